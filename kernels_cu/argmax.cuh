// Argmax reductions over (value, index) pairs, lowest index on equal values (numpy's argmax),
// shared by the sampler (sampling.cu) and speculative decoding's verify step (speculative.cu).
// block_argmax assumes blockDim.x is a multiple of 32 and at most 1024; every thread of the
// block must call it and every thread gets the winner.
#pragma once
#include "ops_common.cuh"

#define NO_INDEX 0x7fffffff

// (value, index) pairs ordered for argmax: a valid pair beats an empty one (NO_INDEX), a larger
// value wins, and on equal values the lower index wins.
__device__ __forceinline__ bool beats(float v, int i, float ov, int oi) {
    return i != NO_INDEX && (oi == NO_INDEX || v > ov || (v == ov && i < oi));
}

__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(k4ops::FULL_MASK, v, off);
        const int oi = __shfl_xor_sync(k4ops::FULL_MASK, idx, off);
        if (beats(ov, oi, v, idx)) {
            v = ov;
            idx = oi;
        }
    }
}

// Argmax over the block (see beats); every thread gets the winner.
__device__ __forceinline__ void block_argmax(float& v, int& idx) {
    __shared__ float pv[32];
    __shared__ int pi[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    warp_argmax(v, idx);
    __syncthreads();
    if (lane == 0) {
        pv[warp] = v;
        pi[warp] = idx;
    }
    __syncthreads();
    v = lane < n_warps ? pv[lane] : -k4ops::inf_f32();
    idx = lane < n_warps ? pi[lane] : NO_INDEX;
    warp_argmax(v, idx);
}

