"""The persistent decode kernel (K4_MEGAKERNEL, kernels_cu/megakernel.cu) against the graph of one
kernel per op: llama.cpp's greedy tokens of stories260K (Q4_K_M), and decode logits step by step
on tiny models of the shapes it must handle (grouped heads of 64 and 128, NeoX RoPE with q/k norms,
q/k/v biases; Q4_K, Q6_K and Q8_0 weights), past MK_SPLIT_KEYS positions so that the attention's
splits and their merge run too. Limits: tests/cuda_backend_cases.py (decode with 8-bit x)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda.constants import MK_SPLIT_KEYS
from k4.runtime.model import open_model
from k4.runtime.tokenizer import Tokenizer
from tests.cuda_backend_cases import K_CFG, check_q4_k_m_greedy, cuda, decode_limit, rel_l2
from tests.gpu import cupy_or_skip
from tests import tiny
from tests.quant_blocks import blocks_like

cp = cupy_or_skip()
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("unset_backend_flags")]

CASES = {
    "llama-q4_k-gqa64": ("llama", T.Q4_K, dict(n_embd=512, n_ff=768, n_head=8, n_head_kv=2, head_dim=64, rope_dim=64)),
    "qwen3-q6_k-qknorm128": ("qwen3", T.Q6_K, dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=1, head_dim=128, rope_dim=128)),
    "qwen2-q8_0-bias": ("qwen2", T.Q8_0, K_CFG),
}


def backend(mf, n_ctx: int, on: bool, monkeypatch):
    monkeypatch.setenv("K4_MEGAKERNEL", str(int(on)))
    be = cuda(mf, n_ctx)
    assert (be.forward.mega is not None) == on, be.megakernel_off
    return be


def test_q4_k_m_greedy_matches_llama_cpp(data, monkeypatch):
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    tok = Tokenizer.from_model(mf)
    be = backend(mf, 256, True, monkeypatch)
    check_q4_k_m_greedy(data, tok, be)
    # the decode graph replayed: the embedding, the megakernel, 2 sampling kernels (the argmax partials, the finish)
    assert be.trace.get("decode").graph_replays > 0 and be.graph_launches == 4
    be.close()


def step_logits(mf, on: bool, feed: list[int], monkeypatch) -> list[np.ndarray]:
    """The logits of each one-token pass over `feed` after a 4-token prompt."""
    be = backend(mf, 1024, on, monkeypatch)
    be.eval(feed[:4])
    out = [be.eval([t]) for t in feed[4:]]
    be.close()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_decode_logits_match_the_graph(tmp_path, data, monkeypatch, case):
    arch, mtype, over = CASES[case]
    monkeypatch.setattr(tiny, "quantize", blocks_like)  # random blocks of the type (tests/quant_blocks.py)
    cfg = tiny.tiny_config(arch, **{**over, "n_ctx_train": 1024})
    mf = open_model(tiny.write_tiny(tmp_path / f"{case}.gguf", data / "models" / "stories260K.gguf", cfg, mtype, seed=7))
    feed = [int(t) for t in np.random.default_rng(1).integers(0, cfg.n_vocab, MK_SPLIT_KEYS + 60)]
    want, got = (step_logits(mf, on, feed, monkeypatch) for on in (False, True))
    errs = [rel_l2(g, w) for g, w in zip(got, want)]
    assert max(errs) < decode_limit(mf), (case, int(np.argmax(errs)), max(errs))
