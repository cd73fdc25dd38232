"""The CUDA backend end to end: llama.cpp's golden outputs on the stories260K models, logits
against the numpy backend on every architecture and tensor type, and the load (progress, memory
report, the up-front memory check). The decode loop's behaviour: test_cuda_runner.py; the
optimization switches: test_cuda_switches.py; limits and cases: tests/cuda_backend_cases.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k4.runtime.errors import BackendUnavailableError
from k4.runtime.model import open_model
from k4.runtime.perplexity import perplexity
from k4.runtime.reference import NumpyBackend
from k4.runtime.tokenizer import Tokenizer
from tests.cuda_backend_cases import (ARCH_CASES, GREEDY, LIMIT_DECODE_FLOAT, check_q4_k_m_greedy, continuation, cuda, decode_limit,
                                      greedy_cases, prefill_errors, rel_l2, take)
from tests.gpu import cupy_or_skip

cp = cupy_or_skip()
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("unset_backend_flags")]


def test_f32_greedy_matches_llama_cpp_exactly(data, stories):
    _, tok, be = stories
    cases = greedy_cases(data, "stories260K.gguf")
    assert len(cases) >= 4
    for case in cases:
        be.reset()
        ids = tok.encode(case["prompt"])
        out = take(be.generate(ids, GREEDY), case["n_predict"])
        assert continuation(tok, ids, out) == case["completion"], case["prompt"]


def test_q4_k_m_greedy_first_16_tokens(data, stories_q4):
    _, tok, be = stories_q4
    check_q4_k_m_greedy(data, tok, be)


def running_ppl(be, tok: Tokenizer, text: str, n_ctx: int) -> list[float]:
    bos = tok.bos_id if tok.add_bos else None
    return [r.ppl for r in perplexity(be, tok.encode(text), n_ctx, bos)]


def test_f32_perplexity_matches_llama_cpp(data, stories):
    _, tok, be = stories
    for case in json.loads((data / "golden" / "perplexity.json").read_text())["cases"]:
        assert case["model"] == "stories260K.gguf"
        ours = running_ppl(be, tok, (data / "golden" / case["text_file"]).read_text(), case["n_ctx"])
        assert ours == pytest.approx(case["chunks"], rel=5e-4)


def test_q4_k_m_perplexity_matches_numpy(data, stories_q4):
    mf, tok, be = stories_q4
    text = (data / "golden" / "story.txt").read_text()
    ours = running_ppl(be, tok, text, 128)
    theirs = running_ppl(NumpyBackend(mf, 128), tok, text, 128)
    assert ours == pytest.approx(theirs, rel=5e-3)


# ---- every architecture and tensor type against the numpy backend ------------------------------


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_logits_match_numpy_backend(tiny_model, case):
    mf = tiny_model(case)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, mf.config.n_vocab, size=21).tolist()
    be, ref = cuda(mf, 64), NumpyBackend(mf, 64)
    bad = prefill_errors(mf, be.eval(prompt, all_logits=True), ref.eval(prompt, all_logits=True))
    assert not bad, f"prefill errors {bad}"
    err = rel_l2(be.eval([5]), ref.eval([5]))
    assert err < decode_limit(mf), f"decode {err:.2e}"
    # the captured decode step: each greedy pick is the numpy argmax or within a near-tie of it
    be.reset()
    ref.reset()
    gen = be.generate(prompt, GREEDY)
    logits = ref.eval(prompt)
    for _ in range(4):
        t = next(gen)
        assert logits[t] >= logits.max() - 1e-2 * np.abs(logits).max()
        logits = ref.eval([t])
    gen.close()


def test_long_context_split_attention_matches_numpy(data):
    mf = open_model(data / "models" / "stories260K.gguf")
    prompt = np.random.default_rng(5).integers(3, mf.config.n_vocab, size=700).tolist()
    be, ref = cuda(mf, 2048), NumpyBackend(mf, 2048)
    assert be.n_split > 1
    be.eval(prompt)
    ref.eval(prompt)
    assert rel_l2(be.eval([42]), ref.eval([42])) < LIMIT_DECODE_FLOAT


# ---- loading ------------------------------------------------------------------------------------

def test_load_progress_and_memory_report(data):
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    calls = []
    be = cuda(mf, 100, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] and all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    cfg = mf.config
    report = be.memory_report()
    assert report["kv_cache"] == 2 * cfg.n_layer * 100 * cfg.kv_dim * 2
    assert report["weights"] >= sum(t.n_bytes for t in mf.tensors.values() if len(t.shape) == 2)
    load = be.trace.get("load")
    assert load.h2d_bytes >= sum(t.n_bytes for t in mf.tensors.values() if len(t.shape) == 2) and load.allocs > 0
    assert not hasattr(be, "load_tmp")  # the file bytes awaiting their device layout are freed after the load
    assert be.load_detail_ms["file read (summed over reader threads)"] > 0
    assert be.load_detail_ms["copy stream busy (CUDA events)"] > 0


def test_model_that_does_not_fit_is_refused_with_sizes(data, monkeypatch):
    from k4.runtime.cuda import memory

    mf = open_model(data / "models" / "stories260K.gguf")
    monkeypatch.setattr(memory, "free_bytes", lambda: memory.RESERVED_BYTES + 64 * memory.MiB)  # buffers ~40 MiB fit
    with pytest.raises(BackendUnavailableError, match=r"KV cache for --ctx-size 200000 .* use --ctx-size \d+ or less"):
        cuda(mf, 200000)
    monkeypatch.setattr(memory, "free_bytes", lambda: memory.RESERVED_BYTES // 2)
    with pytest.raises(BackendUnavailableError, match="the model needs .* GiB of GPU memory"):
        cuda(mf, 64)
