"""Tiny GGUF models for tests: real tokenizer metadata (from stories260K.gguf), random weights,
any architecture k4 runs. Matrices default to Q8_0 (quantized by the gguf package)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize

from runtime.model import ModelConfig, expected_shapes, open_model

TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
)


def tiny_config(arch: str = "llama", **over) -> ModelConfig:
    base = dict(
        arch=arch, name=f"tiny-{arch}", n_vocab=512, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16,
        n_ff=96, n_ctx_train=128, rms_eps=1e-5, rope_freq_base=10000.0, rope_dim=16, rope_neox=arch != "llama",
        has_qkv_bias=arch == "qwen2", has_qk_norm=arch == "qwen3", has_rope_freqs=False, tied_embeddings=False,
    )
    base.update(over)
    return ModelConfig(**base)


def write_tiny(path: Path, vocab_gguf: Path, cfg: ModelConfig, matrix_type: T = T.Q8_0, seed: int = 0,
               skip: tuple[str, ...] = (), extra: dict | None = None) -> Path:
    """Write a model of config `cfg` with random weights to `path`; tokenizer keys are copied
    from `vocab_gguf`. `skip` leaves tensors out; `extra` adds name -> (array, type) tensors."""
    rng = np.random.default_rng(seed)
    src = open_model(vocab_gguf, require_weights=False)
    w = GGUFWriter(str(path), cfg.arch)
    a = cfg.arch
    w.add_uint32(f"{a}.embedding_length", cfg.n_embd)
    w.add_uint32(f"{a}.block_count", cfg.n_layer)
    w.add_uint32(f"{a}.feed_forward_length", cfg.n_ff)
    w.add_uint32(f"{a}.attention.head_count", cfg.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.context_length", cfg.n_ctx_train)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.rope_dim)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_freq_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_string("tokenizer.ggml.model", src.meta("tokenizer.ggml.model"))
    w.add_token_list(src.meta("tokenizer.ggml.tokens"))
    w.add_token_scores(src.meta("tokenizer.ggml.scores"))
    w.add_token_types(src.meta("tokenizer.ggml.token_type"))
    w.add_bos_token_id(src.meta("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(src.meta("tokenizer.ggml.eos_token_id"))
    for name, shape in expected_shapes(cfg).items():
        if name in skip:
            continue
        if len(shape) == 1:
            base = 1.0 if name.endswith("norm.weight") or name == "rope_freqs.weight" else 0.0
            w.add_tensor(name, (base + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        m = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
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
