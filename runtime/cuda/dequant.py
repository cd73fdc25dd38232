"""Rows of a weight matrix dequantized on the GPU (kernels_cu/matmul.cu dequant_q and its float
kinds): the embedding lookup (dequant_rows) and the launch that prefill's fp16 row ranges and
fp16 weight copies (runtime/cuda/matmul.py) run through. Values are exactly gguf's numpy
dequantize (rounded to fp16 for the "u16" output). Host-side checks raise ValueError; the
launches can be captured in a CUDA graph and are counted in `trace` when given."""

from __future__ import annotations

import math

import numpy as np

from k4.runtime.trace import Trace

from .arg_checks import check_array
from .launch import launch, null_or
from .quant_kernels import _dequant_name, _kernel
from .quant_types import QUANT


def dequant_launch(w, row_ids, row0: int, n_rows: int, out, out_type: str, stream, trace,
                   scale: float = 1.0) -> None:
    """Enqueue rows row_ids[i] (or row0 + i with row_ids None), i < n_rows, of the device_weight.DeviceWeight
    w into out (n_rows, n_in): out_type "float" (float32, times scale) or "u16" (fp16 bits). The
    caller checks the shapes."""
    n_in = w.shape[1]
    kernel = _kernel("matmul.cu", _dequant_name(w.ggml_type, w.planar, out_type), w.evict_first)
    if w.ggml_type in QUANT:
        per_row = n_in // 16  # runs of 16 weights per row
        args = (w.data, np.int64(w.n_blocks), np.int32(n_in), null_or(row_ids), np.int32(row0), np.int32(n_rows), out)
    else:
        per_row = n_in
        args = (w.data, np.int32(n_in), null_or(row_ids), np.int32(row0), np.int32(n_rows), out)
    args += (np.float32(scale),)
    threads = 256  # a multiple of every type's runs per ggml block (dequant_q's scale needs it)
    launch(kernel, (math.ceil(n_rows * per_row / threads),), (threads,), args, 0, stream, trace)


def dequant_rows(w, row_ids, out, stream=None, trace: Trace | None = None, scale: float = 1.0) -> None:
    """out[i] = float32 row row_ids[i] of w, exactly as gguf's numpy dequantize computes it;
    times `scale` (gemma's embedding scale sqrt(n_embd)) when not 1, exactly as numpy's
    row * np.float32(scale) (one float32 product per value).

    row_ids: (n,) int32 cupy array of row indices, each in [0, n_out) (not checked: the ids
    stay on the device); out: (n, n_in) float32 cupy array, contiguous, 16-byte aligned.
    Raises ValueError on wrong shapes or dtypes.
    """
    n = row_ids.shape[0] if getattr(row_ids, "ndim", 0) == 1 else -1
    check_array("row_ids", row_ids, (n,), np.int32)
    check_array("out", out, (n, w.shape[1]), align16=True)
    if n:
        dequant_launch(w, row_ids, 0, n, out, "float", stream, trace, scale)
