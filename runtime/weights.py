"""Weights of the numpy reference backend: kept in their GGUF encoding, dequantized on use.

A Q4_K_M file is about 7x smaller than its weights in float32 (4.8 bits per weight against 32),
so the reference keeps every matrix as the memory-mapped bytes of its ggml type and turns it into
float32 only for the product that reads it: the whole matrix at once when it fits in
`block_bytes` of float32 (one product, the same float32 math as a matrix dequantized at load), else
in blocks of rows. Small models keep their dequantized matrices between steps instead, when all
of them fit in the backend's cache budget (dequantizing costs more than the product there).

Dequantization: gguf.quants, the gguf package's numpy port of ggml's dequantize_row_* (each
ggml block decodes on its own, so any row range decodes to the same values as the whole tensor).
"""

from __future__ import annotations

import mmap
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from .model import Tensor

DEQUANT_PIECE_BYTES = 2**20  # float32 bytes one gguf call produces (its temporaries are ~3x that)


def dequantize_tensor(t: Tensor) -> np.ndarray:
    """A GGUF tensor decoded to float32, numpy shape t.shape (gguf.quants is the oracle).

    F32 tensors come back as the memory-mapped array itself (no copy)."""
    return np.ascontiguousarray(dequantize(t.raw, t.ggml_type), dtype=np.float32).reshape(t.shape)


def dequantize_rows(t: Tensor, start: int, stop: int) -> np.ndarray:
    """Rows start..stop-1 of a matrix t (n_rows, n_in) as float32 (stop - start, n_in).

    Decoded DEQUANT_PIECE_BYTES of output at a time, so gguf's temporaries stay small; the values
    equal dequantize_tensor(t)[start:stop] bit for bit."""
    n_in = t.shape[-1]
    raw = t.raw_bytes()  # (n_rows, bytes_per_row) uint8, memory-mapped
    out = np.empty((stop - start, n_in), dtype=np.float32)  # (stop - start, n_in)
    step = max(1, DEQUANT_PIECE_BYTES // (4 * n_in))
    for r in range(start, stop, step):
        e = min(stop, r + step)
        out[r - start : e - start] = dequantize(raw[r:e], t.ggml_type).reshape(e - r, n_in)
    return out


class Matrix:
    """A weight matrix of shape (n_out, n_in) in its GGUF encoding, memory-mapped.

    f32: the float32 matrix kept between steps, or None. F32 tensors are used in place from the
    memory map; other types are kept only after keep() (the backend's cache decision).
    block_rows: rows dequantized at a time by product() when nothing is kept: all n_out rows
    (one product) when the float32 matrix fits in block_bytes, else block_bytes // (4 n_in).
    """

    def __init__(self, t: Tensor, block_bytes: int):
        self.tensor = t
        self.shape = t.shape  # (n_out, n_in)
        n_out, n_in = t.shape
        self.block_rows = n_out if 4 * n_out * n_in <= block_bytes else max(1, block_bytes // (4 * n_in))
        self.f32 = dequantize_tensor(t) if t.ggml_type == GGMLQuantizationType.F32 else None  # (n_out, n_in) or None

    @property
    def f32_bytes(self) -> int:
        """Bytes of the matrix in float32 (0 for an F32 tensor, which is used in place)."""
        return 0 if self.tensor.ggml_type == GGMLQuantizationType.F32 else 4 * self.tensor.n_elements

    def keep(self) -> None:
        """Dequantize the whole matrix once and keep it in f32."""
        if self.f32 is None:
            self.f32 = dequantize_rows(self.tensor, 0, self.shape[0])

    def product(self, x: np.ndarray) -> np.ndarray:
        """x (T, n_in) float32 -> x @ W.T, (T, n_out) float32.

        One product over the whole float32 matrix when it is kept or fits in a block (the same
        float32 math either way); otherwise one product per block of rows, whose results differ
        from the single product only by the BLAS summation order (float32 rounding)."""
        if self.f32 is not None:
            return x @ self.f32.T
        n_out = self.shape[0]
        if self.block_rows >= n_out:
            return x @ dequantize_rows(self.tensor, 0, n_out).T
        y = np.empty((x.shape[0], n_out), dtype=np.float32)  # (T, n_out)
        for r in range(0, n_out, self.block_rows):
            e = min(n_out, r + self.block_rows)
            y[:, r:e] = x @ dequantize_rows(self.tensor, r, e).T
        return y

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows ids (T,) int as float32 (T, n_in); only those rows are dequantized."""
        if self.f32 is not None:
            return self.f32[ids]
        n_in = self.shape[1]
        return dequantize(self.tensor.raw_bytes()[ids], self.tensor.ggml_type).reshape(len(ids), n_in)


def read_pages(t: Tensor) -> None:
    """Read one byte of every memory page of t's data, so the file is read from disk at load
    (and counted there) rather than during the first token."""
    flat = t.raw_bytes().reshape(-1)  # (n_bytes,) uint8, memory-mapped
    int(flat[:: mmap.PAGESIZE].sum(dtype=np.uint64))

