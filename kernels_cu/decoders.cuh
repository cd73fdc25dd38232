// The per-type decoders of the dequant-matmul kernels (gemv.cu, gemv_batch.cu, moe_gemv.cu,
// matmul.cu): for each ggml type a struct that loads a chunk of a row from either device layout
// (quant_layouts.cuh), dots it with q8 x and dequantizes it. Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 and
// Q5_1 here; Q2_K, Q3_K, Q4_0, IQ4_XS and IQ4_NL in decoders_lowbit.cuh (included below); then
// F32, F16 and BF16. The meaning of the bits: ggml-quants.c dequantize_row_* and get_scale_min_k4.
#pragma once
#include "quant_layouts.cuh"


// The 6-bit scales and mins of sub-blocks 2p and 2p+1 (p = 0..3) of a Q4_K/Q5_K block, from its
// 12 scale bytes as little-endian words s0, s1, s2 (bytes 0-3, 4-7, 8-11). Same bits as
// ggml-quants.c get_scale_min_k4: sub-block i < 4 keeps the low 6 bits of bytes i (scale) and
// i+4 (min); i >= 4 takes its low 4 bits from byte i+4 and its top 2 from bytes i-4 and i.
// The scales (sc) and mins (m) of sub-blocks 4 (p >> 1) .. + 3, a byte each.
__device__ __forceinline__ void scale_min_words(int p, u32 s0, u32 s1, u32 s2, u32& sc, u32& m) {
    sc = p < 2 ? s0 & 0x3F3F3F3Fu : (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);
    m = p < 2 ? s1 & 0x3F3F3F3Fu : ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
}
__device__ __forceinline__ void get_scale_min_k4(int p, u32 s0, u32 s1, u32 s2, int& sc0, int& sc1, int& m0, int& m1) {
    u32 sc, m;
    scale_min_words(p, s0, s1, s2, sc, m);
    const int sh = 16 * (p & 1);
    sc0 = (sc >> sh) & 0xFF;
    sc1 = (sc >> (sh + 8)) & 0xFF;
    m0 = (m >> sh) & 0xFF;
    m1 = (m >> (sh + 8)) & 0xFF;
}

// Byte i (0..3) of w as an exact float: the byte put under 2^23's exponent bits (a byte permute)
// and 2^23 taken away, two instructions where a shift, a mask and a conversion take three.
__device__ __forceinline__ float byte_as_float(u32 w, u32 i) { return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u + i)) - 8388608.0f; }

// get_scale_min_k4's four values as exact floats (byte_as_float: the same values, so the same bits
// downstream).
__device__ __forceinline__ void get_scale_min_k4_f(int p, u32 s0, u32 s1, u32 s2, float& sc0, float& sc1, float& m0, float& m1) {
    u32 sc, m;
    scale_min_words(p, s0, s1, s2, sc, m);
    const u32 b = 2u * (p & 1);
    sc0 = byte_as_float(sc, b);
    sc1 = byte_as_float(sc, b + 1);
    m0 = byte_as_float(m, b);
    m1 = byte_as_float(m, b + 1);
}

// ---- per-type decoders ----------------------------------------------------------------------------
// Each weight type T splits a row into chunks of T::chunk_elems weights, the work of one thread:
//   chunk load<PLANAR>(w, nblk, blk, j)   issue the loads of chunk j of block blk (global index)
//   float dot(chunk, ci, x)               sum over the chunk of w*x (ci: chunk index within the row)
//   void dequant(chunk, ci, r, row)       write run r (of chunk_elems/16 runs of 16 weights) of the
//                                         chunk into row[0..n_in) (float or fp16)
// Values written by dequant round exactly as the gguf package's numpy dequantize does.

struct type_q4_K {
    static constexpr int block_bytes = sizeof(block_q4_K), block_elems = QK_K, chunk_elems = K4_CHUNK_Q4_K;
    static constexpr int raw_align = 16, x_swizzle = K4_X_SWIZZLE_Q4_K;
    static constexpr bool handoff = K4_HANDOFF_Q4_K;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q4_K && K4_PLANAR_EXPERTS;
    // groups: d, dmin and scales (16 bytes) | qs
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)(sizeof(block_q4_K) - sizeof(block_q4_K::qs)) : (int)sizeof(block_q4_K);
    }
    struct chunk {
        uint4 meta;    // d, dmin (fp16), scales[12]
        uint4 q0, q1;  // qs[32j..32j+31]: sub-block 2j in the low nibbles, 2j+1 in the high
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int j) {
        constexpr int A = PLANAR ? 16 : raw_align;
        const u8* qs = group_at<type_q4_K, 1, PLANAR>(w, nblk, blk) + 32 * j;
        return {load16<A>(group_at<type_q4_K, 0, PLANAR>(w, nblk, blk)), load16<A>(qs), load16<A>(qs + 16)};
    }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        float sc0, sc1, m0, m1;
        get_scale_min_k4_f(ci & 3, c.meta.y, c.meta.z, c.meta.w, sc0, sc1, m0, m1);
        // Written for few instructions in the row loop (docs/PERF.md, session 29): the four x units'
        // slots from one row computation, the high nibbles masked in place, not shifted.
        const int u = 4 * ci;  // x units of this chunk: u, u+1 (sub-block 2j), u+2, u+3 (2j+1)
        const x_row xr = x_row_of(u, SWZ);
        const int s0 = dot16(map4(c.q1, 0, 0x0F0F0F0Fu), x.unit_at(xr, 1), dot16(map4(c.q0, 0, 0x0F0F0F0Fu), x.unit_at(xr, 0), 0));
        // the high nibbles in place (q & 0xF0, unsigned: 16 times the quant), the sum shifted back (exact)
        const int s1 = dot16_u8(map4(c.q1, 0, 0xF0F0F0F0u), x.unit_at(xr, 3),
                                dot16_u8(map4(c.q0, 0, 0xF0F0F0F0u), x.unit_at(xr, 2), 0)) >> 4;
        const float2 dx = *reinterpret_cast<const float2*>(x.d + 2 * ci);
        const float4 sx = *reinterpret_cast<const float4*>(x.s + u);
        const float d = f16_to_f32(c.meta.x & 0xFFFF), dmin = f16_to_f32(c.meta.x >> 16);
        return d * (sc0 * dx.x * (float)s0 + sc1 * dx.y * (float)s1) - dmin * (m0 * (sx.x + sx.y) + m1 * (sx.z + sx.w));
    }
    // Run r (0..3) of chunk ci: weights 64ci+16r .. +15; r < 2: low nibbles of q0/q1 (sub-block
    // 2j), else high nibbles (2j+1).
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int r, OUT* row) {
        int sc0, sc1, m0, m1;
        get_scale_min_k4(ci & 3, c.meta.y, c.meta.z, c.meta.w, sc0, sc1, m0, m1);
        const float d = f16_to_f32(c.meta.x & 0xFFFF), dmin = f16_to_f32(c.meta.x >> 16);
        const float ds = __fmul_rn(d, (float)(r >> 1 ? sc1 : sc0)), dm = __fmul_rn(dmin, (float)(r >> 1 ? m1 : m0));
        const uint4 q = r & 1 ? c.q1 : c.q0;
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fsub_rn(__fmul_rn(ds, (float)nibble(q, i, 4 * (r >> 1))), dm);
        store16(row + 64 * ci + 16 * r, v);
    }
};
static_assert(cuts_are<type_q4_K>(K4_GROUPS_Q4_K), "type_q4_K::cut: runtime/cuda/constants.py has other planar groups");

struct type_q5_K {
    static constexpr int block_bytes = sizeof(block_q5_K), block_elems = QK_K, chunk_elems = K4_CHUNK_Q5_K;
    static constexpr int raw_align = 16, x_swizzle = K4_X_SWIZZLE_Q5_K;
    static constexpr bool handoff = K4_HANDOFF_Q5_K;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q5_K && K4_PLANAR_EXPERTS;
    // groups: d, dmin and scales (16 bytes) | qh | qs
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)(sizeof(block_q5_K) - sizeof(block_q5_K::qh) - sizeof(block_q5_K::qs)) : g == 2 ? (int)(sizeof(block_q5_K) - sizeof(block_q5_K::qs)) : (int)sizeof(block_q5_K);
    }
    struct chunk {
        uint4 meta;
        uint4 h0, h1;  // qh[0..31]: bits 2j and 2j+1 are this chunk's
        uint4 q0, q1;  // qs[32j..32j+31]
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int j) {
        constexpr int A = PLANAR ? 16 : raw_align;
        const u8* qh = group_at<type_q5_K, 1, PLANAR>(w, nblk, blk);
        const u8* qs = group_at<type_q5_K, 2, PLANAR>(w, nblk, blk) + 32 * j;
        return {load16<A>(group_at<type_q5_K, 0, PLANAR>(w, nblk, blk)), load16<A>(qh), load16<A>(qh + 16), load16<A>(qs), load16<A>(qs + 16)};
    }
    // bit `bit` of each byte of h, moved to bit 4 (the 5th bit of the quants)
    __device__ static uint4 high(const uint4& h, int bit) {
        uint4 b = map4(h, bit, 0x01010101u);
        return make_uint4(b.x << 4, b.y << 4, b.z << 4, b.w << 4);
    }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int j = ci & 3;
        int sc0, sc1, m0, m1;
        get_scale_min_k4(j, c.meta.y, c.meta.z, c.meta.w, sc0, sc1, m0, m1);
        const int u = 4 * ci;
        const int s0 = dot16(or4(map4(c.q1, 0, 0x0F0F0F0Fu), high(c.h1, 2 * j)), x.unit(u + 1),
                             dot16(or4(map4(c.q0, 0, 0x0F0F0F0Fu), high(c.h0, 2 * j)), x.unit(u), 0));
        const int s1 = dot16(or4(map4(c.q1, 4, 0x0F0F0F0Fu), high(c.h1, 2 * j + 1)), x.unit(u + 3),
                             dot16(or4(map4(c.q0, 4, 0x0F0F0F0Fu), high(c.h0, 2 * j + 1)), x.unit(u + 2), 0));
        const float2 dx = *reinterpret_cast<const float2*>(x.d + 2 * ci);
        const float4 sx = *reinterpret_cast<const float4*>(x.s + u);
        const float d = f16_to_f32(c.meta.x & 0xFFFF), dmin = f16_to_f32(c.meta.x >> 16);
        return d * ((float)sc0 * dx.x * (float)s0 + (float)sc1 * dx.y * (float)s1) -
               dmin * ((float)m0 * (sx.x + sx.y) + (float)m1 * (sx.z + sx.w));
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int r, OUT* row) {  // run r as in type_q4_K
        const int j = ci & 3;
        int sc0, sc1, m0, m1;
        get_scale_min_k4(j, c.meta.y, c.meta.z, c.meta.w, sc0, sc1, m0, m1);
        const float d = f16_to_f32(c.meta.x & 0xFFFF), dmin = f16_to_f32(c.meta.x >> 16);
        const float ds = __fmul_rn(d, (float)(r >> 1 ? sc1 : sc0)), dm = __fmul_rn(dmin, (float)(r >> 1 ? m1 : m0));
        const uint4 q = r & 1 ? c.q1 : c.q0;
        const uint4 h = r & 1 ? c.h1 : c.h0;
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int hb = (word(h, i >> 2) >> (8 * (i & 3) + 2 * j + (r >> 1))) & 1;
            v[i] = __fsub_rn(__fmul_rn(ds, (float)(nibble(q, i, 4 * (r >> 1)) | (hb << 4))), dm);
        }
        store16(row + 64 * ci + 16 * r, v);
    }
};
static_assert(cuts_are<type_q5_K>(K4_GROUPS_Q5_K), "type_q5_K::cut: runtime/cuda/constants.py has other planar groups");

// A file defines K4_WIDE_RAW_Q6_K 1 before including common.cuh where its raw Q6_K loads may take
// more registers for fewer, wider loads (the expert products: experts stay in the file's blocks).
#ifndef K4_WIDE_RAW_Q6_K
#define K4_WIDE_RAW_Q6_K 0
#endif

struct type_q6_K {
    static constexpr int block_bytes = sizeof(block_q6_K), block_elems = QK_K, chunk_elems = K4_CHUNK_Q6_K;
    static constexpr int raw_align = 2, x_swizzle = K4_X_SWIZZLE_Q6_K;
    static constexpr bool handoff = K4_HANDOFF_Q6_K;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q6_K && K4_PLANAR_EXPERTS;
    // groups: ql | qh | scales | d
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)sizeof(block_q6_K::ql) : g == 2 ? (int)(sizeof(block_q6_K::ql) + sizeof(block_q6_K::qh))
             : g == 3 ? (int)(sizeof(block_q6_K) - sizeof(block_q6_K::d)) : (int)sizeof(block_q6_K);
    }
    // Chunk j = 2h + lr covers weights 128h + 32m + 16lr + (0..15), m = 0..3.
    struct chunk {
        uint4 la, lb;  // ql[64h+16lr ..+16], ql[64h+32+16lr ..+16]
        uint4 h;       // qh[32h+16lr ..+16]
        uint4 sc;      // scales[16]
        u16 d;
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int j) {
        constexpr int A = PLANAR ? 16 : raw_align;
        const u8* ql = group_at<type_q6_K, 0, PLANAR>(w, nblk, blk) + 64 * (j >> 1) + 16 * (j & 1);
        const u8* qh = group_at<type_q6_K, 1, PLANAR>(w, nblk, blk) + 32 * (j >> 1) + 16 * (j & 1);
        constexpr bool W = K4_WIDE_RAW_Q6_K;  // raw blocks through two wide loads (device.cuh load16)
        return {load16<A, W>(ql), load16<A, W>(ql + 32), load16<A, W>(qh), load16<A, W>(group_at<type_q6_K, 2, PLANAR>(w, nblk, blk)),
                load2(group_at<type_q6_K, 3, PLANAR>(w, nblk, blk))};
    }
    // 6-bit quants (0..63) of run m, four to a word: the low nibble from ql word l (shifted, not
    // masked), bits 2m, 2m+1 of qh word h at bits 4, 5 (h masked to the pairs of m's parity, the
    // two masks shared by the four runs, then shifted), merged by one select by mask (lop3). In
    // PTX so that nvcc does not fold the shared masks into a mask per run.
    __device__ static u32 quant_word(u32 l, u32 h, int m) {
        u32 p, q;
        if (m & 1)
            asm("and.b32 %0, %1, 0xCCCCCCCC;" : "=r"(p) : "r"(h));
        else
            asm("and.b32 %0, %1, 0x33333333;" : "=r"(p) : "r"(h));
        const u32 hb = m == 0 ? p << 4 : m == 1 ? p << 2 : m == 2 ? p : p >> 2;  // bits 6, 7 clear
        asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(q) : "r"(l >> (4 * (m >> 1))), "r"(hb), "n"(0x0F0F0F0Fu));
        return q;
    }
    __device__ static uint4 quants(const chunk& c, int m) {
        const uint4& l = m & 1 ? c.lb : c.la;
        return make_uint4(quant_word(l.x, c.h.x, m), quant_word(l.y, c.h.y, m), quant_word(l.z, c.h.z, m), quant_word(l.w, c.h.w, m));
    }
    // signed scale of run m
    __device__ static int scale(const chunk& c, int j, int m) {
        const u32 wd = (j >> 1) ? (m >> 1 ? c.sc.w : c.sc.z) : (m >> 1 ? c.sc.y : c.sc.x);
        return (int)(i8)(wd >> (8 * (j & 1) + 16 * (m & 1)));
    }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int j = ci & 3;
        const int u = 8 * (ci >> 1) + (ci & 1);  // x unit of run m: u + 2m
        const x_row xr = x_row_of(u, SWZ);  // the four units lie in one row of 8
        const float4 dx = *reinterpret_cast<const float4*>(x.d + 4 * (ci >> 1));
        int s[4];  // the runs' integer dots, runs 0, 2 (one qh mask), then 1, 3: in order 0..3 the 64-register
                   // instances (row blocks, 32 warps) spilled
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = i < 2 ? 2 * i : 2 * i - 3;
            s[m] = dot16(quants(c, m), x.unit_at(xr, 2 * m), 0);
        }
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const float dxm = m == 0 ? dx.x : m == 1 ? dx.y : m == 2 ? dx.z : dx.w;
            acc += (float)scale(c, j, m) * (dxm * (float)s[m] - 32.f * x.s[u + 2 * m]);
        }
        return f16_to_f32(c.d) * acc;
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int m, OUT* row) {  // run m (0..3)
        const int j = ci & 3;
        const float ds = __fmul_rn(f16_to_f32(c.d), (float)scale(c, j, m));
        const uint4 q = quants(c, m);
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(ds, (float)((int)((word(q, i >> 2) >> (8 * (i & 3))) & 0xFF) - 32));
        store16(row + 256 * (ci >> 2) + 128 * (j >> 1) + 32 * m + 16 * (j & 1), v);
    }
};
static_assert(cuts_are<type_q6_K>(K4_GROUPS_Q6_K), "type_q6_K::cut: runtime/cuda/constants.py has other planar groups");

struct type_q8_0 {
    static constexpr int block_bytes = sizeof(block_q8_0), block_elems = QK8_0, chunk_elems = K4_CHUNK_Q8_0;
    static constexpr int raw_align = 2, x_swizzle = K4_X_SWIZZLE_Q8_0;
    static constexpr bool handoff = K4_HANDOFF_Q8_0;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q8_0 && K4_PLANAR_EXPERTS;
    // groups: d | qs
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)(sizeof(block_q8_0) - sizeof(block_q8_0::qs)) : (int)sizeof(block_q8_0);
    }
    struct chunk {
        uint4 q0, q1;  // qs[0..31]
        u16 d;
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int) {
        constexpr int A = PLANAR ? 16 : raw_align;
        const u8* qs = group_at<type_q8_0, 1, PLANAR>(w, nblk, blk);
        return {load16<A>(qs), load16<A>(qs + 16), load2(group_at<type_q8_0, 0, PLANAR>(w, nblk, blk))};
    }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int s = dot16(c.q1, x.unit(2 * ci + 1), dot16(c.q0, x.unit(2 * ci), 0));
        return f16_to_f32(c.d) * x.d[ci] * (float)s;
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int r, OUT* row) {  // run r: weights 16r..16r+15
        const float d = f16_to_f32(c.d);
        const uint4 q = r ? c.q1 : c.q0;
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fmul_rn((float)(i8)(word(q, i >> 2) >> (8 * (i & 3))), d);
        store16(row + 32 * ci + 16 * r, v);
    }
};
static_assert(cuts_are<type_q8_0>(K4_GROUPS_Q8_0), "type_q8_0::cut: runtime/cuda/constants.py has other planar groups");

struct type_q5_0 {
    static constexpr int block_bytes = sizeof(block_q5_0), block_elems = QK5_0, chunk_elems = K4_CHUNK_Q5_0;
    static constexpr int raw_align = 2, x_swizzle = K4_X_SWIZZLE_Q5_0;
    static constexpr bool handoff = K4_HANDOFF_Q5_0;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q5_0 && K4_PLANAR_EXPERTS;
    // groups: d | qh | qs
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)sizeof(block_q5_0::d) : g == 2 ? (int)(sizeof(block_q5_0) - sizeof(block_q5_0::qs)) : (int)sizeof(block_q5_0);
    }
    struct chunk {
        uint4 q;  // qs[16]: weights i (low nibble) and i+16 (high)
        u32 qh;   // bit i: 5th bit of weight i
        u16 d;
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int) {
        constexpr int A = PLANAR ? 16 : raw_align;
        return {load16<A>(group_at<type_q5_0, 2, PLANAR>(w, nblk, blk)), load4<A>(group_at<type_q5_0, 1, PLANAR>(w, nblk, blk)),
                load2(group_at<type_q5_0, 0, PLANAR>(w, nblk, blk))};
    }
    // bits 0..3 of n, one per byte, at bit 4 of bytes 0..3 (the four copies n<<7k do not overlap)
    __device__ static u32 spread4(u32 n) { return ((n * 0x00204081u) & 0x01010101u) << 4; }
    // 5-bit quants (0..31) of half r (weights 16r..16r+15)
    __device__ static uint4 quants(const chunk& c, int r) {
        const uint4 l = map4(c.q, 4 * r, 0x0F0F0F0Fu);
        const u32 h = c.qh >> (16 * r);
        return make_uint4(l.x | spread4(h & 0xF), l.y | spread4((h >> 4) & 0xF), l.z | spread4((h >> 8) & 0xF), l.w | spread4((h >> 12) & 0xF));
    }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int s = dot16(quants(c, 1), x.unit(2 * ci + 1), dot16(quants(c, 0), x.unit(2 * ci), 0));
        return f16_to_f32(c.d) * (x.d[ci] * (float)s - 16.f * (x.s[2 * ci] + x.s[2 * ci + 1]));
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int r, OUT* row) {  // run r: weights 16r..16r+15
        const float d = f16_to_f32(c.d);
        const uint4 q = quants(c, r);
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(d, (float)((int)((word(q, i >> 2) >> (8 * (i & 3))) & 0xFF) - 16));
        store16(row + 32 * ci + 16 * r, v);
    }
};
static_assert(cuts_are<type_q5_0>(K4_GROUPS_Q5_0), "type_q5_0::cut: runtime/cuda/constants.py has other planar groups");

struct type_q5_1 {
    static constexpr int block_bytes = sizeof(block_q5_1), block_elems = QK5_1, chunk_elems = K4_CHUNK_Q5_1;
    static constexpr int raw_align = 4, x_swizzle = K4_X_SWIZZLE_Q5_1;
    static constexpr bool handoff = K4_HANDOFF_Q5_1;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q5_1 && K4_PLANAR_EXPERTS;
    // groups: d | m | qh | qs
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? 2 : g == 2 ? 4 : g == 3 ? (int)(sizeof(block_q5_1) - sizeof(block_q5_1::qs)) : (int)sizeof(block_q5_1);
    }
    struct chunk {
        uint4 q;  // qs[16]: weights i (low nibble) and i+16 (high)
        u32 qh;   // bit i: 5th bit of weight i
        u16 d, m;
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int) {
        constexpr int A = PLANAR ? 16 : raw_align;
        return {load16<A>(group_at<type_q5_1, 3, PLANAR>(w, nblk, blk)), load4<A>(group_at<type_q5_1, 2, PLANAR>(w, nblk, blk)),
                load2(group_at<type_q5_1, 0, PLANAR>(w, nblk, blk)), load2(group_at<type_q5_1, 1, PLANAR>(w, nblk, blk))};
    }
    // 5-bit quants (0..31) of half r (weights 16r..16r+15): the same bit layout as Q5_0
    __device__ static uint4 quants(const chunk& c, int r) {
        const uint4 l = map4(c.q, 4 * r, 0x0F0F0F0Fu);
        const u32 h = c.qh >> (16 * r);
        return make_uint4(l.x | type_q5_0::spread4(h & 0xF), l.y | type_q5_0::spread4((h >> 4) & 0xF),
                          l.z | type_q5_0::spread4((h >> 8) & 0xF), l.w | type_q5_0::spread4((h >> 12) & 0xF));
    }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int s = dot16(quants(c, 1), x.unit(2 * ci + 1), dot16(quants(c, 0), x.unit(2 * ci), 0));
        return f16_to_f32(c.d) * x.d[ci] * (float)s + f16_to_f32(c.m) * (x.s[2 * ci] + x.s[2 * ci + 1]);
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int r, OUT* row) {  // run r: weights 16r..16r+15
        const float d = f16_to_f32(c.d), m = f16_to_f32(c.m);
        const uint4 q = quants(c, r);
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fadd_rn(__fmul_rn((float)((word(q, i >> 2) >> (8 * (i & 3))) & 0xFF), d), m);
        store16(row + 32 * ci + 16 * r, v);
    }
};
static_assert(cuts_are<type_q5_1>(K4_GROUPS_Q5_1), "type_q5_1::cut: runtime/cuda/constants.py has other planar groups");

#include "decoders_lowbit.cuh"  // type_q2_K, type_q3_K, type_q4_0, type_iq4_xs, type_iq4_nl

// Unquantized types: `per16` weights per 16 bytes, unpacked to float.
struct type_f32 {
    static constexpr int elem_bytes = 4, per16 = 4;
    __device__ static float get(const u8* row, i64 i) { return __ldg(reinterpret_cast<const float*>(row) + i); }
    __device__ static void unpack(const uint4& v, float (&f)[per16]) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y); f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    }
};

struct type_f16 {
    static constexpr int elem_bytes = 2, per16 = 8;
    __device__ static float get(const u8* row, i64 i) { return f16_to_f32(__ldg(reinterpret_cast<const u16*>(row) + i)); }
    __device__ static void unpack(const uint4& v, float (&f)[per16]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            f[2 * k] = f16_to_f32(word(v, k) & 0xFFFF);
            f[2 * k + 1] = f16_to_f32(word(v, k) >> 16);
        }
    }
};

struct type_bf16 {
    static constexpr int elem_bytes = 2, per16 = 8;
    __device__ static float get(const u8* row, i64 i) { return bf16_to_f32(__ldg(reinterpret_cast<const u16*>(row) + i)); }
    __device__ static void unpack(const uint4& v, float (&f)[per16]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            f[2 * k] = __uint_as_float(word(v, k) << 16);
            f[2 * k + 1] = __uint_as_float(word(v, k) & 0xFFFF0000u);
        }
    }
};
