// Products of 1 to 8 tokens of raw Q6_K weights on int8 tensor cores, reading the weights once:
// for each of n_tok rows of X, Y[t] = W @ X[t] (+ bias) (+ residual[t]), or with GLU the gate/up
// epilogue of gemv_q8 (act(gate . x) * (up . x), act silu or with GELU gelu_tanh). Raw weights
// (quant_layouts.cuh; planar ones too, but gemv_mma_staged.cu takes those, and Q4_K). Speculative
// decoding's verify step (runtime/cuda/gemv_mma.py); mma8_common.cuh holds what they share.
//
// Per 16 weight rows and group i of 16 inputs: one m16n8k16 mma of the rows' quants (A) with the
// 8 tokens' 8-bit x (B; tokens past n_tok are zeros), whose int32 result, with -32 * the sum of
// the x quants as the C operand, is each (row, token)'s exact integer dot with q - 32; the float
// epilogue scales it as gemv's T::dot does: d * sc_i * dx * dot.
//
// Weights: per weight row and 256-weight block, the four lanes of a quad load the quants as
// 16-byte pieces (lane t piece t and t + 4 of ql, piece t of qh) and swap words among themselves
// (quad_transpose) so that lane t holds word t (quants 4t..4t+3) of every piece: the k order of
// the mma fragments. The scale bytes are loaded by all four lanes (one transaction).
//
// Thread mapping: the block's WARPS warps take TILES = WARPS / KS tiles of 16 weight rows at a
// step (tile TILES * step + w / KS; KS chosen per matrix by the launcher, so that the steps
// spread over the grid: runtime/cuda/gemv_mma.py mma_ks); the KS warps of a tile split its
// 256-weight blocks (warp w takes blocks w % KS, w % KS + KS, ...), the next block's weights
// loading during the current one's mma and epilogue (also across steps). At the end of a step the
// warps' partial sums meet in shared memory (two buffers: one __syncthreads per step) and
// mma8_step_out writes Y. Steps: blockIdx.x, + gridDim.x, ... Each warp asks L2 for its blocks
// PREFETCH_AHEAD blocks ahead of their use (prefetch.global.L2; the first ones before the wait
// for X), so the weights stream from memory while X is staged and while a step's partials are
// summed. Rows of a tile past the matrix load the last row again and are not written. With GLU
// the weight rows interleave gate and up (2 n_out rows).
//
// Shared memory (mma8_smem bytes, runtime/cuda/constants.py): for S = n_in / 32 sub-blocks
//   xq  (S, 8, 32) int8: token n's quants of sub-block s at 256 s + 32 n, value p (0..31) at byte
//       8 ((p & 15) >> 2) + 4 (p >> 4) + (p & 3), so lane 4g + t reads its B fragments (values
//       4t..4t+3 and 16+4t..16+4t+3 of token g) as the 8 bytes at 256 s + 8 lane: conflict-free;
//   xsc (S, 4, 8) words: at 32 s + 8 t for tokens 2t, 2t + 1: dx (float, the 32 values' q8
//       scale), dx * sum of the 32 quants (float), -32 * the sum of quants 0..15 (int), of
//       16..31 (int);
//   red (2, WARPS, 32) float4: the warps' partial sums, in their C fragment order.
// The launcher validates shapes, strides, alignment and that the shared memory fits.
#include "mma8_common.cuh"

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

// Q6_K (ggml-common.h block_q6_K), loaded by quads of lanes; the product is mma8_common.cuh q6k_dot.
struct mma_q6_K {
    using T = type_q6_K;
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
    // acc (C order: rows g, g + 8 x tokens 2t, 2t + 1) += the products of block kb of rows r0 (g)
    // and r1 (g + 8) with the x of its 8 sub-blocks (the header's layouts).
    __device__ static void dot(const row& r0, const row& r1, const u8* xq, const u32* xsc, int, int kb, int lane,
                               float (&acc)[4]) {
        const int t = lane & 3;
        const uint4 l0[2] = {quad_transpose(r0.la, t), quad_transpose(r0.lb, t)}, h0 = quad_transpose(r0.h, t);
        const uint4 l1[2] = {quad_transpose(r1.la, t), quad_transpose(r1.lb, t)}, h1 = quad_transpose(r1.h, t);
        q6k_dot(l0, h0, r0.sc, f16_to_f32(r0.d), l1, h1, r1.sc, f16_to_f32(r1.d), xq + 256 * 8 * kb, xsc + 32 * 8 * kb, lane, acc);
    }
};

// Blocks (256 weights x 16 rows) each warp asks of L2 ahead of their use: 8 warps x 8 x 3.4 KB
// (Q6_K) per multiprocessor, 28 MB in all, under the H200's L2 whatever the
// matrix (a whole step ahead would be the whole 37 MB of a 4096 x 11008 Q6_K matrix).
constexpr int PREFETCH_AHEAD = 8;

// Dynamic shared memory: mma8_smem(n_in, WARPS) bytes. M: mma_q6_K.
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
         const u8* __restrict__ x_q8,     // n_tok * q8x_bytes(n_in) (quantize_q8_rows, rms_norm_q8, an NQ product) or null
         int x_swz,                       // x_q8's swizzle (x_unit_slot)
                                          // (X already quantized: X is then not read)
         const float* __restrict__ x_parts,  // x_q8 an NQ handoff: its sums of squares (mma8_stage_x), or null
         int x_n_parts, float x_eps) {    // per token; the RMSNorm's eps
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
    mma8_stage_x<false>(x, x_stride, x_q8, x_swz, n_tok, n_in, xq, xsc, x_parts, x_n_parts, x_eps, [] {});
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
        mma8_step_out<GLU, GELU>(red + buf * WARPS * 32, KS, TILES, step, n_rows, n_out, n_tok, y, y_stride, residual, r_stride, bias);
        buf ^= 1;
    }
}
