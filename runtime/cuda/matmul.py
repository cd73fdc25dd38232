"""The dequant-matmul family on the GPU: matrix-vector products for decode (gemv), matrix-matrix
products for prefill (matmul); their microbenchmarks are in runtime/cuda/microbench.py. Rows
dequantized whole (the embedding lookup, prefill's fp16 row ranges): runtime/cuda/dequant.py. The
weight they take (DeviceWeight, make_weight): runtime/cuda/device_weight.py.

Weights stay in their ggml encoding on the device (Q4_K keeps 144 bytes per 256 weights). With
repacking on (flag K4_REPACK) a quantized tensor is stored *planar*: each byte range of the
block (e.g. Q6_K's ql | qh | scales | d) contiguous over all blocks, each plane padded to 16
bytes, so every wide field is 16-byte aligned whatever the block size; the kernels read raw
(ggml's array of blocks) and planar alike. Layouts: ggml-common.h; kernels: kernels_cu/gemv.cu
and kernels_cu/matmul.cu, their per-type decoders in kernels_cu/common.cuh.

decode, y = W @ x: one kernel. Quantized types quantize x to 8 bits per 32 values inside each
thread block (llama.cpp's q8_1 idea) and use integer dot products; F32/F16/BF16 use float x.
The kernel can fold the RMSNorm of x into its prologue (`norm=`) and, for a weight whose rows
interleave ffn_gate and ffn_up (combined(glu=True), DeviceWeight.glu), apply SwiGLU (GeGLU) in its epilogue.
prefill, Y = X @ W^T: W is dequantized to fp16 a row range at a time (<= 32 MiB, so it stays in
L2) and multiplied by cuBLAS on tensor cores (fp16 inputs, fp32 accumulation and output), or
read from a whole fp16 copy made at load (make_half, DeviceWeight.half); X may come in fp16
already. With K4_PREFILL_TC=0, or for a few tokens, matrix-vector products instead: up to 8
tokens per read of a quantized W (runtime/cuda/gemv_batch.py), one gemv per token for floats.

Measured on one H200 (gemv in CUDA graphs with PDL, weights streamed from memory): Q4_K
4096x4096 4.0 µs with x quantized beforehand, Q6_K 32000x4096 27 µs (3.97 TB/s, 94%); a fixed
~2 µs per launch keeps small matrices lower (docs/PERF.md). Prefill Q4_K 512x4096x4096: 50 µs
(345 TFLOP/s), 2048 tokens 510 TFLOP/s.

Every entry point validates on the host (ValueError: these are programming errors of the
caller, not user errors), allocates nothing and never synchronizes; launches go through
runtime.cuda.launch and are counted in `trace` when given. gemv can be captured in a CUDA
graph; matmul's tensor-core path can be when given a runtime.cuda.blas.Blas
(CuPy's own cuBLAS calls refuse stream capture), its per-token gemv path always can.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from gguf import GGMLQuantizationType as T

from k4.runtime.trace import Trace

from .arg_checks import check_array, check_post
from .constants import q8x_bytes
from .dequant import dequant_launch
from .device_weight import DeviceWeight, half_bytes
from .gemv_batch import gemv_rows
from .gemv_choice import NQ_TYPES, gemv_cluster, gemv_variant, nq_balanced, nq_variants
from .gemv_mma import uses_mma8
from .launch import allow_shared, blocks_per_sm, capturing, device_limits, launch, null_or
from .q8_handoff import Q8Vector, check_q8
from .quant_kernels import DEQUANT_CHUNK_BYTES, FLOAT_GEMV, GEMV_MAX_TOKENS, _gemv_f_name, _gemv_q8_name, _kernel
from .quant_types import FLOAT, QUANT


# ---- a weight's fp16 copy for prefill ----------------------------------------------------------

def make_half(w: DeviceWeight, out, stream=None, trace: Trace | None = None) -> None:
    """Dequantize all of w into `out` (cupy float16, (n_out, n_in), contiguous) and keep it as
    w.half, so matmul (prefill) skips the per-call dequantization. Values round as gguf's numpy
    dequantize followed by a cast to float16. Raises ValueError on a wrong `out` or a type
    with no copy (half_bytes(w) == 0)."""
    if half_bytes(w) == 0:
        raise ValueError(f"{w.ggml_type.name} weights are multiplied as they are; they need no fp16 copy")
    check_array("out", out, w.shape, np.float16)
    rows = _chunk_rows(w)
    for r0 in range(0, w.shape[0], rows):
        n = min(rows, w.shape[0] - r0)
        dequant_launch(w, None, r0, n, out[r0 : r0 + n], "u16", stream, trace)
    w.half = out


def _gemv_plan(w: DeviceWeight, variant: tuple[int, int, int] | None = None, norm: bool = False, post: bool = False,
               split: bool = False, nq: bool = False, nx: bool = False, am: bool = False):
    """The launch of gemv on w, cached per variant, norm prologue, post-norm prologue (post: its x
    and t * w kept as floats after x's q8), split (x quantized in the kernel without norm or
    post-norm: in clusters where gemv_choice.gemv_cluster says), nq (the NQ instance, gemv
    norm_out), nx (its reader, x_q8 with parts) and am (gemv argmax). The grid is as many blocks as fit on the GPU at once, but at most one per output,
    cut to a multiple of the cluster. Returns (kernel, grid, block, shared_mem, blocks per cluster)."""
    plan = w._plans.get((variant, norm, post, split, nq, nx, am))
    if plan is not None:
        return plan
    n_out, n_in = w.shape
    if w.glu:
        n_out //= 2
    if w.ggml_type in QUANT:
        q = QUANT[w.ggml_type]
        variant = variant or gemv_variant(w.ggml_type, n_out, n_in, w.glu)
        warps = variant[0]
        cluster = gemv_cluster(w.ggml_type, n_out, n_in, variant) if split and not w.glu else 1
        name = _gemv_q8_name(w.ggml_type, w.planar, variant, w.glu, w.glu_act, cluster > 1, nq, nx, am)
        kernel = _kernel("gemv.cu", name, w.evict_first)
        smem = q8x_bytes(n_in)
        after = 8 * n_in if post else 0  # the post-norm's x and t * w (floats), then free
        if (w.glu and q.handoff) or nq:  # room for one block's outputs (y_q8): its 32-output groups
            groups = -(-n_out // 32)
            # the grid has at least this many blocks; NQ: the norm weights after the outputs
            after = max(after, (2 if nq else 1) * 4 * 32 * -(-groups // min(device_limits()[0], n_out)))
        smem += after
    else:
        warps, cluster = FLOAT_GEMV[0], 1
        kernel = _kernel("gemv.cu", _gemv_f_name(w.ggml_type, (n_in * FLOAT[w.ggml_type][1]) % 16 == 0, w.glu, w.glu_act))
        smem = (8 if post else 4) * n_in if norm else 0
    allow_shared(kernel, smem)
    grid = min(device_limits()[0] * blocks_per_sm(kernel, 32 * warps, smem), n_out)
    grid -= grid % cluster
    plan = (kernel, (grid,), (32 * warps,), smem, cluster)
    w._plans[(variant, norm, post, split, nq, nx, am)] = plan
    return plan


def argmax_ok(w: DeviceWeight) -> bool:
    """Whether gemv can write w's argmax partials (gemv argmax): a quantized weight without glu whose
    default gemv_q8 variant runs (gemv_choice.gemv_variant)."""
    (n_out, n_in), t = w.shape, w.ggml_type
    return t in QUANT and not w.glu and gemv_variant(t, n_out, n_in) == QUANT[t].gemv


def norm_q8_blocks(w: DeviceWeight, x_cluster: bool = True, variant: tuple[int, int, int] | None = None) -> int:
    """The blocks (n_parts) of gemv's NQ launch on w (norm_out, float x; x_cluster, variant as gemv's), or 0: not a
    non-glu NQ_TYPES weight, n_out a multiple of 32, in a variant of nq_variants (None: the default where
    gemv_variant chooses it) that gemv_choice.nq_balanced admits."""
    (n_out, n_in), t = w.shape, w.ggml_type
    if (w.glu or t not in NQ_TYPES or n_out % 32 or variant not in (None, *nq_variants(t))
            or variant is None and gemv_variant(t, n_out, n_in) != QUANT[t].gemv):
        return 0
    _, (grid,), (threads,), _, _ = _gemv_plan(w, variant, False, False, x_cluster, True)
    return grid if nq_balanced(n_out, n_in, grid, threads // 32) else 0


# ---- decode: matrix-vector ---------------------------------------------------------------------

def gemv(w: DeviceWeight, x, y, *, residual=None, bias=None, norm=None, stream=None, trace: Trace | None = None,
         variant: tuple[int, int, int] | None = None, pdl: bool | None = None, x_q8: Q8Vector | None = None,
         y_q8: Q8Vector | None = None, post=None, x_q8_out: Q8Vector | None = None, x_cluster: bool = True,
         norm_out=None, argmax=None) -> int:
    """y = w @ x (+ bias) (+ residual), one kernel launch; with w.glu, y = act(gate @ x) * (up @ x),
    act w.glu_act (silu, or gelu_tanh for gemma).

    x: (n_in,) float32, 16-byte aligned; y: (n_out,) float32, (n_out / 2,) for w.glu;
    residual: like y or None, may be y itself (in-place residual add); bias: like y or None;
    neither with w.glu. norm: None or (norm_w, eps), norm_w (n_in,) float32: x is replaced by
    RMSNorm(x) * norm_w, computed in the kernel's prologue (the norm kernel folded in; n_in a
    multiple of 4). All cupy arrays, contiguous. `variant` (WARPS, U, PF) picks another compiled
    gemv_q8 instance (see EXTRA_GEMV_VARIANTS); `pdl` launches with programmatic dependent launch
    (runtime.cuda.launch; default: w.pdl while the stream is being captured into a CUDA graph):
    the kernel then starts while the previous one drains, prefetching its weights, and waits
    for it before reading x or writing y. Quantized weights compute with x quantized to 8 bits
    per 32 values (relative error about 5e-3 on random data); float weights in float32.
    x_q8: x already quantized (by the previous product, see y_q8) for w's type (Q8Vector.for_weight
    of w): the kernel copies it instead of quantizing x, which it then does not read; not with
    norm; an NQ handoff (x_q8.parts, from norm_out) stands for RMSNorm(x) * norm_w. y_q8: w.glu
    only, a type with QuantKernels.handoff, n_out a multiple of 32: y is also
    written quantized into y_q8 (made for the weight of the product that will read it), the same
    bytes that product would compute from y itself.
    norm_out: None or (norm_w, parts), norm_w (n_out,) float32, parts a float32 array of at least
    norm_q8_blocks(w) values, with y_q8, where norm_q8_blocks(w) is not 0 (flag K4_NORM_Q8): y is
    written as usual, and y * norm_w quantized into y_q8 and the blocks' sums of y^2 into parts:
    the next products' x_q8 (Q8Vector with parts) in place of RMSNorm(y) * norm_w.
    argmax: None or (part_val, part_idx), float32 and int32 arrays of at least the grid's warps,
    where argmax_ok(w) (the output head, K4_HEAD_ARGMAX), without bias, residual, y_q8, x_q8_out
    or norm_out: warp i also writes its largest y[r] and that r (the lowest on equal values; -inf
    and NO_INDEX without rows) to part_val[i], part_idx[i], the partials of sampling.cu's sample_finish.
    post: None or (t, post_w, x_out), each (n_in,) float32, 16-byte aligned, with norm (Gemma's
    post-norm of the product before, folded in): the input is x + RMSNorm(t) * post_w (norm.cu
    rms_norm_add's residual add, same eps) instead of x, and the kernel's first block writes it
    to x_out (the new residual stream; not x or t).
    x_q8_out: a quantized weight without x_q8 only: the kernel's first block also writes the x it
    multiplies (after norm and post) into x_q8_out, made for the weight of the next product of
    the same x (Q8Vector.for_weight), the bytes that product would compute itself where it does
    not fold the norm's scale into its outputs (q8_handoff.folds_norm; with x_q8_out this launch
    does not either).
    x_cluster: a quantized product that quantizes a long x itself without norm or post-norm
    launches in thread-block clusters that share that work (gemv_choice.gemv_cluster; flag
    K4_X_CLUSTER); the same bits.
    Returns the grid's warps. Raises ValueError on wrong shapes, dtypes or alignment, and for
    x_q8, y_q8, post, x_q8_out or argmax where they do not apply.
    """
    n_out, n_in = w.shape
    if w.glu:
        n_out //= 2
        if residual is not None or bias is not None:
            raise ValueError("a gate/up (glu) product takes no residual and no bias")
    check_array("x", x, (n_in,), align16=True)
    check_array("y", y, (n_out,))
    if residual is not None:
        check_array("residual", residual, (n_out,))
    if bias is not None:
        check_array("bias", bias, (n_out,))
    norm_w, eps = (None, 0.0) if norm is None else norm
    if norm_w is not None:
        if n_in % 4:
            raise ValueError(f"the fused RMSNorm needs n_in a multiple of 4, got {n_in}")
        check_array("norm weight", norm_w, (n_in,), align16=True)
    check_q8(w, x_q8, y_q8, n_in, n_out, norm_w is not None, norm_out is not None, variant)
    if x_q8_out is not None and (w.ggml_type not in QUANT or x_q8 is not None or x_q8_out.n != n_in):
        raise ValueError("x_q8_out needs a quantized weight, no x_q8, and a q8 vector of n_in values")
    post_t, post_w, x_out = check_post(post, x, n_in, norm_w is not None, x_q8 is not None)
    am = argmax is not None
    if am and not (argmax_ok(w) and variant in (None, QUANT[w.ggml_type].gemv)
                   and residual is bias is y_q8 is x_q8_out is norm_out is None):
        raise ValueError(f"argmax partials need a plain product of {w.ggml_type.name} {w.shape} in its default variant")
    split = x_cluster and x_q8 is None and norm_w is None and post is None and not am
    nq_w, parts = (None, None) if norm_out is None else norm_out
    if norm_out is not None:
        n_parts = norm_q8_blocks(w, split, variant)
        check_array("norm_out weight", nq_w, (n_out,))
        if not n_parts or parts.dtype != np.float32 or parts.size < n_parts:
            raise ValueError(f"norm_out does not apply to {w.ggml_type.name} {w.shape} or its parts hold fewer than {n_parts} floats")
    nx = x_q8 is not None and x_q8.parts is not None  # an NQ handoff (check_q8 made sure an instance reads it)
    if nx:
        eps = x_q8.eps
    kernel, grid, block, smem, cluster = _gemv_plan(w, variant, norm_w is not None, post is not None, split, norm_out is not None, nx,
                                                    am)
    warps = grid[0] * block[0] // 32
    if am:
        check_array("argmax values", argmax[0][:warps], (warps,))
        check_array("argmax rows", argmax[1][:warps], (warps,), np.int32)
    args = (w.data, x, y, null_or(residual), null_or(bias), null_or(norm_w), np.float32(eps), np.int32(n_out), np.int32(n_in))
    if w.ggml_type in QUANT:
        args += (null_or(x_q8 and x_q8.data), null_or(y_q8 and y_q8.data), np.int32(y_q8.swizzle if y_q8 else 0))
    args += (null_or(post_t), null_or(post_w), null_or(x_out))
    if w.ggml_type in QUANT:
        args += (null_or(x_q8_out and x_q8_out.data), np.int32(x_q8_out.swizzle if x_q8_out else 0), null_or(nq_w), null_or(parts),
                 null_or(x_q8 and x_q8.parts), np.int32(x_q8.n_parts if x_q8 is not None else 0),
                 null_or(argmax and argmax[0]), null_or(argmax and argmax[1]))
    if pdl is None:  # eagerly the driver-API launch costs more host time than it saves
        pdl = w.pdl and capturing(stream)
    launch(kernel, grid, block, args, smem, stream, trace, pdl, cluster=cluster)
    return warps


# ---- prefill: matrix-matrix --------------------------------------------------------------------

def _chunk_rows(w: DeviceWeight) -> int:
    n_out, n_in = w.shape
    return min(n_out, max(128, DEQUANT_CHUNK_BYTES // (2 * n_in) // 128 * 128))


def uses_gemv(w: DeviceWeight, n_tok: int) -> bool:
    """Whether matmul of n_tok tokens on w runs as matrix-vector products (K4_PREFILL_TC off, at
    most GEMV_MAX_TOKENS tokens, or a product gemv_mma.uses_mma8 takes: 3 to 8 tokens of Q4_K
    or Q6_K with K4_MMA8): gemv_batch.gemv_rows for quantized w, gemv per token else."""
    return not w.prefill_tc or n_tok <= GEMV_MAX_TOKENS or uses_mma8(w, n_tok)


def takes_half(w: DeviceWeight, n_tok: int) -> bool:
    """Whether matmul of n_tok tokens on w accepts X in float16 (the tensor-core path of a type
    other than F32), so the caller can produce it in fp16 and save the conversion."""
    return not uses_gemv(w, n_tok) and w.ggml_type != T.F32


def _scratch_parts(w: DeviceWeight, n_tok: int) -> tuple[int, int]:
    """(fp16 X bytes, fp16 W chunk bytes) that matmul of n_tok tokens needs in its scratch."""
    if uses_gemv(w, n_tok) or w.ggml_type == T.F32:
        return 0, 0
    x_bytes = (n_tok * w.shape[1] * 2 + 255) & ~255
    return x_bytes, 0 if w.ggml_type == T.F16 else _chunk_rows(w) * w.shape[1] * 2


def matmul_scratch_bytes(weights: Sequence[DeviceWeight], max_tokens: int) -> int:
    """Bytes of device scratch that `matmul` needs for any of `weights` and up to `max_tokens` tokens."""
    if not weights:
        return 0
    x_bytes = max(_scratch_parts(w, max_tokens)[0] for w in weights)
    w_bytes = max(_scratch_parts(w, max_tokens)[1] for w in weights)
    return x_bytes + w_bytes


_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


def _gemm(m: int, n: int, k: int, a_ptr: int, a_type: int, b_ptr: int, b_type: int, c_ptr: int, ldc: int, beta_one: bool,
          blas=None) -> None:
    """C (col-major m x n, ldc; float32) = A^T @ B (+ C): A col-major k x m, B col-major k x n.
    On the current stream, through `blas` (runtime.cuda.blas.Blas: capturable) or CuPy's handle."""
    import cupy as cp
    from cupy_backends.cuda.libs import cublas

    beta = _ONE if beta_one else _ZERO
    args = (cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k, _ONE.ctypes.data, a_ptr, a_type, k, b_ptr, b_type, k,
            beta.ctypes.data, c_ptr, cp.cuda.runtime.CUDA_R_32F, ldc, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    if blas is not None:
        blas.gemm_ex(cp.cuda.get_current_stream().ptr, *args)
        return
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    cublas.gemmEx(handle, *args)


def matmul(w: DeviceWeight, X, Y, *, residual=None, bias=None, scratch=None, stream=None,
           trace: Trace | None = None, blas=None, x_q8=None) -> None:
    """Y = X @ w^T (+ bias) (+ residual) for a batch of tokens (prefill).

    X: (n_tok, n_in) float32, or float16 when takes_half(w, n_tok), 16-byte aligned; Y: (n_tok,
    n_out) float32 (a glu weight yields its interleaved gate/up products); residual: (n_tok,
    n_out) float32 or None, may be Y itself; bias: (n_out,) float32 or None; scratch: cupy uint8
    array of at least matmul_scratch_bytes([w, ...], n_tok) bytes (None only when that is 0).
    Tensor-core path: X and W in fp16 (W from w.half when made), fp32 accumulation (relative
    error about 1e-3); F32 weights run in float32 through cuBLAS; when uses_gemv (the flag
    K4_PREFILL_TC off, n_tok <= GEMV_MAX_TOKENS, or up to 8 tokens on int8 tensor cores with
    K4_MMA8), matrix-vector products instead (quantized: gemv_batch.gemv_rows, up to
    BATCH_TOKENS tokens per launch; float types: gemv per token; not for a glu weight: call gemv
    or gemv_rows, which apply the SwiGLU). blas: a runtime.cuda.blas.Blas for the cuBLAS calls,
    so they can be captured in a CUDA graph (None: CuPy's handle, which refuses capture). x_q8:
    None or X already quantized (q8_handoff.Q8Rows), which gemv_rows may copy instead of X. Raises
    ValueError on wrong shapes, dtypes or scratch size.
    """
    import cupy as cp

    n_out, n_in = w.shape
    n_tok = X.shape[0] if getattr(X, "ndim", 0) == 2 else -1
    half_x = getattr(X, "dtype", None) == np.float16
    if half_x and not takes_half(w, n_tok):
        raise ValueError(f"matmul of {n_tok} tokens on {w.ggml_type.name} takes float32 X, not float16")
    if w.glu and uses_gemv(w, n_tok):
        raise ValueError("a gate/up (glu) weight on the per-token path runs through gemv, which applies the SwiGLU")
    check_array("X", X, (n_tok, n_in), np.float16 if half_x else np.float32, align16=True)
    check_array("Y", Y, (n_tok, n_out))
    if residual is not None:
        check_array("residual", residual, (n_tok, n_out))
    if bias is not None:
        check_array("bias", bias, (n_out,))
    if uses_gemv(w, n_tok) and w.ggml_type in QUANT:  # up to BATCH_TOKENS tokens per read of w
        gemv_rows(w, X, Y, residual=residual, bias=bias, stream=stream, trace=trace, x_q8=x_q8)
        return
    if uses_gemv(w, n_tok):
        for i in range(n_tok):
            gemv(w, X[i], Y[i], residual=None if residual is None else residual[i], bias=bias, stream=stream, trace=trace)
        return
    x_bytes, w_bytes = _scratch_parts(w, n_tok)
    x_bytes, w_bytes = 0 if half_x else x_bytes, 0 if w.half is not None else w_bytes
    if x_bytes + w_bytes and (scratch is None or scratch.dtype != np.uint8 or scratch.nbytes < x_bytes + w_bytes):
        raise ValueError(f"matmul of {n_tok} tokens on {w.ggml_type.name} {w.shape} needs a uint8 scratch of "
                         f"{x_bytes + w_bytes} bytes (matmul_scratch_bytes)")
    in_place = residual is not None and residual.data.ptr == Y.data.ptr
    with stream or cp.cuda.get_current_stream():
        if w.ggml_type == T.F32 or half_x:
            b_ptr, b_type = X.data.ptr, cp.cuda.runtime.CUDA_R_16F if half_x else cp.cuda.runtime.CUDA_R_32F
        else:
            xh = scratch[:x_bytes].view(np.float16)
            launch(_kernel("matmul.cu", "convert_f32_f16"), (math.ceil(n_tok * n_in / 256),), (256,),
                   (X, xh, np.int64(n_tok * n_in)), 0, None, trace)
            b_ptr, b_type = xh.data.ptr, cp.cuda.runtime.CUDA_R_16F
        a_type = {T.F32: cp.cuda.runtime.CUDA_R_32F}.get(w.ggml_type, cp.cuda.runtime.CUDA_R_16F)
        whole = w.ggml_type in (T.F32, T.F16) or w.half is not None
        rows = n_out if whole else _chunk_rows(w)
        wh = None if whole else scratch[x_bytes : x_bytes + w_bytes].view(np.float16)
        for r0 in range(0, n_out, rows):
            n = min(rows, n_out - r0)
            if w.half is not None:
                a_ptr = w.half.data.ptr
            elif wh is None:
                a_ptr = w.data.data.ptr + r0 * n_in * (4 if w.ggml_type == T.F32 else 2)
            else:
                dequant_launch(w, None, r0, n, wh, "u16", None, trace)
                a_ptr = wh.data.ptr
            _gemm(n, n_tok, n_in, a_ptr, a_type, b_ptr, b_type, Y.data.ptr + 4 * r0, n_out, in_place, blas)
            if trace is not None:
                trace.launch()
        if (residual is not None and not in_place) or bias is not None:
            launch(_kernel("matmul.cu", "add_rows"), (math.ceil(n_tok * n_out / 256),), (256,),
                   (Y, null_or(None if in_place else residual), null_or(bias), np.int32(n_tok), np.int32(n_out)), 0, None, trace)
