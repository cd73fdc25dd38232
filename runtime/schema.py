"""The metadata keys k4 reads, their types and ranges, and their relations to tensor shapes,
checked once when a file is opened and before anything is built from them.

Keys and meanings are llama.cpp's (gguf-py `Keys`, llama-arch.cpp); value types are GGUF's
(docs/gguf.md). A violation raises ModelFileError with one line naming the key, the value and
what was expected, e.g. `llama.block_count = "five" (a string); expected an integer in 1..4096`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf import GGUFValueType as V

from .arch import ARCHITECTURES
from .errors import ModelFileError

if TYPE_CHECKING:
    from .model import ModelFile

_INTS = frozenset({V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64})
_FLOATS = frozenset({V.FLOAT32, V.FLOAT64})


@dataclass(frozen=True)
class Key:
    """One metadata key: `kind` is "int", "float", "bool" or "str"; lo..hi bounds numbers (inclusive)."""

    name: str
    kind: str
    lo: float = -math.inf
    hi: float = math.inf


# Keys of the architecture ("{arch}." prefix), with llama.cpp's limits where it has them
# (LLAMA_MAX_LAYERS is 512) and generous ones elsewhere.
ARCH_KEYS = (
    Key("embedding_length", "int", 1, 1 << 16),
    Key("block_count", "int", 1, 4096),
    Key("attention.head_count", "int", 1, 1 << 14),
    Key("attention.head_count_kv", "int", 1, 1 << 14),
    Key("attention.key_length", "int", 1, 1 << 14),
    Key("feed_forward_length", "int", 1, 1 << 22),
    Key("context_length", "int", 1, (1 << 31) - 1),
    Key("attention.layer_norm_rms_epsilon", "float", 1e-30, 0.5),
    Key("rope.freq_base", "float", 1e-3, 1e12),
    Key("rope.dimension_count", "int", 2, 1 << 14),
    # RoPE scaling (runtime/rope.py; llama.cpp's LLM_KV_ROPE_SCALING_*)
    Key("rope.scaling.type", "str"),
    Key("rope.scaling.factor", "float", 1e-3, 1e6),
    Key("rope.scale_linear", "float", 1e-3, 1e6),
    Key("rope.scaling.original_context_length", "int", 1, (1 << 31) - 1),
    Key("rope.scaling.attn_factor", "float", 1e-3, 1e3),
    Key("rope.scaling.yarn_beta_fast", "float", 1e-3, 1e6),
    Key("rope.scaling.yarn_beta_slow", "float", 1e-3, 1e6),
    # sliding-window attention and soft-caps (runtime/family_keys.py; read by the Gemma families)
    Key("attention.sliding_window", "int", 0, (1 << 31) - 1),
    Key("rope.freq_base_swa", "float", 1e-3, 1e12),
    Key("attn_logit_softcapping", "float", 1e-3, 1e6),
    Key("final_logit_softcapping", "float", 1e-3, 1e6),
    # mixture of experts (runtime/moe.py; llama.cpp's LLM_KV_EXPERT_*; read by the moe families)
    Key("expert_count", "int", 1, 1 << 12),
    Key("expert_used_count", "int", 1, 1 << 12),
    Key("expert_feed_forward_length", "int", 1, 1 << 22),
    Key("expert_shared_feed_forward_length", "int", 1, 1 << 22),
)
REQUIRED = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
MOE_REQUIRED = ("expert_count", "expert_used_count")  # moe families: and feed_forward_length is optional

TOKENIZER_KEYS = (
    Key("general.architecture", "str"),
    Key("general.name", "str"),
    Key("tokenizer.ggml.model", "str"),
    Key("tokenizer.ggml.pre", "str"),
    Key("tokenizer.chat_template", "str"),
    Key("tokenizer.ggml.add_bos_token", "bool"),
    Key("tokenizer.ggml.add_eos_token", "bool"),
    Key("tokenizer.ggml.add_space_prefix", "bool"),
) + tuple(Key(f"tokenizer.ggml.{n}_token_id", "int", -(1 << 31), (1 << 32) - 1)
          for n in ("bos", "eos", "eot", "eom", "padding", "unknown", "seperator", "cls", "mask"))
# arrays: key -> allowed element types
TOKENIZER_ARRAYS = {
    "tokenizer.ggml.tokens": frozenset({V.STRING}),
    "tokenizer.ggml.merges": frozenset({V.STRING}),
    "tokenizer.ggml.token_type": _INTS,
    "tokenizer.ggml.scores": _FLOATS,
}
_KIND_TEXT = {"int": "an integer", "float": "a finite number", "bool": "a boolean", "str": "a string"}
_LAYER = re.compile(r"blk\.(\d+)\.")


def _fail(mf: "ModelFile", key: str, value: str, expected: str) -> None:
    raise ModelFileError(f"{mf.path}: metadata key '{key}' = {value}; expected {expected}")


def _shown(mf: "ModelFile", key: str) -> str:
    """The value of `key` as the error shows it: short, quoted strings, arrays by length and type."""
    field = mf.reader.fields[key]
    if field.types[0] == V.ARRAY:
        return f"an array of {len(field.data):,} {field.types[-1].name}"
    try:
        value = field.contents()
    except UnicodeDecodeError:
        return "bytes that are not UTF-8"
    text = repr(value) if isinstance(value, str) else str(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} ({field.types[0].name})"


def _scalar(mf: "ModelFile", spec: Key, key: str) -> Any:
    """The value of `key` checked against `spec`, or None when absent."""
    field = mf.reader.fields.get(key)
    if field is None:
        return None
    vtype = field.types[0]
    if spec.kind == "int":
        bounds = f" in {int(spec.lo):,}..{int(spec.hi):,}"
    else:
        bounds = f" in {spec.lo:g}..{spec.hi:g}" if spec.kind == "float" else ""
    expected = _KIND_TEXT[spec.kind] + bounds
    ok = {"int": vtype in _INTS, "float": vtype in _FLOATS or vtype in _INTS, "bool": vtype == V.BOOL,
          "str": vtype == V.STRING}[spec.kind]
    if not ok:
        _fail(mf, key, _shown(mf, key), expected)
    try:
        value = field.contents()
    except UnicodeDecodeError:
        _fail(mf, key, "bytes that are not UTF-8", "UTF-8 text")
    if spec.kind in ("int", "float") and not (math.isfinite(value) and spec.lo <= value <= spec.hi):
        _fail(mf, key, _shown(mf, key), expected)
    return value


def check_tokenizer_keys(mf: "ModelFile") -> None:
    """Types of the general and tokenizer keys, and the lengths of the vocabulary arrays
    (token_type and scores: one per token). Raises ModelFileError."""
    for spec in TOKENIZER_KEYS:
        _scalar(mf, spec, spec.name)
    fields = mf.reader.fields
    for key, element_types in TOKENIZER_ARRAYS.items():
        field = fields.get(key)
        if field is not None and (field.types[0] != V.ARRAY or field.types[-1] not in element_types):
            kinds = "strings" if V.STRING in element_types else "integers" if element_types == _INTS else "numbers"
            _fail(mf, key, _shown(mf, key), f"an array of {kinds}")
    if "tokenizer.ggml.tokens" in fields:
        n_tokens = len(fields["tokenizer.ggml.tokens"].data)
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if key in fields and len(fields[key].data) != n_tokens:
                _fail(mf, key, _shown(mf, key), f"{n_tokens:,} entries, one per token of tokenizer.ggml.tokens")


def check_model_keys(mf: "ModelFile", arch: str) -> dict[str, Any]:
    """The `{arch}.*` hyper-parameters, checked for type and range, against each other and
    against the tensor shapes (n_embd = token_embd columns, vocabulary = token_embd rows,
    block_count = the blk.N layers present, n_head x head_dim = attn_q rows, n_head_kv x head_dim
    = attn_k rows, n_ff = ffn_up rows), before any per-layer structure is made.

    Returns key suffix -> value for every key of ARCH_KEYS present, "attention.head_count_kv",
    "attention.key_length" and "rope.dimension_count" filled with their defaults. Raises
    ModelFileError (a required key missing: names it).
    """
    v: dict[str, Any] = {}
    moe = arch in ARCHITECTURES and ARCHITECTURES[arch].moe
    required = tuple(k for k in REQUIRED if k != "feed_forward_length") + MOE_REQUIRED if moe else REQUIRED
    for spec in ARCH_KEYS:
        value = _scalar(mf, spec, f"{arch}.{spec.name}")
        if value is not None:
            v[spec.name] = value
        elif spec.name in required:
            raise ModelFileError(f"{mf.path}: metadata key '{arch}.{spec.name}' is missing; the file is incomplete")
    _check_embedding(mf, arch, v["embedding_length"])
    if moe:
        _moe_defaults(mf, arch, v)
    n_head = v["attention.head_count"]
    v.setdefault("attention.head_count_kv", n_head)
    n_kv = v["attention.head_count_kv"]
    if n_kv > n_head or n_head % n_kv:
        _fail(mf, f"{arch}.attention.head_count_kv", str(n_kv), f"a divisor of attention.head_count ({n_head})")
    v.setdefault("attention.key_length", v["embedding_length"] // n_head)
    head_dim = v["attention.key_length"]
    if head_dim < 1:
        _fail(mf, f"{arch}.attention.head_count", str(n_head), f"at most embedding_length ({v['embedding_length']})")
    _check_shapes(mf, arch, v)
    pattern = _swa_pattern(mf, f"{arch}.attention.sliding_window_pattern", v["block_count"])
    if pattern is not None:
        v["attention.sliding_window_pattern"] = pattern
    v.setdefault("rope.dimension_count", head_dim)
    rope_dim = v["rope.dimension_count"]
    if rope_dim % 2 or rope_dim > head_dim:
        _fail(mf, f"{arch}.rope.dimension_count", str(rope_dim), f"an even number of at most the head size ({head_dim})")
    return v


def _moe_defaults(mf: "ModelFile", arch: str, v: dict[str, Any]) -> None:
    """expert_used_count at most expert_count; the expert and shared-expert FFN widths default as
    llama.cpp's qwen2moe/qwen3moe loaders do (n_ff / n_expert_used, n_ff), and
    feed_forward_length (unused by these families) to the expert width."""
    if v["expert_used_count"] > v["expert_count"]:
        _fail(mf, f"{arch}.expert_used_count", str(v["expert_used_count"]), f"at most expert_count ({v['expert_count']})")
    if "expert_feed_forward_length" not in v:
        if "feed_forward_length" not in v:
            raise ModelFileError(f"{mf.path}: metadata key '{arch}.expert_feed_forward_length' is missing; the file is incomplete")
        v["expert_feed_forward_length"] = max(1, v["feed_forward_length"] // v["expert_used_count"])
    v.setdefault("feed_forward_length", v["expert_feed_forward_length"])
    if ARCHITECTURES[arch].moe_shared:
        v.setdefault("expert_shared_feed_forward_length", v["feed_forward_length"])


def _up_parts(arch: str) -> int:
    """Row blocks of n_ff in ffn_up: 2 where it holds gate and up (phi3), else 1."""
    a = ARCHITECTURES.get(arch)
    return 2 if a is not None and a.fused_gate_up else 1


def _swa_pattern(mf: "ModelFile", key: str, n_layer: int) -> int | tuple[bool, ...] | None:
    """attention.sliding_window_pattern: a period (an integer 1..n_layer) or one flag per layer
    (an array of n_layer booleans or integers, true: the layer slides), as gguf-py's
    add_sliding_window_pattern writes it; None when absent."""
    field = mf.reader.fields.get(key)
    if field is None:
        return None
    expected = f"a period in 1..{n_layer:,} or an array of {n_layer:,} booleans, one per layer"
    if field.types[0] == V.ARRAY:
        if field.types[-1] not in _INTS | {V.BOOL} or len(field.data) != n_layer:
            _fail(mf, key, _shown(mf, key), expected)
        return tuple(bool(x) for x in field.contents())
    if field.types[0] not in _INTS or not 1 <= field.contents() <= n_layer:
        _fail(mf, key, _shown(mf, key), expected)
    return int(field.contents())


def _rows(mf: "ModelFile", name: str) -> tuple[int, ...] | None:
    t = mf.tensors.get(name)
    return None if t is None else t.shape


def _check_embedding(mf: "ModelFile", arch: str, n_embd: int) -> None:
    """n_embd = token_embd columns; one token per token_embd row."""
    embd = _rows(mf, "token_embd.weight")
    if embd is None or len(embd) != 2:
        raise ModelFileError(f"{mf.path}: tensor 'token_embd.weight' is missing or not a matrix; the file is incomplete")
    if embd[1] != n_embd:
        _fail(mf, f"{arch}.embedding_length", str(n_embd), f"{embd[1]}, the columns of token_embd.weight")
    tokens = mf.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) != embd[0]:
        _fail(mf, "tokenizer.ggml.tokens", f"{len(tokens.data):,} tokens", f"{embd[0]:,}, the rows of token_embd.weight")


def _check_shapes(mf: "ModelFile", arch: str, v: dict[str, Any]) -> None:
    """block_count = the blk.N layers present; attn_q, attn_k and ffn_up rows."""
    layers = {int(m.group(1)) for name in mf.tensors if (m := _LAYER.match(name))}
    n_layer = max(layers) + 1 if layers else 0
    if v["block_count"] != n_layer:
        held = f"the file has tensors for layers blk.0 .. blk.{n_layer - 1}" if n_layer else "the file has no blk.N tensors"
        _fail(mf, f"{arch}.block_count", str(v["block_count"]), f"{n_layer} ({held})")
    head_dim = v["attention.key_length"]
    for tensor, key, rows in (("attn_q", "attention.head_count", v["attention.head_count"] * head_dim),
                              ("attn_k", "attention.head_count_kv", v["attention.head_count_kv"] * head_dim),
                              ("ffn_up", "feed_forward_length", v["feed_forward_length"] * _up_parts(arch))):
        shape = _rows(mf, f"blk.0.{tensor}.weight")
        if shape is None or shape[0] == rows:
            continue
        if tensor == "ffn_up":
            _fail(mf, f"{arch}.{key}", str(v[key]), f"the {shape[0]} rows of blk.0.{tensor}.weight")
        if shape[0] % head_dim == 0 or f"{arch}.attention.key_length" not in mf.reader.fields:
            _fail(mf, f"{arch}.{key}", f"{v[key]} (x head size {head_dim} = {rows})", f"the {shape[0]} rows of blk.0.{tensor}.weight")
        _fail(mf, f"{arch}.attention.key_length", f"{head_dim} (x {key} {v[key]} = {rows})", f"the {shape[0]} rows of blk.0.{tensor}.weight")
