"""Hardening on the CPU: CUDA errors become one-line GpuErrors naming the kernel and the phase
(runtime/cuda/launch.py, driven with fake kernels, streams and graphs), the CLI's exit code for
them, the same tokens from the same seed in two processes (numpy), and the long-run measurements
of tests/soak.py on the numpy backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer

from k4.cli.common import SAMPLE_MODEL
from k4.cli.render import errors_to_exit
from k4.runtime.backend import make_backend
from k4.runtime.chat import ChatSession
from k4.runtime.chat_template import ChatTemplate
from k4.runtime.cuda import launch as launching
from k4.runtime.errors import GpuError, K4Error, UsageError
from k4.runtime.model import open_model
from k4.runtime.sampling import SamplingParams
from k4.runtime.tokenizer import Tokenizer
from k4.runtime.trace import Trace
from tests.soak import MEMORY_KEYS, soak_chat, soak_decode

MiB = 1 << 20
RMS_NORM_SYMBOL = "_Z8rms_normIfEvPKfS1_PT_if"  # what NVRTC names rms_norm<float> (kernels_cu/norm.cu)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)


class FakeCudaError(Exception):
    """Stands for cupy's CUDARuntimeError in these tests."""


class FakeKernel:
    num_regs = 32  # what launch reads of a cupy Function before launching (blocks_per_sm, the carveout)
    preferred_shared_memory_carveout = -1

    def __init__(self, name: str, error: str | None = None):
        self.name, self.error, self.calls = name, error, 0

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls += 1
        if self.error:
            raise FakeCudaError(self.error)


class FakeStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeGraph:
    def launch(self, stream=None):
        raise FakeCudaError("cudaErrorLaunchFailure:\nunspecified launch failure")


@pytest.fixture(autouse=True)
def fake_cuda_errors(monkeypatch):
    monkeypatch.setattr(launching, "cuda_error_types", lambda: (FakeCudaError,))
    monkeypatch.setattr(launching, "_last", launching._LastLaunch())


def test_kernel_names_are_demangled():
    assert launching.kernel_name(FakeKernel(RMS_NORM_SYMBOL)) == "rms_norm<float>"
    assert launching.kernel_name(FakeKernel("set_i32")) == "set_i32"
    assert launching.kernel_name(FakeKernel("_Znot_a_symbol")) == "_Znot_a_symbol"


def test_refused_launch_names_the_kernel_the_configuration_and_the_phase():
    trace = Trace()
    kernel = FakeKernel(RMS_NORM_SYMBOL, "cudaErrorInvalidConfiguration: invalid configuration argument")
    with trace.in_phase("decode"), pytest.raises(GpuError) as info:
        launching.launch(kernel, (1,), (2048,), (), 64, FakeStream(), trace)
    message = str(info.value)
    assert message.startswith("CUDA refused to launch kernel rms_norm<float> (grid (1,), block (2048,), 64 bytes shared) during decode: ")
    assert "cudaErrorInvalidConfiguration" in message and "--backend numpy" in message and "\n" not in message
    assert info.value.exit_code == 3 and kernel.calls == 1
    assert trace.get("decode").launches == 0  # a refused launch is not counted


def test_error_at_a_later_sync_names_the_phase_and_the_last_kernel():
    trace = Trace()
    with pytest.raises(GpuError) as info, trace.in_phase("prefill"), launching.GpuErrors(trace):
        launching.launch(FakeKernel(RMS_NORM_SYMBOL), (4,), (256,), (), 0, FakeStream(), trace)
        raise FakeCudaError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    message = str(info.value)
    assert message.startswith("CUDA error during prefill, after kernel rms_norm<float> was launched: cudaErrorIllegalAddress")
    assert trace.get("prefill").launches == 1 and launching.last_launched() == "kernel rms_norm<float>"


def test_error_before_any_launch_and_graph_replays_are_named():
    trace = Trace()
    with (pytest.raises(GpuError, match="during load, before any kernel was launched: cudaErrorNoDevice"),
          trace.in_phase("load"), launching.GpuErrors(trace)):
        raise FakeCudaError("cudaErrorNoDevice: no CUDA-capable device is detected")
    with (trace.in_phase("decode"),
          pytest.raises(GpuError, match=r"replay the decode graph during decode: cudaErrorLaunchFailure: unspecified launch failure;")):
        launching.launch_graph(FakeGraph(), FakeStream(), trace, 125)
    assert launching.last_launched() == "the decode graph (125 kernels)"
    assert trace.get("decode").graph_replays == 0


@pytest.mark.parametrize("error", [KeyboardInterrupt(), UsageError("bad option"), ValueError("a bug")])
def test_other_exceptions_pass_through_the_guard_unchanged(error):
    trace = Trace()
    with pytest.raises(type(error)) as info, trace.in_phase("decode"), launching.GpuErrors(trace):
        raise error
    assert info.value is error


def test_cli_exits_3_with_one_line_for_a_gpu_error(capsys):
    @errors_to_exit
    def command():
        raise GpuError("CUDA error during decode, after kernel attn_f16kv was launched: cudaErrorIllegalAddress; run again")

    with pytest.raises(typer.Exit) as info:
        command()
    assert info.value.exit_code == 3
    err = capsys.readouterr().err
    assert "error: CUDA error during decode, after kernel attn_f16kv" in err and "Traceback" not in err
    assert issubclass(GpuError, K4Error)


def run_json(model, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "k4.cli", "run", "-m", str(model), "--json", *args],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_same_seed_same_tokens_in_two_processes_numpy(data):
    model = data / "models" / "stories260K.gguf"
    args = ("--backend", "numpy", "--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "-n", "64", "Once upon a time")
    first = run_json(model, "--seed", "1234", *args)
    second = run_json(model, "--seed", "1234", *args)
    other = run_json(model, "--seed", "4321", *args)
    assert len(first["token_ids"]) >= 16
    assert first["token_ids"] == second["token_ids"] and first["text"] == second["text"]
    assert other["token_ids"] != first["token_ids"]


def test_soak_decode_on_numpy_measures_windows_and_memory(data):
    mf = open_model(data / "models" / "stories260K.gguf")
    tok = Tokenizer.from_model(mf)
    be = make_backend(mf, "numpy", 512)
    prompt = tok.encode("Once upon a time")
    r = soak_decode(be, prompt, SAMPLED, n_windows=4, window=100)
    assert r["tokens"] == 401 and r["depth"] == len(prompt) + 400 and len(r["window_tps"]) == 4
    assert all(t > 0 for t in r["window_tps"]) and r["same_tokens"] is None
    assert r["growth"]["host_rss"] < 16 * MiB and r["growth"]["pool_used"] is None
    fixed = soak_decode(be, prompt, SAMPLED, n_windows=3, window=100, fixed_depth=True)
    assert fixed["same_tokens"] is True and fixed["tokens"] == 303 and fixed["depth"] == len(prompt) + 100
    with pytest.raises(ValueError, match=f"needs {len(prompt) + 601} positions"):
        soak_decode(be, prompt, SAMPLED, n_windows=6, window=100)


def test_soak_chat_on_numpy_reuses_the_cache_and_drops_turns():
    mf = open_model(SAMPLE_MODEL)
    tok = Tokenizer.from_model(mf)
    session = ChatSession(make_backend(mf, "numpy", 512), tok, ChatTemplate.from_model(mf, tok), SAMPLED, n_predict=32)
    r = soak_chat(session, 12)
    assert r["turns"] == 12 and len(r["prompt_tokens"]) == len(r["prefill_tokens"]) == len(r["reply_tokens"]) == 12
    assert r["dropped_turns"] > 0
    assert r["prefill_tokens"][1] < r["prompt_tokens"][1]  # the second turn reuses the first's cache
    assert set(r["start"]) == set(MEMORY_KEYS) and r["growth"]["host_rss"] < 16 * MiB
    assert r["first_tps"] > 0 and r["last_tps"] > 0
