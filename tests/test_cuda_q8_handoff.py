"""Decode's 8-bit handoff between products (K4_FUSE_QUANT; runtime/cuda/q8_handoff.py): q8x_host,
the host reference of the kernels' q8 x layout; a SwiGLU/GeGLU product writing its output as q8 x
and the down product reading it, to the bit the same as down on the float output; a product
quantizing a long x itself, to the bit q8x_host's; the checks of what does not fit. Inputs: tests/matmul_ref.py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import gemv_choice as gc
from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda import q8_handoff as hand
from tests.matmul_ref import GLU_REF, LIMIT_Q8, QUANTIZED, fresh_rng, glu_weight, nan_like, q8_rounded, rel_err, weight

@pytest.mark.parametrize("swizzle", [1, 2])
def test_q8x_host_is_q8_rounded_in_the_kernel_layout(swizzle):
    """q8x_host (the handoff's reference): unit u's 16 quants at slot x_unit_slot(u), d per 32,
    d * sum per 16, padding zero; its values are q8_rounded's. 416 values: 26 units padded to 32."""
    x = np.random.default_rng(3).standard_normal(416).astype(np.float32)
    x[32:64] = 0  # an all-zero group: d 0, quants 0
    raw = hand.q8x_host(x, swizzle)
    assert raw.shape == (mm.q8x_bytes(416),) == (512 + 64 + 112,)
    u = np.arange(26)
    slot = (u & ~7) | ((u + swizzle * (u >> 3)) & 7)
    assert (slot != u).any()
    quants = raw[16 * slot[:, None] + np.arange(16)].view(np.int8).reshape(-1, 32)
    d, s = raw[512:564].view(np.float32), raw[576:680].view(np.float32)
    np.testing.assert_array_equal((quants * d[:, None]).astype(np.float64).reshape(-1), q8_rounded(x))
    np.testing.assert_array_equal(s, np.repeat(d, 2) * quants.reshape(-1, 16).sum(axis=1).astype(np.float32))
    pad = np.r_[16 * np.setdiff1d(np.arange(32), slot)[:, None] + np.arange(16)].reshape(-1)
    assert not raw[pad].any() and not raw[564:576].any() and not raw[680:].any() and d[1] == 0 and np.abs(quants).max() == 127


@pytest.mark.cuda
@pytest.mark.parametrize("act", list(GLU_REF))
@pytest.mark.parametrize("down_type", QUANTIZED)
@pytest.mark.parametrize("glu_type", [t for t in QUANTIZED if mm.QUANT[T[t]].handoff])
def test_gemv_q8_handoff_is_the_quantization_of_y(glu_type, down_type, act):
    """y_q8 from a SwiGLU (or GeGLU) product holds y quantized (q8_rounded) in the down type's layout;
    down with x_q8 = it equals down on y itself to the bit, and never reads x. 4352 outputs =
    136 groups of 32: more than the grid has blocks, so blocks take unequal runs."""
    import cupy as cp

    rng, seed = fresh_rng()
    for n_ff in (256, 4352):
        n_in = 512
        glu, _, _ = glu_weight(T[glu_type], n_ff, n_in, rng, act=act)
        down, _ = weight(down_type, 300, n_ff, rng, True)
        assert hand.can_hand_off(glu, down)
        x = cp.asarray(rng.standard_normal(n_in).astype(np.float32))
        y, y_plain = nan_like(n_ff), nan_like(n_ff)
        q8 = hand.Q8Vector.for_weight(down, cp.zeros(mm.q8x_bytes(n_ff), cp.uint8))
        mm.gemv(glu, x, y, y_q8=q8)
        mm.gemv(glu, x, y_plain)
        assert cp.array_equal(y, y_plain), f"{glu_type} y_q8 changed y (seed {seed})"
        np.testing.assert_array_equal(q8.data.get(), hand.q8x_host(y.get(), q8.swizzle))
        z, z_q8 = nan_like(300), nan_like(300)
        mm.gemv(down, y, z)
        mm.gemv(down, nan_like(n_ff), z_q8, x_q8=q8)
        assert cp.array_equal(z, z_q8), f"{glu_type} -> {down_type} n_ff {n_ff} (seed {seed})"


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", [1, 2, 4])
@pytest.mark.parametrize("type_name,variant", [("Q4_K", None), ("Q6_K", None), ("Q4_K", (32, 2, 0))])
def test_gemv_quantizes_a_long_x_as_q8x_host(type_name, variant, cluster, monkeypatch):
    """gemv_q8 quantizing x itself (in blocks of 512 threads and of 1,024; alone, or shared out
    over clusters of 2 and 4 blocks: gemv_choice.gemv_cluster) equals gemv given q8x_host(x) as x_q8, to
    the bit. n_in 8,448 (528 units: more than a block has threads; 264 and 132 a cluster block)
    and 16,896 (1,056 units)."""
    import cupy as cp

    monkeypatch.setattr(gc, "X_CLUSTER", cluster)
    rng, seed = fresh_rng()
    for n_in in (8448, 16896):
        w, _ = weight(type_name, 300, n_in, rng, True)
        x = (rng.standard_normal(n_in) * rng.uniform(0.1, 10, n_in)).astype(np.float32)
        q8 = hand.Q8Vector.for_weight(w, cp.asarray(hand.q8x_host(x, mm.QUANT[w.ggml_type].x_swizzle)))
        z, z_q8 = nan_like(300), nan_like(300)
        mm.gemv(w, cp.asarray(x), z, variant=variant)
        mm.gemv(w, nan_like(n_in), z_q8, variant=variant, x_q8=q8)
        assert cp.array_equal(z, z_q8), f"{type_name} {variant} cluster {cluster} n_in {n_in} (seed {seed})"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name,variant", [("Q4_K", None), ("Q6_K", None), ("Q4_K", (32, 2, 0))])
def test_the_rms_norm_folds_into_the_outputs(type_name, variant):
    """A normed product in blocks of at most 16 warps (q8_handoff.folds_norm) quantizes x * norm_w
    and scales its outputs by the norm's scale: it equals the product given q8x_host(x * norm_w)
    times rsqrt(mean(x^2) + eps), within the float32 rounding of that scale (limit 1e-5; the 32-warp
    instances normalize x first: within the 8-bit limit of it). Given x_q8_out it normalizes x first
    too, and hands that q8 x on (K4_QKV_Q8): with a post-norm (where no product folds) a Q6_K product
    reading it has the bits of the same product normalizing x itself where both run blocks of 16
    warps (a 32-warp block sums x^2 in another order: within the 8-bit limit)."""
    import cupy as cp

    rng, seed = fresh_rng()
    n_out, n_in, eps = 300, 4096, 1e-5
    w, _ = weight(type_name, n_out, n_in, rng, True)
    w6, _ = weight("Q6_K", 200, n_in, rng, True)
    x, t = ((3 * rng.standard_normal(n_in) + 0.5).astype(np.float32) for _ in range(2))
    nw, pw = ((1 + 0.3 * rng.standard_normal(n_in)).astype(np.float32) for _ in range(2))
    dx, norm = cp.asarray(x), (cp.asarray(nw), eps)
    folds = hand.folds_norm(variant or gc.gemv_variant(w.ggml_type, n_out, n_in))
    assert folds == (variant is None)
    y, y_q8 = nan_like(n_out), nan_like(n_out)
    mm.gemv(w, dx, y, norm=norm, variant=variant)
    q8 = hand.Q8Vector.for_weight(w, cp.asarray(hand.q8x_host(x * nw, mm.QUANT[w.ggml_type].x_swizzle)))
    mm.gemv(w, nan_like(n_in), y_q8, x_q8=q8, variant=variant)
    s = np.float32(1 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps))
    err = rel_err(y.get(), y_q8.get() * s)
    assert err < (1e-5 if folds else LIMIT_Q8), f"{type_name} {variant}: {err:.2e} (seed {seed})"
    out = hand.Q8Vector.for_weight(w6, cp.zeros(mm.q8x_bytes(n_in), cp.uint8))
    y2 = nan_like(n_out)
    mm.gemv(w, dx, y2, norm=norm, variant=variant, x_q8_out=out)  # normalized first, as without the fold
    err = rel_err(y2.get(), y.get())
    assert err <= (LIMIT_Q8 if folds else 0), f"{type_name} {variant} with x_q8_out: {err:.2e} (seed {seed})"
    post = (cp.asarray(t), cp.asarray(pw), cp.zeros(n_in, cp.float32))
    mm.gemv(w, dx, y2, norm=norm, variant=variant, post=post, x_q8_out=out)
    z, z_q8 = nan_like(200), nan_like(200)
    mm.gemv(w6, dx, z, norm=norm, post=(post[0], post[1], cp.zeros(n_in, cp.float32)))
    mm.gemv(w6, nan_like(n_in), z_q8, x_q8=out)
    err = rel_err(z_q8.get(), z.get())
    assert err <= (0 if folds else LIMIT_Q8), f"{type_name} {variant}'s q8 x with a post-norm read by Q6_K: {err:.2e} (seed {seed})"


@pytest.mark.cuda
def test_gemv_q8_handoff_rejects_what_does_not_fit():
    import cupy as cp

    rng = np.random.default_rng(0)
    w, _ = weight("Q4_K", 64, 256, rng, True)
    w6, _ = weight("Q6_K", 64, 256, rng, True)
    buf = cp.zeros(mm.q8x_bytes(256), cp.uint8)
    x, y = cp.zeros(256, cp.float32), cp.zeros(64, cp.float32)
    with pytest.raises(ValueError, match="swizzle"):
        mm.gemv(w, x, y, x_q8=hand.Q8Vector.for_weight(w6, buf))
    with pytest.raises(ValueError, match="no fused norm"):
        mm.gemv(w, x, y, x_q8=hand.Q8Vector.for_weight(w, buf), norm=(x, 1e-6))
    with pytest.raises(ValueError, match="glu"):
        mm.gemv(w, x, y, y_q8=hand.Q8Vector(buf, 64, 1))
    with pytest.raises(ValueError, match="needs 352 uint8 bytes"):
        hand.Q8Vector.for_weight(w, cp.zeros(100, cp.uint8))
    f32, _ = weight("F32", 64, 256, rng, True)
    with pytest.raises(ValueError, match="float x"):
        hand.Q8Vector.for_weight(f32, buf)
    glu, _, _ = glu_weight(T.Q5_0, 64, 256, rng)
    assert not hand.can_hand_off(glu, w6)
    with pytest.raises(ValueError, match="handoff"):
        mm.gemv(glu, x, y, y_q8=hand.Q8Vector(buf, 64, 1))
