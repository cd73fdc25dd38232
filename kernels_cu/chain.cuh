// A decode step's launches waiting on counts instead of on the whole grid before them
// (flag K4_COUNT_WAIT; runtime/cuda/chain.py hands the slots out, docs/PERF.md session 54).
//
// runtime/cuda/chain.py gives each linked launch of a one-token step `chain`, the step's int32
// slots (zero at the step's start), and `at`: its own slot, plus CHAIN_GRID where the launch
// before it counts nothing. In modules compiled with K4_COUNT_WAIT=1, with chain non-null:
//  - chain_wait (every thread of the block, where the kernel would call pdl_wait): thread 0 polls
//    the slot of the launch before (at - 1) with relaxed loads until it holds CHAIN_DONE, takes one
//    acquire fence, and a barrier hands the block what that launch's blocks released. A relaxed
//    poll is a strong load from L2 only; an acquire load would invalidate the multiprocessor's L1
//    at every poll (sm_90 CCTL.IVALL; docs/PERF.md, session 53). griddepcontrol.wait, in its
//    place, waits for the whole grid before to end and its writes to be flushed.
//  - chain_count (thread 0 of every block, once a barrier has followed every write of the block,
//    or where it wrote nothing): one release fence, then its block's share added to slot at,
//    relaxed: 1, and the grid's first block CHAIN_DONE - (the grid's blocks) + 1, so that the slot
//    holds CHAIN_DONE once every block has counted, whatever the grid.
// A launch counts only after its own wait, so a launch that has seen its predecessor's count
// complete also sees every earlier launch's writes (release and acquire are cumulative in the PTX
// memory model, and a grid's completion orders what it observed for griddepcontrol.wait after it).
// The step's last launch (sampling.cu sample_finish) zeroes slots 0 .. at - 1 after its wait (chain_reset);
// the next step's launches start after it ends (its first, the embedding lookup, launches without
// programmatic dependent launch).
// Elsewhere (chain null, or a module built without K4_COUNT_WAIT) chain_wait is pdl_wait and
// chain_count and chain_reset do nothing: the kernels' code as before.
#pragma once
#include "constants.cuh"
#include "device.cuh"

#ifndef K4_COUNT_WAIT
#define K4_COUNT_WAIT 0
#endif
static_assert(CHAIN_DONE < CHAIN_GRID, "a slot's index stays below CHAIN_GRID");

// Polls of one wait before it traps: about 2^24 L2 round trips, several seconds; a decode step's
// longest wait is microseconds.
constexpr unsigned CHAIN_MAX_POLLS = 1u << 24;

// Whether this launch takes part in a chain: always false in a build without K4_COUNT_WAIT, so
// the code behind it compiles away.
__device__ __forceinline__ bool chain_on(const int* chain) { return K4_COUNT_WAIT && chain != nullptr; }

__device__ __forceinline__ void chain_wait(const int* chain, int at) {
    if (chain_on(chain) && !(at & CHAIN_GRID)) {  // uniform over the grid
        if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
            const int* slot = chain + at - 1;
            // a launch that never completes its count (a bug) traps after seconds instead of hanging the GPU
            for (unsigned polls = 0; ld_relaxed(slot) < CHAIN_DONE;)
                if (++polls == CHAIN_MAX_POLLS) __trap();
            acquire_fence();
        }
        __syncthreads();
        return;
    }
    pdl_wait();
}

__device__ __forceinline__ void chain_count(int* chain, int at) {
    if (!chain_on(chain)) return;
    const int blocks = gridDim.x * gridDim.y * gridDim.z;
    const int share = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 ? CHAIN_DONE - blocks + 1 : 1;
    asm volatile("fence.release.gpu;" ::: "memory");  // PTX ISA 8.6: the block's writes before the count
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(chain + (at & ~CHAIN_GRID)), "r"(share) : "memory");
}

// The whole block, after its chain_wait: slots 0 .. at - 1 (at without CHAIN_GRID) back to zero
// for the next step.
__device__ __forceinline__ void chain_reset(int* chain, int at) {
    if (!chain_on(chain)) return;
    for (int i = threadIdx.x; i < (at & ~CHAIN_GRID); i += blockDim.x) chain[i] = 0;
}
