"""Speculative decoding on the GPU: the device verify step (runtime/cuda/speculative.py,
kernels_cu/speculative.cu) against the numpy backend's, the cache rollback, graph replays, and
greedy output equal to llama.cpp's goldens with prompt lookup and a draft model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime.backend import make_backend
from k4.runtime.model import open_model
from k4.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cuda
runner = CliRunner()
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"


def _greedy_continuation(mf, cache: list[int], n: int) -> list[int]:
    probe = make_backend(mf, "numpy", 256)
    probe.eval(cache[:-1])
    gen = probe.generate(cache[-1:], SamplingParams(temperature=0.0))
    try:
        return [next(gen) for _ in range(n)]
    finally:
        gen.close()


def verify_product_calls(data, monkeypatch) -> tuple[int, list[list[dict]]]:
    """Verify steps of 3 and MMA8_TOKENS tokens of stories260K-pad (Q4_K) on the GPU, each
    asserted to accept the numpy backend's tokens: (the model's n_layer, per step the keyword
    arguments of every gemv_mma call runtime/cuda/forward.py made: its direct calls, the gate/up
    and residual products that write a q8 output). Set the switches under test before calling."""
    from k4.runtime.cuda import forward
    from k4.runtime.cuda.constants import MMA8_TOKENS

    calls: list[dict] = []
    product = forward.gemv_mma

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        product(*args, **kwargs)

    monkeypatch.setattr(forward, "gemv_mma", recorded)
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    gpu, ref = make_backend(mf, "cuda", 256), make_backend(mf, "numpy", 256)
    for be in (gpu, ref):
        be.eval(PROMPT)
    steps = []
    for n in (3, MMA8_TOKENS):
        before = len(calls)
        batch = _greedy_continuation(mf, ref.tokens, n)
        assert gpu.verify(batch) == ref.verify(batch), (n, batch)
        steps.append(calls[before:])
    return mf.config.n_layer, steps


@pytest.mark.parametrize("model", ["stories260K.gguf", "stories260K-pad-q4_k_m.gguf"])
def test_verify_matches_numpy_and_rolls_back(data, model):
    """Batches of 1..8 tokens: the greedy continuation of the cache with one token replaced at
    a random place (or none), so acceptance runs 0..k; the same n recurs, so each is run
    eagerly, captured, then replayed. Accepted ids and the cache equal the numpy backend's."""
    mf = open_model(data / "models" / model)
    gpu, ref = make_backend(mf, "cuda", 256), make_backend(mf, "numpy", 256)
    for be in (gpu, ref):
        be.eval(PROMPT)
    rng = np.random.default_rng(0)
    accepted = []
    for step in range(20):
        n = 1 + step % 8
        batch = _greedy_continuation(mf, ref.tokens, n)
        if n > 1 and rng.random() < 0.6:
            batch[int(rng.integers(1, n))] = int(rng.integers(3, mf.config.n_vocab))
        expect = ref.verify(batch)
        assert gpu.verify(batch) == expect, (step, batch)
        assert gpu.tokens == ref.tokens
        accepted.append(len(expect) - 1)
    assert min(accepted) == 0 and max(accepted) >= 5
    # the cache left behind is right: plain decoding from it agrees with numpy's
    nxt = _greedy_continuation(mf, ref.tokens, 4)
    assert gpu.verify(nxt) == ref.verify(nxt) == nxt[1:] + [_greedy_continuation(mf, ref.tokens, 1)[0]]


@pytest.mark.parametrize("how", [["--lookup", "2"], ["-md", "stories260K.gguf", "--draft-max", "6"]])
def test_cuda_greedy_speculation_is_the_golden_output(data, how):
    cases = [c for c in json.loads((data / "golden" / "greedy.json").read_text())["cases"] if c["model"] == "stories260K.gguf"]
    how = [str(data / "models" / a) if a.endswith(".gguf") else a for a in how]
    accepted = 0
    for case in cases:
        result = runner.invoke(app, ["run", "--backend", "cuda", "--temp", "0", "--json", "-m", str(data / "models" / case["model"]),
                                     "-n", str(case["n_predict"]), *how, case["prompt"]])
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["text"] == case["completion"], case["prompt"]
        accepted += out["draft_accepted"]
    assert accepted > 0


def test_cuda_sampled_speculation_runs_and_is_seeded(data):
    m = str(data / "models" / "stories260K.gguf")
    outs = []
    for _ in range(2):
        result = runner.invoke(app, ["run", "--backend", "cuda", "--json", "-m", m, "-n", "40", "-s", "7", "--lookup", "2",
                                     "Once upon a time"])
        assert result.exit_code == 0, result.output
        outs.append(json.loads(result.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 40
