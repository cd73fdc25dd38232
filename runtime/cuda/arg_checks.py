"""The host-side argument checks of the matrix-vector launchers (runtime/cuda/matmul.py gemv,
runtime/cuda/gemv_pair.py): ValueError for a caller's programming error, before any launch."""

from __future__ import annotations

import numpy as np


def check_array(name: str, a, shape: tuple[int, ...], dtype=np.float32, align16: bool = False) -> None:
    """Raise ValueError naming `name` unless `a` is a contiguous cupy array of `shape` and `dtype`
    (16-byte aligned with align16)."""
    import cupy as cp

    if not isinstance(a, cp.ndarray) or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
        got = f"{a.dtype} {a.shape}" if isinstance(a, cp.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a contiguous {np.dtype(dtype).name} cupy array of shape {shape}, got {got}")
    if align16 and a.data.ptr % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address")


def check_post(post, x, n_in: int, norm: bool, x_q8: bool) -> tuple:
    """gemv's (and gemv_pair's) post argument checked: (t, post_w, x_out), or three Nones."""
    if post is None:
        return None, None, None
    if not norm or x_q8:
        raise ValueError("a folded post-norm needs the fused RMSNorm (norm) and no x_q8")
    t, post_w, x_out = post
    for name, a in (("post-norm input", t), ("post-norm weight", post_w), ("post-norm output", x_out)):
        check_array(name, a, (n_in,), align16=True)
    if x_out.data.ptr in (x.data.ptr, t.data.ptr):
        raise ValueError("the post-norm output must not be x or t")
    return t, post_w, x_out
