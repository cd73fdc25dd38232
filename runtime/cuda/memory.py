"""Device memory of the CUDA backend: counted allocations, counted host<->device copies, pinned
staging (the threaded weight uploader, small per-call uploads, the 4-byte token readback), and
the up-front check that a model fits in free GPU memory.

Every allocation and copy here is recorded in a runtime.trace.Trace; nothing else in the CUDA
backend allocates device memory or copies between host and device.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import cupy as cp
import numpy as np

from ..errors import BackendUnavailableError, ModelFileError
from ..trace import Trace

GiB = 1 << 30
MiB = 1 << 20
STAGING_BYTES = 16 * MiB  # the largest piece of a weight upload (the size of each pinned staging buffer)
READ_THREADS = max(1, min(8, os.cpu_count() or 1))  # threads reading the model file during the upload
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

    def release(self, a: cp.ndarray, kind: str) -> None:
        """Stop counting `a` (allocated by empty/zeros as `kind`); the caller drops its last reference."""
        self.bytes[kind] -= a.nbytes

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


class _Slot:
    """One pinned staging buffer and the piece being read into it (see Uploader)."""

    def __init__(self, nbytes: int):
        self.buf = PinnedBuffer(nbytes)
        self.future: Future | None = None
        self.dst_ptr, self.nbytes, self.then = 0, 0, None


def _pread_into(fd: int, view: np.ndarray, offset: int) -> None:
    """Fill uint8 `view` with the file's bytes from `offset` (os.preadv: the kernel copies from
    the page cache straight into the buffer, no page faults on a memory map, GIL released).
    Raises ModelFileError if the file ends first."""
    mv, done = memoryview(view), 0
    while done < view.nbytes:
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise ModelFileError("the model file ended while its weights were being read; it was truncated or changed during the load")
        done += n


class Uploader:
    """Weight upload, a pipeline: `threads` threads read pieces of at most STAGING_BYTES (from the
    model file with preadv, or from host arrays) into a ring of pinned staging buffers, while the
    main thread moves finished pieces to the device on `stream`, in the order they were asked
    for. A buffer is refilled only after the device has read it (its event).

    `then`, given with a tensor's last piece, runs on the main thread right after that piece's
    copy is enqueued, so what it enqueues on `stream` (a layout change on the device) follows
    every piece of the tensor. With pinned=False (K4_PINNED_UPLOAD=0) each piece is read on the
    main thread and copied from pageable memory on `stream`. `progress(done_bytes, total_bytes)`
    is called after each piece. Nothing is on the device for certain until finish(); call
    close() on every path (it stops the readers).

    After finish(): read_ms, the time spent filling staging buffers (reading the file or
    copying host arrays), summed over the readers; copy_ms, the copy stream's span from the
    first copy to the last (CUDA events; it includes what `then` enqueued and any wait for data).
    """

    def __init__(self, trace: Trace, stream: cp.cuda.Stream, total: int, pinned: bool,
                 progress: Callable[[int, int], None] | None = None, threads: int = READ_THREADS):
        self.trace, self.stream, self.total, self.pinned, self.progress = trace, stream, total, pinned, progress
        self.done = 0
        self.piece = max(1 << 20, min(STAGING_BYTES, -(-max(total, 1) // threads)))
        self.slots = [_Slot(self.piece) for _ in range(threads + 2)] if pinned else []
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="k4-read") if pinned else None
        self.turn = 0
        self.fds: dict[str, int] = {}
        self.read_ms = self.copy_ms = 0.0
        self.first_copy: cp.cuda.Event | None = None

    def upload(self, dst_ptr: int, src: np.ndarray, then: Callable[[], None] | None = None) -> None:
        """Copy host `src` (any dtype; its bytes in C order) to device address `dst_ptr`. `src`
        must not change until finish()."""
        data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)  # (nbytes,)
        self._pieces(dst_ptr, data.nbytes, lambda view, at: np.copyto(view, data[at : at + view.nbytes]), then)

    def upload_file(self, dst_ptr: int, path: os.PathLike, offset: int, nbytes: int,
                    then: Callable[[], None] | None = None) -> None:
        """Copy `nbytes` of the file at byte `offset` to device address `dst_ptr`."""
        key = os.fspath(path)
        if key not in self.fds:
            self.fds[key] = os.open(key, os.O_RDONLY)
        fd = self.fds[key]
        self._pieces(dst_ptr, nbytes, lambda view, at: _pread_into(fd, view, offset + at), then)

    def _pieces(self, dst_ptr: int, nbytes: int, fill: Callable[[np.ndarray, int], None], then) -> None:
        starts = range(0, nbytes, self.piece)
        for start in starts:
            n = min(self.piece, nbytes - start)
            last = start == starts[-1]
            if not self.pinned:
                host = np.empty(n, np.uint8)
                self.read_ms += 1e3 * self._fill(None, fill, host, start)
                self._mark_first()
                cp.cuda.runtime.memcpyAsync(dst_ptr + start, host.ctypes.data, n, H2D, self.stream.ptr)  # staged before it returns
                self.trace.h2d(n)
                self._advance(n)
                if last and then:
                    then()
                continue
            slot = self.slots[self.turn]
            self.turn = (self.turn + 1) % len(self.slots)
            self._drain(slot)
            slot.dst_ptr, slot.nbytes, slot.then = dst_ptr + start, n, then if last else None
            slot.future = self.pool.submit(self._fill, slot.buf, fill, slot.buf.host[:n], start)

    @staticmethod
    def _fill(buf: PinnedBuffer | None, fill, view: np.ndarray, at: int) -> float:
        """Fill `view` (the first bytes of buf) once buf's previous piece has reached the
        device; returns the seconds the filling took."""
        if buf is not None:
            buf.wait()
        t0 = time.perf_counter()
        fill(view, at)
        return time.perf_counter() - t0

    def _mark_first(self) -> None:
        if self.first_copy is None:
            self.first_copy = cp.cuda.Event()
            self.first_copy.record(self.stream)

    def _drain(self, slot: _Slot) -> None:
        """Finish the slot's read (re-raising its error) and enqueue its copy, then its `then`."""
        if slot.future is None:
            return
        future, slot.future = slot.future, None
        self.read_ms += 1e3 * future.result()
        self._mark_first()
        h2d(self.trace, slot.dst_ptr, slot.buf, 0, slot.nbytes, self.stream)
        self._advance(slot.nbytes)
        if slot.then:
            slot.then()

    def _advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress:
            self.progress(min(self.done, self.total), self.total)

    def finish(self) -> None:
        """Enqueue the pieces still in the ring, wait for every transfer (one counted stream
        sync), and release the readers and staging buffers."""
        for k in range(len(self.slots)):
            self._drain(self.slots[(self.turn + k) % len(self.slots)])
        last = cp.cuda.Event()
        last.record(self.stream)
        self.stream.synchronize()
        self.trace.sync()
        if self.first_copy is not None:
            self.copy_ms = cp.cuda.get_elapsed_time(self.first_copy, last)
        self.close()

    def close(self) -> None:
        """Stop the readers (those running finish their piece) and close the files. Idempotent."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
