// Launched by runtime/cuda/ops.py (Ops.attention, flag K4_MMA_ATTN).
#include "mma_common.cuh"
#include "attention_sizes.cuh"
#include "gemv_common.cuh"  // q8_row_put, q8x_bytes

// ---- attn_mma: prefill attention on tensor cores ----------------------------------------------
// FlashAttention-2 (Dao 2023) with mma.sync.m16n8k16 (fp16 inputs, f32 accumulators; operand and
// accumulator layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
// A block of MMA_WARPS warps takes MMA_BQ = 16 * MMA_WARPS queries of one head; warp w owns the
// 16 queries starting at 16w. The block walks the keys 0 .. (its last query's position) in
// tiles of BK, double-buffered in shared memory by cp.async (tile j + 1 lands while tile j is
// multiplied); rows past the block's last key are zero-filled, so the NaN or garbage of the
// cache beyond the causal range never reaches an mma. Per tile and warp:
//   S = Q K^T (Q pre-scaled by log2(e) / sqrt(D) and rounded to fp16: S is in log2 units),
//   the causal mask (only on tiles reaching past the warp's first query; tiles wholly past its
//   last query are skipped), online softmax with exp2 in f32 registers (running max m and a
//   per-lane partial row sum l), P rounded to fp16 and kept in registers as the A operand of
//   O += P V (the accumulator layout of S is the A layout of P).
// Q stays in registers (fp16 A fragments, read once from global) for D <= 128; for larger D it
// is staged in shared memory and read by ldmatrix each tile (registers hold O and S). K
// fragments come from ldmatrix, V fragments from ldmatrix.trans. Shared rows are padded to
// D + 8 halves: the 8 rows of one 8x8 ldmatrix matrix then start 16 bytes apart modulo 128 and
// hit all 32 banks once. The heaviest query tiles (the last ones, most keys) are scheduled first.
// Measured on an H200 (bench_attention, 32 heads): 16 rows per warp beat 32 (two row groups
// sharing each K/V fragment) on 512-query chunks, where 64-query blocks fill the chip twice as
// well; 32 rows won by 5-13% only on single 4096-query calls, which k4 never makes.
// MMA_WARPS, MMA_THREADS = 32 * MMA_WARPS, MMA_BQ = 16 * MMA_WARPS: constants.cuh. The mma helpers (k4mma): mma_common.cuh.

// Causal attention of n_tok queries (query t at position pos0 + t, pos0 = *pos) over the cache
// rows 0 .. pos0 + t, on tensor cores. q, out: (n_tok, n_head, D) f32; k_cache, v_cache: (n_ctx,
// n_head_kv, D) of KT::elem / VT::elem with k_d, v_d their scale planes or null (kv_cache.cuh:
// fp16 tiles are copied by cp.async; q8_0 ones are dequantized to fp16 through registers as
// they are staged, so their next tile's loads are not asynchronous); scale, window, softcap: as
// attn_kv (tiles before the window of a block's or a warp's first query are skipped; softcap
// applies to S in log2 units with cap * log2(e)). Grid: (n_head, ceil(n_tok / MMA_BQ)); block:
// MMA_THREADS; dynamic shared memory mma_smem(D, BK). Requires D % 16 == 0, BK % 16 == 0. out_q8
// (D % 32 == 0; null: none): out also quantized, row t's q8 x at out_q8 + t * q8x_bytes(n_head D),
// swizzle q8_swz (q8_row_put's bytes), for the output product (K4_ATTN_Q8's rows).
// Thread mapping: lane = 4g + t holds rows g and g + 8 of its warp's 16 queries and, per 8-column
// chunk of S or O, columns 2t and 2t + 1 (the mma accumulator layout).
template <int D, int BK, class KT, class VT>
__global__ void __launch_bounds__(MMA_THREADS, 2)
attn_mma(const float* __restrict__ q, const typename KT::elem* __restrict__ k_cache, const u16* __restrict__ k_d,
         const typename VT::elem* __restrict__ v_cache, const u16* __restrict__ v_d, float* __restrict__ out,
         const int* __restrict__ pos, int n_tok, int n_head, int n_head_kv, float scale, int window, float softcap, int ring,
         u8* __restrict__ out_q8, int q8_swz) {
    using namespace k4mma;
    constexpr int DP = D + 8;          // shared row stride (halves)
    constexpr int ROW_BYTES = 2 * DP;
    constexpr bool QREG = D <= 128;     // Q fragments live in registers
    constexpr int NKC = D / 16;         // 16-wide head-dim chunks (k of S = Q K^T)
    constexpr int NSC = BK / 8;         // 8-key column chunks of S
    constexpr int NOC = D / 8;          // 8-wide column chunks of O
    extern __shared__ uint4 mma_buf[];
    u16* Qs = reinterpret_cast<u16*>(mma_buf);    // (MMA_BQ, DP) fp16 queries, pre-scaled (D > 128)
    u16* Ks = Qs + (QREG ? 0 : MMA_BQ * DP);      // (2, BK, DP) keys, double-buffered
    u16* Vs = Ks + 2 * BK * DP;                   // (2, BK, DP) values
    pdl_trigger();
    pdl_wait();
    const int h = blockIdx.x, q0 = (gridDim.y - 1 - blockIdx.y) * MMA_BQ;
    const int hk = h / (n_head / n_head_kv);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int nq = min(MMA_BQ, n_tok - q0);
    const int pos0 = *pos;
    const int n_keys = pos0 + q0 + nq;  // keys seen by the block's last query
    const int n_tiles = (n_keys + BK - 1) / BK;
    const size_t kv_stride = (size_t)n_head_kv * D;
    const size_t head_off = (size_t)hk * D;  // element of this KV head's row at position 0
    const u32 qs_base = smem_u32(Qs), ks_base = smem_u32(Ks), vs_base = smem_u32(Vs);
    const float qscale = scale * 1.4426950408889634f;  // log2(e) / sqrt(D)

    // cp.async mapping: thread tid copies the 16-byte chunk c0 = tid % (D / 8) of rows
    // r0 + LOAD_STEP * it of the tile (it < LOAD_ITERS, r0 = tid / (D / 8)), keys and values alike.
    constexpr int LOAD_STEP = MMA_THREADS / (D / 8), LOAD_ITERS = BK / LOAD_STEP;
    static_assert(MMA_THREADS % (D / 8) == 0 && BK % LOAD_STEP == 0, "the tile loads evenly over the block");
    const int r0 = tid / (D / 8), c0 = tid % (D / 8);
    const u32 tile_dst = (u32)(r0 * ROW_BYTES + 16 * c0);
    auto load_tile = [&](int j) {  // keys and values j * BK .. + BK - 1 into stage j & 1
        const int k0 = j * BK + r0;
        const size_t at = head_off + (size_t)(((j * BK) & ring) + r0) * kv_stride + 8 * c0;  // BK divides a ring's rows
        const u32 dst = tile_dst + (u32)((j & 1) * BK * ROW_BYTES);
#pragma unroll
        for (int it = 0; it < LOAD_ITERS; ++it) {
            const bool valid = k0 + LOAD_STEP * it < n_keys;
            const size_t e = valid ? at + (size_t)(LOAD_STEP * it) * kv_stride : 0;
            stage8<KT>(ks_base + dst + LOAD_STEP * it * ROW_BYTES, k_cache, k_d, e, valid);
            stage8<VT>(vs_base + dst + LOAD_STEP * it * ROW_BYTES, v_cache, v_d, e, valid);
        }
        cp_async_commit();
    };
    const int j_begin = window > 0 ? max(0, pos0 + q0 - window + 1) / BK : 0;  // the tile of the block's first visible key
    load_tile(j_begin);

    const int wrow = 16 * warp;  // the warp's first row in the block
    u32 qf[QREG ? NKC : 1][4];   // A fragments of Q (D <= 128)
    if constexpr (QREG) {
#pragma unroll
        for (int kc = 0; kc < NKC; ++kc)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = wrow + g + 8 * (e & 1), col = 16 * kc + 8 * (e >> 1) + 2 * t;
                float2 v = make_float2(0.f, 0.f);
                if (r < nq) v = *reinterpret_cast<const float2*>(q + ((size_t)(q0 + r) * n_head + h) * D + col);
                qf[kc][e] = pack_f16x2(v.x * qscale, v.y * qscale);
            }
    } else {
        for (int i = tid; i < MMA_BQ * D / 8; i += MMA_THREADS) {
            const int r = i / (D / 8), c = i % (D / 8);
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
            if (r < nq) {
                const float4* src = reinterpret_cast<const float4*>(q + ((size_t)(q0 + r) * n_head + h) * D + 8 * c);
                a = src[0];
                b = src[1];
            }
            *reinterpret_cast<uint4*>(Qs + r * DP + 8 * c) =
                make_uint4(pack_f16x2(a.x * qscale, a.y * qscale), pack_f16x2(a.z * qscale, a.w * qscale),
                           pack_f16x2(b.x * qscale, b.y * qscale), pack_f16x2(b.z * qscale, b.w * qscale));
        }
    }

    float o[NOC][4], m[2], l[2];
    softmax_state_init(o, m, l);
    const int row_pos = pos0 + q0 + wrow;  // position of the warp's first query

    const float cap2 = softcap * 1.4426950408889634f;  // the cap in log2 units
    for (int j = j_begin; j < n_tiles; ++j) {
        cp_async_wait_all();
        __syncthreads();  // tile j is visible to all; every warp is done with tile j - 1 (and Qs is written)
        if (j + 1 < n_tiles) load_tile(j + 1);
        const int k0 = j * BK;
        if (k0 > row_pos + 15) continue;  // every key of the tile is past every query of this warp
        if (window > 0 && k0 + BK - 1 <= row_pos - window) continue;  // before every window of this warp
        const u32 kb = ks_base + (u32)((j & 1) * BK * ROW_BYTES), vb = vs_base + (u32)((j & 1) * BK * ROW_BYTES);

        float s[NSC][4];
#pragma unroll
        for (int c = 0; c < NSC; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[c][e] = 0.f;
#pragma unroll
        for (int kc = 0; kc < NKC; ++kc) {
            u32 a[4];
            if constexpr (QREG) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[e] = qf[kc][e];
            } else {
                ldsm_x4(qs_base + (u32)((wrow + (lane & 15)) * ROW_BYTES + 2 * (16 * kc + 8 * (lane >> 4))), a[0], a[1], a[2], a[3]);
            }
#pragma unroll
            for (int np = 0; np < NSC / 2; ++np) {
                u32 b0, b1, b2, b3;  // keys 16np .. +7 (b0, b1) and +8 .. +15 (b2, b3), dims 16kc .. +15
                ldsm_x4(kb + (u32)((16 * np + (lane & 7) + 8 * (lane >> 4)) * ROW_BYTES + 2 * (16 * kc + 8 * ((lane >> 3) & 1))),
                        b0, b1, b2, b3);
                mma16816(s[2 * np], a, b0, b1);
                mma16816(s[2 * np + 1], a, b2, b3);
            }
        }
        if (softcap > 0.f) {
#pragma unroll
            for (int c = 0; c < NSC; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[c][e] = cap2 * k4ops::tanh_f32(s[c][e] / cap2);
        }
        // the tile reaches past some query of this warp (causal mask) or before some query's window
        if (k0 + BK - 1 > row_pos || (window > 0 && k0 <= row_pos + 15 - window)) {
#pragma unroll
            for (int c = 0; c < NSC; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + 8 * c + 2 * t + (e & 1), qp = row_pos + g + 8 * (e >> 1);
                    if (key > qp || (window > 0 && key <= qp - window)) s[c][e] = -k4ops::inf_f32();
                }
        }
        // online softmax: rows g (e = 0, 1) and g + 8 (e = 2, 3); the 4 lanes of a row reduce by shuffles
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int c = 0; c < NSC; ++c) mx = fmaxf(mx, fmaxf(s[c][2 * r], s[c][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(k4ops::FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(k4ops::FULL_MASK, mx, 2));
            const float base = mx == -k4ops::inf_f32() ? 0.f : mx;  // no key yet: keep exp2 finite
            const float corr = exp2f(m[r] - base);
            m[r] = mx;
            float rs = 0.f;
#pragma unroll
            for (int c = 0; c < NSC; ++c) {
                s[c][2 * r] = exp2f(s[c][2 * r] - base);
                s[c][2 * r + 1] = exp2f(s[c][2 * r + 1] - base);
                rs += s[c][2 * r] + s[c][2 * r + 1];
            }
            l[r] = l[r] * corr + rs;
#pragma unroll
            for (int c = 0; c < NOC; ++c) {
                o[c][2 * r] *= corr;
                o[c][2 * r + 1] *= corr;
            }
        }
        // O += P V over 16-key chunks
#pragma unroll
        for (int kc = 0; kc < BK / 16; ++kc) {
            const u32 a[4] = {pack_f16x2(s[2 * kc][0], s[2 * kc][1]), pack_f16x2(s[2 * kc][2], s[2 * kc][3]),
                              pack_f16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]), pack_f16x2(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                u32 b0, b1, b2, b3;  // dims 16dp .. +7 (b0, b1) and +8 .. +15 (b2, b3), keys 16kc .. +15
                ldsm_x4_trans(vb + (u32)((16 * kc + (lane & 7) + 8 * ((lane >> 3) & 1)) * ROW_BYTES + 2 * (16 * dp + 8 * (lane >> 4))),
                              b0, b1, b2, b3);
                mma16816(o[2 * dp], a, b0, b1);
                mma16816(o[2 * dp + 1], a, b2, b3);
            }
        }
    }

    // out_q8: the rows go through shared memory (the tiles' space, once every warp is done with
    // it), where a thread per 16-value unit quantizes them with q8_row_put, the code
    // quantize_q8_rows runs: the same bytes. (Quantizing in the accumulator layout, a quad per group of 32, made
    // one warp run every group of its rows one after another: +1.7 µs a launch on the H200.)
    constexpr int YS = D + 4;  // the staged rows' stride (floats)
    static_assert(MMA_BQ * YS * 4 <= mma_smem(D, BK), "attn_mma's staged output rows fit in its shared memory");
    const bool q8 = D % 32 == 0 && out_q8 != nullptr;  // block-uniform
    float* ys = reinterpret_cast<float*>(mma_buf);
    if (q8) __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lr = l[r];
        lr += __shfl_xor_sync(k4ops::FULL_MASK, lr, 1);
        lr += __shfl_xor_sync(k4ops::FULL_MASK, lr, 2);
        const float inv_l = 1.f / lr;
        const int row = wrow + g + 8 * r;
        if (row >= nq) continue;
        float* dst = out + ((size_t)(q0 + row) * n_head + h) * D + 2 * t;
#pragma unroll
        for (int c = 0; c < NOC; ++c) {
            const float2 v = make_float2(o[c][2 * r] * inv_l, o[c][2 * r + 1] * inv_l);
            *reinterpret_cast<float2*>(dst + 8 * c) = v;
            if (q8) *reinterpret_cast<float2*>(ys + row * YS + 8 * c + 2 * t) = v;
        }
    }
    if (!q8) return;
    __syncthreads();
    constexpr int UNITS = D / 16;  // a row's units of this head; even: a scale's two in adjacent lanes
    const int n = n_head * D;
    for (int base = 0; base < nq * UNITS; base += MMA_THREADS) {  // block-uniform trip count
        const int f = base + tid, row = f / UNITS, u = f % UNITS;
        const bool ok = f < nq * UNITS;
        float v[16];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 a = ok ? *reinterpret_cast<const float4*>(ys + row * YS + 16 * u + 4 * k) : make_float4(0.f, 0.f, 0.f, 0.f);
            v[4 * k] = a.x; v[4 * k + 1] = a.y; v[4 * k + 2] = a.z; v[4 * k + 3] = a.w;
        }
        q8_row_put(v, ok, h * UNITS + u, n, q8_swz, out_q8 + (size_t)(ok ? q0 + row : 0) * q8x_bytes(n));
    }
}
