"""Quantized blocks for tiny test models of every type k4 runs, including those neither the gguf
package nor runtime.kquants quantizes (Q2_K, Q3_K, IQ4_XS, IQ4_NL): for those, random valid blocks
(runtime.synthetic.random_blocks) with the matrix's standard deviation. Tests that compare two
backends on one file need valid weights of the right scale, not a faithful quantization."""

from __future__ import annotations

import zlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from k4.runtime import kquants
from k4.runtime.synthetic import random_blocks

RANDOM_ONLY = (T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL)  # no quantizer in gguf 0.19 or runtime.kquants
KQUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def blocks_like(m: np.ndarray, t: T) -> np.ndarray:
    """Blocks of type t for the float32 matrix m (n_rows, n_cols): uint8 (n_rows, bytes per row).

    K-quants through runtime.kquants, Q2_K/Q3_K/IQ4_XS/IQ4_NL as random blocks whose weights have m's
    standard deviation (seeded by m's bytes, so a file is the same on every run), other types
    through gguf.quants.quantize. A stacked expert tensor (n_expert, n_rows, n_cols) gives
    (n_expert, n_rows, bytes per row)."""
    if m.ndim == 3:
        return blocks_like(m.reshape(-1, m.shape[-1]), t).reshape(*m.shape[:2], -1)
    if t in RANDOM_ONLY:
        rng = np.random.default_rng(zlib.crc32(np.ascontiguousarray(m).tobytes()))
        return random_blocks(t, m.shape[0], m.shape[1], rng, float(m.std()))
    if t in KQUANTS:
        return kquants.quantize(m, t)
    return quantize(m, t)
