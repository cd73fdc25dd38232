"""Which ggml type each tensor gets in a llama.cpp quantization mix (Q4_K_M, Q4_K_S, Q5_K_M, Q6_K,
Q8_0): llama.cpp's llama_tensor_get_type (src/llama-quant.cpp at c392e50, the llama.cpp k4's
goldens and its Q4_K_M test file come from), without importance matrix or overrides, for the
families k4 runs.

The rules, in the order llama.cpp tests the names:
  - 1-D tensors, norms and the expert router (ffn_gate_inp) keep their type;
  - output.weight (token_embd.weight when the embeddings are tied): Q6_K, or Q8_0 when its rows
    are not a multiple of the mix's block; the Q8_0 mix keeps Q8_0;
  - attn_v: Q6_K in the layers use_more_bits picks among the attention-v tensors (Q4_K_M,
    Q5_K_M); Q5_K for the first four (Q4_K_S); Q4_K -> Q5_K in 70B models; Q8_0 in models of
    exactly 8 experts. The count of attention-v tensors (n_attention_wv) includes attn_qkv, as
    llama.cpp counts it, but only attn_v tensors advance the index;
  - attn_k: Q8_0 in models of exactly 8 experts;
  - ffn_down (and ffn_down_exps, ffn_down_shexp): Q6_K in the layers use_more_bits picks among
    n_layer (Q4_K_M, Q5_K_M), Q5_K in the first eighth (Q4_K_S). The layer is a running count of
    ffn_down tensors, or in a mixture of experts the block number of the name (llama.cpp's
    layer_info), since a block holds two ffn_down tensors there;
  - attn_output: Q5_K in models of exactly 8 experts (Q4_K_S, Q4_K_M);
  - attn_qkv (Phi-3, Phi-4): Q5_K (Q4_K_M), Q6_K (Q5_K_M);
  - a type whose block does not divide the row length falls back: Q4_K -> Q5_0, Q5_K -> Q5_1,
    Q6_K -> Q8_0, then F16.
llama.cpp after its 2026 rewrite of this function (PR 19770, tensor categories) sends attn_qkv
through the attn_v rule instead; k4 follows c392e50.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import UsageError

T = GGMLQuantizationType


@dataclass(frozen=True)
class Mix:
    """A llama.cpp file type: its LLAMA_FTYPE number (general.file_type) and default tensor type."""

    name: str
    file_type: int
    default_type: GGMLQuantizationType


MIXES = {
    m.name: m
    for m in (
        Mix("Q4_K_M", 15, T.Q4_K),
        Mix("Q4_K_S", 14, T.Q4_K),
        Mix("Q5_K_M", 17, T.Q5_K),
        Mix("Q6_K", 18, T.Q6_K),
        Mix("Q8_0", 7, T.Q8_0),
    )
}

FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
ATTENTION_V = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")  # what n_attention_wv counts


def get_mix(name: str) -> Mix:
    """The Mix called `name` (case-insensitive). Raises UsageError naming the valid ones."""
    mix = MIXES.get(name.upper())
    if mix is None:
        raise UsageError(f"unknown quantization type {name!r}; use one of {', '.join(MIXES)}")
    return mix


def layer_of(name: str) -> int:
    """The layer number of `blk.N.` tensor names, -1 for the others (llama.cpp's sscanf)."""
    m = re.match(r"blk\.([+-]?\d+)\.", name)
    return int(m.group(1)) if m else -1


def llama_order(names: Sequence[str]) -> list[str]:
    """Tensor names in llama.cpp's loader order (weight_name_comparer: layer, then name bytes)."""
    return sorted(names, key=lambda n: (layer_of(n), n.encode("utf-8")))


def allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """llama-quant.cpp tensor_allows_quantization: at least 2 dimensions counted as ggml_n_dims
    does (numpy shape (1, n) is 1-D), named *weight, not a norm, not an expert router."""
    n_dims = len(shape)
    while n_dims > 1 and shape[len(shape) - n_dims] == 1:
        n_dims -= 1
    # the expert router stays in its type (llama-quant.cpp: quantize &= no "ffn_gate_inp.weight")
    return n_dims >= 2 and name.endswith("weight") and "_norm.weight" not in name and "ffn_gate_inp.weight" not in name


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp use_more_bits: the first and last eighth of the layers and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def fallback(ggml_type: GGMLQuantizationType, n_per_row: int) -> GGMLQuantizationType:
    """llama-quant.cpp's fallback: a type whose block divides the row length.

    Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when that still does not fit. Where
    llama.cpp gives up (a Q8_0 target on rows not a multiple of 32) this returns F16 too.
    """
    if n_per_row % GGML_QUANT_SIZES[ggml_type][0] == 0:
        return ggml_type
    ggml_type = FALLBACK.get(ggml_type, T.F16)
    return ggml_type if n_per_row % GGML_QUANT_SIZES[ggml_type][0] == 0 else T.F16


@dataclass
class _Counters:
    """quantize_state_impl's counters: attention-v tensors in all, and those seen; ffn_down seen."""

    n_attention_wv: int
    i_attention_wv: int = 0
    i_ffn_down: int = 0


def choose_types(
    tensors: Sequence[tuple[str, tuple[int, ...]]],
    mix: Mix,
    arch: str,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    n_expert: int = 0,
) -> list[GGMLQuantizationType | None]:
    """llama.cpp's type for each (name, numpy shape), in llama_order; None = keep the input type.
    n_expert: experts per block (0 for a dense model). The attn_v and ffn_down counters advance
    in the order given, so pass the tensors in llama_order. Rules: the module docstring."""
    names = [n for n, _ in tensors]
    tied = "output.weight" not in names
    count = _Counters(sum(any(k in n for k in ATTENTION_V) for n in names))
    # llama-model.cpp: 80 layers is LLM_TYPE_70B for qwen2, and for llama with grouped-query attention
    is_70b = n_layer == 80 and (arch == "qwen2" or (arch == "llama" and n_head != n_head_kv))
    types: list[GGMLQuantizationType | None] = []
    for name, shape in tensors:
        if not allows_quantization(name, shape):
            types.append(None)
            continue
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            new = _output_type(mix, shape[-1])
        else:
            new = _block_type(name, mix, count, n_layer, n_expert, is_70b)
        types.append(fallback(new, shape[-1]))
    return types


def _output_type(mix: Mix, n_per_row: int) -> GGMLQuantizationType:
    """The output projection's type: Q8_0 when the mix's block does not divide its rows, else Q6_K
    (the Q8_0 mix keeps Q8_0)."""
    if n_per_row % GGML_QUANT_SIZES[mix.default_type][0]:
        return T.Q8_0
    return T.Q8_0 if mix.default_type == T.Q8_0 else T.Q6_K


def _block_type(name: str, mix: Mix, count: _Counters, n_layer: int, n_expert: int, is_70b: bool) -> GGMLQuantizationType:
    """The type of a tensor other than the output projection, advancing `count` as llama.cpp does."""
    new = mix.default_type
    more_bits_mix = mix.name in ("Q4_K_M", "Q5_K_M")
    if name == "token_embd.weight":
        return new
    if "attn_v.weight" in name:
        if more_bits_mix and use_more_bits(count.i_attention_wv, count.n_attention_wv):
            new = T.Q6_K
        elif mix.name == "Q4_K_S" and count.i_attention_wv < 4:
            new = T.Q5_K
        if is_70b and new == T.Q4_K:
            new = T.Q5_K
        if n_expert == 8:
            new = T.Q8_0
        count.i_attention_wv += 1
    elif "attn_k.weight" in name:
        if n_expert == 8:
            new = T.Q8_0
    elif "ffn_down" in name:
        i_layer = layer_of(name) if n_expert > 1 else count.i_ffn_down
        if more_bits_mix and use_more_bits(i_layer, n_layer):
            new = T.Q6_K
        elif mix.name == "Q4_K_S" and i_layer < n_layer // 8:
            new = T.Q5_K
        count.i_ffn_down += 1
    elif "attn_output.weight" in name:
        if n_expert == 8 and mix.name in ("Q4_K_S", "Q4_K_M"):
            new = T.Q5_K
    elif "attn_qkv.weight" in name:
        new = {"Q4_K_M": T.Q5_K, "Q5_K_M": T.Q6_K}.get(mix.name, new)
    return new
