"""Shared by the product tests (test_cuda_gemv, test_cuda_matmul, test_cuda_q8_handoff,
test_cuda_gemv_batch, test_cuda_moe, test_cuda_norms): the types and shapes they cover, random
device weights with their float64 reference, the numpy references of what the kernels compute
(x rounded to 8 bits as the kernels round it, RMSNorm, the GLU activations) and the error limits.

Error limits (relative L2, ||got - ref|| / ||ref||). gemv on quantized weights quantizes x to 8
bits per 32 values: against numpy with x rounded the same way (q8_rounded), float32 rounding
only, limit 1e-4; against the float x, the error of that rounding, about 5e-3 on random data,
limit 1e-2 (checked on shapes with many rows, where the norm is stable). gemv on float weights,
float32: 1e-5. Prefill on tensor cores rounds X and W to fp16: about 4e-4, limit 2e-3.
dequant_rows is exact. Quantized blocks use the full ranges of real files' scale fields (Q6_K's
int8 scales -128..127, all 6-bit K-quant scale and min codes; runtime.synthetic.random_blocks
full_range). Inputs are seeded by the test id (fresh_rng; the seed is in the failure message);
outputs are poisoned with NaN before each call (nan_like).
"""

from __future__ import annotations

import os
import zlib

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from k4.runtime.cuda import layout as lay
from k4.runtime.cuda.device_weight import make_weight
from k4.runtime.cuda.microbench import random_weight
from tests.helpers_matmul import interleave_rows

QUANTIZED = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_0", "IQ4_XS", "IQ4_NL"]
FLOATS = ["F16", "BF16", "F32"]
LIMIT_Q8 = 1e-2
LIMIT_Q8_ROUNDED = 1e-4
LIMIT_F32 = 1e-5
LIMIT_FP16 = 2e-3


def shapes(type_name: str) -> list[tuple[int, int]]:
    """(n_out, n_in) cases: n_out from 1 to more rows than the grid has warps, n_in from one
    block to many; float types also get rows that are not a multiple of 16 bytes."""
    block = GGML_QUANT_SIZES[T[type_name]][0] if type_name in QUANTIZED else 32
    second = (37, 37) if type_name in FLOATS else (37, 2 * block)
    return [(5, block), second, (300, 3 * block), (4133, 8 * block)]


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def q8_rounded(x: np.ndarray) -> np.ndarray:
    """x (float32, length a multiple of 32) as the q8 gemv kernels see it, float64: rounded to
    int8 per 32 values with scale max|x|/127 (kernels_cu/gemv.cu quantize_x)."""
    g = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(g).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    return (np.rint(g * inv) * (amax * np.float32(1 / 127))).astype(np.float64).reshape(-1)


def gemv_ref(type_name: str, ref_w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, float]:
    """(reference y, error limit) for gemv of x on a weight of type_name."""
    if type_name in QUANTIZED:
        return ref_w @ q8_rounded(x), LIMIT_Q8_ROUNDED
    return ref_w @ x.astype(np.float64), LIMIT_F32


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator seeded by the running test's id (crc32), so every run draws the same inputs."""
    seed = zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())
    return np.random.default_rng(seed), seed


def weight(type_name: str, n_out: int, n_in: int, rng, repack: bool):
    """(device weight, float64 reference matrix (n_out, n_in))."""
    import cupy as cp

    t = random_weight(T[type_name], n_out, n_in, rng)
    w = make_weight(t, cp.asarray(lay.weight_layout(t, repack)), repack)
    return w, dequantize(t.raw_bytes(), t.ggml_type).astype(np.float64)


def glu_weight(ggml_type: T, n_ff: int, n_in: int, rng, repack: bool = True, act: str = "silu"):
    """(device gate/up weight with the `act` epilogue, gate's and up's float64 references
    (n_ff, n_in) each): random gate then up matrices of ggml_type, interleaved as DeviceWeight's
    glu layout expects (tests/helpers_matmul.py interleave_rows)."""
    import cupy as cp

    gate, up = (random_weight(ggml_type, n_ff, n_in, rng) for _ in range(2))
    t = interleave_rows(gate, up, "ffn_gate_up")
    w = make_weight(t, cp.asarray(lay.weight_layout(t, repack)), repack, glu=True, glu_act=act)
    ref_g, ref_u = (dequantize(p.raw_bytes(), p.ggml_type).astype(np.float64) for p in (gate, up))
    return w, ref_g, ref_u


def nan_like(shape):
    import cupy as cp

    return cp.full(shape, cp.nan, cp.float32)


def rms_normed(x: np.ndarray, norm_w: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * norm_w in float64 (runtime/reference.py rms_norm)."""
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64) + eps) * norm_w.astype(np.float64)



def silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def gelu_tanh(v: np.ndarray) -> np.ndarray:
    """runtime/reference.py's formula in float64: 0.5 v (1 + tanh(sqrt(2/pi) v (1 + 0.044715 v^2)))."""
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * v * (1 + 0.044715 * v * v)))


GLU_REF = {"silu": silu, "gelu_tanh": gelu_tanh}  # the epilogue's act against numpy
