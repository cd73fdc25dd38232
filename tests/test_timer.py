"""DeviceTimer's bookkeeping (runtime/cuda/timer.py) with fake events, no GPU: chained spans record
one event each, an event is never handed out again while a pending span still reads it, a span
chained to an end the GPU has passed starts afresh, and spans resolve in order into the trace."""

from __future__ import annotations

import pytest

from k4.runtime.cuda.timer import DeviceTimer
from k4.runtime.trace import Trace


class FakeEvent:
    """An event whose record() takes the stream's clock; `done` once the fake GPU has passed its
    latest record."""

    def __init__(self, gpu: "FakeGpu"):
        self.gpu, self.at, self.seq = gpu, None, None

    def record(self, stream) -> None:
        assert stream is self.gpu.stream
        self.seq, self.at = len(self.gpu.records), self.gpu.clock
        self.gpu.records.append(self)

    @property
    def done(self) -> bool:
        return self.seq is not None and self.seq < self.gpu.passed


class FakeGpu:
    """The event API DeviceTimer takes (new, elapsed, fault) over a clock the test advances."""

    fault = RuntimeError

    def __init__(self):
        self.stream, self.clock, self.records, self.made, self.passed = object(), 0.0, [], 0, 0

    def new(self) -> FakeEvent:
        self.made += 1
        return FakeEvent(self)

    def elapsed(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.done and end.done
        return end.at - start.at

    def run(self, ms: float = 0.0, but_last: bool = False) -> None:
        """The GPU works ms and passes every record so far (but_last: all but the latest)."""
        self.clock += ms
        self.passed = len(self.records) - (1 if but_last else 0)


def chained_steps(timer: DeviceTimer, gpu: FakeGpu, n: int, busy: bool) -> list:
    """A prefill span, then n decode steps chained as the CUDA backend's ping-pong loop chains them
    (each 2 ms of GPU work; busy: the host enqueues each step before the GPU finished the one
    before, else after); collect() runs after every step, as there. Returns the lent ends."""
    trace = timer.trace
    with trace.in_phase("prefill"):
        with timer.span(gpu.stream, step=True, lend=True) as span:
            gpu.clock += 5.0
    lent, ends = span.end, []
    with trace.in_phase("decode"):
        for _ in range(n):
            if not busy:
                gpu.run()
            with timer.span(gpu.stream, step=True, after=timer.chain_start(lent), lend=True) as span:
                gpu.clock += 2.0
            ends.append(span.end)
            lent = span.end
            gpu.run(but_last=busy)  # busy: the GPU reaches the step before's end only now
            timer.collect()
    gpu.run()
    timer.collect()
    return ends


def test_chained_steps_record_one_event_each_and_time_every_step():
    gpu = FakeGpu()
    timer = DeviceTimer(Trace(), gpu)
    chained_steps(timer, gpu, 6, busy=True)
    assert len(gpu.records) == 2 + 6  # the prefill's start and end, then one end a step
    assert timer.trace.gpu_steps["prefill"] == [5.0]
    assert timer.trace.gpu_steps["decode"] == [2.0] * 6
    assert not timer.pending


def test_an_end_the_gpu_passed_is_not_a_start():
    """The host was late (the GPU idle before each step): every step records its own start, so the
    idle time is not counted."""
    gpu = FakeGpu()
    timer = DeviceTimer(Trace(), gpu)
    gpu_idle = 100.0

    def late(*_):
        gpu.clock += gpu_idle

    trace = timer.trace
    with trace.in_phase("decode"):
        lent = None
        for _ in range(4):
            gpu.run()
            late()
            with timer.span(gpu.stream, step=True, after=timer.chain_start(lent), lend=True) as span:
                gpu.clock += 2.0
            lent = span.end
            gpu.run()
            timer.collect()
    assert trace.gpu_steps["decode"] == [2.0] * 4
    assert len(gpu.records) == 8
    assert gpu.made <= 3  # the ends no span took were reused


def test_no_event_is_reused_while_a_pending_span_reads_it():
    """Events go back to the free list only once no unresolved span holds them: a lent end stays
    out of it until the span that started there resolves."""
    gpu = FakeGpu()
    timer = DeviceTimer(Trace(), gpu)
    for busy in (True, False, True):
        chained_steps(timer, gpu, 5, busy)
        held = {id(e) for p in timer.pending for e in p[2:4]}
        assert not held & {id(e) for e in timer.free}
        assert len({id(e) for e in timer.free}) == len(timer.free)
    assert timer.trace.gpu_steps["decode"] == [2.0] * 15
    assert gpu.made < 2 * 18  # events are reused


def test_a_span_that_raises_records_nothing_and_keeps_the_lent_end_out():
    gpu = FakeGpu()
    timer = DeviceTimer(Trace(), gpu)
    with timer.span(gpu.stream, step=True, lend=True) as first:
        gpu.clock += 1.0
    with pytest.raises(KeyError):
        with timer.span(gpu.stream, step=True, after=first.end, lend=True):
            raise KeyError("enqueue failed")
    gpu.run()
    timer.collect()
    assert timer.trace.gpu_steps[timer.trace.phase] == [1.0]
    assert first.end not in timer.free
