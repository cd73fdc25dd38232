"""The work of `k4 quantize` spread over worker processes: units of at most CHUNK_WEIGHTS
weights (whole rows of one tensor), encoded in output order.

Processes, not threads: the quantizers are many short numpy operations, and threads spend the
time between them waiting for the GIL (2 threads ran slower than 1; docs/PERF.md, session 7).
Each worker maps the input file itself and reads its rows from the page cache; only the
encoded rows come back through the pipe (0.56 bytes per weight for Q4_K).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from . import kquants
from .errors import ModelFileError
from .model import ModelFile

if TYPE_CHECKING:
    from .quantize import QuantPlan

CHUNK_WEIGHTS = 1 << 20  # weights per unit of work and per progress step


def encode_rows(raw: np.ndarray, src: GGMLQuantizationType, dst: GGMLQuantizationType, name: str) -> np.ndarray:
    """Input rows (n, bytes) uint8 of type src -> output rows (n, bytes) uint8 of type dst."""
    x = np.asarray(dequantize(raw, src), dtype=np.float32)  # (n, n_per_row) exact for F32/F16/BF16
    if not np.isfinite(x).all():
        raise ModelFileError(f"tensor {name!r} contains NaN or infinite weights; the input model is damaged")
    return kquants.quantize(x, dst)


_MAPS: dict[str, np.memmap] = {}  # a worker process's map of the input file, made on its first chunk


def _encode_chunk(path: str, offset: int, shape: tuple[int, int], src: GGMLQuantizationType, dst: GGMLQuantizationType, name: str) -> np.ndarray:
    """A worker process's unit of work: rows of `shape` (rows, input row bytes) at byte `offset`
    of the file at `path`, encoded as encode_rows does (the input is read from the page cache,
    never sent through a pipe)."""
    mm = _MAPS.get(path)
    if mm is None:
        mm = _MAPS[path] = np.memmap(path, dtype=np.uint8, mode="r")
    return encode_rows(mm[offset : offset + shape[0] * shape[1]].reshape(shape), src, dst, name)


def _ignore_sigint() -> None:
    """Worker initializer: Ctrl-C reaches the whole process group; only the parent handles it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def chunks(plan: QuantPlan):
    """(tensor plan, first row, end row) of every unit of work, in output order (tensors kept as
    they are have none)."""
    for tp in plan.tensors:
        if tp.dst_type != tp.src_type:
            n_rows = int(np.prod(tp.shape[:-1]))
            step = max(1, CHUNK_WEIGHTS // tp.shape[-1])
            yield from ((tp, r, min(r + step, n_rows)) for r in range(0, n_rows, step))


def encoded_chunks(mf: ModelFile, plan: QuantPlan, pool: ProcessPoolExecutor | None, depth: int):
    """The encoded rows of every `chunks` unit, in order: computed here when pool is None, else
    by the pool with up to `depth` units in flight."""
    if pool is None:
        for tp, r0, r1 in chunks(plan):
            yield encode_rows(mf.tensors[tp.name].raw_bytes()[r0:r1], tp.src_type, tp.dst_type, tp.name)
        return
    path = str(Path(mf.path).resolve())
    in_flight: deque = deque()
    for tp, r0, r1 in chunks(plan):
        t = mf.tensors[tp.name]
        row_bytes = t.n_bytes // int(np.prod(tp.shape[:-1]))
        in_flight.append(pool.submit(_encode_chunk, path, t.file_offset + r0 * row_bytes, (r1 - r0, row_bytes), tp.src_type, tp.dst_type, tp.name))
        if len(in_flight) >= depth:
            yield in_flight.popleft().result()
    while in_flight:
        yield in_flight.popleft().result()


def worker_count(threads: int) -> int:
    """Worker processes for `threads` (0: one per CPU core this process may run on)."""
    if threads:
        return threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start_pool(workers: int) -> ProcessPoolExecutor | None:
    """A process pool of `workers` (None for 1: the work runs in this process). Workers come from
    a forkserver with numpy and the quantizers imported, so each starts in milliseconds and none
    inherits this process's threads."""
    if workers <= 1:
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_ignore_sigint)
