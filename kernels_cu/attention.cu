// Attention of f32 queries over the fp16 KV cache, causal, with GQA (query head h reads KV head
// h / (n_head / n_head_kv)). One kernel serves decode (n_tok = 1) and prefill (query t sits at
// position pos0 + t and sees cache rows 0 .. pos0 + t).
//
// Each block walks its key range in chunks of ATT_CHUNK positions with the online softmax of
// Milakov & Gimelshein 2018 (as in FlashAttention). With n_split > 1 the key range is split over
// blocks (flash-decoding, Dao et al. 2023): each block writes its running max m, sum l and
// unnormalized accumulator, and attn_combine merges them.
// Launched by runtime/cuda/ops.py (Ops.attention).
#include "ops_common.cuh"

#define ATT_THREADS 128
#define ATT_CHUNK 128
#define ATT_KEYS 4  // keys whose loads one thread issues together

// q: (n_tok, n_head, D) f32. k_cache, v_cache: (n_ctx, n_head_kv, D) fp16 (this layer).
// out: (n_tok, n_head, D) f32, written when n_split == 1.
// part: (n_tok, n_head, n_split, D + 2) f32 partials [m, l, acc[D]], written when n_split > 1.
// pos: (1,) int32, the position of query 0. split_len: keys per split (multiple of ATT_CHUNK).
// Grid: (n_head, n_tok, n_split); block: ATT_THREADS. Dynamic shared memory:
//   (D + ATT_CHUNK + ATT_THREADS * 8) floats. Requires D % 8 == 0 and D <= 8 * ATT_THREADS.
// Thread mapping: scores: groups of tpg lanes per key (tpg = largest power of two <= 32
//   dividing D/8), each lane dotting 8-value slices of ATT_KEYS keys at a time; values: thread =
//   (slice c, key lane kl), accumulating 8 output dims over keys kl, kl + n_kl, ...; key lanes
//   are summed at the end.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attn_f16kv(const float* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
           float* __restrict__ out, float* __restrict__ part, const int* __restrict__ pos, int n_head,
           int n_head_kv, int D, int split_len, float scale) {
    const int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z;
    const int n_split = gridDim.z;
    const int tid = threadIdx.x;
    const int hk = h / (n_head / n_head_kv);
    const int n_kv = *pos + t + 1;
    const int begin = s * split_len;
    const int end = min(n_kv, begin + split_len);
    const size_t kv_stride = (size_t)n_head_kv * D;
    const u16* kbase = k_cache + (size_t)hk * D;
    const u16* vbase = v_cache + (size_t)hk * D;

    extern __shared__ float smem[];
    float* qs = smem;            // (D,) query, pre-scaled
    float* sc = qs + D;          // (ATT_CHUNK,) scores, then probabilities
    float* red = sc + ATT_CHUNK; // (n_kl, D) per-key-lane accumulators

    const float* qh = q + ((size_t)t * n_head + h) * D;
    for (int i = tid; i < D; i += ATT_THREADS) qs[i] = qh[i] * scale;
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
                    raw[u] = j < n ? *reinterpret_cast<const uint4*>(kbase + (size_t)(c0 + j) * kv_stride + cc * 8)
                                   : make_uint4(0, 0, 0, 0);
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
                    raw[u] = j < n ? *reinterpret_cast<const uint4*>(vbase + (size_t)(c0 + j) * kv_stride + c * 8)
                                   : make_uint4(0, 0, 0, 0);
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
    if (n_split > 1 && tid == 0) {
        dst[-2] = m;
        dst[-1] = l;
    }
}

// Merge the n_split partials of each (token, head): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
// part: (n_tok, n_head, n_split, D + 2) f32; out: (n_tok, n_head, D) f32.
// Grid: (n_head, n_tok); threads stride over D. Splits past the key range hold m = -inf, l = 0.
extern "C" __global__ void attn_combine(const float* __restrict__ part, float* __restrict__ out, int n_head, int D,
                                        int n_split) {
    const size_t row = (size_t)blockIdx.y * n_head + blockIdx.x;
    const float* pr = part + row * n_split * (D + 2);
    float M = -k4ops::inf_f32();
    for (int s = 0; s < n_split; ++s) M = fmaxf(M, pr[s * (D + 2)]);
    float L = 0.0f;
    for (int s = 0; s < n_split; ++s) L += pr[s * (D + 2) + 1] * __expf(pr[s * (D + 2)] - M);
    const float inv_L = 1.0f / L;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_split; ++s) a += pr[s * (D + 2) + 2 + i] * __expf(pr[s * (D + 2)] - M);
        out[row * D + i] = a * inv_L;
    }
}
