"""Decode's matrix-vector products (runtime/cuda/matmul.py gemv, kernels_cu/gemv.cu) against numpy
on every type, raw and planar: plain, with PDL (also chained in a captured graph), stacked rows,
the launch variants, the epilogues (bias, residual), the fused RMSNorm prologue, the SwiGLU and
GeGLU epilogues of gate/up weights, and the checks of bad arguments. Error limits and inputs:
tests/matmul_ref.py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from k4.runtime.cuda import gemv_choice as gc
from k4.runtime.cuda import layout as lay
from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda import quant_kernels as qk
from k4.runtime.cuda.device_weight import make_weight
from k4.runtime.cuda.matrix_jobs import compile_jobs
from k4.runtime.cuda.microbench import random_weight
from k4.runtime.model import Tensor
from tests.helpers_matmul import stack_rows
from tests.matmul_ref import (FLOATS, GLU_REF, LIMIT_Q8, LIMIT_Q8_ROUNDED, QUANTIZED, fresh_rng, gemv_ref, glu_weight, nan_like,
                              q8_rounded, rel_err, rms_normed, shapes, silu, weight)

@pytest.mark.cuda
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("type_name", QUANTIZED + FLOATS)
def test_gemv_matches_numpy(type_name, repack):
    import cupy as cp

    rng, seed = fresh_rng()
    for n_out, n_in in shapes(type_name):
        w, ref_w = weight(type_name, n_out, n_in, rng, repack)
        x = rng.standard_normal(n_in).astype(np.float32)
        y = nan_like(n_out)
        mm.gemv(w, cp.asarray(x), y)
        got = y.get()
        what = f"{type_name} {n_out}x{n_in} repack={repack} (seed {seed})"
        assert np.isfinite(got).all(), f"{what}: unwritten or non-finite outputs"
        ref, limit = gemv_ref(type_name, ref_w, x)
        assert rel_err(got, ref) < limit, f"{what}: relative error {rel_err(got, ref):.2e}"
        if type_name in QUANTIZED and n_out >= 300:
            err = rel_err(got, ref_w @ x.astype(np.float64))
            assert err < LIMIT_Q8, f"{what}: relative error to float x {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "F16"])
def test_gemv_programmatic_dependent_launch(type_name):
    import cupy as cp

    rng, seed = fresh_rng()
    w, ref_w = weight(type_name, 300, 512, rng, True)
    x = rng.standard_normal(512).astype(np.float32)
    y = nan_like(300)
    mm.gemv(w, cp.asarray(x), y, pdl=True)
    ref, limit = gemv_ref(type_name, ref_w, x)
    assert rel_err(y.get(), ref) < limit, f"seed {seed}"


@pytest.mark.cuda
def test_gemv_chain_with_pdl_in_a_graph():
    """Two dependent products launched with programmatic dependent launch, replayed from a CUDA
    graph on new x: the second must see the first's output."""
    import cupy as cp

    rng, seed = fresh_rng()
    w1, ref1 = weight("Q4_K", 512, 768, rng, True)
    w2, ref2 = weight("Q6_K", 300, 512, rng, True)
    x, y1, y2 = cp.zeros(768, cp.float32), nan_like(512), nan_like(300)
    cp.cuda.Device().synchronize()  # the inputs were built on the default stream, which `stream` does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        mm.gemv(w1, x, y1, pdl=True)
        mm.gemv(w2, y1, y2, pdl=True)
        graph = stream.end_capture()
        for _ in range(3):
            xh = rng.standard_normal(768).astype(np.float32)
            x.set(xh, stream=stream)
            graph.launch()
            stream.synchronize()
            h1 = y1.get()
            assert rel_err(h1, ref1 @ q8_rounded(xh)) < LIMIT_Q8_ROUNDED, f"first product (seed {seed})"
            assert rel_err(y2.get(), ref2 @ q8_rounded(h1)) < LIMIT_Q8_ROUNDED, f"second product (seed {seed})"


@pytest.mark.cuda
def test_stacked_rows_multiply_as_one_matrix():
    import cupy as cp

    rng, seed = fresh_rng()
    parts = [random_weight(T.Q4_K, n, 512, rng) for n in (256, 64, 64)]
    t = stack_rows(parts, "blk.0.attn_qkv.weight")
    assert t.shape == (384, 512)
    w = make_weight(t, cp.asarray(lay.weight_layout(t, True)), True)
    x = rng.standard_normal(512).astype(np.float32)
    y = nan_like(384)
    mm.gemv(w, cp.asarray(x), y)
    ref = np.concatenate([dequantize(p.raw_bytes(), p.ggml_type).astype(np.float64) @ q8_rounded(x) for p in parts])
    assert rel_err(y.get(), ref) < LIMIT_Q8_ROUNDED, f"seed {seed}"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name,variant", [(t, v) for t, vs in qk.EXTRA_GEMV_VARIANTS.items() for v in vs]
                         + list(gc.ROW_BLOCKS_VARIANT.items()))
def test_gemv_variants_match_numpy(type_name, variant):
    import cupy as cp

    rng, seed = fresh_rng()
    w, ref_w = weight(type_name.name, 777, 1536, rng, True)
    x = rng.standard_normal(1536).astype(np.float32)
    y = nan_like(777)
    mm.gemv(w, cp.asarray(x), y, variant=variant)
    assert rel_err(y.get(), ref_w @ q8_rounded(x)) < LIMIT_Q8_ROUNDED, f"seed {seed}"


@pytest.mark.cuda
def test_the_output_products_wide_variant_reads_attentions_q8():
    """gemv_choice.after_attention_variant's instance (K4_WO_WIDE) as forward runs it on Qwen2.5
    7B's output product: x handed in quantized (attention's q8 output), the residual added; against
    numpy on the q8-rounded x, and the bits of the default (16, 2, 1), whose rows sum in the same order."""
    import cupy as cp

    from k4.runtime.cuda import q8_handoff as hand

    rng, seed = fresh_rng()
    n = 3584
    variant = gc.after_attention_variant(T.Q4_K, n)
    w, ref_w = weight("Q4_K", n, n, rng, True)
    x = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32)
    vec = hand.Q8Vector.for_weight(w, cp.zeros(mm.q8x_bytes(n), cp.uint8))
    q8 = hand.Q8Vector(cp.asarray(hand.q8x_host(x, vec.swizzle)), vec.n, vec.swizzle)
    wide, default = nan_like(n), nan_like(n)
    mm.gemv(w, nan_like(n), wide, residual=cp.asarray(r), x_q8=q8, variant=variant)
    mm.gemv(w, nan_like(n), default, residual=cp.asarray(r), x_q8=q8)
    assert rel_err(wide.get() - r, ref_w @ q8_rounded(x)) < LIMIT_Q8_ROUNDED, f"seed {seed}"
    assert bool((wide == default).all()), f"seed {seed}"


@pytest.mark.cuda
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
def test_the_qkv_variant_sums_the_rows_as_the_default_does(repack):
    """gemv_choice.qkv_variant's 20-warp instance (K4_QKV_WIDE) on Qwen2.5 7B's q|k|v shape
    (4,608 x 3,584, bias): x quantized as it is, the bits of the default (16, 2, 1), whose rows
    run the same loop (U, PF); with the RMSNorm folded in, numpy's normed product within the 8-bit
    limit and the default's within float32 rounding (the norm's sum of squares meets over other
    warps, so its scale may differ in the last bits)."""
    import cupy as cp

    rng, seed = fresh_rng()
    n_out, n_in = 4608, 3584
    variant = gc.qkv_variant(T.Q4_K, n_out, 132)
    assert variant == gc.QKV_VARIANT[T.Q4_K]
    w, ref_w = weight("Q4_K", n_out, n_in, rng, repack)
    x = (3 * rng.standard_normal(n_in) + 0.5).astype(np.float32)
    b = cp.asarray(rng.standard_normal(n_out).astype(np.float32))
    norm_w = cp.asarray((1 + 0.3 * rng.standard_normal(n_in)).astype(np.float32))
    wide, default = nan_like(n_out), nan_like(n_out)
    mm.gemv(w, cp.asarray(x), wide, bias=b, variant=variant)
    mm.gemv(w, cp.asarray(x), default, bias=b)
    assert bool((wide == default).all()), f"seed {seed}"
    assert rel_err(wide.get() - b.get(), ref_w @ q8_rounded(x)) < LIMIT_Q8_ROUNDED, f"seed {seed}"
    mm.gemv(w, cp.asarray(x), wide, bias=b, norm=(norm_w, 1e-5), variant=variant)
    mm.gemv(w, cp.asarray(x), default, bias=b, norm=(norm_w, 1e-5))
    assert rel_err(wide.get(), default.get().astype(np.float64)) < 5e-6, f"seed {seed}"
    assert rel_err(wide.get() - b.get(), ref_w @ rms_normed(x, norm_w.get(), 1e-5)) < LIMIT_Q8, f"seed {seed}"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "F32"])
def test_gemv_epilogues(type_name):
    import cupy as cp

    rng, seed = fresh_rng()
    n_out, n_in = 300, 512
    w, ref_w = weight(type_name, n_out, n_in, rng, True)
    x = rng.standard_normal(n_in).astype(np.float32)
    r = rng.standard_normal(n_out).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    ref, limit = gemv_ref(type_name, ref_w, x)
    dx = cp.asarray(x)

    y = nan_like(n_out)
    mm.gemv(w, dx, y, residual=cp.asarray(r), bias=cp.asarray(b))
    assert rel_err(y.get(), ref + r + b) < limit, f"residual + bias (seed {seed})"

    y = cp.asarray(r)
    mm.gemv(w, dx, y, residual=y)
    assert rel_err(y.get(), ref + r) < limit, f"in-place residual (seed {seed})"

    y = nan_like(n_out)
    mm.gemv(w, dx, y, bias=cp.asarray(b))
    assert rel_err(y.get(), ref + b) < limit, f"bias (seed {seed})"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "F32", "F16"])
def test_gemv_fused_rms_norm(type_name):
    """The RMSNorm prologue against the norm computed in float64: the kernel quantizes its own
    normalized x, whose q8 rounding may differ in a few last bits from numpy's, so the float-x
    limits apply (1e-2 quantized, float32 rounding otherwise)."""
    import cupy as cp

    rng, seed = fresh_rng()
    for n_out, n_in in ((300, 512), (4133, 2048), (40, 17408)):
        w, ref_w = weight(type_name, n_out, n_in, rng, True)
        x = (3 * rng.standard_normal(n_in) + 0.5).astype(np.float32)
        norm_w = (1 + 0.3 * rng.standard_normal(n_in)).astype(np.float32)
        r = rng.standard_normal(n_out).astype(np.float32)
        y = cp.asarray(r)
        mm.gemv(w, cp.asarray(x), y, residual=y, norm=(cp.asarray(norm_w), 1e-5))
        ref = ref_w @ rms_normed(x, norm_w, 1e-5)
        err = rel_err(y.get() - r, ref)
        assert err < (LIMIT_Q8 if type_name in QUANTIZED else 1e-5), f"{type_name} {n_out}x{n_in}: {err:.2e} (seed {seed})"


@pytest.mark.cuda
@pytest.mark.parametrize("act", list(GLU_REF))
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("type_name", QUANTIZED + FLOATS)
def test_gemv_swiglu_epilogue(type_name, repack, act):
    """A gate/up interleaved weight (glu): y = act(gate x) * (up x) from one launch, with and
    without the norm prologue; act silu (SwiGLU) or gemma's gelu_tanh (GeGLU). The gelu case
    fails if its instance applied silu: on these |g| ~ 1-3 the two differ by ~30%."""
    import cupy as cp

    rng, seed = fresh_rng()
    n_ff, n_in = shapes(type_name)[2]
    w, ref_g, ref_u = glu_weight(T[type_name], n_ff, n_in, rng, repack, act)
    x = rng.standard_normal(n_in).astype(np.float32)
    y = nan_like(n_ff)
    mm.gemv(w, cp.asarray(x), y)
    (g, limit), (u, _) = gemv_ref(type_name, ref_g, x), gemv_ref(type_name, ref_u, x)
    f = GLU_REF[act]
    err = rel_err(y.get(), f(g) * u)
    assert err < 2 * limit, f"{type_name} {act} {n_ff}x{n_in}: {err:.2e} (seed {seed})"
    norm_w = (1 + 0.3 * rng.standard_normal(n_in)).astype(np.float32)
    y = nan_like(n_ff)
    mm.gemv(w, cp.asarray(x), y, norm=(cp.asarray(norm_w), 1e-6))
    xn = rms_normed(x, norm_w, 1e-6)
    err = rel_err(y.get(), f(ref_g @ xn) * (ref_u @ xn))
    assert err < (3 * LIMIT_Q8 if type_name in QUANTIZED else 2e-5), f"{type_name} with norm: {err:.2e} (seed {seed})"
    with pytest.raises(ValueError, match="no residual"):
        mm.gemv(w, cp.asarray(x), y, residual=y)


@pytest.mark.cuda
@pytest.mark.parametrize("type_name,variant", [(t, v) for t, vs in qk.EXTRA_GLU_VARIANTS.items() for v in vs])
def test_gemv_swiglu_variants_match_numpy(type_name, variant):
    import cupy as cp

    rng, seed = fresh_rng()
    w, ref_g, ref_u = glu_weight(type_name, 777, 1536, rng)
    x = rng.standard_normal(1536).astype(np.float32)
    y = nan_like(777)
    mm.gemv(w, cp.asarray(x), y, variant=variant)
    g, u = ref_g @ q8_rounded(x), ref_u @ q8_rounded(x)
    assert rel_err(y.get(), silu(g) * u) < 2 * LIMIT_Q8_ROUNDED, f"seed {seed}"


def test_glu_instances_keep_the_swiglu_names_and_add_gelu_ones():
    """The SwiGLU instances keep their names (the GELU template argument left at its default);
    the GeGLU ones, one group per type, compile only for a gelu_tanh model; make_weight names
    an unknown activation."""
    assert qk._gemv_q8_name(T.Q4_K, True, (16, 2, 1), True) == "gemv_q8<type_q4_K, true, 16, 2, true, true>"
    assert qk._gemv_q8_name(T.Q4_K, True, (16, 2, 1), True, "gelu_tanh") == "gemv_q8<type_q4_K, true, 16, 2, true, true, true>"
    assert qk._gemv_q8_name(T.Q4_K, True, (16, 2, 1), False, "gelu_tanh") == "gemv_q8<type_q4_K, true, 16, 2, true, false>"
    assert qk._gemv_f_name(T.F32, True, True, "gelu_tanh") == "gemv_f<type_f32, 8, 4, true, true, true>"
    gelu = qk.GROUPS["gemv.cu"]["Q6_K.gelu_tanh"]
    assert len(gelu) == 2 and all(n.endswith("true, true>") for n in gelu)
    assert not any(n.endswith("true, true, true>") for n in qk.GROUPS["gemv.cu"]["Q6_K"])
    groups = lambda act: [g for f, g, _ in compile_jobs([T.Q6_K, T.F32], True, act) if f == "gemv.cu"]  # noqa: E731
    assert groups("silu") == [qk.GROUPS["gemv.cu"]["Q6_K"], qk.GROUPS["gemv.cu"]["Q6_K.nq"], qk.GROUPS["gemv.cu"]["F32"]]
    assert qk.GROUPS["gemv.cu"]["F32.gelu_tanh"] in groups("gelu_tanh") and len(groups("gelu_tanh")) == 4
    gate_up = Tensor("ffn_gate_up", T.F32, (4, 32), 0, None)
    with pytest.raises(ValueError, match="relu"):
        make_weight(gate_up, np.zeros(512, np.uint8), False, glu=True, glu_act="relu")


@pytest.mark.cuda
def test_gemv_rejects_bad_arguments():
    import cupy as cp

    w, _ = weight("Q4_K", 8, 256, np.random.default_rng(0), True)
    with pytest.raises(ValueError, match="x must be"):
        mm.gemv(w, cp.zeros(255, cp.float32), cp.zeros(8, cp.float32))
    with pytest.raises(ValueError, match="y must be"):
        mm.gemv(w, cp.zeros(256, cp.float32), cp.zeros(8, cp.float64))
    with pytest.raises(ValueError, match="16-byte aligned"):
        mm.gemv(w, cp.zeros(260, cp.float32)[1:257], cp.zeros(8, cp.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "F32"])
def test_gemv_folded_post_norm(type_name):
    """Gemma's post-norm folded into the next product (gemv post): the input is x + rmsnorm(t) *
    post_w (what rms_norm_add writes), normed again by the product's own RMSNorm; the first block
    writes that input to x_out. Against float64: x_out to float32 rounding, y within the fused
    norm's limits; a gate/up pair (GeGLU) takes it too, with its q8 handoff's shared memory after it."""
    import cupy as cp

    rng, seed = fresh_rng()
    eps = 1e-6
    for n_out, n_in in ((300, 512), (4133, 5120)):
        w, ref_w = weight(type_name, n_out, n_in, rng, True)
        x, t = (3 * rng.standard_normal((2, n_in)) + 0.5).astype(np.float32)
        post_w, norm_w = (1 + 0.3 * rng.standard_normal((2, n_in))).astype(np.float32)
        x_out = nan_like(n_in)
        y = nan_like(n_out)
        mm.gemv(w, cp.asarray(x), y, norm=(cp.asarray(norm_w), eps), post=(cp.asarray(t), cp.asarray(post_w), x_out))
        want_x = x.astype(np.float64) + rms_normed(t, post_w, eps)
        what = f"{type_name} {n_out}x{n_in} (seed {seed})"
        assert rel_err(x_out.get(), want_x) < 1e-6, what
        err = rel_err(y.get(), ref_w @ rms_normed(want_x, norm_w, eps))
        assert err < (LIMIT_Q8 if type_name in QUANTIZED else 1e-5), f"{what}: {err:.2e}"
    if type_name in ("Q4_K", "F32"):
        n_ff, n_in = 96, 512
        w, ref_g, ref_u = glu_weight(T[type_name], n_ff, n_in, rng, True, "gelu_tanh")
        x, t = rng.standard_normal((2, n_in)).astype(np.float32)
        x_out, y = nan_like(n_in), nan_like(n_ff)
        mm.gemv(w, cp.asarray(x), y, norm=(cp.asarray(post_w[:n_in]), eps), post=(cp.asarray(t), cp.asarray(norm_w[:n_in]), x_out))
        xn = rms_normed(x.astype(np.float64) + rms_normed(t, norm_w[:n_in], eps), post_w[:n_in], eps)
        err = rel_err(y.get(), GLU_REF["gelu_tanh"](ref_g @ xn) * (ref_u @ xn))
        assert err < (3 * LIMIT_Q8 if type_name in QUANTIZED else 2e-5), f"{type_name} gelu pair: {err:.2e} (seed {seed})"
    with pytest.raises(ValueError, match="post-norm"):
        mm.gemv(w, cp.asarray(x), y, post=(cp.asarray(t), cp.asarray(norm_w[:n_in]), x_out))  # no norm
