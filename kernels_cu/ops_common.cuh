// Helpers shared by the non-matmul kernels (norm, rope, attention, elementwise, sampling):
// warp and block reductions, an infinity constant (NVRTC has no <cmath>), and the fp16 type.
//
// Block reductions assume blockDim.x is a multiple of 32 and at most 1024. Every thread of
// the block must call them (they contain __syncthreads) and every thread gets the result.
#pragma once
#include <cuda_fp16.h>

namespace k4ops {

constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float inf_f32() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}

__device__ __forceinline__ int warp_min(int v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}

// Block-wide reductions: each warp reduces, warp leaders publish to shared memory, then every
// warp reduces the (at most 32) partials itself, so no broadcast step is needed. The leading
// barrier protects the scratch array from a previous call's readers.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_sum(lane < n_warps ? part[lane] : 0.0f);
}

__device__ __forceinline__ double block_sum(double v) {
    __shared__ double part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_sum(lane < n_warps ? part[lane] : 0.0);
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_max(lane < n_warps ? part[lane] : -inf_f32());
}

__device__ __forceinline__ int block_min(int v) {
    __shared__ int part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_min(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_min(lane < n_warps ? part[lane] : 0x7fffffff);
}

// Eight fp16 values (one 16-byte load) widened to float.
__device__ __forceinline__ void load_half8(const half* __restrict__ p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const half2* h = reinterpret_cast<const half2*>(&raw);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const float2 f = __half22float2(h[u]);
        out[2 * u] = f.x;
        out[2 * u + 1] = f.y;
    }
}

}  // namespace k4ops
