// Products of 1 to 8 tokens on int8 tensor cores with the weights staged in shared memory: for
// each of n_tok rows of X, Y[t] = W @ X[t] (+ bias) (+ residual[t]), or with GLU the gate/up
// epilogue of gemv_q8 (act(gate . x) * (up . x), act silu or with GELU gelu_tanh). Q4_K weights
// raw or planar (staged_q4_K), Q6_K planar (staged_q6_K; raw Q6_K, whose 210-byte blocks are not
// 16-byte aligned, runs gemv_mma.cu's register kernel). Speculative decoding's verify step
// (runtime/cuda/gemv_mma.py); mma8_common.cuh holds what the kernels share.
//
// Q4_K, per 16 weight rows and sub-block j of 32 inputs: one m16n8k32 mma of the rows' 4-bit
// quants (u8, A) with the 8 tokens' 8-bit x (s8, B; tokens past n_tok are zeros), then
// d * sc_j * dx_j * dot per (row, token); the mins' part, dmin * sum_j m_j * (dx_j * the sum of
// token's quants of j), is one 16 x 8 x 8 float product per block (two tf32 mma: the tokens' sums
// split in a tf32 high and low part, m_j exact). Q6_K, per group i of 16: one m16n8k16 mma of the
// 6-bit quants (u8) with x, -32 * the sum of x's quants as the C operand (the dot with q - 32),
// then d * sc_i * dx * dot. Either way gemv_q8's integer dots scaled in float32, summed in another
// order (tests/test_cuda_gemv_mma.py states the limits).
//
// Weights reach the mma through shared memory: each warp keeps a ring of S stages (S = 2..4,
// chosen by the launcher from the shared memory left), one item (16 rows x one 256-weight block)
// each, filled by cp.async 16 bytes at a time, S - 1 items ahead of the one it multiplies, so the
// loads neither hold registers nor wait for the compiler's schedule. Each decoder's copier takes
// 128 contiguous bytes of 4 rows per copy instruction where it can, and finds the rows'
// addresses once per step. Its item() reads the fragments from the stage conflict-free.
// Before the programmatic-dependent-launch wait a warp fills MMA8_PRE_STAGES of its stages; the
// others go out right after x's loads, which would otherwise queue behind the whole ring (the
// verify products' x took 3 µs of a 4096 x 4096 product; docs/PERF.md, session 39).
//
// Thread mapping (as gemv_mma.cu): the block's WARPS warps take TILES = WARPS / KS tiles of 16
// weight rows at a step (tile TILES * step + w / KS; KS from runtime/cuda/gemv_mma.py mma_ks); the
// KS warps of a tile split its blocks (warp w takes blocks w % KS, w % KS + KS, ...); steps
// blockIdx.x, + gridDim.x, ...; at a step's end the partial sums meet in shared memory and
// mma8_step_out writes Y. Rows of a tile past the matrix load the last row again and are not
// written. With GLU the weight rows interleave gate and up (2 n_out rows).
//
// An NQ product (nq_w non-null; runtime/cuda/gemv_mma.py nq_out, flag K4_MMA8_NQ) also hands the
// products after the next RMSNorm its Y (mma8_common.cuh mma8_step_nq), one step at a time; a
// product with nq_q8 but no nq_w writes its Y also quantized as it is (gemv_mma.py y_q8, flag
// K4_MMA8_FFQ8: the gate/up products' output for the down products), every step's at once after
// its last step, a warp per step (one warp after each step cost the gate/up product 1.4 µs).
//
// Shared memory: mma8_smem(n_in, WARPS) + WARPS * S * D::STAGE (runtime/cuda/constants.py
// mma8_staged_smem, MMA8_STAGE_BYTES), and with nq_q8 MMA8_NQ_RUN TILES * 8 floats after the rings
// (without nq_w that many for each of the block's steps: they are quantized after the last)
// (ys, mma8_step_out's copy of a step's Y):
//   Q4_K (NATURAL_X): xq (n_in / 256, 4, 32 lanes, 2, 8) int8: for 256-weight block kb, sub-blocks
//       j = 2i, 2i + 1 and lane 4g + t the 16 bytes at 2048 kb + 512 i + 16 lane: token g's quants
//       8t..8t+7 of j = 2i, then of j = 2i + 1 (one conflict-free 16-byte read, two B fragments);
//       xsc: per block, dx at Q4X_DX_WORDS kb + Q4X_DX_T_WORDS t + 2 j + (tok & 1) for tokens 2t,
//       2t + 1; after all blocks' dx, per block (32 lanes) float4: for lane 4g + t, sx = dx * the
//       sum of quants of sub-blocks t and t + 4 of token g rounded to tf32, then their remainders
//       (the mins product's B fragments);
//   Q6_K: gemv_mma.cu's layout (its header);
//   red (2, WARPS, 32) float4: the warps' partial sums in C order; then the rings.
#include "mma8_common.cuh"

// Ring stages a warp fills before the programmatic-dependent-launch wait (the header). Measured on
// the H200 with 8 tokens (bench_gemv_batch): 1 against S - 1 (= 3 at 4,096 inputs), Q4_K output
// 7.71 -> 7.19 µs, down 14.22 -> 13.64, Q6_K down 24.45 -> 19.94 with x's loads four at once, q|k|v
// 13.68 -> 14.18; 0 and 2 no better.
constexpr int MMA8_PRE_STAGES = 1;

// Without clusters and an NQ handoff, a step's end joins only the KS warps of each tile (a named
// barrier, 1 + the tile's slot) and they write the tile's Y, instead of the whole block at one
// barrier: the tiles' warps do not wait for each other (docs/PERF.md, session 45).
constexpr bool MMA8_TILE_SYNC = true;

static_assert(MMA8_STAGE_BYTES == 16 * K4_BLOCK_BYTES_Q4_K, "a Q4_K ring stage is 16 rows of one block_q4_K");
static_assert(MMA8_STAGE_BYTES_Q6_K == 16 * (K4_BLOCK_BYTES_Q6_K - 2) + 16 * 16, "a Q6_K stage: 16 rows' ql, qh, scales and 16-byte d chunks");

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Until at most `pending` (1..3) of this thread's newest groups are in flight.
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
    if (pending <= 1) cp_async_wait<1>();
    else if (pending == 2) cp_async_wait<2>();
    else cp_async_wait<3>();
}

// ---- Q4_K --------------------------------------------------------------------------------------
// In a stage, row r's block (144 bytes) sits at 144 sigma(r), sigma(r) = 2 (r & 3) + ((r >> 2) & 1)
// + 8 (r >> 3): the four rows that a half warp reads together start 8 banks apart (conflict-free
// 8-byte reads). Lane t of a quad reads 8 bytes of each 32-byte piece c of qs (bytes 32c + 8t ..):
// the fragment's k 4t..4t+3 and 16+4t..16+4t+3 in a permuted k order that x's layout matches.
struct staged_q4_K {
    using T = type_q4_K;
    static constexpr bool NATURAL_X = true;
    static constexpr int STAGE = MMA8_STAGE_BYTES;
    __device__ static int stage_row(int r) { return 2 * (r & 3) + ((r >> 2) & 1) + 8 * (r >> 3); }

    // The qs of rows a + 4i (a = lane / 8, i = 0..3), 16 bytes at 16 (lane % 8): 4 rows' 128
    // contiguous bytes per copy instruction; lanes 0..15 also copy row lane's d, dmin and scales.
    template <bool PLANAR>
    struct copier {
        const u8* qs[4];  // block 0 of rows a + 4i, at this lane's 16 bytes
        const u8* meta;   // block 0 of row lane (lanes 0..15)
        __device__ void locate(const u8* w, i64 nblk, int row0, int n_rows, int nblk_row, int lane) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                qs[i] = group_at<T, 1, PLANAR>(w, nblk, (i64)min(row0 + (lane >> 3) + 4 * i, n_rows - 1) * nblk_row) + 16 * (lane & 7);
            meta = group_at<T, 0, PLANAR>(w, nblk, (i64)min(row0 + (lane & 15), n_rows - 1) * nblk_row);
        }
        __device__ void copy(u32 st, int kb, int lane) const {  // st: the stage's shared address
            constexpr int META_STEP = PLANAR ? 16 : K4_BLOCK_BYTES_Q4_K, QS_STEP = PLANAR ? QK_K / 2 : K4_BLOCK_BYTES_Q4_K;
            const u32 qs_dst = st + K4_BLOCK_BYTES_Q4_K * 2 * (lane >> 3) + 16 + 16 * (lane & 7);  // sigma(a + 4i) = 2a + (i & 1) + 8 (i >> 1)
#pragma unroll
            for (int i = 0; i < 4; ++i) cp_async16(qs_dst + K4_BLOCK_BYTES_Q4_K * ((i & 1) + 8 * (i >> 1)), qs[i] + (i64)kb * QS_STEP);
            if (lane < 16) cp_async16(st + K4_BLOCK_BYTES_Q4_K * stage_row(lane), meta + (i64)kb * META_STEP);
        }
    };

    // acc (C order: rows g, g + 8 x tokens 2t, 2t + 1) += the products of the item in stage st
    // (block kb of the tile's rows) with the x of block kb, at index kb of x's layout of nblk_lay
    // blocks (the header's layouts; in a cluster's block, kb counts from the block's first).
    __device__ static void item(const u8* st, const u8* xq, const u32* xsc_w, int nblk_lay, int kb, int, int, int, int, int lane,
                                float (&acc)[4]) {
        const float* xsc = reinterpret_cast<const float*>(xsc_w);
        const int g = lane >> 2, t = lane & 3;
        const u8* w0 = st + K4_BLOCK_BYTES_Q4_K * stage_row(g);
        const u8* w1 = st + K4_BLOCK_BYTES_Q4_K * stage_row(g + 8);
        const uint4 m0 = *reinterpret_cast<const uint4*>(w0), m1 = *reinterpret_cast<const uint4*>(w1);  // d, dmin, scales
        uint2 q0[4], q1[4];  // qs bytes 32c + 8t ..
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            q0[c] = *reinterpret_cast<const uint2*>(w0 + 16 + 32 * c + 8 * t);
            q1[c] = *reinterpret_cast<const uint2*>(w1 + 16 + 32 * c + 8 * t);
        }
        // 6-bit scales and mins of sub-blocks 0..3, 4..7, four to a word (get_scale_min_k4's bits)
        const u32 sc0_lo = m0.y & 0x3F3F3F3Fu, sc0_hi = (m0.w & 0x0F0F0F0Fu) | ((m0.y >> 2) & 0x30303030u);
        const u32 sc1_lo = m1.y & 0x3F3F3F3Fu, sc1_hi = (m1.w & 0x0F0F0F0Fu) | ((m1.y >> 2) & 0x30303030u);
        const u32 mn0_lo = m0.z & 0x3F3F3F3Fu, mn0_hi = ((m0.w >> 4) & 0x0F0F0F0Fu) | ((m0.z >> 2) & 0x30303030u);
        const u32 mn1_lo = m1.z & 0x3F3F3F3Fu, mn1_hi = ((m1.w >> 4) & 0x0F0F0F0Fu) | ((m1.z >> 2) & 0x30303030u);
        const uint4* xb = reinterpret_cast<const uint4*>(xq + 2048 * kb) + lane;                           // B pairs
        const float4* dxp = reinterpret_cast<const float4*>(xsc + Q4X_DX_WORDS * kb + Q4X_DX_T_WORDS * t);  // dx pairs
        float dot[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles of piece i) and 2i + 1 (high nibbles)
            const uint4 b = xb[32 * i];
            const float4 dx = dxp[i];  // tokens 2t, 2t + 1 of sub-block 2i, then of 2i + 1
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * i + h;
                const u32 mask = h ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
                int d[4];
                mma_k32_u8(d, q0[i].x & mask, q1[i].x & mask, q0[i].y & mask, q1[i].y & mask, h ? b.z : b.x, h ? b.w : b.y);
                const int sh = 8 * (j & 3);
                const int sa = ((j < 4 ? sc0_lo : sc0_hi) >> sh) & 0xFF, sb = ((j < 4 ? sc1_lo : sc1_hi) >> sh) & 0xFF;
                const float da = h ? dx.z : dx.x, db = h ? dx.w : dx.y;
                const int s4 = 4 * h;  // a high nibble's dot comes out 16 times too large: shifted back (exact)
                dot[0] += da * magic_int_to_float(sa * (d[0] >> s4));  // |sc * dot| <= 63 * 32 * 15 * 127 < 2^22
                dot[1] += db * magic_int_to_float(sa * (d[1] >> s4));
                dot[2] += da * magic_int_to_float(sb * (d[2] >> s4));
                dot[3] += db * magic_int_to_float(sb * (d[3] >> s4));
            }
        }
        // the mins: A = m of sub-blocks t, t + 4 of rows g, g + 8 (exact small integers), B = sx hi, lo
        const float a0 = byte_as_float(mn0_lo, t), a1 = byte_as_float(mn1_lo, t);
        const float a2 = byte_as_float(mn0_hi, t), a3 = byte_as_float(mn1_hi, t);
        const float4 bs = reinterpret_cast<const float4*>(xsc + Q4X_DX_WORDS * nblk_lay)[32 * kb + lane];
        float mins[4] = {0.f, 0.f, 0.f, 0.f};
        mma_tf32(mins, a0, a1, a2, a3, bs.x, bs.y);
        mma_tf32(mins, a0, a1, a2, a3, bs.z, bs.w);
        const float d0 = f16_to_f32(m0.x & 0xFFFF), dmin0 = f16_to_f32(m0.x >> 16);
        const float d1 = f16_to_f32(m1.x & 0xFFFF), dmin1 = f16_to_f32(m1.x >> 16);
        acc[0] += d0 * dot[0] - dmin0 * mins[0];
        acc[1] += d0 * dot[1] - dmin0 * mins[1];
        acc[2] += d1 * dot[2] - dmin1 * mins[2];
        acc[3] += d1 * dot[3] - dmin1 * mins[3];
    }
};

// ---- Q6_K (planar) -----------------------------------------------------------------------------
// In a stage, row r's ql, qh and scales (208 bytes) at 208 r, then per row the 16-byte aligned
// chunk of the d plane holding its d (at 16 * 208 + 16 r; the d at byte 2 (blk & 7) of it). Row
// stride 208 bytes = 52 words puts the 8 rows of a warp's 4-byte reads (lane t: word t of a piece)
// in distinct banks.
struct staged_q6_K {
    using T = type_q6_K;
    static constexpr bool NATURAL_X = false;
    static constexpr int STAGE = MMA8_STAGE_BYTES_Q6_K;
    static constexpr int ROW = QK_K / 2 + QK_K / 4 + QK_K / 16;  // ql, qh, scales: 208

    // ql: rows a + 4i (a = lane / 8), 16 bytes at 16 (lane % 8); qh: rows lane / 4 + 8i, 16 bytes at
    // 16 (lane % 4); lanes 0..15: row lane's scales, lanes 16..31: the d chunk of row lane - 16.
    template <bool PLANAR>
    struct copier {
        static_assert(PLANAR, "raw Q6_K blocks are not 16-byte aligned: gemv_mma.cu's kernel reads them");
        const u8* ql[4];
        const u8* qh[2];
        const u8* sd;  // scales (lanes 0..15) or d (16..31) of block 0 of the lane's row
        __device__ void locate(const u8* w, i64 nblk, int row0, int n_rows, int nblk_row, int lane) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                ql[i] = group_at<T, 0, true>(w, nblk, (i64)min(row0 + (lane >> 3) + 4 * i, n_rows - 1) * nblk_row) + 16 * (lane & 7);
#pragma unroll
            for (int i = 0; i < 2; ++i)
                qh[i] = group_at<T, 1, true>(w, nblk, (i64)min(row0 + (lane >> 2) + 8 * i, n_rows - 1) * nblk_row) + 16 * (lane & 3);
            const i64 blk = (i64)min(row0 + (lane & 15), n_rows - 1) * nblk_row;
            sd = lane < 16 ? group_at<T, 2, true>(w, nblk, blk) : group_at<T, 3, true>(w, nblk, blk);
        }
        __device__ void copy(u32 st, int kb, int lane) const {
            const u32 ql_dst = st + ROW * (lane >> 3) + 16 * (lane & 7);
#pragma unroll
            for (int i = 0; i < 4; ++i) cp_async16(ql_dst + ROW * 4 * i, ql[i] + (i64)kb * (QK_K / 2));
            const u32 qh_dst = st + ROW * (lane >> 2) + QK_K / 2 + 16 * (lane & 3);
#pragma unroll
            for (int i = 0; i < 2; ++i) cp_async16(qh_dst + ROW * 8 * i, qh[i] + (i64)kb * (QK_K / 4));
            if (lane < 16) {
                cp_async16(st + ROW * lane + QK_K / 2 + QK_K / 4, sd + (i64)kb * (QK_K / 16));
            } else {  // the aligned 16 bytes holding d (the plane is padded to 16: never past it)
                const unsigned long long d = reinterpret_cast<unsigned long long>(sd + (i64)kb * 2);
                cp_async16(st + 16 * ROW + 16 * (lane - 16), reinterpret_cast<const void*>(d & ~15ull));
            }
        }
    };

    // acc (C order) += the products of the item in stage st (block kb of rows row0 + g, row0 + g + 8)
    // with the x of block kb, at index kx of x's layout (gemv_mma.cu's).
    __device__ static void item(const u8* st, const u8* xq, const u32* xsc, int, int kx, int nblk_row, int kb, int row0, int n_rows,
                                int lane, float (&acc)[4]) {
        const int g = lane >> 2, t = lane & 3;
        uint4 l[2][2], h[2], sc[2];  // per row: word t of ql pieces 0..3 and 4..7, of qh pieces 0..3; the scales
        float dd[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u8* row = st + ROW * (g + 8 * r);
            const u32* wq = reinterpret_cast<const u32*>(row) + t;
            l[r][0] = make_uint4(wq[0], wq[4], wq[8], wq[12]);
            l[r][1] = make_uint4(wq[16], wq[20], wq[24], wq[28]);
            h[r] = make_uint4(wq[32], wq[36], wq[40], wq[44]);
            sc[r] = *reinterpret_cast<const uint4*>(row + QK_K / 2 + QK_K / 4);
            const int blk = (int)(((i64)min(row0 + g + 8 * r, n_rows - 1) * nblk_row + kb) & 7);
            dd[r] = f16_to_f32(*reinterpret_cast<const u16*>(st + 16 * ROW + 16 * (g + 8 * r) + 2 * blk));
        }
        q6k_dot(l[0], h[0], sc[0], dd[0], l[1], h[1], sc[1], dd[1], xq + 256 * 8 * kx, xsc + 32 * 8 * kx, lane, acc);
    }
};

// ---- the kernel ----------------------------------------------------------------------------------
// Dynamic shared memory: mma8_smem(n_lay, WARPS) + (CL - 1) * 2 * WARPS * 512 + WARPS * S * D::STAGE
// bytes (n_lay: QK_K * ceil(n_in / QK_K / CL)). D: staged_q4_K, staged_q6_K.
//
// CL > 1: launched in thread-block clusters of CL blocks along x, the blocks of a cluster
// splitting every row's 256-weight blocks: rank r takes blocks [r nblk / CL, (r + 1) nblk / CL)
// of the cluster's steps (blockIdx.x / CL, + gridDim.x / CL, ...) and stages only their x (a
// layout of n_lay inputs), so each block reads and converts 1 / CL of x. The cluster's i-th step
// is finished by rank i % CL (the epilogues alternate): at the step's end the other ranks store
// their warps' partial sums into its shared memory (red's set r; st.shared::cluster) and arrive
// at the cluster barrier; the finisher waits for them and writes Y and its handoffs, adding the
// sets in rank order (the same sums in every launch).
template <class D, bool PLANAR, int WARPS, bool GLU, bool GELU = false, int CL = 1>
__global__ void __launch_bounds__(WARPS * 32, 1)
gemv_mma_staged(const u8* __restrict__ w,        // (n_out, n_in) in D::T's blocks; GLU: (2 n_out, n_in) interleaved
                const float* __restrict__ x,     // (n_tok, n_in) rows x_stride floats apart, 16-byte aligned
                int x_stride,
                float* y,                        // (n_tok, n_out) rows y_stride floats apart
                int y_stride,
                const float* residual,           // (n_tok, n_out) rows r_stride apart, or null; may alias y (not with GLU)
                int r_stride,
                const float* __restrict__ bias,  // (n_out,) or null, added to every row (not with GLU)
                int n_out, int n_in, int n_tok,  // 1 <= n_tok <= MMA8_TOKENS, n_in a multiple of QK_K
                int KS,                          // warps per tile: a divisor of WARPS, at least 4 (gemv_mma.py mma_ks)
                int S,                           // ring stages per warp, 2..4
                const u8* __restrict__ x_q8,     // n_tok * q8x_bytes(n_in) (quantize_q8_rows, rms_norm_q8, an NQ product) or null
                int x_swz,                       // x_q8's swizzle (x_unit_slot)
                const float* __restrict__ x_parts,  // x_q8 an NQ handoff: its sums of squares (mma8_stage_x), or null
                int x_n_parts, float x_eps,      // per token; the RMSNorm's eps
                const float* __restrict__ nq_w,  // NQ: the next RMSNorm's weights (n_out,), or null (Y quantized as it is)
                u8* nq_q8,                       // n_tok * q8x_bytes(n_out): y (* nq_w) quantized (mma8_step_nq), or null
                float* nq_parts,                 // NQ: (n_tok, n_steps) sums of y^2, a step's at [t * n_steps + step]
                int nq_swz) {                    // nq_q8's swizzle
    using T = typename D::T;
    static_assert(CL == 1 || CL == 2 || CL == 4, "clusters of 1, 2 or 4 blocks");
    const int TILES = WARPS / KS;
    extern __shared__ uint4 smem[];
    const int nblk_row = n_in / QK_K;
    const int rank = CL > 1 ? (int)(blockIdx.x % CL) : 0;  // the cluster's blocks along x: its rank
    const int kb_lo = rank * nblk_row / CL, kb_hi = (rank + 1) * nblk_row / CL;  // this block's share of every row
    const int nblk_lay = (nblk_row + CL - 1) / CL, n_sub = 8 * nblk_lay;  // x's layout: kb_hi - kb_lo <= nblk_lay blocks
    const int cid = blockIdx.x / CL, n_cl = gridDim.x / CL;
    u8* xq = reinterpret_cast<u8*>(smem);
    u32* xsc = reinterpret_cast<u32*>(xq + 256 * n_sub);
    float4* red = reinterpret_cast<float4*>(xsc + 32 * n_sub);  // (2, CL, WARPS, 32)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u8* ring = reinterpret_cast<u8*>(red + 2 * CL * WARPS * 32) + warp * S * D::STAGE;
    float* ys = nq_q8 ? reinterpret_cast<float*>(reinterpret_cast<u8*>(red + 2 * CL * WARPS * 32) + WARPS * S * D::STAGE) : nullptr;
    const u32 ring_s = (u32)__cvta_generic_to_shared(ring);
    if constexpr (CL > 1) cluster_arrive_relaxed();  // the start: no block stores into rank 0 before it runs

    const int slot = warp / KS, kl = warp % KS;
    const int n_rows = GLU ? 2 * n_out : n_out;  // weight rows
    const i64 nblk = (i64)n_rows * nblk_row;
    const int n_steps = (n_rows + 16 * TILES - 1) / (16 * TILES);

    // This warp's items in order: (step, kb), kb = kb_lo + kl, + KS, ... then the next step.
    auto advance = [&](int& step, int& kb) {
        kb += KS;
        if (kb >= kb_hi) {
            step += n_cl;
            kb = kb_lo + kl;
        }
    };
    // Copy the next item of the sequence (if any) into stage st, as one cp.async group.
    typename D::template copier<PLANAR> cp;
    int is_step = cid, is_kb = kb_lo + kl, at_step = -1;
    auto issue = [&](int st) {
        if (is_step < n_steps && kb_lo + kl < kb_hi) {
            if (is_step != at_step) {
                at_step = is_step;
                cp.locate(w, nblk, 16 * (TILES * is_step + slot), n_rows, nblk_row, lane);
            }
            cp.copy(ring_s + st * D::STAGE, is_kb, lane);
            advance(is_step, is_kb);
        }
        cp_async_commit();  // every call commits a group, empty or not: the counts below stay uniform
    };

    pdl_trigger();
    const int pre = min(S - 1, MMA8_PRE_STAGES);
    for (int st = 0; st < pre; ++st) issue(st);  // weights only: before the wait
    pdl_wait();
    // x's loads first, then the ring's other stages: x queues behind fewer weight bytes
    mma8_stage_x<D::NATURAL_X>(x, x_stride, x_q8, x_swz, n_tok, n_in, xq, xsc, x_parts, x_n_parts, x_eps, [&] {
        for (int st = pre; st < S - 1; ++st) issue(st);
    }, 16 * MMA8_TOKENS * kb_lo, 16 * MMA8_TOKENS * kb_hi, QK_K * nblk_lay);
    __syncthreads();

    int cur = 0, next = S - 1, buf = 0;  // stage of the item multiplied next, stage the next copy fills
    const int ys_step = MMA8_NQ_RUN * TILES * MMA8_TOKENS;  // floats of a step's Y in ys
    int local = 0;  // the block's steps so far
    int done = 0;   // the steps whose Y it wrote (with CL > 1, those it finished)
    bool pending = CL > 1;  // this thread arrived at the cluster barrier and has not waited since (the start's arrival)
    for (int step = cid; step < n_steps; step += n_cl, ++local) {  // block-uniform
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const int row0 = 16 * (TILES * step + slot);
        // mma8_step_nq's norm weights for this step, on their way into L1 during the step
        if (nq_w && (int)threadIdx.x < TILES && 16 * (TILES * step + (int)threadIdx.x) < n_out)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(nq_w + 16 * (TILES * step + threadIdx.x)));
        for (int kb = kb_lo + kl; kb < kb_hi; kb += KS) {
            issue(next);  // into the stage the previous item left
            next = next + 1 == S ? 0 : next + 1;
            cp_async_wait_pending(S - 1);  // this item's group has landed
            __syncwarp();
            D::item(ring + cur * D::STAGE, xq, xsc, nblk_lay, kb - kb_lo, nblk_row, kb, row0, n_rows, lane, acc);
            __syncwarp();  // every lane done with the stage before it is refilled
            cur = cur + 1 == S ? 0 : cur + 1;
        }
        float4* set = red + ((buf * CL + rank) * WARPS + warp) * 32 + lane;  // this warp's partial sums in the finisher's red
        if constexpr (CL > 1) {
            // the step's finisher: rank local % CL. Before any store into a finisher's red, this thread's
            // last arrival is waited for: every rank has then finished the epilogues that read it.
            const int fin = local % CL;
            if (pending) cluster_wait();
            if (rank != fin) {
                asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(peer_addr(set, fin)), "f"(acc[0]),
                             "f"(acc[1]), "f"(acc[2]), "f"(acc[3]) : "memory");
                cluster_arrive();
                pending = true;
                buf ^= 1;
                continue;
            }
            *set = make_float4(acc[0], acc[1], acc[2], acc[3]);
            cluster_arrive();
            cluster_wait();  // every rank's partial sums are in red (and this block's threads past the barrier)
            pending = false;
        } else if (MMA8_TILE_SYNC && !nq_w) {  // block-uniform
            *set = make_float4(acc[0], acc[1], acc[2], acc[3]);
            asm volatile("bar.sync %0, %1;" ::"r"(1 + slot), "r"(32 * KS) : "memory");
            const int f = 32 * kl + lane;  // this thread's output of the tile: (lane f / 4, C register f % 4)
            if (f < 128)
                mma8_step_out<GLU, GELU>(red + buf * WARPS * 32, KS, TILES, step, n_rows, n_out, n_tok, y, y_stride, residual, r_stride,
                                         bias, ys ? ys + done * ys_step : ys, 1, 0, 128 * slot + f);
            ++done;
            buf ^= 1;
            continue;
        } else {
            *set = make_float4(acc[0], acc[1], acc[2], acc[3]);
            __syncthreads();
        }
        mma8_step_out<GLU, GELU>(red + buf * CL * WARPS * 32, KS, TILES, step, n_rows, n_out, n_tok, y, y_stride, residual, r_stride, bias,
                                 ys && !nq_w ? ys + done * ys_step : ys, CL, WARPS * 32);
        ++done;
        if (nq_w) {  // block-uniform; the next step's mma8_step_out writes ys after its barrier
            __syncthreads();
            if (warp == 0) mma8_step_nq(ys, mma8_step_units(TILES, GLU), step, n_out, n_tok, nq_w, nq_q8, nq_parts, n_steps, nq_swz);
        }
        buf ^= 1;
    }
    if (ys && !nq_w) {  // Y quantized as it is: every step's at once after the last, warp i taking the block's step i
        __syncthreads();
        for (int i = warp; i < done; i += WARPS)  // the i-th step this block finished: the cluster's step CL i + rank
            mma8_step_nq(ys + i * ys_step, mma8_step_units(TILES, GLU), cid + (CL * i + rank) * n_cl, n_out, n_tok, nullptr, nq_q8,
                         nullptr, 0, nq_swz);
    }
    cp_async_wait<0>();  // no copy outlives the block
}
