"""The argument types and host-side checks shared by k4's kernel launchers (runtime/cuda/ops.py,
runtime/cuda/attention_launch.py): RoPE of a layer (RopeArgs), what a layer's attention computes
beyond causal softmax (AttnShape), the decode token's fused RoPE inputs (FreshKV), and the shape
and dtype assertions (programming errors of the caller, not user errors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cupy as cp
import numpy as np

NULL = np.uint64(0)  # a null device pointer argument
OUT_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "u16"}  # output dtype -> kernel template argument


def check_f32(a: cp.ndarray, *shape: int) -> None:
    """Assert a is a C-contiguous float32 array of `shape`."""
    assert a.dtype == cp.float32 and a.flags.c_contiguous, (a.dtype, a.flags.c_contiguous)
    assert a.shape == shape, (a.shape, shape)


def check_out(a: cp.ndarray, *shape: int) -> str:
    """Check a contiguous f32 or fp16 output of `shape`; its kernel template argument."""
    assert a.dtype in OUT_TYPES and a.flags.c_contiguous and a.shape == shape, (a.dtype, a.shape, shape)
    return OUT_TYPES[a.dtype]


def row_stride(a: cp.ndarray, n_tok: int, width: int) -> int:
    """Floats between token rows of `a`: f32, either contiguous with n_tok rows of `width` values
    (any shape (n_tok, ...)), or a 2-D (n_tok, width) view whose rows are contiguous (a column
    slice of a wider product output)."""
    assert a.dtype == cp.float32 and a.shape[0] == n_tok, (a.dtype, a.shape, n_tok)
    if a.flags.c_contiguous:
        assert a.size == n_tok * width, (a.shape, width)
        return width
    assert a.ndim == 2 and a.shape[1] == width and a.strides[1] == 4 and a.strides[0] % 4 == 0, (a.shape, a.strides)
    return a.strides[0] // 4



@dataclass(frozen=True)
class RopeArgs:
    """RoPE of one layer as rope_qk_store and fused attention apply it: optional per-head
    RMSNorm of q and k first (qwen3; (D,) f32 weights or None), then rotation of the first
    rope_dim dims of each head by pos * inv_freq ((rope_dim/2,) f64), NeoX halves or
    interleaved pairs; eps of the norm; mscale: the factor on the rotated pairs' cos and sin
    (runtime/rope.py RopeTable.mscale: YaRN / LongRoPE magnitude, 1.0 otherwise)."""

    q_norm: cp.ndarray | None
    k_norm: cp.ndarray | None
    inv_freq: cp.ndarray
    rope_dim: int
    neox: bool
    eps: float
    mscale: float = 1.0

    def check(self, D: int) -> None:
        assert self.inv_freq.dtype == cp.float64 and self.inv_freq.shape == (self.rope_dim // 2,)
        assert self.rope_dim % 2 == 0 and self.rope_dim <= D
        for w in (self.q_norm, self.k_norm):
            if w is not None:
                check_f32(w, D)

    def kernel_args(self) -> tuple:
        return (NULL if self.q_norm is None else self.q_norm, NULL if self.k_norm is None else self.k_norm, self.inv_freq)


@dataclass(frozen=True)
class AttnShape:
    """What a layer's attention computes beyond plain causal softmax (Gemma): scale of q.k (None:
    1/sqrt(head_dim)); window > 0: the query at position p sees keys p - window + 1 .. p only
    (a sliding layer); softcap > 0: scores -> softcap * tanh(score / softcap) (Gemma 2); ring > 0:
    the layer's cache is a ring of that many rows (a power of two; position p at row p & (ring -
    1), runtime/swa_ring.py), 0 a plain cache (row p). The default is the llama families'
    attention, with the same kernels and arguments' effect."""

    scale: float | None = None
    window: int = 0
    softcap: float = 0.0
    ring: int = 0

    def kernel_args(self, D: int) -> tuple:
        """The kernels' (scale, window, softcap, ring) arguments; ring as the row mask, -1 for none."""
        assert self.window >= 0 and self.softcap >= 0 and self.ring & (self.ring - 1) == 0
        scale = 1.0 / math.sqrt(D) if self.scale is None else self.scale
        return np.float32(scale), np.int32(self.window), np.float32(self.softcap), ring_mask(self.ring)


def ring_mask(ring: int) -> np.int32:
    """The kernels' `ring` argument for a cache of `ring` rows as a ring (0: a plain cache, -1)."""
    return np.int32(ring - 1 if ring else -1)


PLAIN = AttnShape()


@dataclass(frozen=True)
class FreshKV:
    """For one decode query: the token's unrotated products, q (1, n_head * D), k and v
    (1, n_head_kv * D) f32 views, that the attention kernel rotates (rope) and stores itself."""

    q: cp.ndarray
    k: cp.ndarray
    v: cp.ndarray
    rope: RopeArgs
