"""Tiny GGUF models for tests: real tokenizer metadata (from stories260K.gguf), random float
weights quantized by the gguf package (Q8_0 by default), any architecture k4 runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize

from k4.runtime.model import ModelConfig, expected_shapes
from k4.runtime.synthetic import vocab_from, write_metadata

def tiny_config(arch: str = "llama", **over) -> ModelConfig:
    base = dict(
        arch=arch, name=f"tiny-{arch}", n_vocab=512, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16,
        n_ff=96, n_ctx_train=128, rms_eps=1e-5, rope_freq_base=10000.0, rope_dim=16, rope_neox=arch != "llama",
        has_qkv_bias=arch == "qwen2", has_qk_norm=arch == "qwen3", has_rope_freqs=False, tied_embeddings=False,
    )
    if arch == "phi3":  # llama.cpp's phi3 files: fused attn_qkv and gate|up ffn_up
        base.update(fused_qkv=True, fused_gate_up=True)
    base.update(over)
    return ModelConfig(**base)


def write_tiny(path: Path, vocab_gguf: Path, cfg: ModelConfig, matrix_type: T = T.Q8_0, seed: int = 0,
               skip: tuple[str, ...] = (), extra: dict | None = None) -> Path:
    """Write a model of config `cfg` with random weights to `path`; tokenizer keys are copied
    from `vocab_gguf`. `skip` leaves tensors out; `extra` adds name -> (array, type) tensors."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), cfg.arch)
    write_metadata(w, cfg, vocab_from(vocab_gguf, cfg.n_vocab))
    for name, shape in expected_shapes(cfg).items():
        if name in skip:
            continue
        if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):  # the expert router stays F32, as in llama.cpp's files
            base = 1.0 if name.endswith("norm.weight") or name.startswith("rope_") else 0.0
            w.add_tensor(name, (base + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        m = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if name == "token_embd.weight":
            m *= np.sqrt(shape[1])
        if matrix_type == T.F32:
            w.add_tensor(name, m)
        elif matrix_type == T.F16:
            w.add_tensor(name, m.astype(np.float16))
        else:
            w.add_tensor(name, quantize(m, matrix_type), raw_shape=None, raw_dtype=matrix_type)
    for name, (arr, ttype) in (extra or {}).items():
        w.add_tensor(name, arr, raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
