"""RoPE frequencies for a model and a context size: the one table both backends rotate by.

Rotary position embedding (Su et al. 2021, RoFormer) turns pair i of a head (i < rope_dim/2) at
position p by the angle p * inv_freq[i], and multiplies the rotated pair by `mscale`; the
dimensions at or past rope_dim pass through unscaled. What the file declares changes the table:

- base: inv_freq[i] = rope_freq_base^(-2i / rope_dim).
- `rope_freqs.weight` (Llama 3.1) or LongRoPE's `rope_factors_long/short.weight` (phi3): each
  inv_freq[i] divided by the factor of pair i (ggml_rope_ext's freq_factors). LongRoPE takes the
  long factors when the context exceeds rope.scaling.original_context_length, else the short
  ones (llama.cpp llama_model::get_rope_factors); its magnitude factor is
  rope.scaling.attn_factor, which convert_hf_to_gguf.py's Phi3MiniModel writes as
  sqrt(1 + ln(s) / ln(original context)) (transformers' _compute_longrope_parameters).
- linear (rope.scaling.type = linear): inv_freq / factor (positions divided by the factor).
- YaRN (Peng et al. 2023; ggml's rope_yarn and ggml_rope_yarn_corr_dims; transformers'
  _compute_yarn_parameters): per pair, a blend of the interpolated frequency inv_freq / factor
  and the original one, the original weighted by ramp[i] = 1 - clamp((i - low) / (high - low),
  0, 1) where low/high are the pair indices at which a wavelength fits beta_fast / beta_slow
  turns into the original context (floored / ceiled, clamped to 0..rope_dim-1); magnitude
  (0.1 ln(factor) + 1) * rope.scaling.attn_factor (llama.cpp's llama_context folds its
  get_mscale into yarn_attn_factor and ggml multiplies the rest back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .model import ModelConfig


@dataclass(frozen=True)
class RopeTable:
    """inv_freq: (rope_dim/2,) float64 radians per position of each pair; mscale: the factor on
    the rotated pairs' cos and sin (1.0 unless the file scales RoPE)."""

    inv_freq: np.ndarray
    mscale: float


def factor_tensor(cfg: ModelConfig, n_ctx: int) -> str | None:
    """Name of the per-pair divisor tensor the rotation uses at context n_ctx, or None."""
    if cfg.has_rope_freqs:
        return "rope_freqs.weight"
    if cfg.rope_scaling == "longrope":
        return "rope_factors_long.weight" if n_ctx > original_ctx(cfg) else "rope_factors_short.weight"
    return None


def original_ctx(cfg: ModelConfig) -> int:
    """The context the model was trained at before scaling (llama.cpp's n_ctx_orig_yarn)."""
    return cfg.rope_orig_ctx or cfg.n_ctx_train


def yarn_corr_dims(cfg: ModelConfig) -> tuple[float, float]:
    """(low, high) pair indices of YaRN's ramp, as ggml_rope_yarn_corr_dims."""
    d, base, ctx = cfg.rope_dim, cfg.rope_freq_base, original_ctx(cfg)

    def dim(n_rot: float) -> float:  # the pair index whose wavelength turns n_rot times in ctx
        return d * math.log(ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(dim(cfg.rope_yarn_beta_fast))), min(d - 1.0, math.ceil(dim(cfg.rope_yarn_beta_slow)))


def rope_table(cfg: ModelConfig, n_ctx: int, factors: np.ndarray | None) -> RopeTable:
    """The table for cfg at a context of n_ctx positions. factors: the (rope_dim/2,) values of
    factor_tensor(cfg, n_ctx) (any float dtype), or None when it names none."""
    half = cfg.rope_dim // 2
    inv = cfg.rope_freq_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)  # (half,)
    if factors is not None:
        inv = inv / np.asarray(factors, dtype=np.float64).reshape(half)
    mscale = cfg.rope_attn_factor
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_scale
    elif cfg.rope_scaling == "yarn":
        low, high = yarn_corr_dims(cfg)
        ramp = 1.0 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0.0, 1.0)  # (half,) 1 = original
        inv = inv / cfg.rope_scale * (1.0 - ramp) + inv * ramp
        if cfg.rope_scale > 1.0:
            mscale *= 1.0 + 0.1 * math.log(cfg.rope_scale)
    return RopeTable(inv, float(mscale))
