"""KV cache types: what `-ctk/--cache-type-k` and `-ctv/--cache-type-v` choose (llama.cpp's
options and ggml type names), and q8_0's quantization of cache rows as both backends apply it.

f16 (the default) stores each key and value as IEEE half. q8_0 stores blocks of 32 values as
llama.cpp's block_q8_0 (ggml-common.h): one fp16 scale d and 32 int8 quants, 34 bytes per 32
values; the CUDA backend keeps the quants and the scales in two planes (runtime/cuda/buffers.py).
The quantization is llama.cpp's quantize_row_q8_0_ref, in float32 arithmetic: per block,
amax = max |x|, d = amax / 127, id = 1 / d (0 when d is 0), q = roundf(x * id) (round half away
from zero), d stored as fp16 (round to nearest even); a value reads back as q * fp16(d).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import UsageError

CACHE_TYPES = ("f16", "q8_0")  # the -ctk / -ctv values
QK8_0, Q8_0_BLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]  # 32 values, fp16 d + 32 int8 quants (ggml-common.h)


def parse_cache_type(value: str, option: str) -> str:
    """The cache type named by `value` for `option` (e.g. "-ctk"). Raises UsageError for a name
    outside CACHE_TYPES."""
    if value not in CACHE_TYPES:
        raise UsageError(f"{option} {value!r} is unknown; use one of {', '.join(CACHE_TYPES)}")
    return value


@dataclass(frozen=True)
class KVTypes:
    """The element types of the KV cache: k for keys, v for values, each "f16" or "q8_0"."""

    k: str = "f16"
    v: str = "f16"

    def __post_init__(self):
        parse_cache_type(self.k, "--cache-type-k")
        parse_cache_type(self.v, "--cache-type-v")

    @property
    def quantized(self) -> bool:
        return "q8_0" in (self.k, self.v)

    def check(self, head_dim: int) -> None:
        """Raise UsageError when a q8_0 cache cannot hold rows of head_dim values (q8_0 blocks
        split each head's row, so head_dim must be a multiple of 32, as llama.cpp requires)."""
        if self.quantized and head_dim % QK8_0:
            raise UsageError(f"a q8_0 KV cache needs a head size that is a multiple of {QK8_0}; this model's is "
                             f"{head_dim}: use -ctk f16 -ctv f16")

    def bytes_per_token(self, n_layer: int, kv_dim: int) -> int:
        """Bytes one token's keys and values take in the cache: kv_dim = n_head_kv * head_dim
        values each per layer, 2 bytes a value for f16 and 34/32 for q8_0."""
        return n_layer * (row_bytes(self.k, kv_dim) + row_bytes(self.v, kv_dim))

    def text(self) -> str:
        return f"k {self.k}, v {self.v}"


F16 = KVTypes()


def row_bytes(cache_type: str, n: int) -> int:
    """Bytes of n values (a multiple of 32 for q8_0) in a cache of `cache_type`."""
    return 2 * n if cache_type == "f16" else n // QK8_0 * Q8_0_BLOCK_BYTES


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's q8_0 of x (..., n) float32, n a multiple of 32, in float32 arithmetic (module
    docstring): (quants (..., n) int8, scales (..., n / 32) float16)."""
    assert x.shape[-1] % QK8_0 == 0, x.shape
    b = np.asarray(x, dtype=np.float32).reshape(*x.shape[:-1], -1, QK8_0)  # (..., n/32, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)  # (..., n/32, 1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    y = (b * inv).astype(np.float64)  # float32 products, exact in float64
    q = np.trunc(y + np.copysign(0.5, y))  # roundf: half away from zero (exact in float64)
    return q.astype(np.int8).reshape(x.shape), d[..., 0].astype(np.float16)


def dequantize_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q (..., n) int8, d (..., n / 32) float16 -> (..., n) float32 values q * d."""
    b = q.reshape(*q.shape[:-1], -1, QK8_0).astype(np.float32)
    return (b * d.astype(np.float32)[..., None]).reshape(q.shape)


def round_trip(x: np.ndarray, cache_type: str) -> np.ndarray:
    """x (..., n) float32 as a cache of `cache_type` gives it back: unchanged for f16 (the numpy
    backend keeps float32), dequantize_q8_0(quantize_q8_0(x)) for q8_0."""
    if cache_type == "f16":
        return x
    return dequantize_q8_0(*quantize_q8_0(x))
