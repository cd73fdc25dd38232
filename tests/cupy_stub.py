"""A stand-in for CuPy on a machine without a GPU, so that the CUDA backend's Python runs end to
end on the CPU and tests/dry_run.py can check every kernel launch it makes.

What it does instead of the GPU's work:
- device arrays are numpy arrays (the class `ndarray`) whose `.data.ptr` is their host address,
  filled with zeros where CuPy would leave them uninitialized;
- copies between addresses (memcpy, memcpyAsync, memsetAsync) are memmove/memset on the host, so
  what the backend reads back is what it wrote, or zeros;
- streams, events and graphs order nothing; a graph's replay is recorded, not run;
- RawModule compiles nothing; its kernels (RawKernel) record each launch in LAUNCHES as a
  Launch (the kernel with its module's source, options and name expressions, grid, block, the
  arguments as passed, shared memory, stream, programmatic dependent launch, cluster, and the
  dynamic shared memory the kernel was allowed at the time: 48 KB unless raised), and so
  does runtime/cuda/launch.py's driver path once install() has patched it (patch_launch);
- cuBLAS calls are recorded as ("cublas", name).

The kernels' outputs stay zero, so generated tokens are id 0 and logits zeros: what the stub
checks is the host side (which kernels launch, with which arguments), never numbers.

install() puts the stub into sys.modules as `cupy` (and cupy_backends' cuBLAS). It must run
before anything imports k4.runtime.cuda, in a process of its own (tests/dry_run.py runs as one).
"""

from __future__ import annotations

import ctypes
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from tests import kernel_params

SM_COUNT = 132  # what Device().attributes reports: an H200's
L2_BYTES = 60 << 20
SMEM_OPTIN = kernel_params.SMEM_OPTIN  # MaxSharedMemoryPerBlockOptin on sm_90


@dataclass
class Launch:
    """One kernel launch as the stub saw it."""

    kernel: RawKernel
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int
    stream: int  # the stream's ptr (0: the legacy default stream)
    pdl: bool
    cluster: int
    smem_limit: int  # the kernel's max_dynamic_shared_size_bytes when it was launched


LAUNCHES: list = []  # Launch, or (what, details) tuples for graphs, captures and cuBLAS calls
# What CUDA refuses while a stream is being captured into a graph, done during a capture: a
# device allocation (CuPy's pool may call cudaMalloc), a synchronization, a synchronous copy.
# Each entry names the call and the k4 source line that made it.
CAPTURE_VIOLATIONS: list[str] = []
_capturing: list = []  # the streams being captured


def reset() -> None:
    """Forget what was recorded (LAUNCHES, CAPTURE_VIOLATIONS)."""
    LAUNCHES.clear()
    CAPTURE_VIOLATIONS.clear()


def _during_capture(what: str) -> None:
    if not _capturing:
        return
    import traceback

    here = [f for f in traceback.extract_stack()[:-2] if "/tests/" not in f.filename.replace("\\", "/")]
    where = f"{Path(here[-1].filename).name}:{here[-1].lineno}" if here else "?"
    CAPTURE_VIOLATIONS.append(f"{what} during a graph capture ({where})")


class _Mem:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray(np.ndarray):
    """A device array: a numpy array with CuPy's `.data.ptr`, `.get()` and `.set()`."""

    @property
    def data(self):  # CuPy: a MemoryPointer; its ptr is what kernels receive
        return _Mem(self.__array_interface__["data"][0])

    def get(self, stream=None, order="C", out=None):
        host = np.array(self, copy=True, order=order).view(np.ndarray)
        if out is None:
            return host
        out[...] = host
        return out

    def set(self, arr, stream=None):
        self[...] = arr


def _device(a) -> ndarray:
    return a.view(ndarray) if isinstance(a, np.ndarray) else a


def asarray(a, dtype=None, order=None) -> ndarray:
    _during_capture("cupy.asarray (a device allocation)")
    base = a.view(np.ndarray) if isinstance(a, ndarray) else a
    return np.array(base, dtype=dtype, copy=True, order="C" if order is None else order).view(ndarray)


def empty(shape, dtype=np.float32, order="C") -> ndarray:
    _during_capture("cupy.empty (a device allocation)")
    return np.zeros(shape, dtype, order).view(ndarray)


def empty_like(a, dtype=None, order="K", shape=None) -> ndarray:
    _during_capture("cupy.empty_like (a device allocation)")
    return np.zeros_like(a, dtype=dtype, shape=shape).view(ndarray)


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int = 0):
        super().__init__(f"cudaError {status}")
        self.status = status


class CUDADriverError(RuntimeError):
    def __init__(self, status: int = 0):
        super().__init__(f"CUDA_ERROR {status}")
        self.status = status


class CompileException(Exception):
    pass


class OutOfMemoryError(MemoryError):
    pass


class Graph:
    def __init__(self, n_kernels: int):
        self.n_kernels = n_kernels

    def launch(self, stream=None):
        LAUNCHES.append(("graph", self.n_kernels))

    def upload(self, stream=None):
        pass


class Stream:
    _next_ptr = 0x1000

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority=None):
        Stream._next_ptr += 0x10
        self.ptr = 0 if null else Stream._next_ptr
        self._capture_start: int | None = None

    def __enter__(self):
        _current.append(self)
        return self

    def __exit__(self, *exc):
        _current.pop()

    def use(self):
        _current[0] = self
        return self

    def synchronize(self):
        _during_capture("Stream.synchronize")

    def record(self, event=None):
        return event if event is not None else Event()

    def wait_event(self, event):
        pass

    def begin_capture(self, mode=None):
        self._capture_start = len(LAUNCHES)
        _capturing.append(self)
        LAUNCHES.append(("begin_capture", self.ptr))

    def end_capture(self) -> Graph:
        n = sum(isinstance(x, Launch) for x in LAUNCHES[self._capture_start:])
        self._capture_start = None
        _capturing.remove(self)
        LAUNCHES.append(("end_capture", self.ptr))
        return Graph(n)

    def is_capturing(self) -> bool:
        return self._capture_start is not None

    def done(self) -> bool:
        return True


_current = [Stream(null=True)]


def get_current_stream(device_id=None) -> Stream:
    return _current[-1]


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.ptr, self.done = 1, True

    def record(self, stream=None):
        pass

    def synchronize(self):
        _during_capture("Event.synchronize")

    def query(self) -> bool:
        _during_capture("Event.query")
        return True


class Device:
    attributes: ClassVar[dict] = {"MultiProcessorCount": SM_COUNT, "L2CacheSize": L2_BYTES,
                                  "MaxSharedMemoryPerBlockOptin": SMEM_OPTIN, "MaxSharedMemoryPerMultiprocessor": 228 << 10}

    def __init__(self, device_id: int = 0):
        self.id = device_id
        self.compute_capability = "90"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def use(self):
        pass

    def synchronize(self):
        _during_capture("Device.synchronize")


def alloc_pinned_memory(nbytes: int):
    """Host memory with CuPy's PinnedMemoryPointer's `ptr`, usable by np.frombuffer."""
    buf = (ctypes.c_uint8 * max(1, nbytes))()
    buf.ptr = ctypes.addressof(buf)
    return buf


def _memcpy(dst: int, src: int, nbytes: int, kind=None, stream=None) -> None:
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


def _memcpy_sync(dst: int, src: int, nbytes: int, kind=None) -> None:
    _during_capture("runtime.memcpy (synchronous)")
    _memcpy(dst, src, nbytes)


def _memset(ptr: int, value: int, nbytes: int, stream=None) -> None:
    if nbytes:
        ctypes.memset(ptr, value, nbytes)


class RawKernel:
    """A kernel of a RawModule: `name` as asked for; launching it records a Launch."""

    def __init__(self, module: RawModule, name: str):
        self.module, self.name = module, name
        self.num_regs = 64
        self.max_dynamic_shared_size_bytes = 48 << 10
        self.preferred_shared_memory_carveout = -1
        self.kernel = types.SimpleNamespace(ptr=id(self))

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        record(self, grid, block, args, shared_mem, (stream or get_current_stream()).ptr, False, 1)


class RawModule:
    """A module that compiles nothing. get_function refuses a template instance that is not
    among the name expressions, as CuPy does."""

    def __init__(self, code: str | None = None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, log_stream=None, jitify=False):
        self.code, self.options, self.name_expressions = code or "", tuple(options), tuple(name_expressions or ())
        self._kernels: dict = {}

    def compile(self, log_stream=None):
        pass

    def get_function(self, name: str) -> RawKernel:
        if "<" in name and name not in self.name_expressions:
            raise CompileException(f"{name} is not among the module's name expressions")
        return self._kernels.setdefault(name, RawKernel(self, name))


def record(kernel, grid, block, args, shared_mem: int, stream: int, pdl: bool, cluster: int) -> None:
    LAUNCHES.append(Launch(kernel, tuple(grid), tuple(block), tuple(args), int(shared_mem), stream, bool(pdl), int(cluster),
                           int(kernel.max_dynamic_shared_size_bytes)))


def _numpy_function(name: str):
    fn = getattr(np, name)
    if callable(fn) and not isinstance(fn, type):
        return lambda *a, **k: _device(fn(*a, **k))
    return fn


class _RandomState:
    """cupy.random.RandomState: numpy's generator whose arrays are device arrays; randint gives
    zeros (the microbenchmarks' buffers: no kernel reads their values here)."""

    def __init__(self, seed=None):
        self._rs = np.random.RandomState(seed)

    def randint(self, low, high=None, size=None, dtype=np.int64):
        return empty(() if size is None else size, dtype)

    def __getattr__(self, name):
        fn = getattr(self._rs, name)
        return lambda *a, **k: _device(np.asarray(fn(*a, **k)))


def _module() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    cp.__version__ = "0.0-stub"
    cp.ndarray, cp.asarray, cp.array = ndarray, asarray, asarray
    cp.empty = cp.zeros = empty
    cp.empty_like = cp.zeros_like = empty_like
    cp.asnumpy = lambda a, stream=None: np.array(a, copy=True).view(np.ndarray)
    cp.RawModule, cp.RawKernel = RawModule, RawKernel
    pool = types.SimpleNamespace(free_all_blocks=lambda: None, used_bytes=lambda: 0, total_bytes=lambda: 0, free_bytes=lambda: 0,
                                 set_limit=lambda **kw: None)
    cp.get_default_memory_pool = cp.get_default_pinned_memory_pool = lambda: pool
    cp.random = types.SimpleNamespace(RandomState=_RandomState)
    cp.__getattr__ = _numpy_function  # dtypes and array functions: numpy's
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream, cuda.Event, cuda.Device, cuda.Graph = Stream, Event, Device, Graph
    cuda.get_current_stream, cuda.alloc_pinned_memory = get_current_stream, alloc_pinned_memory
    cuda.get_elapsed_time = lambda start, end: 1.0
    cuda.runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, getDeviceCount=lambda: 1, memcpy=_memcpy_sync, memcpyAsync=_memcpy, memsetAsync=_memset,
        memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyDeviceToDevice=3, memcpyDefault=4,
        memGetInfo=lambda: (140 << 30, 141 << 30), runtimeGetVersion=lambda: 13000, driverGetVersion=lambda: 13000,
        deviceSynchronize=lambda: _during_capture("deviceSynchronize"), getDevice=lambda: 0,
        getDeviceProperties=lambda i: {"name": b"cupy_stub", "totalGlobalMem": 141 << 30, "multiProcessorCount": SM_COUNT,
                                       "major": 9, "minor": 0, "l2CacheSize": L2_BYTES},
        CUDA_R_32F=0, CUDA_R_16F=2, CUDA_R_8I=3, CUDA_R_32I=10, CUDA_R_16BF=14)
    cuda.driver = types.SimpleNamespace(CUDADriverError=CUDADriverError)
    cuda.compiler = types.SimpleNamespace(CompileException=CompileException)
    cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
    cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 1, Device=Device)
    cp.cuda = cuda
    return cp


def _cublas() -> types.ModuleType:
    cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
    cublas.CUBLASError = type("CUBLASError", (RuntimeError,), {})
    for i, name in enumerate(("CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_COMPUTE_32F", "CUBLAS_COMPUTE_32F_FAST_16F",
                              "CUBLAS_COMPUTE_16F", "CUBLAS_GEMM_DEFAULT", "CUBLAS_GEMM_DEFAULT_TENSOR_OP")):
        setattr(cublas, name, i)
    cublas.setStream = lambda handle, stream: None
    cublas.gemmEx = lambda *args: LAUNCHES.append(("cublas", "gemmEx"))
    return cublas


def install() -> None:
    """Make `import cupy` (and cupy_backends' cuBLAS) give the stub in this process."""
    if "k4.runtime.cuda.launch" in sys.modules:
        raise RuntimeError("install the CuPy stub before anything imports k4.runtime.cuda")
    cp = _module()
    sys.modules["cupy"], sys.modules["cupy.cuda"] = cp, cp.cuda
    cublas = _cublas()
    for name in ("cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.libs"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["cupy_backends.cuda.libs"].cublas = cublas
    sys.modules["cupy_backends.cuda.libs.cublas"] = cublas


class _CublasFunction:
    """A function of the stub's libcublas: ctypes' argtypes and restype settable, every call
    returns 0 (CUBLAS_STATUS_SUCCESS) and is recorded as ("cublas", name)."""

    def __init__(self, name: str):
        self.name, self.argtypes, self.restype = name, None, None

    def __call__(self, *args):
        LAUNCHES.append(("cublas", self.name))
        return 0


class _CublasLibrary:
    """What runtime/cuda/blas.py loads as libcublas.so.N (ctypes.CDLL): any function, a stub."""

    def __getattr__(self, name: str) -> _CublasFunction:
        fn = _CublasFunction(name)
        setattr(self, name, fn)
        return fn


def patch_launch() -> None:
    """Route runtime/cuda/launch.py's driver path (cuLaunchKernelEx: programmatic dependent launch,
    clusters) into LAUNCHES; the plain path calls RawKernel, which records already. And give
    runtime/cuda/blas.py a libcublas whose calls are recorded, so the paths a GPU machine takes
    with k4's own cuBLAS handle (prefill chunks and verify steps captured as graphs) run here too."""
    from k4.runtime.cuda import blas, launch

    def launch_ex(kernel, grid, block, args, shared_mem, stream_ptr, pdl=True, cluster=1):
        record(kernel, grid, block, args, shared_mem, stream_ptr, pdl, cluster)

    launch._launch_ex = launch_ex
    blas._library = _CublasLibrary
