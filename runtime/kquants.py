"""llama.cpp's reference quantizers (no importance matrix), vectorized over blocks in numpy.

Every function here reproduces, byte for byte, the `quantize_row_*_ref` function of the same
name in ggml's ggml-quants.c, which `llama-quantize` runs when no importance matrix is given:

    Q4_K  quantize_row_q4_K_ref   (make_qkx2_quants on 8 sub-blocks of 32, 6-bit scales/mins)
    Q5_K  quantize_row_q5_K_ref   (the same with 5-bit quants)
    Q6_K  quantize_row_q6_K_ref   (make_qx_quants on 16 sub-blocks of 16, int8 scales)
    Q5_0  quantize_row_q5_0_ref,  Q5_1 quantize_row_q5_1_ref   (fallbacks for rows % 256 != 0)
    Q8_0  quantize_row_q8_0_ref   (through gguf.quants, whose Q8_0 is the same arithmetic)
    F16   GGML_FP32_TO_FP16 (round to nearest even, as numpy's float16 cast)

Block layouts are ggml-common.h's block_q4_K, block_q5_K, block_q6_K, block_q5_0, block_q5_1,
block_q8_0, all little-endian. The C code works in float32 and sums left to right; so does this
module. Sub-blocks are laid out as columns, x of shape (n, N) for N sub-blocks of n elements,
so that element i of every sub-block is one contiguous row and every sum over a sub-block is
a sum over axis 0 in element order (`_sum_seq`), for all sub-blocks at once.

Input everywhere: finite float32 array (n_rows, n_per_row) with n_per_row a multiple of the
block size (runtime/quantize.py refuses NaN and inf weights before they get here).
Output: uint8 array (n_rows, n_per_row // block_size * type_size).

Speed: numpy cannot fuse the C loops, so every candidate scale of make_qkx2_quants costs about
16 passes over the (n, N) arrays (5 of them for the error alone); rows are quantized in passes
of CACHE_WEIGHTS so that the scratch arrays stay in the L2 cache, results are rounded with
np.rint after clipping (exact below 2**21, proven per pass), and the search keeps only the
(iscale, min) of its best candidate, since every sub-block but those whose final scale is 0
is quantized again. docs/PERF.md has the rates (about 11 M weights/s per core for Q4_K).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

QK_K = 256  # weights per K-quant super-block (ggml-common.h)
CACHE_WEIGHTS = 1 << 16  # weights quantized per pass: 256 KiB float32 scratch arrays, in L2 cache
GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c: a group whose max |x| is below this is all zero
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23, nearest_int's rounding constant

f32 = np.float32


def nearest_int(x: np.ndarray) -> np.ndarray:
    """ggml-quants.c nearest_int: float32 array -> int32, rounding half to even.

    The C code adds 1.5 * 2**23 and reads the low mantissa bits; doing the same here keeps the
    result identical to llama.cpp's even for inputs outside +-2**22 (inf, nan, huge), which the
    callers then clamp.
    """
    bits = (np.asarray(x, dtype=f32) + _MAGIC).view(np.int32)
    return (bits & 0x7FFFFF) - 0x400000


_EXACT = f32(2**21)  # below this magnitude v + 1.5 * 2**23 rounds v to an integer exactly


def _round_clip(v: np.ndarray, lo: int, hi: int, in_range: bool | None = None) -> np.ndarray:
    """MAX(lo, MIN(hi, nearest_int(v))) as float32, computed in place in v (float32 array).

    When every |v| < 2**21 (in_range; checked here when not given) nearest_int is numpy's
    round-half-to-even, and clamping to integer bounds commutes with it, so v is clipped and
    then rounded (two passes); otherwise (inf, nan, huge values) the integer trick is run for
    bit-exact agreement.
    """
    if in_range is None:
        in_range = bool(v.min() > -_EXACT and v.max() < _EXACT)  # false on nan
    if in_range:
        v.clip(lo, hi, out=v)  # the method: np.clip's wrapper costs more than the pass
        np.rint(v, out=v)
    else:
        v[...] = np.clip(nearest_int(v), lo, hi)
    return v


def _sum_seq(a: np.ndarray) -> np.ndarray:
    """(n, N) float32 -> (N,): `s = a[0]; for i >= 1: s += a[i]` in float32, the C loops' order.

    numpy reduces a C-contiguous array over axis 0 row by row into one accumulator row (its
    pairwise summation applies only along the contiguous axis), which is this order;
    tests/test_quantize.py checks it on data where the order shows.
    """
    return np.add.reduce(np.ascontiguousarray(a), axis=0)


add_seq = np.add.reduce  # _sum_seq for arrays known to be C-contiguous (the hot loops' scratch)


def _fp16(x: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16: float32 -> float16, round to nearest even."""
    return np.asarray(x, dtype=f32).astype(np.float16)


def _columns(x: np.ndarray, n: int) -> np.ndarray:
    """(n_rows, n_per_row) -> (n, N): sub-blocks of n consecutive weights as contiguous columns."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _rows(cols: np.ndarray, block: int) -> np.ndarray:
    """Inverse of _columns: (n, N) -> (n_blocks, block), weights back in file order."""
    return np.ascontiguousarray(cols.T).reshape(-1, block)


def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml-quants.c make_qkx2_quants (use_mad = false) for N sub-blocks at once.

    x, w: (n, N) float32 weights (finite) and their importance. Fits x ~ scale * L - the_min
    with L in [0, nmax], trying nstep + 1 candidate scales; a candidate is kept when its
    weighted squared error is lower, and later candidates start from the best min found so
    far, as in C. Returns scale (N,), the_min (N,) (>= 0) and the pair (iscale, mn) (N,) from
    which the kept L = clamp(nearest_int(iscale * (x - mn)), 0, nmax) (iscale 0 for a flat
    sub-block, whose L is 0); all float32. L itself is not formed: the K-quant callers
    re-quantize every sub-block but those whose 6-bit scale is 0.
    """
    xmin = x.min(axis=0)  # (N,)
    mx = x.max(axis=0)  # (N,)
    mn0 = np.where(xmin > 0, f32(0), xmin)  # C: running min, then `if (min > 0) min = 0`
    flat = mx == mn0  # (N,) C returns early; here their span is made 1 and the result reset
    mx = np.where(flat, f32(1), mx)  # flat means mx = mn0 <= 0
    sum_w = _sum_seq(w)  # (N,)
    sum_x = _sum_seq(w * x)  # (N,)
    lf = np.empty_like(x)  # (n, N) candidate quants
    wl, prod = np.empty_like(x), np.empty_like(x)  # (n, N) w*l; w*l*l, w*l*x, then error terms

    def in_range(mn: np.ndarray, span: np.ndarray) -> bool:
        """Whether every iscale * (x - mn) is provably below 2**21 (so _round_clip may round in
        float): span = max - mn neither tiny nor huge, and min - mn at most 1e4 spans."""
        a = np.abs(span)
        return bool(np.all((a > f32(1e-30)) & (a < f32(1e30)) & (np.abs(xmin - mn) <= f32(1e4) * a)))

    def quants(iscale: np.ndarray, mn: np.ndarray, fast: bool) -> None:
        """lf = clamp(nearest_int(iscale * (x - mn)), 0, nmax)."""
        np.multiply(np.subtract(x, mn, out=lf), iscale, out=lf)
        _round_clip(lf, 0, nmax, fast)

    def error(scale: np.ndarray, mn: np.ndarray) -> np.ndarray:
        """sum of w * (scale * lf + mn - x)^2, left to right."""
        np.subtract(np.add(np.multiply(lf, scale, out=prod), mn, out=prod), x, out=prod)
        np.multiply(np.square(prod, out=prod), w, out=prod)
        return add_seq(prod, axis=0)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        span = mx - mn0
        fast = in_range(mn0, span)
        iscale = f32(nmax) / span
        quants(iscale, mn0, fast)
        # the best candidate so far: its error, scale, and the iscale and min that made its L;
        # then the min the next candidates start from (C's `min`)
        best = np.stack((error(f32(1) / iscale, mn0), f32(1) / iscale, iscale, mn0, mn0))  # (5, N)
        mn = best[4]
        for step in range(nstep + 1):
            iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / span
            quants(iscale, mn, fast)
            sum_l = add_seq(np.multiply(w, lf, out=wl), axis=0)
            sum_l2 = add_seq(np.multiply(wl, lf, out=prod), axis=0)
            sum_xl = add_seq(np.multiply(wl, x, out=prod), axis=0)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            clamped = this_min > 0
            if clamped.any():
                np.copyto(this_min, f32(0), where=clamped)
                np.copyto(this_scale, sum_xl / sum_l2, where=clamped)
            cur_error = error(this_scale, this_min)
            better = (D > 0) & (cur_error < best[0])  # (N,)
            if better.any():
                np.copyto(best, np.stack((cur_error, this_scale, iscale, mn, this_min)), where=better)
                span = mx - mn
                fast = in_range(mn, span)
    _, scale, q_iscale, q_min, mn = best
    scale = np.where(flat, f32(0), scale)
    mn = np.where(flat, mn0, mn)
    return scale, -mn, (np.where(flat, f32(0), q_iscale), q_min)


def make_qx_quants(x: np.ndarray, nmax: int):
    """ggml-quants.c make_qx_quants with rmse_type = 1 and no quant weights (w = x*x).

    x: (n, N) float32 sub-blocks (finite). Fits x ~ scale * (L - nmax), L in [0, 2*nmax - 1],
    trying the scales -(nmax + 0.1*is)/max for is in -9..9 around the first guess. Returns
    scale (N,) float32 (signed), iscale (N,) float32 from which the kept
    L = clamp(nearest_int(iscale * x), -nmax, nmax - 1) + nmax, and zero (N,) bool: sub-blocks
    whose max |x| is below GROUP_MAX_EPS, with scale 0 and L = 0. L itself is not formed:
    quantize_q6_K re-quantizes every sub-block but those whose int8 scale is 0.
    """
    hi, lo = x.max(axis=0), x.min(axis=0)  # (N,)
    amax = np.maximum(hi, -lo)
    mx = np.where(hi >= -lo, hi, lo)  # (N,) the signed value of largest magnitude
    tie = (hi == -lo) & (hi != 0)  # C keeps the first of +a and -a: look it up
    if tie.any():
        cols = np.flatnonzero(tie)
        mx[cols] = x[np.abs(x[:, cols]).argmax(axis=0), cols]
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx)  # their result is reset; 1 keeps iscale finite
    w = x * x
    wx = w * x
    lf, prod = np.empty_like(x), np.empty_like(x)  # (n, N) candidate quants (signed), products

    def fit(iscale):
        """lf = clamp(nearest_int(iscale * x), -nmax, nmax - 1); sums of w*x*l and w*l*l.
        |iscale * x| <= |iscale * max| < nmax + 1, so the float path is exact."""
        _round_clip(np.multiply(x, iscale, out=lf), -nmax, nmax - 1, True)
        sumlx = add_seq(np.multiply(wx, lf, out=prod), axis=0)
        return sumlx, add_seq(np.multiply(np.multiply(w, lf, out=prod), lf, out=prod), axis=0)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q_iscale = f32(-nmax) / mx
        sumlx, suml2 = fit(q_iscale)
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(f32(nmax) + f32(0.1) * f32(step)) / mx
            sumlx, suml2 = fit(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            if better.any():
                scale = np.where(better, sumlx / suml2, scale)
                best = np.where(better, scale * sumlx, best)
                q_iscale = np.where(better, iscale, q_iscale)
    return np.where(zero, f32(0), scale), q_iscale, zero


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins (n_blocks, 8) -> the 12 scale bytes of block_q4_K / block_q5_K.

    Layout (get_scale_min_k4): bytes 0-3 hold scales 0-3 plus the top 2 bits of scales 4-7,
    bytes 4-7 mins 0-3 plus the top bits of mins 4-7, bytes 8-11 the low nibbles of scales
    and mins 4-7.
    """
    out = np.empty((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _quantize_kx(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """The part quantize_row_q4_K_ref and quantize_row_q5_K_ref share.

    x: (n_rows, n_per_row) float32. Returns d, dmin (n_blocks,) float16, the 12 scale bytes
    (n_blocks, 12) and the quants L (n_blocks, 256) uint8 in [0, nmax].
    """
    xs = _columns(x, 32)  # (32, N) N = 8 sub-blocks per super-block
    nb = xs.shape[1] // 8
    av_x = np.sqrt(_sum_seq(xs * xs) / f32(32))  # (N,)
    weights = av_x + np.abs(xs)  # (32, N)
    scales, mins, (q_iscale, q_min) = make_qkx2_quants(xs, weights, nmax, rmin, rdelta, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = scales.max(axis=1)
    max_scale = np.where(max_scale > 0, max_scale, f32(0))  # (nb,) C: running max from 0
    max_min = mins.max(axis=1)
    max_min = np.where(max_min > 0, max_min, f32(0))
    with np.errstate(divide="ignore", over="ignore"):  # 63 / a subnormal max overflows, as in C
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
    # `uint8_t ls = nearest_int(...)` wraps modulo 256 before MIN(63, ls)
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)  # (nb, 8)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d = _fp16(max_scale / f32(63))  # (nb,)
    dmin = _fp16(max_min / f32(63))
    d_sub = (d.astype(f32)[:, None] * ls.astype(f32)).reshape(-1)  # (N,)
    dm_sub = (dmin.astype(f32)[:, None] * lm.astype(f32)).reshape(-1)
    keep = d_sub == 0  # (N,) a sub-block whose scale is 0 keeps its first fit
    L = np.add(xs, dm_sub)  # (32, N)
    _round_clip(np.divide(L, np.where(keep, f32(1), d_sub), out=L), 0, nmax)
    if keep.any():
        c = np.flatnonzero(keep)
        L[:, c] = _round_clip((xs[:, c] - q_min[c]) * q_iscale[c], 0, nmax)
    return d, dmin, _pack_scales_k4(ls, lm), _rows(L, QK_K).astype(np.uint8)


def quantize_q4_K(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: (n_rows, n_per_row) float32 -> block_q4_K bytes (n_rows, n_per_row / 256 * 144).

    block_q4_K: d (fp16), dmin (fp16), scales[12], qs[128] (two 4-bit quants per byte: weight l
    of each 64-run in the low nibble, weight l + 32 in the high nibble).
    """
    n_rows = x.shape[0]
    d, dmin, scales, L = _quantize_kx(x, 15, -1.0, 0.1, 20)
    Lr = L.reshape(-1, 4, 2, 32)  # (nb, 64-run, half, l)
    qs = (Lr[:, :, 0, :] | (Lr[:, :, 1, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(n_rows, -1)


def quantize_q5_K(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: (n_rows, n_per_row) float32 -> block_q5_K bytes (n_rows, n_per_row / 256 * 176).

    block_q5_K: d, dmin (fp16), scales[12], qh[32] (bit 2k / 2k+1 of qh[l] is the fifth bit of
    weight l / l + 32 of 64-run k), qs[128] (low nibbles, laid out as in Q4_K).
    """
    n_rows = x.shape[0]
    d, dmin, scales, L = _quantize_kx(x, 31, -0.5, 0.1, 15)
    Lr = L.reshape(-1, 4, 2, 32)  # (nb, 64-run, half, l)
    lo, hi = Lr & 0xF, Lr >> 4
    qs = (lo[:, :, 0, :] | (lo[:, :, 1, :] << 4)).reshape(-1, 128)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]  # (1, 4, 1)
    qh = np.bitwise_or.reduce((hi[:, :, 0, :] << shifts) | (hi[:, :, 1, :] << (shifts + 1)), axis=1)  # (nb, 32)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qh.astype(np.uint8), qs], axis=1)
    return blocks.reshape(n_rows, -1)


def quantize_q6_K(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: (n_rows, n_per_row) float32 -> block_q6_K bytes (n_rows, n_per_row / 256 * 210).

    block_q6_K: ql[128] (low nibbles), qh[64] (high 2 bits), scales[16] (int8), d (fp16).
    A super-block whose sub-block scales are all below GROUP_MAX_EPS is all zero bytes.
    """
    n_rows = x.shape[0]
    xs = _columns(x, 16)  # (16, N) N = 16 sub-blocks per super-block
    nb = xs.shape[1] // 16
    scales, q_iscale, zero_sub = make_qx_quants(xs, 32)
    scales = scales.reshape(nb, 16)
    abs_scales = np.abs(scales)
    first = abs_scales.argmax(axis=1)  # (nb,) C keeps the first largest |scale|
    max_abs = abs_scales[np.arange(nb), first]
    max_scale = scales[np.arange(nb), first]
    zero = max_abs < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = f32(-128) / max_scale  # (nb,)
        d = _fp16(f32(1) / iscale)
        sc = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)  # (nb, 16)
        d_sub = (d.astype(f32)[:, None] * sc.astype(f32)).reshape(-1)  # (N,)
    keep = d_sub == 0  # (N,) a sub-block whose scale is 0 keeps its first fit
    L = np.divide(xs, np.where(keep, f32(1), d_sub))  # (16, N)
    _round_clip(L, -32, 31)
    if keep.any():
        c = np.flatnonzero(keep)
        L[:, c] = np.where(zero_sub[c], f32(-32), _round_clip(xs[:, c] * q_iscale[c], -32, 31))
    L = _rows(L + f32(32), QK_K).astype(np.uint8)  # (nb, 256)
    Lr = L.reshape(nb, 2, 4, 32)  # (nb, 128-half, quarter, l)
    ql = np.concatenate([(Lr[:, :, 0] & 0xF) | ((Lr[:, :, 2] & 0xF) << 4), (Lr[:, :, 1] & 0xF) | ((Lr[:, :, 3] & 0xF) << 4)], axis=2)
    qh = (Lr[:, :, 0] >> 4) | ((Lr[:, :, 1] >> 4) << 2) | ((Lr[:, :, 2] >> 4) << 4) | ((Lr[:, :, 3] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    blocks[zero] = 0
    return blocks.reshape(n_rows, -1)


def _pack_q5(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """5-bit quants (nb, 32) -> qh (nb, 4) (bit j = fifth bit of weight j) and qs (nb, 16) (weight j | weight j+16 << 4)."""
    q = q.astype(np.uint32)
    qh = np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(32, dtype=np.uint32), axis=1).astype("<u4")
    qs = ((q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)).astype(np.uint8)
    return qh.view(np.uint8).reshape(-1, 4), qs


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_0_ref: (n_rows, n_per_row) float32 -> block_q5_0 bytes (n_rows, n_per_row / 32 * 22).

    block_q5_0: d (fp16) = max / -16 where max is the first weight of largest |x|, qh[4], qs[16];
    quants (int8)(x / d + 16.5), at most 31.
    """
    n_rows = x.shape[0]
    b = x.reshape(-1, 32)  # (nb, 32)
    rows = np.arange(b.shape[0])
    mx = b[rows, np.abs(b).argmax(axis=1)]
    d = mx / f32(-16)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, f32(1) / d, f32(0))
    q = np.minimum(np.trunc(b * inv[:, None] + f32(16.5)), 31).astype(np.uint8)
    qh, qs = _pack_q5(q)
    blocks = np.concatenate([_fp16(d).view(np.uint8).reshape(-1, 2), qh, qs], axis=1)
    return blocks.reshape(n_rows, -1)


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_1_ref: (n_rows, n_per_row) float32 -> block_q5_1 bytes (n_rows, n_per_row / 32 * 24).

    block_q5_1: d = (max - min) / 31, m = min (both fp16), qh[4], qs[16]; quants (uint8)((x - min) / d + 0.5).
    """
    n_rows = x.shape[0]
    b = x.reshape(-1, 32)  # (nb, 32)
    mn = b.min(axis=1)
    d = (b.max(axis=1) - mn) / f32(31)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, f32(1) / d, f32(0))
    q = np.trunc((b - mn[:, None]) * inv[:, None] + f32(0.5)).astype(np.uint8)
    qh, qs = _pack_q5(q)
    blocks = np.concatenate([_fp16(d).view(np.uint8).reshape(-1, 2), _fp16(mn).view(np.uint8).reshape(-1, 2), qh, qs], axis=1)
    return blocks.reshape(n_rows, -1)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref: (n_rows, n_per_row) float32 -> block_q8_0 bytes (n_rows, n_per_row / 32 * 34).

    block_q8_0: d = max|x| / 127 (fp16), qs[32] = roundf(x / d). The gguf package's Q8_0
    quantizer does exactly this arithmetic in float32 (checked against a transcription of the C
    in tests/test_quantize.py), so it is used as is.
    """
    return gguf_quantize(np.asarray(x, dtype=f32), GGMLQuantizationType.Q8_0)


def quantize_f16(x: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 row by row: (n_rows, n_per_row) float32 -> F16 bytes (n_rows, n_per_row * 2)."""
    return np.ascontiguousarray(_fp16(x)).view(np.uint8).reshape(x.shape[0], -1)


QUANTIZERS = {
    GGMLQuantizationType.Q4_K: quantize_q4_K,
    GGMLQuantizationType.Q5_K: quantize_q5_K,
    GGMLQuantizationType.Q6_K: quantize_q6_K,
    GGMLQuantizationType.Q5_0: quantize_q5_0,
    GGMLQuantizationType.Q5_1: quantize_q5_1,
    GGMLQuantizationType.Q8_0: quantize_q8_0,
    GGMLQuantizationType.F16: quantize_f16,
}


def quantize(x: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Encode float32 rows as `ggml_type`: (n_rows, n_per_row) -> uint8 (n_rows, row bytes).

    Types: Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0 (llama.cpp reference arithmetic) and F16.
    Raises ValueError for another type or rows that are not a multiple of the block size
    (the planner in runtime/quantize.py never asks for either).
    """
    block, _ = GGML_QUANT_SIZES[ggml_type]
    x = np.asarray(x, dtype=f32)
    if x.ndim != 2 or x.shape[1] % block:
        raise ValueError(f"{ggml_type.name} needs rows that are a multiple of {block}, got shape {x.shape}")
    if ggml_type not in QUANTIZERS:
        raise ValueError(f"no quantizer for {ggml_type.name}")
    step = max(1, CACHE_WEIGHTS // x.shape[1])  # rows per pass, so the scratch arrays stay in cache
    return np.concatenate([QUANTIZERS[ggml_type](x[r : r + step]) for r in range(0, x.shape[0], step)])
