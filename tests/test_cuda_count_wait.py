"""K4_COUNT_WAIT on the GPU: a decode step's products, attn_short and sample_finish wait for the
launch before them on its count of blocks done (kernels_cu/chain.cuh, runtime/cuda/chain.py)
instead of on its whole grid. The outputs are computed as before, so generation (CUDA graphs,
programmatic dependent launch: the configuration users run) must give the same tokens and the same
logits bits with the flag on and off; llama.cpp's greedy goldens must hold with it on; the step's
slots must be zero after every step; and the launches must really be linked (count waits, and
grid waits only after a launch the chain does not link)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.gpu import cupy_or_skip

cp = cupy_or_skip()
pytestmark = pytest.mark.cuda

from k4.runtime.cuda import chain as chain_mod
from k4.runtime.cuda import matmul as mm

from tests.cuda_backend_cases import (
    ARCH_CASES,
    GREEDY,
    K_CFG,
    check_q4_k_m_greedy,
    cuda,
    take,
)


def generate_by_flag(monkeypatch, mf, prompt: list[int], n: int, n_ctx: int = 256) -> dict[bool, tuple]:
    """{on: (the n greedy tokens after prompt, the last step's logits, the chain's slots after it, the
    `at` of every linked launch)} with K4_COUNT_WAIT on and off."""
    out, ats, link = {}, [], chain_mod.Chain.link

    def linked(self):
        args = link(self)
        ats.append(int(args[1]))
        return args

    monkeypatch.setattr(chain_mod.Chain, "link", linked)
    for on in (True, False):
        monkeypatch.setenv("K4_COUNT_WAIT", str(int(on)))
        ats.clear()
        be = cuda(mf, n_ctx)
        tokens = take(be.generate(prompt, GREEDY), n)
        be.runner.stream.synchronize()  # the step enqueued ahead (K4_PINGPONG) done before its buffers are read
        act = be.forward.act
        out[on] = (tokens, act.logits[0].get(), act.chain.get(), list(ats))
        be.close()
    return out


def hd64(monkeypatch, name: str, arch: str, ttype: T) -> str:
    """An ARCH_CASES entry of heads of 64 (attn_short's smallest), registered for this test."""
    monkeypatch.setitem(ARCH_CASES, name, (arch, ttype, {**K_CFG, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "rope_dim": 64}))
    return name


@pytest.mark.parametrize("prompt_len,n_ctx", [(21, 64), (300, 512)], ids=["one-split", "merged-splits"])
@pytest.mark.parametrize("handoff", [False, True], ids=["x", "nq-handoff"])
def test_generation_is_the_same_bits_with_count_waits(tiny_model, monkeypatch, prompt_len, n_ctx, handoff):
    """Q4_K llama with heads of 64: every product and attn_short linked, past 256 keys attn_short's
    splits merged by their last block (which counts after its merge); with the residual products'
    NQ handoff forced or not."""
    if handoff:
        monkeypatch.setattr(mm, "nq_balanced", lambda *a: True)
    mf = tiny_model(hd64(monkeypatch, "llama-q4_k-hd64", "llama", T.Q4_K))
    prompt = np.random.default_rng(11).integers(3, mf.config.n_vocab, size=prompt_len).tolist()
    got = generate_by_flag(monkeypatch, mf, prompt, 12, n_ctx)
    (tok_on, logits_on, slots_on, ats_on), (tok_off, logits_off, _, ats_off) = got[True], got[False]
    assert tok_on == tok_off and np.array_equal(logits_on.view(np.uint32), logits_off.view(np.uint32))
    assert not slots_on.any(), "sample_finish leaves the step's slots zero"
    assert not ats_off
    per_step = 5 * mf.config.n_layer + 1  # q/k/v, attention, output, gate/up, down a layer, then the head
    assert len(ats_on) >= per_step
    first = ats_on[:per_step]
    assert chain_mod.waits_for_grid(first[0]) and [chain_mod.slot_of(a) for a in first] == list(range(per_step))
    assert not any(chain_mod.waits_for_grid(a) for a in first[1:]), "every launch after the first waits on a count"


# (case, whether its decode step has a launch the chain does not link: attention on attn_kv, heads of 16 or 32)
OTHER_CASES = [("qwen2-q8_0-hd64", None), ("llama-q6_k-tied", True), ("qwen2-q8_0-bias", True), ("qwen3moe-q4_k", True),
               ("qwen3moe-q6_k", True)]


@pytest.mark.parametrize("case,breaks", OTHER_CASES)
def test_unlinked_launches_break_the_chain_and_the_bits_hold(tiny_model, monkeypatch, case, breaks):
    """Attention of heads other than attn_short's (attn_kv), grouped-query attention (qwen2-q8_0-hd64's 4
    query heads a KV head) and the products of other types: the launches the chain does not link make the next linked one wait
    for the grid; the same tokens and logits bits as without the flag. The qwen3moe cases: moe_one
    (every block waiting for every other inside it) linked between the output product and the next
    q/k/v product."""
    mf = tiny_model(case)
    prompt = np.random.default_rng(12).integers(3, mf.config.n_vocab, size=30).tolist()
    got = generate_by_flag(monkeypatch, mf, prompt, 10)
    (tok_on, logits_on, slots_on, ats_on), (tok_off, logits_off, _, _) = got[True], got[False]
    assert tok_on == tok_off and np.array_equal(logits_on.view(np.uint32), logits_off.view(np.uint32))
    assert not slots_on.any()
    assert ats_on
    if breaks is not None:
        assert any(chain_mod.waits_for_grid(a) for a in ats_on[1:]) == breaks


def test_llama_cpp_greedy_goldens_hold_with_count_waits(data, tok_q4, monkeypatch):
    """stories260K Q4_K_M (llama.cpp's greedy completions): its q|k and Q6_K v products as one paired
    launch, linked."""
    monkeypatch.setenv("K4_COUNT_WAIT", "1")
    mf, tok = tok_q4
    be = cuda(mf, 256)
    try:
        check_q4_k_m_greedy(data, tok, be)
        be.runner.stream.synchronize()
        assert not be.forward.act.chain.get().any()
    finally:
        be.close()


@pytest.fixture
def tok_q4(data):
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer

    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    return mf, Tokenizer.from_model(mf)
