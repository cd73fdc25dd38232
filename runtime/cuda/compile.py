"""Compile kernels_cu/*.cu modules once per process (CuPy RawModule). CuPy keeps the binaries in
its on-disk cache (CUPY_CACHE_DIR, default ~/.cupy/kernel_cache), keyed by a hash of the source,
the options, the name expressions, the GPU architecture and the NVRTC version, so the second
start of a process loads instead of compiling. CuPy does not hash the headers a source
includes, so each source handed to it starts with a comment carrying the hash of every
kernels_cu/*.cuh: a changed header compiles anew instead of loading a stale binary. A compile
error names the .cu file.

A module is one file compiled with one set of template instances (name expressions) and
preprocessor defines, besides those of runtime/cuda/constants.py that every module gets. Small modules (one quantized type's instances, one attention kernel)
compile only what a model needs, and compile_async() builds several at once: NVRTC releases
the GIL, so threads compile in parallel while the weights upload.

Usage: `module("elementwise.cu").get_function("set_i32")`, or with template instances
`module("gemv.cu", ("gemv<4>",)).get_function("gemv<4>")`.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Iterable

from k4.kernels_cu import SOURCE_DIR
from k4.runtime.errors import BackendUnavailableError

from .constants import defines as shared_constants

# every module gets the numbers shared with Python (runtime/cuda/constants.py) as -D options
OPTIONS = ("-std=c++17", f"-I{SOURCE_DIR}", "--use_fast_math", *(f"-D{d}" for d in shared_constants()))

Job = tuple[str, "tuple[str, ...] | None", "tuple[str, ...]"]  # module()'s arguments

_lock = threading.Lock()
_modules: dict[Job, Future] = {}  # one future per module: a second caller waits for the first


def module(filename: str, name_expressions: tuple[str, ...] | None = None, defines: tuple[str, ...] = ()):
    """The compiled cupy.RawModule for kernels_cu/`filename` with the template instances
    `name_expressions` (None: only its extern "C" kernels) and preprocessor `defines` such as
    "K4_EVICT_FIRST=0". Compiled on first use, once per process even when several threads ask.

    Raises BackendUnavailableError naming the file when CuPy or NVRTC rejects it.
    """
    key = (filename, name_expressions, defines)
    with _lock:
        fut = _modules.get(key)
        owner = fut is None
        if owner:
            fut = _modules[key] = Future()
    if owner:
        try:
            fut.set_result(_compile(*key))
        except BaseException as exc:
            with _lock:
                del _modules[key]  # a later call tries again
            fut.set_exception(exc)
    return fut.result()


def compile_async(jobs: Iterable[Job], workers: int = 0) -> list[Future]:
    """Start compiling the modules `jobs` (module()'s arguments) on `workers` threads (0: one per
    CPU core, at most one per job); returns their futures (result: the RawModule, or the
    BackendUnavailableError of a failed compile)."""
    jobs = list(dict.fromkeys(jobs))
    if not jobs:
        return []
    pool = ThreadPoolExecutor(max_workers=min(len(jobs), workers or os.cpu_count() or 1), thread_name_prefix="k4-nvrtc")
    futures = [pool.submit(module, *job) for job in jobs]
    pool.shutdown(wait=False)
    return futures


@lru_cache(maxsize=None)
def headers_digest() -> str:
    """sha256 (hex, 16 digits) of every kernels_cu/*.cuh, in name order: part of each module's
    source text, so CuPy's cache key changes with any header."""
    h = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*.cuh")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _compile(filename: str, name_expressions: tuple[str, ...] | None, defines: tuple[str, ...]):
    import cupy as cp

    source = f"// k4 headers {headers_digest()}\n#line 1\n" + (SOURCE_DIR / filename).read_text()
    try:
        options = OPTIONS + tuple(f"-D{d}" for d in defines)
        mod = cp.RawModule(code=source, options=options, name_expressions=name_expressions)
        mod.compile()
    except cp.cuda.compiler.CompileException as exc:
        first = str(exc).strip().splitlines()
        detail = next((line for line in first if "error" in line), first[0] if first else "")
        raise BackendUnavailableError(f"kernels_cu/{filename} failed to compile: {detail}") from None
    return mod
