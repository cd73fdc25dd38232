// Attention of f32 queries over the fp16 KV cache, causal, with GQA (query head h reads KV head
// h / (n_head / n_head_kv)). One kernel serves decode (n_tok = 1) and prefill (query t sits at
// position pos0 + t and sees cache rows 0 .. pos0 + t).
//
// Each block walks its key range in chunks of ATT_CHUNK positions with the online softmax of
// Milakov & Gimelshein 2018 (as in FlashAttention). With n_split > 1 the key range is split over
// blocks (flash-decoding, Dao et al. 2023): each block writes its running max m, sum l and
// unnormalized accumulator, and the last block of a query head to finish (an atomic ticket,
// the threadFenceReduction pattern of the CUDA samples) merges them, so no second kernel runs.
// attn_tiled serves prefill (flag K4_TILED_ATTN): a block takes 32 queries of one head and walks
// the keys in tiles of 64 staged in shared memory, so each key and value is read once per 32
// queries instead of once per query (the tiling of FlashAttention-2, Dao 2023, on CUDA cores).
// attn_mma (flag K4_MMA_ATTN, taking precedence) is FlashAttention-2 on tensor cores: see its section.
// Launched by runtime/cuda/ops.py (Ops.attention).
// ATT_THREADS, ATT_CHUNK, TILE_*, MMA_* and the shared-memory sizes the launcher computes
// come from runtime/cuda/constants.py (constants.cuh); the sizes are checked below.
#include "ops_common.cuh"

#define ATT_KEYS 4  // keys whose loads one thread issues together

// q: (n_tok, n_head, D) f32. k_cache, v_cache: (n_ctx, n_head_kv, D) fp16 (this layer).
// out: (n_tok, n_head, D) f32.
// part: (n_tok, n_head, n_split, D + 2) f32 partials [m, l, acc[D]], written when n_split > 1
//   by the splits that hold keys (the first ceil(n_kv / split_len)); ticket: (n_tok, n_head)
//   int32, zero on entry and left zero, counts the splits done.
// pos: (1,) int32, the position of query 0. split_len: keys per split. scale: of q.k.
// window > 0: a sliding layer (Gemma): the query at position p sees keys p - window + 1 .. p only;
//   splits wholly before that hold no keys (they exit, and the merge skips them). softcap > 0:
//   scores -> softcap * tanh(score / softcap) (Gemma 2). window = 0, softcap = 0: plain causal.
// fresh_q, fresh_k, fresh_v: null, or (decode, n_tok = 1, RoPE fused; q is then not read) the
//   token's unrotated q (n_head, D), k and v (n_head_kv, D) f32 from the projections: each block
//   rotates q itself (with q_norm, k_norm (D,) or null, inv_freq (rope_dim/2,) f64, rope_dim,
//   neox, eps, mscale as rope.cu), the block whose split holds the token's position takes its key and
//   value from registers rounded to fp16 (exactly what the cache would hold), and of those the
//   block of the first query head of each KV head stores them into the cache rows through
//   k_store, v_store (the cache again; that row is read by no block of this launch).
// Grid: (n_head, n_tok, n_split); block: ATT_THREADS. Dynamic shared memory: att_smem(D) bytes.
//   Requires D % 8 == 0 and D <= 8 * ATT_THREADS.
// Thread mapping: scores: groups of tpg lanes per key (tpg = largest power of two <= 32
//   dividing D/8), each lane dotting 8-value slices of ATT_KEYS keys at a time; values: thread =
//   (slice c, key lane kl), accumulating 8 output dims over keys kl, kl + n_kl, ...; key lanes
//   are summed at the end.
// Shared memory of attn_f16kv in bytes: qs, sc, red (floats), kcur and vcur (fp16), as carved below.
__host__ __device__ constexpr int att_smem(int D) { return 4 * (D + ATT_CHUNK + ATT_THREADS * 8) + 2 * 2 * D; }

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attn_f16kv(const float* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
           float* __restrict__ out, float* __restrict__ part, int* __restrict__ ticket, const int* __restrict__ pos,
           int n_head, int n_head_kv, int D, int split_len, float scale, int window, float softcap,
           const float* __restrict__ fresh_q, const float* __restrict__ fresh_k, const float* __restrict__ fresh_v,
           u16* k_store, u16* v_store, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
           const double* __restrict__ inv_freq, int rope_dim, int neox, float eps, float mscale) {
    pdl_trigger();
    pdl_wait();
    const int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z;
    const int n_split = gridDim.z;
    const int tid = threadIdx.x;
    const int hk = h / (n_head / n_head_kv);
    const int n_kv = *pos + t + 1;
    const int n_active = (n_kv + split_len - 1) / split_len;  // splits up to the last key
    const int lo = window > 0 ? max(0, n_kv - window) : 0;    // the first key this query sees
    const int first = lo / split_len;                         // the first split holding keys
    if (s >= n_active || s < first) return;
    const int begin = max(s * split_len, lo);
    const int end = min(n_kv, (s + 1) * split_len);  // this split's range, cut to the window's start above
    const size_t kv_stride = (size_t)n_head_kv * D;
    const u16* kbase = k_cache + (size_t)hk * D;
    const u16* vbase = v_cache + (size_t)hk * D;

    extern __shared__ float smem[];
    float* qs = smem;            // (D,) query, pre-scaled
    float* sc = qs + D;          // (ATT_CHUNK,) scores, then probabilities
    float* red = sc + ATT_CHUNK; // (n_kl, D) per-key-lane accumulators
    u16* kcur = reinterpret_cast<u16*>(red + ATT_THREADS * 8);  // (D,) fp16 key of the fresh token
    u16* vcur = kcur + D;                                         // (D,) its value

    const int p = n_kv - 1;  // this query's position
    const int cur = fresh_q && end == n_kv ? p : -1;  // the key taken from kcur / vcur, if in this split
    if (fresh_q) {
        const int warp = tid >> 5, lane = tid & 31;
        if (warp == 0) k4ops::rope_row(fresh_q + (size_t)h * D, qs, nullptr, q_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
        if (cur >= 0 && warp == 1)
            k4ops::rope_row(fresh_k + (size_t)hk * D, nullptr, kcur, k_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
        if (cur >= 0 && warp == 2)
            for (int i = lane; i < D; i += 32) vcur[i] = f32_to_f16(fresh_v[(size_t)hk * D + i]);
        __syncthreads();
        for (int i = tid; i < D; i += ATT_THREADS) qs[i] *= scale;
        if (cur >= 0 && h % (n_head / n_head_kv) == 0) {
            const size_t row = (size_t)p * kv_stride + (size_t)hk * D;
            for (int i = tid; i < D; i += ATT_THREADS) {
                k_store[row + i] = kcur[i];
                v_store[row + i] = vcur[i];
            }
        }
    } else {
        const float* qh = q + ((size_t)t * n_head + h) * D;
        for (int i = tid; i < D; i += ATT_THREADS) qs[i] = qh[i] * scale;
    }
    __syncthreads();

    const int G = D / 8;  // 8-value slices per row
    int tpg = 1;
    while (tpg < 32 && G % (tpg * 2) == 0) tpg *= 2;
    const int grp = tid / tpg, gl = tid % tpg, n_grp = ATT_THREADS / tpg;
    const int n_kl = ATT_THREADS / G;  // key lanes for the value pass
    const int c = tid % G, kl = tid / G;
    const bool v_active = kl < n_kl;

    float m = -k4ops::inf_f32(), l = 0.0f;
    float acc[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) acc[u] = 0.0f;

    for (int c0 = begin; c0 < end; c0 += ATT_CHUNK) {
        const int n = min(ATT_CHUNK, end - c0);
        // Scores, ATT_KEYS keys per group per round with their loads issued together. The trip
        // count is uniform per warp, so the group shuffles see every lane.
        for (int j0 = 0; j0 < n; j0 += ATT_KEYS * n_grp) {
            float d[ATT_KEYS];
#pragma unroll
            for (int u = 0; u < ATT_KEYS; ++u) d[u] = 0.0f;
            for (int cc = gl; cc < G; cc += tpg) {
                uint4 raw[ATT_KEYS];
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    const int j = j0 + grp + u * n_grp;
                    raw[u] = j >= n           ? make_uint4(0, 0, 0, 0)
                             : c0 + j == cur ? *reinterpret_cast<const uint4*>(kcur + cc * 8)
                                             : ld_once16(kbase + (size_t)(c0 + j) * kv_stride + cc * 8);
                }
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    float kv[8];
                    k4ops::unpack_half8(raw[u], kv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) d[u] += kv[e] * qs[cc * 8 + e];
                }
            }
#pragma unroll
            for (int u = 0; u < ATT_KEYS; ++u) {
                for (int off = tpg / 2; off > 0; off >>= 1) d[u] += __shfl_xor_sync(k4ops::FULL_MASK, d[u], off);
                const int j = j0 + grp + u * n_grp;
                if (softcap > 0.0f) d[u] = softcap * k4ops::tanh_f32(d[u] / softcap);
                if (j < n && gl == 0) sc[j] = d[u];
            }
        }
        __syncthreads();
        float cm = -k4ops::inf_f32();
        for (int j = tid; j < n; j += ATT_THREADS) cm = fmaxf(cm, sc[j]);
        cm = k4ops::block_max(cm);
        const float m_new = fmaxf(m, cm);
        const float corr = __expf(m - m_new);
        float ps = 0.0f;
        for (int j = tid; j < n; j += ATT_THREADS) {
            const float p = __expf(sc[j] - m_new);
            sc[j] = p;
            ps += p;
        }
        ps = k4ops::block_sum(ps);  // its barriers also publish sc
        l = l * corr + ps;
        m = m_new;
#pragma unroll
        for (int u = 0; u < 8; ++u) acc[u] *= corr;
        if (v_active) {  // ATT_KEYS keys per round, loads first
            for (int j0 = kl; j0 < n; j0 += ATT_KEYS * n_kl) {
                uint4 raw[ATT_KEYS];
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    const int j = j0 + u * n_kl;
                    raw[u] = j >= n           ? make_uint4(0, 0, 0, 0)
                             : c0 + j == cur ? *reinterpret_cast<const uint4*>(vcur + c * 8)
                                             : ld_once16(vbase + (size_t)(c0 + j) * kv_stride + c * 8);
                }
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    const int j = j0 + u * n_kl;
                    const float p = j < n ? sc[j] : 0.0f;
                    float vv[8];
                    k4ops::unpack_half8(raw[u], vv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[e] += p * vv[e];
                }
            }
        }
        __syncthreads();  // sc is rewritten by the next chunk
    }

    if (v_active) {
#pragma unroll
        for (int u = 0; u < 8; ++u) red[kl * D + c * 8 + u] = acc[u];
    }
    __syncthreads();
    const size_t row = (size_t)t * n_head + h;
    float* dst = n_split == 1 ? out + row * D : part + (row * n_split + s) * (D + 2) + 2;
    const float inv_l = n_split == 1 ? 1.0f / l : 1.0f;
    for (int i = tid; i < D; i += ATT_THREADS) {
        float a = 0.0f;
        for (int r = 0; r < n_kl; ++r) a += red[r * D + i];
        dst[i] = a * inv_l;
    }
    if (n_split == 1) return;
    if (tid == 0) {
        dst[-2] = m;
        dst[-1] = l;
    }
    // the last split of this (token, head) to finish merges the partials:
    // out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
    __shared__ int is_last;
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        is_last = atomicAdd(ticket + row, 1) == n_active - first - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float* pr = part + row * n_split * (D + 2);
    float M = -k4ops::inf_f32();
    for (int j = first; j < n_active; ++j) M = fmaxf(M, __ldcg(pr + j * (D + 2)));
    float L = 0.0f;
    for (int j = first; j < n_active; ++j) L += __ldcg(pr + j * (D + 2) + 1) * __expf(__ldcg(pr + j * (D + 2)) - M);
    const float inv_L = 1.0f / L;
    for (int i = tid; i < D; i += ATT_THREADS) {
        float a = 0.0f;
        for (int j = first; j < n_active; ++j) a += __ldcg(pr + j * (D + 2) + 2 + i) * __expf(__ldcg(pr + j * (D + 2)) - M);
        out[row * D + i] = a * inv_L;
    }
    if (tid == 0) ticket[row] = 0;
}

// TILE_Q queries per block, TILE_K keys per shared-memory tile, TILE_THREADS threads; TILE_PS:
// the row stride of the probabilities (floats), TILE_K + 16 so the two half-warps hit other banks.

// Shared memory of attn_tiled<D> in bytes; runtime/cuda/ops.py computes the same.
__host__ __device__ constexpr int tiled_smem(int D) { return 4 * (TILE_Q * (D + 4) + TILE_K * (D + 4) + TILE_K * D + TILE_Q * TILE_PS); }

// Causal attention of n_tok queries (query t at position pos0 + t, pos0 = *pos) over the cache
// rows 0 .. pos0 + t. q, out: (n_tok, n_head, D) f32; k_cache, v_cache: (n_ctx, n_head_kv, D) fp16.
// scale, window, softcap: as attn_f16kv (the block starts at the tile of its first query's window).
// Grid: (n_head, ceil(n_tok / TILE_Q)); block: TILE_THREADS; dynamic shared memory tiled_smem(D).
// Thread mapping: thread (rg, kg) = (tid / 16, tid % 16) owns query rows rg + 8i (i < 4); for
// scores the keys kg + 16j (j < 4) of the tile, for the output the columns 64c + 4kg .. + 3
// (c < D / 64). The 16 lanes of a half-warp share their rows, so row max and sum reduce by
// shuffles among them. Rows are padded by 4 floats so the 16-byte key reads are conflict-free.
template <int D>
__global__ void __launch_bounds__(TILE_THREADS)
attn_tiled(const float* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
           float* __restrict__ out, const int* __restrict__ pos, int n_tok, int n_head, int n_head_kv, float scale,
           int window, float softcap) {
    constexpr int DP = D + 4, NC = D / 64;
    extern __shared__ float4 tile_smem[];
    float* Qs = reinterpret_cast<float*>(tile_smem);  // (TILE_Q, DP) queries, pre-scaled
    float* Ks = Qs + TILE_Q * DP;                     // (TILE_K, DP) keys
    float* Vs = Ks + TILE_K * DP;                     // (TILE_K, D) values
    float* Ps = Vs + TILE_K * D;                      // (TILE_Q, TILE_PS) probabilities
    pdl_trigger();
    pdl_wait();
    const int h = blockIdx.x, q0 = blockIdx.y * TILE_Q;
    const int hk = h / (n_head / n_head_kv);
    const int tid = threadIdx.x, rg = tid >> 4, kg = tid & 15;
    const int nq = min(TILE_Q, n_tok - q0);
    const int pos0 = *pos;
    const int n_keys = pos0 + q0 + nq;  // keys seen by the block's last query
    const size_t kv_stride = (size_t)n_head_kv * D;

    for (int i = tid; i < TILE_Q * D / 4; i += TILE_THREADS) {
        const int r = i / (D / 4), c4 = i % (D / 4);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nq) v = reinterpret_cast<const float4*>(q + ((size_t)(q0 + r) * n_head + h) * D)[c4];
        *reinterpret_cast<float4*>(Qs + r * DP + 4 * c4) = make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale);
    }
    float m[4], l[4], o[4][NC][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = -k4ops::inf_f32();
        l[i] = 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[i][c][e] = 0.f;
    }

    const int k_begin = window > 0 ? max(0, pos0 + q0 - window + 1) / TILE_K * TILE_K : 0;
    for (int k0 = k_begin; k0 < n_keys; k0 += TILE_K) {
        __syncthreads();  // the previous tile is consumed (and Qs is written, the first time)
        for (int i = tid; i < TILE_K * D / 8; i += TILE_THREADS) {
            const int r = i / (D / 8), c8 = i % (D / 8);
            uint4 kr = make_uint4(0, 0, 0, 0), vr = kr;
            if (k0 + r < n_keys) {
                const size_t at = (size_t)(k0 + r) * kv_stride + (size_t)hk * D + 8 * c8;
                kr = *reinterpret_cast<const uint4*>(k_cache + at);
                vr = *reinterpret_cast<const uint4*>(v_cache + at);
            }
            float kf[8], vf[8];
            k4ops::unpack_half8(kr, kf);
            k4ops::unpack_half8(vr, vf);
            float4* kd = reinterpret_cast<float4*>(Ks + r * DP + 8 * c8);
            float4* vd = reinterpret_cast<float4*>(Vs + r * D + 8 * c8);
            kd[0] = make_float4(kf[0], kf[1], kf[2], kf[3]);
            kd[1] = make_float4(kf[4], kf[5], kf[6], kf[7]);
            vd[0] = make_float4(vf[0], vf[1], vf[2], vf[3]);
            vd[1] = make_float4(vf[4], vf[5], vf[6], vf[7]);
        }
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            float4 qv[4], kv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) qv[i] = *reinterpret_cast<const float4*>(Qs + (rg + 8 * i) * DP + d);
#pragma unroll
            for (int j = 0; j < 4; ++j) kv[j] = *reinterpret_cast<const float4*>(Ks + (kg + 16 * j) * DP + d);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    s[i][j] += qv[i].x * kv[j].x + qv[i].y * kv[j].y + qv[i].z * kv[j].z + qv[i].w * kv[j].w;
        }
        // online softmax per row: mask keys past the query, rescale the running sums
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = rg + 8 * i;
            const int q_pos = pos0 + q0 + row;
            float mx = -k4ops::inf_f32();
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int key = k0 + kg + 16 * j;
                if (softcap > 0.f) s[i][j] = softcap * k4ops::tanh_f32(s[i][j] / softcap);
                if (row >= nq || key > q_pos || (window > 0 && key <= q_pos - window)) s[i][j] = -k4ops::inf_f32();
                mx = fmaxf(mx, s[i][j]);
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(k4ops::FULL_MASK, mx, off));
            const float m_new = fmaxf(m[i], mx);
            const bool none = m_new == -k4ops::inf_f32();  // no key of this row yet (a padding row)
            const float corr = none ? 1.f : __expf(m[i] - m_new);
            float ps = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float p = none || s[i][j] == -k4ops::inf_f32() ? 0.f : __expf(s[i][j] - m_new);
                Ps[row * TILE_PS + kg + 16 * j] = p;
                ps += p;
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) ps += __shfl_xor_sync(k4ops::FULL_MASK, ps, off);
            l[i] = l[i] * corr + ps;
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < NC; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[i][c][e] *= corr;
        }
        __syncthreads();  // Ps complete
        const int kn = min(TILE_K, n_keys - k0);
        for (int kk = 0; kk < kn; ++kk) {
            float p[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) p[i] = Ps[(rg + 8 * i) * TILE_PS + kk];
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4 v = *reinterpret_cast<const float4*>(Vs + kk * D + 64 * c + 4 * kg);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    o[i][c][0] += p[i] * v.x;
                    o[i][c][1] += p[i] * v.y;
                    o[i][c][2] += p[i] * v.z;
                    o[i][c][3] += p[i] * v.w;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = rg + 8 * i;
        if (row >= nq) continue;
        const float inv_l = 1.f / l[i];
        float* dst = out + ((size_t)(q0 + row) * n_head + h) * D;
#pragma unroll
        for (int c = 0; c < NC; ++c)
            *reinterpret_cast<float4*>(dst + 64 * c + 4 * kg) =
                make_float4(o[i][c][0] * inv_l, o[i][c][1] * inv_l, o[i][c][2] * inv_l, o[i][c][3] * inv_l);
    }
}


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
// MMA_WARPS, MMA_THREADS = 32 * MMA_WARPS, MMA_BQ = 16 * MMA_WARPS: constants.cuh.

namespace k4mma {

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, asynchronously; valid = false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Four 8x8 fp16 matrices; lane i gives the row address of matrix i / 8, row i % 8.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// c (16x8 f32) += a (16x16 fp16, row) * b (16x8 fp16, col).
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to fp16, lo in the low half.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

}  // namespace k4mma

// Shared memory of attn_mma<D, BK> in bytes (the Q tile for D > 128, two K and two V tiles, rows
// of D + 8 halves); runtime/cuda/ops.py computes the same.
__host__ __device__ constexpr int mma_smem(int D, int BK) { return 2 * (D + 8) * ((D <= 128 ? 0 : MMA_BQ) + 4 * BK); }

// Causal attention of n_tok queries (query t at position pos0 + t, pos0 = *pos) over the cache
// rows 0 .. pos0 + t, on tensor cores. q, out: (n_tok, n_head, D) f32; k_cache, v_cache: (n_ctx,
// n_head_kv, D) fp16; scale, window, softcap: as attn_f16kv (tiles before the window of a block's or a
// warp's first query are skipped; softcap applies to S in log2 units with cap * log2(e)). Grid: (n_head, ceil(n_tok / MMA_BQ)); block:
// MMA_THREADS; dynamic shared memory mma_smem(D, BK). Requires D % 16 == 0, BK % 16 == 0.
// Thread mapping: lane = 4g + t holds rows g and g + 8 of its warp's 16 queries and, per 8-column
// chunk of S or O, columns 2t and 2t + 1 (the mma accumulator layout).
template <int D, int BK>
__global__ void __launch_bounds__(MMA_THREADS, 2)
attn_mma(const float* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
         float* __restrict__ out, const int* __restrict__ pos, int n_tok, int n_head, int n_head_kv, float scale,
         int window, float softcap) {
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
    const u16* kg = k_cache + (size_t)hk * D;
    const u16* vg = v_cache + (size_t)hk * D;
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
        const size_t at = (size_t)k0 * kv_stride + 8 * c0;
        const u32 dst = tile_dst + (u32)((j & 1) * BK * ROW_BYTES);
#pragma unroll
        for (int it = 0; it < LOAD_ITERS; ++it) {
            const bool valid = k0 + LOAD_STEP * it < n_keys;
            const size_t off = valid ? at + (size_t)(LOAD_STEP * it) * kv_stride : 0;
            cp_async16(ks_base + dst + LOAD_STEP * it * ROW_BYTES, kg + off, valid);
            cp_async16(vs_base + dst + LOAD_STEP * it * ROW_BYTES, vg + off, valid);
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
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m[r] = -k4ops::inf_f32();
        l[r] = 0.f;
    }
#pragma unroll
    for (int c = 0; c < NOC; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[c][e] = 0.f;
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
        for (int c = 0; c < NOC; ++c) *reinterpret_cast<float2*>(dst + 8 * c) = make_float2(o[c][2 * r] * inv_l, o[c][2 * r + 1] * inv_l);
    }
}

// The launcher's sizes (runtime/cuda/constants.py att_smem, tiled_smem, mma_smem) are these.
__host__ __device__ constexpr bool smem_sizes_agree() {
    constexpr int att[] = {K4_CHECK_ATT_SMEM};      // D, bytes
    constexpr int tiled[] = {K4_CHECK_TILED_SMEM};  // D, bytes
    constexpr int mma[] = {K4_CHECK_MMA_SMEM};      // D, BK, bytes
    for (int i = 0; i < (int)(sizeof(att) / sizeof(int)); i += 2)
        if (att_smem(att[i]) != att[i + 1]) return false;
    for (int i = 0; i < (int)(sizeof(tiled) / sizeof(int)); i += 2)
        if (tiled_smem(tiled[i]) != tiled[i + 1]) return false;
    for (int i = 0; i < (int)(sizeof(mma) / sizeof(int)); i += 3)
        if (mma_smem(mma[i], mma[i + 1]) != mma[i + 2]) return false;
    return true;
}
static_assert(smem_sizes_agree(), "a shared-memory size differs from runtime/cuda/constants.py");
