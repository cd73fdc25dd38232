"""The optimization switches (K4_* flags) of the CUDA backend: all off gives the same tokens; each
alone keeps llama.cpp's greedy tokens and the numpy backend's logits, and (the fusions) the
kernel count of a decode step; the 8-bit handoff changes no bit of the logits. Limits and cases:
tests/cuda_backend_cases.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend
from k4.runtime.tokenizer import Tokenizer
from tests.cuda_backend_cases import (ALL_FLAGS, FUSIONS, GREEDY, LIMIT_PREFILL, continuation, cuda, decode_by_flag, decode_limit,
                                      greedy_cases, rel_l2, sampling_kernels, take)
from tests.gpu import cupy_or_skip

cp = cupy_or_skip()
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("unset_backend_flags")]


def test_every_flag_off_gives_the_same_tokens(stories, monkeypatch):
    mf, tok, be = stories
    prompt = tok.encode("The little dog")
    be.reset()
    want = take(be.generate(prompt, GREEDY), 30)
    for name in ALL_FLAGS:
        monkeypatch.setenv(name, "0")
    off = cuda(mf, 256)
    assert off.graph is None and off.n_split == 1
    assert take(off.generate(prompt, GREEDY), 30) == want
    d = off.trace.get("decode")
    assert d.syncs == d.steps and d.graph_replays == 0 and d.h2d_bytes == 0


# ---- each fusion switched off --------------------------------------------------------------------

def step_kernels(mf, flag: str | None) -> int:
    """Kernels of one decode step with `flag` off: per layer the q/k/v products (one per run of
    one type when stacked, one for two runs of a paired type), attention (with RoPE and the cache store, its splits merged in the
    kernel), output, gate/up with SwiGLU, down; then the embedding, lm_head (the final norm
    folded into both), and the sampling kernels (sampling_kernels). Each switch off adds its kernels."""
    from k4.runtime.cuda.gemv_choice import QKV_PAIRS
    from k4.runtime.cuda.weights import runs_of_one_type

    n = mf.config.n_layer

    def launches(i: int) -> int:  # two runs of a QKV_PAIRS pair are one launch (K4_QKV_PAIR)
        types = [mf.tensor(f"blk.{i}.attn_{p}.weight").ggml_type for p in "qkv"]
        runs = runs_of_one_type(types, flag != "K4_STACK")
        pair = flag not in ("K4_QKV_PAIR", "K4_STACK") and len(runs) == 2 and tuple(types[r[0]] for r in runs) in QKV_PAIRS
        return 1 if pair else len(runs)

    qkv = sum(launches(i) for i in range(n))
    extra = {"K4_FUSE_SWIGLU": n, "K4_FUSE_ROPE": n, "K4_FUSE_NORM": 2 * n + 1}.get(flag, 0)
    return qkv + 4 * n + 2 + sampling_kernels(mf, flag != "K4_HEAD_ARGMAX") + extra


SWITCHES = [None, *(f"{name}=0" for name in ALL_FLAGS), "K4_FUSE_QUANT=1"]  # default, each off alone, the default-off one on


def family_cases(data) -> list[dict]:
    """llama.cpp's greedy completions for stories260K as qwen2 and as llama + rope_freqs."""
    return json.loads((data / "golden" / "families.json").read_text())["cases"]


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_switch_keeps_golden_tokens_and_numpy_logits(data, tiny_model, monkeypatch, switch):
    """Every K4_* switch alone: llama.cpp's greedy tokens on the Q4_K_M model and on the qwen2
    and rope_freqs family models, numpy's logits on tiny models of each family, and (for the
    fusions) the kernel count of a decode step."""
    flag = None
    if switch:
        flag, value = switch.split("=")
        monkeypatch.setenv(flag, value)
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    tok, be = Tokenizer.from_model(mf), cuda(mf, 256)
    if flag in (None, "K4_HEAD_ARGMAX") or (flag in FUSIONS and flag != "K4_PREFILL_F16_CACHE"):
        assert be.graph_launches == step_kernels(mf, flag)
    assert (be.memory_report()["prefill_f16"] > 0) == (flag not in ("K4_PREFILL_F16_CACHE", "K4_PREFILL_TC"))
    for case in greedy_cases(data, "stories260K-pad-q4_k_m.gguf"):
        be.reset()
        ids = tok.encode(case["prompt"])
        out = take(be.generate(ids, GREEDY), 16)
        assert case["completion"].startswith(continuation(tok, ids, out)), case["prompt"]
    be.close()
    for family in family_cases(data):
        fm = open_model(data / "golden" / "families" / family["model"])
        ftok, fbe = Tokenizer.from_model(fm), cuda(fm, 256)
        for case in family["greedy"]:
            ids = ftok.encode(case["prompt"])
            fbe.reset()
            out = take(fbe.generate(ids, GREEDY), 24)
            assert case["completion"].startswith(continuation(ftok, ids, out)), (family["model"], case["prompt"])
        fbe.close()
    for case in ("qwen2-q8_0-bias", "qwen3-q5_k", "llama-f16-tied", "qwen2-q8_0-hd64", "llama-f32-rope-freqs"):
        small = tiny_model(case)
        prompt = np.random.default_rng(4).integers(3, small.config.n_vocab, size=19).tolist()
        got, ref = cuda(small, 64), NumpyBackend(small, 64)
        # without tensor cores, prefill multiplies each token as decode does (8-bit activations)
        prefill_limit = decode_limit(small) if flag == "K4_PREFILL_TC" else LIMIT_PREFILL
        assert rel_l2(got.eval(prompt, all_logits=True), ref.eval(prompt, all_logits=True)) < prefill_limit, case
        assert rel_l2(got.eval([7]), ref.eval([7])) < decode_limit(small), case
        got.close()


# The 8-bit handoffs between decode products: (flag, what the backend holds with it on or off)
HANDOFFS = {
    # K4_FUSE_QUANT: the down product copies the SwiGLU output the gate/up epilogue quantized
    # instead of quantizing it in every block
    "K4_FUSE_QUANT": lambda be, on: all((L.ff_q8 is not None) == on for L in be.layers),
    # K4_QKV_Q8: in the layers whose q|k and v are runs of two types (Q4_K_M: Q4_K and Q6_K), the
    # v product copies the x the q|k product normalized and quantized (another swizzle), where it
    # does not fold the norm's scale into its outputs (q8_handoff.folds_norm; here it does, so the
    # flag must change nothing: test_cuda_q8_handoff checks the handoff's bits with a post-norm);
    # measured with K4_QKV_PAIR off, which launches both runs as one product
    "K4_QKV_Q8": lambda be, on: any(len(L.qkv) > 1 for L in be.layers),
    # K4_QKV_PAIR: those two runs in one launch (gemv_q8_pair)
    "K4_QKV_PAIR": lambda be, on: any(len(L.qkv) == 2 and paired(L.qkv[0].w, L.qkv[1].w) for L in be.layers),
}


@pytest.mark.parametrize("gqa", [True, False])
def test_attention_q8_handoff_changes_no_bit_of_the_decode_logits(tiny_model, monkeypatch, gqa):
    """K4_ATTN_Q8: the output product copies the bytes the attention kernel quantized instead of
    quantizing the attention output itself, so the decode logits are the same with it on and
    off. gqa: every decode range on attn_gqa (GQA_MIN_LIMIT 0, K4_SHORT_ATTN off), else on
    attn_short (the 128 positions of this context, head_dim 64); the positions past the first split."""
    from k4.runtime.cuda import attention_launch, ops

    if gqa:
        monkeypatch.setattr(attention_launch, "GQA_MIN_LIMIT", 0)
        monkeypatch.setattr(ops, "GQA_MIN_LIMIT", 0)
        monkeypatch.setenv("K4_SHORT_ATTN", "0")
    mf = tiny_model("qwen2-q8_0-hd64")  # 4 query heads per KV head, head_dim 64, Q8_0 output product
    cfg = mf.config
    prompt = np.random.default_rng(5).integers(3, cfg.n_vocab, size=100).tolist()
    logits = {}
    for on in (True, False):
        monkeypatch.setenv("K4_ATTN_Q8", str(int(on)))
        be = cuda(mf, 128)
        f = be.forward
        limit, n_split, _ = f.splits[-1]
        assert n_split > 1 or not gqa
        assert (f.hand.attn_q8(f.w.layers[0].wo, 1, n_split, limit) is not None) == on
        be.eval(prompt)
        logits[on] = [be.eval([t]) for t in (7, 8, 9)]
        be.close()
    assert all(np.array_equal(a, b) for a, b in zip(logits[True], logits[False]))


def paired(w1, w2) -> bool:
    from k4.runtime.cuda.gemv_pair import pairs

    return pairs(w1, w2)


@pytest.mark.parametrize("flag", list(HANDOFFS))
def test_q8_handoffs_change_no_bit_of_the_decode_logits(data, monkeypatch, flag):
    """Each handoff copies the bytes the receiving product would compute itself, so the decode
    logits are the same with the flag on and off."""
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    prompt = Tokenizer.from_model(mf).encode("Once upon a time")
    logits = {}
    if flag == "K4_QKV_Q8":
        monkeypatch.setenv("K4_QKV_PAIR", "0")
    for on in (True, False):
        monkeypatch.setenv(flag, str(int(on)))
        be = cuda(mf, 64)
        assert HANDOFFS[flag](be, on)
        be.eval(prompt)
        logits[on] = [be.eval([t]) for t in (7, 8, 9)]
        be.close()
    assert all(np.array_equal(a, b) for a, b in zip(logits[True], logits[False]))


def counted_launches(monkeypatch, handoff: bool, count) -> list:
    """matmul.gemv patched to append count(its keyword arguments) for each launch; the list.
    handoff: the NQ handoff forced (nq_balanced: the tiny models are too small for it)."""
    from k4.runtime.cuda import matmul as mm

    if handoff:
        monkeypatch.setattr(mm, "nq_balanced", lambda *a: True)
    calls, gemv = [], mm.gemv

    def counted(*a, **k):
        calls.append(count(k))
        return gemv(*a, **k)

    monkeypatch.setattr(mm, "gemv", counted)
    return calls


@pytest.mark.parametrize("handoff", [False, True])
def test_the_wide_qkv_product_keeps_the_decode_logits(tiny_model, monkeypatch, handoff):
    """K4_QKV_WIDE: the q/k/v product in QKV_VARIANT's 20 warps, here forced onto a tiny Q4_K llama
    model (qkv_variant chooses it only for a few rounds of rows on the whole GPU), runs the
    default's row loop: the decode logits with the flag on and off agree within 1e-3 (the RMSNorm's
    sum of squares folded in meets over 20 warps instead of 16, in layer 0 and every layer without
    the handoff, so its scale may differ in the last bits and move an 8-bit rounding downstream; the
    handoff's readers give the same bits: test_cuda_norm_q8; a wrong row errs by far more). The
    variant runs only when on, reading the down product's handoff where it is forced (nq_balanced)."""
    from k4.runtime.cuda import forward as fw
    from k4.runtime.cuda import gemv_choice as gc

    monkeypatch.setattr(fw, "qkv_variant", lambda t, n_out, n_sm: gc.QKV_VARIANT.get(t))
    wide = gc.QKV_VARIANT[gc.T.Q4_K]
    # a launch of the wide variant (reading the handoff where forced)
    calls = counted_launches(monkeypatch, handoff, lambda k: k.get("variant") == wide and (
        not handoff or (k.get("x_q8") is not None and k["x_q8"].parts is not None)))
    small = tiny_model("llama-q4_k")
    prompt = np.random.default_rng(5).integers(3, small.config.n_vocab, size=17).tolist()
    # with the handoff, layer 0's q/k/v still normalizes the embedding itself
    logits = decode_by_flag(monkeypatch, small, "K4_QKV_WIDE", prompt, (7, 8, 9), calls,
                            lambda on, calls: sum(calls) >= (small.config.n_layer - handoff) if on else not any(calls))
    assert all(rel_l2(a, b) < 1e-3 for a, b in zip(logits[True], logits[False]))


@pytest.mark.parametrize("handoff", [False, True])
def test_the_wide_output_product_changes_no_bit_of_the_decode_logits(tiny_model, monkeypatch, handoff):
    """K4_WO_WIDE: the output product in after_attention_variant's (32, 2, 0), here forced onto a tiny
    Q4_K llama model (the input bound at 0), sums its rows in the default's order: the decode logits
    are the same bits with the flag on and off, and the variant runs only when on. With the handoff
    forced (nq_balanced: the model is too small for it) the variant's NQ instance runs, its blocks
    the default's groups, so the reader's scale is the same bits too."""
    from k4.runtime.cuda import gemv_choice as gc

    monkeypatch.setattr(gc, "AFTER_ATTENTION_MIN_IN", 0)
    wide = gc.ROW_BLOCKS_VARIANT[gc.T.Q4_K]
    # a launch of the wide variant (with its handoff where forced)
    calls = counted_launches(monkeypatch, handoff, lambda k: k.get("variant") == wide and (not handoff or k.get("norm_out") is not None))
    small = tiny_model("llama-q4_k")
    prompt = np.random.default_rng(5).integers(3, small.config.n_vocab, size=17).tolist()
    logits = decode_by_flag(monkeypatch, small, "K4_WO_WIDE", prompt, (7, 8, 9), calls,
                            lambda on, calls: sum(calls) >= small.config.n_layer if on else not any(calls))
    assert all(np.array_equal(a, b) for a, b in zip(logits[True], logits[False]))
