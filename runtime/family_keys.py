"""The ModelConfig fields of the Gemma options (runtime/arch.py): embedding scale, activation,
post-norms, sliding-window layers and their RoPE base, query scale and soft-caps, from a
family's Architecture and the file's schema-checked `{arch}.*` keys (runtime/schema.py).

What llama.cpp does at inference is the rule (src/models/gemma2-iswa.cpp, gemma3.cpp, their
hparams in llama-model.cpp, llama_hparams::set_swa_pattern, is_masked_swa):

- sliding layers: layer il slides when il % period < period - 1 (gemma3: 5 local, 1 global;
  gemma2: even layers local), the period from `attention.sliding_window_pattern` when it is an
  integer, or the per-layer flags when it is an array; the window of `attention.sliding_window`
  positions: the query at position p sees keys p - window + 1 .. p (transformers'
  sliding_window_overlay: kv_idx > q_idx - sliding_window). A file without the key (or 0) has
  no sliding layers, except gemma2, whose default window is 4096.
- RoPE base of sliding layers: `rope.freq_base_swa`, else 10,000 for gemma3 (llama.cpp's
  rope_freq_base_train_swa) and the global base for gemma2; sliding layers take no rope
  scaling (rope_freq_scale_train_swa = 1).
- query scale: 1/sqrt(head_dim), except the 27B models (by block count), where it is
  1/sqrt(n_embd / n_head) (gemma_pytorch's query_pre_attn_scalar, as llama.cpp hard-codes it).
- soft-caps: score -> cap * tanh(score / cap), of the attention scores (after the query scale)
  and of the logits; from `attn_logit_softcapping` / `final_logit_softcapping`, else the
  family's default.
"""

from __future__ import annotations

import math
from typing import Any

from .arch import ARCHITECTURES, Architecture


def swa_layers(a: Architecture, n_layer: int, window: int, pattern: int | tuple[bool, ...] | None) -> tuple[bool, ...]:
    """Per layer, whether it attends to a sliding window: () when the family or the file has none.
    pattern: the file's attention.sliding_window_pattern (a period, or one flag per layer), or None."""
    if not a.swa_period or window <= 0:
        return ()
    if isinstance(pattern, tuple):
        return pattern
    period = a.swa_period if pattern is None else pattern
    return tuple(period == 0 or il % period < period - 1 for il in range(n_layer))


def family_fields(a: Architecture, v: dict[str, Any], n_layer: int, n_embd: int, n_head: int, head_dim: int,
                  rope_freq_base: float) -> dict[str, Any]:
    """ModelConfig keyword arguments for the Gemma options of family `a`, from the checked keys
    `v` (key suffix -> value, as schema.check_model_keys returns them). Families without these
    options get the ModelConfig defaults, so their configs are unchanged."""
    window = int(v.get("attention.sliding_window", a.swa_window)) if a.swa_period else 0
    layers = swa_layers(a, n_layer, window, v.get("attention.sliding_window_pattern"))
    base_swa = float(v.get("rope.freq_base_swa", a.swa_rope_base or rope_freq_base)) if layers else 0.0
    wide = a.wide_query_layers and n_layer == a.wide_query_layers
    return dict(
        embed_scale=math.sqrt(n_embd) if a.embed_scale else 1.0,
        activation=a.activation,
        has_post_norms=a.post_norms,
        n_swa=window if any(layers) else 0,
        swa_layers=layers if any(layers) else (),
        rope_freq_base_swa=base_swa if any(layers) else 0.0,
        attn_scale=1.0 / math.sqrt(n_embd // n_head) if wide else 0.0,  # 0: 1/sqrt(head_dim)
        attn_softcap=float(v.get("attn_logit_softcapping", a.attn_softcap)) if a.attn_softcap is not None else 0.0,
        final_softcap=float(v.get("final_logit_softcapping", a.final_softcap)) if a.final_softcap is not None else 0.0,
    )


def family_keys(cfg) -> dict[str, Any]:
    """The `{arch}.*` keys (suffix -> value) a file needs so that family_fields gives back cfg's
    Gemma fields (for writers: runtime/synthetic.py, tests): the window, the pattern when it is
    not the family's, the sliding RoPE base and the caps when they differ from the defaults."""
    a = ARCHITECTURES.get(cfg.arch)
    keys: dict[str, Any] = {}
    if a is None:  # a family k4 does not run (tests write such files): no Gemma keys
        return keys
    if a.swa_period and (cfg.n_swa or a.swa_window):
        keys["attention.sliding_window"] = cfg.n_swa
    if cfg.swa_layers and cfg.swa_layers != swa_layers(a, cfg.n_layer, cfg.n_swa, None):
        keys["attention.sliding_window_pattern"] = list(cfg.swa_layers)
    if cfg.swa_layers and cfg.rope_freq_base_swa != (a.swa_rope_base or cfg.rope_freq_base):
        keys["rope.freq_base_swa"] = cfg.rope_freq_base_swa
    if a.attn_softcap is not None and cfg.attn_softcap != a.attn_softcap:
        keys["attn_logit_softcapping"] = cfg.attn_softcap
    if a.final_softcap is not None and cfg.final_softcap != a.final_softcap:
        keys["final_logit_softcapping"] = cfg.final_softcap
    return keys
