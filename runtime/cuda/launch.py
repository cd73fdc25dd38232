"""The one way k4 launches a kernel: on the current CuPy stream (or `stream`), counted in a Trace.

Launching through here keeps `K4_TRACE=1` and `k4 bench` honest about kernel counts. It
allocates nothing and never synchronizes, so launches can be captured in a CUDA graph.

`pdl=True` launches with programmatic dependent launch (CUDA driver cuLaunchKernelEx with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, sm_90): the kernel may start while
the previous kernel in the stream is still running, so its launch latency and its first loads
overlap that kernel's tail. Only kernels that execute `griddepcontrol.wait` (pdl_wait in
kernels_cu/device.cuh) before touching anything an earlier kernel writes may be launched so.
`cluster=N` launches thread-block clusters of N blocks along x (the cluster-dimension
attribute of the same call).

Every kernel launched here asks for one split of each multiprocessor's L1 and shared memory
(K4_CARVEOUT, use_carveout): left to the driver, each kernel gets the split its own shared memory
suggests, and consecutive kernels that differ make the multiprocessor reconfigure between them.

CUDA errors become runtime.errors.GpuError here. A launch the driver refuses names the kernel
(its C++ name, demangled), the grid, the block and the trace phase. Most faults surface later,
at whatever call next waits on the device: the backend wraps its phases in `GpuErrors`, whose
message names the phase and the last kernel (or graph) launched in this process.
"""

from __future__ import annotations

import ctypes
import math
from functools import cache

import numpy as np

from k4.runtime.errors import GpuError
from k4.runtime.trace import Trace

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
# The carveout kernels ask for with K4_CARVEOUT: percent of the most shared memory, 50 being the
# 132 KB split on sm_90 (the driver rounds up to a supported size), or what the blocks a kernel is
# sized for need where that is more (carveout_for: attn_gqa's two or three blocks of 60-110 KB,
# which at 50% would fit one). Measured on the H200 (tg128, t/s, the matrix-vector kernels alone
# asking; the driver's choice / 25 / 50 / 100): Llama 2 7B 571.9 / 583.2 / 583.1 / 525.3, Gemma 3
# 12B (whose products take 36 KB) 314.3 / 314.2 / 314.2 / 282.6 (docs/PERF.md, session 14).
SHARED_CARVEOUT = 50
SM_SHARED = 228 << 10  # bytes of shared memory a multiprocessor can give its blocks (sm_90)
CARVEOUT_DEFAULT = -1  # the driver's choice per kernel
_carveout = {"on": True, "set": {}}  # K4_CARVEOUT (use_carveout); per kernel, the carveout it has


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute (cuda.h): id, padding, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


_C_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
              np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float}


@cache
def _cu_launch_kernel_ex():
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _dim3(d: tuple[int, ...]):
    return (ctypes.c_uint * 3)(*(tuple(d) + (1, 1))[:3])


def _launch_ex(kernel, grid, block, args, shared_mem: int, stream_ptr: int, pdl: bool = True, cluster: int = 1) -> None:
    """cuLaunchKernelEx with the PDL attribute (its value: pdl) and, for cluster > 1, clusters of
    that many blocks along x; raises cupy's CUDADriverError on a refusal."""
    import cupy as cp

    values = [ctypes.c_void_p(a.data.ptr) if isinstance(a, cp.ndarray) else _C_SCALARS[a.dtype](a.item()) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attrs = (_LaunchAttribute * 2)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value[0] = int(pdl)
    attrs[1].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attrs[1].value[0:3] = [cluster, 1, 1]
    config = _LaunchConfig(_dim3(grid), _dim3(block), shared_mem, stream_ptr, attrs, 2 if cluster > 1 else 1)
    status = _cu_launch_kernel_ex()(ctypes.byref(config), kernel.kernel.ptr, params, None)
    if status != 0:
        raise cp.cuda.driver.CUDADriverError(status)


@cache
def cuda_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions CuPy raises for a failed CUDA call: CUDARuntimeError, CUDADriverError and
    cuBLAS's CUBLASError; () when CuPy is not installed."""
    try:
        import cupy as cp
        from cupy_backends.cuda.libs import cublas
    except ImportError:
        return ()
    return (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError, cublas.CUBLASError)


@cache
def _demangler():
    """libstdc++'s __cxa_demangle (Itanium C++ ABI) and libc's free, or None where absent."""
    try:
        cxx, libc = ctypes.CDLL("libstdc++.so.6"), ctypes.CDLL(None)
    except OSError:
        return None
    demangle = cxx.__cxa_demangle
    demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    demangle.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return demangle, libc.free


def kernel_name(kernel) -> str:
    """The readable name of a cupy.RawKernel (or of anything with a `name`): a template
    instance's C++ name as written in kernels_cu, e.g. `rms_norm<float>` for the symbol
    `_Z8rms_normIfEvPKfS1_PT_if`; extern "C" names as they are; the symbol itself when it cannot
    be demangled."""
    name = str(getattr(kernel, "name", kernel))
    tools = _demangler() if name.startswith("_Z") else None
    if tools is None:
        return name
    demangle, free = tools
    status = ctypes.c_int()
    ptr = demangle(name.encode(), None, None, ctypes.byref(status))
    if not ptr:
        return name
    try:
        full = ctypes.string_at(ptr).decode()  # e.g. "void rms_norm<float>(float const*, ...)"
    finally:
        free(ptr)
    return full.split("(", 1)[0].removeprefix("void ")


class _LastLaunch:
    """The kernel object (or graph name) most recently launched in this process, named only when
    an error message needs it, so a launch costs one assignment."""

    what: object = None


_last = _LastLaunch()

REFUSED_ADVICE = "use --backend numpy, and report this line as a k4 bug"
FAULT_ADVICE = "the GPU state is unknown: run again, or use --backend numpy; report this line if it repeats"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def last_launched() -> str:
    """What was launched last through this module: "kernel rms_norm<float>", "the decode graph
    (125 kernels)", or "" before any launch."""
    what = _last.what
    return "" if what is None else what if isinstance(what, str) else f"kernel {kernel_name(what)}"


def device_limits() -> tuple[int, int]:
    """(multiprocessors, L2 bytes) of the current device."""
    import cupy as cp

    attrs = cp.cuda.Device().attributes
    return attrs["MultiProcessorCount"], attrs["L2CacheSize"]


def blocks_per_sm(kernel, threads: int, smem: int) -> int:
    """Resident blocks per multiprocessor (sm_90: 2048 threads, 64K registers allocated per warp
    in units of 256, 228 KB shared memory with 1 KB reserved per block)."""
    regs = max(1, -(-kernel.num_regs // 8) * 8)
    return max(1, min(2048 // threads, 65536 // (regs * threads), SM_SHARED // (smem + (1 << 10))))


def allow_shared(kernel, smem: int) -> None:
    """Let kernel launch with smem bytes of dynamic shared memory: its limit raised past the
    default 48 KB where smem needs it, never lowered (weights and layers of other sizes share a
    compiled kernel, and a lower limit would fail their launches)."""
    if smem > 48 << 10 and kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem


def null_or(a):
    """A kernel's pointer argument: the array a, or a null pointer for None."""
    return np.uint64(0) if a is None else a


def capturing(stream) -> bool:
    """Whether `stream` (None: the current CuPy stream) is being captured into a CUDA graph."""
    import cupy as cp

    return (stream or cp.cuda.get_current_stream()).is_capturing()


def use_carveout(on: bool) -> None:
    """Kernels launched from now on ask for carveout_for's split (on; K4_CARVEOUT, set by
    CudaBackend from its Flags) or leave it to the driver (off). A process-wide setting: it is a
    property of each kernel, which every backend in the process shares."""
    _carveout["on"] = on


@cache
def carveout_for(kernel, threads: int, smem: int, on: bool = True, per_sm: int | None = None) -> int:
    """The carveout (percent) a launch of `kernel` with blocks of `threads` threads and `smem`
    bytes of dynamic shared memory asks for: SHARED_CARVEOUT, or more where the blocks per
    multiprocessor its grid is sized for (per_sm, default blocks_per_sm) need more;
    CARVEOUT_DEFAULT when off."""
    if not on:
        return CARVEOUT_DEFAULT
    need = (per_sm or blocks_per_sm(kernel, threads, smem)) * (smem + (1 << 10))
    return max(SHARED_CARVEOUT, min(100, -(-100 * need // SM_SHARED)))


def _ask_carveout(kernel, block: tuple[int, ...], smem: int, per_sm: int | None = None) -> None:
    want = carveout_for(kernel, math.prod(block), smem, _carveout["on"], per_sm)  # math.prod: this runs at every launch
    if _carveout["set"].get(kernel) != want:
        kernel.preferred_shared_memory_carveout = want
        _carveout["set"][kernel] = want


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0,
           stream=None, trace: Trace | None = None, pdl: bool = False, per_sm: int | None = None, cluster: int = 1) -> None:
    """Launch `kernel` (a cupy.RawKernel) with `grid` blocks of `block` threads and `shared_mem`
    bytes of dynamic shared memory, on `stream` (a cupy.cuda.Stream) or the current stream;
    `pdl`: programmatic dependent launch (see the module docstring); per_sm: the blocks a
    multiprocessor runs at once that its shared-memory carveout is asked for (carveout_for;
    default as many as fit); cluster: blocks per thread-block cluster along x (1: none; grid[0]
    a multiple of it).

    Arguments: cupy arrays pass their device pointer, numpy scalars their value with their own
    C type (pass np.int32/np.int64/np.float32, and np.uint64(0) for a null pointer).
    Raises GpuError naming the kernel, grid, block and trace phase when CUDA refuses the launch.
    """
    _last.what = kernel
    try:
        _ask_carveout(kernel, block, shared_mem, per_sm)
        if pdl or cluster > 1:
            if stream is None:
                import cupy as cp

                stream = cp.cuda.get_current_stream()
            _launch_ex(kernel, grid, block, args, shared_mem, stream.ptr, pdl, cluster)
        elif stream is None:  # on the current stream: no context switch (prefill is launch-bound)
            kernel(grid, block, args, shared_mem=shared_mem)
        else:
            with stream:
                kernel(grid, block, args, shared_mem=shared_mem)
    except cuda_error_types() as exc:
        during = f" during {trace.phase}" if trace is not None else ""
        raise GpuError(f"CUDA refused to launch kernel {kernel_name(kernel)} (grid {tuple(grid)}, block {tuple(block)}, "
                       f"{shared_mem} bytes shared){during}: {_one_line(exc)}; {REFUSED_ADVICE}") from None
    if trace is not None:
        trace.launch()


def launch_graph(graph, stream, trace: Trace, n_kernels: int, name: str = "decode graph") -> None:
    """Replay `graph` (a cupy.cuda.Graph) on `stream`, counted in `trace` as one replay and
    `n_kernels` launches; `name` is what error messages call it. Raises GpuError."""
    _last.what = f"the {name} ({n_kernels} kernels)"
    try:
        graph.launch(stream=stream)
    except cuda_error_types() as exc:
        raise GpuError(f"CUDA refused to replay the {name} during {trace.phase}: {_one_line(exc)}; {FAULT_ADVICE}") from None
    trace.graph_replay()
    trace.launch(n_kernels)


class GpuErrors:
    """A reusable context manager (one per backend, no allocation per use): inside it, a CUDA
    error (cuda_error_types) that surfaces anywhere, typically at a synchronization, a copy or an
    allocation after an asynchronous fault, becomes a GpuError naming `trace.phase` as it is
    when the error is raised, and the last kernel launched. Errors at a launch are GpuErrors
    already and pass through, as does everything else."""

    __slots__ = ("trace",)

    def __init__(self, trace: Trace):
        self.trace = trace

    def __enter__(self) -> GpuErrors:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is None or not issubclass(kind, cuda_error_types()):
            return False
        last = last_launched()
        after = f"after {last} was launched" if last else "before any kernel was launched"
        raise GpuError(f"CUDA error during {self.trace.phase}, {after}: {_one_line(exc)}; {FAULT_ADVICE}") from None
