"""The one way k4 launches a kernel: on the current CuPy stream (or `stream`), counted in a Trace.

Launching through here keeps `K4_TRACE=1` and `k4 bench` honest about kernel counts. It
allocates nothing and never synchronizes, so launches can be captured in a CUDA graph.

`pdl=True` launches with programmatic dependent launch (CUDA driver cuLaunchKernelEx with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, sm_90): the kernel may start while
the previous kernel in the stream is still running, so its launch latency and its first loads
overlap that kernel's tail. Only kernels that execute `griddepcontrol.wait` (pdl_wait in
kernels_cu/common.cuh) before touching anything an earlier kernel writes may be launched so.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from runtime.trace import Trace

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


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


def _launch_pdl(kernel, grid, block, args, shared_mem: int, stream_ptr: int) -> None:
    import cupy as cp

    values = [ctypes.c_void_p(a.data.ptr) if isinstance(a, cp.ndarray) else _C_SCALARS[a.dtype](a.item()) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attr = _LaunchAttribute(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = _LaunchConfig(_dim3(grid), _dim3(block), shared_mem, stream_ptr, ctypes.pointer(attr), 1)
    status = _cu_launch_kernel_ex()(ctypes.byref(config), kernel.kernel.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0,
           stream=None, trace: Trace | None = None, pdl: bool = False) -> None:
    """Launch `kernel` (a cupy.RawKernel) with `grid` blocks of `block` threads and `shared_mem`
    bytes of dynamic shared memory, on `stream` (a cupy.cuda.Stream) or the current stream;
    `pdl`: programmatic dependent launch (see the module docstring).

    Arguments: cupy arrays pass their device pointer, numpy scalars their value with their own
    C type (pass np.int32/np.int64/np.float32, and np.uint64(0) for a null pointer).
    Raises RuntimeError if the driver refuses a pdl launch.
    """
    import cupy as cp

    s = stream or cp.cuda.get_current_stream()
    with s:
        if pdl:
            _launch_pdl(kernel, grid, block, args, shared_mem, s.ptr)
        else:
            kernel(grid, block, args, shared_mem=shared_mem)
    if trace is not None:
        trace.launch()
