"""Device memory of the CUDA backend: counted allocations, counted host<->device copies, pinned
staging (the ping-pong weight uploader, small per-call uploads, the 4-byte token readback), and
the up-front check that a model fits in free GPU memory.

Every allocation and copy here is recorded in a runtime.trace.Trace; nothing else in the CUDA
backend allocates device memory or copies between host and device.
"""

from __future__ import annotations

from typing import Callable

import cupy as cp
import numpy as np

from ..errors import BackendUnavailableError
from ..trace import Trace

GiB = 1 << 30
MiB = 1 << 20
STAGING_BYTES = 64 * MiB  # each of the two pinned upload buffers
RESERVED_BYTES = 512 * MiB  # left free for the CUDA context, library workspaces and graphs

H2D = cp.cuda.runtime.memcpyHostToDevice
D2H = cp.cuda.runtime.memcpyDeviceToHost


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


class DeviceMemory:
    """Allocates device arrays through CuPy's pool, recording each in `trace` and summing bytes
    by kind ("weights", "kv_cache", "scratch", "prefill_f16": the fp16 weight copy) for memory_report().

    Raises BackendUnavailableError when the GPU runs out of memory.
    """

    def __init__(self, trace: Trace):
        self.trace = trace
        self.bytes = {"weights": 0, "kv_cache": 0, "scratch": 0, "prefill_f16": 0}

    def empty(self, shape, dtype, kind: str) -> cp.ndarray:
        try:
            a = cp.empty(shape, dtype=dtype)
        except cp.cuda.memory.OutOfMemoryError:
            need = int(np.prod(shape)) * np.dtype(dtype).itemsize
            raise BackendUnavailableError(
                f"out of GPU memory allocating {need / MiB:.1f} MiB of {kind}; use a smaller --ctx-size or a smaller model"
            ) from None
        self.trace.alloc(a.nbytes)
        self.bytes[kind] += a.nbytes
        return a

    def zeros(self, shape, dtype, kind: str) -> cp.ndarray:
        a = self.empty(shape, dtype, kind)
        a.fill(0)
        self.trace.launch()
        return a


def free_bytes() -> int:
    """Device memory this process can still use: the driver's free bytes plus CuPy's pool cache."""
    free, _total = cp.cuda.runtime.memGetInfo()
    return int(free) + int(cp.get_default_memory_pool().free_bytes())


def check_fits(weights: int, kv_cache: int, scratch: int, n_ctx: int, free: int) -> None:
    """Refuse a model that cannot fit, before anything is uploaded. Sizes in bytes.

    Raises BackendUnavailableError with the sizes; when only the KV cache does not fit, it names
    the largest --ctx-size that does.
    """
    rest = weights + scratch + RESERVED_BYTES
    if rest + kv_cache <= free:
        return
    if rest < free:
        max_ctx = (free - rest) * n_ctx // kv_cache
        raise BackendUnavailableError(
            f"the KV cache for --ctx-size {n_ctx} needs {gib(kv_cache)} GiB but only {gib(free - rest)} GiB of GPU memory "
            f"is left after the weights ({gib(weights)} GiB) and buffers ({gib(scratch)} GiB); use --ctx-size {max_ctx} or less"
        )
    raise BackendUnavailableError(
        f"the model needs {gib(rest + kv_cache)} GiB of GPU memory (weights {gib(weights)}, KV cache {gib(kv_cache)}, "
        f"buffers {gib(scratch)}, reserve {gib(RESERVED_BYTES)}) but {gib(free)} GiB is free; use a smaller model or free the GPU"
    )


class PinnedBuffer:
    """Page-locked host memory of `nbytes` with an event marking the end of its last copy, so the
    host refills it only once the device has read it (`wait`)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.mem = cp.cuda.alloc_pinned_memory(nbytes)
        self.host = np.frombuffer(self.mem, dtype=np.uint8, count=nbytes)  # (nbytes,) uint8
        self.event = cp.cuda.Event(block=False, disable_timing=True)
        self.recorded = False

    @property
    def ptr(self) -> int:
        return self.mem.ptr

    def view(self, dtype, count: int, offset: int = 0) -> np.ndarray:
        """A typed (count,) view at byte `offset`."""
        return self.host[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)

    def wait(self) -> None:
        """Block until the last copy from or into this buffer has finished (an event wait, not a stream sync)."""
        if self.recorded:
            self.event.synchronize()

    def mark(self, stream: cp.cuda.Stream) -> None:
        self.event.record(stream)
        self.recorded = True


def h2d(trace: Trace, dst_ptr: int, src: PinnedBuffer, offset: int, nbytes: int, stream: cp.cuda.Stream) -> None:
    """Asynchronous copy of `nbytes` from pinned `src` (at byte offset) to device address `dst_ptr`
    on `stream`; marks `src` busy until it is done."""
    cp.cuda.runtime.memcpyAsync(dst_ptr, src.ptr + offset, nbytes, H2D, stream.ptr)
    src.mark(stream)
    trace.h2d(nbytes)


def d2h_async(trace: Trace, dst: PinnedBuffer, offset: int, src_ptr: int, nbytes: int, stream: cp.cuda.Stream) -> None:
    """Asynchronous copy of `nbytes` from device address `src_ptr` into pinned `dst` at byte
    offset, on `stream`; `dst.wait()` returns once it has landed."""
    cp.cuda.runtime.memcpyAsync(dst.ptr + offset, src_ptr, nbytes, D2H, stream.ptr)
    dst.mark(stream)
    trace.d2h(nbytes)


def d2h_sync(trace: Trace, dst: np.ndarray, src: cp.ndarray, stream: cp.cuda.Stream) -> None:
    """Copy device `src` into host `dst` (same byte size, both C-contiguous) after all work on
    `stream`: synchronizes the stream (counted), then copies."""
    assert dst.nbytes == src.nbytes and dst.flags.c_contiguous and src.flags.c_contiguous
    stream.synchronize()
    trace.sync()
    cp.cuda.runtime.memcpy(dst.ctypes.data, src.data.ptr, src.nbytes, D2H)
    trace.d2h(src.nbytes)


class Uploader:
    """Weight upload: the host copies each piece of a tensor (reading the memory-mapped file) into
    one of two pinned staging buffers while the copy stream moves the other to the device.

    With pinned=False (K4_PINNED_UPLOAD=0) every tensor is copied synchronously from pageable
    memory instead. `progress(done_bytes, total_bytes)` is called after each piece.
    """

    def __init__(self, trace: Trace, stream: cp.cuda.Stream, total: int, pinned: bool,
                 progress: Callable[[int, int], None] | None = None):
        self.trace, self.stream, self.total, self.pinned, self.progress = trace, stream, total, pinned, progress
        self.done = 0
        size = min(STAGING_BYTES, max(total, 1))
        self.buffers = [PinnedBuffer(size), PinnedBuffer(size)] if pinned else []
        self.turn = 0

    def upload(self, dst: cp.ndarray, src: np.ndarray) -> None:
        """Copy host `src` (any dtype, C-contiguous, same byte size as `dst`) into device `dst`."""
        data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)  # (nbytes,)
        assert data.nbytes == dst.nbytes, (data.nbytes, dst.nbytes)
        if not self.pinned:
            cp.cuda.runtime.memcpy(dst.data.ptr, data.ctypes.data, data.nbytes, H2D)
            self.trace.h2d(data.nbytes)
            self._advance(data.nbytes)
            return
        for start in range(0, data.nbytes, self.buffers[0].nbytes):
            piece = data[start : start + self.buffers[0].nbytes]
            buf = self.buffers[self.turn]
            self.turn ^= 1
            buf.wait()
            buf.host[: piece.nbytes] = piece
            h2d(self.trace, dst.data.ptr + start, buf, 0, piece.nbytes, self.stream)
            self._advance(piece.nbytes)

    def _advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress:
            self.progress(min(self.done, self.total), self.total)

    def finish(self) -> None:
        """Wait for the last transfers (one counted stream sync) and release the staging buffers."""
        self.stream.synchronize()
        self.trace.sync()
        self.buffers = []
