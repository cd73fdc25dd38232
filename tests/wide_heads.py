"""stories260K with its attention heads widened by zero padding, so that a q8_0 KV cache (whose
blocks of 32 must not cross a head, as llama.cpp requires) can hold it: the same function,
a real trained model for KV cache tests on the story text.

Each head of 8 becomes a head of WIDE_HEAD_DIM: q, k and v rows of head h go to rows
h * WIDE_HEAD_DIM .. + 7 (the rest zero), attn_output's columns likewise; RoPE keeps its 8
rotated dimensions (rope.dimension_count), the padding passes through as zeros. The scores
q.k / sqrt(head_dim) keep their values because q is multiplied by sqrt(WIDE_HEAD_DIM / 8) = 4,
a power of two (exact in float). Values and outputs of the padded dimensions are zero.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from k4.runtime.model import expected_shapes, open_model
from k4.runtime.synthetic import vocab_from, write_metadata
from k4.runtime.weights import dequantize_tensor

WIDE_HEAD_DIM = 128  # head_dim of the widened model: tiled and tensor-core prefill attention have instances for it


def _rows(w: np.ndarray, n_heads: int, hd: int, wide: int, factor: float = 1.0) -> np.ndarray:
    """(n_heads * hd, n) rows -> (n_heads * wide, n), head h's rows first in its block."""
    out = np.zeros((n_heads, wide, w.shape[1]), dtype=np.float32)
    out[:, :hd] = w.reshape(n_heads, hd, -1) * np.float32(factor)
    return out.reshape(n_heads * wide, -1)


def write_wide_heads(src: Path, dst: Path, wide: int = WIDE_HEAD_DIM) -> Path:
    """Write `src` (an F32 llama GGUF such as stories260K.gguf) with heads widened to `wide`
    (a multiple of 32, wide / head_dim a power of four) to `dst`; returns dst."""
    mf = open_model(src)
    cfg = mf.config
    hd = cfg.head_dim
    factor = float(np.sqrt(wide / hd))
    assert factor == int(factor) and (int(factor) & (int(factor) - 1)) == 0, "sqrt(wide / head_dim) must be a power of two"
    new = dataclasses.replace(cfg, head_dim=wide, rope_dim=cfg.rope_dim)
    w = GGUFWriter(str(dst), new.arch)
    write_metadata(w, new, vocab_from(src, new.n_vocab), family=False)
    for name, shape in expected_shapes(new).items():
        a = dequantize_tensor(mf.tensor(name))
        if name.endswith("attn_q.weight"):
            a = _rows(a, cfg.n_head, hd, wide, factor)
        elif name.endswith(("attn_k.weight", "attn_v.weight")):
            a = _rows(a, cfg.n_head_kv, hd, wide)
        elif name.endswith("attn_output.weight"):
            a = np.ascontiguousarray(_rows(np.ascontiguousarray(a.T), cfg.n_head, hd, wide).T)
        assert a.shape == shape, (name, a.shape, shape)
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
