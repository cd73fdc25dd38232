"""The 8-bit handoff between decode's matrix-vector products (runtime/cuda/matmul.py gemv's x_q8
and y_q8): the quantized vector a SwiGLU product writes for the down product (flag
K4_FUSE_QUANT), or a residual product for the products after the next RMSNorm (norm_out, flag
K4_NORM_Q8), its host reference, and the checks gemv applies to it; and its form of a few rows
(Q8Rows), which the verify step's products take and hand on (gemv_batch, gemv_mma)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .constants import FOLD_MAX_WARPS, q8x_bytes, q8x_offsets
from .gemv_choice import NQ_TYPES, gemv_variant, nx_reads
from .quant_types import QUANT


@dataclass
class Q8Vector:
    """A vector of n float32 values quantized to 8 bits per 32 (q8x_bytes(n) bytes in `data`, a
    cupy uint8 array), laid out for the gemv_q8 instances of x_swizzle `swizzle`
    (QuantKernels.x_swizzle): what a SwiGLU product hands the down product (gemv y_q8, x_q8), so
    that it is quantized once instead of in every thread block of the next kernel. The scheme is
    llama.cpp's q8_1 (ggml-quants.c quantize_row_q8_1): d = max|v| / 127, q = round(v / d)."""

    data: object
    n: int
    swizzle: int
    # An NQ product's handoff (gemv norm_out, flag K4_NORM_Q8): data holds its y times the next
    # RMSNorm's weights, quantized without the norm's scale; parts (float32 cupy array) its
    # blocks' sums of y^2, n_parts of them, and eps the norm's. The product given it as x_q8
    # scales its sums by rsqrt(sum(parts) / n + eps). None: a plain q8 vector.
    parts: object = None
    n_parts: int = 0
    eps: float = 0.0

    @staticmethod
    def for_weight(w, data) -> "Q8Vector":
        """The q8 x of w's (a device_weight.DeviceWeight) gemv_q8 kernel, (n_in,) values, in `data` (at least q8x_bytes(n_in)
        bytes, may be shared with Q8Vectors used at other times). Raises ValueError for a float
        weight type or a buffer that is too small."""
        if w.ggml_type not in QUANT:
            raise ValueError(f"{w.ggml_type.name} products take float x, not a q8 vector")
        n = w.shape[1]
        if data.dtype != np.uint8 or data.nbytes < q8x_bytes(n):
            raise ValueError(f"a q8 vector of {n} values needs {q8x_bytes(n)} uint8 bytes, got {data.dtype} ({data.nbytes} bytes)")
        return Q8Vector(data, n, QUANT[w.ggml_type].x_swizzle)


@dataclass
class Q8Rows:
    """n_tok vectors of n float32 values quantized to 8 bits per 32 (llama.cpp's q8_1 scheme, as
    Q8Vector), each q8x_bytes(n) bytes, one after another in `data` (cupy uint8), laid
    out for the products of x swizzle `swizzle` (QuantKernels.x_swizzle): gemv_batch's X
    quantized once (quantize_rows) instead of in every thread block of the product.

    With parts, the NQ handoff of the verify step's products (gemv_mma nq_out, flag K4_MMA8_NQ),
    as Q8Vector's for each row: n_parts sums of y^2 a row (row t's at t * n_parts) and the norm's
    eps; only gemv_mma reads it (its blocks scale each d by the norm)."""

    data: object
    n_tok: int
    n: int
    swizzle: int
    parts: object = None  # float32 cupy array, or None: plain rows
    n_parts: int = 0
    eps: float = 0.0

    @staticmethod
    def nbytes(n_tok: int, n: int) -> int:
        """Bytes of n_tok quantized vectors of n values."""
        return n_tok * q8x_bytes(n)


def folds_norm(variant: tuple[int, int, int]) -> bool:
    """Whether a gemv_q8 launch of variant (WARPS, U, PF) with an RMSNorm, no post-norm and no
    x_q8_out folds the norm's scale into its outputs (kernels_cu/gemv.cu: quantize_x_unscaled, one
    pass over x, in instances of at most FOLD_MAX_WARPS warps; the 32-warp ones, at 64 registers,
    keep two passes, as do products handing their q8 x on)."""
    return variant[0] <= FOLD_MAX_WARPS


def q8x_host(x: np.ndarray, swizzle: int) -> np.ndarray:
    """x (n,) float32, n a multiple of 32, quantized as the gemv_q8 kernels quantize it: the
    (q8x_bytes(n),) uint8 bytes of a Q8Vector of that swizzle, padding zero. The reference the
    kernels' handoff is tested against, and bench_gemv's pre-quantized x."""
    x = np.asarray(x, np.float32)
    n = x.shape[0]
    g = x.reshape(-1, 32)
    amax = np.abs(g).max(axis=1)
    d = amax * np.float32(1 / 127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    units = np.rint(g * inv[:, None]).astype(np.int8).reshape(-1, 16)
    s = np.repeat(d, 2) * units.sum(axis=1, dtype=np.int32).astype(np.float32)
    d_off, s_off, nbytes = q8x_offsets(n)
    out = np.zeros(nbytes, np.uint8)
    u = np.arange(units.shape[0])
    slot = (u & ~7) | ((u + swizzle * (u >> 3)) & 7)
    out[16 * slot[:, None] + np.arange(16)] = units.view(np.uint8)
    out[d_off : d_off + 4 * d.size] = d.view(np.uint8)
    out[s_off : s_off + 4 * s.size] = s.astype(np.float32).view(np.uint8)
    return out


def can_hand_off(glu, down) -> bool:
    """Whether gemv on the gate/up device_weight.DeviceWeight `glu` can write its output quantized (y_q8) for gemv on
    `down` to read (x_q8): both quantized, glu's type with a handoff, n_ff a multiple of 32."""
    n_ff = down.shape[1]
    return (glu.glu and glu.ggml_type in QUANT and QUANT[glu.ggml_type].handoff and down.ggml_type in QUANT
            and n_ff % 32 == 0 and glu.shape[0] == 2 * n_ff)


def check_q8(w, x_q8: Q8Vector | None, y_q8: Q8Vector | None, n_in: int, n_out: int, norm: bool, norm_out: bool = False,
             variant: tuple[int, int, int] | None = None) -> None:
    """gemv's checks of its q8 handoff arguments for device_weight.DeviceWeight w (n_out: its outputs,
    SwiGLU pairs for a glu weight) launched with `variant` (ValueError)."""
    if norm_out:
        if y_q8 is None or w.glu or w.ggml_type not in NQ_TYPES or n_out % 32 or x_q8 is not None and x_q8.parts is not None:
            raise ValueError("norm_out needs y_q8, a non-glu weight of an NQ type, n_out a multiple of 32 and no normed x_q8")
        if y_q8.n != n_out:
            raise ValueError(f"y_q8 holds {y_q8.n} values; this product writes {n_out}")
        y_q8 = None
    if x_q8 is not None and x_q8.parts is not None:  # an NQ handoff: only NX instances read it
        if not nx_reads(w.ggml_type, variant or gemv_variant(w.ggml_type, n_out, n_in, w.glu), w.glu):
            n_y = n_out * (2 if w.glu else 1)
            raise ValueError(f"no product of {w.ggml_type.name} {(n_y, n_in)} reads an NQ handoff (x_q8 with parts)")
    q = QUANT.get(w.ggml_type)
    if x_q8 is not None:
        if q is None or norm:
            raise ValueError("x_q8 needs a quantized weight and no fused norm")
        if (x_q8.n, x_q8.swizzle) != (n_in, q.x_swizzle):
            raise ValueError(f"x_q8 holds {x_q8.n} values for swizzle {x_q8.swizzle}; this product needs {n_in} for {q.x_swizzle}")
    if y_q8 is not None:
        if q is None or not (w.glu and q.handoff) or n_out % 32:
            raise ValueError("y_q8 needs a gate/up (glu) weight of a type with a handoff and n_out a multiple of 32")
        if y_q8.n != n_out:
            raise ValueError(f"y_q8 holds {y_q8.n} values; this product writes {n_out}")
