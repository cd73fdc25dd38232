"""Counters and timers per phase: every host<->device copy, sync, kernel launch, graph replay
and device allocation is recorded here, so `K4_TRACE=1` and `k4 bench` can show where the
bytes and the time go.

Phases are free-form names; k4 uses "load", "prefill", "decode", "sample", "detokenize".
Units: bytes, counts, milliseconds. `ms` is host wall clock; `gpu_ms` is device time from CUDA
events (runtime/cuda/timer.py), 0 where a backend records none (numpy).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields


@dataclass
class Counters:
    h2d_bytes: int = 0
    h2d_count: int = 0
    d2h_bytes: int = 0
    d2h_count: int = 0
    syncs: int = 0
    launches: int = 0
    graph_replays: int = 0
    allocs: int = 0
    alloc_bytes: int = 0
    steps: int = 0
    ms: float = 0.0
    gpu_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Trace:
    """Per-phase Counters. `phase` is the one currently counted into."""

    phases: dict[str, Counters] = field(default_factory=dict)
    phase: str = "load"
    gpu_steps: dict[str, list[float]] = field(default_factory=dict)  # per-step device ms, by phase

    def _c(self) -> Counters:
        return self.phases.setdefault(self.phase, Counters())

    @contextmanager
    def in_phase(self, name: str):
        """Count into phase `name` inside the block and add its wall time (ms) to it."""
        previous, self.phase = self.phase, name
        t0 = time.perf_counter()
        try:
            yield self._c()
        finally:
            self.phases.setdefault(name, Counters()).ms += (time.perf_counter() - t0) * 1e3
            self.phase = previous

    def h2d(self, nbytes: int) -> None:
        c = self._c()
        c.h2d_bytes += int(nbytes)
        c.h2d_count += 1

    def d2h(self, nbytes: int) -> None:
        c = self._c()
        c.d2h_bytes += int(nbytes)
        c.d2h_count += 1

    def sync(self) -> None:
        self._c().syncs += 1

    def launch(self, n: int = 1) -> None:
        self._c().launches += n

    def graph_replay(self) -> None:
        self._c().graph_replays += 1

    def alloc(self, nbytes: int) -> None:
        c = self._c()
        c.allocs += 1
        c.alloc_bytes += int(nbytes)

    def step(self) -> None:
        self._c().steps += 1

    def gpu(self, phase: str, ms: float, step: bool = False) -> None:
        """Add device time `ms` to `phase`; step=True also keeps it as one per-step sample."""
        self.phases.setdefault(phase, Counters()).gpu_ms += ms
        if step:
            self.gpu_steps.setdefault(phase, []).append(ms)

    def get(self, phase: str) -> Counters:
        return self.phases.get(phase, Counters())

    def reset(self, phase: str | None = None) -> None:
        if phase is None:
            self.phases.clear()
            self.gpu_steps.clear()
        else:
            self.phases.pop(phase, None)
            self.gpu_steps.pop(phase, None)
