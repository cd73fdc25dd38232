// Helpers shared by the non-matmul kernels (norm, rope, attention, elementwise, sampling), on
// top of common.cuh (device.cuh: integer types, fp16 conversion, float warp reductions): block reductions,
// double and int warp reductions, an infinity constant (NVRTC has no <cmath>), 8-wide fp16
// unpacking, and the RoPE of one head row (rope.cu, attention.cu).
//
// Block reductions assume blockDim.x is a multiple of 32 and at most 1024. Every thread of
// the block must call them (they contain __syncthreads) and every thread gets the result.
#pragma once
#include "common.cuh"

namespace k4ops {

constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float inf_f32() { return __int_as_float(0x7f800000); }

// tanh(x) to a few float32 ulps whatever --use_fast_math does to tanhf (which it may map to the
// ~1e-3-accurate hardware approximation): -expm1(-2|x|) / (2 + expm1(-2|x|)), sign restored.
// expm1f keeps its accuracy near 0, where 1 - e^-2x would cancel.
__device__ __forceinline__ float tanh_f32(float x) {
    const float e = expm1f(-2.0f * fabsf(x));
    return copysignf(__fdiv_rn(-e, 2.0f + e), x);
}

// x * sigmoid(2 u), u = sqrt(2/pi) (x + 0.044715 x^3): the tanh-approximated GELU,
// 0.5 x (1 + tanh(u)), written so that no 1 + tanh(u) cancels for negative x.
__device__ __forceinline__ float gelu_tanh_f32(float x) {
    const float u = 0.7978845608028654f * x * (1.0f + 0.044715f * x * x);
    return __fdiv_rn(x, 1.0f + __expf(-2.0f * u));
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
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
    v = ::warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return ::warp_sum(lane < n_warps ? part[lane] : 0.0f);
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
    v = ::warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return ::warp_max(lane < n_warps ? part[lane] : -inf_f32());
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

// Eight fp16 values (the 16 bytes of one vector load) widened to float.
__device__ __forceinline__ void unpack_half8(const uint4 raw, float* out) {
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        out[2 * u] = f16_to_f32((u16)(w[u] & 0xffffu));
        out[2 * u + 1] = f16_to_f32((u16)(w[u] >> 16));
    }
}

// The rotation of RoPE's pair i at position p: (cos, sin) of p * inv_freq[i] in double, each
// rounded to float and times mscale (YaRN / LongRoPE magnitude, 1.0 otherwise: then bit-identical
// to no factor). rope_row computes it per pair; attention_short.cu tabulates it (rope_table).
__device__ __forceinline__ float2 rope_cos_sin(const double* __restrict__ inv_freq, double p, int i, float mscale) {
    double s, c;
    sincos(p * inv_freq[i], &s, &c);
    return make_float2((float)c * mscale, (float)s * mscale);
}

// rope_cos_sin of pairs 0 .. rope_dim / 2 - 1 at position p into tab (cos, then sin: rope_dim
// floats), threads tid, tid + n_threads, ... of the caller each taking pairs.
__device__ __forceinline__ void rope_table(const double* __restrict__ inv_freq, double p, int rope_dim, float mscale, float* tab,
                                          int tid, int n_threads) {
    const int half_dim = rope_dim / 2;
    for (int i = tid; i < half_dim; i += n_threads) {
        const float2 cs = rope_cos_sin(inv_freq, p, i, mscale);
        tab[i] = cs.x;
        tab[half_dim + i] = cs.y;
    }
}

// Pair (a, b) of values (xa, xb) turned by r = (cos, sin) into dst_f32 or dst_f16 (rope_apply).
// post: a factor the float outputs are then multiplied by (rounded once more; 1: none).
__device__ __forceinline__ void rope_turn(float xa, float xb, float2 r, int a, int b, float* dst_f32, u16* dst_f16, float post = 1.0f) {
    const float ya = __fsub_rn(__fmul_rn(xa, r.x), __fmul_rn(xb, r.y));
    const float yb = __fmaf_rn(xa, r.y, __fmul_rn(xb, r.x));
    if (dst_f32 != nullptr) {
        dst_f32[a] = __fmul_rn(ya, post);
        dst_f32[b] = __fmul_rn(yb, post);
    } else {
        dst_f16[a] = f32_to_f16(ya);
        dst_f16[b] = f32_to_f16(yb);
    }
}

// RoPE of one head row (D values) by one warp, as rope.cu describes (optional per-head RMSNorm
// first, pairs (2i, 2i+1) or NeoX (i, i + rope_dim/2), pair i turned by cs(i), its (cos, sin) as
// rope_cos_sin gives them): src may alias dst_f32 (q is rotated in place); exactly one of dst_f32 /
// dst_f16 is non-null. The rotation's roundings are written out (what nvcc made of x_a c - x_b s
// and x_a s + x_b c until session 22), so every kernel that rotates gives the same bits whatever
// the compiler would contract where cs(i) comes from (attention_short.cu's table, rope_row's sincos).
// MAXD > 0 (D <= MAXD, a compile-time bound): every value a lane reads is loaded before any is
// used (at most MAXD / 32 a lane), so the row costs one round trip to memory where the loop of
// load-then-use steps (MAXD 0: for kernels whose registers are capped, attention.cu's) costs one a
// step (docs/PERF.md, session 33). The arithmetic and its order are the same, so are the bits.
// post: each float output multiplied by it once it is made, as a pass over dst_f32
// afterwards would (attention_short.cu's query scale), in the same rounding.
template <int MAXD = 0, class CosSin>
__device__ __forceinline__ void rope_apply(const float* src, float* dst_f32, u16* dst_f16, const float* __restrict__ norm_w, float eps,
                                           int D, int rope_dim, int neox, int lane, CosSin cs, float post = 1.0f) {
    if constexpr (MAXD == 0) {
        float scale = 1.0f;
        if (norm_w != nullptr) {
            float ss = 0.0f;
            for (int i = lane; i < D; i += 32) ss += src[i] * src[i];
            ss = ::warp_sum(ss);
            scale = rsqrtf(ss / (float)D + eps);
        }
        const int half_dim = rope_dim / 2;
        for (int i = lane; i < half_dim; i += 32) {
            const int a = neox ? i : 2 * i;
            const int b = neox ? i + half_dim : 2 * i + 1;
            float xa = src[a] * scale, xb = src[b] * scale;
            if (norm_w != nullptr) {
                xa *= norm_w[a];
                xb *= norm_w[b];
            }
            rope_turn(xa, xb, cs(i), a, b, dst_f32, dst_f16, post);
        }
        for (int i = rope_dim + lane; i < D; i += 32) {
            const float x = src[i] * scale * (norm_w != nullptr ? norm_w[i] : 1.0f);
            if (dst_f32 != nullptr) dst_f32[i] = __fmul_rn(x, post);
            else dst_f16[i] = f32_to_f16(x);
        }
    } else {
        constexpr int V = MAXD / 32, J = MAXD / 64;
        if (D > MAXD) __trap();
        const int half_dim = rope_dim / 2;
        const bool norm = norm_w != nullptr;
        float xs[V], xt[V], xa[J], xb[J];  // the norm's pass, the part past rope_dim, the pairs
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int i = lane + 32 * k;
            xs[k] = norm && i < D ? src[i] : 0.0f;
            xt[k] = rope_dim + i < D ? src[rope_dim + i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int i = lane + 32 * j;
            xa[j] = i < half_dim ? src[neox ? i : 2 * i] : 0.0f;
            xb[j] = i < half_dim ? src[neox ? i + half_dim : 2 * i + 1] : 0.0f;
        }
        float scale = 1.0f;
        if (norm) {
            float ss = 0.0f;
#pragma unroll
            for (int k = 0; k < V; ++k)
                if (lane + 32 * k < D) ss += xs[k] * xs[k];
            ss = ::warp_sum(ss);
            scale = rsqrtf(ss / (float)D + eps);
        }
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int i = lane + 32 * j;
            if (i >= half_dim) break;
            const int a = neox ? i : 2 * i;
            const int b = neox ? i + half_dim : 2 * i + 1;
            float x_a = xa[j] * scale, x_b = xb[j] * scale;
            if (norm) {
                x_a *= norm_w[a];
                x_b *= norm_w[b];
            }
            rope_turn(x_a, x_b, cs(i), a, b, dst_f32, dst_f16, post);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int i = rope_dim + lane + 32 * k;
            if (i >= D) break;
            const float x = xt[k] * scale * (norm ? norm_w[i] : 1.0f);
            if (dst_f32 != nullptr) dst_f32[i] = __fmul_rn(x, post);
            else dst_f16[i] = f32_to_f16(x);
        }
    }
}

// rope_apply at position p, each pair's rotation computed as it is used.
template <int MAXD = 0>
__device__ __forceinline__ void rope_row(const float* src, float* dst_f32, u16* dst_f16,
                                         const float* __restrict__ norm_w, float eps,
                                         const double* __restrict__ inv_freq, double p, int D, int rope_dim,
                                         int neox, int lane, float mscale) {
    rope_apply<MAXD>(src, dst_f32, dst_f16, norm_w, eps, D, rope_dim, neox, lane,
               [&](int i) { return rope_cos_sin(inv_freq, p, i, mscale); });
}

}  // namespace k4ops
