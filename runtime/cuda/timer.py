"""Device time per phase from CUDA events, read without synchronizing.

`DeviceTimer.span(stream)` records a timing event on the stream before and after a block of
enqueued work; the pair is resolved (cudaEventElapsedTime, ms) once the end event has completed,
which `collect()` checks with cudaEventQuery, so a decode loop never waits for it. Each resolved
span adds its milliseconds to the phase's `Counters.gpu_ms` and, for steps, one sample to
`Trace.gpu_steps[phase]` (the per-token decode latencies `k4 bench` reports as p50/p99).

An event pair measures the time between the GPU reaching the two records on that stream: the
kernels of the block plus any gaps inside it, not the host's time to enqueue it while the GPU
was busy with earlier work.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import cupy as cp

from ..trace import Trace


class DeviceTimer:
    """Event-pair timing of enqueued work into `trace` (see the module docstring). Events are
    reused, so a long generation allocates none after its first steps."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.pending: deque[tuple[str, bool, cp.cuda.Event, cp.cuda.Event]] = deque()
        self.free: list[cp.cuda.Event] = []

    def _event(self) -> cp.cuda.Event:
        return self.free.pop() if self.free else cp.cuda.Event()

    @contextmanager
    def span(self, stream: cp.cuda.Stream, step: bool = False):
        """Time the work the block enqueues on `stream` into the current phase; step=True also
        keeps it as one per-step sample. Nothing is recorded if the block raises."""
        phase = self.trace.phase
        start = self._event()
        start.record(stream)
        try:
            yield
        except BaseException:
            self.free.append(start)
            raise
        end = self._event()
        end.record(stream)
        self.pending.append((phase, step, start, end))

    def collect(self) -> None:
        """Resolve, in order, every span whose end event has completed; stop at the first still
        running. Never blocks."""
        while self.pending:
            phase, step, start, end = self.pending[0]
            try:
                if not end.done:
                    return
                ms = cp.cuda.get_elapsed_time(start, end)
            except cp.cuda.runtime.CUDARuntimeError:  # the context faulted: the caller reports that
                self.drop()
                return
            self.pending.popleft()
            self.trace.gpu(phase, ms, step)
            self.free += (start, end)

    def drop(self) -> None:
        """Forget unresolved spans (after a failure or an interrupted generation whose work was
        abandoned); their events are not reused."""
        self.pending.clear()
