"""Inputs on which RMSNorm's eps matters, and the float64 formula the norm tests compare with.

RMSNorm (llama.cpp ggml_rms_norm): y = x / sqrt(mean(x^2) + eps) * w. In a trained model
mean(x^2) is far above eps (about 0.1 in stories260K against eps 1e-5), so moving eps outside
the sqrt or dropping it moves the output by about 1e-4 relative, within most limits. Rows here
have mean(x^2) from 0 to 100 eps: at 1 eps either mistake moves the output by about 40%.
"""

from __future__ import annotations

import numpy as np

# mean(x^2) / eps of each row; the 0 row is all zeros (its norm is 0, finite only through eps)
RATIOS = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 10.0, 100.0)


def eps_rows(rng: np.random.Generator, n: int, eps: float, ratios=RATIOS) -> np.ndarray:
    """(len(ratios), n) float32 rows, row r with mean(x^2) = ratios[r] * eps (to float32
    rounding): Gaussian draws plus an offset of 0.3 (a mean, as real activations have), scaled."""
    g = rng.standard_normal((len(ratios), n)) + 0.3  # (rows, n)
    scale = np.sqrt(np.asarray(ratios)[:, None] * eps / np.mean(g * g, axis=1, keepdims=True))
    return (g * scale).astype(np.float32)


def norm_weight(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n,) float32 norm weights, 1 +- 0.3 (unequal, as trained ones are)."""
    return (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)


def rms_norm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n), w (n,) -> x / sqrt(mean(x^2) + eps) * w over the last axis, in float64."""
    x64 = np.asarray(x, np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def eps_outside_sqrt64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The mistake x / (sqrt(mean(x^2)) + eps) * w, float64 (what a limit must reject)."""
    x64 = np.asarray(x, np.float64)
    return x64 / (np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True)) + eps) * np.asarray(w, np.float64)


def row_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Relative L2 error of each row of got (..., n) against want; an all-zero want row counts
    the absolute error (any non-zero or NaN output there is an error)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    num = np.linalg.norm(got - want, axis=-1)
    den = np.linalg.norm(want, axis=-1)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), num)
