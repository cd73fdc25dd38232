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
// Launched by runtime/cuda/ops.py (Ops.attention).
#include "ops_common.cuh"

#define ATT_THREADS 128
#define ATT_CHUNK 128
#define ATT_KEYS 4  // keys whose loads one thread issues together

// q: (n_tok, n_head, D) f32. k_cache, v_cache: (n_ctx, n_head_kv, D) fp16 (this layer).
// out: (n_tok, n_head, D) f32.
// part: (n_tok, n_head, n_split, D + 2) f32 partials [m, l, acc[D]], written when n_split > 1
//   by the splits that hold keys (the first ceil(n_kv / split_len)); ticket: (n_tok, n_head)
//   int32, zero on entry and left zero, counts the splits done.
// pos: (1,) int32, the position of query 0. split_len: keys per split.
// fresh_q, fresh_k, fresh_v: null, or (decode, n_tok = 1, RoPE fused; q is then not read) the
//   token's unrotated q (n_head, D), k and v (n_head_kv, D) f32 from the projections: each block
//   rotates q itself (with q_norm, k_norm (D,) or null, inv_freq (rope_dim/2,) f64, rope_dim,
//   neox, eps as rope.cu), the block whose split holds the token's position takes its key and
//   value from registers rounded to fp16 (exactly what the cache would hold), and of those the
//   block of the first query head of each KV head stores them into the cache rows through
//   k_store, v_store (the cache again; that row is read by no block of this launch).
// Grid: (n_head, n_tok, n_split); block: ATT_THREADS. Dynamic shared memory:
//   (D + ATT_CHUNK + ATT_THREADS * 8 + D) floats. Requires D % 8 == 0 and D <= 8 * ATT_THREADS.
// Thread mapping: scores: groups of tpg lanes per key (tpg = largest power of two <= 32
//   dividing D/8), each lane dotting 8-value slices of ATT_KEYS keys at a time; values: thread =
//   (slice c, key lane kl), accumulating 8 output dims over keys kl, kl + n_kl, ...; key lanes
//   are summed at the end.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attn_f16kv(const float* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
           float* __restrict__ out, float* __restrict__ part, int* __restrict__ ticket, const int* __restrict__ pos,
           int n_head, int n_head_kv, int D, int split_len, float scale,
           const float* __restrict__ fresh_q, const float* __restrict__ fresh_k, const float* __restrict__ fresh_v,
           u16* k_store, u16* v_store, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
           const double* __restrict__ inv_freq, int rope_dim, int neox, float eps) {
    pdl_trigger();
    pdl_wait();
    const int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z;
    const int n_split = gridDim.z;
    const int tid = threadIdx.x;
    const int hk = h / (n_head / n_head_kv);
    const int n_kv = *pos + t + 1;
    const int n_active = (n_kv + split_len - 1) / split_len;  // splits holding keys
    if (s >= n_active) return;
    const int begin = s * split_len;
    const int end = min(n_kv, begin + split_len);
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
        if (warp == 0) k4ops::rope_row(fresh_q + (size_t)h * D, qs, nullptr, q_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane);
        if (cur >= 0 && warp == 1)
            k4ops::rope_row(fresh_k + (size_t)hk * D, nullptr, kcur, k_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane);
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
                                             : *reinterpret_cast<const uint4*>(kbase + (size_t)(c0 + j) * kv_stride + cc * 8);
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
                                             : *reinterpret_cast<const uint4*>(vbase + (size_t)(c0 + j) * kv_stride + c * 8);
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
        is_last = atomicAdd(ticket + row, 1) == n_active - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float* pr = part + row * n_split * (D + 2);
    float M = -k4ops::inf_f32();
    for (int j = 0; j < n_active; ++j) M = fmaxf(M, __ldcg(pr + j * (D + 2)));
    float L = 0.0f;
    for (int j = 0; j < n_active; ++j) L += __ldcg(pr + j * (D + 2) + 1) * __expf(__ldcg(pr + j * (D + 2)) - M);
    const float inv_L = 1.0f / L;
    for (int i = tid; i < D; i += ATT_THREADS) {
        float a = 0.0f;
        for (int j = 0; j < n_active; ++j) a += __ldcg(pr + j * (D + 2) + 2 + i) * __expf(__ldcg(pr + j * (D + 2)) - M);
        out[row * D + i] = a * inv_L;
    }
    if (tid == 0) ticket[row] = 0;
}

#define TILE_Q 32       // queries per block of attn_tiled
#define TILE_K 64       // keys per shared-memory tile
#define TILE_THREADS 128
#define TILE_PS (TILE_K + 16)  // row stride of the probabilities (floats): the two half-warps hit other banks

// Shared memory of attn_tiled<D> in bytes; runtime/cuda/ops.py computes the same.
template <int D>
__host__ __device__ constexpr int tiled_smem() { return 4 * (TILE_Q * (D + 4) + TILE_K * (D + 4) + TILE_K * D + TILE_Q * TILE_PS); }

// Causal attention of n_tok queries (query t at position pos0 + t, pos0 = *pos) over the cache
// rows 0 .. pos0 + t. q, out: (n_tok, n_head, D) f32; k_cache, v_cache: (n_ctx, n_head_kv, D) fp16.
// Grid: (n_head, ceil(n_tok / TILE_Q)); block: TILE_THREADS; dynamic shared memory tiled_smem<D>().
// Thread mapping: thread (rg, kg) = (tid / 16, tid % 16) owns query rows rg + 8i (i < 4); for
// scores the keys kg + 16j (j < 4) of the tile, for the output the columns 64c + 4kg .. + 3
// (c < D / 64). The 16 lanes of a half-warp share their rows, so row max and sum reduce by
// shuffles among them. Rows are padded by 4 floats so the 16-byte key reads are conflict-free.
template <int D>
__global__ void __launch_bounds__(TILE_THREADS)
attn_tiled(const float* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
           float* __restrict__ out, const int* __restrict__ pos, int n_tok, int n_head, int n_head_kv, float scale) {
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

    for (int k0 = 0; k0 < n_keys; k0 += TILE_K) {
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
                if (row >= nq || k0 + kg + 16 * j > q_pos) s[i][j] = -k4ops::inf_f32();
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

template __global__ void attn_tiled<64>(const float*, const u16*, const u16*, float*, const int*, int, int, int, float);
template __global__ void attn_tiled<128>(const float*, const u16*, const u16*, float*, const int*, int, int, int, float);
template __global__ void attn_tiled<256>(const float*, const u16*, const u16*, float*, const int*, int, int, int, float);
