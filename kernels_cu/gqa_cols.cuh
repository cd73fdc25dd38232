// attn_gqa with the group's query heads as the mma's 8 columns (attention_gqa.cu, COLS = true;
// groups of at most 8 query heads per KV head: Llama 3 8B 4, Qwen2.5 7B 7, Qwen3-30B-A3B 8).
//
// With the queries as the 16 rows of the tile (COLS = false) a group of 4 fills a quarter of every
// S and O tile. Here the roles turn: a warp's 16 keys are the rows, so S^T = K Q^T (m16n8k16: A =
// 16 keys x 16 dims from the key tile, B = Q^T from registers) is one mma per 16 dims instead of
// two, and O^T = V^T P^T (A = 16 dims x 16 keys from the value tile through ldmatrix.trans, B =
// P^T) one per 16 dims instead of two per 16; the accumulators hold D / 4 floats a lane instead
// of D / 2. The probabilities leave S^T's accumulator layout (lane = 4g + t: keys g and g + 8,
// queries 2t and 2t + 1) for P^T's B-operand layout (keys 2t, 2t + 1 and 2t + 8, 2t + 9 of query
// g) by one movmatrix.trans per 8 keys (PTX ISA: movmatrix, sm_75 and up). A query's softmax
// state (m, l: log2 units, as COLS = false) lives in the 8 lanes of its t; l is summed over them
// at the end.
#pragma once
#include "mma_common.cuh"

namespace k4gqa {
using namespace k4mma;

// The 8x8 fp16 matrix of the warp's fragments (lane 4g + t: row g, columns 2t and 2t + 1),
// transposed: lane 4g + t then holds row g of the transpose (column g of the input).
__device__ __forceinline__ u32 movmatrix_trans(u32 a) {
    u32 d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
    return d;
}

// B fragments of Q^T (D / 16 chunks of 16 dims x 8 queries) from the query rows 0 .. 7 at
// qs_base (fp16, rows ROW_BYTES apart): qb[kc] = {dims 16kc + 2t, +1; 16kc + 8 + 2t, +1} of query g.
template <int D, int ROW_BYTES>
__device__ __forceinline__ void cols_query(u32 (&qb)[D / 16][2], u32 qs_base, int lane) {
#pragma unroll
    for (int kc = 0; kc < D / 16; kc += 2)
        ldsm_x4(qs_base + (u32)((lane & 7) * ROW_BYTES + 2 * (16 * kc + 8 * (lane >> 3))), qb[kc][0], qb[kc][1], qb[kc + 1][0],
                qb[kc + 1][1]);
}

// S^T of one warp's 16 keys (kw .. kw + 15 of the fp16 key tile kb) and the group's queries
// (qb): sc[e] is key kw + g + 8 (e >> 1), query 2t + (e & 1), in log2 units.
template <int D, int ROW_BYTES>
__device__ __forceinline__ void cols_scores(float (&sc)[4], const u32 (&qb)[D / 16][2], u32 kb, int kw, int lane) {
    float s2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // two chains of mma: even and odd chunks
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        u32 a[4];  // keys kw .. +15 (rows), dims 16kc .. +15
        ldsm_x4(kb + (u32)((kw + (lane & 15)) * ROW_BYTES + 2 * (16 * kc + 8 * (lane >> 4))), a[0], a[1], a[2], a[3]);
        mma16816(s2[kc & 1], a, qb[kc][0], qb[kc][1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] = s2[0][e] + s2[1][e];
}

// The group's query rows 0 .. 7 at qs_base (fp16, rows ROW_BYTES apart; rows past the group zero)
// quantized to 8 bits per 32 dims for q.k on int8 tensor cores over a q8_0 key plane (I8K), as
// llama.cpp's vector kernels quantize q for quantized keys: d = max |q| / 127, q8 = round(q / d)
// (the float32 rounding tests/attention_ref.py gqa_int8_queries emulates). Threads tid < 8 D / 32
// of the block each take one (row, 32 dims) into q8 (8 rows of D + 16 bytes) and qd (8 rows of
// D / 32 floats), both in shared memory; the caller syncs the block before reading them.
template <int D, int ROW_BYTES>
__device__ __forceinline__ void cols_quantize_query(u32 qs_base, signed char* q8, float* qd, int tid) {
    constexpr int NB = D / 32;
    if (tid >= 8 * NB) return;
    const int r = tid / NB, b = tid % NB;
    float v[32], amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 w = ld_shared16(qs_base + (u32)(r * ROW_BYTES + 2 * (32 * b + 8 * i)));
        const u32 h[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            v[8 * i + k] = f16_to_f32((u16)(h[k / 2] >> (16 * (k & 1))));
            amax = fmaxf(amax, fabsf(v[8 * i + k]));
        }
    }
    const float d = __fdiv_rn(amax, 127.f);  // IEEE divisions whatever --use_fast_math: the test emulates them
    u32 packed[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u32 w = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int qi = d > 0.f ? __float2int_rn(__fdiv_rn(v[4 * i + k], d)) : 0;
            w |= (u32)(qi & 0xff) << (8 * k);
        }
        packed[i] = w;
    }
    uint4* dst = reinterpret_cast<uint4*>(q8 + r * (D + 16) + 32 * b);
    dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    qd[r * NB + b] = d;
}

// B fragments of the quantized Q^T for m16n8k32 (D / 32 chunks of 32 dims x 8 queries: dims 32kc +
// 4t .. +3 (qb[kc][0]) and 32kc + 16 + 4t .. +3 (qb[kc][1]) of query g) and the scales of this
// lane's accumulator columns, queries 2t and 2t + 1 (qd2[kc]), from cols_quantize_query's output.
template <int D>
__device__ __forceinline__ void cols_query_i8(u32 (&qb)[D / 32][2], float2 (&qd2)[D / 32], const signed char* q8, const float* qd,
                                              int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kc = 0; kc < D / 32; ++kc) {
        qb[kc][0] = *reinterpret_cast<const u32*>(q8 + g * (D + 16) + 32 * kc + 4 * t);
        qb[kc][1] = *reinterpret_cast<const u32*>(q8 + g * (D + 16) + 32 * kc + 16 + 4 * t);
        qd2[kc] = make_float2(qd[(2 * t) * (D / 32) + kc], qd[(2 * t + 1) * (D / 32) + kc]);
    }
}

// cols_scores over a raw q8_0 key tile (kq: quants, rows D + 16 bytes apart; ksc: their fp16
// scales, D / 16 bytes a row) on int8 tensor cores: per 32 dims one m16n8k32 of exact int32 sums,
// times the key's and the query's scales.
template <int D>
__device__ __forceinline__ void cols_scores_i8(float (&sc)[4], const u32 (&qb)[D / 32][2], const float2 (&qd2)[D / 32], u32 kq,
                                               u32 ksc, int kw, int lane) {
    const int g = lane >> 2;
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 32; ++kc) {
        u32 a0, a1, a2, a3;  // keys kw .. +15 (rows), dims 32kc .. +31: ldmatrix's 8x8 b16 matrices are A's 8x16 bytes
        ldsm_x4(kq + (u32)((kw + (lane & 15)) * (D + 16) + 32 * kc + 16 * (lane >> 4)), a0, a1, a2, a3);
        int c[4];
        mma16832_s8(c, a0, a1, a2, a3, qb[kc][0], qb[kc][1]);
        const float d0 = f16_to_f32(ld_shared_u16(ksc + (u32)((kw + g) * (D / 16) + 2 * kc)));
        const float d1 = f16_to_f32(ld_shared_u16(ksc + (u32)((kw + g + 8) * (D / 16) + 2 * kc)));
        sc[0] += (float)c[0] * (d0 * qd2[kc].x);
        sc[1] += (float)c[1] * (d0 * qd2[kc].y);
        sc[2] += (float)c[2] * (d1 * qd2[kc].x);
        sc[3] += (float)c[3] * (d1 * qd2[kc].y);
    }
}

// One warp's 16 keys, their scores sc (cols_scores) and values (kw .. kw + 15 of the fp16 value
// tile vb; absolute keys k0 .. k0 + 15, visible in [begin, end)) into the online softmax state of
// queries 2t, 2t + 1: m, l and O^T (o[i]: dims 16i + g and 16i + g + 8). cap2: the soft-cap in
// log2 units (0: none).
template <int D, int ROW_BYTES>
__device__ __forceinline__ void cols_update(float (&o)[D / 16][4], float (&m)[2], float (&l)[2], float (&sc)[4], u32 vb, int kw, int k0,
                                            int begin, int end, float cap2, int lane) {
    const int g = lane >> 2;
    const bool edge = k0 < begin || k0 + 15 >= end;  // some of the 16 keys are not visible
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (cap2 > 0.f) sc[e] = cap2 * k4ops::tanh_f32(sc[e] / cap2);
        const int key = k0 + g + 8 * (e >> 1);
        if (edge && (key < begin || key >= end)) sc[e] = -k4ops::inf_f32();
    }
    float corr[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {  // query 2t + c: its keys are in the 8 lanes of this t
        float mx = fmaxf(sc[c], sc[2 + c]);
        mx = fmaxf(mx, __shfl_xor_sync(k4ops::FULL_MASK, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(k4ops::FULL_MASK, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(k4ops::FULL_MASK, mx, 16));
        mx = fmaxf(m[c], mx);
        const float base = mx == -k4ops::inf_f32() ? 0.f : mx;  // no key yet: keep exp2 finite
        corr[c] = exp2f(m[c] - base);
        m[c] = mx;
        sc[c] = exp2f(sc[c] - base);
        sc[2 + c] = exp2f(sc[2 + c] - base);
        l[c] = l[c] * corr[c] + sc[c] + sc[2 + c];  // this lane's keys; summed over the 8 lanes at the end
    }
    if (__any_sync(k4ops::FULL_MASK, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
            o[i][0] *= corr[0];
            o[i][1] *= corr[1];
            o[i][2] *= corr[0];
            o[i][3] *= corr[1];
        }
    }
    // P^T as the B operand: keys 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of query g
    const u32 b0 = movmatrix_trans(pack_f16x2(sc[0], sc[1])), b1 = movmatrix_trans(pack_f16x2(sc[2], sc[3]));
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
        u32 a[4];  // V^T: dims 16i .. +15 (rows), keys kw .. +15
        ldsm_x4_trans(vb + (u32)((kw + (lane & 7) + 8 * (lane >> 4)) * ROW_BYTES + 2 * (16 * i + 8 * ((lane >> 3) & 1))),
                      a[0], a[1], a[2], a[3]);
        mma16816(o[i], a, b0, b1);
    }
}

// The warp's (m, l, O) of queries r < G into shared memory for the merge of the warps: wm, wl
// (GQA_WARPS, 16), wo (GQA_WARPS, 16, D), row = query.
template <int D>
__device__ __forceinline__ void cols_store(const float (&o)[D / 16][4], const float (&m)[2], const float (&l)[2], float* wm,
                                           float* wl, float* wo, int warp, int G, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        float lc = l[c];
        lc += __shfl_xor_sync(k4ops::FULL_MASK, lc, 4);
        lc += __shfl_xor_sync(k4ops::FULL_MASK, lc, 8);
        lc += __shfl_xor_sync(k4ops::FULL_MASK, lc, 16);
        const int r = 2 * t + c;
        if (r >= G) continue;
        if (g == 0) {
            wm[warp * 16 + r] = m[c];
            wl[warp * 16 + r] = lc;
        }
        float* dst = wo + (warp * 16 + r) * D + g;
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
            dst[16 * i] = o[i][c];
            dst[16 * i + 8] = o[i][2 + c];
        }
    }
}

}  // namespace k4gqa
