// The block layouts and per-type decoders (decoders.cuh's interface: chunk, load, dot, dequant) of
// the types of the smaller quantized files: Q2_K and Q3_K (Q2_K and Q3_K_M files), Q4_0 (Gemma 3
// QAT releases), IQ4_XS, and IQ4_NL (llama.cpp's fallback in those files for rows that are not a
// multiple of 256). Included by decoders.cuh after its own types.
//
// Block layouts: ggml-common.h (block_q2_K, block_q3_K, block_q4_0, block_iq4_xs, block_iq4_nl,
// kvalues_iq4nl). The values: ggml-quants.c dequantize_row_q2_K / _q3_K / _q4_0 / _iq4_xs / _iq4_nl,
// as the gguf package's numpy port (gguf/quants.py Q2_K, Q3_K, Q4_0, IQ4_XS, IQ4_NL) rounds them; dequant writes those exact
// values (one IEEE float32 rounding per numpy operation, in numpy's order, no contraction).
#pragma once

#define QK4_0 K4_QK_Q4_0
#define QK4_NL K4_QK_IQ4_NL
static_assert(K4_QK_Q2_K == QK_K && K4_QK_Q3_K == QK_K && K4_QK_IQ4_XS == QK_K, "Q2_K, Q3_K and IQ4_XS blocks hold QK_K weights");

// fp16 numbers are stored as their bits (ggml_half is uint16_t).
struct block_q2_K {  // 256 weights, 2.625 bits each: w = d*sc*q - dmin*m per 16 weights, q in 0..3
    u8 scales[QK_K / 16];      // byte i: sub-block i's scale code (low 4 bits) and min code (high 4 bits)
    u8 qs[QK_K / 4];           // bits 2s..2s+1 of byte 32h+l belong to weight 128h+32s+l
    u16 d;                     // super-block scale of the scale codes
    u16 dmin;                  // super-block scale of the min codes
};
static_assert(sizeof(block_q2_K) == K4_BLOCK_BYTES_Q2_K, "block_q2_K: gguf GGML_QUANT_SIZES has another size");

struct block_q3_K {  // 256 weights, 3.4375 bits each: w = d*(sc-32)*(q-4) per 16 weights, q in 0..7
    u8 hmask[QK_K / 8];        // 3rd bit of q: bit i of byte l belongs to weight 32i+l
    u8 qs[QK_K / 4];           // low 2 bits of q, laid out as block_q2_K's qs
    u8 scales[12];             // 16 6-bit codes: low 4 bits, nibble i/8 of byte i%8; top 2, bits 2(i/4) of byte 8+i%4
    u16 d;
};
static_assert(sizeof(block_q3_K) == K4_BLOCK_BYTES_Q3_K, "block_q3_K: gguf GGML_QUANT_SIZES has another size");

struct block_q4_0 {  // 32 weights: w = d*(q-8), q in 0..15
    u16 d;
    u8 qs[QK4_0 / 2];          // byte i holds weights i (low nibble) and i+16 (high)
};
static_assert(sizeof(block_q4_0) == K4_BLOCK_BYTES_Q4_0, "block_q4_0: gguf GGML_QUANT_SIZES has another size");

struct block_iq4_xs {  // 256 weights, 4.25 bits each: w = d*(sc-32)*kvalues_iq4nl[q] per 32 weights
    u16 d;
    u16 scales_h;              // top 2 bits of sub-block i's 6-bit scale code: bits 2i..2i+1
    u8 scales_l[QK_K / 64];    // low 4 bits: nibble i%2 of byte i/2
    u8 qs[QK_K / 2];           // byte 16i+l holds weights 32i+l (low nibble) and 32i+16+l (high), l < 16
};
static_assert(sizeof(block_iq4_xs) == K4_BLOCK_BYTES_IQ4_XS, "block_iq4_xs: gguf GGML_QUANT_SIZES has another size");

struct block_iq4_nl {  // 32 weights: w = d*kvalues_iq4nl[q]
    u16 d;
    u8 qs[QK4_NL / 2];         // byte i holds weights i (low nibble) and i+16 (high)
};
static_assert(sizeof(block_iq4_nl) == K4_BLOCK_BYTES_IQ4_NL, "block_iq4_nl: gguf GGML_QUANT_SIZES has another size");

// ---- Q2_K and Q3_K: chunk j = 2h + k of a block (h, k in 0..1) covers weights 128h + 32m + 16k + i,
// run m = 0..3, i = 0..15 (16 bytes of qs, bits 2m..2m+1), so run m is sub-block 8h + 2m + k and x
// unit 8(ci >> 1) + (ci & 1) + 2m of row chunk ci (as type_q6_K's chunks). Run m of chunk ci
// lands at row offset 256(ci >> 2) + 128h + 32m + 16k.
__device__ __forceinline__ int run_offset_k(int ci, int m) { return 256 * (ci >> 2) + 128 * ((ci >> 1) & 1) + 32 * m + 16 * (ci & 1); }

struct type_q2_K {
    static constexpr int block_bytes = sizeof(block_q2_K), block_elems = QK_K, chunk_elems = K4_CHUNK_Q2_K;
    static constexpr int raw_align = 4, x_swizzle = K4_X_SWIZZLE_Q2_K;
    static constexpr bool handoff = K4_HANDOFF_Q2_K;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q2_K && K4_PLANAR_EXPERTS;
    // groups: scales | qs | d dmin
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)sizeof(block_q2_K::scales) : g == 2 ? (int)(sizeof(block_q2_K::scales) + sizeof(block_q2_K::qs))
             : (int)sizeof(block_q2_K);
    }
    struct chunk {
        uint4 q;       // qs[16j .. 16j+15]
        u32 sc0, sc1;  // scales[8h .. 8h+7]: byte 2m+k is run m's
        u32 dd;        // d (low half), dmin (high half)
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int j) {
        constexpr int A = PLANAR ? 16 : raw_align;
        const u8* sc = group_at<type_q2_K, 0, PLANAR>(w, nblk, blk) + 8 * (j >> 1);
        return {load16<A>(group_at<type_q2_K, 1, PLANAR>(w, nblk, blk) + 16 * j), load4<A>(sc), load4<A>(sc + 4),
                load4<A>(group_at<type_q2_K, 2, PLANAR>(w, nblk, blk))};
    }
    // the scale byte of run m (scale code in the low nibble, min code in the high)
    __device__ static u32 code(const chunk& c, int ci, int m) { return ((m >> 1 ? c.sc1 : c.sc0) >> (8 * (2 * (m & 1) + (ci & 1)))) & 0xFF; }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int u = 8 * (ci >> 1) + (ci & 1);  // x unit of run m: u + 2m, its scale x.d[4(ci >> 1) + m]
        const float4 dx = *reinterpret_cast<const float4*>(x.d + 4 * (ci >> 1));
        float acc_d = 0.f, acc_m = 0.f;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const u32 b = code(c, ci, m);
            const int s = dot16(map4(c.q, 2 * m, 0x03030303u), x.unit(u + 2 * m), 0);
            const float dxm = m == 0 ? dx.x : m == 1 ? dx.y : m == 2 ? dx.z : dx.w;
            acc_d += (float)(b & 0xF) * dxm * (float)s;
            acc_m += (float)(b >> 4) * x.s[u + 2 * m];
        }
        return f16_to_f32(c.dd & 0xFFFF) * acc_d - f16_to_f32(c.dd >> 16) * acc_m;
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int m, OUT* row) {  // run m (0..3)
        const u32 b = code(c, ci, m);
        const float dl = __fmul_rn(f16_to_f32(c.dd & 0xFFFF), (float)(b & 0xF)), ml = __fmul_rn(f16_to_f32(c.dd >> 16), (float)(b >> 4));
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fsub_rn(__fmul_rn(dl, (float)((word(c.q, i >> 2) >> (8 * (i & 3) + 2 * m)) & 3)), ml);
        store16(row + run_offset_k(ci, m), v);
    }
};
static_assert(cuts_are<type_q2_K>(K4_GROUPS_Q2_K), "type_q2_K::cut: runtime/cuda/constants.py has other planar groups");

struct type_q3_K {
    static constexpr int block_bytes = sizeof(block_q3_K), block_elems = QK_K, chunk_elems = K4_CHUNK_Q3_K;
    static constexpr int raw_align = 2, x_swizzle = K4_X_SWIZZLE_Q3_K;
    static constexpr bool handoff = K4_HANDOFF_Q3_K;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q3_K && K4_PLANAR_EXPERTS;
    // groups: hmask | qs | scales | d
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)sizeof(block_q3_K::hmask) : g == 2 ? (int)(sizeof(block_q3_K::hmask) + sizeof(block_q3_K::qs))
             : g == 3 ? (int)(sizeof(block_q3_K) - sizeof(block_q3_K::d)) : (int)sizeof(block_q3_K);
    }
    struct chunk {
        uint4 q;           // qs[16j .. 16j+15]
        uint4 h;           // hmask[16k .. 16k+15]: bit 4h+m of byte i is the 3rd bit of run m's weight i
        u32 s0, s1, s2;    // scales[0..11]
        u16 d;
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int j) {
        constexpr int A = PLANAR ? 16 : raw_align;
        const u8* sc = group_at<type_q3_K, 2, PLANAR>(w, nblk, blk);
        return {load16<A>(group_at<type_q3_K, 1, PLANAR>(w, nblk, blk) + 16 * j), load16<A>(group_at<type_q3_K, 0, PLANAR>(w, nblk, blk) + 16 * (j & 1)),
                load4<A>(sc), load4<A>(sc + 4), load4<A>(sc + 8), load2(group_at<type_q3_K, 3, PLANAR>(w, nblk, blk))};
    }
    // the signed scale (code - 32) of run m: sub-block 8h + 2m + k, whose low 4 bits are nibble h
    // of byte 2m + k and top 2 bits are bits 2(2h + m/2) of byte 8 + (2m + k) % 4
    __device__ static int scale(const chunk& c, int ci, int m) {
        const int b = 2 * m + (ci & 1), h = (ci >> 1) & 1;
        const u32 lo = ((b >> 2 ? c.s1 : c.s0) >> (8 * (b & 3) + 4 * h)) & 0xF;
        const u32 hi = (c.s2 >> (8 * (b & 3) + 2 * (2 * h + (m >> 1)))) & 3;
        return (int)(lo | (hi << 4)) - 32;
    }
    // q (0..7; the weight is d * scale * (q - 4)) of run m: low bits from qs, the 3rd from hmask
    __device__ static uint4 quants(const chunk& c, int ci, int m) {
        const uint4 l = map4(c.q, 2 * m, 0x03030303u), h = map4(c.h, 4 * ((ci >> 1) & 1) + m, 0x01010101u);
        return make_uint4(l.x | (h.x << 2), l.y | (h.y << 2), l.z | (h.z << 2), l.w | (h.w << 2));
    }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int u = 8 * (ci >> 1) + (ci & 1);  // as type_q2_K
        const float4 dx = *reinterpret_cast<const float4*>(x.d + 4 * (ci >> 1));
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int s = dot16(quants(c, ci, m), x.unit(u + 2 * m), 0);
            const float dxm = m == 0 ? dx.x : m == 1 ? dx.y : m == 2 ? dx.z : dx.w;
            acc += (float)scale(c, ci, m) * (dxm * (float)s - 4.f * x.s[u + 2 * m]);
        }
        return f16_to_f32(c.d) * acc;
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int m, OUT* row) {  // run m (0..3)
        const float dl = __fmul_rn(f16_to_f32(c.d), (float)scale(c, ci, m));
        const uint4 q = quants(c, ci, m);
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(dl, (float)((int)((word(q, i >> 2) >> (8 * (i & 3))) & 0xFF) - 4));
        store16(row + run_offset_k(ci, m), v);
    }
};
static_assert(cuts_are<type_q3_K>(K4_GROUPS_Q3_K), "type_q3_K::cut: runtime/cuda/constants.py has other planar groups");

// The block of Q4_0 and IQ4_NL (d | qs[16]: 32 weights as nibbles, i low and i + 16 high): the
// planar cut, the chunk of one block and its load. Self: the decoder (group_at's type).
template <class Self, class Block>
struct nibble32_block {
    // groups: d | qs
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)sizeof(Block::d) : (int)sizeof(Block);
    }
    struct chunk {
        uint4 q;  // qs[16]: weights i (low nibble) and i+16 (high)
        u16 d;
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int) {
        constexpr int A = PLANAR ? 16 : Self::raw_align;
        return {load16<A>(group_at<Self, 1, PLANAR>(w, nblk, blk)), load2(group_at<Self, 0, PLANAR>(w, nblk, blk))};
    }
};

struct type_q4_0 : nibble32_block<type_q4_0, block_q4_0> {
    static constexpr int block_bytes = sizeof(block_q4_0), block_elems = QK4_0, chunk_elems = K4_CHUNK_Q4_0;
    static constexpr int raw_align = 2, x_swizzle = K4_X_SWIZZLE_Q4_0;
    static constexpr bool handoff = K4_HANDOFF_Q4_0;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_Q4_0 && K4_PLANAR_EXPERTS;
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int s = dot16(map4(c.q, 4, 0x0F0F0F0Fu), x.unit(2 * ci + 1), dot16(map4(c.q, 0, 0x0F0F0F0Fu), x.unit(2 * ci), 0));
        return f16_to_f32(c.d) * (x.d[ci] * (float)s - 8.f * (x.s[2 * ci] + x.s[2 * ci + 1]));
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int r, OUT* row) {  // run r: weights 16r..16r+15
        const float d = f16_to_f32(c.d);
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(d, (float)(nibble(c.q, i, 4 * r) - 8));
        store16(row + 32 * ci + 16 * r, v);
    }
};
static_assert(cuts_are<type_q4_0>(K4_GROUPS_Q4_0), "type_q4_0::cut: runtime/cuda/constants.py has other planar groups");

// ---- IQ4_XS: 4-bit indices into ggml's non-linear table kvalues_iq4nl (16 int8 values, from
// runtime/cuda/constants.py IQ4NL_VALUES, the gguf package's IQ4_NL.kvalues).
__host__ __device__ constexpr u32 iq4nl_word(int k) {  // table entries 4k..4k+3 as packed int8
    const int v[] = {K4_IQ4NL_VALUES};
    return (u32)(v[4 * k] & 0xFF) | (u32)(v[4 * k + 1] & 0xFF) << 8 | (u32)(v[4 * k + 2] & 0xFF) << 16 | (u32)(v[4 * k + 3] & 0xFF) << 24;
}
__host__ __device__ constexpr bool iq4nl_fits() {
    const int v[] = {K4_IQ4NL_VALUES};
    for (int i = 0; i < 16; ++i)
        if (v[i] < -128 || v[i] > 127) return false;
    return sizeof(v) == 16 * sizeof(int);
}
static_assert(iq4nl_fits(), "K4_IQ4NL_VALUES: 16 int8 values");

// The table values of four indices (0..15, one per byte of idx), as four int8 in one word: two
// byte permutes pick from entries 0-7 and 8-15 by the low 3 bits, bit 3 chooses between them.
__device__ __forceinline__ u32 iq4nl_lookup(u32 idx) {
    constexpr u32 t0 = iq4nl_word(0), t1 = iq4nl_word(1), t2 = iq4nl_word(2), t3 = iq4nl_word(3);
    const u32 v = idx & 0x07070707u;
    const u32 p = v | (v >> 4);                          // byte 2i: index 2i in bits 0-2, index 2i+1 in bits 4-6
    const u32 sel = (p & 0xFFu) | ((p >> 8) & 0xFF00u);  // nibble i: index i
    const u32 upper = ((idx >> 3) & 0x01010101u) * 0xFFu;
    return (__byte_perm(t0, t1, sel) & ~upper) | (__byte_perm(t2, t3, sel) & upper);
}

__device__ __forceinline__ uint4 iq4nl_lookup4(const uint4& q, int shift) {
    const uint4 i = map4(q, shift, 0x0F0F0F0Fu);
    return make_uint4(iq4nl_lookup(i.x), iq4nl_lookup(i.y), iq4nl_lookup(i.z), iq4nl_lookup(i.w));
}

struct type_iq4_xs {
    static constexpr int block_bytes = sizeof(block_iq4_xs), block_elems = QK_K, chunk_elems = K4_CHUNK_IQ4_XS;
    static constexpr int raw_align = 8, x_swizzle = K4_X_SWIZZLE_IQ4_XS;
    static constexpr bool handoff = K4_HANDOFF_IQ4_XS;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_IQ4_XS && K4_PLANAR_EXPERTS;
    // groups: d, scales_h and scales_l (8 bytes) | qs
    __host__ __device__ static constexpr int cut(int g) {
        return g == 0 ? 0 : g == 1 ? (int)(sizeof(block_iq4_xs) - sizeof(block_iq4_xs::qs)) : (int)sizeof(block_iq4_xs);
    }
    // Chunk j: sub-blocks 2j (q0) and 2j+1 (q1), weights 64j .. 64j+63; run r (0..3) is x unit
    // 4ci + r: the low (r even) or high nibbles of q0 (r < 2) or q1.
    struct chunk {
        u32 dh;        // d (low half), scales_h (high half)
        u32 sl;        // scales_l[4]
        uint4 q0, q1;  // qs[32j .. 32j+31]
    };
    template <bool PLANAR>
    __device__ static chunk load(const u8* w, i64 nblk, i64 blk, int j) {
        constexpr int A = PLANAR ? 16 : raw_align;
        const u8* meta = group_at<type_iq4_xs, 0, PLANAR>(w, nblk, blk);
        const u8* qs = group_at<type_iq4_xs, 1, PLANAR>(w, nblk, blk) + 32 * j;
        return {load4<A>(meta), load4<A>(meta + 4), load16<A>(qs), load16<A>(qs + 16)};
    }
    // the signed scale (code - 32) of sub-block sb (0..7)
    __device__ static int scale(const chunk& c, int sb) {
        const u32 lo = (c.sl >> (4 * sb)) & 0xF, hi = (c.dh >> (16 + 2 * sb)) & 3;
        return (int)(lo | (hi << 4)) - 32;
    }
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int j = ci & 3, u = 4 * ci;
        const int s0 = dot16(iq4nl_lookup4(c.q0, 4), x.unit(u + 1), dot16(iq4nl_lookup4(c.q0, 0), x.unit(u), 0));
        const int s1 = dot16(iq4nl_lookup4(c.q1, 4), x.unit(u + 3), dot16(iq4nl_lookup4(c.q1, 0), x.unit(u + 2), 0));
        const float2 dx = *reinterpret_cast<const float2*>(x.d + 2 * ci);
        return f16_to_f32(c.dh & 0xFFFF) * ((float)scale(c, 2 * j) * dx.x * (float)s0 + (float)scale(c, 2 * j + 1) * dx.y * (float)s1);
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int r, OUT* row) {  // run r (0..3): weights 64ci + 16r ..
        const float dl = __fmul_rn(f16_to_f32(c.dh & 0xFFFF), (float)scale(c, 2 * (ci & 3) + (r >> 1)));
        const uint4 vals = iq4nl_lookup4(r >> 1 ? c.q1 : c.q0, 4 * (r & 1));
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(dl, (float)(i8)(word(vals, i >> 2) >> (8 * (i & 3))));
        store16(row + 64 * ci + 16 * r, v);
    }
};
static_assert(cuts_are<type_iq4_xs>(K4_GROUPS_IQ4_XS), "type_iq4_xs::cut: runtime/cuda/constants.py has other planar groups");

struct type_iq4_nl : nibble32_block<type_iq4_nl, block_iq4_nl> {  // Q4_0's layout with IQ4_XS's values
    static constexpr int block_bytes = sizeof(block_iq4_nl), block_elems = QK4_NL, chunk_elems = K4_CHUNK_IQ4_NL;
    static constexpr int raw_align = 2, x_swizzle = K4_X_SWIZZLE_IQ4_NL;
    static constexpr bool handoff = K4_HANDOFF_IQ4_NL;  // gemv.cu: its SwiGLU instance can write a q8 y
    // expert tensors in the planar layout (constants.py QuantLayout.expert_planar, switch K4_PLANAR_EXPERTS)
    static constexpr bool expert_planar = K4_EXPERT_PLANAR_IQ4_NL && K4_PLANAR_EXPERTS;
    template <int SWZ>
    __device__ static float dot(const chunk& c, int ci, const q8x<SWZ>& x) {
        const int s = dot16(iq4nl_lookup4(c.q, 4), x.unit(2 * ci + 1), dot16(iq4nl_lookup4(c.q, 0), x.unit(2 * ci), 0));
        return f16_to_f32(c.d) * x.d[ci] * (float)s;
    }
    template <class OUT>
    __device__ static void dequant(const chunk& c, int ci, int r, OUT* row) {  // run r: weights 16r..16r+15
        const float d = f16_to_f32(c.d);
        const uint4 vals = iq4nl_lookup4(c.q, 4 * r);
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(d, (float)(i8)(word(vals, i >> 2) >> (8 * (i & 3))));
        store16(row + 32 * ci + 16 * r, v);
    }
};
static_assert(cuts_are<type_iq4_nl>(K4_GROUPS_IQ4_NL), "type_iq4_nl::cut: runtime/cuda/constants.py has other planar groups");
