"""The context k4 picks (-c 0 and no -c: runtime.backend.fit_context) and the chat context meter."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime import hostmem
from k4.runtime.backend import CTX_STEP, fit_context, make_backend
from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend, max_context
from tiny import tiny_config, write_tiny

METER = re.compile(r"\[ prompt ([\d,]+) tok [\d,-]+ t/s \| reply ([\d,]+) tok [\d,.-]+ t/s \| context ([\d,]+) / ([\d,]+) \]")


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, data):
    return open_model(write_tiny(tmp_path_factory.mktemp("ctx") / "long.gguf", data / "models" / "stories260K.gguf",
                                 tiny_config(n_ctx_train=32768)))


def test_numpy_max_context_matches_what_the_backend_accepts(long_model):
    """max_context's answer loads; one token more is refused by the backend's own check."""
    _, left, per_token = max_context(long_model, mem_available=2**30)
    assert per_token == 2 * 4 * 2 * 2 * 16  # float32 keys and values, 2 layers x 2 KV heads x 16
    avail = 2**30 - left + 5000 * per_token
    n, _, _ = max_context(long_model, mem_available=avail)
    assert n == 5000
    NumpyBackend(long_model, n, mem_available=avail)
    with pytest.raises(Exception, match="KV cache"):
        NumpyBackend(long_model, n + 1, mem_available=avail)


@pytest.mark.parametrize("room, want", [(40000, 32768), (32768, 32768), (5000, 4864), (300, 256), (10, CTX_STEP)])
def test_fit_context_takes_the_training_context_or_the_largest_multiple_of_256(long_model, monkeypatch, room, want):
    _, left, per_token = max_context(long_model, mem_available=2**30)
    monkeypatch.setattr(hostmem, "available_ram", lambda *a, **k: 2**30 - left + room * per_token)
    n_ctx, note = fit_context(long_model, "numpy")
    assert n_ctx == want
    assert (note is None) == (want == 32768 or room < CTX_STEP)  # too little room: the backend's own error says it
    if note is not None:
        assert note.startswith(f"context {want:,} tokens instead of the model's 32,768: its KV cache would need 16 MiB")
        assert "\n" not in note
    if room >= CTX_STEP:  # make_backend(n_ctx=0) takes the same answer and says it through status
        said = []
        assert make_backend(long_model, "numpy", 0, status=said.append).n_ctx == want
        assert said == ([] if note is None else [note])


@pytest.mark.parametrize("room", [200, 10])  # more tokens than the training context fit; fewer than CTX_STEP
def test_fit_context_never_passes_a_short_training_context(tmp_path, data, monkeypatch, room):
    """A model trained on fewer than CTX_STEP tokens keeps its own context, also when memory is short."""
    short = open_model(write_tiny(tmp_path / "short.gguf", data / "models" / "stories260K.gguf", tiny_config(n_ctx_train=128)))
    _, left, per_token = max_context(short, mem_available=2**30)
    monkeypatch.setattr(hostmem, "available_ram", lambda *a, **k: 2**30 - left + room * per_token)
    assert max_context(short)[0] == room
    assert fit_context(short, "numpy") == (128, None)


def test_chat_stats_line_has_a_context_meter():
    r = CliRunner().invoke(app, ["chat", "--backend", "numpy", "--temp", "0", "-n", "3"], input="Hi\nTell me more\n")
    assert r.exit_code == 0, r.output
    meters = [tuple(int(g.replace(",", "")) for g in m.groups()) for m in METER.finditer(r.stderr)]
    assert len(meters) == 2
    (p1, r1, used1, total1), (p2, r2, used2, total2) = meters
    assert total1 == total2 == 512  # the sample model's training context
    assert p1 <= used1 <= p1 + r1  # the cache holds the prompt and the reply (but its last token)
    assert used1 < used2 <= used1 + 1 + p2 + r2


@pytest.mark.cuda
def test_gpu_fit_loads_and_one_step_more_is_refused(long_model, monkeypatch):
    """runtime/cuda/sizing.py against CudaBackend's own memory check, with the free GPU memory
    set to the weights and buffers plus 1,000 tokens of KV cache."""
    from k4.runtime.cuda import memory, sizing
    from k4.runtime.cuda.backend import CudaBackend
    from k4.runtime.errors import BackendUnavailableError
    from k4.runtime.flags import Flags

    fixed = sizing.fixed_bytes(long_model, Flags())
    per_token = sizing.max_context(long_model, Flags(), free=fixed)[2]
    assert per_token == 2 * 2 * 2 * 2 * 16  # fp16 keys and values, 2 layers x 2 KV heads x 16
    monkeypatch.setattr(memory, "free_bytes", lambda: fixed + 1000 * per_token)
    n_ctx, note = fit_context(long_model, "cuda")
    assert n_ctx == 768 and note.startswith("context 768 tokens instead of the model's 32,768")
    be = CudaBackend(long_model, n_ctx)
    try:
        assert be.eval([1, 2, 3]).shape == (512,)
    finally:
        be.close()
    with pytest.raises(BackendUnavailableError, match="KV cache"):  # the buffers at 4,096 are smaller than at
        CudaBackend(long_model, 4096)  # 32,768 (token ids: 112 KiB), far from the 768 KiB more the cache takes


def _ctx_of(command: list[str], path, monkeypatch, room: int, text_file=None) -> tuple[int, str]:
    """(n_ctx, stderr) of `k4 <command>` on the numpy backend with RAM for `room` tokens of KV cache."""
    import json

    mf = open_model(path)
    _, left, per_token = max_context(mf, mem_available=2**30)
    monkeypatch.setattr(hostmem, "available_ram", lambda *a, **k: 2**30 - left + room * per_token)
    args = [command[0], "--backend", "numpy", "-m", str(path), *command[1:]]
    if command[0] == "run":
        args += ["--json", "-n", "1", "Once"]
    elif command[0] == "perplexity":
        args += ["--json", "-f", str(text_file)]
    elif command[0] == "bench":
        args += ["-o", "json", "-r", "1", "-p", "8", "-n", "4"]
    r = CliRunner().invoke(app, args, input="Hi\n")
    assert r.exit_code == 0, r.output
    if command[0] == "chat":
        return int(METER.search(r.stderr).group(4).replace(",", "")), r.stderr
    rec = json.loads(r.stdout)
    return (rec[0] if command[0] == "bench" else rec)["n_ctx"], r.stderr


@pytest.mark.parametrize("command", [["run"], ["run", "-c", "0"], ["chat", "-n", "2"], ["chat", "-c", "0", "-n", "2"],
                                     ["perplexity", "-c", "0"]])
def test_ctx_zero_is_the_same_fit_in_run_chat_and_perplexity(long_model, monkeypatch, tmp_path, command):
    """Room for 300 tokens of KV cache: the 32,768-token training context does not fit, so each
    command takes fit_context's 256 and prints its note (perplexity: chunks of 256)."""
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time there was a little girl named Lily. She liked to play in the park. " * 40)
    n_ctx, stderr = _ctx_of(command, long_model.path, monkeypatch, 300, text)
    assert n_ctx == 256
    assert "context 256 tokens instead of the model's 32,768" in stderr


def test_bench_ctx_zero_is_what_the_tests_need(long_model, monkeypatch):
    """bench -c 0 sizes the cache as llama-bench does (the longest test: 8 + 4 tokens, at least
    16), not the training context, and prints no fit note; an explicit -c is taken as given."""
    n_ctx, stderr = _ctx_of(["bench", "-c", "0"], long_model.path, monkeypatch, 300)
    assert n_ctx == 16 and "instead of" not in stderr
    assert _ctx_of(["bench", "-c", "200"], long_model.path, monkeypatch, 300)[0] == 200
