"""The one way k4 launches a kernel: on the current CuPy stream (or `stream`), counted in a Trace.

Launching through here keeps `K4_TRACE=1` and `k4 bench` honest about kernel counts. It
allocates nothing and never synchronizes, so launches can be captured in a CUDA graph.
"""

from __future__ import annotations

from runtime.trace import Trace


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0,
           stream=None, trace: Trace | None = None) -> None:
    """Launch `kernel` (a cupy.RawKernel) with `grid` blocks of `block` threads and `shared_mem`
    bytes of dynamic shared memory, on `stream` (a cupy.cuda.Stream) or the current stream.

    Arguments: cupy arrays pass their device pointer, numpy scalars their value with their own
    C type (so pass np.int32/np.int64/np.float32, and np.uint64(0) for a null pointer).
    """
    if stream is None:
        kernel(grid, block, args, shared_mem=shared_mem)
    else:
        with stream:
            kernel(grid, block, args, shared_mem=shared_mem)
    if trace is not None:
        trace.launch()
