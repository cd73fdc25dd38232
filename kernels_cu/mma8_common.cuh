// What the int8 tensor-core products of a few tokens share (kernels_cu/gemv_mma_staged.cu, and
// gemv_mma.cu for raw Q6_K; runtime/cuda/gemv_mma.py): the mma.sync wrappers, two exact
// conversions, the shared-memory size, the 8 tokens' x quantized into shared memory in either
// layout, Q6_K's block product, and a step's end (the warps' partial sums added, Y written).
//
// x is quantized as gemv_q8 quantizes it (q8_unit: per 32 values d = max|x| / 127, quants
// rint(x * 127 / max|x|), llama.cpp's q8_1 idea), by every block into its shared memory, or
// copied from X quantized once by quantize_q8_rows (x_q8: 1.25 instead of 4 bytes of L2 reads per
// value and token in every block). Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k32",
// "for mma.m16n8k16" (.s8, .u8) and "for mma.m16n8k8" (.tf32): lane = 4 g + t holds A rows g and
// g + 8, B column (token) g, C rows g, g + 8 x tokens 2t, 2t + 1.
#pragma once
#include "gemv_common.cuh"

static_assert(MMA8_TOKENS == 8, "MMA8_TOKENS (runtime/cuda/constants.py) is the n of the mma shapes used here");

// x of the 8 tokens (xq, xsc) and the warps' partial sums (red, two buffers): per 32 inputs 32
// bytes and 4 words per token; two float4 per lane of each warp. gemv_mma_staged.cu adds its rings.
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

// The Q4_K layout's dx words per 256-weight block: 4 token pairs, each 16 words padded to 20 so
// that the four pairs' 16-byte reads fall in different banks.
constexpr int Q4X_DX_T_WORDS = 20, Q4X_DX_WORDS = 4 * Q4X_DX_T_WORDS;
static_assert(Q4X_DX_WORDS + 128 <= 8 * 4 * MMA8_TOKENS, "the Q4_K x layout fits in xsc's 32 words per sub-block");

// Units of x_q8 a thread of mma8_stage_x loads at once (one L2 round trip a round).
constexpr int MMA8_X_ROUND = 4;

// Bring the 128-byte line holding p into L2 (a hint: no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

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

// The RMSNorm scales 1 / sqrt(sum / n + eps) of tokens 0..7 (1 past n_tok), in every lane, from
// the sums of squares parts[t * n_parts .. + n_parts) of an NQ handoff (mma8_step_nq), summed in
// one order: lane l adds parts l, l + 32, ... of each token (up to 4 per token issued at once,
// before any is added), then warp_sum. Every lane of the warp calls it; every warp of every block
// gets the same values.
__device__ __forceinline__ void mma8_parts_scales(const float* __restrict__ parts, int n_parts, int n_tok, int n, float eps,
                                                  float (&r)[MMA8_TOKENS]) {
    const int lane = threadIdx.x & 31;
    float s[MMA8_TOKENS];
#pragma unroll
    for (int t = 0; t < MMA8_TOKENS; ++t) s[t] = 0.f;
    for (int base = 0; base < n_parts; base += 128) {  // one pass up to 128 parts
        float v[MMA8_TOKENS][4];
#pragma unroll
        for (int t = 0; t < MMA8_TOKENS; ++t)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int i = base + 32 * k + lane;
                v[t][k] = t < n_tok && i < n_parts ? __ldg(parts + (i64)t * n_parts + i) : 0.f;
            }
#pragma unroll
        for (int t = 0; t < MMA8_TOKENS; ++t) s[t] += (v[t][0] + v[t][1]) + (v[t][2] + v[t][3]);
    }
#pragma unroll
    for (int t = 0; t < MMA8_TOKENS; ++t) r[t] = t < n_tok ? rsqrtf(warp_sum(s[t]) / (float)n + eps) : 1.f;
}

// Unit f of mma8_stage_x's order (f < total: stored; every lane of the warp calls it, for the
// shuffles) into xq, xsc: its quants q (word k: values 4k..4k+3), their sum and its scale d.
template <bool NATURAL>
__device__ __forceinline__ void mma8_put_unit(int f, int total, const u32 (&q)[4], int sum, float d, int n_in, u8* xq, u32* xsc) {
    const int h = f & 1, tok = (f >> 1) & (MMA8_TOKENS - 1), s = f >> 4;
    // xq bytes 0..15 of (s, tok) are words 0, 1 of both units (unit 0's first), 16..31 words 2, 3:
    // unit 0 keeps words 0, 1 and receives unit 1's; unit 1 keeps words 2, 3 and receives unit 0's
    // (NATURAL: each unit's words as they are)
    const u32 s0 = NATURAL ? 0 : __shfl_xor_sync(0xffffffffu, h ? q[0] : q[2], 1);
    const u32 s1 = NATURAL ? 0 : __shfl_xor_sync(0xffffffffu, h ? q[1] : q[3], 1);
    const int other = __shfl_xor_sync(0xffffffffu, sum, 1);
    if (f >= total) return;
    if (NATURAL) {  // the Q4_K layout (gemv_mma_staged.cu): B pairs, padded dx, the mins' B split in tf32 high and low
        const int kb = s >> 3, j = s & 7;
        uint2* pair = reinterpret_cast<uint2*>(xq + 2048 * kb + 512 * (j >> 1) + 8 * (j & 1));
        pair[2 * (4 * tok + 2 * h)] = make_uint2(q[0], q[1]);      // values 16h .. 16h + 7: lane 4 tok + 2h
        pair[2 * (4 * tok + 2 * h + 1)] = make_uint2(q[2], q[3]);  // 16h + 8 .. 16h + 15: the next lane
        if (!h) {
            float* xs = reinterpret_cast<float*>(xsc);
            const float sx = d * (float)(sum + other), hi = tf32_hi(sx);
            xs[Q4X_DX_WORDS * kb + Q4X_DX_T_WORDS * (tok >> 1) + 2 * j + (tok & 1)] = d;
            float* mb = xs + Q4X_DX_WORDS * (n_in >> 8) + 128 * kb + 4 * (4 * tok + (j & 3)) + (j >> 2);
            mb[0] = hi;
            mb[2] = sx - hi;
        }
    } else {
        *reinterpret_cast<uint4*>(xq + 256 * s + 32 * tok + 16 * h) = h ? make_uint4(s0, q[2], s1, q[3]) : make_uint4(q[0], s0, q[1], s1);
        u32* sc = xsc + 32 * s + 8 * (tok >> 1) + (tok & 1);
        if (!h) {
            sc[0] = __float_as_uint(d);
            sc[2] = __float_as_uint(d * (float)(sum + other));
        }
        sc[4 + 2 * h] = (u32)(-32 * sum);
    }
}

// X (n_tok rows of n_in floats, x_stride apart, 16-byte aligned, n_in a multiple of 32) quantized
// into xq, xsc for MMA8_TOKENS tokens (tokens n_tok.. all zero), by the whole block (blockDim.x a
// multiple of 32); or, with x_q8 non-null, the same quants and scales copied from X quantized
// beforehand (gemv_batch.cu quantize_q8_rows, norm.cu rms_norm_q8: n_tok q8 x of q8x_bytes(n_in)
// bytes, swizzle swz, any),
// the sums recomputed from the quants: the same bytes. Thread f takes 16 values: unit h = f & 1
// of sub-block s = f >> 4 of token (f >> 1) & 7; the two units of a sub-block sit in adjacent
// lanes (one scale, as q8_unit), which swap halves so that each stores 16 consecutive bytes of xq
// (a warp writes 512 contiguous bytes). NATURAL: the Q4_K layout of gemv_mma_staged.cu instead (its
// header), each unit's words stored as they are. x_parts (with x_q8; null: none): x_q8 is an NQ
// handoff (mma8_step_nq: y * norm_w quantized without the norm's scale), token t's sums of y^2 at
// x_parts[t * n_parts ..]; each d is multiplied by token t's 1 / sqrt(sum / n_in + eps), summed
// in one order in every warp (mma8_parts_scales), so the staged x is RMSNorm(y) * norm_w's.
// A thread's x_q8 loads go out MMA8_X_ROUND units at a time, all before any is stored: one L2
// round trip per round instead of per unit. then(): called once by every thread, right after the
// first round's loads are issued (with float x, before its first loads): the caller's weight loads
// that should queue behind x's.
// Units [f0, f1) only (f0 a multiple of 128: whole 256-input blocks; default all): unit f stored
// as unit f - f0 of a layout of n_lay inputs (default n_in), so a block of a cluster that takes
// blocks [f0 / 128, f1 / 128) of every row (gemv_mma_staged.cu CL) holds just those.
template <bool NATURAL, class Then>
__device__ void mma8_stage_x(const float* __restrict__ x, int x_stride, const u8* __restrict__ x_q8, int swz, int n_tok, int n_in,
                             u8* xq, u32* xsc, const float* __restrict__ x_parts, int n_parts, float eps, Then then,
                             int f0 = 0, int f1 = -1, int n_lay = -1) {
    const int total = f1 < 0 ? MMA8_TOKENS * (n_in >> 4) : f1;
    if (n_lay < 0) n_lay = n_in;
    if (!x_q8) then();  // block-uniform
    if (x_q8) {
        float scale[MMA8_TOKENS];  // per token: its RMSNorm scale (an NQ handoff), found in the first round
#pragma unroll
        for (int t = 0; t < MMA8_TOKENS; ++t) scale[t] = 1.f;
        for (int base = f0; base < total; base += MMA8_X_ROUND * (int)blockDim.x) {  // warp-uniform trip count
            uint4 v[MMA8_X_ROUND];
            float dv[MMA8_X_ROUND];
#pragma unroll
            for (int r = 0; r < MMA8_X_ROUND; ++r) {
                const int f = base + r * blockDim.x + threadIdx.x;
                const int h = f & 1, tok = (f >> 1) & (MMA8_TOKENS - 1), s = f >> 4;
                const bool ok = f < total && tok < n_tok;
                const u8* row = x_q8 + (i64)(ok ? tok : 0) * q8x_bytes(n_in);
                v[r] = ok ? __ldg(reinterpret_cast<const uint4*>(row + 16 * x_unit_slot(2 * s + h, swz))) : make_uint4(0, 0, 0, 0);
                dv[r] = ok ? __ldg(reinterpret_cast<const float*>(row + q8x_bytes_q(n_in)) + s) : 0.f;
            }
            if (base == f0) {
                then();
                if (x_parts) mma8_parts_scales(x_parts, n_parts, n_tok, n_in, eps, scale);  // with the first loads in flight
            }
#pragma unroll
            for (int r = 0; r < MMA8_X_ROUND; ++r) {
                const int f = base + r * blockDim.x + threadIdx.x, tok = (f >> 1) & (MMA8_TOKENS - 1);
                float d = dv[r];
                if (x_parts) {
                    float st = scale[0];
#pragma unroll
                    for (int t = 1; t < MMA8_TOKENS; ++t) st = tok == t ? scale[t] : st;  // selects, not an indexed array
                    d *= st;
                }
                const u32 q[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
                int sum = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) sum = dp4a((int)q[k], 0x01010101, sum);
                mma8_put_unit<NATURAL>(f - f0, total - f0, q, sum, d, n_lay, xq, xsc);
            }
        }
        return;
    }
    for (int base = f0; base < total; base += blockDim.x) {  // warp-uniform trip count
        const int f = base + threadIdx.x;
        const int h = f & 1, tok = (f >> 1) & (MMA8_TOKENS - 1), s = f >> 4;
        const bool ok = f < total && tok < n_tok;
        u32 q[4];
        int sum = 0;
        float v[16];
        load_unit16(x + (i64)(ok ? tok : 0) * x_stride + (ok ? 16 * (2 * s + h) : 0), ok, v);
        const float d = q8_pack16(v, q, sum);  // q8_unit's arithmetic: the same bits
        mma8_put_unit<NATURAL>(f - f0, total - f0, q, sum, d, n_lay, xq, xsc);
    }
}

// Q6_K (ggml-common.h block_q6_K): group i = 8h + 2m + l of 16 values (scale scales[i]) has value
// e at ql[64h + 32 (m & 1) + 16l + e] (nibble m >> 1), i.e. ql piece 4h + 2 (m & 1) + l, and the
// high bits 2m, 2m + 1 of qh[32h + 16l + e], qh piece 2h + l (type_q6_K's order). Quants 4t..4t+3
// of group i (0..63 each), from word t of the ql pieces (l[0]: 0..3, l[1]: 4..7) and qh pieces (h).
__device__ __forceinline__ u32 q6k_quants(const uint4 (&l)[2], const uint4& h, int i) {
    const int half = i >> 3, m = (i >> 1) & 3, lr = i & 1;
    return type_q6_K::quant_word(word(l[half], 2 * (m & 1) + lr), word(h, 2 * half + lr), m);
}

// Byte i (0..3) of w as a signed int: one prmt in its generic form, whose selector nibbles with the
// msb set replicate the selected byte's sign over the upper three bytes (PTX ISA, prmt).
__device__ __forceinline__ int sbyte(u32 w, int i) {
    int r;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(w), "r"(i | (0x8 | i) << 4 | (0x8 | i) << 8 | (0x8 | i) << 12));
    return r;
}

// acc (C order: rows g, g + 8 x tokens 2t, 2t + 1) += one Q6_K block of rows g (l0, h0: word t
// of its ql and qh pieces, sc0 its 16 scales, d0 its scale) and g + 8 (l1, h1, sc1, d1) times the
// x of its 8 sub-blocks at xq, xsc (gemv_mma.cu's layout): per group one m16n8k16 mma with -32 *
// the sum of x's quants as C (the dot with q - 32, |dot| <= 16 * 32 * 127 < 2^16); the two groups
// of a sub-block (one dx) meet in int32, sc_a dot_a + sc_b dot_b (|.| <= 2 * 128 * 2^16 < 2^24,
// so exact as a float), and dx times that is the sub-block's one float rounding.
__device__ __forceinline__ void q6k_dot(const uint4 (&l0)[2], const uint4& h0, const uint4& sc0, float d0,
                                        const uint4 (&l1)[2], const uint4& h1, const uint4& sc1, float d1,
                                        const u8* xq, const u32* xsc, int lane, float (&acc)[4]) {
    const int t = lane & 3;
    float dot_s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < 8; ++s) {  // sub-block s of 32: groups 2s, 2s + 1
        const uint2 b = *reinterpret_cast<const uint2*>(xq + 256 * s + 8 * lane);
        const float2 dx = *reinterpret_cast<const float2*>(xsc + 32 * s + 8 * t);     // tokens 2t, 2t + 1
        const int4 c32 = *reinterpret_cast<const int4*>(xsc + 32 * s + 8 * t + 4);  // -32 sums: 2s (x, y), 2s + 1 (z, w)
        int da[4], db[4];
        mma_k16(da, q6k_quants(l0, h0, 2 * s), q6k_quants(l1, h1, 2 * s), b.x, c32.x, c32.y);
        mma_k16(db, q6k_quants(l0, h0, 2 * s + 1), q6k_quants(l1, h1, 2 * s + 1), b.y, c32.z, c32.w);
        const u32 w0 = word(sc0, s >> 1), w1 = word(sc1, s >> 1);  // scales 2s, 2s + 1: bytes 2 (s & 1), + 1
        const int a0 = sbyte(w0, 2 * (s & 1)), b0 = sbyte(w0, 2 * (s & 1) + 1);
        const int a1 = sbyte(w1, 2 * (s & 1)), b1 = sbyte(w1, 2 * (s & 1) + 1);
        dot_s[0] += dx.x * (float)(a0 * da[0] + b0 * db[0]);
        dot_s[1] += dx.y * (float)(a0 * da[1] + b0 * db[1]);
        dot_s[2] += dx.x * (float)(a1 * da[2] + b1 * db[2]);
        dot_s[3] += dx.y * (float)(a1 * da[3] + b1 * db[3]);
    }
    acc[0] += d0 * dot_s[0];
    acc[1] += d0 * dot_s[1];
    acc[2] += d1 * dot_s[2];
    acc[3] += d1 * dot_s[3];
}

// The runs of 16 outputs a token that a step of TILES tiles writes: 16 rows a tile, 8 outputs
// with GLU (a gate row and its up row make one).
__host__ __device__ constexpr int mma8_step_units(int tiles, bool glu) { return glu ? tiles / 2 : tiles; }

// The end of a step: TILES * 128 threads, one per (tile slot, row, token) of the step's TILES
// tiles, add the KS warps' partial sums from red (WARPS, 32) float4, warp slot * KS + k holding
// tile slot's k-th share in C order, and write Y (the GLU epilogue from a gate row and its up row,
// the next weight row, lane + 4). ys (null: none): each Y value written also at
// ys[MMA8_NQ_RUN (U token + r / 16) + r % 16], r its output in the step and U = mma8_step_units
// (TILES, GLU) its runs of 16 a token, for mma8_step_nq.
// With CL > 1 (gemv_mma_staged.cu's clusters), red holds CL such sets of partial sums, each
// set_stride float4 after the one before (the blocks of a cluster, rank order), added in that
// order after the KS shares of each.
template <bool GLU, bool GELU>
__device__ void mma8_step_out(const float4* red, int KS, int TILES, int step, int n_rows, int n_out, int n_tok,
                              float* y, int y_stride, const float* residual, int r_stride, const float* __restrict__ bias,
                              float* ys = nullptr, int CL = 1, int set_stride = 0, int f = -1) {
    if (f < 0) f = threadIdx.x;  // (tile slot, lane, C register) of one output: by default the thread's
    if (f >= TILES * 128) return;
    const int sl = f >> 7, ln = (f >> 2) & 31, reg = f & 3;
    const float* part = reinterpret_cast<const float*>(red + sl * KS * 32);
    float v = 0.f;
    for (int c = 0; c < CL; ++c)
        for (int k = 0; k < KS; ++k) v += part[4 * set_stride * c + 128 * k + 4 * ln + reg];
    const int row = 16 * (TILES * step + sl) + (ln >> 2) + 8 * (reg >> 1);  // weight row
    const int tok = 2 * (ln & 3) + (reg & 1);
    if (GLU) {
        if (!(row & 1) && row < n_rows && tok < n_tok) {  // a gate row: its up row is the next, lane ln + 4
            float u = 0.f;
            for (int c = 0; c < CL; ++c)
                for (int k = 0; k < KS; ++k) u += part[4 * set_stride * c + 128 * k + 4 * (ln + 4) + reg];
            const float out = glu_act<GELU>(v, u);
            y[(i64)tok * y_stride + row / 2] = out;
            if (ys) {  // 8 outputs a tile
                const int r = row / 2 - 8 * TILES * step;
                ys[MMA8_NQ_RUN * (mma8_step_units(TILES, true) * tok + (r >> 4)) + (r & 15)] = out;
            }
        }
    } else if (row < n_out && tok < n_tok) {
        if (bias) v += bias[row];  // write_row's sums, in its order (through write_row, nvcc schedules these kernels otherwise)
        if (residual) v += residual[(i64)tok * r_stride + row];
        y[(i64)tok * y_stride + row] = v;
        if (ys) {  // a token's run of 16 values in MMA8_NQ_RUN words: mma8_step_nq's lanes read without bank conflicts
            const int r = row - 16 * TILES * step;
            ys[MMA8_NQ_RUN * (mma8_step_units(TILES, false) * tok + (r >> 4)) + (r & 15)] = v;
        }
    }
}

// A step's Y handed over quantized (its U = mma8_step_units runs of 16 outputs a token, U 2 or 4,
// at ys as mma8_step_out wrote them; n_out a multiple of 32): token t's y, or with norm_w (an NQ
// handoff, for the products after the RMSNorm of Y with weight norm_w) y * norm_w quantized
// without the norm's scale, into its q8 x at q8 + t * q8x_bytes(n_out) (swizzle swz, q8_unit's
// bytes: the same as quantize_q8_rows of Y, or of Y * norm_w), and with norm_w the step's sum of
// its y^2 at parts[t * n_parts + step] (n_parts: the product's steps, every one of which writes
// its rows). The reader of an NQ handoff (mma8_stage_x with x_parts) scales each d by the norm.
// One warp (the caller's choice): lane l = U t + i takes outputs 16 i .. 16 i + 15 of the step's
// of token t (at ys[MMA8_NQ_RUN l ..]); the two halves of a scale sit in adjacent lanes, as q8_unit needs.
__device__ void mma8_step_nq(const float* ys, int U, int step, int n_out, int n_tok, const float* __restrict__ norm_w, u8* q8,
                             float* parts, int n_parts, int swz) {
    const int lane = threadIdx.x & 31, tok = lane / U, i = lane % U;
    const int row = 16 * (U * step + i);  // the run's first output
    const bool ok = tok < n_tok && row < n_out;  // lanes past 8 U have tok >= 8 >= n_tok
    float v[16], ss = 0.f;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const float yv = ok ? ys[MMA8_NQ_RUN * lane + k] : 0.f;
        ss += yv * yv;
        v[k] = !ok ? 0.f : norm_w ? yv * __ldg(norm_w + row + k) : yv;
    }
    q8_row_put(v, ok, row >> 4, n_out, swz, q8 + (i64)(ok ? tok : 0) * q8x_bytes(n_out));
    if (!norm_w) return;
    for (int o = 1; o < U; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (ok && i == 0) parts[(i64)tok * n_parts + step] = ss;
}
