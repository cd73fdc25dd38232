// Products of 1 to 8 tokens on int8 tensor cores, reading the weights once: for each of n_tok rows
// of X, Y[t] = W @ X[t] (+ bias) (+ residual[t]), or with GLU the gate/up epilogue of gemv_q8
// (act(gate . x) * (up . x), act silu or with GELU gelu_tanh). Q4_K and Q6_K weights, raw or planar
// (common.cuh). For speculative decoding's verify step (runtime/cuda/gemv_mma.py): gemv_q8_batch
// (gemv_batch.cu) does the same on dp4a and is bound by that integer work at 8 tokens.
//
// The product per 16 weight rows and 32 (Q6_K: 16) inputs is one mma.sync: the weights' quants are
// the A operand (16 rows x k), the 8 tokens' 8-bit x the B operand (k x 8 tokens, tokens past
// n_tok are zeros), and the int32 result is each (row, token)'s exact integer dot over one scale
// group of the weight type, which the float epilogue scales as gemv's T::dot does:
//   Q4_K, m16n8k32 per sub-block j of 32: d * sc_j * dx * dot - dmin * m_j * dx * sum(x quants),
//   Q6_K, m16n8k16 per group i of 16:    d * sc_i * dx * (dot - 32 * sum(x quants)), the -32 sum
//         entering as the mma's C operand, so the int32 result is the dot with q - 32.
// x is quantized as gemv_q8 quantizes it (q8_unit: per 32 values d = max|x| / 127, quants
// rint(x * 127 / max|x|), llama.cpp's q8_1 idea), by every block into its shared memory, or
// copied from X quantized once by quantize_q8_rows (x_q8: 1.25 instead of 4 bytes of L2 reads per
// value and token in every block, the prologue's cost: 8 x 4 x 11008 bytes per block for down).
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k32" / "for mma.m16n8k16" with .s8
// integers: lane = 4 g + t holds A rows g and g + 8 at k 4t..4t+3 (and 16+4t..16+4t+3 for k32),
// B token g at the same k, C rows g, g + 8 x tokens 2t, 2t + 1.
//
// Weights: per weight row and 256-weight block, Q4_K: lane t of a quad loads 8 bytes of each
// 32-byte piece of qs, which are the fragment's k 4t..4t+3 and 16+4t..16+4t+3 in a permuted k
// order that x's natural layout matches (mma_q4_K); Q6_K: the four lanes load the quants as
// 16-byte pieces (lane t piece t and t + 4 of ql, piece t of qh) and swap words among themselves
// (quad_transpose) so that lane t holds word t (quants 4t..4t+3) of every piece: the k order of
// the mma fragments. The scale bytes are loaded by all four lanes (one transaction).
//
// Thread mapping: the block's WARPS warps take TILES = WARPS / KS tiles of 16 weight rows at a
// step (tile TILES * step + w / KS; KS chosen per matrix by the launcher, so that the steps
// spread over the grid: runtime/cuda/gemv_mma.py mma_ks); the KS warps of a tile split its 256-weight blocks (warp w
// takes blocks w % KS, w % KS + KS, ...), the next block's weights loading during the current
// one's mma and epilogue (also across steps). At the end of a step the warps' partial sums meet
// in shared memory (two buffers: one __syncthreads per step) and TILES * 128 threads, one per
// (row, token), add the KS partials and write Y with the epilogue. Steps: blockIdx.x, + gridDim.x,
// ... Each warp asks L2 for its blocks PREFETCH_AHEAD blocks ahead of their use
// (prefetch.global.L2; the first ones before the wait for X), so the weights stream from memory
// while X is staged and while a step's partials are summed. Rows of a tile past the matrix load
// the last row again and are not written. With GLU the
// weight rows interleave gate and up (2 n_out rows): the thread of a gate row reads its up row's
// sums too.
//
// Shared memory (mma8_smem bytes, runtime/cuda/constants.py): for S = n_in / 32 sub-blocks
//   xq  (S, 8, 32) int8: token n's quants of sub-block s at 256 s + 32 n, value p (0..31) at byte
//       p (Q4_K: NATURAL_X) or 8 ((p & 15) >> 2) + 4 (p >> 4) + (p & 3) (Q6_K), so lane 4g + t
//       reads its B fragment as the 8 bytes at 256 s + 8 lane (conflict-free): values 8t..8t+7 of
//       token g (Q4_K), 4t..4t+3 and 16+4t..16+4t+3 (Q6_K);
//   xsc, 32 S words: Q6_K: (S, 4, 8) words: at 32 s + 8 t for tokens 2t, 2t + 1: dx (float, the 32
//       values' q8 scale), dx * sum of the 32 quants (float), -32 * the sum of quants 0..15 (int),
//       of 16..31 (int); Q4_K (NATURAL_X): dx (S, 8 tokens) floats, then per 256-weight block
//       (S / 8, 32 lanes) float4: for lane 4g + t, sx = dx * the sum of quants of sub-blocks t and
//       t + 4 of token g, rounded to tf32 (hi), then their remainders sx - hi (the B fragments of
//       mma_q4_K's mins product); the rest unused;
//   red (2, WARPS, 32) float4: the warps' partial sums, in their C fragment order.
// The launcher validates shapes, strides, alignment and that the shared memory fits.
#include "gemv_common.cuh"

static_assert(MMA8_TOKENS == 8, "MMA8_TOKENS (runtime/cuda/constants.py) is the n of the mma shapes used here");

// xq and xsc: per 32 inputs 32 bytes and 4 words per token; red: two float4 per lane of each warp.
__host__ __device__ constexpr int mma8_smem(int n_in, int warps) {
    return (n_in / 32) * MMA8_TOKENS * (32 + 16) + warps * 32 * 16 * 2;
}

__host__ __device__ constexpr bool mma8_smem_agrees() {
    constexpr int rows[] = {K4_CHECK_MMA8_SMEM};  // n_in, warps, bytes
    for (int i = 0; i < (int)(sizeof(rows) / sizeof(int)); i += 3)
        if (mma8_smem(rows[i], rows[i + 1]) != rows[i + 2]) return false;
    return true;
}
static_assert(mma8_smem_agrees(), "gemv_mma's shared memory differs from runtime/cuda/constants.py mma8_smem");

// Lane t of each quad holds piece t (4 words); returns word t of pieces 0..3 (a 4x4 transpose
// over the quad: two exchanges of two words).
__device__ __forceinline__ uint4 quad_transpose(const uint4& v, int t) {
    const bool hi = t & 2, odd = t & 1;
    u32 r0 = __shfl_xor_sync(0xffffffffu, hi ? v.x : v.z, 2);
    u32 r1 = __shfl_xor_sync(0xffffffffu, hi ? v.y : v.w, 2);
    const uint4 a = hi ? make_uint4(r0, r1, v.z, v.w) : make_uint4(v.x, v.y, r0, r1);  // 2x2 blocks of words in place
    r0 = __shfl_xor_sync(0xffffffffu, odd ? a.x : a.y, 1);
    r1 = __shfl_xor_sync(0xffffffffu, odd ? a.z : a.w, 1);
    return odd ? make_uint4(r0, a.y, r1, a.w) : make_uint4(a.x, r0, a.z, r1);
}

// Bring the 128-byte line holding p into L2 (a hint: no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// d = a (16x32 s8, row) * b (32x8 s8, col), exact int32.
__device__ __forceinline__ void mma_k32(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

// d = a (16x16 s8, row) * b (16x8 s8, col) + c, exact int32.
__device__ __forceinline__ void mma_k16(int (&d)[4], u32 a0, u32 a1, u32 b0, int c0, int c1) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %7, %8};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(c0), "r"(c1));
}

// d = a (16x32 u8, row) * b (32x8 s8, col), exact int32: Q4_K's quants as unsigned bytes, so a
// high nibble masked in place (16 q, 0..240) needs no shift.
__device__ __forceinline__ void mma_k32_u8(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

// d += a (16x8 tf32, row) * b (8x8 tf32, col) in float32 (the operands' low 13 mantissa bits unused).
__device__ __forceinline__ void mma_tf32(float (&d)[4], float a0, float a1, float a2, float a3, float b0, float b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)), "r"(__float_as_uint(a3)),
          "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// v rounded to tf32 (nearest, ties away: cvt.rna), as a float: the high part of a two-term split.
__device__ __forceinline__ float tf32_hi(float v) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return __uint_as_float(r);
}

// (float)v for |v| < 2^22, exactly: v added to the bits of 1.5 * 2^23 (whose last mantissa bit
// is 1), minus 1.5 * 2^23. Two full-rate instructions (and the add folds into an IMAD) instead
// of I2F, which sm_90 issues at a quarter of the FP32 rate: the products' epilogue converts
// 4 of them per mma.
__device__ __forceinline__ float magic_int_to_float(int v) { return __int_as_float(0x4B400000 + v) - 12582912.f; }

// Q4_K (ggml-common.h block_q4_K): sub-block j = 2c + h of a block is the low (h 0) or high (h 1)
// nibbles of qs[32c .. 32c + 31], its value p in byte 32c + p. A dot product may take its terms in
// any order, so lane t of a quad loads bytes 8t .. 8t + 7 of each 32-byte piece c (one 8-byte
// load, no exchange between lanes) and gives them to the mma as k 4t .. 4t + 3 (the first word)
// and 16 + 4t .. 16 + 4t + 3 (the second); x is stored in its natural order (NATURAL_X), so the
// same lane's B fragment, the 8 bytes at 8t of token g's 32 quants, holds the x of the same values.
struct mma_q4_K {
    using T = type_q4_K;
    static constexpr bool NATURAL_X = true;
    struct row {         // one weight row's share of a block, for lane t of a quad
        uint4 meta;      // d, dmin (fp16), scales[12]: the same in the quad's four lanes
        uint2 q[4];      // qs bytes 32c + 8t .. 32c + 8t + 7, c = 0..3
    };
    template <bool PLANAR>
    __device__ static row load(const u8* w, i64 nblk, i64 blk, int t) {
        constexpr int A = PLANAR ? 16 : T::raw_align;
        const u8* qs = group_at<T, 1, PLANAR>(w, nblk, blk) + 8 * t;
        return {load16<A>(group_at<T, 0, PLANAR>(w, nblk, blk)), {load8(qs), load8(qs + 32), load8(qs + 64), load8(qs + 96)}};
    }
    template <bool PLANAR>
    __device__ static void prefetch(const u8* w, i64 nblk, i64 blk, int t) {  // the lines load reads
        const u8* qs = group_at<T, 1, PLANAR>(w, nblk, blk) + 16 * t;
        prefetch_l2(group_at<T, 0, PLANAR>(w, nblk, blk));
        prefetch_l2(qs);
        prefetch_l2(qs + 64);
    }
    // The 6-bit scales (sc) and mins (m) of sub-blocks 0..3 and 4..7 as four packed bytes each
    // (get_scale_min_k4's bits, four at a time).
    struct scales {
        u32 sc_lo, sc_hi, m_lo, m_hi;
        __device__ explicit scales(const uint4& meta)
            : sc_lo(meta.y & 0x3F3F3F3Fu), sc_hi((meta.w & 0x0F0F0F0Fu) | ((meta.y >> 2) & 0x30303030u)),
              m_lo(meta.z & 0x3F3F3F3Fu), m_hi(((meta.w >> 4) & 0x0F0F0F0Fu) | ((meta.z >> 2) & 0x30303030u)) {}
        __device__ int sc(int j) const { return ((j < 4 ? sc_lo : sc_hi) >> (8 * (j & 3))) & 0xFF; }
    };
    // acc (C order: rows g, g + 8 x tokens 2t, 2t + 1) += the block's products of rows r0 (g) and
    // r1 (g + 8) with the x of its 8 sub-blocks (block kb of xq, xsc: the layouts of the file's
    // header). Per sub-block j: the int8 mma, then d * sc_j * dx_j * dot (a high nibble's dot comes
    // out 16 times too large, masked in place, and is shifted back: exact). The mins' part,
    // dmin * sum_j m_j * (dx_j * sum of x quants of j), is one 16 x 8 x 8 product of the rows' m
    // (exact in tf32) with the tokens' sums, split in a tf32 high and low part (two mma): the
    // float32 sum to about 2^-21.
    __device__ static void dot(const row& r0, const row& r1, const u8* xq, const u32* xsc, int n_sub, int kb, int lane,
                               float (&acc)[4]) {
        const int t = lane & 3;
        const scales s0(r0.meta), s1(r1.meta);
        const float* dx = reinterpret_cast<const float*>(xsc) + 8 * 8 * kb + 2 * t;  // tokens 2t, 2t + 1 of sub-block 8 kb
        float dot_s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int c = j >> 1, sh = 4 * (j & 1);
            const u32 mask = j & 1 ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
            const uint2 b = *reinterpret_cast<const uint2*>(xq + 256 * (8 * kb + j) + 8 * lane);
            int d[4];
            mma_k32_u8(d, r0.q[c].x & mask, r1.q[c].x & mask, r0.q[c].y & mask, r1.q[c].y & mask, b.x, b.y);
            const int sa = s0.sc(j), sb = s1.sc(j);
            const float2 xs = *reinterpret_cast<const float2*>(dx + 8 * j);
            dot_s[0] += xs.x * magic_int_to_float(sa * (d[0] >> sh));
            dot_s[1] += xs.y * magic_int_to_float(sa * (d[1] >> sh));
            dot_s[2] += xs.x * magic_int_to_float(sb * (d[2] >> sh));
            dot_s[3] += xs.y * magic_int_to_float(sb * (d[3] >> sh));
        }
        // A: m of sub-blocks t and t + 4 of rows g and g + 8 (the tf32 fragment's k = t, t + 4)
        const u32 sel = 0x7540u + t;  // byte t into the low byte of 2^23's bits
        const float a0 = __int_as_float(__byte_perm(s0.m_lo, 0x4B000000u, sel)) - 8388608.f;
        const float a1 = __int_as_float(__byte_perm(s1.m_lo, 0x4B000000u, sel)) - 8388608.f;
        const float a2 = __int_as_float(__byte_perm(s0.m_hi, 0x4B000000u, sel)) - 8388608.f;
        const float a3 = __int_as_float(__byte_perm(s1.m_hi, 0x4B000000u, sel)) - 8388608.f;
        const float4 bs = reinterpret_cast<const float4*>(xsc + 8 * n_sub)[32 * kb + lane];  // hi (t, t + 4), lo (t, t + 4)
        float mins[4] = {0.f, 0.f, 0.f, 0.f};
        mma_tf32(mins, a0, a1, a2, a3, bs.x, bs.y);
        mma_tf32(mins, a0, a1, a2, a3, bs.z, bs.w);
        const float d0 = f16_to_f32(r0.meta.x & 0xFFFF), dmin0 = f16_to_f32(r0.meta.x >> 16);
        const float d1 = f16_to_f32(r1.meta.x & 0xFFFF), dmin1 = f16_to_f32(r1.meta.x >> 16);
        acc[0] += d0 * dot_s[0] - dmin0 * mins[0];
        acc[1] += d0 * dot_s[1] - dmin0 * mins[1];
        acc[2] += d1 * dot_s[2] - dmin1 * mins[2];
        acc[3] += d1 * dot_s[3] - dmin1 * mins[3];
    }
};

// Q6_K (ggml-common.h block_q6_K): group i = 8h + 2m + l of 16 values (scale scales[i]) has value
// e at ql[64h + 32 (m & 1) + 16l + e] (nibble m >> 1), i.e. ql piece 4h + 2 (m & 1) + l, and the
// high bits 2m, 2m + 1 of qh[32h + 16l + e], qh piece 2h + l (type_q6_K's order).
struct mma_q6_K {
    using T = type_q6_K;
    static constexpr bool NATURAL_X = false;
    struct row {         // one weight row's share of a block, for lane t of a quad
        uint4 la, lb;    // ql pieces t and t + 4 (bytes 16t .., 64 + 16t ..)
        uint4 h;         // qh piece t
        uint4 sc;        // scales[16]: the same in the quad's four lanes
        u16 d;
    };
    template <bool PLANAR>
    __device__ static row load(const u8* w, i64 nblk, i64 blk, int t) {
        constexpr int A = PLANAR ? 16 : T::raw_align;
        const u8* ql = group_at<T, 0, PLANAR>(w, nblk, blk) + 16 * t;
        return {load16<A>(ql), load16<A>(ql + 64), load16<A>(group_at<T, 1, PLANAR>(w, nblk, blk) + 16 * t),
                load16<A>(group_at<T, 2, PLANAR>(w, nblk, blk)), load2(group_at<T, 3, PLANAR>(w, nblk, blk))};
    }
    template <bool PLANAR>
    __device__ static void prefetch(const u8* w, i64 nblk, i64 blk, int t) {  // the lines load reads
        const u8* ql = group_at<T, 0, PLANAR>(w, nblk, blk) + 16 * t;
        prefetch_l2(ql);
        prefetch_l2(ql + 64);
        prefetch_l2(group_at<T, 1, PLANAR>(w, nblk, blk) + 16 * t);
        prefetch_l2(group_at<T, 2, PLANAR>(w, nblk, blk));
        prefetch_l2(group_at<T, 3, PLANAR>(w, nblk, blk));
    }
    // quants 4t..4t+3 of group i (0..63 each), from word t of the ql and qh pieces (l: ql halves, h: qh)
    __device__ static u32 quants(const uint4 (&l)[2], const uint4& h, int i) {
        const int half = i >> 3, m = (i >> 1) & 3, lr = i & 1;
        const u32 lo = (word(l[half], 2 * (m & 1) + lr) >> (4 * (m >> 1))) & 0x0F0F0F0Fu;
        return lo | type_q6_K::hbits(word(h, 2 * half + lr), m);
    }
    // as mma_q4_K::dot
    __device__ static void dot(const row& r0, const row& r1, const u8* xq, const u32* xsc, int n_sub, int kb, int lane,
                               float (&acc)[4]) {
        xq += 256 * 8 * kb;
        xsc += 32 * 8 * kb;
        const int t = lane & 3;
        const uint4 l0[2] = {quad_transpose(r0.la, t), quad_transpose(r0.lb, t)}, h0 = quad_transpose(r0.h, t);
        const uint4 l1[2] = {quad_transpose(r1.la, t), quad_transpose(r1.lb, t)}, h1 = quad_transpose(r1.h, t);
        float dot_s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < 8; ++s) {  // sub-block s of 32: groups 2s, 2s + 1
            const uint2 b = *reinterpret_cast<const uint2*>(xq + 256 * s + 8 * lane);
            const float2 dx = *reinterpret_cast<const float2*>(xsc + 32 * s + 8 * t);     // tokens 2t, 2t + 1
            const int4 c32 = *reinterpret_cast<const int4*>(xsc + 32 * s + 8 * t + 4);  // -32 sums: 2s (x, y), 2s + 1 (z, w)
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int i = 2 * s + k;
                int d[4];
                mma_k16(d, quants(l0, h0, i), quants(l1, h1, i), k ? b.y : b.x, k ? c32.z : c32.x, k ? c32.w : c32.y);
                const int sa = (int)(i8)(word(r0.sc, i >> 2) >> (8 * (i & 3)));
                const int sb = (int)(i8)(word(r1.sc, i >> 2) >> (8 * (i & 3)));
                dot_s[0] += dx.x * (float)(sa * d[0]);
                dot_s[1] += dx.y * (float)(sa * d[1]);
                dot_s[2] += dx.x * (float)(sb * d[2]);
                dot_s[3] += dx.y * (float)(sb * d[3]);
            }
        }
        const float d0 = f16_to_f32(r0.d), d1 = f16_to_f32(r1.d);
        acc[0] += d0 * dot_s[0];
        acc[1] += d0 * dot_s[1];
        acc[2] += d1 * dot_s[2];
        acc[3] += d1 * dot_s[3];
    }
};

// X (n_tok rows of n_in floats, x_stride apart, 16-byte aligned, n_in a multiple of 32) quantized
// into xq, xsc for MMA8_TOKENS tokens (tokens n_tok.. all zero), by the whole block (blockDim.x a
// multiple of 32); or, with x_q8 non-null, the same quants and scales copied from X quantized
// beforehand (gemv_batch.cu quantize_q8_rows: n_tok q8 x of q8x_bytes(n_in) bytes, swizzle SWZ),
// the sums recomputed from the quants: the same bytes. Thread f takes 16 values: unit h = f & 1
// of sub-block s = f >> 4 of token (f >> 1) & 7; the two units of a sub-block sit in adjacent
// lanes (one scale, as q8_unit), which swap halves so that each stores 16 consecutive bytes of xq
// (a warp writes 512 contiguous bytes). NATURAL (the decoder's NATURAL_X): xq holds token n's
// value p of sub-block s at 256 s + 32 n + p instead, each unit stored as it is.
template <int SWZ, bool NATURAL>
__device__ void mma8_stage_x(const float* __restrict__ x, int x_stride, const u8* __restrict__ x_q8, int n_tok, int n_in,
                             u8* xq, u32* xsc) {
    const int total = MMA8_TOKENS * (n_in >> 4);
    for (int base = 0; base < total; base += blockDim.x) {  // warp-uniform trip count
        const int f = base + threadIdx.x;
        const int h = f & 1, tok = (f >> 1) & (MMA8_TOKENS - 1), s = f >> 4;
        const bool ok = f < total && tok < n_tok;
        u32 q[4];  // word k: values 4k..4k+3 of the unit
        int sum = 0;
        float d;
        if (x_q8) {  // block-uniform
            const u8* row = x_q8 + (i64)(ok ? tok : 0) * q8x_bytes(n_in);
            const uint4* unit = reinterpret_cast<const uint4*>(row + 16 * x_unit_slot(2 * s + h, SWZ));
            const uint4 v = ok ? __ldg(unit) : make_uint4(0, 0, 0, 0);
            d = ok ? __ldg(reinterpret_cast<const float*>(row + q8x_bytes_q(n_in)) + s) : 0.f;
            q[0] = v.x; q[1] = v.y; q[2] = v.z; q[3] = v.w;
#pragma unroll
            for (int k = 0; k < 4; ++k) sum = dp4a((int)q[k], 0x01010101, sum);
        } else {
            const float4* src = reinterpret_cast<const float4*>(x + (i64)(ok ? tok : 0) * x_stride) + (ok ? 4 * (2 * s + h) : 0);
            float v[16];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float4 g = ok ? __ldg(src + k) : make_float4(0.f, 0.f, 0.f, 0.f);
                v[4 * k] = g.x; v[4 * k + 1] = g.y; v[4 * k + 2] = g.z; v[4 * k + 3] = g.w;
            }
            float amax = 0.f;
#pragma unroll
            for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            d = amax * (1.f / 127.f);
            const float id = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;  // as q8_unit
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                q[k] = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int qi = __float2int_rn(v[4 * k + b] * id);
                    sum += qi;
                    q[k] |= (u32)(qi & 0xFF) << (8 * b);
                }
            }
        }
        // xq bytes 0..15 of (s, tok) are words 0, 1 of both units (unit 0's first), 16..31 words 2, 3:
        // unit 0 keeps words 0, 1 and receives unit 1's; unit 1 keeps words 2, 3 and receives unit 0's
        // (NATURAL: each unit's 16 bytes as they are, values in order)
        const u32 s0 = NATURAL ? 0 : __shfl_xor_sync(0xffffffffu, h ? q[0] : q[2], 1);
        const u32 s1 = NATURAL ? 0 : __shfl_xor_sync(0xffffffffu, h ? q[1] : q[3], 1);
        const int other = __shfl_xor_sync(0xffffffffu, sum, 1);
        if (f < total) {
            const uint4 out = NATURAL ? make_uint4(q[0], q[1], q[2], q[3])
                              : h     ? make_uint4(s0, q[2], s1, q[3])
                                      : make_uint4(q[0], s0, q[1], s1);
            *reinterpret_cast<uint4*>(xq + 256 * s + 32 * tok + 16 * h) = out;
            if (NATURAL) {  // mma_q4_K's layout (the header): dx, and dx * the sum split in tf32 high and low
                if (!h) {
                    float* dxs = reinterpret_cast<float*>(xsc);
                    const float sx = d * (float)(sum + other), hi = tf32_hi(sx);
                    dxs[8 * s + tok] = d;
                    float* mb = dxs + 8 * (n_in >> 5) + 128 * (s >> 3) + 4 * (4 * tok + (s & 3)) + ((s >> 2) & 1);
                    mb[0] = hi;
                    mb[2] = sx - hi;
                }
            } else {
                u32* sc = xsc + 32 * s + 8 * (tok >> 1) + (tok & 1);
                if (!h) {
                    sc[0] = __float_as_uint(d);
                    sc[2] = __float_as_uint(d * (float)(sum + other));
                }
                sc[4 + 2 * h] = (u32)(-32 * sum);
            }
        }
    }
}

// Blocks (256 weights x 16 rows) each warp asks of L2 ahead of their use: 8 warps x 8 x 2.3 KB
// (Q4_K) to 3.4 KB (Q6_K) per multiprocessor, 19-28 MB in all, under the H200's L2 whatever the
// matrix (a whole step ahead would be the whole 37 MB of a 4096 x 11008 Q6_K matrix).
constexpr int PREFETCH_AHEAD = 8;

// Dynamic shared memory: mma8_smem(n_in, WARPS) bytes. M: mma_q4_K or mma_q6_K.
template <class M, bool PLANAR, int WARPS, bool GLU, bool GELU = false>
__global__ void __launch_bounds__(WARPS * 32, 1)
gemv_mma(const u8* __restrict__ w,        // (n_out, n_in) in M::T's blocks, raw or planar; GLU: (2 n_out, n_in) interleaved
         const float* __restrict__ x,     // (n_tok, n_in) rows x_stride floats apart, 16-byte aligned
         int x_stride,
         float* y,                        // (n_tok, n_out) rows y_stride floats apart
         int y_stride,
         const float* residual,           // (n_tok, n_out) rows r_stride apart, or null; may alias y (not with GLU)
         int r_stride,
         const float* __restrict__ bias,  // (n_out,) or null, added to every row (not with GLU)
         int n_out, int n_in, int n_tok,  // 1 <= n_tok <= MMA8_TOKENS, n_in a multiple of QK_K
         int KS,                          // warps per tile: a divisor of WARPS, at least 4 (gemv_mma.py mma_ks)
         const u8* __restrict__ x_q8) {   // n_tok * q8x_bytes(n_in) (quantize_q8_rows, swizzle M::T::x_swizzle) or null
                                          // (X already quantized: X is then not read)
    const int TILES = WARPS / KS;  // 16-row tiles per step; TILES * 128 <= WARPS * 32: a thread per (row, token) of them
    extern __shared__ uint4 smem[];
    const int n_sub = n_in / 32;
    u8* xq = reinterpret_cast<u8*>(smem);
    u32* xsc = reinterpret_cast<u32*>(xq + 256 * n_sub);
    float4* red = reinterpret_cast<float4*>(xsc + 32 * n_sub);  // (2, WARPS, 32)

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slot = warp / KS, kl = warp % KS;
    const int nblk_row = n_in / QK_K;
    const int n_rows = GLU ? 2 * n_out : n_out;  // weight rows
    const i64 nblk = (i64)n_rows * nblk_row;
    const int n_steps = (n_rows + 16 * TILES - 1) / (16 * TILES);

    typename M::row cur0, cur1, nx0, nx1;  // rows g, g + 8 of this warp's tile: the block in use, the next one
    // The first blocks of rows g and g + 8 of a step's tile (recomputed when the step changes).
    struct rows_at {
        int step = -1;
        i64 b0 = 0, b1 = 0;
    };
    auto locate = [&](rows_at& at, int step) {
        if (step == at.step) return;
        const int row = 16 * (TILES * step + slot) + (lane >> 2);
        at = {step, (i64)min(row, n_rows - 1) * nblk_row, (i64)min(row + 8, n_rows - 1) * nblk_row};
    };
    rows_at ld_at, pf_at;
    auto load = [&](typename M::row& r0, typename M::row& r1, int step, int kb) {
        locate(ld_at, step);
        r0 = M::template load<PLANAR>(w, nblk, ld_at.b0 + kb, lane & 3);
        r1 = M::template load<PLANAR>(w, nblk, ld_at.b1 + kb, lane & 3);
    };
    // This warp's blocks in order: (step, kb), kb = kl, kl + KS, ... then the next step.
    auto advance = [&](int& step, int& kb) {
        kb += KS;
        if (kb >= nblk_row) {
            step += gridDim.x;
            kb = kl;
        }
    };
    int pf_step = blockIdx.x, pf_kb = kl;  // the next block of the sequence to ask of L2
    auto prefetch_next = [&]() {
        if (pf_step >= n_steps || kl >= nblk_row) return;
        locate(pf_at, pf_step);
        M::template prefetch<PLANAR>(w, nblk, pf_at.b0 + pf_kb, lane & 3);
        M::template prefetch<PLANAR>(w, nblk, pf_at.b1 + pf_kb, lane & 3);
        advance(pf_step, pf_kb);
    };
    pdl_trigger();
    if ((int)blockIdx.x < n_steps && kl < nblk_row) load(cur0, cur1, blockIdx.x, kl);  // weights only: before the wait
#pragma unroll 1
    for (int i = 0; i < PREFETCH_AHEAD; ++i) prefetch_next();  // streaming from memory while X is staged
    pdl_wait();
    mma8_stage_x<M::T::x_swizzle, M::NATURAL_X>(x, x_stride, x_q8, n_tok, n_in, xq, xsc);
    __syncthreads();

    int buf = 0;
    for (int step = blockIdx.x; step < n_steps; step += gridDim.x) {  // block-uniform
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        // block kb of the step, in a0/a1, while the next one of the sequence loads into b0/b1
        auto item = [&](const typename M::row& a0, const typename M::row& a1, typename M::row& b0, typename M::row& b1, int kb) {
            prefetch_next();  // PREFETCH_AHEAD blocks ahead of this one
            int next_step = step, next_kb = kb;
            advance(next_step, next_kb);
            if (next_step < n_steps) load(b0, b1, next_step, next_kb);
            M::dot(a0, a1, xq, xsc, n_sub, kb, lane, acc);
        };
        for (int kb = kl; kb < nblk_row; kb += 2 * KS) {  // two blocks a trip, the buffers trading roles
            item(cur0, cur1, nx0, nx1, kb);
            if (kb + KS >= nblk_row) {  // an odd count: the next block is in nx
                cur0 = nx0;
                cur1 = nx1;
                break;
            }
            item(nx0, nx1, cur0, cur1, kb + KS);
        }
        red[(buf * WARPS + warp) * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();
        const int f = threadIdx.x;  // (tile slot, lane, C register) of one output
        if (f < TILES * 128) {
            const int sl = f >> 7, ln = (f >> 2) & 31, reg = f & 3;
            const float* part = reinterpret_cast<const float*>(red + (buf * WARPS + sl * KS) * 32);
            float v = 0.f;
            for (int k = 0; k < KS; ++k) v += part[128 * k + 4 * ln + reg];
            const int row = 16 * (TILES * step + sl) + (ln >> 2) + 8 * (reg >> 1);  // weight row
            const int tok = 2 * (ln & 3) + (reg & 1);
            if (GLU) {
                if (!(row & 1) && row < n_rows && tok < n_tok) {  // a gate row: its up row is the next, lane ln + 4
                    float u = 0.f;
                    for (int k = 0; k < KS; ++k) u += part[128 * k + 4 * (ln + 4) + reg];
                    y[(i64)tok * y_stride + row / 2] = glu_act<GELU>(v, u);
                }
            } else if (row < n_out && tok < n_tok) {
                write_row(y + (i64)tok * y_stride, residual ? residual + (i64)tok * r_stride : nullptr, bias, row, v);
            }
        }
        buf ^= 1;
    }
}
