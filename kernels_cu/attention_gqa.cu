// Launched by runtime/cuda/attention_launch.py (Ops.attention, flag K4_GQA_MMA).
#include "mma_common.cuh"
#include "attention_sizes.cuh"
#include "split_merge.cuh"

// ---- attn_gqa: decode attention of a grouped-query model on tensor cores --------------------
// One token's query heads that share a KV head (G = n_head / n_head_kv, 2 <= G <= 16: Llama 3
// 8B 4, Qwen3-30B-A3B 8) are the 16 rows of an mma tile (rows G .. 15 are zero and never
// written), so each key and value is read and converted once for the whole group and the
// per-(query, key) work runs on tensor cores (mma.sync.m16n8k16, fp16 inputs, f32 accumulators),
// as llama.cpp's mma decode kernels group heads. attn_kv, one block per query head, spent its
// time on the scalar dot products and their shuffles, not on the bytes (docs/PERF.md, session 8).
//
// Split over the sequence like attn_kv (flash-decoding, Dao et al. 2023): block (hk, s) takes the
// keys of split s (split_len, a multiple of BK) in tiles of BK keys, S stages in shared memory
// (cp.async groups: S - 1 tiles land while one is used; kernel_names.gqa_stages, with its
// measurements). fp16 planes are copied into S fp16 stages; q8_0 planes' quants and scales into
// S raw stages, and the tile about to be used is dequantized (q * d rounded to fp16, the bits of
// attn_mma's staging) into one fp16 tile. Rows outside the split's visible range [begin, end)
// are zero-filled, so the cache's garbage never reaches an mma, and masked to -inf in S. With
// the token fused in, the first tiles' loads are issued before the programmatic-dependent-launch
// wait (see there).
// Within the block, warp w takes keys 16w .. 16w + 15 of every tile with its own online softmax
// (FlashAttention-2's: S = Q K^T with Q pre-scaled by log2(e) * scale, so S is in log2 units;
// exp2; P rounded to fp16 as the A operand of O += P V); at the end the warps' (m, l, O) are
// merged through shared memory. With n_split > 1 the block writes its (m, l, O) per head to
// part (m in log2 units) and the last block of the group to finish (an atomic ticket, as attn_kv)
// merges the splits, or the last few share the merge (helpers).
// fresh_q etc.: as attn_kv (the token's RoPE and cache store fused in): the block rotates the
// group's query rows itself; the block whose split holds the token's position p rotates k,
// writes k and v in the cache's form to cache row p (no other block reads that row) and puts
// them, as the tile staging would have, into the row of p in its last tile.
// Grid: (n_head_kv, n_split); block: GQA_THREADS = 32 * GQA_WARPS; dynamic shared memory
// gqa_smem(D, BK, S, KT::SCALED, VT::SCALED) (attention_sizes.cuh). Requires BK == 16 *
// GQA_WARPS, D % 16 == 0, D % 32 == 0 for a q8_0 plane, one query (decode).
// Thread mapping: lane = 4g + t holds, per 8-column chunk of S or O, rows g and g + 8 and columns
// 2t, 2t + 1 (the mma accumulator layout); tile loads: thread tid copies 16-byte chunks tid,
// tid + GQA_THREADS, ... of the tile, row-major (a row is D / 8 fp16 chunks or D / 16 q8_0 ones).

#include "gqa_stage.cuh"
#include "gqa_cols.cuh"

// q: (1, n_head, D) f32 (not read with fresh_q); k_cache, v_cache, k_d, v_d: as attn_kv (this
// layer's planes, positions 0 .. n_ctx - 1); out: (1, n_head, D) f32. part: (1, n_head, n_split,
// D + 2) f32 partials [m (log2 units), l, O[D]] of each (head, split) that holds keys, written
// when n_split > 1; ticket: (n_head,) int32, zero on entry and left zero (entry hk * G counts the
// group's splits and its merge's helpers, merge_join). pos: (1,) int32, the query's position.
// split_len: keys per split, a multiple of BK, or -BK: sized per step (attention_sizes.cuh
// split_keys). scale, window, softcap, ring, fresh_*, *_store, q_norm, k_norm, inv_freq,
// rope_dim, neox, eps, mscale: as attn_kv. x_q8: null, or (n_split > 1) the q8 x of out (n_head
// * D values, swizzle x_swz; q8_handoff.Q8Vector) that the merge also writes, for the output
// product (K4_ATTN_Q8). helpers: how many of the group's last blocks to finish share its merge
// (K4_SHARED_MERGE; 0 or 1: the last alone); with more than 1, (helpers - 1) * n_head_kv must be
// below the multiprocessors (merge_join).
template <int D, int BK, int S, class KT, class VT, bool COLS, bool I8K>
__global__ void __launch_bounds__(GQA_THREADS, D > 128 ? 1 : S == 2 ? 3 : 2)  // S = 2: three blocks fit in shared memory
attn_gqa(const float* __restrict__ q, const typename KT::elem* __restrict__ k_cache, const u16* __restrict__ k_d,
         const typename VT::elem* __restrict__ v_cache, const u16* __restrict__ v_d,
         float* __restrict__ out, float* __restrict__ part, int* __restrict__ ticket, const int* __restrict__ pos,
         int n_head, int n_head_kv, int split_len, float scale, int window, float softcap, int ring,
         const float* __restrict__ fresh_q, const float* __restrict__ fresh_k, const float* __restrict__ fresh_v,
         typename KT::elem* k_store, u16* kd_store, typename VT::elem* v_store, u16* vd_store,
         const float* __restrict__ q_norm, const float* __restrict__ k_norm,
         const double* __restrict__ inv_freq, int rope_dim, int neox, float eps, float mscale, u8* __restrict__ x_q8, int x_swz,
         int helpers) {
    using namespace k4mma;
    static_assert(BK == 16 * GQA_WARPS, "each warp takes 16 keys of a tile");
    static_assert(D % 16 == 0, "head_dim in 16-wide mma chunks");
    constexpr int DP = D + 8;  // shared row stride (halves): ldmatrix rows hit all banks once
    constexpr int ROW_BYTES = 2 * DP;
    constexpr bool QREG = D <= 128;  // Q fragments live in registers
    constexpr int NKC = D / 16, NOC = D / 8;
    static_assert(!I8K || (COLS && KT::SCALED), "int8 q.k: the column instance over a q8_0 key plane");
    using KPlane = k4gqa::Plane<KT, D, BK, S, ROW_BYTES, KT::SCALED, I8K>;
    using VPlane = k4gqa::Plane<VT, D, BK, S, ROW_BYTES>;
    static_assert(S >= 2, "at least one tile in flight while another is used");
    static_assert(4 * GQA_WARPS * 16 * (D + 2) <= KPlane::BYTES + VPlane::BYTES, "the warps' merge fits in the tiles' space");
    static_assert(gqa_smem(D, BK, S, KT::SCALED, VT::SCALED, I8K) == 32 * DP + KPlane::BYTES + VPlane::BYTES + 4 * GQA_WARPS * D + 4 * D + D / 8,
                  "attention_sizes.cuh gqa_smem is this layout");
    extern __shared__ uint4 gqa_buf[];
    u16* Qs = reinterpret_cast<u16*>(gqa_buf);  // (16, DP) fp16 query rows, pre-scaled
    u8* planes = reinterpret_cast<u8*>(Qs + 16 * DP);  // the key plane's stages (KPlane::BYTES), then the value plane's
    float* scr = reinterpret_cast<float*>(planes + KPlane::BYTES + VPlane::BYTES);  // (GQA_WARPS, D) a row in f32 per warp
    auto* kcur = reinterpret_cast<typename KT::elem*>(scr + GQA_WARPS * D);  // (D,) the fresh key, cache form
    auto* vcur = reinterpret_cast<typename VT::elem*>(reinterpret_cast<u16*>(kcur) + D);  // (D,) its value
    u16* kdcur = reinterpret_cast<u16*>(vcur) + D;  // (D / 32,) their q8_0 scales (q8_0 planes only)
    u16* vdcur = kdcur + D / QK8_0;
    pdl_trigger();
    // With the token's q, k, v fused in, the kernel before (the q/k/v product) writes nothing this
    // block reads until the query rows: the cache rows below p are older, row p is this
    // kernel's own, pos is the step's. So the first tiles' loads are issued before waiting for
    // it (programmatic dependent launch), and overlap its tail. Without them, q and cache row p
    // come from the kernels before: wait first.
    if (fresh_q == nullptr) pdl_wait();

    const int hk = blockIdx.x, s = blockIdx.y, n_split = gridDim.y;
    const int G = n_head / n_head_kv;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n_kv = *pos + 1, p = n_kv - 1;
    const int lo = window > 0 ? max(0, n_kv - window) : 0;  // splits count from the first key seen, as attn_kv's
    split_len = split_keys(split_len, n_kv - lo, n_split);  // -BK: sized for this step's keys
    const int n_active = (n_kv - lo + split_len - 1) / split_len;
    if (s >= n_active) return;
    const int begin = lo + s * split_len, end = min(n_kv, begin + split_len);
    const size_t kv_stride = (size_t)n_head_kv * D;
    const size_t head_off = (size_t)hk * D;
    const u32 qs_base = smem_u32(Qs);
    const KPlane kp(smem_u32(planes), k_cache, k_d, head_off, kv_stride, tid);
    const VPlane vp(smem_u32(planes + KPlane::BYTES), v_cache, v_d, head_off, kv_stride, tid);
    const int j_begin = begin / BK, n_tiles = (end + BK - 1) / BK;
    auto fetch = [&](int j) {  // tile j into its stages, as one cp.async group (empty past the last tile)
        if (j < n_tiles) {
            kp.fetch(j, begin, end, ring);
            vp.fetch(j, begin, end, ring);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int u = 0; u < S - 1; ++u) fetch(j_begin + u);
    if (fresh_q != nullptr) pdl_wait();

    // the group's query rows, rotated here (fresh) or read, times log2(e) * scale, as fp16
    const float qscale = scale * 1.4426950408889634f;
    const bool holds_p = fresh_q != nullptr && end == n_kv;  // this block stores and stages the token's k, v
    float* wscr = scr + warp * D;
    for (int r = warp; r < 16; r += GQA_WARPS) {
        if (r < G && fresh_q != nullptr) {
            k4ops::rope_row(fresh_q + (size_t)(hk * G + r) * D, wscr, nullptr, q_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
            __syncwarp();
        }
        for (int i = lane; i < D; i += 32) {
            const float v = r >= G ? 0.f : fresh_q != nullptr ? wscr[i] : q[(size_t)(hk * G + r) * D + i];
            Qs[r * DP + i] = f32_to_f16(v * qscale);
        }
        __syncwarp();
    }
    if (holds_p && warp == 0) {
        if constexpr (KT::SCALED) {  // rotated in f32, then quantized as rope.cu does
            k4ops::rope_row(fresh_k + head_off, wscr, nullptr, k_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
            __syncwarp();
            KT::store_row(wscr, D, kcur, kdcur, 0, lane);
        } else {
            k4ops::rope_row(fresh_k + head_off, nullptr, kcur, k_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
        }
    }
    if (holds_p && warp == 1) VT::store_row(fresh_v + head_off, D, vcur, vdcur, 0, lane);
    __syncthreads();
    if (holds_p)  // cache row p: read by no block of this launch
        store_fresh_row<KT, VT>(k_store, kd_store, v_store, vd_store, (size_t)(p & ring) * kv_stride + head_off, kcur, kdcur, vcur, vdcur, D,
                                tid, GQA_THREADS);

    u32 qf[QREG || COLS ? NKC : 1][COLS ? 2 : 4];  // Q's A fragments (rows; D <= 128), or Q^T's B fragments (COLS)
    u32 q8f[I8K ? D / 32 : 1][2];                   // I8K: the 8-bit Q^T's B fragments and its scales
    float2 qd2[I8K ? D / 32 : 1];
    if constexpr (I8K) {  // scr is free again (the RoPE rows are in Qs)
        auto* q8 = reinterpret_cast<signed char*>(scr);
        float* qd = reinterpret_cast<float*>(q8 + 8 * (D + 16));
        static_assert(8 * (D + 16) + 4 * 8 * (D / 32) <= 4 * GQA_WARPS * D, "the 8-bit query rows fit in scr");
        k4gqa::cols_quantize_query<D, ROW_BYTES>(qs_base, q8, qd, tid);
        __syncthreads();
        k4gqa::cols_query_i8<D>(q8f, qd2, q8, qd, lane);
    } else if constexpr (COLS) {
        k4gqa::cols_query<D, ROW_BYTES>(qf, qs_base, lane);
    } else if constexpr (QREG) {
#pragma unroll
        for (int kc = 0; kc < NKC; ++kc)
            ldsm_x4(qs_base + (u32)((lane & 15) * ROW_BYTES + 2 * (16 * kc + 8 * (lane >> 4))), qf[kc][0], qf[kc][1], qf[kc][2], qf[kc][3]);
    }

    float o[COLS ? D / 16 : NOC][4], m[2], l[2];  // O (rows: queries), or O^T (COLS: dims 16i + g, 16i + g + 8)
    softmax_state_init(o, m, l);
    const float cap2 = softcap * 1.4426950408889634f;  // the cap in log2 units
    const int kw = 16 * warp;  // the warp's first key in a tile

    for (int j = j_begin; j < n_tiles; ++j) {
        cp_async_wait<S - 2>();  // tile j's group has landed (the S - 2 after it may not have)
        __syncthreads();         // ... for every thread; every warp is done with tile j - 1
        fetch(j + S - 1);        // into the stages tile j - 1 used
        const u32 kb = kp.tile(j), vb = vp.tile(j);
        kp.prepare(j, tid);  // q8_0: dequantized into the fp16 tile
        vp.prepare(j, tid);
        const bool patch = holds_p && j == n_tiles - 1;
        if (patch) {  // the token's key and value, as staged from the cache (after the dequantization's stores)
            if (KT::SCALED || VT::SCALED) __syncthreads();
            const int rp = p - j * BK;
            if constexpr (I8K) kp.put_row(j, rp, kcur, kdcur, tid, GQA_THREADS);
            for (int i = tid; i < D / 8; i += GQA_THREADS) {
                if constexpr (!I8K) stage8_now<KT>(kb + (u32)(rp * ROW_BYTES + 16 * i), kcur, kdcur, (size_t)(8 * i));
                stage8_now<VT>(vb + (u32)(rp * ROW_BYTES + 16 * i), vcur, vdcur, (size_t)(8 * i));
            }
        }
        if (KT::SCALED || VT::SCALED || patch) __syncthreads();
        const int k0 = j * BK + kw;
        if (k0 >= end || k0 + 15 < begin) continue;  // none of the warp's 16 keys is visible
        if constexpr (COLS) {
            float sc[4];
            if constexpr (I8K) {
                k4gqa::cols_scores_i8<D>(sc, q8f, qd2, kb, kp.scales(j), kw, lane);
            } else {
                k4gqa::cols_scores<D, ROW_BYTES>(sc, qf, kb, kw, lane);
            }
            k4gqa::cols_update<D, ROW_BYTES>(o, m, l, sc, vb, kw, k0, begin, end, softcap > 0.f ? cap2 : 0.f, lane);
            continue;
        }

        float sc[2][4];
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[c][e] = 0.f;
#pragma unroll
        for (int kc = 0; kc < NKC; ++kc) {
            u32 a[4];
            if constexpr (QREG) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[e] = qf[kc][e];
            } else {
                ldsm_x4(qs_base + (u32)((lane & 15) * ROW_BYTES + 2 * (16 * kc + 8 * (lane >> 4))), a[0], a[1], a[2], a[3]);
            }
            u32 b0, b1, b2, b3;  // keys kw .. +7 (b0, b1) and +8 .. +15 (b2, b3), dims 16kc .. +15
            ldsm_x4(kb + (u32)((kw + (lane & 7) + 8 * (lane >> 4)) * ROW_BYTES + 2 * (16 * kc + 8 * ((lane >> 3) & 1))), b0, b1, b2, b3);
            mma16816(sc[0], a, b0, b1);
            mma16816(sc[1], a, b2, b3);
        }
        if (softcap > 0.f) {
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[c][e] = cap2 * k4ops::tanh_f32(sc[c][e] / cap2);
        }
        if (k0 < begin || k0 + 15 >= end) {  // keys outside the visible range
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + 8 * c + 2 * t + (e & 1);
                    if (key < begin || key >= end) sc[c][e] = -k4ops::inf_f32();
                }
        }
        // online softmax: rows g (e = 0, 1) and g + 8 (e = 2, 3); a row's 4 lanes reduce by shuffles
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = fmaxf(m[r], fmaxf(fmaxf(sc[0][2 * r], sc[0][2 * r + 1]), fmaxf(sc[1][2 * r], sc[1][2 * r + 1])));
            mx = fmaxf(mx, __shfl_xor_sync(k4ops::FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(k4ops::FULL_MASK, mx, 2));
            const float base = mx == -k4ops::inf_f32() ? 0.f : mx;  // no key yet: keep exp2 finite
            corr[r] = exp2f(m[r] - base);
            m[r] = mx;
            float rs = 0.f;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                sc[c][2 * r] = exp2f(sc[c][2 * r] - base);
                sc[c][2 * r + 1] = exp2f(sc[c][2 * r + 1] - base);
                rs += sc[c][2 * r] + sc[c][2 * r + 1];
            }
            l[r] = l[r] * corr[r] + rs;
        }
        // rescale O only when some row's max moved (deep in a sequence it seldom does)
        if (__any_sync(k4ops::FULL_MASK, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
            for (int c = 0; c < NOC; ++c) {
                o[c][0] *= corr[0];
                o[c][1] *= corr[0];
                o[c][2] *= corr[1];
                o[c][3] *= corr[1];
            }
        }
        // O += P V over the warp's 16 keys
        const u32 a[4] = {pack_f16x2(sc[0][0], sc[0][1]), pack_f16x2(sc[0][2], sc[0][3]),
                          pack_f16x2(sc[1][0], sc[1][1]), pack_f16x2(sc[1][2], sc[1][3])};
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            u32 b0, b1, b2, b3;  // dims 16dp .. +7 (b0, b1) and +8 .. +15 (b2, b3), keys kw .. +15
            ldsm_x4_trans(vb + (u32)((kw + (lane & 7) + 8 * ((lane >> 3) & 1)) * ROW_BYTES + 2 * (16 * dp + 8 * (lane >> 4))),
                          b0, b1, b2, b3);
            mma16816(o[2 * dp], a, b0, b1);
            mma16816(o[2 * dp + 1], a, b2, b3);
        }
    }

    // merge the warps: (m, l, O) of rows < G through shared memory (the tiles' space, now free)
    cp_async_wait_all();  // the empty groups past the last tile
    float* wm = reinterpret_cast<float*>(planes);  // (GQA_WARPS, 16) running max, log2 units
    float* wl = wm + GQA_WARPS * 16;           // (GQA_WARPS, 16) sums
    float* wo = wl + GQA_WARPS * 16;           // (GQA_WARPS, 16, D) unnormalized outputs
    __syncthreads();  // every warp is done with the tiles
    if constexpr (COLS) {
        k4gqa::cols_store<D>(o, m, l, wm, wl, wo, warp, G, lane);
    } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float lr = l[r];
            lr += __shfl_xor_sync(k4ops::FULL_MASK, lr, 1);
            lr += __shfl_xor_sync(k4ops::FULL_MASK, lr, 2);
            const int row = g + 8 * r;
            if (row >= G) continue;
            if (t == 0) {
                wm[warp * 16 + row] = m[r];
                wl[warp * 16 + row] = lr;
            }
            float* dst = wo + (warp * 16 + row) * D + 2 * t;
#pragma unroll
            for (int c = 0; c < NOC; ++c) *reinterpret_cast<float2*>(dst + 8 * c) = make_float2(o[c][2 * r], o[c][2 * r + 1]);
        }
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += GQA_THREADS) {
        const int r = i / D, c = i % D;
        float M = -k4ops::inf_f32();
#pragma unroll
        for (int w = 0; w < GQA_WARPS; ++w) M = fmaxf(M, wm[w * 16 + r]);
        float L = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < GQA_WARPS; ++w) {
            const float f = exp2f(wm[w * 16 + r] - M);
            L += wl[w * 16 + r] * f;
            a += wo[(w * 16 + r) * D + c] * f;
        }
        const int h = hk * G + r;
        if (n_split == 1) {
            out[(size_t)h * D + c] = a / L;
        } else {
            float* pr = part + ((size_t)h * n_split + s) * (D + 2);
            pr[2 + c] = a;
            if (c == 0) {
                pr[0] = M;
                pr[1] = L;
            }
        }
    }
    if (n_split == 1) return;
    // The last K blocks of the group to finish merge the partials (split_merge.cuh merge_join),
    // each a share of the slices of MERGE_SLICE outputs; K = 1: the last alone, all of them.
    int* count = ticket + hk * G;
    const int K = min(max(helpers, 1), n_active), h = merge_join(count, n_active, K, tid);
    if (h < 0) return;
    if (K == 1) {
        merge_splits<true, D>(part, hk * G, G, n_split, n_active, out, tid, GQA_THREADS, x_q8, x_swz, n_head);
        if (tid == 0) *count = 0;
        return;
    }
    int gone = 0;
    if (tid == 0) gone = merge_leave(count);
    constexpr int SLICES = D / MERGE_SLICE;  // a head's
    for (int i = h + K * warp; i < G * SLICES; i += K * GQA_WARPS) {
        const int r = hk * G + i / SLICES;
        merge_slice<true, D>(part + (size_t)r * n_split * (D + 2), n_active, MERGE_SLICE * (i % SLICES), out + (size_t)r * D, lane,
                             x_q8, x_swz, n_head * D, r * D);
    }
    if (tid == 0 && gone == K - 1) *count = 0;
}

