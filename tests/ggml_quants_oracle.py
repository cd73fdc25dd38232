"""A scalar transcription of ggml-quants.c's reference quantizers (float32 scalars, loops in C
order): the oracle tests/test_quantize.py holds runtime/kquants.py to, and
hard_blocks, the weights that take the special paths."""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as T

F = np.float32
EPS = F(1e-15)


def c_nearest_int(v) -> int:
    bits = np.array([F(v) + F(12582912.0)], dtype=np.float32).view(np.int32)[0]
    return int(bits & 0x7FFFFF) - 0x400000


def c_fp16(v) -> bytes:
    return np.array([v], dtype=np.float32).astype(np.float16).tobytes()


def c_make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep):
    n = len(x)
    mn, mx, sum_w = x[0], x[0], w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return F(0), -mn, [0] * n
    iscale = F(nmax) / (mx - mn)
    scale = F(1) / iscale
    best_error = F(0)
    L = []
    for i in range(n):
        L.append(max(0, min(nmax, c_nearest_int(iscale * (x[i] - mn)))))
        diff = scale * F(L[i]) + mn - x[i]
        best_error += w[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / (mx - mn)
        sum_l = sum_l2 = sum_xl = F(0)
        laux = []
        for i in range(n):
            laux.append(max(0, min(nmax, c_nearest_int(iscale * (x[i] - mn)))))
            sum_l += w[i] * F(laux[i])
            sum_l2 += w[i] * F(laux[i]) * F(laux[i])
            sum_xl += w[i] * F(laux[i]) * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F(0)
                this_scale = sum_xl / sum_l2
            cur_error = F(0)
            for i in range(n):
                diff = this_scale * F(laux[i]) + this_min - x[i]
                cur_error += w[i] * (diff * diff)
            if cur_error < best_error:
                L, best_error, scale, mn = laux, cur_error, this_scale, this_min
    return scale, -mn, L


def c_make_qx_quants(x, nmax):
    mx = amax = F(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < EPS:
        return F(0), [0] * len(x)
    iscale = F(-nmax) / mx

    def sums(iscale):
        sumlx = suml2 = F(0)
        ls = []
        for v in x:
            l = max(-nmax, min(nmax - 1, c_nearest_int(iscale * v)))
            ls.append(l + nmax)
            w = v * v
            sumlx += w * v * F(l)
            suml2 += w * F(l) * F(l)
        return ls, sumlx, suml2

    L, sumlx, suml2 = sums(iscale)
    scale = sumlx / suml2 if suml2 else F(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        ls, sumlx, suml2 = sums(-(F(nmax) + F(0.1) * F(step)) / mx)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L, scale = ls, sumlx / suml2
            best = scale * sumlx
    return scale, L


def c_kx_block(x, nmax, rmin, rdelta, nstep):
    """The shared part of quantize_row_q4_K_ref / q5_K_ref for one super-block."""
    L, scales, mins = [0] * 256, [], []
    max_scale = max_min = F(0)
    for j in range(8):
        sub = x[32 * j: 32 * j + 32]
        sum_x2 = F(0)
        for v in sub:
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / F(32))
        w = [av_x + abs(v) for v in sub]
        s, m, l = c_make_qkx2_quants(sub, w, nmax, rmin, rdelta, nstep)
        scales.append(s)
        mins.append(m)
        L[32 * j: 32 * j + 32] = l
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    with np.errstate(over="ignore"):  # 63 / a subnormal max is inf in C too
        inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
        inv_min = F(63) / max_min if max_min > 0 else F(0)
    sc = [0] * 12
    ls_all, lm_all = [], []
    for j in range(8):
        ls = min(63, c_nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, c_nearest_int(inv_min * mins[j]) & 0xFF)
        ls_all.append(ls)
        lm_all.append(lm)
        if j < 4:
            sc[j], sc[j + 4] = ls, lm
        else:
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
    d, dmin = c_fp16(max_scale / F(63)), c_fp16(max_min / F(63))
    df, dminf = np.frombuffer(d, np.float16)[0].astype(F), np.frombuffer(dmin, np.float16)[0].astype(F)
    for j in range(8):
        dd = df * F(ls_all[j])
        if dd == 0:
            continue
        dm = dminf * F(lm_all[j])
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, c_nearest_int((x[32 * j + ii] + dm) / dd)))
    return d + dmin + bytes(sc), L


def c_q4_K(x):
    head, L = c_kx_block(x, 15, -1.0, 0.1, 20)
    qs = [L[j + l] | (L[j + l + 32] << 4) for j in range(0, 256, 64) for l in range(32)]
    return head + bytes(qs)


def c_q5_K(x):
    head, L = c_kx_block(x, 31, -0.5, 0.1, 15)
    qh, ql = [0] * 32, []
    m1, m2 = 1, 2
    for n in range(0, 256, 64):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= m1
            if l2 > 15:
                l2 -= 16
                qh[j] |= m2
            ql.append(l1 | (l2 << 4))
        m1, m2 = m1 << 2, m2 << 2
    return head + bytes(qh) + bytes(ql)


def c_q6_K(x):
    L, scales = [], []
    max_scale = max_abs = F(0)
    for ib in range(16):
        s, l = c_make_qx_quants(x[16 * ib: 16 * ib + 16], 32)
        scales.append(s)
        L += l
        if abs(s) > max_abs:
            max_abs, max_scale = abs(s), s
    if max_abs < EPS:
        return bytes(210)
    iscale = F(-128) / max_scale
    d = c_fp16(F(1) / iscale)
    sc = [np.int32(min(127, c_nearest_int(iscale * s))).astype(np.int8) for s in scales]
    for j in range(16):
        dd = np.frombuffer(d, np.float16)[0].astype(F) * F(sc[j])
        if dd == 0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, c_nearest_int(x[16 * j + ii] / dd))) + 32
    ql, qh = [0] * 128, [0] * 64
    for j in range(0, 256, 128):
        for l in range(32):
            q = [L[j + l + 32 * k] for k in range(4)]
            ql[j // 2 + l] = (q[0] & 0xF) | ((q[2] & 0xF) << 4)
            ql[j // 2 + l + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4)
            qh[j // 4 + l] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6)
    return bytes(ql) + bytes(qh) + np.array(sc, dtype=np.int8).tobytes() + d


def c_q5_pack(q):
    qh = 0
    for j in range(16):
        qh |= ((q[j] & 0x10) >> 4) << j
        qh |= ((q[j + 16] & 0x10) >> 4) << (j + 16)
    return qh.to_bytes(4, "little") + bytes((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4) for j in range(16))


def c_q5_0(x):
    amax = mx = F(0)
    for v in x:
        if amax < abs(v):
            amax, mx = abs(v), v
    d = mx / F(-16)
    inv = F(1) / d if d else F(0)
    return c_fp16(d) + c_q5_pack([min(31, int(x[j] * inv + F(16.5))) for j in range(32)])


def c_q5_1(x):
    mn, mx = F(np.finfo(F).max), F(-np.finfo(F).max)
    for v in x:
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    d = (mx - mn) / F(31)
    inv = F(1) / d if d else F(0)
    return c_fp16(d) + c_fp16(mn) + c_q5_pack([int((x[j] - mn) * inv + F(0.5)) for j in range(32)])


def c_roundf(v) -> int:
    """C roundf: half away from zero (exact in double for a float32 argument)."""
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))


def c_q8_0(x):
    amax = F(0)
    for v in x:
        amax = max(amax, abs(v))
    d = amax / F(127)
    inv = F(1) / d if d else F(0)
    return c_fp16(d) + bytes(c_roundf(v * inv) & 0xFF for v in x)


ORACLES = {T.Q4_K: (c_q4_K, 256), T.Q5_K: (c_q5_K, 256), T.Q6_K: (c_q6_K, 256), T.Q5_0: (c_q5_0, 32), T.Q5_1: (c_q5_1, 32), T.Q8_0: (c_q8_0, 32)}


def hard_blocks(n: int, seed: int) -> np.ndarray:
    """(n + 12) * 256 float32 weights: ordinary blocks and the cases that take special paths (zero
    and constant sub-blocks, one-signed blocks, outliers, fp16 underflow, exact ties, -0.0, spans
    too small for float rounding), and two blocks found by search whose bytes change if a scale
    search takes one step more than ggml's (make_qx_quants' -9 .. 9 for Q6_K, make_qkx2_quants'
    nstep 15 for Q5_K), which random blocks seldom tell (about 1 in 500 for Q5_K, 1 in 37,000 for Q6_K)."""
    rng = np.random.default_rng(seed)
    blocks = [rng.standard_normal(256) * 0.02 for _ in range(n)]
    b = rng.standard_normal(256) * 0.05
    b[:32] = 0
    b[32:64] = -0.25
    b[64:96] = 1e-7 * rng.standard_normal(32)
    blocks.append(b)
    blocks.append(-np.abs(rng.standard_normal(256)) - 0.5)
    blocks.append(np.abs(rng.standard_normal(256)) + 0.1)
    o = rng.standard_normal(256) * 0.01
    o[7] = 3.0
    o[200] = -5.0
    blocks.append(o)
    blocks.append(rng.standard_normal(256) * 1e-9)
    blocks.append(rng.integers(-8, 8, 256) * 0.125)
    blocks.append(np.zeros(256))
    z = rng.standard_normal(256)
    z[::3] = -0.0
    blocks.append(z)
    blocks.append(rng.standard_normal(256) * 1e-36)  # spans below 1e-30: kquants' integer rounding path
    blocks.append(np.where(rng.random(256) < 0.1, -1.0, 1e-7 * rng.standard_normal(256)))  # sparse outliers
    blocks.append(np.random.default_rng(5).standard_t(3, size=(400, 256))[399].astype(F) * F(0.02))
    blocks.append(np.random.default_rng(0).laplace(size=(216, 256))[215].astype(F) * F(0.02))
    return np.concatenate(blocks).astype(np.float32)
