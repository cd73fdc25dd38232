"""Two matrix-vector products of one x in one launch (kernels_cu/gemv.cu gemv_q8_pair): decode's
q/k/v when they are two runs of different quantized types, as in llama.cpp's K-quant mixes
(Q4_K_M: q|k in Q4_K, v in Q6_K in about half the layers). Each output has the bits
matmul.gemv gives it; the second launch, its kernel boundary and its x prologue are gone
(flag K4_QKV_PAIR, docs/PERF.md session 17). The grid's blocks are split between the two
matrices (split_blocks, session 26)."""

from __future__ import annotations

import numpy as np

from k4.runtime.trace import Trace

from .arg_checks import check_array, check_post
from .constants import q8x_bytes
from .device_weight import DeviceWeight
from .gemv_choice import NQ_TYPES, QKV_PAIRS, gemv_variant
from .launch import allow_shared, blocks_per_sm, capturing, device_limits, launch, null_or
from .quant_kernels import _kernel, gemv_pair_name
from .quant_types import QUANT


def pairs(w1: DeviceWeight, w2: DeviceWeight) -> bool:
    """Whether gemv_pair can multiply w1 and w2 (in this order) in one launch: a QKV_PAIRS type
    pair, one layout, rows of the same length for which each weight's own product takes its
    type's default variant (gemv_choice.gemv_variant), no gate/up interleave."""
    return ((w1.ggml_type, w2.ggml_type) in QKV_PAIRS and w1.planar == w2.planar and w1.shape[1] == w2.shape[1]
            and all(gemv_variant(w.ggml_type, *w.shape) == QUANT[w.ggml_type].gemv for w in (w1, w2))
            and not w1.glu and not w2.glu)


def split_blocks(grid: int, warps: int, n1: int, row_bytes1: int, n2: int, row_bytes2: int) -> int:
    """The blocks of a gemv_q8_pair grid of `grid` blocks (`warps` warps each, grid >= 2) that take
    w2's n2 rows (row_bytes2 bytes each); the other grid - b2 take w1's n1. Rows go round-robin
    over a part's warps, so the busiest warp of a part holds its rows' count over the part's warps,
    rounded up, times the row's bytes: b2 minimizes the larger of the two parts' busiest warps, then
    the larger of their bytes per block (each block has a multiprocessor's share of the bandwidth).
    """
    def cost(b2: int) -> tuple[int, float]:
        warp = max(-(-n2 // (b2 * warps)) * row_bytes2, -(-n1 // ((grid - b2) * warps)) * row_bytes1)
        return warp, max(n2 * row_bytes2 / b2, n1 * row_bytes1 / (grid - b2))
    return min(range(1, grid), key=cost)


def _plan(w1: DeviceWeight, w2: DeviceWeight, post: bool, nx: bool = False):
    """(kernel, grid, block, shared bytes, b2) of gemv_q8_pair for w1 and w2, cached on w1: the
    warps of both types' own products, the grid as many blocks as fit at once, at most one per
    output, b2 of them on w2's rows (split_blocks); nx: the instance that reads an NQ handoff."""
    key = ("pair", w2.ggml_type, w2.shape[0], post, nx)
    plan = w1._plans.get(key)
    if plan is not None:
        return plan
    n_in = w1.shape[1]
    kernel = _kernel("gemv.cu", gemv_pair_name(w1.ggml_type, w2.ggml_type, w1.planar, nx), w1.evict_first)
    smem = q8x_bytes(n_in) + (8 * n_in if post else 0)
    allow_shared(kernel, smem)
    warps = QUANT[w1.ggml_type].gemv[0]
    grid = max(2, min(device_limits()[0] * blocks_per_sm(kernel, 32 * warps, smem), w1.shape[0] + w2.shape[0]))
    b2 = split_blocks(grid, warps, w1.shape[0], w1.nbytes // w1.shape[0], w2.shape[0], w2.nbytes // w2.shape[0])
    plan = (kernel, (grid,), (32 * warps,), smem, b2)
    w1._plans[key] = plan
    return plan


def gemv_pair(w1: DeviceWeight, w2: DeviceWeight, x, y1, y2, *, bias1=None, bias2=None, norm=None, post=None,
              stream=None, trace: Trace | None = None, pdl: bool | None = None, x_q8=None) -> None:
    """y1 = w1 @ x (+ bias1) and y2 = w2 @ x (+ bias2) in one kernel launch, for pairs(w1, w2).

    x: (n_in,) float32, 16-byte aligned; y1: (n1,), y2: (n2,) float32 (n1, n2: the weights'
    rows); bias1, bias2: like y1, y2, or None. norm: None or (norm_w, eps), the RMSNorm folded
    into the prologue; post: None or (t, post_w, x_out), Gemma's post-norm folded in (with
    norm), both as matmul.gemv takes them. pdl: programmatic dependent launch (default: the
    weights' pdl while the stream is captured). Each block takes rows of one matrix and
    quantizes x to 8 bits per 32 values (llama.cpp's q8_1 scheme) in that matrix's layout, as
    matmul.gemv does, so both outputs are the bits two gemv calls give. x_q8: None, or an NQ
    handoff (q8_handoff.Q8Vector with parts, matmul.gemv norm_out) of n_in values in any
    swizzle, standing for RMSNorm(x) * norm_w (then no norm or post): each block copies it into
    its type's swizzle. Raises ValueError when the weights do not pair or on wrong shapes,
    dtypes or alignment."""
    if not pairs(w1, w2):
        raise ValueError(f"no paired product of {w1.ggml_type.name} {w1.shape} and {w2.ggml_type.name} {w2.shape}")
    (n1, n_in), n2 = w1.shape, w2.shape[0]
    check_array("x", x, (n_in,), align16=True)
    check_array("y1", y1, (n1,))
    check_array("y2", y2, (n2,))
    for name, b, n in (("bias1", bias1, n1), ("bias2", bias2, n2)):
        if b is not None:
            check_array(name, b, (n,))
    norm_w, eps = (None, 0.0) if norm is None else norm
    if norm_w is not None:
        check_array("norm weight", norm_w, (n_in,), align16=True)
    post_t, post_w, x_out = check_post(post, x, n_in, norm_w is not None, False)
    if x_q8 is not None:
        if (x_q8.parts is None or x_q8.n != n_in or norm is not None or post is not None
                or not all(t in NQ_TYPES for t in (w1.ggml_type, w2.ggml_type))):
            raise ValueError(f"gemv_pair's x_q8 is an NQ handoff of {n_in} values, for NQ types, without norm or post")
        eps = x_q8.eps
    kernel, grid, block, smem, b2 = _plan(w1, w2, post is not None, x_q8 is not None)
    args = (w1.data, w2.data, x, y1, y2, null_or(bias1), null_or(bias2), null_or(norm_w), np.float32(eps),
            np.int32(n1), np.int32(n2), np.int32(n_in), null_or(post_t), null_or(post_w), null_or(x_out), np.int32(b2),
            null_or(x_q8 and x_q8.data), np.int32(x_q8.swizzle if x_q8 else 0), null_or(x_q8 and x_q8.parts),
            np.int32(x_q8.n_parts if x_q8 else 0))
    if pdl is None:
        pdl = w1.pdl and capturing(stream)
    launch(kernel, grid, block, args, smem, stream, trace, pdl)
