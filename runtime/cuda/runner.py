"""Runs forward passes: prefill in chunks (full chunks replayed as CUDA graphs), the decode
step (a CUDA graph per range of context lengths, captured on first use, replayed every token),
on-device sampling, and the readback of sampled ids.

Decode state lives on the device, (4,) int32 [tok, pos, ring_count, draw] (ops.ST_*): the token
the next step evaluates, its position (= n_past), the tokens pushed into the repeat-penalty
ring, and the draws made (the RNG step). The decode step reads and advances it itself, so the
same graph serves every step, and its only host traffic is the 4-byte sampled id, copied on
the copy stream into one of two pinned slots (ping-pong) while the next step runs.

Trace counting: launches count kernels (a cuBLAS call counts one), also those a graph replay
runs; syncs count stream synchronizations.
"""

from __future__ import annotations

from typing import Sequence

import cupy as cp
import numpy as np

from ..sampling import SamplingParams
from ..trace import Trace
from . import memory, ops
from .buffers import Readback
from .forward import Forward
from .launch import launch_graph
from .memory import DeviceMemory


class Runner:
    """Enqueues prefill, decode steps and sampling for one Forward on `stream`; `copy_stream`
    carries readbacks. smp: the sampler's buffers (buffers.sampler_spec), whose state the
    Forward's `pos` is a view of. capture() makes decode steps graph replays (K4_CUDA_GRAPH)."""

    def __init__(self, fwd: Forward, smp, mem: DeviceMemory, trace: Trace, stream, copy_stream):
        self.fwd, self.ops, self.smp, self.mem, self.trace = fwd, fwd.ops, smp, mem, trace
        self.stream, self.copy_stream = stream, copy_stream
        self.io = Readback(fwd.n_ctx, smp.ring.shape[0])
        self.decode_graphs: dict[int, tuple] = {}  # range limit -> (graph, kernels per replay)
        self.prefill_graphs: dict[bool, tuple] = {}  # last chunk or not -> (graph, kernels per replay)
        self.graph, self.graph_launches = None, 0  # the decode graph in use (None: eager steps)

    @property
    def tok_view(self) -> cp.ndarray:
        return self.smp.state[ops.ST_TOK : ops.ST_TOK + 1]

    # ---- uploads and prefill --------------------------------------------------------------------
    def upload(self, ids: list[int], window: list[int] | None = None, params: SamplingParams | None = None) -> None:
        """Stage the token ids of one call (and, for generate, the repeat-penalty window and the
        sampler parameters) in pinned memory, and enqueue their copies to the device."""
        base, cap, staging = 4 * self.fwd.n_ctx, self.smp.ring.shape[0], self.io.staging
        staging.wait()
        staging.view(np.int32, len(ids))[:] = ids
        memory.h2d(self.trace, self.fwd.act.ids.data.ptr, staging, 0, 4 * len(ids), self.stream)
        if window:
            staging.view(np.int32, len(window), base)[:] = window
            memory.h2d(self.trace, self.smp.ring.data.ptr, staging, base, 4 * len(window), self.stream)
        if params is not None:
            staging.view(np.uint64, ops.SAMPLER_PARAM_WORDS, base + 4 * cap)[:] = ops.pack_sampler_params(params)
            memory.h2d(self.trace, self.smp.params.data.ptr, staging, base + 4 * cap, 8 * ops.SAMPLER_PARAM_WORDS, self.stream)

    def prefill(self, n_past: int, n_total: int, logits_out: np.ndarray | None) -> None:
        """Enqueue the n_total uploaded ids (after n_past cached tokens) in chunks. With
        logits_out (n_total, n_vocab) every position's logits are copied there; otherwise the
        last position's logits are left in logits[0]. Without logits_out, full chunks replay a
        captured CUDA graph (when fwd.blas is set, K4_PREFILL_GRAPH): a chunk is ~10 launches per
        layer from Python, slower to issue than the GPU runs them on small models."""
        fwd, chunk = self.fwd, self.fwd.chunk
        ids, logits = fwd.act.ids, fwd.act.logits
        for c0 in range(0, n_total, chunk):
            n = min(chunk, n_total - c0)
            self.ops.set_i32(fwd.pos, n_past + c0)
            if logits_out is None and fwd.blas is not None and n == chunk:
                if c0:  # the graph reads its ids from the start of the buffer
                    cp.cuda.runtime.memcpyAsync(ids.data.ptr, ids.data.ptr + 4 * c0, 4 * n,
                                                cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
                    self.trace.launch()
                self._prefill_chunk_graph(c0 + n == n_total)
                continue
            split = self.split_for(n_past + c0 + 1) if n == 1 else None
            if logits_out is None and c0 + n == n_total and self.mega_runs(split):  # one token: the megakernel
                fwd.decode_mega(ids[c0 : c0 + 1])
                continue
            x = fwd.layers(n, ids[c0 : c0 + n], split)
            if logits_out is not None:
                fwd.output(x, logits[:n])
                memory.d2h_sync(self.trace, logits_out[c0 : c0 + n], logits[:n], self.stream)
            elif c0 + n == n_total:
                fwd.output(x[n - 1 :], logits[:1])
        self.ops.set_i32(fwd.pos, n_past + n_total)

    def _prefill_chunk_graph(self, last: bool) -> None:
        """Replay the graph of one full chunk (ids from ids[:chunk], positions from state[pos];
        with `last`, the last row's logits into logits[0]), capturing it on first use."""
        if last not in self.prefill_graphs:
            P, fwd = self.fwd.chunk, self.fwd

            def body() -> None:
                x = fwd.layers(P, fwd.act.ids[:P])
                if last:
                    fwd.output(x[P - 1 :], fwd.act.logits[:1])

            self.prefill_graphs[last] = self.captured(body)
        graph, n_kernels = self.prefill_graphs[last]
        launch_graph(graph, self.stream, self.trace, n_kernels, "prefill graph")

    # ---- the decode step ------------------------------------------------------------------------
    def decode_body(self, split: tuple[int, int, int] | None = None) -> None:
        """One decode step on the current stream: evaluate state[tok] at state[pos], sample the
        next token into state and the ring, advance pos. Reads nothing from the host. split: the
        attention configuration (Forward.layers); ranges of up to fwd.mega.max_keys keys run the
        megakernel instead, when there is one (K4_MEGAKERNEL)."""
        fwd, s = self.fwd, self.smp
        parts = 0  # argmax partials the output head wrote (K4_HEAD_ARGMAX)
        if self.mega_runs(split):
            fwd.decode_mega(self.tok_view)
        else:
            x = fwd.layers(1, self.tok_view, split)
            parts = fwd.output(x, fwd.act.logits[:1], (s.part_val, s.part_idx))
        self.ops.sample(fwd.act.logits[0], s.params, s.state, s.ring, s.seen, s.part_val, s.part_idx, advance=True,
                        head_parts=parts)

    def mega_runs(self, split: tuple[int, int, int] | None) -> bool:
        """Whether a one-token pass with attention configuration `split` runs the megakernel
        (Forward.mega, K4_MEGAKERNEL): there is one and the range attends at most its max_keys."""
        return self.fwd.mega is not None and split is not None and split[0] <= self.fwd.mega.max_keys

    def warm_up(self) -> None:
        """Run one decode step on the zeroed state (greedy, position 0), so every kernel module is
        loaded before graph capture, which forbids loading. What it writes (cache row 0, the
        state) is overwritten before any real use."""
        self.decode_body(self.split_for(1))
        self.stream.synchronize()
        self.trace.sync()

    def capture(self, n_kv: int = 1) -> None:
        """Make self.graph the decode graph for a step attending n_kv keys (position n_kv - 1):
        the graph of the first range of splits that holds n_kv, captured on first use;
        graph_launches keeps how many kernels one replay runs."""
        split = self.split_for(n_kv)
        if split[0] not in self.decode_graphs:
            self.decode_graphs[split[0]] = self.captured(lambda: self.decode_body(split))
        self.graph, self.graph_launches = self.decode_graphs[split[0]]

    def captured(self, body) -> tuple:
        """(graph, kernels per replay) of `body` captured on the stream; its launches count into
        a scratch Trace meanwhile."""
        counting, self.ops.trace = self.ops.trace, Trace(phase=self.trace.phase)
        try:
            self.stream.begin_capture()
            try:
                body()
            finally:
                graph = self.stream.end_capture()
            return graph, self.ops.trace.get(self.ops.trace.phase).launches
        finally:
            self.ops.trace = counting

    def split_for(self, n_kv: int) -> tuple[int, int, int]:
        """The decode attention configuration of a step attending n_kv keys: the first range of
        splits that holds n_kv. Graph replays and eager steps alike use it, so the result of a
        step depends on its position only."""
        return next(sp for sp in self.fwd.splits if n_kv <= sp[0])

    def decode_step(self, n_past: int) -> None:
        """Enqueue the decode step that evaluates position n_past (a graph replay with graphs on)."""
        if self.graph is not None:
            self.capture(n_past + 1)
            launch_graph(self.graph, self.stream, self.trace, self.graph_launches)
        else:
            self.decode_body(self.split_for(n_past + 1))

    # ---- sampling and readback ------------------------------------------------------------------
    def start(self, ids: list[int], params: SamplingParams, history: Sequence[int], n_past: int) -> int:
        """Prefill ids after n_past cached tokens and sample the first token on the device.
        Returns the ring count of that token (its ring slot, before the modulo). One id (a
        decode-only start, as tgN runs it) is a replay of the decode graph."""
        recent = list(history) + ids
        window = recent[len(recent) - min(params.repeat_last_n, len(recent)) :]
        if len(window) + 2 > self.smp.ring.shape[0]:
            self._grow_ring(len(window) + 2, n_past)
        self.upload(ids, window, params)
        s = self.smp
        self.ops.set_i32(s.state[ops.ST_RING : ops.ST_RING + 1], len(window))
        self.ops.set_i32(s.state[ops.ST_DRAW : ops.ST_DRAW + 1], 0)
        if len(ids) == 1 and self.graph is not None:
            self.ops.set_i32(self.tok_view, ids[0])
            self.ops.set_i32(self.fwd.pos, n_past)
            self.decode_step(n_past)  # evaluates state[tok] at state[pos], samples, advances pos
        else:
            self.prefill(n_past, len(ids), None)
            logits = self.fwd.act.logits[0]
            self.ops.sample(logits, s.params, s.state, s.ring, s.seen, s.part_val, s.part_idx, advance=False)
        return len(window)

    def start_readback(self, ring_count: int, slot: int, stream, after: cp.cuda.Event | None = None) -> None:
        """Copy the token at ring[ring_count % ring_cap] into pinned slot `slot` on `stream`,
        after the work enqueued so far on the compute stream. after: an event recorded on the
        compute stream after that work (the step's timing end, runtime/cuda/timer.py), waited
        for instead of recording one more (each record between two decode graphs widens the gap
        between them)."""
        if stream is not self.stream:
            if after is None:
                self.io.computed[slot].record(self.stream)
            stream.wait_event(after if after is not None else self.io.computed[slot])
        ring = self.smp.ring
        src = ring.data.ptr + 4 * (ring_count % ring.shape[0])
        memory.d2h_async(self.trace, self.io.slots[slot], 0, src, 4, stream)

    def read_slot(self, slot: int) -> int:
        self.io.slots[slot].wait()
        return int(self.io.slots[slot].view(np.int32, 1)[0])

    def _grow_ring(self, n: int, n_past: int) -> None:
        """Make the token ring hold at least n ids (a larger repeat_last_n); the decode graphs are re-captured."""
        size = 1 << (n - 1).bit_length()
        self.smp.ring = self.mem.zeros((size,), cp.int32, "scratch")
        self.io.staging.wait()
        self.io = Readback(self.fwd.n_ctx, size)
        if self.graph is not None:  # every decode graph reads the old ring
            self.decode_graphs.clear()
            self.capture(n_past + 1)

    def close(self) -> None:
        """Drop the graphs (after the caller synchronized the streams)."""
        self.graph = None
        self.decode_graphs.clear()
        self.prefill_graphs.clear()
