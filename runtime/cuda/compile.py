"""Compile kernels_cu/*.cu once per process (CuPy RawModule; CuPy also caches the binaries on
disk, so the second start is fast). A compile error names the .cu file.

Usage: `module("elementwise.cu").get_function("set_i32")`, or with template instances
`module("gemv.cu", ("gemv<4>",)).get_function("gemv<4>")`.
"""

from __future__ import annotations

from functools import lru_cache

from k4.kernels_cu import SOURCE_DIR
from k4.runtime.errors import BackendUnavailableError

OPTIONS = ("-std=c++17", f"-I{SOURCE_DIR}", "--use_fast_math")


@lru_cache(maxsize=None)
def module(filename: str, name_expressions: tuple[str, ...] | None = None, defines: tuple[str, ...] = ()):
    """The compiled cupy.RawModule for kernels_cu/`filename` (compiled on first use, once per
    set of `defines`, preprocessor definitions such as "K4_EVICT_FIRST=0").

    Raises BackendUnavailableError naming the file when CuPy or NVRTC rejects it.
    """
    import cupy as cp

    path = SOURCE_DIR / filename
    source = path.read_text()
    try:
        options = OPTIONS + tuple(f"-D{d}" for d in defines)
        mod = cp.RawModule(code=source, options=options, name_expressions=name_expressions)
        mod.compile()
    except cp.cuda.compiler.CompileException as exc:
        first = str(exc).strip().splitlines()
        detail = next((line for line in first if "error" in line), first[0] if first else "")
        raise BackendUnavailableError(f"kernels_cu/{filename} failed to compile: {detail}") from None
    return mod
