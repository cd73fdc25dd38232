"""Stream-K matrix-vector products for decode's residual products that hand the next RMSNorm's
products their input (kernels_cu/gemv_streamk.cu gemv_q8_sk; flag K4_STREAM_K).

gemv.cu's NQ instances give each thread block whole 32-output groups. Where the groups are fewer
than the blocks, blocks idle and the busy ones set the time: Qwen2.5 7B's 3,584-output down
product (112 groups on the H200's 132 multiprocessors), TinyLlama's 2,048 outputs (64 groups,
which gemv's rule refuses the handoff: matmul.norm_q8_blocks). gemv_q8_sk cuts the product into
(group, SK_UNIT inputs) items, spread evenly over the grid; a group split between blocks is summed
by the last of them, in a fixed order (the kernel's header). The handoff is gemv's: y * norm_w
quantized into y_q8 (a q8_handoff.Q8Vector), and a sum of y^2 per group in parts.

Importable without CuPy (sk_grid is a plain rule); gemv_sk launches.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from ..kquants import QK_K
from ..trace import Trace
from .constants import SK_SLOTS, SK_UNIT, q8x_bytes
from .quant_kernels import NQ_TYPES, QUANT, _kernel, sk_name


def sk_pieces(groups: int, units: int, grid: int) -> int:
    """The most blocks one group's items are split over when `grid` blocks take groups * units
    items (group-major) in even runs, block b the items [b total / grid, (b + 1) total / grid)
    (gemv_q8_sk's split)."""
    total = groups * units

    def owner(i: int) -> int:  # the block whose run holds item i
        return -(-(i + 1) * grid // total) - 1

    return max(owner((g + 1) * units - 1) - owner(g * units) + 1 for g in range(groups))


def sk_grid(t: T, n_out: int, n_in: int, glu: bool, slots: int) -> int:
    """The grid of gemv_q8_sk on a matrix of type t, n_out outputs of n_in inputs, on a GPU
    running `slots` of its blocks at once (multiprocessors times blocks per multiprocessor), or 0
    where it does not apply or gains nothing: a glu weight, a type outside NQ_TYPES, n_out not a
    multiple of 32 or n_in not of QK_K; groups (n_out / 32) that fill the grid already; fewer
    items than blocks; a busiest block as long as a whole group's row (no gain over gemv's NQ
    product); or a group split over more than SK_SLOTS blocks. The grid is at most two blocks a
    group, so each block's run holds parts of two groups at most."""
    if glu or t not in NQ_TYPES or n_out % 32 or n_in % QK_K:
        return 0
    groups, units = n_out // 32, -(-n_in // SK_UNIT)
    grid = min(slots, 2 * groups)
    if grid <= groups or groups * units < grid or -(-groups * units // grid) >= units:
        return 0
    return grid if sk_pieces(groups, units, grid) <= SK_SLOTS else 0


def _plan(w):
    """(kernel, grid, threads, shared bytes) of gemv_q8_sk on DeviceWeight w, grid 0 where sk_grid
    refuses it; cached on w."""
    plan = w._plans.get("sk")
    if plan is None:
        from .launch import allow_shared, blocks_per_sm, device_limits

        (n_out, n_in), t = w.shape, w.ggml_type
        if w.glu or t not in NQ_TYPES:
            plan = (None, 0, 0, 0)
        else:
            kernel = _kernel("gemv_streamk.cu", sk_name(t, w.planar), w.evict_first)
            threads, smem = 32 * QUANT[t].gemv[0], q8x_bytes(n_in)
            allow_shared(kernel, smem)
            grid = sk_grid(t, n_out, n_in, w.glu, device_limits()[0] * blocks_per_sm(kernel, threads, smem))
            plan = (kernel, grid, threads, smem)
        w._plans["sk"] = plan
    return plan


def sk_groups(w) -> int:
    """The per-group sums of squares (n_parts) gemv_sk writes for matmul.DeviceWeight w, n_out / 32,
    or 0 where it does not run on w (sk_grid)."""
    return w.shape[0] // 32 if _plan(w)[1] else 0


def scratch_floats(n_out: int) -> int:
    """float32 values of the partial sums of gemv_sk's products of up to n_out outputs."""
    return SK_SLOTS * n_out


def gemv_sk(w, x, y, *, y_q8, norm_w, parts, scratch, residual=None, bias=None, x_q8=None, stream=None,
            trace: Trace | None = None, pdl: bool | None = None) -> None:
    """y = w @ x (+ bias) (+ residual) for one token, stream-K (gemv_q8_sk), also writing the next
    RMSNorm's handoff: y * norm_w quantized into y_q8 (q8_handoff.Q8Vector of n_out values, its
    swizzle that of the product reading it) and each 32-output group's sum of y^2 into parts, as
    matmul.gemv's norm_out does; the reader takes Q8Vector(..., parts, sk_groups(w), eps).

    w: matmul.DeviceWeight where sk_groups(w) is not 0; x: (n_in,) float32, 16-byte aligned (not
    read with x_q8: x quantized for w, Q8Vector.for_weight, no parts); y, residual (may be y),
    bias, norm_w: (n_out,) float32; parts: float32 of at least n_out / 32 values; scratch: (part,
    count), float32 of scratch_floats(n_out) and int32 of n_out / 32 values, the counts zero
    (the kernel leaves them zero; one launch at a time uses them). pdl: as matmul.gemv's. y may
    differ from matmul.gemv's in the last bits (its sums split over blocks).
    Raises ValueError where the product does not apply or an argument is wrong."""
    from .arg_checks import check_array
    from .launch import capturing, launch, null_or

    n_out, n_in = w.shape
    kernel, grid, threads, smem = _plan(w)
    if not grid:
        raise ValueError(f"no stream-K product of {w.ggml_type.name} {w.shape}{' (glu)' if w.glu else ''}")
    check_array("x", x, (n_in,), align16=True)
    for name, a in (("y", y), ("residual", residual), ("bias", bias), ("norm_w", norm_w)):
        if a is not None:
            check_array(name, a, (n_out,))
    part, count = scratch
    if part.dtype != np.float32 or part.size < scratch_floats(n_out) or count.dtype != np.int32 or count.size < n_out // 32:
        raise ValueError(f"the stream-K scratch needs {scratch_floats(n_out)} float32 and {n_out // 32} int32 values")
    if parts.dtype != np.float32 or parts.size < n_out // 32:
        raise ValueError(f"parts needs {n_out // 32} float32 values")
    if y_q8.n != n_out or y_q8.data.nbytes < q8x_bytes(n_out):
        raise ValueError(f"y_q8 holds {y_q8.n} values; this product writes {n_out}")
    if x_q8 is not None and (x_q8.parts is not None or (x_q8.n, x_q8.swizzle) != (n_in, QUANT[w.ggml_type].x_swizzle)):
        raise ValueError(f"x_q8 must be a plain q8 vector of {n_in} values for {w.ggml_type.name}")
    args = (w.data, x, y, null_or(residual), null_or(bias), np.int32(n_out), np.int32(n_in), null_or(x_q8 and x_q8.data),
            y_q8.data, np.int32(y_q8.swizzle), norm_w, parts, part, count)
    if pdl is None:
        pdl = w.pdl and capturing(stream)
    launch(kernel, (grid,), (threads,), args, smem, stream, trace, pdl)
