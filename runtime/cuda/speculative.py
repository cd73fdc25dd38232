"""Speculative decoding's greedy verify step on the GPU (runtime/speculative.py drives it).

One step evaluates n = k + 1 tokens [t, d_1 .. d_k] (the last sampled token, then k drafts) as
one forward pass: every matrix is read once for all n rows (the batched matrix-vector product
for n up to matmul's per-token limit). Then, on the device, kernels_cu/speculative.cu takes
each row's argmax, keeps the longest run of drafts that greedy decoding agrees with, and moves
the cache position past t and the accepted drafts; the host reads m + 2 ids with one copy and
one synchronization per step, not per token. The cache rows of rejected drafts stay where they
are and are overwritten by the next step (their position is past the cache length).

Each n is run eagerly the first time (loading any kernel module it needs), then captured as a
CUDA graph and replayed: ids come from the ids buffer, the position from the decode state.
"""

from __future__ import annotations

from typing import Sequence

import cupy as cp
import numpy as np

from . import memory
from .launch import launch, launch_graph
from .quant_kernels import GEMV_MAX_TOKENS

ARGMAX_THREADS = 1024  # threads of spec_argmax's one block per row


class Verifier:
    """The verify step for one Runner (runtime/cuda/runner.py): at most max_tokens tokens per step."""

    def __init__(self, runner, max_tokens: int):
        self.r, self.max_tokens = runner, max_tokens
        self.best = runner.mem.zeros((max_tokens,), cp.int32, "scratch")  # argmax of each row
        self.out = runner.mem.zeros((max_tokens + 1,), cp.int32, "scratch")  # [m, accepted drafts, next id]
        self.host = np.zeros(max_tokens + 1, np.int32)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (n, split limit) -> (graph, kernels per replay)
        self.ran: set[tuple[int, int]] = set()  # keys run eagerly once (their modules are loaded)

    def step(self, ids: Sequence[int], n_past: int) -> list[int]:
        """Evaluate ids = [t, d_1 .. d_k] at positions n_past .. n_past + k and keep t and the
        accepted drafts in the cache. Returns d_1 .. d_m followed by the greedy token after d_m
        (m + 1 ids, 0 <= m <= k). The caller checks that the cache has room for all of ids."""
        r, n = self.r, len(ids)
        if not 1 <= n <= self.max_tokens:
            raise ValueError(f"a verify step takes 1 to {self.max_tokens} tokens, got {n}")
        r.upload(list(ids))
        r.ops.set_i32(r.fwd.pos, n_past)
        split = r.split_for(n_past + 1) if n == 1 else None
        key = (n, split[0] if split else 0)
        if key in self.graphs:
            graph, n_kernels = self.graphs[key]
            launch_graph(graph, r.stream, r.trace, n_kernels, "verify graph")
        elif key in self.ran and self._capturable(n):
            self.graphs[key] = r.captured(lambda: self._body(n, split))
            graph, n_kernels = self.graphs[key]
            launch_graph(graph, r.stream, r.trace, n_kernels, "verify graph")
        else:
            self._body(n, split)
            self.ran.add(key)
        out = self.host[: n + 1]
        memory.d2h_sync(r.trace, out, self.out[: n + 1], r.stream)
        m = int(out[0])
        return [int(t) for t in out[1 : m + 2]]

    def _capturable(self, n: int) -> bool:
        """Whether a step of n tokens can be captured: every product is a kernel of ours, or
        cuBLAS runs on the capturable handle (Forward.blas)."""
        return n <= GEMV_MAX_TOKENS or self.r.fwd.blas is not None

    def _body(self, n: int, split) -> None:
        """Enqueue one step of n tokens (ids in the ids buffer, position in the decode state)."""
        r, fwd = self.r, self.r.fwd
        x = fwd.layers(n, fwd.act.ids[:n], split)
        logits = fwd.act.logits[:n]
        fwd.output(x, logits)
        n_vocab = logits.shape[1]
        launch(r.ops.function("speculative.cu", "spec_argmax"), (n,), (ARGMAX_THREADS,),
               (logits, np.int32(n_vocab), self.best), 0, None, r.ops.trace)
        launch(r.ops.function("speculative.cu", "spec_accept"), (1,), (32,),
               (fwd.act.ids, self.best, np.int32(n), self.out, fwd.pos), 0, None, r.ops.trace)

    def close(self) -> None:
        self.graphs.clear()
