"""Host-side builders of combined weight matrices, for tests: the bytes that
runtime.cuda.matmul.combined describes and device_layout builds on the GPU at load, made here in
numpy so the device path can be checked against them and kernels can be fed fused matrices."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from k4.runtime.cuda.layout import combined
from k4.runtime.model import Tensor


def stack_rows(tensors: Sequence[Tensor], name: str) -> Tensor:
    """One matrix holding the rows of `tensors` in order (combined(tensors)): shape (sum of n_out,
    n_in), encoded bytes concatenated (a host copy). Raises ValueError as combined does."""
    spec = combined(tensors, name)
    raw = np.concatenate([t.raw_bytes() for t in tensors], axis=0)  # (sum n_out, bytes_per_row)
    return Tensor(name, spec.ggml_type, spec.shape, raw)


def interleave_rows(gate: Tensor, up: Tensor, name: str) -> Tensor:
    """One matrix of shape (2 n_ff, n_in) whose row 2i is gate's row i and row 2i + 1 up's row i
    (combined([gate, up], glu=True)), the layout of a DeviceWeight with glu=True. Encoded bytes, a
    host copy. Raises ValueError as combined does."""
    spec = combined([gate, up], name, glu=True)
    raw = np.stack([gate.raw_bytes(), up.raw_bytes()], axis=1)  # (n_ff, 2, bytes_per_row)
    return Tensor(name, spec.ggml_type, spec.shape, raw.reshape(spec.shape[0], -1))
