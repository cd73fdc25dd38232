"""Products of a few tokens on int8 tensor cores, reading the weights once (kernels_cu/gemv_mma_staged.cu
for Q4_K and planar Q6_K, kernels_cu/gemv_mma.cu for raw Q6_K): speculative decoding's verify step
of up to 8 tokens.

gemv_batch (runtime/cuda/gemv_batch.py) multiplies each weight chunk with every token's x on
dp4a, which is bound by that integer work (8 tokens: 3.6x one gemv on the H200). gemv_mma does
the same products as mma.sync with the weights' quants as A (16 rows x one scale group) and
the 8 tokens' q8 x as B, so the integer work moves to the tensor cores and what is left per
weight is the float epilogue of each scale group (docs/PERF.md). x is quantized to 8 bits per
32 values as gemv quantizes it; the sums run in another order than gemv's, so results agree
with gemv to float rounding, not bit for bit (tests/test_cuda_gemv_mma.py states the limits).

matmul.matmul (through gemv_batch.gemv_rows) and forward.py's gate/up path use it for
MMA8_MIN_TOKENS to MMA8_TOKENS tokens when the weight's mma8 option is on (flag K4_MMA8, on by
default) and uses_mma8 says the product fits. Where mma8_cluster says (flag K4_MMA8_CLUSTER), the
staged kernel runs in thread-block clusters of two whose blocks split each row's 256-weight
blocks, so each block stages half of the tokens' x (docs/PERF.md session 45). Like matmul.py's
entry points: validates on the host (ValueError: programming errors of the caller), allocates
nothing, never synchronizes, can be captured in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from k4.runtime.trace import Trace

from .batch_args import check_products
from .constants import (MMA8_NQ_RUN, MMA8_STAGE_BYTES, MMA8_STAGE_BYTES_Q6_K, MMA8_TOKENS, mma8_lay_in, mma8_smem,
                        mma8_staged_smem, q8x_bytes)
from .device_weight import DeviceWeight
from .launch import allow_shared, blocks_per_sm, capturing, device_limits, launch, null_or
from .q8_handoff import Q8Rows
from .quant_kernels import EXTRA_MMA8_WARPS, MMA8_CLUSTER, MMA8_DECODERS, MMA8_KERNELS, MMA8_MIN_TOKENS, _gemv_mma_name, _kernel, mma8_file

SMEM_LIMIT = 227 << 10  # sm_90: the most dynamic shared memory a block may opt in to (bytes)


def uses_mma8(w: DeviceWeight, n_tok: int, variant: tuple[int, ...] | None = None) -> bool:
    """Whether a product of n_tok tokens on w runs as gemv_mma: w's mma8 option is on (K4_MMA8),
    its type has an mma kernel (quant_kernels.MMA8_DECODERS: Q4_K, Q6_K), MMA8_MIN_TOKENS <= n_tok
    <= MMA8_TOKENS, and the 8 tokens' quantized x (and the staged kernel's rings) fit in one
    block's shared memory (mma_shape: n_in up to about 15,600 for Q4_K, 18,600 for Q6_K; about twice
    that in clusters, mma8_cluster). Measured on the H200
    (scripts/bench_gemv_mma.py, Llama 2 7B's products; docs/PERF.md)."""
    return w.mma8 and w.ggml_type in MMA8_DECODERS and MMA8_MIN_TOKENS <= n_tok <= MMA8_TOKENS and _fits(w, variant)


def _fits(w: DeviceWeight, variant: tuple[int, ...] | None) -> bool:
    """Whether a gemv_mma instance fits w's rows: without clusters, or in clusters where w's
    mma8_cluster option allows them (half of x a block: Qwen2.5 7B's down product of 18,944 inputs)."""
    return (mma_shape(w.ggml_type, w.shape[1], w.planar, variant) is not None
            or (w.mma8_cluster and mma_shape(w.ggml_type, w.shape[1], w.planar, variant, MMA8_CLUSTER) is not None))


STEP_COST = 2  # mma_ks: a step's end (barrier, partial sums) in 256-weight blocks of one warp
STAGES = (4, 3, 2)  # gemv_mma_staged ring stages per warp, the most that fit first
STAGE_BYTES = {T.Q4_K: MMA8_STAGE_BYTES, T.Q6_K: MMA8_STAGE_BYTES_Q6_K}


def mma_shape(t, n_in: int, planar: bool, variant: tuple[int, ...] | None = None, cl: int = 1) -> tuple[bool, int, int] | None:
    """(staged, warps, stages) of the gemv_mma instance for rows of n_in inputs of type t in its
    layout, or None where none fits: the first of quant_kernels.MMA8_KERNELS[t] for the layout whose
    shared memory fits (SMEM_LIMIT) with one of its warp counts, in order: the staged kernel with the
    most ring stages (STAGES) that fit (mma8_staged_smem), the register kernel with stages 0
    (mma8_smem). variant (WARPS, KS[, STAGES]) fixes the warps (the first kernel compiled with
    them, EXTRA_MMA8_WARPS for the register kernel) and, if non-zero, the stages. cl > 1: the
    staged kernel's instance for clusters of cl blocks (mma8_staged_smem's cl), or None."""
    for staged, layouts, warp_list in MMA8_KERNELS[t]:
        if planar not in layouts or (cl > 1 and not staged):
            continue
        if variant:
            if variant[0] not in (*warp_list, *(() if staged else EXTRA_MMA8_WARPS.get(t, ()))):
                continue
            warp_list = (variant[0],)
        for warps in warp_list:
            if not staged:
                if mma8_smem(n_in, warps) <= SMEM_LIMIT:
                    return False, warps, 0
                continue
            for st in (variant[2],) if variant and len(variant) > 2 and variant[2] else STAGES:
                if mma8_staged_smem(n_in, warps, st, STAGE_BYTES[t], cl) <= SMEM_LIMIT:
                    return True, warps, st
    return None


def mma_ks(n_rows: int, n_in: int, warps: int, resident: int) -> tuple[int, int]:
    """(KS, grid) for gemv_mma on a matrix of n_rows weight rows (a gate/up weight's rows of both)
    of n_in inputs: KS, the warps that split each 16-row tile's 256-weight blocks, among the
    divisors of `warps` from 4 up (a step's epilogue needs a thread per (row, token) of its
    warps / KS tiles), the one whose busiest warp has the least work: steps per block x (blocks per
    warp and tile + STEP_COST, a step's barrier and partial sums counted as that many blocks), the
    smallest on a tie; grid: at most `resident` blocks, at most one per step. For example with 16
    warps on 132 multiprocessors a 4096 x 4096 matrix takes KS 8 (128 steps of 2 tiles, 2 blocks
    per warp) where KS 4 would leave 68 multiprocessors idle (64 steps of 4 tiles, 4 blocks per
    warp), and 22016 x 4096 keeps KS 4 (3 steps of 4 blocks per warp, not 11 of 1). Measured on
    the H200 (docs/PERF.md): with a cost of 0 per step KS 16 took 22016 x 4096 at 35.7 µs against
    KS 4's 28.7."""
    tiles, nblk_row = -(-n_rows // 16), n_in // 256
    best = None
    for ks in range(4, warps + 1):
        if warps % ks:
            continue
        steps = -(-tiles // (warps // ks))
        grid = min(resident, steps)
        cost = -(-steps // grid) * (-(-nblk_row // ks) + STEP_COST)
        if best is None or cost < best[0]:
            best = (cost, ks, grid)
    return best[1], best[2]


# A product runs in clusters (MMA8_CLUSTER) where its rows have at least MMA8_CLUSTER_MIN_IN inputs
# (half of x is what a block saves) and no cluster takes more than MMA8_CLUSTER_STEPS steps (each
# step ends at a cluster barrier), or where only clusters fit x. Measured on the H200 (8 tokens,
# x handed in quantized, µs, clusters against none; docs/PERF.md): Llama 2 7B's q|k|v (3 steps a
# cluster) 13.7 against 14.6, its output product (1) 6.6 against 7.3, Q6_K down (1) 18.8 against
# 21.4, TinyLlama's downs (5,632 inputs) 6.2 / 8.1 against 7.5 / 9.1; but the 7B's gate/up (6
# steps) 25.4 against 20.6, its Q6_K output head (8) 50.6 against 44.6, TinyLlama's gate/up (2,048
# inputs, 3 steps) 9.5 against 8.4, its output product 4.3 against 4.2 and its Q6_K v (256 rows)
# 4.8 against 4.4.
MMA8_CLUSTER_STEPS = 3
MMA8_CLUSTER_MIN_IN = 3072


def mma8_cluster(w: DeviceWeight, variant: tuple[int, ...] | None = None) -> int:
    """Blocks per thread-block cluster of gemv_mma on w (kernels_cu/gemv_mma_staged.cu CL): MMA8_CLUSTER
    where w's mma8_cluster option is on (flag K4_MMA8_CLUSTER), the staged kernel's cluster
    instance fits (mma_shape) and either the rows have MMA8_CLUSTER_MIN_IN inputs or more and no
    cluster takes more than MMA8_CLUSTER_STEPS steps, or the kernel without clusters does not fit;
    else 1."""
    return _mma_plan(w, variant)[6]


def _mma_plan(w: DeviceWeight, variant: tuple[int, ...] | None):
    """(kernel, grid, block, shared_mem, KS, stages, cluster) of gemv_mma on w, cached in w._plans:
    the blocks per cluster as mma8_cluster says, warps and stages from mma_shape, one block per
    multiprocessor or more where the shared memory and registers allow (the grid whole clusters),
    KS from mma_ks (over a block's share of each row's blocks) unless the variant names one."""
    key = ("mma8", variant)
    plan = w._plans.get(key)
    if plan is not None:
        return plan
    plan = None
    alone = mma_shape(w.ggml_type, w.shape[1], w.planar, variant) is not None
    if (w.mma8_cluster and not (alone and w.shape[1] < MMA8_CLUSTER_MIN_IN)
            and mma_shape(w.ggml_type, w.shape[1], w.planar, variant, MMA8_CLUSTER) is not None):
        plan = _plan_for(w, variant, MMA8_CLUSTER)
        _, (grid,), (threads,), _, ks, _, cl = plan
        steps = -(-w.shape[0] // (16 * (threads // 32 // ks)))
        if alone and -(-steps // (grid // cl)) > MMA8_CLUSTER_STEPS:
            plan = None
    plan = plan or _plan_for(w, variant, 1)
    w._plans[key] = plan
    return plan


def _plan_for(w: DeviceWeight, variant: tuple[int, ...] | None, cl: int):
    """_mma_plan's plan for clusters of cl blocks (1: none), not cached."""
    staged, warps, stages = mma_shape(w.ggml_type, w.shape[1], w.planar, variant, cl)
    kernel = _kernel(mma8_file(staged), _gemv_mma_name(w.ggml_type, w.planar, warps, w.glu, w.glu_act, staged, cl), w.evict_first)
    smem = mma8_staged_smem(w.shape[1], warps, stages, STAGE_BYTES[w.ggml_type], cl) if stages else mma8_smem(w.shape[1], warps)
    allow_shared(kernel, smem)
    resident = device_limits()[0] * blocks_per_sm(kernel, 32 * warps, smem) // cl  # clusters
    # weight rows (a glu weight's gate and up rows alike) over a block's share of each row
    ks, grid = mma_ks(w.shape[0], mma8_lay_in(w.shape[1], cl), warps, resident)
    if variant and variant[1]:
        ks = variant[1]
        grid = min(resident, -(-w.shape[0] // (16 * (warps // ks))))
    return kernel, (cl * grid,), (32 * warps,), smem, ks, stages, cl


def _steps(w: DeviceWeight) -> tuple[int, int]:
    """(tiles of 16 weight rows a step, steps) of gemv_mma's plan on w (kernels_cu/gemv_mma_staged.cu)."""
    _, _, block, _, ks, _, _ = _mma_plan(w, None)
    tiles = block[0] // 32 // ks
    return tiles, -(-w.shape[0] // (16 * tiles))


def _q8_out_smem(w: DeviceWeight, nq: bool) -> int:
    """The shared memory of gemv_mma on w when it also writes its Y quantized (nq_out with nq, an
    NQ handoff; y_q8 without): the plan's and, after the rings, a step's Y for mma8_step_nq (16
    rows a tile in MMA8_NQ_RUN floats, MMA8_TOKENS tokens), for y_q8 one for each of a block's
    steps (quantized after its last: kernels_cu/gemv_mma_staged.cu); 0 where w's product cannot: the
    register kernel, a glu weight for an NQ handoff, outputs (n_out, half a glu weight's rows) not
    a multiple of 32, a step of other than 2 or 4 runs of 16 outputs a token (mma8_step_units:
    units of 32 within a step, a power of two of lanes a token), or more than SMEM_LIMIT bytes."""
    n_out = w.shape[0] // 2 if w.glu else w.shape[0]
    if (nq and w.glu) or n_out % 32:
        return 0
    _, grid, _, smem, _, stages, cl = _mma_plan(w, None)
    tiles, n_steps = _steps(w)
    units = tiles // 2 if w.glu else tiles  # mma8_common.cuh mma8_step_units
    per_cluster = -(-n_steps // (grid[0] // cl))  # the most steps a cluster (a block, cl 1) takes
    ys_steps = 1 if nq else -(-per_cluster // cl)  # y_q8: the most steps a block finishes (they alternate)
    smem += MMA8_NQ_RUN * tiles * MMA8_TOKENS * 4 * ys_steps
    return smem if stages and units in (2, 4) and smem <= SMEM_LIMIT else 0


def writes_q8(w: DeviceWeight, n_tok: int) -> bool:
    """Whether gemv_mma on w for n_tok tokens can also write its Y quantized (y_q8): it runs as
    gemv_mma (uses_mma8) in steps that hold whole 32-output groups (_q8_out_smem)."""
    return uses_mma8(w, n_tok) and _q8_out_smem(w, False) > 0


def nq_parts(w: DeviceWeight, n_tok: int) -> int:
    """The sums of squares per token that gemv_mma on w writes as an NQ product of n_tok tokens
    (nq_out: one per step of the product), or 0 where w's product of n_tok tokens does not run as
    gemv_mma or cannot hand off (_q8_out_smem)."""
    if not uses_mma8(w, n_tok) or not _q8_out_smem(w, True):
        return 0
    return _steps(w)[1]


def gemv_mma(w: DeviceWeight, X, Y, *, residual=None, bias=None, stream=None, trace: Trace | None = None,
             pdl: bool | None = None, variant: tuple[int, ...] | None = None, x_q8: Q8Rows | None = None,
             nq_out: tuple | None = None, y_q8: Q8Rows | None = None) -> None:
    """Y[t] = w @ X[t] (+ bias) (+ residual[t]) for n_tok = 1 .. MMA8_TOKENS tokens, one kernel
    launch reading w once, on int8 tensor cores; with w.glu, Y[t] = act(gate @ X[t]) * (up @
    X[t]), act w.glu_act (silu or gelu_tanh).

    w: a device_weight.DeviceWeight of type Q4_K or Q6_K (MMA8_DECODERS), raw or planar, n_in at most
    what uses_mma8 allows. X: (n_tok, n_in) float32, rows contiguous, 16-byte aligned, any
    multiple of 16 bytes apart. Y: (n_tok, n_out) float32 ((n_tok, n_out / 2) for w.glu), rows
    any whole number of floats apart. residual: like Y or None, may be Y itself; bias: (n_out,)
    float32 or None, added to every row; neither with w.glu. pdl, stream, trace: as matmul.gemv.
    variant: (WARPS, KS[, STAGES]): another compiled instance of WARPS warps
    (quant_kernels.MMA8_WARPS, EXTRA_MMA8_WARPS), KS 0 for mma_ks's choice, else a divisor of WARPS
    from 4 up, STAGES (staged kernel) 0 for mma_shape's choice, else 2 to 4. x is
    quantized to 8 bits per 32 values as gemv quantizes it (llama.cpp's q8_1 idea); Y differs
    from gemv's only by float32 rounding (sums in another order), within the gemv tests' limit
    against numpy with x rounded the same way (1e-4 relative L2). x_q8: X already quantized by
    gemv_batch.quantize_rows or Ops.rms_norm (n_tok rows of n_in, any swizzle), copied by every
    block instead of reading and quantizing X (not read then, still checked): the same quants,
    the same Y; with parts (an NQ handoff), each block scales the d's by the RMSNorm's scale
    (mma8_stage_x), so the product takes RMSNorm(y) * norm_w of the NQ product's y.
    nq_out: (norm_w (n_out,) float32, Q8Rows of n_tok rows of n_out with parts of at least
    n_tok * nq_parts(w, n_tok) floats and n_parts nq_parts(w, n_tok)): an NQ product, which also
    hands the products after the next RMSNorm (weight norm_w) its Y (kernels_cu/mma8_common.cuh
    mma8_step_nq; flag K4_MMA8_NQ); not with variant.
    y_q8: Q8Rows of n_tok rows of n_out (n_out / 2 outputs for w.glu), no parts, where writes_q8
    says the product can: Y also written quantized, the bytes quantize_rows would write from Y
    (flag K4_MMA8_FFQ8: the gate/up product's output for the down product); not with nq_out or variant.
    Raises ValueError on another weight type, n_tok outside 1..MMA8_TOKENS, an n_in whose x does
    not fit in shared memory, wrong shapes, dtypes, strides or alignment, residual/bias with w.glu,
    or an x_q8 of other rows or size, an nq_out or y_q8 for a product that cannot write it or of other rows.
    """
    if w.ggml_type not in MMA8_DECODERS:
        raise ValueError(f"gemv_mma multiplies {', '.join(t.name for t in MMA8_DECODERS)} weights, not {w.ggml_type.name}")
    n_tok, n_out, x_stride, y_stride, r_stride = check_products("gemv_mma", w, X, Y, residual, bias, MMA8_TOKENS)
    n_in = w.shape[1]
    if variant and variant[1] and (variant[1] < 4 or variant[0] % variant[1]):
        raise ValueError(f"gemv_mma variant {variant}: KS must divide WARPS and be at least 4")
    if not _fits(w, variant):
        raise ValueError(f"gemv_mma holds the x of {MMA8_TOKENS} tokens in shared memory: {mma8_smem(n_in, 8)} bytes or more "
                         f"for n_in {n_in}, more than {SMEM_LIMIT} with its rings")
    need = n_tok * q8x_bytes(n_in)
    if x_q8 is not None and ((x_q8.n_tok, x_q8.n) != (n_tok, n_in) or x_q8.data.nbytes < need or not 0 <= x_q8.swizzle < 8):
        raise ValueError(f"x_q8 holds {x_q8.n_tok} rows of {x_q8.n} for swizzle {x_q8.swizzle} ({x_q8.data.nbytes} bytes); "
                         f"this product needs {n_tok} of {n_in} ({need} bytes, swizzle 0..7)")
    kernel, grid, block, smem, ks, stages, cl = _mma_plan(w, variant)
    parts = x_q8.parts if x_q8 is not None else None
    if parts is not None and (parts.dtype != np.float32 or parts.size < n_tok * x_q8.n_parts or x_q8.n_parts < 1):
        raise ValueError(f"x_q8's parts hold {parts.size} {parts.dtype}; {n_tok} rows of {x_q8.n_parts} float32 are read")
    args = (w.data, X, np.int32(x_stride), Y, np.int32(y_stride), null_or(residual), np.int32(r_stride), null_or(bias),
            np.int32(n_out), np.int32(n_in), np.int32(n_tok), np.int32(ks), *((np.int32(stages),) if stages else ()),
            null_or(x_q8 and x_q8.data), np.int32(x_q8.swizzle if x_q8 is not None else 0), null_or(parts),
            np.int32(x_q8.n_parts if parts is not None else 0), np.float32(x_q8.eps if parts is not None else 0))
    if stages:  # gemv_mma_staged: its NQ arguments
        args += _nq_args(w, nq_out, n_tok, variant) if y_q8 is None else _y_q8_args(w, y_q8, n_tok, n_out, variant, nq_out)
        if nq_out is not None or y_q8 is not None:
            smem = _q8_out_smem(w, nq_out is not None)
            allow_shared(kernel, smem)
    elif nq_out is not None or y_q8 is not None:
        raise ValueError(f"gemv_mma on {w.ggml_type.name} {w.shape} runs the register kernel, which writes no q8 output")
    if pdl is None:  # as gemv: eagerly the driver-API launch costs more host time than it saves
        pdl = w.pdl and capturing(stream)
    launch(kernel, grid, block, args, smem, stream, trace, pdl, cluster=cl)


def _nq_args(w: DeviceWeight, nq_out: tuple | None, n_tok: int, variant) -> tuple:
    """gemv_mma_staged's NQ arguments (norm weights, q8 rows, parts, swizzle) for nq_out, checked
    (ValueError), or nulls for None."""
    if nq_out is None:
        return (np.uint64(0), np.uint64(0), np.uint64(0), np.int32(0))
    norm_w, out = nq_out
    n_parts = nq_parts(w, n_tok)
    if variant or not n_parts:
        raise ValueError(f"gemv_mma on {w.ggml_type.name} {w.shape}{' as a variant' if variant else ''} cannot hand off (nq_out)")
    n_out = w.shape[0]
    if getattr(norm_w, "dtype", None) != np.float32 or norm_w.shape != (n_out,):
        raise ValueError(f"nq_out's norm weights must be ({n_out},) float32, got {getattr(norm_w, 'shape', None)}")
    if (out.n_tok, out.n, out.n_parts) != (n_tok, n_out, n_parts) or out.data.nbytes < n_tok * q8x_bytes(n_out) \
            or out.parts is None or out.parts.dtype != np.float32 or out.parts.size < n_tok * n_parts or not 0 <= out.swizzle < 8:
        raise ValueError(f"nq_out holds {out.n_tok} rows of {out.n} with {out.n_parts} parts; this product writes {n_tok} "
                         f"of {n_out} with {n_parts} parts ({n_tok * q8x_bytes(n_out)} bytes, swizzle 0..7)")
    return (norm_w, out.data, out.parts, np.int32(out.swizzle))


def _y_q8_args(w: DeviceWeight, out: Q8Rows, n_tok: int, n_out: int, variant, nq_out) -> tuple:
    """gemv_mma_staged's arguments for y_q8 (no norm weights, q8 rows, no parts, swizzle), checked
    (ValueError)."""
    if nq_out is not None or variant or not writes_q8(w, n_tok):
        raise ValueError(f"gemv_mma on {w.ggml_type.name} {w.shape}{' as a variant' if variant else ''}"
                         f"{' with nq_out' if nq_out is not None else ''} cannot write y_q8")
    if (out.n_tok, out.n) != (n_tok, n_out) or out.parts is not None or out.data.nbytes < n_tok * q8x_bytes(n_out) \
            or not 0 <= out.swizzle < 8:
        raise ValueError(f"y_q8 holds {out.n_tok} rows of {out.n}{' with parts' if out.parts is not None else ''} "
                         f"({out.data.nbytes} bytes); this product writes {n_tok} of {n_out} without parts "
                         f"({n_tok * q8x_bytes(n_out)} bytes, swizzle 0..7)")
    return (np.uint64(0), out.data, np.uint64(0), np.int32(out.swizzle))
