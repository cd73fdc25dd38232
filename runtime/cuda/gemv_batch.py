"""Matrix-vector products of a few tokens that read the weights once (kernels_cu/gemv_batch.cu
gemv_q8_batch), for quantized weights: speculative decoding's verify step and short prefills.

gemv on each of n tokens reads all of W n times; gemv_batch reads it once and multiplies each
weight chunk with up to BATCH_TOKENS x vectors, quantized as gemv quantizes its x (llama.cpp's
q8_1 idea), so each token's result is bit-identical to gemv on that token alone. matmul.matmul's
gemv path (at most GEMV_MAX_TOKENS tokens, or every prefill with K4_PREFILL_TC=0) and
forward.py's gate/up epilogue path call gemv_rows, which runs groups of up to BATCH_TOKENS rows,
on int8 tensor cores (runtime/cuda/gemv_mma.py) where that applies.
Decode (one token) keeps matmul.gemv with its fused norm and q8 handoff. quantize_rows writes X
quantized once (Q8Rows) for gemv_batch's x_q8, so its blocks copy 1.4 bytes per value instead
of reading 4 bytes per value of every row from L2 (docs/PERF.md).

Like matmul.py's entry points: validates on the host (ValueError: programming errors of the
caller), allocates nothing, never synchronizes, can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
import numpy as np

from k4.runtime.trace import Trace

from .batch_args import check_products, check_rows
from .constants import q8x_bytes
from .device_weight import DeviceWeight
from .gemv_mma import gemv_mma, uses_mma8
from .launch import allow_shared, blocks_per_sm, capturing, device_limits, launch, null_or
from .q8_handoff import Q8Rows
from .quant_kernels import BATCH_TOKENS, BATCH_VARIANT, _gemv_batch_name, _kernel
from .quant_types import QUANT


def quantize_rows(X, out: Q8Rows, stream=None, trace: Trace | None = None, pdl: bool | None = None) -> None:
    """out = X quantized as gemv_batch quantizes it (kernels_cu/gemv_batch.cu quantize_q8_rows),
    one launch. X: (out.n_tok, out.n) float32, rows contiguous, 16-byte aligned, a multiple of 16
    bytes apart; out.n a multiple of 32; out.data at least Q8Rows.nbytes(n_tok, n) uint8 bytes
    (the padding between the vectors is left as it is). pdl: as gemv_batch (default: while the
    stream is captured). Raises ValueError on wrong shapes, dtypes, alignment or size."""
    if out.n % 32 or out.n_tok < 1:
        raise ValueError(f"quantized rows need n a multiple of 32 and at least one row, got {out.n_tok} x {out.n}")
    x_stride = check_rows("X", X, (out.n_tok, out.n), align16=True)
    need = Q8Rows.nbytes(out.n_tok, out.n)
    if out.data.dtype != np.uint8 or out.data.nbytes < need:
        raise ValueError(f"{out.n_tok} quantized rows of {out.n} need {need} uint8 bytes, got {out.data.dtype} ({out.data.nbytes} bytes)")
    units = out.n_tok * out.n // 16
    args = (X, np.int32(x_stride), np.int32(out.n_tok), np.int32(out.n), np.int32(out.swizzle), out.data)
    pdl = capturing(stream) if pdl is None else pdl
    launch(_kernel("gemv_batch.cu", "quantize_q8_rows"), (math.ceil(units / 256),), (256,), args, 0, stream, trace, pdl)


def _batch_plan(w: DeviceWeight, n_tok: int, variant: tuple[int, int, int, int] | None):
    """(kernel, grid, block, shared_mem) of gemv_q8_batch on w for n_tok tokens, cached in
    w._plans. Shared memory: n_tok q8 x vectors; the grid: as many blocks as fit at once, at most
    one per group of R outputs."""
    key = ("batch", variant, n_tok)
    plan = w._plans.get(key)
    if plan is not None:
        return plan
    n_out, n_in = w.shape
    if w.glu:
        n_out //= 2
    warps, _, _, rows = variant or BATCH_VARIANT[w.ggml_type]
    kernel = _kernel("gemv_batch.cu", _gemv_batch_name(w.ggml_type, w.planar, variant, w.glu, w.glu_act), w.evict_first)
    smem = n_tok * q8x_bytes(n_in)
    allow_shared(kernel, smem)
    grid = min(device_limits()[0] * blocks_per_sm(kernel, 32 * warps, smem), -(-n_out // rows))
    plan = (kernel, (grid,), (32 * warps,), smem)
    w._plans[key] = plan
    return plan


def gemv_batch(w: DeviceWeight, X, Y, *, residual=None, bias=None, stream=None, trace: Trace | None = None,
               pdl: bool | None = None, variant: tuple[int, int, int, int] | None = None, x_q8: Q8Rows | None = None) -> None:
    """Y[t] = w @ X[t] (+ bias) (+ residual[t]) for n_tok = 1 .. BATCH_TOKENS tokens, one kernel
    launch reading w once; with w.glu, Y[t] = act(gate @ X[t]) * (up @ X[t]), act w.glu_act.

    w: a device_weight.DeviceWeight of a quantized type (quant_types.QUANT). X: (n_tok, n_in)
    float32, rows contiguous, 16-byte aligned, any multiple of 16 bytes apart. Y: (n_tok, n_out)
    float32 ((n_tok, n_out / 2) for w.glu), rows contiguous, any whole number of floats apart (a
    column view of a stacked output). residual: like Y or None, may be Y itself; bias: (n_out,)
    float32, contiguous, or None, added to every row; neither with w.glu. pdl, stream, trace: as
    matmul.gemv. variant: another compiled (WARPS, U, PF, R) instance
    (quant_kernels.EXTRA_BATCH_VARIANTS). x is quantized to 8 bits per 32 values as by gemv:
    each row of Y equals gemv's result for that row bit for bit. x_q8: X already quantized by
    quantize_rows for w's swizzle (n_tok rows of n_in): copied instead of X, which is then not
    read (still checked), with the same results.
    Raises ValueError on a float weight type, n_tok outside 1..BATCH_TOKENS, wrong shapes,
    dtypes, strides or alignment, residual/bias with w.glu, or an x_q8 of other rows or swizzle.
    """
    if w.ggml_type not in QUANT:
        raise ValueError(f"gemv_batch multiplies quantized weights; {w.ggml_type.name} runs one gemv per token")
    n_tok, n_out, x_stride, y_stride, r_stride = check_products("gemv_batch", w, X, Y, residual, bias, BATCH_TOKENS)
    n_in = w.shape[1]
    if x_q8 is not None and x_q8.parts is not None:
        raise ValueError("gemv_batch does not read an NQ handoff (x_q8 with parts): gemv_mma does")
    if x_q8 is not None and (x_q8.n_tok, x_q8.n, x_q8.swizzle) != (n_tok, n_in, QUANT[w.ggml_type].x_swizzle):
        raise ValueError(f"x_q8 holds {x_q8.n_tok} rows of {x_q8.n} for swizzle {x_q8.swizzle}; this product needs "
                         f"{n_tok} of {n_in} for {QUANT[w.ggml_type].x_swizzle}")
    if x_q8 is not None and x_q8.data.nbytes < Q8Rows.nbytes(n_tok, n_in):
        raise ValueError(f"x_q8 holds {x_q8.data.nbytes} bytes, {n_tok} rows of {n_in} need {Q8Rows.nbytes(n_tok, n_in)}")
    kernel, grid, block, smem = _batch_plan(w, n_tok, variant)
    args = (w.data, X, np.int32(x_stride), Y, np.int32(y_stride), null_or(residual), np.int32(r_stride), null_or(bias),
            np.int32(n_out), np.int32(n_in), np.int32(n_tok), null_or(x_q8 and x_q8.data))
    if pdl is None:  # as gemv: eagerly the driver-API launch costs more host time than it saves
        pdl = w.pdl and capturing(stream)
    launch(kernel, grid, block, args, smem, stream, trace, pdl)


def gemv_rows(w: DeviceWeight, X, Y, *, residual=None, bias=None, stream=None, trace: Trace | None = None,
              x_q8: Q8Rows | None = None) -> None:
    """The few-token products over any number of tokens: rows of X in groups of up to
    BATCH_TOKENS, one launch each (ceil(n_tok / BATCH_TOKENS) reads of w): gemv_mma.gemv_mma
    where gemv_mma.uses_mma8 says so (Q4_K and Q6_K, 3 to 8 rows, flag K4_MMA8), else
    gemv_batch. x_q8: None, or X (at most BATCH_TOKENS rows) already quantized (Q8Rows, e.g. by
    Ops.rms_norm): gemv_mma takes it whatever its swizzle, gemv_batch where the swizzle is w's;
    else it is not used. Arguments as gemv_batch, any n_tok >= 1. Raises ValueError as gemv_batch."""
    n_tok = X.shape[0] if getattr(X, "ndim", 0) == 2 else 0
    if n_tok < 1:
        raise ValueError(f"X must be a 2-D array of at least one row, got shape {getattr(X, 'shape', None)}")
    for i in range(0, n_tok, BATCH_TOKENS):
        rows = slice(i, i + BATCH_TOKENS)
        mma = uses_mma8(w, min(BATCH_TOKENS, n_tok - i))
        if x_q8 is not None and x_q8.parts is not None and not (mma and n_tok <= BATCH_TOKENS):
            raise ValueError(f"an NQ handoff (x_q8 with parts) is read only by gemv_mma; {w.ggml_type.name} {w.shape} "
                             f"runs {n_tok} tokens otherwise")
        q8 = x_q8 if x_q8 is not None and n_tok <= BATCH_TOKENS and (mma or x_q8.swizzle == QUANT[w.ggml_type].x_swizzle) else None
        product = gemv_mma if mma else gemv_batch
        product(w, X[rows], Y[rows], residual=None if residual is None else residual[rows], bias=bias,
                stream=stream, trace=trace, x_q8=q8)
