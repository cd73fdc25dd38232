"""Synthetic models: the exact shapes and Q4_K_M tensor-type layout of real models, with random,
numerically sane weights, written as quantized blocks directly (no float weights are made).

Speed does not depend on weight values, so these are how k4 is benchmarked at real sizes.
Shapes: the models' published configs (Hugging Face config.json of each). Q4_K_M type choice:
llama.cpp's, as runtime.quantize implements it. Block layouts: ggml-common.h.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T

from .arch import ARCHITECTURES
from .errors import UsageError
from .family_keys import family_fields, family_keys
from .model import SAMPLE_MODEL, ModelConfig, expected_shapes, open_model
from .outfile import check_output, partial_output



@dataclass(frozen=True)
class Preset:
    """A real model's shape. Sizes in elements; n_ctx is the training context."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int
    rope_freq_base: float
    rms_eps: float
    head_dim: int = 0  # 0: n_embd // n_head
    tied: bool = False
    window: int = 0  # attention.sliding_window (gemma), 0: none
    rope_linear: float = 0.0  # linear RoPE scaling factor (rope.scaling.type linear), 0: none
    n_expert: int = 0  # mixture of experts (qwen3moe, qwen2moe): experts, used per token, their FFN width
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # the shared expert's width (qwen2moe), 0: none

    def config(self, name: str) -> ModelConfig:
        hd = self.head_dim or self.n_embd // self.n_head
        return ModelConfig(
            arch=self.arch, name=name, n_vocab=self.n_vocab, n_embd=self.n_embd, n_layer=self.n_layer,
            n_head=self.n_head, n_head_kv=self.n_head_kv, head_dim=hd, n_ff=self.n_ff, n_ctx_train=self.n_ctx,
            rms_eps=self.rms_eps, rope_freq_base=self.rope_freq_base, rope_dim=hd, rope_neox=self.arch != "llama",
            has_qkv_bias=ARCHITECTURES[self.arch].qkv_bias == "always", has_qk_norm=ARCHITECTURES[self.arch].qk_norm, has_rope_freqs=False,
            tied_embeddings=self.tied,
            rope_scaling="linear" if self.rope_linear else "none", rope_scale=self.rope_linear or 1.0,
            fused_qkv=ARCHITECTURES[self.arch].fused_qkv != "never", fused_gate_up=ARCHITECTURES[self.arch].fused_gate_up,
            n_expert=self.n_expert, n_expert_used=self.n_expert_used, n_ff_exp=self.n_ff_exp, n_ff_shexp=self.n_ff_shexp,
            expert_norm=ARCHITECTURES[self.arch].moe_norm_topk,
            **family_fields(ARCHITECTURES[self.arch], {"attention.sliding_window": self.window} if self.window else {},
                            self.n_layer, self.n_embd, self.n_head, hd, self.rope_freq_base),
        )


PRESETS: dict[str, Preset] = {
    "tinyllama-1.1b": Preset("llama", 32000, 2048, 22, 32, 4, 5632, 2048, 10000.0, 1e-5),
    "llama2-7b": Preset("llama", 32000, 4096, 32, 32, 32, 11008, 4096, 10000.0, 1e-5),
    "llama3-8b": Preset("llama", 128256, 4096, 32, 32, 8, 14336, 8192, 500000.0, 1e-5),
    "qwen2.5-0.5b": Preset("qwen2", 151936, 896, 24, 14, 2, 4864, 32768, 1000000.0, 1e-6, tied=True),
    "qwen2.5-7b": Preset("qwen2", 152064, 3584, 28, 28, 4, 18944, 32768, 1000000.0, 1e-6),
    "qwen3-8b": Preset("qwen3", 151936, 4096, 36, 32, 8, 12288, 40960, 1000000.0, 1e-6, head_dim=128),
    # google/gemma-3-{12b,27b}-it text_config; the vocabulary as llama.cpp's converter writes it (the
    # tokenizer's 262,144 tokens: it drops the embedding's 64 padding rows of vocab_size 262,208).
    # Their global layers take linear RoPE scaling 8 (rope_scaling of the config; sliding layers none).
    "gemma3-12b": Preset("gemma3", 262144, 3840, 48, 16, 8, 15360, 131072, 1000000.0, 1e-6, head_dim=256, tied=True,
                         window=1024, rope_linear=8.0),
    "gemma3-27b": Preset("gemma3", 262144, 5376, 62, 32, 16, 21504, 131072, 1000000.0, 1e-6, head_dim=128, tied=True,
                         window=1024, rope_linear=8.0),
    # microsoft/phi-4 (Phi3ForCausalLM; llama.cpp's GGUF: fused attn_qkv and gate|up ffn_up, vocabulary
    # padded to 100,352, no rope scaling)
    "phi4-14b": Preset("phi3", 100352, 5120, 40, 40, 10, 17920, 16384, 250000.0, 1e-5),
    # Qwen/Qwen3-30B-A3B (Qwen3MoeForCausalLM): 128 experts of width 768, 8 used, renormalized;
    # feed_forward_length is the config's intermediate_size (6144), which no tensor uses
    "qwen3-30b-a3b": Preset("qwen3moe", 151936, 2048, 48, 32, 4, 6144, 40960, 1000000.0, 1e-6, head_dim=128,
                            n_expert=128, n_expert_used=8, n_ff_exp=768),
    # a small shape for tests: every code path of the 7B shapes, 256-multiple rows, GQA
    "test-tiny": Preset("llama", 512, 256, 2, 4, 2, 512, 512, 10000.0, 1e-5),
}


def q4_k_m_types(cfg: ModelConfig) -> dict[str, T]:
    """The ggml type of every tensor of a model of config `cfg` in llama.cpp's Q4_K_M mix
    (runtime.quant_mix.choose_types; 1-D tensors stay F32)."""
    from .quant_mix import choose_types, get_mix, llama_order

    shapes = expected_shapes(cfg)
    names = llama_order(list(shapes))
    types = choose_types([(n, shapes[n]) for n in names], get_mix("Q4_K_M"), cfg.arch, cfg.n_layer, cfg.n_head, cfg.n_head_kv,
                         cfg.n_expert)
    return {n: t or T.F32 for n, t in zip(names, types)}


def random_blocks(t: T, n_rows: int, n_cols: int, rng: np.random.Generator, scale: float,
                  full_range: bool = False) -> np.ndarray:
    """Random valid blocks of type t for an (n_rows, n_cols) matrix whose weights have standard
    deviation about `scale`: uint8 (n_rows, n_cols / block * type_size). Scales are finite fp16;
    quants are random bytes. Sub-block scales stay in a narrow band (similar magnitudes, as in
    synthetic models) unless `full_range`: then they take every value their field can hold
    (Q6_K int8 -128..127, K-quant 6-bit codes 0..63), as real files' do, for kernel tests."""
    block, size = GGML_QUANT_SIZES[t]
    nb = n_rows * (n_cols // block)
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)  # (nb, size)

    def put_f16(col: int, values: np.ndarray) -> None:
        raw[:, col : col + 2] = values.astype(np.float16).view(np.uint8).reshape(nb, 2)

    jitter = rng.uniform(0.5, 1.5, size=nb).astype(np.float32)
    if t == T.Q4_K:  # d, dmin, scales[12] (6-bit), qs[128]: w = d*sc*q - dmin*m, q in 0..15
        put_f16(0, scale / (48 * 4.6) * jitter)
        put_f16(2, scale / (48 * 4.6) * 7.5 * jitter)
        if not full_range:
            raw[:, 4:16] |= 0x20  # scale and min codes in 32..63 (low 6 bits; high bits of scales[8:] hold 4-bit halves)
    elif t == T.Q5_K:  # d, dmin, scales[12], qh[32], qs[128]: q in 0..31
        put_f16(0, scale / (48 * 9.2) * jitter)
        put_f16(2, scale / (48 * 9.2) * 15.5 * jitter)
        if not full_range:
            raw[:, 4:16] |= 0x20
    elif t == T.Q6_K:  # ql[128], qh[64], int8 scales[16], d: w = d*sc*(q-32)
        if full_range:  # int8 -128..127: rms about 74
            raw[:, 192:208] = rng.integers(-128, 128, size=(nb, 16)).astype(np.int8).view(np.uint8)
            put_f16(208, scale / (74 * 18.5) * jitter)
        else:
            raw[:, 192:208] = rng.integers(8, 24, size=(nb, 16), dtype=np.uint8)
            put_f16(208, scale / (16 * 18.5) * jitter)
    elif t == T.Q8_0:  # d, int8 qs[32]
        put_f16(0, scale / 73.9 * jitter)
    elif t == T.Q5_0:  # d, qh[4], qs[16]: w = d*(q-16)
        put_f16(0, scale / 9.2 * jitter)
    elif t == T.Q5_1:  # d, m, qh[4], qs[16]: w = d*q + m
        put_f16(0, scale / 9.2 * jitter)
        put_f16(2, -scale / 9.2 * 15.5 * jitter)
    elif t == T.Q2_K:  # scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin: w = d*sc*q - dmin*m, q in 0..3
        if not full_range:
            raw[:, :16] |= 0x88  # scale and min codes in 8..15
        put_f16(80, scale / (11.5 * 1.12) * jitter)
        put_f16(82, scale / (11.5 * 1.12) * 1.5 * jitter)
    elif t == T.Q3_K:  # hmask[32], qs[64], scales[12] (6-bit codes), d: w = d*(code-32)*(q-4), q in 0..7
        if not full_range:
            raw[:, 96:108] = _pack_q3_k_scales(_signed_band(rng, nb, 16))
        put_f16(108, scale / ((18.5 if full_range else 11.5) * 2.35) * jitter)
    elif t == T.Q4_0:  # d, qs[16]: w = d*(q-8)
        put_f16(0, scale / 4.6 * jitter)
    elif t == T.IQ4_XS:  # d, scales_h, scales_l[4], qs[128]: w = d*(code-32)*kvalues_iq4nl[q]
        if not full_range:
            codes = _signed_band(rng, nb, 8)  # (nb, 8)
            high = ((codes >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
            raw[:, 2:4] = high.astype("<u2").view(np.uint8).reshape(nb, 2)  # scales_h: bits 2i..2i+1, code i's top bits
            raw[:, 4:8] = (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)
        put_f16(0, scale / ((18.5 if full_range else 11.5) * 67.4) * jitter)
    elif t == T.IQ4_NL:  # d, qs[16]: w = d*kvalues_iq4nl[q]
        put_f16(0, scale / 67.4 * jitter)
    else:
        raise ValueError(f"random_blocks: no generator for {t.name}")
    return raw.reshape(n_rows, -1)


def _signed_band(rng: np.random.Generator, nb: int, n: int) -> np.ndarray:
    """(nb, n) uint8 6-bit scale codes 32 +- (8..15): signed scales of similar magnitudes, either sign."""
    mag = rng.integers(8, 16, size=(nb, n))
    return np.where(rng.integers(0, 2, size=(nb, n)) == 1, 32 + mag, 32 - mag).astype(np.uint8)


def _pack_q3_k_scales(codes: np.ndarray) -> np.ndarray:
    """(nb, 16) 6-bit codes -> (nb, 12) bytes of block_q3_K.scales: code j's low 4 bits in
    nibble j // 8 of byte j % 8, its top 2 bits at bits 2 * (j // 4) of byte 8 + j % 4
    (ggml-quants.c quantize_row_q3_K_ref)."""
    low, high = codes & 0xF, codes >> 4
    out = np.zeros((codes.shape[0], 12), np.uint8)
    out[:, :8] = low[:, :8] | (low[:, 8:] << 4)
    for k in range(4):
        out[:, 8:] |= high[:, 4 * k : 4 * k + 4] << (2 * k)
    return out


def vocab_from(path: Path | None, n_vocab: int) -> dict:
    """Tokenizer metadata of `path` (a GGUF with a vocabulary), or of the bundled sample model,
    padded with `<unused_N>` tokens to n_vocab when shorter, cut when longer."""
    src = open_model(path or SAMPLE_MODEL, require_weights=False)
    tokens = list(src.meta("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise UsageError(f"{src.path}: has no vocabulary (tokenizer.ggml.tokens); point --vocab at a model GGUF")
    scores = list(src.meta("tokenizer.ggml.scores") or [0.0] * len(tokens))
    types = list(src.meta("tokenizer.ggml.token_type") or [1] * len(tokens))
    pad = n_vocab - len(tokens)
    tokens = tokens[:n_vocab] + [f"<unused_{i}>" for i in range(pad)]
    scores = scores[:n_vocab] + [-1e9] * pad
    types = types[:n_vocab] + [5] * pad  # 5 = unused
    meta = {k: src.meta(k) for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                                      "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                                      "tokenizer.chat_template")}
    merges = src.meta("tokenizer.ggml.merges")
    return {"tokens": tokens, "scores": scores, "types": types, "merges": merges, "meta": meta}


def write_synthetic(preset: str, out: Path, vocab: Path | None = None, seed: int = 0,
                    progress: Callable[[int, int], None] | None = None, force: bool = False) -> Path:
    """Write a synthetic Q4_K_M model of PRESETS[preset] to `out` through
    runtime.outfile.partial_output (a unique temporary name beside it, published exclusively
    unless force, removed on any error, Ctrl-C or SIGTERM). progress(done_bytes, total_bytes) is
    called after each tensor.

    Raises UsageError for an unknown preset or an output path partial_output refuses.
    """
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[preset].config(f"synthetic {preset}")
    rng = np.random.default_rng(seed)
    v = vocab_from(vocab, cfg.n_vocab)
    shapes = expected_shapes(cfg)
    types = q4_k_m_types(cfg)
    out = Path(out)
    check_output(out, force)
    w = GGUFWriter(None, cfg.arch)
    write_metadata(w, cfg, v)
    for name, shape in shapes.items():
        block, size = GGML_QUANT_SIZES[types[name]]
        nbytes = int(np.prod(shape)) // block * size
        if types[name] == T.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:  # quantized tensors are described by their byte shape
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes, raw_dtype=types[name])
    total = sum(int(np.prod(s)) // GGML_QUANT_SIZES[types[n]][0] * GGML_QUANT_SIZES[types[n]][1] for n, s in shapes.items())
    with partial_output(out, force) as tmp:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for name, shape in shapes.items():
            data = _tensor_data(name, shape, types[name], cfg, rng)
            w.write_tensor_data(data)
            done += data.nbytes
            if progress:
                progress(done, total)
        w.close()
    return out


def write_metadata(w: GGUFWriter, cfg: ModelConfig, v: dict, family: bool = True) -> None:
    """Write the hyper-parameters of `cfg` (llama.cpp's `{arch}.*` keys; with `family` also the
    Gemma keys runtime/family_keys.py reads back), general.file_type Q4_K_M, and the tokenizer
    metadata `v` (as vocab_from returns it)."""
    a = cfg.arch
    w.add_name(cfg.name)
    w.add_uint32(f"{a}.context_length", cfg.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", cfg.n_embd)
    w.add_uint32(f"{a}.block_count", cfg.n_layer)
    w.add_uint32(f"{a}.feed_forward_length", cfg.n_ff)
    w.add_uint32(f"{a}.attention.head_count", cfg.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.rope_dim)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_freq_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    for key, value in (family_keys(cfg) if family else {}).items():  # gemma: sliding window, its pattern and RoPE base, soft-caps
        if isinstance(value, list):
            w.add_array(f"{a}.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"{a}.{key}", value)
        else:
            w.add_float32(f"{a}.{key}", value)
    if cfg.n_expert:  # mixture of experts: llama.cpp's LLM_KV_EXPERT_* keys
        w.add_uint32(f"{a}.expert_count", cfg.n_expert)
        w.add_uint32(f"{a}.expert_used_count", cfg.n_expert_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", cfg.n_ff_exp)
        if cfg.n_ff_shexp:
            w.add_uint32(f"{a}.expert_shared_feed_forward_length", cfg.n_ff_shexp)
    _write_rope_scaling(w, cfg)
    w.add_uint32("general.file_type", 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_uint32("general.quantization_version", 2)
    meta = v["meta"]
    w.add_string("tokenizer.ggml.model", meta["tokenizer.ggml.model"])
    if meta["tokenizer.ggml.pre"]:
        w.add_string("tokenizer.ggml.pre", meta["tokenizer.ggml.pre"])
    w.add_token_list(v["tokens"])
    w.add_token_scores(v["scores"])
    w.add_token_types(v["types"])
    if v["merges"]:
        w.add_token_merges(v["merges"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unknown", w.add_unk_token_id)):
        if meta[f"tokenizer.ggml.{key}_token_id"] is not None:
            add(meta[f"tokenizer.ggml.{key}_token_id"])
    if meta["tokenizer.chat_template"]:
        w.add_chat_template(meta["tokenizer.chat_template"])


def _write_rope_scaling(w: GGUFWriter, cfg: ModelConfig) -> None:
    """The `{arch}.rope.scaling.*` keys of cfg's RoPE scaling, as convert_hf_to_gguf.py writes
    them (LongRoPE: no type key, its factors are tensors; its attention factor as attn_factor)."""
    a = cfg.arch
    if cfg.rope_scaling in ("linear", "yarn"):
        w.add_string(f"{a}.rope.scaling.type", cfg.rope_scaling)
        w.add_float32(f"{a}.rope.scaling.factor", cfg.rope_scale)
    if cfg.rope_scaling == "yarn":
        w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", cfg.rope_yarn_beta_fast)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", cfg.rope_yarn_beta_slow)
    if cfg.rope_orig_ctx:
        w.add_uint32(f"{a}.rope.scaling.original_context_length", cfg.rope_orig_ctx)
    if cfg.rope_attn_factor != 1.0:
        w.add_float32(f"{a}.rope.scaling.attn_factor", cfg.rope_attn_factor)


def _tensor_data(name: str, shape: tuple[int, ...], t: T, cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    if t == T.F32:
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + 0.02 * rng.standard_normal(shape)).astype(np.float32)  # norms near 1, biases near 0
    n_rows, n_cols = int(np.prod(shape[:-1])), shape[-1]  # stacked experts: all experts' rows
    # token_embd rows are read as activations (std ~1 after the first norm); other weights as a
    # 1/sqrt(fan_in) projection so activations keep their scale through the layers
    scale = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(n_cols)
    return random_blocks(t, n_rows, n_cols, rng, scale)
