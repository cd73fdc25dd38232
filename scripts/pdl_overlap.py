"""Which pairs of kernels can run side by side under programmatic dependent launch (GPU).

Kernel A (132 x 512 threads, one block a multiprocessor, the registers of gemv_q8_pair) holds
its registers for --hold µs; kernel B (2 blocks a multiprocessor of 128 threads, the registers
of attn_gqa, a chosen amount of dynamic shared memory) is launched after it with programmatic
dependent launch, both captured in one CUDA graph behind a kernel A0 (the product before). Every
block stamps %globaltimer when it starts (B before its griddepcontrol.wait), A's blocks also
when they end. The table gives, per case, how many of B's blocks started before A's last block
ended, and when the first did. A block of B can run beside one of A only where both fit in the
registers and shared memory; this shows what else decides it: the shared-memory carveout each
kernel asks for (cudaFuncAttributePreferredSharedMemoryCarveout, percent of 228 KB), A0's
included. docs/PERF.md, session 20, has the H200's answers.

Usage (from the repository root, k4 importable): python scripts/pdl_overlap.py [--hold 20] [--reps 10]
"""

from __future__ import annotations

import argparse

import numpy as np

SOURCE = r"""
__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
// Load NV 16-byte words a thread and keep them live across a wait of ns nanoseconds: 4 NV registers.
template <int NV>
__device__ void hold(const uint4* p, long long ns, unsigned* sink) {
    const unsigned long long t0 = now();
    uint4 v[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) v[i] = p[((size_t)blockIdx.x * NV + i) * blockDim.x + threadIdx.x];
    while (now() < t0 + ns) {}
    unsigned a = 0;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        asm volatile("" ::"r"(v[i].x), "r"(v[i].y), "r"(v[i].z), "r"(v[i].w));
        a ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    }
    if (a == 0x12345u) sink[0] = a;
}
template <int NV>  // a primary: triggers its dependents at once (then waits for its own primary with wait), stamps its start and end
__device__ void primary(const uint4* p, unsigned long long* start, unsigned long long* end, long long ns, unsigned* sink, int wait) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0) start[blockIdx.x] = now();
    hold<NV>(p, ns, sink);
    __syncthreads();
    if (threadIdx.x == 0) end[blockIdx.x] = now();
}
extern "C" __global__ void __launch_bounds__(512, 1)
kernel_a0(const uint4* p, unsigned long long* s, unsigned long long* e, long long ns, unsigned* sink, int w) {
    primary<14>(p, s, e, ns, sink, w);  // 68 registers: the product before
}
extern "C" __global__ void __launch_bounds__(512, 1)
kernel_a(const uint4* p, unsigned long long* s, unsigned long long* e, long long ns, unsigned* sink, int w) {
    primary<21>(p, s, e, ns, sink, w);  // 96 registers: gemv_q8_pair as nvcc compiles it
}
extern "C" __global__ void __launch_bounds__(128)
kernel_b(const uint4* p, unsigned long long* start, long long ns, unsigned* sink) {  // 118 registers: attn_gqa's 119
    extern __shared__ uint4 staged[];
    if (threadIdx.x == 0) start[blockIdx.x] = now();
    staged[threadIdx.x] = p[threadIdx.x];
    asm volatile("griddepcontrol.wait;" ::: "memory");
    hold<26>(p, ns, sink);
    if (staged[threadIdx.x ^ 1].x == 0x777u) sink[1] = 1;
}
"""

KB = 1 << 10
# (A0's carveout, A's, B's, B's shared memory in KB[, A waits for A0 (griddepcontrol.wait) after its trigger, as the
# products do[, a second A0 launched by PDL before A]]): the decode chain's choices and the ones around them
CASES = ((50, 50, 50, 60), (50, 50, 50, 60, 1), (50, 50, 50, 60, 1, 1), (50, 50, 50, 111), (50, 50, 99, 111), (100, 100, 99, 111), (50, 100, 99, 111),
         (60, 60, 60, 77), (66, 66, 66, 77), (71, 71, 71, 77), (72, 72, 72, 77), (50, 72, 72, 77),
         (72, 72, 72, 77, 1, 1), (100, 100, 99, 111, 1, 1), (80, 80, 80, 77), (86, 86, 86, 111), (100, 100, 50, 60))


def main() -> None:
    import cupy as cp

    from k4.runtime.cuda.launch import _launch_ex  # the raw cuLaunchKernelEx launch (PDL): launch() would set its own carveouts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold", type=float, default=20.0, help="µs each block of A holds its registers")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per case (the first half is warm-up)")
    args = ap.parse_args()
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    a0, a, b = (mod.get_function(n) for n in ("kernel_a0", "kernel_a", "kernel_b"))
    print("registers: A0", a0.attributes["num_regs"], "A", a.attributes["num_regs"], "B", b.attributes["num_regs"])
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    words = cp.zeros((4 << 20, 4), dtype=cp.uint32)
    sink = cp.zeros(4, dtype=cp.uint32)
    a_start, a_end, scratch = (cp.zeros(n_sm, dtype=cp.uint64) for _ in range(3))
    b_start = cp.zeros(2 * n_sm, dtype=cp.uint64)
    stream = cp.cuda.Stream(non_blocking=True)
    a_smem = 9 * KB  # gemv_q8_pair's 5.5 KB of x and its second swizzle
    print("carveouts A0 A B, B's shared memory, A waits, A0 by PDL | B blocks started before A ended, first B start - A end (µs)")
    for c0, ca, cb, b_kb, *more in CASES:
        wait, a0_pdl = (more + [0, 0])[:2]
        a0.preferred_shared_memory_carveout, a.preferred_shared_memory_carveout = c0, ca
        a.max_dynamic_shared_size_bytes = a0.max_dynamic_shared_size_bytes = a_smem
        b.max_dynamic_shared_size_bytes, b.preferred_shared_memory_carveout = b_kb * KB, cb
        stream.begin_capture()
        with stream:
            a0((n_sm,), (512,), (words, scratch, scratch, np.int64(2000), sink, np.int32(0)), shared_mem=a_smem)
            if a0_pdl:  # a second A0 by PDL, so that A's primary is itself a dependent
                _launch_ex(a0, (n_sm,), (512,), (words, scratch, scratch, np.int64(2000), sink, np.int32(1)), a_smem, stream.ptr)
            _launch_ex(a, (n_sm,), (512,), (words, a_start, a_end, np.int64(args.hold * 1e3), sink, np.int32(wait)), a_smem, stream.ptr)
            _launch_ex(b, (2 * n_sm,), (128,), (words, b_start, np.int64(3000), sink), b_kb * KB, stream.ptr)
        graph = stream.end_capture()
        early, first = [], []
        for _ in range(args.reps):
            graph.launch(stream)
            stream.synchronize()
            end, starts = int(a_end.get().max()), b_start.get().astype(np.int64)
            early.append(int((starts < end).sum()))
            first.append((starts.min() - end) / 1e3)
        half = args.reps // 2
        print(f"{c0:3d} {ca:3d} {cb:3d} {b_kb:4d} KB {wait} {a0_pdl} | {np.median(early[half:]):4.0f} {np.median(first[half:]):+8.2f}")


if __name__ == "__main__":
    main()
