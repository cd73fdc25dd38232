"""Device time per phase from CUDA events, read without synchronizing.

`DeviceTimer.span(stream)` records a timing event on the stream before and after a block of
enqueued work; the pair is resolved (cudaEventElapsedTime, ms) once the end event has completed,
which `collect()` checks with cudaEventQuery, so a decode loop never waits for it. Each resolved
span adds its milliseconds to the phase's `Counters.gpu_ms` and, for steps, one sample to
`Trace.gpu_steps[phase]` (the per-token decode latencies `k4 bench` reports as p50/p99).

An event pair measures the time between the GPU reaching the two records on that stream: the
kernels of the block plus any gaps inside it, not the host's time to enqueue it while the GPU
was busy with earlier work.

Chained spans (`lend`, `after`): every event record between two CUDA graph replays on a stream
widens the gap between them (by about 1.6 µs per timing event on the H200: docs/PERF.md, session
35), so the decode loop records one event per step. A span opened with `lend=True` keeps its end
event for the next span, which passes it as `after` and starts there instead of recording a
start of its own, and waits for it to read the token back (runtime/cuda/runner.py). Such a span
also counts the gap before its work. The loop chains only while the GPU is still busy with the
step before (`chain_start`), so time the GPU spent waiting for the host is not counted.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Any

from ..trace import Trace


class CupyEvents:
    """The event API DeviceTimer uses, from CuPy (imported on first use): new() a timing event,
    elapsed(start, end) its ms, fault the exception of a context that faulted. Tests pass a fake."""

    def __init__(self):
        import cupy as cp

        self.new, self.elapsed, self.fault = cp.cuda.Event, cp.cuda.get_elapsed_time, cp.cuda.runtime.CUDARuntimeError


class Span:
    """What `DeviceTimer.span` yields: `end`, the span's end event (a cupy.cuda.Event) once the
    block has exited."""

    end: Any = None


class DeviceTimer:
    """Event-pair timing of enqueued work into `trace` (see the module docstring). Events are
    reused, so a long generation allocates none after its first steps."""

    def __init__(self, trace: Trace, events: Any = None):
        self.trace = trace
        self.events = events if events is not None else CupyEvents()
        # (phase, step, start, end, whether the span frees its end: not when lent to the next span)
        self.pending: deque[tuple[str, bool, Any, Any, bool]] = deque()
        self.free: list = []

    def _event(self):
        return self.free.pop() if self.free else self.events.new()

    def chain_start(self, lent):
        """`lent` (an end event a span lent, or None) if the GPU has not reached it yet, else None:
        a span chained to an end the GPU has passed would count the time it waited for the host.
        An end not taken goes back to the free list once its own span has resolved (every span
        before it has finished too: one stream), so a host slower than the GPU allocates none."""
        if lent is None or not lent.done:
            return lent
        self.collect()
        if all(p[3] is not lent for p in self.pending):
            self.free.append(lent)
        return None

    @contextmanager
    def span(self, stream, step: bool = False, after=None, lend: bool = False):
        """Time the work the block enqueues on `stream` (a cupy.cuda.Stream) into the current
        phase; step=True also keeps it as one per-step sample. Yields a Span, whose end is set
        when the block exits. Nothing is recorded if the block raises.

        after: None, or the end event of the last span on `stream`, which was opened with
        lend=True, with nothing enqueued on the stream since: the span starts there (no record
        of its own) and frees that event once resolved. lend: keep this span's end event for the
        next span's `after` (`chain_start` frees an end no span takes)."""
        phase = self.trace.phase
        start = after if after is not None else self._event()
        if after is None:
            start.record(stream)
        out = Span()
        try:
            yield out
        except BaseException:
            if after is None:
                self.free.append(start)
            raise
        end = self._event()
        end.record(stream)
        out.end = end
        self.pending.append((phase, step, start, end, not lend))

    def collect(self) -> None:
        """Resolve, in order, every span whose end event has completed; stop at the first still
        running. Never blocks."""
        while self.pending:
            phase, step, start, end, free_end = self.pending[0]
            try:
                if not end.done:
                    return
                ms = self.events.elapsed(start, end)
            except self.events.fault:  # the context faulted: the caller reports that
                self.drop()
                return
            self.pending.popleft()
            self.trace.gpu(phase, ms, step)
            self.free += (start, end) if free_end else (start,)  # a lent end is the next span's start, freed with it

    def drop(self) -> None:
        """Forget unresolved spans (after a failure or an interrupted generation whose work was
        abandoned); their events are not reused."""
        self.pending.clear()
