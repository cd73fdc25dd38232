"""The CUDA backend: the model of runtime/reference.py on one NVIDIA GPU, with our kernels.

Reads top to bottom in execution order: availability check, weights (uploaded once in their
quantized block layout), buffers (all allocated at load), the forward pass (shared by prefill
chunks and the decode step), the decode step (a CUDA graph replayed every token, one per range
of context lengths so that short contexts launch only the attention splits they need), and the
generation loop (on-device sampling, two-stream ping-pong readback).

Fusions, each behind a flag (runtime/flags.py): attn_q/k/v rows stacked into one matrix per
run of one ggml type, ffn_gate/up into one (K4_STACK); in decode, each RMSNorm folded into the
matrix-vector product after it (K4_FUSE_NORM), SwiGLU into the gate/up product, whose rows
are interleaved for it (K4_FUSE_SWIGLU), and RoPE with the KV-cache store into the attention
kernel, which also merges its own splits (K4_FUSE_ROPE); programmatic dependent launch of every
kernel of the decode graph (K4_PDL). Off by default: the SwiGLU output quantized to 8 bits once,
in that epilogue, for the down product (K4_FUSE_QUANT=1). A 7B decode step runs 5-6 kernels
per layer. Prefill runs on fp16 activations when every product takes them, from an fp16 copy of
the weights when it fits (K4_PREFILL_F16_CACHE), with attention on tensor cores (K4_MMA_ATTN;
else tiled on CUDA cores, K4_TILED_ATTN).

Decode state lives on the device, (4,) int32 [tok, pos, ring_count, draw] (ops.ST_*): the token
the next step evaluates, its position (= n_past), the tokens pushed into the repeat-penalty
ring, and the draws made (the RNG step). The decode step reads and advances it itself, so the
same graph serves every step, and its only host traffic is the 4-byte sampled id.

Trace counting: launches count kernels (a cuBLAS call counts one), also those a graph replay
runs; syncs count stream synchronizations. The ping-pong readback waits on the event of
one 4-byte copy while the next step runs; that wait drains no stream and is not counted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ..backend import TokenCache
from ..errors import BackendUnavailableError, UnsupportedModelError
from ..flags import Flags
from ..model import ModelConfig, ModelFile, expected_shapes
from ..reference import dequantize_tensor
from ..sampling import SamplingParams
from ..trace import Trace

try:
    import cupy as cp
except ModuleNotFoundError:  # require_cuda() says so
    cp = None
else:
    from . import blas, matmul, memory, ops
    from .compile import compile_async
    from .launch import GpuErrors, launch_graph
    from .timer import DeviceTimer

PREFILL_CHUNK = 512  # tokens per prefill batch (rows of the activation buffers)
RING_MIN = 1024  # slots of the device token ring (repeat penalty window and readback source)


def require_cuda() -> None:
    """Raise BackendUnavailableError when CuPy is missing, no NVIDIA GPU is visible, or the GPU
    is older than compute capability 7.0 (our kernels use warp match instructions)."""
    if cp is None:
        raise BackendUnavailableError("CuPy is not installed; install k4 with pip install -e '.[cuda13]' (or cuda12), or use --backend numpy")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as exc:
        raise BackendUnavailableError(f"no usable NVIDIA GPU ({exc}); check the driver with nvidia-smi, or use --backend numpy") from None
    if n == 0:
        raise BackendUnavailableError("no NVIDIA GPU is visible; check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --backend numpy")
    major = int(cp.cuda.Device().compute_capability[:-1])
    if major < 7:
        raise BackendUnavailableError(f"the GPU has compute capability {cp.cuda.Device().compute_capability}; k4 needs 7.0 or newer")


@dataclass
class Projection:
    """One matrix product of a layer whose weight stacks the rows of one or more GGUF tensors.

    w: matmul.DeviceWeight (n_out, n_in); bias: (n_out,) f32 or None (qwen2's q/k/v biases,
    concatenated); parts: (name, rows) of each stacked tensor in order ("q", "k", "v", "gate",
    "up"; "gate_up" for a glu weight, interleaved); out: (P, n_out) f32 view of the scratch
    buffer it writes; cols: per part name, the (P, rows) column view of out.
    """

    w: object
    bias: object
    parts: tuple[tuple[str, int], ...]
    out: object = None
    cols: dict = None


@dataclass
class LayerWeights:
    """One block's weights on the device. Matrices are matmul.DeviceWeight (n_out, n_in);
    vectors are f32 CuPy arrays."""

    attn_norm: object  # (n_embd,)
    qkv: tuple  # Projections covering q (q_dim rows), k, v (kv_dim each), in that order
    wo: object  # (n_embd, q_dim)
    ffn_norm: object  # (n_embd,)
    gate_up: tuple  # Projections covering gate and up (n_ff rows each): one glu, one stacked, or two
    w_down: object  # (n_embd, n_ff)
    q_norm: object = None  # (head_dim,) qwen3
    k_norm: object = None  # (head_dim,)
    ff_q8: object = None  # matmul.Q8Vector: decode's SwiGLU output quantized for w_down (K4_FUSE_QUANT)


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


def check_shapes(cfg: ModelConfig) -> None:
    """Raise UnsupportedModelError for head shapes the attention and RoPE kernels do not take."""
    if cfg.head_dim % 8 or cfg.head_dim > ops.MAX_HEAD_DIM:
        raise UnsupportedModelError(f"head_dim {cfg.head_dim} is not supported on cuda (needs a multiple of 8 up to {ops.MAX_HEAD_DIM}); use --backend numpy")
    if cfg.rope_dim % 2 or cfg.rope_dim > cfg.head_dim:
        raise UnsupportedModelError(f"rope dimension {cfg.rope_dim} does not fit head_dim {cfg.head_dim}; the file is inconsistent")


def rope_inv_freq(cfg: ModelConfig, freq_factors: np.ndarray | None) -> np.ndarray:
    """(rope_dim/2,) float64: rope_freq_base^(-2i/rope_dim), divided by rope_freqs[i] when given."""
    inv = cfg.rope_freq_base ** (-np.arange(cfg.rope_dim // 2, dtype=np.float64) * 2.0 / cfg.rope_dim)
    return inv if freq_factors is None else inv / freq_factors.astype(np.float64)


class CudaBackend(TokenCache):
    """The CUDA backend (protocol: runtime/backend.py).

    mf: a validated ModelFile; n_ctx: KV cache positions; progress(done_bytes, total_bytes) is
    called while weights upload; status(text) once, if the kernels are still compiling when the
    upload ends (a first run on this GPU and k4 version: CuPy caches them on disk). Raises BackendUnavailableError (no GPU/CuPy, model does not fit),
    UnsupportedModelError (head shapes the kernels do not take); load, eval and generate raise
    GpuError (runtime.cuda.launch) when a CUDA call fails, naming the phase and the kernel.
    """

    name = "cuda"

    def __init__(self, mf: ModelFile, n_ctx: int, progress: Callable[[int, int], None] | None = None,
                 status: Callable[[str], None] | None = None):
        require_cuda()
        cfg = mf.config
        assert cfg is not None
        check_shapes(cfg)
        self.config, self.n_ctx, self.trace = cfg, n_ctx, Trace()
        self.gpu_errors = GpuErrors(self.trace)  # CUDA errors -> GpuError naming the phase
        self.tokens: list[int] = []
        self.flags = Flags()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self.timer = DeviceTimer(self.trace)  # device time of prefill and of each decode step
        self.ops = ops.Ops(self.trace, self.flags.on("K4_PDL"), self.flags.on("K4_TILED_ATTN"), self.flags.on("K4_MMA_ATTN"),
                           self.flags.on("K4_EVICT_FIRST"))
        # kernels compile on threads while the weights upload; the "compile" step waits for them
        matrix_types = {t.ggml_type for t in mf.tensors.values() if len(t.shape) == 2}
        self._status = status
        self._compiling = compile_async(matmul.compile_jobs(matrix_types, self.flags.on("K4_EVICT_FIRST"))
                                        + self.ops.compile_jobs(cfg.head_dim))
        self.fuse_norm = self.flags.on("K4_FUSE_NORM")
        self.fuse_rope = self.flags.on("K4_FUSE_ROPE")
        self.mem = memory.DeviceMemory(self.trace)
        self.chunk = min(n_ctx, PREFILL_CHUNK)
        # decode attention: one configuration per range of context lengths (ops.split_buckets) and a
        # decode graph for each range, captured on first use; eager steps take the last (any position)
        max_split = self.ops.attention_capacity(self.config.head_dim) // self.config.n_head
        self.splits = ops.split_buckets(n_ctx, self.flags.on("K4_SPLIT_ATTN"), max_split)
        self.n_split = max(n for _, n, _ in self.splits)  # the most splits of any range: the partials buffer
        self.decode_graphs: dict[int, tuple] = {}  # limit -> (graph, kernels per replay)
        self.load_ms: dict[str, float] = {}  # wall time of each load step (the stream synchronized after each)
        self.load_detail_ms: dict[str, float] = {}  # inside read+upload, which overlap: see memory.Uploader
        self.blas = None  # cuBLAS through a handle of our own: prefill chunks replay as CUDA graphs (K4_PREFILL_GRAPH)
        self.prefill_graphs: dict[bool, tuple] = {}  # last chunk or not -> (graph, kernels per replay)
        with self.trace.in_phase("load"), self.stream, self.gpu_errors:
            memory.check_fits(self._weight_bytes(mf), self._kv_bytes(), self._scratch_bytes(), n_ctx, memory.free_bytes())
            self._timed("read+upload", self._load_weights, mf, progress)
            self._timed("buffers", self._alloc_buffers)
            self._timed("prefill fp16 copy", self._half_weights)
            self._timed("compile", self._finish_compile)
            if self.flags.on("K4_PREFILL_GRAPH"):
                workspace = self.mem.empty((blas.WORKSPACE_BYTES,), cp.uint8, "scratch")
                self.blas = blas.Blas.open(workspace)
                if self.blas is None:  # no libcublas by name: prefill keeps CuPy's launched path
                    self.mem.release(workspace, "scratch")
                del workspace
            self.graph = None
            self._timed("warm-up", self._warm_up)
            if self.flags.on("K4_CUDA_GRAPH"):
                self._timed("graph capture", self._capture)

    def _finish_compile(self) -> None:
        """Wait for the modules compiling since __init__ (raising the first compile error), then
        load every kernel the model launches."""
        pending = sum(not fut.done() for fut in self._compiling)
        if pending and self._status is not None:
            self._status(f"compiling CUDA kernels ({pending} of {len(self._compiling)} modules left; "
                         "first run on this GPU and k4 version, cached afterwards)")
        for fut in self._compiling:
            fut.result()
        self.ops.compile_all(self.config.head_dim)

    def _timed(self, step: str, fn, *args) -> None:
        """Run one load step and record its wall time (ms) in load_ms, after synchronizing."""
        t0 = time.perf_counter()
        fn(*args)
        self.stream.synchronize()
        self.trace.sync()
        self.load_ms[step] = (time.perf_counter() - t0) * 1e3

    # ---- sizes ----------------------------------------------------------------------------------
    def _weight_bytes(self, mf: ModelFile) -> int:
        return sum(mf.tensor(n).n_bytes if len(s) == 2 else 4 * math.prod(s) for n, s in expected_shapes(self.config).items())

    def _kv_bytes(self) -> int:
        cfg = self.config
        return 2 * cfg.n_layer * self.n_ctx * cfg.kv_dim * 2

    def _scratch_bytes(self) -> int:
        cfg, P = self.config, self.chunk
        rows = 4 * cfg.n_embd + 3 * cfg.q_dim + 2 * cfg.kv_dim + 4 * cfg.n_ff + cfg.n_vocab
        part = cfg.n_head * self.n_split * (cfg.head_dim + 2) if self.n_split > 1 else 0
        workspace = blas.WORKSPACE_BYTES if self.flags.on("K4_PREFILL_GRAPH") else 0
        return 4 * (P * rows + part + self.n_ctx + RING_MIN + 2 * cfg.n_vocab) + workspace

    # ---- weights --------------------------------------------------------------------------------
    def _upload_matrix(self, up, mf: ModelFile, tensors: Sequence, repack: bool, glu: bool = False):
        """Upload the rows of `tensors` (one ggml type and n_in) as one DeviceWeight: stacked in
        order, or with glu the two (ffn_gate, ffn_up) interleaved (matmul.combined). The file's
        bytes go to the device as they are; when the layout differs (planar repack, interleave),
        they land in self.load_tmp and matmul.device_layout rearranges them on the copy stream."""
        spec = matmul.combined(tensors, tensors[0].name, glu)
        buf = self.mem.empty(matmul.layout_nbytes(spec, repack), cp.uint8, "weights")
        post = matmul.needs_device_layout(spec, repack, glu)
        raw_bytes = sum(t.n_bytes for t in tensors)
        target = self.load_tmp[:raw_bytes] if post else buf

        def layout() -> None:
            with self.copy_stream:
                matmul.device_layout(buf, target, spec, repack, glu, self.trace)

        at = 0
        for i, t in enumerate(tensors):
            then = layout if post and i == len(tensors) - 1 else None
            if t.file_offset is None:
                up.upload(target.data.ptr + at, t.raw_bytes(), then)
            else:
                up.upload_file(target.data.ptr + at, mf.path, t.file_offset, t.n_bytes, then)
            at += t.n_bytes
        return matmul.make_weight(spec, buf, repack, glu)

    def _upload_vector(self, up, host: np.ndarray):
        buf = self.mem.empty(host.shape, host.dtype, "weights")
        up.upload(buf.data.ptr, host)
        return buf

    def _matrix_plan(self, mf: ModelFile) -> list[tuple]:
        """The matrices to upload, in order: (key, tensor names, glu), key a tensor name or
        (layer, "qkv" or "gate_up", index of the run of one type); glu: gate/up interleaved."""
        cfg, plan = self.config, []
        for name, shape in expected_shapes(cfg).items():
            if len(shape) == 2 and not (name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")):
                plan.append((name, [name], False))
        for i in range(cfg.n_layer):
            for part, names in (("qkv", [f"blk.{i}.attn_{p}.weight" for p in "qkv"]), ("gate_up", [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"])):
                types = [mf.tensor(n).ggml_type for n in names]
                if part == "gate_up" and self.flags.on("K4_FUSE_SWIGLU") and types[0] == types[1]:
                    plan.append(((i, part, 0), names, True))
                    continue
                for j, run in enumerate(runs_of_one_type(types, self.flags.on("K4_STACK"))):
                    plan.append(((i, part, j), [names[k] for k in run], False))
        return plan

    def _load_weights(self, mf: ModelFile, progress) -> None:
        """Upload every tensor the forward pass reads, quantized matrices in their block layout
        (repacked when K4_REPACK; q/k/v and gate/up stacked or interleaved), biases of a stacked
        run concatenated, vectors as f32. Reading the file overlaps the copies (memory.Uploader)."""
        cfg = self.config
        repack = self.flags.on("K4_REPACK")
        plan = self._matrix_plan(mf)
        tmp = max([sum(mf.tensor(n).n_bytes for n in names) for _, names, glu in plan
                   if matmul.needs_device_layout(mf.tensor(names[0]), repack, glu)] or [0])
        self.load_tmp = self.mem.empty(max(tmp, 1), cp.uint8, "scratch")  # file bytes awaiting device_layout
        up = memory.Uploader(self.trace, self.copy_stream, self._weight_bytes(mf), self.flags.on("K4_PINNED_UPLOAD"), progress)
        try:
            dev: dict[object, object] = {}
            for key, names, glu in plan:
                dev[key] = self._upload_matrix(up, mf, [mf.tensor(n) for n in names], repack, glu)
            for name, shape in expected_shapes(cfg).items():
                if len(shape) == 1:
                    host = dequantize_tensor(mf.tensor(name))  # (n,) f32
                    dev[name] = self._upload_vector(up, rope_inv_freq(cfg, host) if name == "rope_freqs.weight" else host)
            if not cfg.has_rope_freqs:
                dev["rope_freqs.weight"] = self._upload_vector(up, rope_inv_freq(cfg, None))  # (rope_dim/2,) f64
            biases = {}
            for key, names, glu in plan:
                b = [n.replace(".weight", ".bias") for n in names]
                if not glu and isinstance(key, tuple) and b[0] in mf.tensors:
                    biases[key] = self._upload_vector(up, np.concatenate([dequantize_tensor(mf.tensor(n)) for n in b]))
            up.finish()
            self.load_detail_ms = {"file read (summed over reader threads)": up.read_ms,
                                   "copy stream busy (CUDA events)": up.copy_ms}
        finally:
            up.close()
        self.mem.release(self.load_tmp, "scratch")
        del self.load_tmp
        qkv_parts, ffn_parts = dict(zip((f"attn_{p}" for p in "qkv"), "qkv")), {"ffn_gate": "gate", "ffn_up": "up"}
        projections: dict[tuple[int, str], list] = {}
        for key, names, glu in plan:
            if isinstance(key, tuple):
                i, part, _ = key
                short = qkv_parts if part == "qkv" else ffn_parts
                parts = (("gate_up", dev[key].shape[0]),) if glu else tuple((short[n.split(".")[2]], mf.tensor(n).shape[0]) for n in names)
                projections.setdefault((i, part), []).append(Projection(dev[key], biases.get(key), parts))
        self.token_embd = dev["token_embd.weight"]
        self.output = dev["token_embd.weight" if cfg.tied_embeddings else "output.weight"]
        self.output_norm = dev["output_norm.weight"]
        self.inv_freq = dev["rope_freqs.weight"]  # (rope_dim/2,) f64
        self.layers = []
        for i in range(cfg.n_layer):
            g = lambda n: dev.get(f"blk.{i}.{n}")  # noqa: E731
            self.layers.append(LayerWeights(g("attn_norm.weight"), tuple(projections[i, "qkv"]), g("attn_output.weight"),
                                            g("ffn_norm.weight"), tuple(projections[i, "gate_up"]), g("ffn_down.weight"),
                                            g("attn_q_norm.weight"), g("attn_k_norm.weight")))
        self.matrices = [self.output] + [w for L in self.layers for w in (*(p.w for p in L.qkv + L.gate_up), L.wo, L.w_down)]

    def _half_weights(self) -> None:
        """With K4_PREFILL_F16_CACHE, keep an fp16 copy of every matrix prefill multiplies on
        tensor cores (matmul.make_half) when all of them take under a quarter of the free GPU
        memory, so prefill skips dequantization; otherwise leave them (no error)."""
        todo = [w for w in self.matrices if matmul.half_bytes(w) and matmul.takes_half(w, self.chunk)]
        need = sum(matmul.half_bytes(w) for w in {id(w): w for w in todo}.values())
        if not (self.flags.on("K4_PREFILL_F16_CACHE") and todo and need < memory.free_bytes() // 4):
            return
        for w in todo:
            if w.half is None:
                matmul.make_half(w, self.mem.empty(w.shape, cp.float16, "prefill_f16"), self.stream, self.trace)

    # ---- buffers --------------------------------------------------------------------------------
    def _alloc_buffers(self) -> None:
        """Every buffer a token needs, allocated once: activations for `chunk` rows, the fp16 KV
        cache, the decode state, sampler buffers, and pinned host staging."""
        cfg, P, f32 = self.config, self.chunk, cp.float32
        m = self.mem
        self.x0 = m.empty((P, cfg.n_embd), f32, "scratch")  # residual stream
        self.x1 = m.empty((P, cfg.n_embd), f32, "scratch")  # residual stream after attention
        self.h = m.empty((P, cfg.n_embd), f32, "scratch")  # normalized input of a projection
        self.h16 = m.empty((P, cfg.n_embd), cp.float16, "scratch")  # the same in fp16 (prefill on tensor cores)
        qkv = m.empty((P * (cfg.q_dim + 2 * cfg.kv_dim),), f32, "scratch")  # q, k, v products, packed per layer
        gu = m.empty((P * 2 * cfg.n_ff,), f32, "scratch")  # gate and up products
        for L in self.layers:
            self._place(L.qkv, qkv)
            self._place(L.gate_up, gu)
        self.q = m.empty((P, cfg.n_head, cfg.head_dim), f32, "scratch")  # q after RoPE
        self.attn = m.empty((P, cfg.n_head, cfg.head_dim), f32, "scratch")
        self.ff = m.empty((P, cfg.n_ff), f32, "scratch")  # silu(gate) * up
        self.ff16 = m.empty((P, cfg.n_ff), cp.float16, "scratch")
        handoff = [L for L in self.layers if self.flags.on("K4_FUSE_QUANT") and matmul.can_hand_off(L.gate_up[0].w, L.w_down)]
        if handoff:  # one buffer: the layers use it one after another
            ff_q8 = m.empty((matmul.q8x_bytes(cfg.n_ff),), cp.uint8, "scratch")
            for L in handoff:
                L.ff_q8 = matmul.Q8Vector.for_weight(L.w_down, ff_q8)
        self.logits = m.empty((P, cfg.n_vocab), f32, "scratch")
        # partials of split decode attention: (1, n_head, n_split, head_dim + 2) of the range in use
        self.part = m.empty((cfg.n_head * self.n_split * (cfg.head_dim + 2),), f32, "scratch") if self.n_split > 1 else None
        self.ticket = m.zeros((cfg.n_head,), cp.int32, "scratch")  # splits of decode attention done, per head
        kv_shape = (cfg.n_layer, self.n_ctx, cfg.n_head_kv, cfg.head_dim)
        self.k_cache = m.empty(kv_shape, cp.float16, "kv_cache")  # (n_layer, n_ctx, n_head_kv, head_dim)
        self.v_cache = m.empty(kv_shape, cp.float16, "kv_cache")
        self.ids = m.empty((self.n_ctx,), cp.int32, "scratch")  # token ids of one eval/prefill
        self.state = m.zeros((ops.STATE_WORDS,), cp.int32, "scratch")  # [tok, pos, ring_count, draw]
        self.tok_view = self.state[ops.ST_TOK : ops.ST_TOK + 1]
        self.pos_view = self.state[ops.ST_POS : ops.ST_POS + 1]
        self.params = m.zeros((ops.SAMPLER_PARAM_WORDS,), cp.uint64, "scratch")
        self.seen = m.zeros((cfg.n_vocab,), cp.int32, "scratch")
        n_part = ops.argmax_parts(cfg.n_vocab)
        self.part_val = m.empty((n_part,), f32, "scratch")
        self.part_idx = m.empty((n_part,), cp.int32, "scratch")
        self.ring = m.zeros((RING_MIN,), cp.int32, "scratch")
        self.mm_scratch = m.empty((matmul.matmul_scratch_bytes(self.matrices, P),), cp.uint8, "scratch")
        self.staging = memory.PinnedBuffer(4 * (self.n_ctx + RING_MIN) + 8 * ops.SAMPLER_PARAM_WORDS)
        self.slots = [memory.PinnedBuffer(4), memory.PinnedBuffer(4)]  # int32 readback slots, one event each
        self.computed = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(2)]

    def _place(self, projections: tuple, flat: cp.ndarray) -> None:
        """Give each projection of one layer its output view: consecutive (P, n_out) blocks of
        `flat`, and the column view of each part."""
        P, off = self.chunk, 0
        for p in projections:
            n_out = p.w.shape[0]
            p.out = flat[P * off : P * (off + n_out)].reshape(P, n_out)
            p.cols, col = {}, 0
            for name, rows in p.parts:
                p.cols[name] = p.out[:, col : col + rows]
                col += rows
            off += n_out

    def _grow_ring(self, n: int) -> None:
        """Make the token ring hold at least n ids (a larger repeat_last_n); the decode graph is re-captured."""
        size = 1 << (n - 1).bit_length()
        self.ring = self.mem.zeros((size,), cp.int32, "scratch")
        self.staging.wait()
        self.staging = memory.PinnedBuffer(4 * (self.n_ctx + size) + 8 * ops.SAMPLER_PARAM_WORDS)
        if self.graph is not None:  # every decode graph reads the old ring
            self.decode_graphs.clear()
            self._capture(self.n_past + 1)

    # ---- forward --------------------------------------------------------------------------------
    def _linear(self, w, X: cp.ndarray, Y: cp.ndarray, residual: cp.ndarray | None = None, bias=None, norm=None,
                x_q8=None, y_q8=None) -> None:
        """Y = X W^T (+ bias) (+ residual). X: (n, n_in) f32 (or fp16 on the tensor-core path),
        Y and residual: (n, n_out) f32 views; a glu weight yields silu(gate) * up, (n, n_out / 2),
        on one row. One row: matmul.gemv, with norm = (norm_w, eps) folded into it and the q8
        handoff x_q8, y_q8 (matmul.Q8Vector); more: matmul.matmul (tensor cores unless
        K4_PREFILL_TC=0)."""
        if X.shape[0] == 1:
            matmul.gemv(w, X[0], Y[0], residual=None if residual is None else residual[0], bias=bias, norm=norm,
                        stream=self.stream, trace=self.ops.trace, x_q8=x_q8, y_q8=y_q8)
        else:
            matmul.matmul(w, X, Y, residual=residual, bias=bias, scratch=self.mm_scratch, stream=self.stream, trace=self.ops.trace,
                          blas=self.blas)

    def _normed(self, x: cp.ndarray, norm_w: cp.ndarray, half: bool):
        """The input of the products after an RMSNorm of x (n, n_embd): (X, norm) for _linear.
        One row with K4_FUSE_NORM: x itself, the norm folded into the product; otherwise the
        norm kernel's output, fp16 when `half`."""
        n = x.shape[0]
        if n == 1 and self.fuse_norm:
            return x, (norm_w, self.config.rms_eps)
        h = (self.h16 if half else self.h)[:n]
        self.ops.rms_norm(x, norm_w, h, self.config.rms_eps)
        return h, None

    def _half(self, n: int) -> bool:
        """Whether a forward pass of n tokens runs on fp16 activations: every product of it takes
        them (matmul.takes_half)."""
        return all(matmul.takes_half(w, n) for w in self.matrices)

    def _forward(self, n: int, row_ids: cp.ndarray, split: tuple[int, int, int] | None = None) -> cp.ndarray:
        """Enqueue the layers for n tokens (ids row_ids (n,) int32 on the device) at positions
        state[pos] .. state[pos] + n - 1, writing their keys/values into the cache. split: for one
        token, the decode attention configuration (limit, n_split, split_len) of self.splits
        (default the last, valid at any position); the position must be below its limit.
        Returns the residual stream (n, n_embd) f32 after the last layer."""
        cfg, o = self.config, self.ops
        x, x1 = self.x0[:n], self.x1[:n]  # (n, n_embd) each
        q, attn = self.q[:n], self.attn[:n]  # (n, n_head, head_dim)
        half = n > 1 and self._half(n)
        ff = (self.ff16 if half else self.ff)[:n]  # (n, n_ff)
        limit, n_split, split_len = (split or self.splits[-1]) if n == 1 else (self.n_ctx, 1, self.n_ctx)
        part = None
        if n_split > 1:
            part = self.part[: cfg.n_head * n_split * (cfg.head_dim + 2)].reshape(1, cfg.n_head, n_split, cfg.head_dim + 2)
        matmul.dequant_rows(self.token_embd, row_ids, x, stream=self.stream, trace=o.trace)
        for li, L in enumerate(self.layers):
            # attention: norm, q/k/v projections (+bias), [q/k norm] + RoPE + cache store, attention, output + residual
            h, norm = self._normed(x, L.attn_norm, half)
            cols = {}
            for p in L.qkv:
                self._linear(p.w, h, p.out[:n], bias=p.bias, norm=norm)
                cols.update({name: c[:n] for name, c in p.cols.items()})
            fresh = None
            if n == 1 and self.fuse_rope:  # RoPE and the cache store inside the attention kernel
                fresh = (cols["q"], cols["k"], cols["v"], L.q_norm, L.k_norm, self.inv_freq, cfg.rope_dim, cfg.rope_neox, cfg.rms_eps)
            else:
                o.rope_qk_store(cols["q"], cols["k"], cols["v"], self.k_cache[li], self.v_cache[li], L.q_norm, L.k_norm,
                                self.inv_freq, self.pos_view, cfg.rope_dim, cfg.rope_neox, cfg.rms_eps, q_out=q)
            o.attention(q, self.k_cache[li, :limit], self.v_cache[li, :limit], attn, self.pos_view, n_split, split_len, part,
                        self.ticket, fresh)
            self._linear(L.wo, attn.reshape(n, cfg.q_dim), x1, residual=x)
            # feed-forward: norm, gate and up with SwiGLU, down + residual
            ff_q8 = self._gate_up(L, x1, ff, half)
            self._linear(L.w_down, ff, x, residual=x1, x_q8=ff_q8)
        return x

    def _gate_up(self, L: LayerWeights, x1: cp.ndarray, ff: cp.ndarray, half: bool):
        """ff (n, n_ff) = silu(gate) * up of rmsnorm(x1 (n, n_embd)) * ffn_norm: in the product's
        epilogue for a glu weight on the matrix-vector path, else by the swiglu kernel. Returns
        L.ff_q8 when the epilogue also wrote ff quantized into it for w_down (one token), else None."""
        n = x1.shape[0]
        h, norm = self._normed(x1, L.ffn_norm, half)
        if len(L.gate_up) == 2:  # separate gate and up
            g, u = (p.out[:n] for p in L.gate_up)
            self._linear(L.gate_up[0].w, h, g, norm=norm)
            self._linear(L.gate_up[1].w, h, u, norm=norm)
            self.ops.swiglu(g, u, ff)
            return None
        p = L.gate_up[0]
        if p.w.glu and matmul.uses_gemv(p.w, n):
            q8 = L.ff_q8 if n == 1 else None
            for i in range(n):  # the matrix-vector path: SwiGLU in the epilogue
                self._linear(p.w, h[i : i + 1], ff[i : i + 1], norm=norm, y_q8=q8)
            return q8
        self._linear(p.w, h, p.out[:n], norm=norm)
        self.ops.swiglu_rows(p.out[:n], ff, interleaved=p.w.glu)
        return None

    def _output(self, x: cp.ndarray, logits: cp.ndarray) -> None:
        """logits (n, n_vocab) = output · rmsnorm(x (n, n_embd)) * output_norm."""
        n = x.shape[0]
        h, norm = self._normed(x, self.output_norm, n > 1 and self._half(n))
        self._linear(self.output, h, logits, norm=norm)

    def _upload(self, ids: list[int], window: list[int] | None = None, params: SamplingParams | None = None) -> None:
        """Stage the token ids of one call (and, for generate, the repeat-penalty window and the
        sampler parameters) in pinned memory, and enqueue their copies to the device."""
        base, cap = 4 * self.n_ctx, self.ring.shape[0]
        self.staging.wait()
        self.staging.view(np.int32, len(ids))[:] = ids
        memory.h2d(self.trace, self.ids.data.ptr, self.staging, 0, 4 * len(ids), self.stream)
        if window:
            self.staging.view(np.int32, len(window), base)[:] = window
            memory.h2d(self.trace, self.ring.data.ptr, self.staging, base, 4 * len(window), self.stream)
        if params is not None:
            self.staging.view(np.uint64, ops.SAMPLER_PARAM_WORDS, base + 4 * cap)[:] = ops.pack_sampler_params(params)
            memory.h2d(self.trace, self.params.data.ptr, self.staging, base + 4 * cap, 8 * ops.SAMPLER_PARAM_WORDS, self.stream)

    def _prefill(self, n_total: int, logits_out: np.ndarray | None) -> None:
        """Enqueue the n_total uploaded ids (after the cached tokens) in chunks of `chunk`
        tokens. With logits_out (n_total, n_vocab) every position's logits are copied there;
        otherwise the last position's logits are left in self.logits[0]. Without logits_out,
        full chunks replay a captured CUDA graph (K4_PREFILL_GRAPH): a chunk is ~10 launches per
        layer from Python, slower to issue than the GPU runs them on small models."""
        p0 = self.n_past
        for c0 in range(0, n_total, self.chunk):
            n = min(self.chunk, n_total - c0)
            self.ops.set_i32(self.pos_view, p0 + c0)
            if logits_out is None and self.blas is not None and n == self.chunk:
                if c0:  # the graph reads its ids from the start of the buffer
                    cp.cuda.runtime.memcpyAsync(self.ids.data.ptr, self.ids.data.ptr + 4 * c0, 4 * n,
                                                cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
                    self.trace.launch()
                self._prefill_chunk_graph(c0 + n == n_total)
                continue
            x = self._forward(n, self.ids[c0 : c0 + n], self._split_for(p0 + c0 + 1) if n == 1 else None)
            if logits_out is not None:
                self._output(x, self.logits[:n])
                memory.d2h_sync(self.trace, logits_out[c0 : c0 + n], self.logits[:n], self.stream)
            elif c0 + n == n_total:
                self._output(x[n - 1 :], self.logits[:1])
        self.ops.set_i32(self.pos_view, p0 + n_total)

    # ---- protocol -------------------------------------------------------------------------------
    def eval(self, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """See runtime/backend.py. Copies the logits to the host (for perplexity and tests)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("eval() needs at least one token")
        self._check_room(len(ids))
        cfg = self.config
        with self.trace.in_phase("prefill" if len(ids) > 1 else "decode") as c, self.stream, self.gpu_errors:
            # all logits: (T, n_vocab), copied by _prefill; else the last token's (n_vocab,)
            out = np.empty((len(ids), cfg.n_vocab) if all_logits else cfg.n_vocab, dtype=np.float32)
            with self.timer.span(self.stream, step=True):
                self._upload(ids)
                self._prefill(len(ids), out if all_logits else None)
            if not all_logits:
                memory.d2h_sync(self.trace, out, self.logits[0], self.stream)
            self.timer.collect()
            c.steps += 1
        self.tokens.extend(ids)
        return out

    # ---- decode step ----------------------------------------------------------------------------
    def _decode_body(self, split: tuple[int, int, int] | None = None) -> None:
        """One decode step on the current stream: evaluate state[tok] at state[pos], sample the
        next token into state and the ring, advance pos. Reads nothing from the host. split: the
        attention configuration (see _forward)."""
        x = self._forward(1, self.tok_view, split)
        self._output(x, self.logits[:1])
        self.ops.sample(self.logits[0], self.params, self.state, self.ring, self.seen, self.part_val, self.part_idx, advance=True)

    def _warm_up(self) -> None:
        """Run one decode step on the zeroed state (greedy, position 0), so every kernel module,
        ours and the matmul family's, is loaded before graph capture, which forbids loading.
        What it writes (cache row 0, the state) is overwritten before any real use."""
        self._decode_body(self._split_for(1))
        self.stream.synchronize()
        self.trace.sync()

    def _capture(self, n_kv: int = 1) -> None:
        """Make self.graph the decode graph for a step attending n_kv keys (position n_kv - 1):
        the graph of the first range of self.splits that holds n_kv, captured from _decode_body
        on first use (ops count into a scratch Trace meanwhile); graph_launches keeps how many
        kernels one replay runs."""
        split = self._split_for(n_kv)
        if split[0] not in self.decode_graphs:
            counting, self.ops.trace = self.ops.trace, Trace(phase=self.trace.phase)
            try:
                self.stream.begin_capture()
                try:
                    self._decode_body(split)
                finally:
                    graph = self.stream.end_capture()
                self.decode_graphs[split[0]] = (graph, self.ops.trace.get(self.ops.trace.phase).launches)
            finally:
                self.ops.trace = counting
        self.graph, self.graph_launches = self.decode_graphs[split[0]]

    def _prefill_chunk_graph(self, last: bool) -> None:
        """Replay the graph of one full chunk (ids from self.ids[:chunk], positions from
        state[pos]; with `last`, the last row's logits into self.logits[0]), capturing it on
        first use. Its launches count into a scratch Trace while it is captured."""
        if last not in self.prefill_graphs:
            P = self.chunk
            counting, self.ops.trace = self.ops.trace, Trace(phase=self.trace.phase)
            try:
                self.stream.begin_capture()
                try:
                    x = self._forward(P, self.ids[:P])
                    if last:
                        self._output(x[P - 1 :], self.logits[:1])
                finally:
                    graph = self.stream.end_capture()
                self.prefill_graphs[last] = (graph, self.ops.trace.get(self.ops.trace.phase).launches)
            finally:
                self.ops.trace = counting
        graph, n_kernels = self.prefill_graphs[last]
        launch_graph(graph, self.stream, self.trace, n_kernels, "prefill graph")

    def _split_for(self, n_kv: int) -> tuple[int, int, int]:
        """The decode attention configuration of a step attending n_kv keys: the first range of
        self.splits that holds n_kv. Graph replays and eager steps alike use it, so the result
        of a step depends on its position only."""
        return next(sp for sp in self.splits if n_kv <= sp[0])

    def _decode_step(self) -> None:
        """Enqueue the decode step that evaluates position n_past (a graph replay with graphs on)."""
        if self.graph is not None:
            self._capture(self.n_past + 1)
            launch_graph(self.graph, self.stream, self.trace, self.graph_launches)
        else:
            self._decode_body(self._split_for(self.n_past + 1))

    def _start_readback(self, ring_count: int, slot: int, stream) -> None:
        """Copy the token at ring[ring_count % ring_cap] into pinned slot `slot` on `stream`,
        after the work enqueued so far on the compute stream."""
        if stream is not self.stream:
            self.computed[slot].record(self.stream)
            stream.wait_event(self.computed[slot])
        src = self.ring.data.ptr + 4 * (ring_count % self.ring.shape[0])
        memory.d2h_async(self.trace, self.slots[slot], 0, src, 4, stream)

    def _read_slot(self, slot: int) -> int:
        self.slots[slot].wait()
        return int(self.slots[slot].view(np.int32, 1)[0])

    # ---- generation -----------------------------------------------------------------------------
    def _start(self, ids: list[int], params: SamplingParams, history: Sequence[int]) -> int:
        """Prefill ids and sample the first token on the device. Returns the ring count of that
        token (its ring slot, before the modulo). One id (a decode-only start, as tgN runs it)
        is a replay of the decode graph, not ~5 kernels per layer launched from Python."""
        recent = list(history) + ids
        window = recent[len(recent) - min(params.repeat_last_n, len(recent)) :]
        if len(window) + 2 > self.ring.shape[0]:
            self._grow_ring(len(window) + 2)
        self._upload(ids, window, params)
        self.ops.set_i32(self.state[ops.ST_RING : ops.ST_RING + 1], len(window))
        self.ops.set_i32(self.state[ops.ST_DRAW : ops.ST_DRAW + 1], 0)
        if len(ids) == 1 and self.graph is not None:
            self.ops.set_i32(self.tok_view, ids[0])
            self.ops.set_i32(self.pos_view, self.n_past)
            self._decode_step()  # evaluates state[tok] at state[pos], samples, advances pos
        else:
            self._prefill(len(ids), None)
            self.ops.sample(self.logits[0], self.params, self.state, self.ring, self.seen, self.part_val, self.part_idx, advance=False)
        self.tokens.extend(ids)
        return len(window)

    def generate(self, token_ids: Sequence[int], params: SamplingParams, history: Sequence[int] = ()) -> Iterator[int]:
        """See runtime/backend.py. With K4_PINGPONG the step evaluating token t (and sampling
        t+1) is enqueued before t is read, from pinned slot t % 2; on close, that evaluation is
        dropped from the cache. Without it, each token is copied and the stream synchronized."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("generate() needs at least one token")
        params.validate()
        self._check_room(len(ids))
        pingpong = self.flags.on("K4_PINGPONG")
        with self.trace.in_phase("prefill") as c, self.stream, self.gpu_errors:
            with self.timer.span(self.stream, step=True):
                ring_count = self._start(ids, params, history)
            if pingpong:
                self._start_readback(ring_count, 0, self.copy_stream)
            c.steps += 1
        slot, ahead = 0, False
        try:
            while True:
                with self.trace.in_phase("decode") as c, self.stream, self.gpu_errors:
                    if pingpong:
                        room = self.n_past < self.n_ctx
                        if room:
                            with self.timer.span(self.stream, step=True):
                                self._decode_step()
                            self._start_readback(ring_count + 1, slot ^ 1, self.copy_stream)
                        tok = self._read_slot(slot)
                        self.timer.collect()
                        if room:
                            self.tokens.append(tok)
                            ahead = True
                        slot ^= 1
                    else:
                        self._start_readback(ring_count, 0, self.stream)
                        self.stream.synchronize()
                        self.trace.sync()
                        tok = self._read_slot(0)
                        self.timer.collect()
                    c.steps += 1
                ring_count += 1
                yield tok
                ahead = False
                if pingpong and not room:
                    self._check_room(1)
                if not pingpong:
                    self._check_room(1)
                    with self.trace.in_phase("decode"), self.stream, self.gpu_errors:
                        with self.timer.span(self.stream, step=True):
                            self._decode_step()
                    self.tokens.append(tok)
        finally:
            if ahead:  # the step evaluating the last token is still in flight: finish it, so that
                self.tokens.pop()  # freeing or reusing buffers after close cannot race with it
                with self.trace.in_phase("close"):
                    self.stream.synchronize()
                    self.trace.sync()
            self.timer.collect()

    def close(self) -> None:
        """Finish all work on both streams and drop the decode graph, so the memory this backend
        frees afterwards cannot be in use by the GPU. Idempotent; the backend is unusable after."""
        with self.gpu_errors:
            self.stream.synchronize()
            self.copy_stream.synchronize()
        self.timer.collect()
        self.graph = None
        self.decode_graphs.clear()
        self.prefill_graphs.clear()
        if self.blas is not None:
            self.blas.close()
            self.blas = None

    def memory_report(self) -> dict[str, int]:
        """Device bytes by kind: weights, kv_cache, scratch (activations, sampler, matmul scratch)."""
        return dict(self.mem.bytes)
