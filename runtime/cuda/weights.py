"""The CUDA backend's weights: what is uploaded, in which layout, and the upload itself.

Matrices go to the device in their quantized block layout (Q4_K stays 144 bytes per 256
weights; repacked into per-field planes with K4_REPACK), the q/k/v and gate/up matrices of a
layer stacked into one matrix per run of one ggml type (K4_STACK), gate/up rows interleaved for
the SwiGLU (GeGLU) epilogue (K4_FUSE_SWIGLU); a file's fused attn_qkv or gate|up ffn_up (phi3) comes
as row views of its bytes (model.layer_matrices) and is planned like separate tensors. Vectors
(norms, biases) go as float32; the RoPE table (runtime/rope.py, from rope_freqs or LongRoPE's
factors) as the float64 inverse frequencies the RoPE kernels read. The file is read by memory.Uploader's
threads into pinned staging buffers while earlier pieces copy to the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import cupy as cp
import numpy as np

from ..model import ModelConfig, ModelFile, expected_shapes, layer_matrices
from ..rope import RopeTable, factor_tensor, rope_table
from ..trace import Trace
from ..weights import dequantize_tensor
from . import device_weight, layout, matmul, memory
from .moe_load import layer_moe, scratch_bytes as moe_scratch_bytes, upload_experts
from .quant_kernels import GLU_ACTS

STACKED = ("attn_q", "attn_k", "attn_v", "attn_qkv", "ffn_gate", "ffn_up")  # per-layer tensors uploaded as Projections


@dataclass(frozen=True)
class WeightOptions:
    """How the weights are laid out on the device (each a K4_* flag, runtime/flags.py)."""

    repack: bool = True  # K4_REPACK: quantized blocks in per-field planes
    stack: bool = True  # K4_STACK: q/k/v (and gate/up) runs of one type as one matrix
    glu: bool = True  # K4_FUSE_SWIGLU: gate/up interleaved for the SwiGLU epilogue
    pinned: bool = True  # K4_PINNED_UPLOAD: pinned staging buffers, reader threads
    planar_experts: bool = True  # K4_PLANAR_EXPERTS: expert tensors of some types planar (moe.planar_experts)
    matrix: device_weight.WeightOptions = field(default_factory=device_weight.WeightOptions)


@dataclass
class Projection:
    """One matrix product of a layer whose weight stacks the rows of one or more GGUF tensors.

    w: device_weight.DeviceWeight (n_out, n_in); bias: (n_out,) f32 or None (qwen2's q/k/v biases,
    concatenated); parts: (name, rows) of each stacked tensor in order ("q", "k", "v", "gate",
    "up"; "gate_up" for a glu weight, interleaved); out: (P, n_out) f32 view of the scratch
    buffer it writes; cols: per part name, the (P, rows) column view of out (buffers.place).
    """

    w: object
    bias: object
    parts: tuple[tuple[str, int], ...]
    out: object = None
    cols: dict = None


@dataclass
class LayerWeights:
    """One block's weights on the device. Matrices are device_weight.DeviceWeight (n_out, n_in);
    vectors are f32 CuPy arrays."""

    attn_norm: object  # (n_embd,)
    qkv: tuple  # Projections covering q (q_dim rows), k, v (kv_dim each), in that order
    wo: object  # (n_embd, q_dim)
    ffn_norm: object  # (n_embd,)
    gate_up: tuple  # Projections covering gate and up (n_ff rows each): one glu, one stacked, or two
    w_down: object  # (n_embd, n_ff)
    q_norm: object = None  # (head_dim,) qwen3
    k_norm: object = None  # (head_dim,)
    ff_q8: object = None  # q8_handoff.Q8Vector: decode's SwiGLU output quantized for w_down (K4_FUSE_QUANT)
    attn_post_norm: object = None  # (n_embd,) gemma: RMSNorm of the attention output before the residual
    ffn_post_norm: object = None  # (n_embd,) gemma: of the feed-forward output
    moe: object = None  # moe.MoeWeights (qwen3moe, qwen2moe): the experts in place of gate_up and w_down


@dataclass
class Weights:
    """Every weight the forward pass reads, on the device."""

    token_embd: object  # DeviceWeight (n_vocab, n_embd)
    output: object  # DeviceWeight (n_vocab, n_embd); token_embd itself when the embeddings are tied
    output_norm: object  # (n_embd,) f32
    inv_freq: object  # (rope_dim/2,) f64: runtime/rope.py's table (base, factors, linear or YaRN scaling)
    layers: list[LayerWeights]
    rope_mscale: float = 1.0  # the factor on the rotated pairs' cos and sin (RopeTable.mscale)
    inv_freq_swa: object = None  # (rope_dim/2,) f64 of the sliding-window layers (gemma; swa_inv_freq), or None
    matrices: list = field(default_factory=list)  # every DeviceWeight a product reads: output first

    def __post_init__(self):
        self.matrices = [self.output] + [w for L in self.layers for w in (*(p.w for p in L.qkv + L.gate_up), L.wo, L.w_down)
                                         if w is not None]
        self.matrices += [w for L in self.layers if L.moe is not None for w in L.moe.shared or ()]


def runs_of_one_type(types: Sequence, stack: bool) -> list[list[int]]:
    """Indices 0..len(types)-1 grouped into runs of consecutive equal types (each alone when not
    `stack`): the matrices that can share one stacked weight."""
    groups: list[list[int]] = []
    for i, t in enumerate(types):
        if stack and groups and types[groups[-1][-1]] == t:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def rope_inv_freq(cfg: ModelConfig, freq_factors: np.ndarray | None) -> np.ndarray:
    """(rope_dim/2,) float64: rope_freq_base^(-2i/rope_dim), divided by freq_factors[i] when
    given, with cfg's linear or YaRN scaling (runtime/rope.py rope_table; its mscale apart)."""
    return rope_table(cfg, cfg.n_ctx_train, freq_factors).inv_freq


def model_rope_table(mf: ModelFile, cfg: ModelConfig, n_ctx: int) -> RopeTable:
    """runtime/rope.py's table for the file at a context of n_ctx (LongRoPE picks its factors by it)."""
    name = factor_tensor(cfg, n_ctx)
    return rope_table(cfg, n_ctx, dequantize_tensor(mf.tensor(name)) if name else None)


def swa_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """(rope_dim/2,) float64 of the sliding-window layers (gemma): rope_freq_base_swa^(-2i/rope_dim),
    no factors and no scaling (reference.swa_rope_tables)."""
    return cfg.rope_freq_base_swa ** (-np.arange(cfg.rope_dim // 2, dtype=np.float64) * 2.0 / cfg.rope_dim)


def weight_bytes(mf: ModelFile, cfg: ModelConfig) -> int:
    """Device bytes of the weights before layout changes: matrices as in the file, vectors f32."""
    return sum(mf.tensor(n).n_bytes if len(s) >= 2 else 4 * math.prod(s) for n, s in expected_shapes(cfg).items())


def matrix_plan(mf: ModelFile, cfg: ModelConfig, opts: WeightOptions) -> list[tuple]:
    """The matrices to upload, in order: (key, tensors, glu), key a tensor name or (layer, "qkv"
    or "gate_up", index of the run of one type); tensors: model.Tensor, the q/k/v and gate/up
    ones by their unfused names (row views of a fused tensor, model.layer_matrices); glu: gate/up
    interleaved, for the product's act(gate) * up epilogue (silu, or gemma's gelu_tanh:
    quant_kernels.GLU_ACTS)."""
    plan = []
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 2 and not (name.startswith("blk.") and name.split(".")[2] in STACKED) and "ffn_gate_inp." not in name:
            plan.append((name, [mf.tensor(name)], False))
    for i in range(cfg.n_layer):
        m = layer_matrices(mf, i)
        parts = [("qkv", [m["attn_q"], m["attn_k"], m["attn_v"]])]
        if not cfg.n_expert:  # a moe block's FFN is its experts (runtime/cuda/moe.py)
            parts.append(("gate_up", [m["ffn_gate"], m["ffn_up"]]))
        for part, tensors in parts:
            types = [t.ggml_type for t in tensors]
            if part == "gate_up" and opts.glu and types[0] == types[1] and cfg.activation in GLU_ACTS:
                plan.append(((i, part, 0), tensors, True))
                continue
            for j, run in enumerate(runs_of_one_type(types, opts.stack)):
                plan.append(((i, part, j), [tensors[k] for k in run], False))
    return plan


class WeightLoader:
    """Uploads a model's weights (load_weights) with a memory.DeviceMemory `mem`, counting copies
    in `trace`, on `copy_stream`. After load: detail_ms, the read and copy times inside it."""

    def __init__(self, mem: memory.DeviceMemory, trace: Trace, copy_stream, opts: WeightOptions):
        self.mem, self.trace, self.copy_stream, self.opts = mem, trace, copy_stream, opts
        self.detail_ms: dict[str, float] = {}

    def load(self, mf: ModelFile, cfg: ModelConfig, progress: Callable[[int, int], None] | None, n_ctx: int = 0) -> Weights:
        """Upload every tensor the forward pass reads (see the module doc), with the RoPE table
        for a context of n_ctx positions (0: the training context). Reading the file overlaps
        the copies; file bytes that need a device layout pass through a scratch buffer freed
        before returning."""
        plan = matrix_plan(mf, cfg, self.opts)
        tmp = max([sum(t.n_bytes for t in tensors) for _, tensors, glu in plan
                   if layout.needs_device_layout(tensors[0], self.opts.repack, glu)] or [0])
        tmp = max(tmp, moe_scratch_bytes(mf, cfg, self.opts.planar_experts))
        load_tmp = self.mem.empty(max(tmp, 1), cp.uint8, "scratch")  # file bytes awaiting device_layout
        up = memory.Uploader(self.trace, self.copy_stream, weight_bytes(mf, cfg), self.opts.pinned, progress)
        try:
            dev = {key: self._matrix(up, mf, tensors, glu, load_tmp, cfg.activation) for key, tensors, glu in plan}
            for name, shape in expected_shapes(cfg).items():
                if len(shape) == 1 and not name.startswith("rope_"):  # the RoPE factors go into the table
                    dev[name] = self._vector(up, dequantize_tensor(mf.tensor(name)))  # (n,) f32
            rope = model_rope_table(mf, cfg, n_ctx or cfg.n_ctx_train)
            dev["rope_freqs.weight"] = self._vector(up, rope.inv_freq)  # (rope_dim/2,) f64
            dev.update(upload_experts(self.mem, up, mf, cfg, self.opts.planar_experts, load_tmp, self.copy_stream, self.trace))
            if cfg.swa_layers:
                dev["rope_freqs_swa"] = self._vector(up, swa_inv_freq(cfg))  # (rope_dim/2,) f64
            biases = {}
            for key, tensors, glu in plan:
                b = [t.name.replace(".weight", ".bias") for t in tensors]
                if not glu and isinstance(key, tuple) and b[0] in mf.tensors:
                    biases[key] = self._vector(up, np.concatenate([dequantize_tensor(mf.tensor(n)) for n in b]))
            up.finish()
            self.detail_ms = {"file read (summed over reader threads)": up.read_ms, "copy stream busy (CUDA events)": up.copy_ms}
        finally:
            up.close()
        self.mem.release(load_tmp, "scratch")
        return _assemble(cfg, plan, dev, biases, rope.mscale)

    def _matrix(self, up, mf: ModelFile, tensors: Sequence, glu: bool, load_tmp, act: str = "silu"):
        """Upload the rows of `tensors` (one ggml type and n_in) as one DeviceWeight: stacked in
        order, or with glu the two (ffn_gate, ffn_up) interleaved (matmul.combined), their
        epilogue act(gate) * up (act: ModelConfig.activation). The file's
        bytes go to the device as they are; when the layout differs (planar repack, interleave),
        they land in load_tmp and layout.device_layout rearranges them on the copy stream."""
        repack = self.opts.repack
        spec = layout.combined(tensors, tensors[0].name, glu)
        buf = self.mem.empty(layout.layout_nbytes(spec, repack), cp.uint8, "weights")
        post = layout.needs_device_layout(spec, repack, glu)
        target = load_tmp[: sum(t.n_bytes for t in tensors)] if post else buf

        def rearrange() -> None:
            with self.copy_stream:
                layout.device_layout(buf, target, spec, repack, glu, self.trace)

        at = 0
        for i, t in enumerate(tensors):
            then = rearrange if post and i == len(tensors) - 1 else None
            if t.file_offset is None:
                up.upload(target.data.ptr + at, t.raw_bytes(), then)
            else:
                up.upload_file(target.data.ptr + at, mf.path, t.file_offset, t.n_bytes, then)
            at += t.n_bytes
        return device_weight.make_weight(spec, buf, repack, glu, self.opts.matrix, glu_act=act if glu else "silu")

    def _vector(self, up, host: np.ndarray):
        buf = self.mem.empty(host.shape, host.dtype, "weights")
        up.upload(buf.data.ptr, host)
        return buf


def _assemble(cfg: ModelConfig, plan: list[tuple], dev: dict, biases: dict, rope_mscale: float) -> Weights:
    """The uploaded pieces (dev: plan key or tensor name -> device array) as Weights."""
    qkv_parts, ffn_parts = dict(zip((f"attn_{p}" for p in "qkv"), "qkv")), {"ffn_gate": "gate", "ffn_up": "up"}
    projections: dict[tuple[int, str], list] = {}
    for key, tensors, glu in plan:
        if isinstance(key, tuple):
            i, part, _ = key
            short = qkv_parts if part == "qkv" else ffn_parts
            parts = (("gate_up", dev[key].shape[0]),) if glu else tuple((short[t.name.split(".")[2]], t.shape[0]) for t in tensors)
            projections.setdefault((i, part), []).append(Projection(dev[key], biases.get(key), parts))
    layers = []
    for i in range(cfg.n_layer):
        g = lambda n: dev.get(f"blk.{i}.{n}")  # noqa: E731
        layers.append(LayerWeights(g("attn_norm.weight"), tuple(projections[i, "qkv"]), g("attn_output.weight"),
                                   g("ffn_norm.weight"), tuple(projections.get((i, "gate_up"), ())), g("ffn_down.weight"),
                                   g("attn_q_norm.weight"), g("attn_k_norm.weight")))
    for i, L in enumerate(layers):  # gemma's post-norms (None elsewhere)
        L.attn_post_norm, L.ffn_post_norm = dev.get(f"blk.{i}.post_attention_norm.weight"), dev.get(f"blk.{i}.post_ffw_norm.weight")
        L.moe = layer_moe(cfg, i, dev)  # None for a dense model
    return Weights(dev["token_embd.weight"], dev["token_embd.weight" if cfg.tied_embeddings else "output.weight"],
                   dev["output_norm.weight"], dev["rope_freqs.weight"], layers, rope_mscale,
                   inv_freq_swa=dev.get("rope_freqs_swa"))


def half_weights(weights: Weights, mem: memory.DeviceMemory, chunk: int, stream, trace: Trace) -> None:
    """Keep an fp16 copy of every matrix prefill multiplies on tensor cores (matmul.make_half)
    when all of them take under a quarter of the free GPU memory, so prefill skips
    dequantization; otherwise leave them (no error). For K4_PREFILL_F16_CACHE."""
    todo = [w for w in weights.matrices if device_weight.half_bytes(w) and matmul.takes_half(w, chunk)]
    need = sum(device_weight.half_bytes(w) for w in {id(w): w for w in todo}.values())
    if not (todo and need < memory.free_bytes() // 4):
        return
    for w in todo:
        if w.half is None:
            matmul.make_half(w, mem.empty(w.shape, cp.float16, "prefill_f16"), stream, trace)
