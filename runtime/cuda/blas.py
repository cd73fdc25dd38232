"""cuBLAS GEMM on a handle of k4's own, called through ctypes, so prefill products can be
captured in a CUDA graph.

CuPy's cuBLAS wrappers refuse to run while a stream is being captured (CuPy issue #6290).
cuBLAS supports capture itself if it never has to allocate. The cuBLAS documentation
("CUDA Graphs support") says to give the handle a workspace with cublasSetWorkspace, and
this module does: the workspace is a device buffer the caller owns. The scalars alpha and
beta are host pointers (CUBLAS_POINTER_MODE_HOST, the default); their values are read when
the call is enqueued or captured.

Entry points: `Blas.open(workspace)` (None when the library cannot be found), `gemm_ex`,
`close`. Library: libcublas.so.<CUDA major>, which CuPy has already loaded.
"""

from __future__ import annotations

import ctypes

import cupy as cp

from ..errors import GpuError

WORKSPACE_BYTES = 32 << 20  # what cuBLAS documents for Hopper's largest kernels

_INT, _PTR = ctypes.c_int, ctypes.c_void_p


def _library() -> ctypes.CDLL | None:
    major = cp.cuda.runtime.runtimeGetVersion() // 1000
    cp.cuda.device.get_cublas_handle()  # makes CuPy load libcublas, so the soname resolves to that copy
    try:
        return ctypes.CDLL(f"libcublas.so.{major}")
    except OSError:
        return None


class Blas:
    """One cuBLAS handle with a fixed workspace. Use from one thread. Not for CuPy's cuBLAS calls."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p, workspace: cp.ndarray):
        self.lib, self.handle, self.workspace = lib, handle, workspace
        self._gemm = lib.cublasGemmEx
        self._gemm.argtypes = [_PTR, _INT, _INT, _INT, _INT, _INT, _PTR, _PTR, _INT, _INT, _PTR, _INT, _INT, _PTR, _PTR, _INT,
                               _INT, _INT, _INT]
        self._gemm.restype = _INT
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes = [_PTR, _PTR]
        self._set_stream.restype = _INT
        self._stream = None

    @classmethod
    def open(cls, workspace: cp.ndarray) -> Blas | None:
        """A handle whose workspace is `workspace` (cupy uint8, at least WORKSPACE_BYTES), or None
        when libcublas cannot be loaded by name (then the caller keeps CuPy's path).
        Raises GpuError when cuBLAS refuses to create the handle or take the workspace."""
        lib = _library()
        if lib is None:
            return None
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(_PTR)]
        lib.cublasCreate_v2.restype = _INT
        lib.cublasDestroy_v2.argtypes = [_PTR]
        lib.cublasDestroy_v2.restype = _INT
        handle = _PTR()
        _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        set_ws = lib.cublasSetWorkspace_v2
        set_ws.argtypes = [_PTR, _PTR, ctypes.c_size_t]
        set_ws.restype = _INT
        status = set_ws(handle, _PTR(workspace.data.ptr), ctypes.c_size_t(workspace.nbytes))
        if status != 0:
            lib.cublasDestroy_v2(handle)  # not left behind by the refusal
        _check(status, "cublasSetWorkspace")
        return cls(lib, handle, workspace)

    def gemm_ex(self, stream_ptr: int, transa: int, transb: int, m: int, n: int, k: int, alpha_ptr: int, a_ptr: int,
                a_type: int, lda: int, b_ptr: int, b_type: int, ldb: int, beta_ptr: int, c_ptr: int, c_type: int, ldc: int,
                compute: int, algo: int) -> None:
        """cublasGemmEx on `stream_ptr` (arguments as cuBLAS takes them: column-major, cudaDataType
        and cublasComputeType_t codes, host scalar pointers). Raises GpuError on a cuBLAS error."""
        if stream_ptr != self._stream:
            _check(self._set_stream(self.handle, _PTR(stream_ptr)), "cublasSetStream")
            self._stream = stream_ptr
        _check(self._gemm(self.handle, transa, transb, m, n, k, _PTR(alpha_ptr), _PTR(a_ptr), a_type, lda, _PTR(b_ptr),
                          b_type, ldb, _PTR(beta_ptr), _PTR(c_ptr), c_type, ldc, compute, algo), "cublasGemmEx")

    def close(self) -> None:
        """Destroy the handle (the workspace stays the caller's). Idempotent."""
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise GpuError(f"{what} failed with cuBLAS status {status}; use --backend numpy, and report this line as a k4 bug")
