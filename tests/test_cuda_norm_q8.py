"""Decode's handoff of an RMSNorm's input (K4_NORM_Q8; gemv.cu gemv_q8 NQ, runtime/cuda/forward.py
residual and normed): the residual product writes y as before, y * norm_w quantized (q8x_host's
bytes) and its blocks' sums of y^2; the products after the norm (gemv_q8 of any 16-warp instance,
gate/up, gemv_q8_pair in either swizzle) read that instead of normalizing x, within float
rounding of the same product given the scaled q8 x, and within the 8-bit error of the normed
product; end to end, llama.cpp's greedy tokens and the numpy backend's logits with the handoff
forced on for models too small for its balance rule (gemv_choice.nq_balanced, as matmul binds
it). Inputs: tests/matmul_ref.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda import q8_handoff as hand
from k4.runtime.cuda.constants import q8x_offsets
from tests.matmul_ref import fresh_rng, glu_weight, nan_like, rel_err, weight

EPS = 1e-5


def produce(w, reader, rng, n_out: int, x_cluster: bool = True):
    """One NQ product of w (n_out, n_in) on random x and residual, its handoff made for `reader`:
    (y, the handoff Q8Vector, host norm weights, the plain product's y)."""
    import cupy as cp

    n_in = w.shape[1]
    x = cp.asarray(rng.standard_normal(n_in).astype(np.float32))
    res = cp.asarray((rng.standard_normal(n_out) * 4).astype(np.float32))
    nw = (1 + 0.5 * rng.standard_normal(n_out)).astype(np.float32)
    n_parts = mm.norm_q8_blocks(w, x_cluster)
    assert n_parts
    vec = hand.Q8Vector.for_weight(reader, cp.zeros(mm.q8x_bytes(n_out), cp.uint8))
    q8 = hand.Q8Vector(vec.data, vec.n, vec.swizzle, cp.full(n_out, cp.nan, cp.float32), n_parts, EPS)
    y, y_plain = nan_like(n_out), nan_like(n_out)
    mm.gemv(w, x, y, residual=res, y_q8=q8, norm_out=(cp.asarray(nw), q8.parts), x_cluster=x_cluster)
    mm.gemv(w, x, y_plain, residual=res, x_cluster=x_cluster)
    return y, q8, nw, y_plain


def scaled(q8, y: np.ndarray) -> hand.Q8Vector:
    """The handoff made the plain q8 x of rmsnorm(y) * norm_w on the host: every d and d * sum times
    the norm's scale (float32), as copy_q8x_normed does."""
    import cupy as cp

    d_off, s_off, _ = q8x_offsets(q8.n)
    end = s_off + 4 * (q8.n // 16)
    raw = q8.data.get()
    rs = np.float32(1 / np.sqrt(np.mean(y.astype(np.float64) ** 2) + EPS))
    raw[d_off:end] = (raw[d_off:end].view(np.float32) * rs).view(np.uint8)
    return hand.Q8Vector(cp.asarray(raw), q8.n, q8.swizzle)


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_the_residual_product_hands_its_norm_input_over(type_name, monkeypatch):
    """y is the plain product's to the bit; the handoff is q8x_host(y * norm_w); the parts sum to
    sum(y^2), blocks without outputs writing 0. 256 outputs (8 groups: most blocks have none),
    4,352 (more groups than blocks), 4,096 at 11,008 inputs (clusters of two quantize x), and
    Qwen2.5 7B's down, 3,584 at 18,944 inputs, which the balance rule itself gives a handoff
    (112 groups: blocks idle on the H200's 132)."""
    rng, seed = fresh_rng()
    qwen_down, _ = weight(type_name, 3584, 18944, rng, True)
    assert mm.norm_q8_blocks(qwen_down), "the balance rule refuses Qwen2.5 7B's down product"
    monkeypatch.setattr(mm, "nq_balanced", lambda *a: True)
    for n_out, n_in in ((256, 512), (4352, 1024), (4096, 11008), (3584, 18944)):
        w = qwen_down if n_in == 18944 else weight(type_name, n_out, n_in, rng, True)[0]
        reader, _ = weight("Q4_K", 64, n_out, rng, True)
        y, q8, nw, y_plain = produce(w, reader, rng, n_out)
        assert bool((y == y_plain).all()), f"{type_name} {n_out}x{n_in} (seed {seed})"
        y_h = y.get()
        np.testing.assert_array_equal(q8.data.get(), hand.q8x_host(y_h * nw, q8.swizzle))
        parts = q8.parts.get()[: q8.n_parts]
        assert not np.isnan(parts).any() and (parts >= 0).all()
        np.testing.assert_allclose(parts.astype(np.float64).sum(), np.sum(y_h.astype(np.float64) ** 2), rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [4096, 3584])
def test_the_wide_output_product_hands_over_as_the_default_does(n):
    """The NQ instance of the output product's wide variant (gemv_choice.nq_variants, K4_WO_WIDE),
    as Llama 2 7B's (4,096) and Qwen2.5 7B's (3,584) output products run it (attention's q8 x, the
    residual): y as the default variant's (the same U, so the same y), the handoff q8x_host(y *
    norm_w) and, where the default hands over too (4,096: 16 warps a block keep it balanced; 3,584
    only in 32-warp blocks), its handoff and its parts' sum."""
    import cupy as cp

    from k4.runtime.cuda.gemv_choice import after_attention_variant

    rng, seed = fresh_rng()
    w, _ = weight("Q4_K", n, n, rng, True)
    reader, _ = weight("Q4_K", 64, n, rng, True)
    wide = after_attention_variant(T.Q4_K, n)
    x = rng.standard_normal(n).astype(np.float32)
    res = cp.asarray((rng.standard_normal(n) * 4).astype(np.float32))
    nw = cp.asarray((1 + 0.5 * rng.standard_normal(n)).astype(np.float32))
    vec = hand.Q8Vector.for_weight(w, cp.zeros(mm.q8x_bytes(n), cp.uint8))
    x_q8 = hand.Q8Vector(cp.asarray(hand.q8x_host(x, vec.swizzle)), vec.n, vec.swizzle)
    assert mm.norm_q8_blocks(w, False, wide), f"no NQ launch of {wide} at {n}"
    assert bool(mm.norm_q8_blocks(w, False)) == (n == 4096)
    out = {}
    for v in (wide, None):
        n_parts = mm.norm_q8_blocks(w, False, v)
        rv = hand.Q8Vector.for_weight(reader, cp.zeros(mm.q8x_bytes(n), cp.uint8))
        y = nan_like(n)
        if not n_parts:
            mm.gemv(w, nan_like(n), y, residual=res, x_q8=x_q8, variant=v)
            out[v] = (y.get(), None, None)
            continue
        q8 = hand.Q8Vector(rv.data, rv.n, rv.swizzle, cp.full(n, cp.nan, cp.float32), n_parts, EPS)
        mm.gemv(w, nan_like(n), y, residual=res, x_q8=x_q8, y_q8=q8, norm_out=(nw, q8.parts), variant=v)
        out[v] = (y.get(), q8.data.get(), q8.parts.get()[:n_parts])
    (y_w, q_w, p_w), (y_d, q_d, p_d) = out[wide], out[None]
    assert np.array_equal(y_w, y_d), f"seed {seed}"
    np.testing.assert_array_equal(q_w, hand.q8x_host(y_w * nw.get(), rv.swizzle))
    assert not np.isnan(p_w).any()
    np.testing.assert_allclose(p_w.astype(np.float64).sum(), np.sum(y_w.astype(np.float64) ** 2), rtol=1e-5)
    if q_d is not None:
        np.testing.assert_array_equal(q_w, q_d)
        np.testing.assert_allclose(p_w.astype(np.float64).sum(), p_d.astype(np.float64).sum(), rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("reader_type,glu", [("Q4_K", False), ("Q6_K", False), ("Q4_K", True)])
def test_a_reader_of_the_handoff_is_the_normed_product(reader_type, glu, monkeypatch):
    """A product given the handoff as x_q8 equals the same product given the norm-scaled q8 x
    (within float32 rounding of the scale), and the normed product on y within the 8-bit error."""
    import cupy as cp

    monkeypatch.setattr(mm, "nq_balanced", lambda *a: True)
    rng, seed = fresh_rng()
    n_out = 4096
    w, _ = weight("Q4_K", n_out, 4096, rng, True)
    reader = glu_weight(T[reader_type], 2048, n_out, rng)[0] if glu else weight(reader_type, 3000, n_out, rng, True)[0]
    y, q8, nw, _ = produce(w, reader, rng, n_out)
    n_r = 2048 if glu else 3000
    got, tight, normed = nan_like(n_r), nan_like(n_r), nan_like(n_r)
    mm.gemv(reader, nan_like(n_out), got, x_q8=q8)
    mm.gemv(reader, nan_like(n_out), tight, x_q8=scaled(q8, y.get()))
    mm.gemv(reader, y, normed, norm=(cp.asarray(nw), EPS))
    got, tight, normed = got.get(), tight.get(), normed.get()
    assert rel_err(got, tight.astype(np.float64)) < 1e-5, f"seed {seed}"
    assert rel_err(got, normed.astype(np.float64)) < 1e-2, f"seed {seed}"


@pytest.mark.cuda
def test_the_qkv_variant_reads_the_handoff_as_the_default_does(monkeypatch):
    """The 20-warp q/k/v instance (gemv_choice.qkv_variant, K4_QKV_WIDE) given a handoff copies
    and scales it as the default's NX instance does and runs the same row loop: the same bits, on
    Qwen2.5 7B's q|k|v shape after its 3,584-output down product (bias added)."""
    import cupy as cp

    from k4.runtime.cuda import gemv_choice as gc

    monkeypatch.setattr(mm, "nq_balanced", lambda *a: True)
    rng, seed = fresh_rng()
    n_out = 3584
    w, _ = weight("Q4_K", n_out, 4096, rng, True)
    reader, _ = weight("Q4_K", 4608, n_out, rng, True)
    _, q8, _, _ = produce(w, reader, rng, n_out)
    b = cp.asarray(rng.standard_normal(4608).astype(np.float32))
    wide, default = nan_like(4608), nan_like(4608)
    mm.gemv(reader, nan_like(n_out), wide, bias=b, x_q8=q8, variant=gc.QKV_VARIANT[T.Q4_K])
    mm.gemv(reader, nan_like(n_out), default, bias=b, x_q8=q8)
    assert bool((wide == default).all()), f"seed {seed}"


@pytest.mark.cuda
def test_the_pair_reads_the_handoff_in_both_swizzles(monkeypatch):
    """gemv_q8_pair (Q4_K q|k, Q6_K v) given one handoff (made in Q4_K's swizzle) equals each
    product alone given the handoff made in its own swizzle, to the bit."""
    from k4.runtime.cuda.gemv_pair import gemv_pair

    monkeypatch.setattr(mm, "nq_balanced", lambda *a: True)
    rng, seed = fresh_rng()
    n_out = 4096
    w, _ = weight("Q4_K", n_out, 4096, rng, True)
    qk_w, _ = weight("Q4_K", 5120, n_out, rng, True)
    v_w, _ = weight("Q6_K", 1024, n_out, rng, True)
    x_rng = np.random.default_rng(seed)
    _, q8_qk, _, _ = produce(w, qk_w, x_rng, n_out)
    y1, y2 = nan_like(5120), nan_like(1024)
    gemv_pair(qk_w, v_w, nan_like(n_out), y1, y2, x_q8=q8_qk)
    alone1, alone2 = nan_like(5120), nan_like(1024)
    mm.gemv(qk_w, nan_like(n_out), alone1, x_q8=q8_qk)
    _, q8_v, _, _ = produce(w, v_w, np.random.default_rng(seed), n_out)  # the same product, Q6_K's swizzle
    assert q8_v.swizzle != q8_qk.swizzle
    mm.gemv(v_w, nan_like(n_out), alone2, x_q8=q8_v)
    assert bool((y1 == alone1).all()) and bool((y2 == alone2).all()), f"seed {seed}"


def test_norm_out_is_refused_where_it_does_not_apply():
    """check_q8's norm_out rules (host only): a y_q8, a non-glu weight of an NQ type, whole groups
    of 32 outputs, and an x_q8 that is not itself a handoff."""
    q4 = SimpleNamespace(ggml_type=T.Q4_K, glu=False)
    vec = hand.Q8Vector(None, 64, 1)
    hand.check_q8(q4, None, vec, 256, 64, False, norm_out=True)
    for w, y_q8, n_out, x_q8 in ((q4, None, 64, None), (SimpleNamespace(ggml_type=T.Q4_K, glu=True), vec, 64, None),
                                 (SimpleNamespace(ggml_type=T.Q8_0, glu=False), vec, 64, None), (q4, vec, 48, None),
                                 (q4, vec, 64, hand.Q8Vector(None, 256, 1, parts=object(), n_parts=4))):
        with pytest.raises(ValueError, match="norm_out needs"):
            hand.check_q8(w, x_q8, y_q8, 256, n_out, False, norm_out=True)
    with pytest.raises(ValueError, match="holds 32 values"):
        hand.check_q8(q4, None, hand.Q8Vector(None, 32, 1), 256, 64, False, norm_out=True)


def test_an_nq_handoff_is_read_only_by_nx_instances():
    """check_q8 (host only): an x_q8 with parts goes to a product with an NX instance (nx_reads:
    an NQ type on its default variant or the q/k/v variant), not to another variant or type."""
    handed = hand.Q8Vector(None, 256, 1, parts=object(), n_parts=4)
    q4 = SimpleNamespace(ggml_type=T.Q4_K, glu=False)
    hand.check_q8(q4, handed, None, 256, 64, False)
    for w, variant in ((q4, (32, 2, 0)), (SimpleNamespace(ggml_type=T.Q8_0, glu=False), None)):
        with pytest.raises(ValueError, match="reads an NQ handoff"):
            hand.check_q8(w, handed, None, 256, 64, False, variant=variant)


@pytest.mark.cuda
def test_decode_with_the_handoff_keeps_golden_tokens_and_numpy_logits(data, tiny_model, monkeypatch):
    """With the handoff forced on (the balance rule off), every output and down product of the
    Q4_K_M stories model and of a tiny Q4_K qwen2 model hands over (counted), llama.cpp's greedy
    tokens hold, and the decode logits stay within the 8-bit limit of the numpy backend's and of
    the logits without the handoff."""
    from k4.runtime.model import open_model
    from k4.runtime.reference import NumpyBackend
    from k4.runtime.tokenizer import Tokenizer
    from tests.cuda_backend_cases import ARCH_CASES, check_q4_k_m_greedy, cuda, decode_by_flag, decode_limit, rel_l2

    monkeypatch.setattr(mm, "nq_balanced", lambda *a: True)
    monkeypatch.setitem(ARCH_CASES, "qwen2-q4_k-nq", ("qwen2", T.Q4_K, ARCH_CASES["llama-q4_k"][2]))
    calls = []
    gemv = mm.gemv
    monkeypatch.setattr(mm, "gemv", lambda *a, **k: (calls.append(k.get("norm_out") is not None), gemv(*a, **k))[1])
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    be = cuda(mf, 256)
    check_q4_k_m_greedy(data, Tokenizer.from_model(mf), be)
    be.close()
    small = tiny_model("qwen2-q4_k-nq")
    prompt = np.random.default_rng(4).integers(3, small.config.n_vocab, size=19).tolist()
    logits = decode_by_flag(monkeypatch, small, "K4_NORM_Q8", prompt, (7,), calls,  # graph captures add more launches
                            lambda on, calls: sum(calls) >= 2 * small.config.n_layer - 1 if on else not any(calls))
    ref = NumpyBackend(small, 64)
    ref.eval(prompt)
    want = ref.eval([7])
    assert rel_l2(logits[True][0], want) < decode_limit(small)
    assert rel_l2(logits[True][0], logits[False][0]) < decode_limit(small)
