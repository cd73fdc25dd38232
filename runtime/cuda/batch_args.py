"""The argument checks of the few-token products (runtime/cuda/gemv_batch.py gemv_batch,
runtime/cuda/gemv_mma.py gemv_mma): X, Y and residual as row ranges of wider arrays, bias, the
gate/up (glu) restrictions. Programming errors of the caller: ValueError, as matmul.py's checks.
Importable without a GPU (CuPy is imported when a check runs).
"""

from __future__ import annotations

import numpy as np

from .device_weight import DeviceWeight


def check_rows(name: str, a, shape: tuple[int, int], align16: bool = False) -> int:
    """Check a (rows, cols) float32 cupy array whose rows are contiguous and may be any whole
    number of floats apart (a row range or column range of a bigger array), not overlapping;
    returns that row stride in floats. align16: the start and the stride are 16-byte multiples.
    Raises ValueError naming `name` otherwise."""
    import cupy as cp

    if not isinstance(a, cp.ndarray) or a.dtype != np.float32 or a.shape != shape or (a.strides[1] != 4 and shape[1] > 1):
        got = f"{a.dtype} {a.shape} strides {a.strides}" if isinstance(a, cp.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a float32 cupy array of shape {shape} with contiguous rows, got {got}")
    stride = a.strides[0] if shape[0] > 1 else 4 * shape[1]
    if stride % 4 or stride < 4 * shape[1]:
        raise ValueError(f"{name}: rows {stride} bytes apart, need a multiple of 4 and at least {4 * shape[1]}")
    if align16 and (a.data.ptr % 16 or stride % 16):
        raise ValueError(f"{name} must start at a 16-byte aligned address with rows a multiple of 16 bytes apart")
    return stride // 4


def check_products(what: str, w: DeviceWeight, X, Y, residual, bias, max_tokens: int) -> tuple[int, int, int, int, int]:
    """Check the arguments of Y[t] = w @ X[t] (+ bias) (+ residual[t]) for 1 .. max_tokens rows
    (`what`: the product's name in messages): X (n_tok, n_in) rows 16-byte aligned and a multiple
    of 16 bytes apart; Y and residual (n_tok, n_out) rows any whole number of floats apart, with
    n_out halved for a glu weight, which takes neither residual nor bias; a residual at Y's
    address is Y itself; bias (n_out,). Returns (n_tok, n_out, x_stride, y_stride, r_stride),
    strides in floats (r_stride 0 without residual). Raises ValueError on any mismatch."""
    n_out, n_in = w.shape
    n_tok = X.shape[0] if getattr(X, "ndim", 0) == 2 else -1
    if not 1 <= n_tok <= max_tokens:
        raise ValueError(f"{what} multiplies 1 to {max_tokens} tokens at once, got X of shape {getattr(X, 'shape', None)}")
    if w.glu:
        n_out //= 2
        if residual is not None or bias is not None:
            raise ValueError("a gate/up (glu) product takes no residual and no bias")
    x_stride = check_rows("X", X, (n_tok, n_in), align16=True)
    y_stride = check_rows("Y", Y, (n_tok, n_out))
    r_stride = 0
    if residual is not None:
        r_stride = check_rows("residual", residual, (n_tok, n_out))
        if residual.data.ptr == Y.data.ptr and r_stride != y_stride:
            raise ValueError("a residual at Y's address must be Y itself (the same row stride)")
    if bias is not None:
        check_rows("bias", bias.reshape(1, -1) if getattr(bias, "ndim", 0) == 1 else bias, (1, n_out))
    return n_tok, n_out, x_stride, y_stride, r_stride
