"""GGUF model files: open, validate, and describe them.

Format: GGUF v2/v3 as specified in ggml's docs/gguf.md, read with the `gguf` package's
memory-mapped `GGUFReader` under a parse bounded by the file size (runtime/gguf_reader.py); the
metadata keys k4 reads are checked against one schema (runtime/schema.py) before anything is
built from them. Tensor shapes here are in numpy (row-major) order, the reverse
of ggml's `ne`: a weight of ggml shape [n_embd, n_vocab] is `(n_vocab, n_embd)` here, one row
per output feature.

Every problem with a file raises `ModelFileError` or `UnsupportedModelError`, whose message
names the file and says what is wrong.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from .arch import ARCHITECTURES as ARCHS
from .arch import layer_shapes
from .errors import ModelFileError, UnsupportedModelError
from .family_keys import family_fields
from .gguf_reader import BoundedReader
from .schema import check_model_keys, check_tokenizer_keys

GGUF_MAGIC = b"GGUF"

# Tensor types every backend computes with (ggml type names).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[n] for n in ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "IQ4_NL", "Q2_K", "Q3_K",
                                      "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
)

ARCHITECTURES = tuple(ARCHS)  # the families k4 runs: runtime/arch.py describes each

# The bundled sample model (samples/README.md): what commands run without -m.
SAMPLE_MODEL = Path(__file__).resolve().parents[1] / "samples" / "stories260k-q4_k_m.gguf"


@dataclass(frozen=True)
class Tensor:
    """One tensor of a GGUF file, still in its on-disk encoding.

    name:  GGUF tensor name, e.g. "blk.0.attn_q.weight".
    ggml_type: its ggml type (GGMLQuantizationType).
    shape: numpy order, e.g. (n_out, n_in) for a matrix.
    raw:   uint8 view of the encoded bytes, memory-mapped, shape (n_rows, bytes_per_row)
           for quantized types, or the typed array for F32/F16 (as the gguf package gives it).
    file_offset: byte offset of the data in its GGUF file (None for a tensor built in memory).
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray
    file_offset: int | None = None

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements // block * size

    def raw_bytes(self) -> np.ndarray:
        """The encoded bytes as a uint8 array of shape (n_rows, bytes_per_row) (memory-mapped view)."""
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        row_bytes = (self.shape[-1] if self.shape else 1) // block * size
        return self.raw.reshape(-1).view(np.uint8).reshape(rows, row_bytes)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a model, from GGUF metadata (keys `{arch}.*` as llama.cpp writes them).

    Sizes are element counts. `rope_neox` selects the NeoX RoPE layout (rotate halves: qwen2,
    qwen3) rather than llama's interleaved pairs (GGUF llama weights are permuted for it).
    """

    arch: str
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_freq_base: float
    rope_dim: int
    rope_neox: bool
    has_qkv_bias: bool
    has_qk_norm: bool
    has_rope_freqs: bool
    tied_embeddings: bool
    fused_qkv: bool = False  # q|k|v rows in one attn_qkv tensor (phi3)
    fused_gate_up: bool = False  # gate rows then up rows in one ffn_up tensor of 2 x n_ff rows (phi3)
    # RoPE scaling the file declares (runtime/rope.py): "none", "linear", "yarn", or "longrope"
    # (rope_factors_long/short tensors); factor, the pre-scaling context (0: n_ctx_train), the
    # magnitude factor rope.scaling.attn_factor and YaRN's ramp corners (llama.cpp's defaults)
    rope_scaling: str = "none"
    rope_scale: float = 1.0
    rope_orig_ctx: int = 0
    rope_attn_factor: float = 1.0
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    # The Gemma options (runtime/arch.py, runtime/family_keys.py): embedding rows times
    # embed_scale; activation "silu" (SwiGLU) or "gelu_tanh" (GeGLU); post-attention and post-FFN
    # RMSNorms; per layer whether it attends only to the last n_swa positions (swa_layers, () for
    # none), with RoPE base rope_freq_base_swa and no rope scaling there; the query scale; tanh
    # soft-caps of the attention scores and of the logits (0: off)
    embed_scale: float = 1.0
    activation: str = "silu"
    has_post_norms: bool = False
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_freq_base_swa: float = 0.0
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Mixture of experts (runtime/arch.py moe options, runtime/moe.py): experts per block, used
    # per token, the routed experts' FFN width, the shared expert's (0: none), and whether the
    # selected softmax weights are renormalized to sum 1
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    expert_norm: bool = False

    @property
    def query_scale(self) -> float:
        """The factor of q.k in attention: attn_scale, or 1/sqrt(head_dim) when it is 0."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends only to the last n_swa positions."""
        return bool(self.swa_layers) and self.swa_layers[layer]

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


class ModelFile:
    """A validated, memory-mapped GGUF file.

    Attributes: path, reader (gguf_reader.BoundedReader, a gguf.GGUFReader), metadata (key -> python value, arrays of
    strings/numbers decoded lazily via `meta`), tensors (name -> Tensor), config (ModelConfig,
    or None for vocabulary-only files).

    Raises ModelFileError (missing, not a regular file, not GGUF, truncated, a count the file
    cannot hold, a general or tokenizer key of the wrong type; with `require_weights`, a model key
    out of its schema or inconsistent with the tensors) or UnsupportedModelError (architecture
    or tensor type k4 cannot run) when `require_weights` is true.
    """

    def __init__(self, path: str | os.PathLike, require_weights: bool = True):
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.tensors = _tensor_table(self.path, self.reader)
        check_tokenizer_keys(self)
        self.arch = self.meta("general.architecture")
        self.config: ModelConfig | None = None
        if require_weights:
            self.config = _config_from(self)
            check_weights(self)

    def meta(self, key: str, default: Any = None) -> Any:
        """The value of a metadata key (scalars, strings, lists), or `default` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:  # the gguf package raises assorted errors on corrupt fields
            raise ModelFileError(f"{self.path}: metadata key {key!r} is corrupt ({exc}); re-download or re-convert the model") from None

    def has_meta(self, key: str) -> bool:
        return key in self.reader.fields

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing; the file is incomplete or not a {self.arch} model") from None

    @property
    def file_size(self) -> int:
        return self.path.stat().st_size

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())


def _open_reader(path: Path) -> GGUFReader:
    if not path.exists():
        raise ModelFileError(f"{path}: no such file; pass an existing .gguf with -m")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory; pass a .gguf file with -m")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file (a pipe or a device); pass a .gguf file with -m")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot be read ({exc.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (bad magic {magic!r}); convert the model to GGUF first")
    _check_header(path)
    try:
        return BoundedReader(path, "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on damage
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelFileError(f"{path}: damaged or truncated GGUF ({reason}); re-download the file") from None


def _check_header(path: Path) -> None:
    """Refuse a file shorter than the GGUF header or of a version other than 2 and 3."""
    with open(path, "rb") as fh:
        head = fh.read(24)
    if len(head) < 24:
        raise ModelFileError(f"{path}: truncated GGUF ({len(head)} bytes, the header alone is 24); re-download the file")
    (version,) = struct.unpack_from("<I", head, 4)
    if version not in (2, 3):
        raise ModelFileError(f"{path}: damaged or truncated GGUF (unsupported GGUF version {version}); re-download the file")


def _tensor_table(path: Path, reader: GGUFReader) -> dict[str, Tensor]:
    size = path.stat().st_size
    align = int(reader.alignment)
    table: dict[str, Tensor] = {}
    for t in reader.tensors:
        if (int(t.data_offset) - int(reader.data_offset)) % align:
            raise ModelFileError(f"{path}: tensor {t.name!r} data is not aligned to {align} bytes; the file is corrupt")
        if t.name in table:
            raise ModelFileError(f"{path}: tensor {t.name!r} appears twice; the file is corrupt")
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise ModelFileError(f"{path}: tensor {t.name!r} runs past the end of the file; the file is truncated, re-download it")
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        table[t.name] = Tensor(t.name, GGMLQuantizationType(int(t.tensor_type)), shape, t.data, int(t.data_offset))
    return table


def _config_from(mf: ModelFile) -> ModelConfig:
    arch = mf.arch
    if arch is None:
        raise ModelFileError(f"{mf.path}: metadata key 'general.architecture' is missing; this is not a model file")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{mf.path}: architecture {arch!r} is not supported; k4 runs {', '.join(ARCHITECTURES)}")

    v = check_model_keys(mf, arch)
    head_dim = v["attention.key_length"]
    return ModelConfig(
        arch=arch,
        name=str(mf.meta("general.name", mf.path.stem)),
        n_vocab=mf.tensor("token_embd.weight").shape[0],
        n_embd=v["embedding_length"],
        n_layer=v["block_count"],
        n_head=v["attention.head_count"],
        n_head_kv=v["attention.head_count_kv"],
        head_dim=head_dim,
        n_ff=v["feed_forward_length"],
        n_ctx_train=v.get("context_length", 2048),
        rms_eps=float(v.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_freq_base=float(v.get("rope.freq_base", 10000.0)),
        rope_dim=v["rope.dimension_count"],
        rope_neox=ARCHS[arch].rope_neox,
        has_qkv_bias=ARCHS[arch].has_qkv_bias(mf.tensors),
        has_qk_norm=ARCHS[arch].qk_norm,
        has_rope_freqs="rope_freqs.weight" in mf.tensors,
        tied_embeddings="output.weight" not in mf.tensors,
        fused_qkv=ARCHS[arch].has_fused_qkv(mf.tensors),
        fused_gate_up=ARCHS[arch].fused_gate_up,
        **rope_scaling_fields(mf, v),
        **moe_fields(ARCHS[arch], v),
        **family_fields(ARCHS[arch], v, v["block_count"], v["embedding_length"], v["attention.head_count"], head_dim,
                        float(v.get("rope.freq_base", 10000.0))),
    )


def moe_fields(a, v: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's expert fields from the schema-checked `{arch}.expert_*` keys (runtime/schema.py
    fills the widths' defaults); none for a dense family."""
    if not a.moe:
        return {}
    return dict(n_expert=v["expert_count"], n_expert_used=v["expert_used_count"], n_ff_exp=v["expert_feed_forward_length"],
                n_ff_shexp=v.get("expert_shared_feed_forward_length", 0) if a.moe_shared else 0, expert_norm=a.moe_norm_topk)


def rope_scaling_fields(mf: ModelFile, v: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's rope_* scaling fields from `{arch}.rope.scaling.*` (schema-checked values
    `v`) and the tensors: rope_factors_long/short make it "longrope" (llama.cpp's phi3), else
    rope.scaling.type (older files: rope.scale_linear alone means linear). Raises
    UnsupportedModelError for a scaling type k4 does not implement."""
    kind = v.get("rope.scaling.type", "none")
    factor = float(v.get("rope.scaling.factor", v.get("rope.scale_linear", 1.0)))
    if "rope.scaling.type" not in v and "rope.scale_linear" in v:
        kind = "linear"
    if "rope_factors_long.weight" in mf.tensors:
        kind = "longrope"
    if kind not in ("none", "linear", "yarn", "longrope"):
        raise UnsupportedModelError(f"{mf.path}: rope scaling type {kind!r} is not supported; k4 runs none, linear, yarn and longrope")
    if kind == "none":
        factor = 1.0
    return dict(rope_scaling=kind, rope_scale=factor, rope_orig_ctx=v.get("rope.scaling.original_context_length", 0),
                rope_attn_factor=float(v.get("rope.scaling.attn_factor", 1.0)),
                rope_yarn_beta_fast=float(v.get("rope.scaling.yarn_beta_fast", 32.0)),
                rope_yarn_beta_slow=float(v.get("rope.scaling.yarn_beta_slow", 1.0)))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, with its numpy shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.n_vocab, cfg.n_embd),
        "output_norm.weight": (cfg.n_embd,),
    }
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (cfg.n_vocab, cfg.n_embd)
    if cfg.has_rope_freqs:
        shapes["rope_freqs.weight"] = (cfg.rope_dim // 2,)
    if cfg.rope_scaling == "longrope":
        shapes["rope_factors_long.weight"] = (cfg.rope_dim // 2,)
        shapes["rope_factors_short.weight"] = (cfg.rope_dim // 2,)
    for i in range(cfg.n_layer):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer_shapes(cfg).items()})
    return shapes


# The matrices of one block under their unfused names (blk.N.<name>), as both forward passes read them.
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def row_view(t: Tensor, name: str, start: int, stop: int) -> Tensor:
    """Rows start..stop-1 of a matrix `t` as a Tensor of its own named `name`: the same encoded
    bytes (a memory-mapped view) and file offset moved by the rows skipped, so both backends load
    it as they load any tensor."""
    raw = t.raw_bytes()  # (n_rows, bytes_per_row) uint8; a 3-D tensor's rows run over its first two axes
    offset = None if t.file_offset is None else t.file_offset + start * raw.shape[1]
    return Tensor(name, t.ggml_type, (stop - start, t.shape[-1]), raw[start:stop], offset)


def expert_view(t: Tensor, e: int) -> Tensor:
    """Expert e's matrix (n_rows, n_in) of a stacked expert tensor t (n_expert, n_rows, n_in), as a
    row_view named `<t.name>[e]`: each expert is contiguous in the file (ggml's ne[2] is the
    outermost axis), so one expert is read or dequantized at a time."""
    rows = t.shape[1]
    return row_view(t, f"{t.name}[{e}]", e * rows, (e + 1) * rows)


def layer_matrices(mf: ModelFile, i: int) -> dict[str, Tensor]:
    """Layer i's matrices by LAYER_MATRICES name -> Tensor (n_out, n_in), each named
    blk.i.<name>.weight. Where the file fuses them (phi3, llama.cpp's create_tensor_qkv and
    LLM_FFN_SWIGLU with no gate tensor): attn_qkv rows are q (q_dim) | k (kv_dim) | v (kv_dim),
    ffn_up rows are gate (n_ff) | up (n_ff) (ggml_swiglu takes the first half as the gate;
    transformers' Phi3MLP chunks gate_up_proj the same way); each part is a row_view. A moe family
    (cfg.n_expert > 0) gives the four attention matrices only: its FFN is runtime/moe.py's."""
    cfg = mf.config
    assert cfg is not None
    name = lambda n: f"blk.{i}.{n}.weight"  # noqa: E731
    if cfg.n_expert:  # the FFN is the experts' (runtime/moe.py reads them)
        out = {n: mf.tensor(name(n)) for n in ("attn_q", "attn_k", "attn_v", "attn_output")}
        return out
    out = {n: mf.tensor(name(n)) for n in ("attn_output", "ffn_down")}
    if cfg.fused_qkv:
        qkv, q, kv = mf.tensor(name("attn_qkv")), cfg.q_dim, cfg.kv_dim
        out.update({name_: row_view(qkv, name(name_), a, b)
                    for name_, a, b in (("attn_q", 0, q), ("attn_k", q, q + kv), ("attn_v", q + kv, q + 2 * kv))})
    else:
        out.update({n: mf.tensor(name(n)) for n in ("attn_q", "attn_k", "attn_v")})
    if cfg.fused_gate_up:
        up = mf.tensor(name("ffn_up"))
        out.update({"ffn_gate": row_view(up, name("ffn_gate"), 0, cfg.n_ff), "ffn_up": row_view(up, name("ffn_up"), cfg.n_ff, 2 * cfg.n_ff)})
    else:
        out.update({n: mf.tensor(name(n)) for n in ("ffn_gate", "ffn_up")})
    return {n: out[n] for n in LAYER_MATRICES}


def check_weights(mf: ModelFile) -> None:
    """Check that every tensor the forward pass needs is present, shaped and typed as expected.

    Raises ModelFileError (missing tensor, wrong shape) or UnsupportedModelError (tensor type).
    """
    assert mf.config is not None
    for name, shape in expected_shapes(mf.config).items():
        t = mf.tensor(name)
        if t.shape != shape and not (name.endswith("ffn_gate_inp_shexp.weight") and t.shape == (1,) + shape):  # (1, n_embd) unsqueezed
            raise ModelFileError(f"{mf.path}: tensor {name!r} has shape {t.shape}, expected {shape}; the file is inconsistent")
        if t.ggml_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(x.name for x in SUPPORTED_TYPES))
            raise UnsupportedModelError(f"{mf.path}: tensor {name!r} has type {t.type_name}, which k4 does not support (supported: {supported})")
        block, _ = GGML_QUANT_SIZES[t.ggml_type]
        if shape[-1] % block:
            raise ModelFileError(f"{mf.path}: tensor {name!r} rows of {shape[-1]} are not a multiple of the {t.type_name} block of {block}")


def open_model(path: str | os.PathLike, require_weights: bool = True) -> ModelFile:
    """Open and validate a GGUF file; see ModelFile."""
    return ModelFile(path, require_weights=require_weights)


def inspect_model(path: str | os.PathLike) -> tuple[ModelFile, ModelFileError | UnsupportedModelError | None]:
    """Open any readable GGUF to describe it (`k4 info`), whether or not k4 can run it.

    Returns (mf, None) for a model k4 runs, with `mf.config` set and every weight checked, or
    (mf, problem) with `mf.config` None, its tensors and metadata still readable, where problem
    is the error open_model would raise: no tensors (a vocabulary-only file), an architecture
    other than ARCHITECTURES, a missing key or tensor, an unsupported tensor type. Raises
    ModelFileError only when the file cannot be read as GGUF at all (missing, bad magic,
    truncated, corrupt tensor table).
    """
    mf = ModelFile(path, require_weights=False)
    if not mf.tensors:
        return mf, ModelFileError(f"{mf.path}: the file holds no tensors (a vocabulary-only file); it has no weights to run")
    try:
        mf.config = _config_from(mf)
        check_weights(mf)
    except (ModelFileError, UnsupportedModelError) as exc:
        mf.config = None
        return mf, exc
    return mf, None
