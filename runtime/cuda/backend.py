"""The CUDA backend: the model of runtime/reference.py on one NVIDIA GPU, with our kernels.

This file assembles the pieces and implements the backend protocol (runtime/backend.py), in
load order: availability check, the memory check (sizes from the buffer specs), the weights
(runtime/cuda/weights.py), buffers (buffers.py) and KV cache (kv_cache.py), kernels compiled while the
weights upload (compile.py), the forward pass (forward.py) and the runner that replays it as
prefill chunks and decode graphs with on-device sampling and ping-pong readback (runner.py).

Every optimization is a K4_* flag (runtime/flags.py), read from the Flags value this backend
is built with and handed to the piece it concerns as an options value.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import BackendUnavailableError, UnsupportedModelError
from ..flags import Flags
from ..kv_types import F16, KVTypes
from ..model import ModelConfig, ModelFile
from ..sampling import SamplingParams
from ..token_cache import TokenCache
from ..trace import Trace

try:
    import cupy as cp
except ModuleNotFoundError:  # require_cuda() says so
    cp = None
else:
    from . import blas, matrix_jobs, megakernel, memory, moe_load, ops, q8_handoff
    from .attention_launch import MAX_HEAD_DIM
    from .buffers import allocate, place, sampler_spec
    from .kv_cache import KVCache
    from .compile import compile_async
    from .forward import Forward, ForwardOptions
    from .launch import GpuErrors, use_carveout
    from .runner import Runner
    from .speculative import Verifier
    from .timer import DeviceTimer
    from .sizing import options, size_plan
    from .weights import WeightLoader, half_weights



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


def check_shapes(cfg: ModelConfig) -> None:
    """Raise UnsupportedModelError for head shapes the attention and RoPE kernels do not take."""
    if cfg.head_dim % 8 or cfg.head_dim > MAX_HEAD_DIM:
        raise UnsupportedModelError(f"head_dim {cfg.head_dim} is not supported on cuda (needs a multiple of 8 up to {MAX_HEAD_DIM}); use --backend numpy")
    if cfg.rope_dim % 2 or cfg.rope_dim > cfg.head_dim:
        raise UnsupportedModelError(f"rope dimension {cfg.rope_dim} does not fit head_dim {cfg.head_dim}; the file is inconsistent")


class CudaBackend(TokenCache):
    """The CUDA backend (protocol: runtime/backend.py).

    mf: a validated ModelFile; n_ctx: KV cache positions; progress(done_bytes, total_bytes) is
    called while weights upload; status(text) once, if the kernels are still compiling when the
    upload ends (a first run on this GPU and k4 version: CuPy caches them on disk); flags: the
    K4_* switches (default: the environment's, Flags()); kv_types: the KV cache's key and value
    types (-ctk, -ctv; runtime/cuda/kv_cache.py). Raises BackendUnavailableError (no
    GPU/CuPy, model does not fit), UnsupportedModelError (head shapes the kernels do not take);
    load, eval and generate raise GpuError (runtime.cuda.launch) when a CUDA call fails, naming
    the phase and the kernel.
    """

    name = "cuda"

    def __init__(self, mf: ModelFile, n_ctx: int, progress: Callable[[int, int], None] | None = None,
                 status: Callable[[str], None] | None = None, flags: Flags | None = None, kv_types: KVTypes = F16):
        require_cuda()
        cfg = mf.config
        assert cfg is not None
        check_shapes(cfg)
        kv_types.check(cfg.head_dim)
        self.config, self.n_ctx, self.trace, self.tokens, self.kv_types = cfg, n_ctx, Trace(), [], kv_types
        self.verifier = None  # speculative decoding's verify step, made on first use
        self.flags = flags if flags is not None else Flags()
        self.gpu_errors = GpuErrors(self.trace)  # CUDA errors -> GpuError naming the phase
        self.mem = memory.DeviceMemory(self.trace)
        self.load_ms: dict[str, float] = {}  # wall time of each load step (the stream synchronized after each)
        self.load_detail_ms: dict[str, float] = {}  # inside read+upload, which overlap: see memory.Uploader
        w_opts, f_opts, o_opts = options(self.flags)
        use_carveout(self.flags.on("K4_CARVEOUT"))
        o = ops.Ops(self.trace, kv_types, o_opts)
        # kernels compile on threads while the weights upload; the "compile" step waits for them
        matrix_types = {t.ggml_type for t in mf.tensors.values() if len(t.shape) == 2}
        head = mf.tensors["token_embd.weight" if cfg.tied_embeddings else "output.weight"].ggml_type
        compiling = compile_async(matrix_jobs.compile_jobs(matrix_types, w_opts.matrix.evict_first, cfg.activation,
                                                           w_opts.matrix.mma8, head if f_opts.head_argmax else None,
                                                           f_opts.qkv_wide)
                                  + o.compile_jobs(cfg.head_dim, cfg.n_head // cfg.n_head_kv) + moe_load.compile_jobs(mf, cfg, o))
        plan = size_plan(mf, n_ctx, self.flags, o)
        chunk = plan.chunk
        stream, copy_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        with self.trace.in_phase("load"), stream, self.gpu_errors:
            ring = self.flags.on("K4_SWA_RING")
            memory.check_fits(plan.weights, KVCache.nbytes(cfg, n_ctx, kv_types, chunk, ring), plan.buffers, n_ctx,
                              memory.free_bytes())
            loader = WeightLoader(self.mem, self.trace, copy_stream, w_opts)
            self._timed(stream, "read+upload", lambda: setattr(self, "weights", loader.load(mf, cfg, progress, n_ctx)))
            self.load_detail_ms = loader.detail_ms
            self._timed(stream, "buffers", lambda: self._buffers(plan, o, f_opts, stream, copy_stream))
            if self.flags.on("K4_PREFILL_F16_CACHE"):
                self._timed(stream, "prefill fp16 copy", half_weights, self.weights, self.mem, chunk, stream, self.trace)
            self._timed(stream, "compile", self._finish_compile, compiling, status)
            if self.megakernel_off not in (None, "off") and status is not None:
                status(f"K4_MEGAKERNEL: not for this model ({self.megakernel_off}); decode runs one kernel per op")
            if self.flags.on("K4_PREFILL_GRAPH"):  # cuBLAS through a handle of our own: prefill chunks as graphs
                workspace = self.mem.empty((blas.WORKSPACE_BYTES,), cp.uint8, "scratch")
                self.forward.blas = blas.Blas.open(workspace)
                if self.forward.blas is None:  # no libcublas by name: prefill keeps CuPy's launched path
                    self.mem.release(workspace, "scratch")
                del workspace
            self._timed(stream, "warm-up", self.runner.warm_up)
            if self.flags.on("K4_CUDA_GRAPH"):
                self._timed(stream, "graph capture", self.runner.capture)

    def _buffers(self, plan, o, f_opts: ForwardOptions, stream, copy_stream) -> None:
        """Allocate the activations, the KV cache and the runner's buffers; place each layer's
        projection outputs; give the layers that hand their SwiGLU output on in 8 bits its buffer."""
        act = allocate(self.mem, plan.act_spec)
        for L in self.weights.layers:
            place(L.qkv, act.qkv, act.x0.shape[0])
            place(L.gate_up, act.gate_up, act.x0.shape[0])
            if act.ff_q8 is not None and L.gate_up and q8_handoff.can_hand_off(L.gate_up[0].w, L.w_down):  # moe: no gate_up
                L.ff_q8 = q8_handoff.Q8Vector.for_weight(L.w_down, act.ff_q8)
        self.kv = KVCache(self.mem, self.config, self.n_ctx, self.kv_types, act.x0.shape[0], self.flags.on("K4_SWA_RING"))
        self.rewind_slack = self.kv.slack
        self.timer = DeviceTimer(self.trace)  # device time of prefill and of each decode step
        smp = allocate(self.mem, sampler_spec(self.config))  # decode state, sampler buffers, token ring
        pos = smp.state[ops.ST_POS : ops.ST_POS + 1]
        self.forward = Forward(self.config, self.weights, act, self.kv, o, f_opts, plan.splits, pos, stream, plan.swa_splits)
        self.runner = Runner(self.forward, smp, self.mem, self.trace, stream, copy_stream)
        # K4_MEGAKERNEL: decode steps in one persistent kernel where the model allows it (else why not)
        self.megakernel_off = megakernel.unsupported(self.config, self.weights, self.kv) if self.flags.on("K4_MEGAKERNEL") else "off"
        if self.megakernel_off is None:
            try:
                self.forward.mega = megakernel.MegaStep(self.config, self.weights, act, self.kv, self.mem, self.weights.rope_mscale,
                                                        self.config.query_scale)
            except megakernel.PlanError as exc:
                self.megakernel_off = str(exc)

    def _finish_compile(self, compiling: list, status) -> None:
        """Wait for the modules compiling since __init__ (raising the first compile error), then
        load every kernel the model launches."""
        pending = sum(not fut.done() for fut in compiling)
        if pending and status is not None:
            status(f"compiling CUDA kernels ({pending} of {len(compiling)} modules left; "
                   "first run on this GPU and k4 version, cached afterwards)")
        for fut in compiling:
            fut.result()
        self.forward.ops.compile_all(self.config.head_dim, self.config.n_head // self.config.n_head_kv)

    def _timed(self, stream, step: str, fn, *args) -> None:
        """Run one load step and record its wall time (ms) in load_ms, after synchronizing."""
        t0 = time.perf_counter()
        fn(*args)
        stream.synchronize()
        self.trace.sync()
        self.load_ms[step] = (time.perf_counter() - t0) * 1e3

    # ---- what tests and bench look at ------------------------------------------------------------
    @property
    def stream(self):
        return self.runner.stream

    @property
    def graph(self):
        """The decode graph in use, None without K4_CUDA_GRAPH."""
        return self.runner.graph

    @property
    def graph_launches(self) -> int:
        return self.runner.graph_launches

    @property
    def decode_graphs(self) -> dict:
        return self.runner.decode_graphs

    @property
    def splits(self) -> list[tuple[int, int, int]]:
        """Decode attention configurations (limit, n_split, split_len) per range of context lengths."""
        return self.forward.splits

    @property
    def n_split(self) -> int:
        """The most decode attention splits of any range."""
        return max(n for _, n, _ in self.forward.splits)

    @property
    def chunk(self) -> int:
        return self.forward.chunk

    @property
    def layers(self):
        return self.weights.layers

    def memory_report(self) -> dict[str, int]:
        """Device bytes by kind: weights, kv_cache, scratch (activations, sampler, matmul scratch), prefill_f16."""
        return dict(self.mem.bytes)

    # ---- protocol -------------------------------------------------------------------------------
    def eval(self, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """See runtime/backend.py. Copies the logits to the host (for perplexity and tests)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("eval() needs at least one token")
        self._check_room(len(ids))
        cfg, r = self.config, self.runner
        with self.trace.in_phase("prefill" if len(ids) > 1 else "decode") as c, r.stream, self.gpu_errors:
            # all logits: (T, n_vocab), copied by prefill; else the last token's (n_vocab,)
            out = np.empty((len(ids), cfg.n_vocab) if all_logits else cfg.n_vocab, dtype=np.float32)
            with self.timer.span(r.stream, step=True):
                r.upload(ids)
                r.prefill(self.n_past, len(ids), out if all_logits else None)
            if not all_logits:
                memory.d2h_sync(self.trace, out, self.forward.act.logits[0], r.stream)
            self.timer.collect()
            c.steps += 1
        self.tokens.extend(ids)
        return out

    def verify(self, token_ids: Sequence[int]) -> list[int]:
        """See runtime/backend.py: argmax, acceptance and the cache rollback run on the device
        (runtime/cuda/speculative.py); one copy of m + 2 ids comes back."""
        ids = [int(t) for t in token_ids]
        if not 1 <= len(ids) <= self.chunk:
            raise ValueError(f"verify() takes 1 to {self.chunk} tokens, got {len(ids)}")
        self._check_room(len(ids))
        r = self.runner
        with self.trace.in_phase("verify") as c, r.stream, self.gpu_errors:
            if self.verifier is None:
                self.verifier = Verifier(r, self.chunk)
            with self.timer.span(r.stream, step=True):
                out = self.verifier.step(ids, self.n_past)
            self.timer.collect()
            c.steps += 1
        self.written = max(self.written, self.n_past + len(ids))  # the rejected drafts' keys were stored too
        self.tokens.extend(ids[: len(out)])  # t and the accepted drafts
        return out

    def _start(self, ids: list[int], params: SamplingParams, history: Sequence[int]) -> int:
        """Prefill ids, sample the first token on the device, cache ids; its ring count."""
        ring_count = self.runner.start(ids, params, history, self.n_past)
        self.tokens.extend(ids)
        return ring_count

    def generate(self, token_ids: Sequence[int], params: SamplingParams, history: Sequence[int] = ()) -> Iterator[int]:
        """See runtime/backend.py. With K4_PINGPONG the step evaluating token t (and sampling
        t+1) is enqueued before t is read, from pinned slot t % 2; on close, that evaluation is
        dropped from the cache. Without it, each token is copied and the stream synchronized.
        With K4_CHAIN_EVENTS (and K4_PINGPONG) the steps' timing spans are chained: one event
        record a step, which the readback waits for (runtime/cuda/timer.py)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("generate() needs at least one token")
        params.validate()
        self._check_room(len(ids))
        pingpong = self.flags.on("K4_PINGPONG")
        chain = pingpong and self.flags.on("K4_CHAIN_EVENTS")  # one event record a step (timer.py)
        with self.trace.in_phase("prefill") as c, self.runner.stream, self.gpu_errors:
            with self.timer.span(self.runner.stream, step=True, lend=chain) as span:
                ring_count = self._start(ids, params, history)
            if pingpong:
                self.runner.start_readback(ring_count, 0, self.runner.copy_stream, span.end if chain else None)
            c.steps += 1
        slot, ahead, lent = 0, False, span.end if chain else None
        try:
            while True:
                with self.trace.in_phase("decode") as c, self.runner.stream, self.gpu_errors:
                    if pingpong:
                        room = self.n_past < self.n_ctx
                        if room:
                            with self.timer.span(self.runner.stream, step=True, after=self.timer.chain_start(lent), lend=chain) as span:
                                self.runner.decode_step(self.n_past)
                            self.runner.start_readback(ring_count + 1, slot ^ 1, self.runner.copy_stream, span.end if chain else None)
                            lent = span.end if chain else None
                        tok = self.runner.read_slot(slot)
                        self.timer.collect()
                        if room:
                            self.tokens.append(tok)
                            ahead = True
                        slot ^= 1
                    else:
                        self.runner.start_readback(ring_count, 0, self.runner.stream)
                        self.runner.stream.synchronize()
                        self.trace.sync()
                        tok = self.runner.read_slot(0)
                        self.timer.collect()
                    c.steps += 1
                ring_count += 1
                yield tok
                ahead = False
                if pingpong and not room:
                    self._check_room(1)
                if not pingpong:
                    self._check_room(1)
                    with self.trace.in_phase("decode"), self.runner.stream, self.gpu_errors:
                        with self.timer.span(self.runner.stream, step=True):
                            self.runner.decode_step(self.n_past)
                    self.tokens.append(tok)
        finally:
            if ahead:  # the step evaluating the last token is still in flight: finish it, so that
                self.written = max(self.written, self.n_past)  # (its key is stored all the same)
                self.tokens.pop()  # freeing or reusing buffers after close cannot race with it
                with self.trace.in_phase("close"):
                    self.runner.stream.synchronize()
                    self.trace.sync()
            self.timer.collect()

    def close(self) -> None:
        """Finish all work on both streams and drop the graphs, so the memory this backend frees
        afterwards cannot be in use by the GPU. Idempotent; the backend is unusable after."""
        with self.gpu_errors:
            self.runner.stream.synchronize()
            self.runner.copy_stream.synchronize()
        self.timer.collect()
        if self.verifier is not None:
            self.verifier.close()
        self.runner.close()
        if self.forward.blas is not None:
            self.forward.blas.close()
            self.forward.blas = None
