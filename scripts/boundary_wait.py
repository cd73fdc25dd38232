"""What a kernel boundary costs against a wait on a count of the blocks done (GPU).

A chain of LINKS kernels (one block of 512 threads a multiprocessor, launched with programmatic
dependent launch, captured in one CUDA graph) stands for decode's chain of products: each link
loads NV 16-byte words a thread of its own weights before it waits (as gemv_q8 issues its first
rows' loads), waits for the link before it, reads that link's whole output x (N_X floats, a
dependent read through L2, as a product's x prologue), sums it over the block and writes its
share of the next x. The wait is, per mode:

- `grid`: griddepcontrol.wait, the boundary the decode chain has today (the previous grid ends
  and its writes are flushed);
- `relaxed`: thread 0 polls the previous link's count (every block adds 1 after a release
  fence, fence.release.gpu) with relaxed loads, then takes one acquire fence (fence.acquire.gpu),
  then a block barrier (the form K4_COUNT_WAIT and K4_HEAD_READY's third form used; both removed
  in session 56, measured slower);
- `acquire`: the same count polled with acquire loads and __nanosleep(32) between polls, release
  reductions: moe_one's arrival wait (on sm_90 every acquire load
  invalidates the multiprocessor's L1);
- `relaxed-sleep`: relaxed polls with __nanosleep(32), one acquire fence;
- `none`: no wait at all: the floor, its x values wrong.

Each case runs with one block a multiprocessor possible at a time (SMEM_KB of dynamic shared
memory a block, as the products, whose registers allow one) and with two (no shared memory), and
reports µs a link (median of graph replays timed by CUDA events) and whether the chain's last x has
the bits of the `grid` mode's. On the H200 (docs/PERF.md, session 56) every count wait was 0.4-0.5 µs
a link slower than `grid`, so decode's boundaries keep griddepcontrol.wait.

Usage (from the repository root, k4 importable): python scripts/boundary_wait.py [--links 100] [--reps 20]
"""

from __future__ import annotations

import argparse

import numpy as np

MODES = ("grid", "relaxed", "acquire", "relaxed-sleep", "none")
NVS = (0, 2, 8)  # 16-byte weight words a thread loaded before the wait: 0, 2.2 and 8.7 MB a link on 132 SMs
SMEM_KB = 120  # a block's dynamic shared memory where one block a multiprocessor is to fit
N_X = 4096  # floats of x each link reads whole and writes a share of (a 7B's n_embd)
THREADS = 512

SOURCE = r"""
#include "device.cuh"  // ld_relaxed, ld_acquire, acquire_fence: the forms the kernels use

// MODE: 0 grid, 1 relaxed, 2 acquire, 3 relaxed-sleep, 4 none (scripts/boundary_wait.py MODES)
template <int NV, int MODE>
__device__ void link(const uint4* w, long long w_stride, const float* x_in, float* x_out, int n_x, int* counts,
                     int idx, unsigned* sink) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    uint4 v[NV > 0 ? NV : 1];
#pragma unroll
    for (int i = 0; i < NV; ++i) v[i] = __ldcs(w + idx * w_stride + ((long long)blockIdx.x * NV + i) * blockDim.x + threadIdx.x);
    if (MODE == 0) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else if (MODE != 4 && idx > 0) {
        if (threadIdx.x == 0) {
            const int* c = counts + idx - 1;
            const int target = gridDim.x;
            if (MODE == 1) {
                while (ld_relaxed(c) < target) {}
                acquire_fence();
            } else if (MODE == 2) {
                while (ld_acquire(c) < target) __nanosleep(32);
            } else {
                while (ld_relaxed(c) < target) __nanosleep(32);
                acquire_fence();
            }
        }
        __syncthreads();
    }
    __shared__ float warp_s[32];
    float s = 0.f;
    for (int i = threadIdx.x; i < n_x; i += blockDim.x) s += x_in[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    if ((threadIdx.x & 31) == 0) warp_s[threadIdx.x >> 5] = s;
    __syncthreads();
    s = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) s += warp_s[i];
    unsigned a = 0;
#pragma unroll
    for (int i = 0; i < NV; ++i) a ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    if (a == 0x12345u) sink[0] = a;
    const int per = n_x / gridDim.x, first = blockIdx.x * per + min((int)blockIdx.x, n_x % (int)gridDim.x);
    const int mine = per + ((int)blockIdx.x < n_x % (int)gridDim.x);
    for (int j = threadIdx.x; j < mine; j += blockDim.x) x_out[first + j] = s * 1e-3f + (float)(first + j) * 1e-4f;
    if (MODE == 1 || MODE == 3) {
        __syncthreads();
        if (threadIdx.x == 0) {
            asm volatile("fence.release.gpu;" ::: "memory");
            asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(counts + idx) : "memory");
        }
    } else if (MODE == 2) {
        __syncthreads();
        if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counts + idx) : "memory");
    }
}

#define K4_LINK(NV, MODE)                                                                                       \
    extern "C" __global__ void __launch_bounds__(512, 2)                                                        \
    link_##NV##_##MODE(const uint4* w, long long w_stride, const float* x_in, float* x_out, int n_x, int* counts, \
                       int idx, unsigned* sink) {                                                               \
        link<NV, MODE>(w, w_stride, x_in, x_out, n_x, counts, idx, sink);                                       \
    }
#define K4_LINKS(NV) K4_LINK(NV, 0) K4_LINK(NV, 1) K4_LINK(NV, 2) K4_LINK(NV, 3) K4_LINK(NV, 4)
K4_LINKS(0)
K4_LINKS(2)
K4_LINKS(8)
"""


def kernel_name(nv: int, mode: str) -> str:
    """The extern "C" name of SOURCE's link for NV words a thread and `mode` (one of MODES)."""
    if nv not in NVS or mode not in MODES:
        raise ValueError(f"no link for NV {nv} and mode {mode!r}: NV is one of {NVS}, mode one of {MODES}")
    return f"link_{nv}_{MODES.index(mode)}"


def cases() -> list[tuple[int, int, str]]:
    """(NV, dynamic shared memory in KB, mode) of every run, the modes of one (NV, shared memory)
    next to each other, `grid` first (the bits the others are compared with)."""
    return [(nv, kb, mode) for nv in NVS for kb in (SMEM_KB, 0) for mode in MODES]


def main() -> None:
    import cupy as cp
    from k4.kernels_cu import SOURCE_DIR
    from k4.runtime.cuda.launch import _launch_ex

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", type=int, default=100, help="kernels in the chain")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per case (the first quarter is warm-up)")
    args = ap.parse_args()
    if args.links < 2 or args.reps < 4:
        raise SystemExit("boundary_wait: --links must be at least 2 and --reps at least 4")
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17", f"-I{SOURCE_DIR}"))
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    stride = n_sm * THREADS * max(NVS)  # 16-byte words of one link's weights
    words = cp.ones((args.links * stride, 4), dtype=cp.uint32)
    x = [cp.zeros(N_X, dtype=cp.float32) for _ in range(2)]
    counts = cp.zeros(args.links, dtype=cp.int32)
    sink = cp.zeros(4, dtype=cp.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    print(f"{args.links} links, {n_sm} blocks of {THREADS} threads, x of {N_X} floats; µs a link (median), same bits as grid")
    print(f"{'NV':>3} {'MB a link':>9} {'blocks/SM':>9} | " + " | ".join(f"{m:>13}" for m in MODES))
    row, ref = [], None
    for nv, kb, mode in cases():
        fn = mod.get_function(kernel_name(nv, mode))
        fn.max_dynamic_shared_size_bytes = kb << 10
        stream.begin_capture()
        with stream:
            counts.fill(0)
            for i in range(args.links):
                a = (words, np.int64(stride), x[i % 2], x[1 - i % 2], np.int32(N_X), counts, np.int32(i), sink)
                _launch_ex(fn, (n_sm,), (THREADS,), a, kb << 10, stream.ptr, pdl=i > 0)
        graph = stream.end_capture()
        times = []
        for _ in range(args.reps):
            with stream:
                x[0][:] = cp.arange(N_X, dtype=cp.float32) * 1e-3
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / args.links)
        out = x[args.links % 2].get()
        if mode == "grid":
            ref = out
        same = "yes" if np.array_equal(out.view(np.uint32), ref.view(np.uint32)) else "NO"
        row.append(f"{np.median(times[args.reps // 4:]):8.2f} {same:>4}")
        if mode == MODES[-1]:
            mb = n_sm * THREADS * nv * 16 / 1e6
            print(f"{nv:>3} {mb:>9.1f} {1 if kb else 2:>9} | " + " | ".join(f"{c:>13}" for c in row))
            row = []


if __name__ == "__main__":
    main()
