"""Two products of one quantized x on int8 tensor cores in one launch (kernels_cu/gemv_mma_staged.cu
gemv_mma_pair): the speculative verify step's q/k/v when they are two runs of Q4_K_M's mix, q|k
in Q4_K and v in Q6_K (planar). Each part runs gemv_mma's staged product on its share of the grid
(the same integer dots and scales; its KS, the warps that split a row's blocks, chosen for that
share, so the float sums may run in another order than gemv_mma's); the second launch and its
kernel boundary are gone (flag K4_MMA8_PAIR; decode's one-token pair is gemv_pair.py).

Like gemv_mma: validates on the host (ValueError), allocates nothing, never synchronizes, can be
captured in a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from k4.runtime.trace import Trace

from .gemv_mma import STAGE_BYTES, STEP_COST, _mma_plan, check_weight, mma_ks, product_args, uses_mma8
from .launch import allow_shared, blocks_per_sm, capturing, device_limits, launch
from .quant_kernels import MMA8_PAIR_TYPES, _kernel, gemv_mma_pair_name

if TYPE_CHECKING:
    from .gemv_batch import Q8Rows
    from .matmul import DeviceWeight

PAIR_WARPS = 16  # gemv_mma_pair's parts: gemv_mma_staged's 16-warp instances


def pairs(a: DeviceWeight, b: DeviceWeight, n_tok: int) -> bool:
    """Whether gemv_mma_pair can multiply a and b (in this order) for n_tok tokens in one launch:
    planar Q4_K and Q6_K (MMA8_PAIR_TYPES) rows of one length, neither a gate/up interleave, each
    product of n_tok tokens on gemv_mma (uses_mma8) in a 16-warp staged instance, both with or both
    without clusters (gemv_mma.mma8_cluster)."""
    if (a.ggml_type, b.ggml_type) != MMA8_PAIR_TYPES or not (a.planar and b.planar) or a.shape[1] != b.shape[1] or a.glu or b.glu:
        return False
    if not (uses_mma8(a, n_tok) and uses_mma8(b, n_tok)):
        return False
    pa, pb = _mma_plan(a, None), _mma_plan(b, None)
    return pa[5] > 0 and pb[5] > 0 and pa[2][0] == pb[2][0] == 32 * PAIR_WARPS and pa[6] == pb[6]


def _pair_plan(a: DeviceWeight, b: DeviceWeight):
    """(kernel, grid, shared_mem, cluster, (ks_a, stages_a), (ks_b, stages_b), split) of
    gemv_mma_pair on a and b, cached on a: the shared memory the larger part needs, as many blocks
    as fit at once in whole clusters, `split` of them (a multiple of the cluster) on a's rows. Each
    part's KS and blocks come from mma_ks on its share; the split minimizes the larger part's
    busiest warp: its steps times (256-weight blocks per warp + STEP_COST) times its stage bytes."""
    key = ("mma8_pair", b.shape[0])
    plan = a._plans.get(key)
    if plan is not None:
        return plan
    (_, _, _, smem_a, _, stages_a, cl), (_, _, _, smem_b, _, stages_b, _) = _mma_plan(a, None), _mma_plan(b, None)
    kernel = _kernel("gemv_mma_staged.cu", gemv_mma_pair_name(cl), a.evict_first)
    smem = max(smem_a, smem_b)
    allow_shared(kernel, smem)
    clusters = device_limits()[0] * blocks_per_sm(kernel, 32 * PAIR_WARPS, smem) // cl
    nblk = -(-(a.shape[1] // 256) // cl)  # a block's share of a row's 256-weight blocks

    def part(w: DeviceWeight, c: int) -> tuple[int, int, int]:  # (cost of the busiest warp, KS, clusters used)
        ks, grid = mma_ks(w.shape[0], 256 * nblk, PAIR_WARPS, c)
        steps = -(-w.shape[0] // (16 * (PAIR_WARPS // ks)))
        return -(-steps // grid) * (-(-nblk // ks) + STEP_COST) * STAGE_BYTES[w.ggml_type], ks, grid

    best = None
    for c_b in range(1, clusters):
        (cost_a, ks_a, g_a), (cost_b, ks_b, g_b) = part(a, clusters - c_b), part(b, c_b)
        score = (max(cost_a, cost_b), cost_a + cost_b)
        if best is None or score < best[0]:
            best = (score, ks_a, g_a, ks_b, g_b)
    _, ks_a, g_a, ks_b, g_b = best
    plan = (kernel, (cl * (g_a + g_b),), smem, cl, (ks_a, stages_a), (ks_b, stages_b), cl * g_a)
    a._plans[key] = plan
    return plan


_NO_NQ = (np.uint64(0), np.uint64(0), np.uint64(0), np.int32(0))  # gemv_mma_staged's NQ arguments, unused


def gemv_mma_pair(a: DeviceWeight, b: DeviceWeight, X, Ya, Yb, *, bias_a=None, bias_b=None, x_q8: Q8Rows | None = None,
                  stream=None, trace: Trace | None = None, pdl: bool | None = None) -> None:
    """Ya[t] = a @ X[t] (+ bias_a), Yb[t] = b @ X[t] (+ bias_b) for n_tok = 1 .. MMA8_TOKENS rows of
    X, one launch: gemv_mma's products (x quantized the same way, or x_q8's), within float32
    rounding of its outputs (the part's KS may differ).

    a, b: matmul.DeviceWeight that pairs(a, b, n_tok) accepts. X: (n_tok, n_in) float32 as
    gemv_mma's; Ya (n_tok, a's n_out), Yb (n_tok, b's n_out) float32 views as gemv_mma's Y; biases
    (n_out,) float32 or None. x_q8: X already quantized (gemv_mma's x_q8), read by both parts.
    Raises ValueError where pairs says no, or on what gemv_mma rejects in either product's
    arguments.
    """
    n_tok = X.shape[0] if getattr(X, "ndim", 0) == 2 else 0
    for w in (a, b):
        check_weight(w)
    if not pairs(a, b, n_tok):
        raise ValueError(f"gemv_mma_pair multiplies planar {'/'.join(t.name for t in MMA8_PAIR_TYPES)} weights of one row "
                         f"length on 16-warp gemv_mma instances, not {a.ggml_type.name} {a.shape} and {b.ggml_type.name} "
                         f"{b.shape} for {n_tok} tokens")
    kernel, grid, smem, cl, (ks_a, st_a), (ks_b, st_b), split = _pair_plan(a, b)
    args_a = product_args(a, X, Ya, None, bias_a, x_q8, ks_a, st_a)[0] + _NO_NQ
    args_b = product_args(b, X, Yb, None, bias_b, x_q8, ks_b, st_b)[0] + _NO_NQ
    if pdl is None:  # as gemv_mma
        pdl = a.pdl and capturing(stream)
    launch(kernel, grid, (32 * PAIR_WARPS,), args_a + args_b + (np.int32(split),), smem, stream, trace, pdl, cluster=cl)
