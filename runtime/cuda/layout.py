"""Where a weight's bytes go on the device: the file's ggml blocks as they are, or *planar*
(K4_REPACK: each byte range of the block, e.g. Q6_K's ql | qh | scales | d, contiguous over all
blocks, each plane padded to 16 bytes, so every wide field is 16-byte aligned whatever the block
size), and several tensors stacked or gate/up interleaved into one matrix. weight_layout builds
it on the host (tests, microbenchmarks); the load path uploads the file's bytes and
device_layout rearranges them on the GPU. A stacked expert tensor keeps its experts apart, each
planar on its own where its type says so (expert_layout). Layouts: ggml-common.h.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k4.runtime.model import Tensor
from k4.runtime.trace import Trace

from .quant_types import FLOAT, QUANT


# ---- host layout -------------------------------------------------------------------------------

def _round16(n: int) -> int:
    return (n + 15) & ~15


def _check_matrix(t: Tensor | MatrixSpec) -> tuple[int, int]:
    if len(t.shape) != 2:
        raise ValueError(f"{t.name}: a weight matrix must be 2-D, got shape {t.shape}")
    if t.ggml_type not in QUANT and t.ggml_type not in FLOAT:
        raise ValueError(f"{t.name}: type {t.type_name} has no CUDA kernels")
    n_out, n_in = t.shape
    block = GGML_QUANT_SIZES[t.ggml_type][0]
    if n_in % block:
        raise ValueError(f"{t.name}: rows of {n_in} are not a multiple of the {t.type_name} block of {block}")
    return n_out, n_in


def planar_nbytes(ggml_type: T, nblk: int) -> int:
    """Bytes of the planar layout of `nblk` blocks of a quantized type: each plane padded to 16."""
    g = QUANT[ggml_type].groups
    return sum(_round16(nblk * (b - a)) for a, b in pairwise(g))


def weight_layout(t: Tensor, repack: bool) -> np.ndarray:
    """The bytes to upload for weight matrix `t`: uint8, 1-D, contiguous.

    Quantized types with `repack` get the planar layout (see the module docstring), everything
    else the file's bytes unchanged. Raises ValueError if `t` is not a 2-D matrix of a type with
    CUDA kernels whose rows are whole blocks.
    """
    _check_matrix(t)
    raw = t.raw_bytes()  # (n_rows, bytes_per_row)
    if not (repack and t.ggml_type in QUANT):
        return np.ascontiguousarray(raw).reshape(-1)
    g = QUANT[t.ggml_type].groups
    blocks = raw.reshape(-1, g[-1])  # (nblk, block_bytes)
    nblk = blocks.shape[0]
    out = np.zeros(planar_nbytes(t.ggml_type, nblk), np.uint8)
    off = 0
    for a, b in pairwise(g):
        out[off : off + nblk * (b - a)] = blocks[:, a:b].reshape(-1)
        off += _round16(nblk * (b - a))
    return out


# ---- device layout (the load path: file bytes uploaded as they are, rearranged on the GPU) ------

@dataclass(frozen=True)
class MatrixSpec:
    """The name, ggml type and (n_out, n_in) shape of a weight matrix whose bytes are elsewhere
    (combined(): the rows of several file tensors, laid out on the device by device_layout)."""

    name: str
    ggml_type: T
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


def combined(tensors: Sequence[Tensor], name: str, glu: bool = False) -> MatrixSpec:
    """The matrix holding the rows of `tensors` in order (attn_q, attn_k, attn_v; ffn_gate,
    ffn_up), so products with the same x run as one gemv launch: shape (sum of n_out, n_in).
    glu: the two matrices gate and up with their rows interleaved (row 2i gate's row i, row
    2i + 1 up's row i), so the gemv SwiGLU epilogue finds both rows of an output in one warp.
    Only the description: device_layout builds the bytes. Raises ValueError unless all are
    matrices of one ggml type and one n_in (glu: two of one shape)."""
    for t in tensors:
        _check_matrix(t)
    first = tensors[0]
    if glu and (len(tensors) != 2 or tensors[1].shape != first.shape):
        raise ValueError(f"{name}: gate/up interleaving takes two matrices of one shape")
    for t in tensors:
        if t.ggml_type != first.ggml_type or t.shape[1] != first.shape[1]:
            raise ValueError(f"cannot stack {t.name} ({t.type_name} {t.shape}) with {first.name} ({first.type_name} {first.shape})")
    return MatrixSpec(name, first.ggml_type, (sum(t.shape[0] for t in tensors), first.shape[1]))


def layout_nbytes(spec: MatrixSpec | Tensor, repack: bool) -> int:
    """Device bytes of weight_layout(spec, repack) (what make_weight expects)."""
    n_out, n_in = _check_matrix(spec)
    block, size = GGML_QUANT_SIZES[spec.ggml_type]
    nblk = n_out * n_in // block
    return planar_nbytes(spec.ggml_type, nblk) if repack and spec.ggml_type in QUANT else nblk * size


def needs_device_layout(spec: MatrixSpec | Tensor, repack: bool, glu: bool) -> bool:
    """Whether the uploaded file bytes must be rearranged (device_layout) rather than used as they are."""
    return glu or (repack and spec.ggml_type in QUANT)


def device_layout(dst, src, spec: MatrixSpec | Tensor, repack: bool, glu: bool, trace: Trace | None = None) -> None:
    """Write into `dst` the bytes weight_layout gives for matrix `spec`, from `src`, its rows as
    the file holds them (with glu: ffn_gate's rows, then ffn_up's; interleaved here as
    combined(glu=True) describes). dst: cupy uint8 (layout_nbytes(spec, repack),); src: cupy uint8
    (n_out * bytes per row,). CuPy copies on the current stream (a launch per plane and pad,
    counted in `trace`); allocates nothing. numpy arrays work the same (the tests compare it
    with weight_layout on the host). Raises ValueError on sizes that do not match."""
    n_out, n_in = _check_matrix(spec)
    block, size = GGML_QUANT_SIZES[spec.ggml_type]
    row_bytes = n_in // block * size
    if src.nbytes != n_out * row_bytes or dst.nbytes != layout_nbytes(spec, repack) or (glu and n_out % 2):
        raise ValueError(f"{spec.name}: device_layout got {src.nbytes} source and {dst.nbytes} destination bytes")
    lead = (n_out // 2, 2) if glu else (n_out,)  # row index, as the layout orders rows

    def rows(a, last: tuple[int, ...]):
        # a viewed as (*lead, *last) in layout order; src holds gate's rows before up's
        if glu:
            return a.reshape(2, n_out // 2, *last).swapaxes(0, 1)
        return a.reshape(*lead, *last)

    if not (repack and spec.ggml_type in QUANT):
        dst.reshape(*lead, row_bytes)[...] = rows(src, (row_bytes,))
        if trace:
            trace.launch()
        return
    groups = QUANT[spec.ggml_type].groups
    per_row = n_in // block
    blocks = rows(src, (per_row, size))  # (*lead, per_row, block bytes)
    nblk, off = n_out * per_row, 0
    for a, b in pairwise(groups):
        plane = dst[off : off + nblk * (b - a)]
        plane.reshape(*lead, per_row, b - a)[...] = blocks[..., a:b]
        pad = _round16(nblk * (b - a)) - nblk * (b - a)
        if pad:
            dst[off + nblk * (b - a) : off + nblk * (b - a) + pad] = 0
        off += nblk * (b - a) + pad
        if trace:
            trace.launch(1 + bool(pad))


# ---- expert tensors (runtime/cuda/moe.py): expert by expert, each raw or planar -----------------

def expert_nbytes(ggml_type: T, shape: tuple[int, int, int], planar: bool) -> int:
    """Device bytes of one expert of a stacked expert tensor of `shape` (n_expert, n_out, n_in):
    its planar layout's (planes padded to 16) with `planar`, else its blocks as in the file."""
    _, n_out, n_in = shape
    block, size = GGML_QUANT_SIZES[ggml_type]
    nblk = n_out * n_in // block
    return planar_nbytes(ggml_type, nblk) if planar else nblk * size


def expert_layout(dst, src, ggml_type: T, shape: tuple[int, int, int], trace: Trace | None = None) -> None:
    """Write into `dst` the planar layout of each expert of a stacked expert tensor, expert e's at
    e * expert_nbytes(ggml_type, shape, True) (what weight_layout gives that expert's matrix with
    repack), from `src`, the tensor's bytes as the file holds them. dst: uint8 (n_expert *
    expert_nbytes,); src: uint8 (the file's bytes,); cupy arrays (copies on the current stream, a
    launch per plane and pad, counted in `trace`) or numpy ones alike; allocates nothing. Raises
    ValueError for a type without planes or sizes that do not match."""
    if ggml_type not in QUANT:
        raise ValueError(f"expert tensors of {ggml_type.name} have no planar layout")
    n_expert, n_out, n_in = shape
    block, size = GGML_QUANT_SIZES[ggml_type]
    nblk = n_out * n_in // block
    slab = expert_nbytes(ggml_type, shape, True)
    if n_in % block or src.nbytes != n_expert * nblk * size or dst.nbytes != n_expert * slab:
        raise ValueError(f"expert_layout of {ggml_type.name} {shape}: got {src.nbytes} source and {dst.nbytes} destination bytes")
    blocks = src.reshape(n_expert, nblk, size)
    out = dst.reshape(n_expert, slab)
    off = 0
    for a, b in pairwise(QUANT[ggml_type].groups):
        n = nblk * (b - a)
        out[:, off : off + n].reshape(n_expert, nblk, b - a)[...] = blocks[:, :, a:b]
        pad = _round16(n) - n
        if pad:
            out[:, off + n : off + n + pad] = 0
        off += n + pad
        if trace:
            trace.launch(1 + bool(pad))
