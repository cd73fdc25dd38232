// Attention of f32 queries over the KV cache (keys KT, values VT: fp16 or q8_0, kv_cache.cuh),
// causal, with GQA (query head h reads KV head h / (n_head / n_head_kv)). One kernel serves
// decode (n_tok = 1) and prefill (query t sits at position pos0 + t and sees cache rows
// 0 .. pos0 + t).
//
// Each block walks its key range in chunks of ATT_CHUNK positions with the online softmax of
// Milakov & Gimelshein 2018 (as in FlashAttention). With n_split > 1 the key range is split over
// blocks (flash-decoding, Dao et al. 2023): each block writes its running max m, sum l and
// unnormalized accumulator, and the last block of a query head to finish (an atomic ticket,
// the threadFenceReduction pattern of the CUDA samples) merges them, so no second kernel runs.
// Prefill runs attn_mma (tensor cores, attention_mma.cu) or attn_tiled (CUDA cores,
// attention_tiled.cu) where head_dim has an instance; this kernel serves decode and the rest.
// Launched by runtime/cuda/ops.py (Ops.attention). ATT_THREADS, ATT_CHUNK and the shared-memory
// size the launcher computes come from runtime/cuda/constants.py (constants.cuh); the sizes are
// checked in attention_sizes.cuh.
#include "kv_cache.cuh"
#include "attention_sizes.cuh"
#include "gemv_common.cuh"  // q8_lane_store

#define ATT_KEYS 4  // keys whose loads one thread issues together

// q: (n_tok, n_head, D) f32. k_cache, v_cache: (n_ctx, n_head_kv, D) of KT::elem / VT::elem (this
//   layer), k_d, v_d: their (n_ctx, n_head_kv, D / 32) fp16 scale planes (q8_0) or null (f16).
// out: (n_tok, n_head, D) f32.
// part: (n_tok, n_head, n_split, D + 2) f32 partials [m, l, acc[D]], written when more than one
//   split holds keys, by those (the first ceil((n_kv - lo) / split_len), lo below); ticket: (n_tok, n_head)
//   int32, zero on entry and left zero, counts the splits done.
// pos: (1,) int32, the position of query 0. split_len: keys per split, or -g: sized per step in
//   multiples of g (attention_sizes.cuh split_keys). scale: of q.k.
// window > 0: a sliding layer (Gemma): the query at position p sees keys p - window + 1 .. p only,
//   and the splits are counted from that first key (split s takes keys lo + s * split_len .., lo
//   = max(0, p + 1 - window)), so a decode configuration sized for the window serves any depth;
//   splits past the last key exit (and the merge skips them). softcap > 0:
//   scores -> softcap * tanh(score / softcap) (Gemma 2). window = 0, softcap = 0: plain causal.
// ring: -1 for a plain cache (position p at row p), or for a sliding layer's ring (its last
//   ring + 1 positions only, ring + 1 a power of two; runtime/swa_ring.py) the mask of the row:
//   position p lives at row p & ring. Every cache address below goes through that mask.
// fresh_q, fresh_k, fresh_v: null, or (decode, n_tok = 1, RoPE fused; q is then not read) the
//   token's unrotated q (n_head, D), k and v (n_head_kv, D) f32 from the projections: each block
//   rotates q itself (with q_norm, k_norm (D,) or null, inv_freq (rope_dim/2,) f64, rope_dim,
//   neox, eps, mscale as rope.cu), the block whose split holds the token's position takes its key and
//   value from shared memory in the cache's form (rounded to fp16, or quantized to q8_0: exactly
//   what the cache will hold), and of those the block of the first query head of each KV head
//   stores them into the cache rows through k_store, kd_store, v_store, vd_store (the cache and
//   its scale planes again; that row is read by no block of this launch).
// Grid: (n_head, n_tok, n_split); block: ATT_THREADS. Dynamic shared memory: att_smem(D) bytes.
//   Requires D % 8 == 0 and D <= 8 * ATT_THREADS; D % 32 == 0 for a q8_0 plane.
// x_q8: null, or (n_tok = 1, D % 32 == 0, D <= 2 * ATT_THREADS; not DEEP, where the values kept
//   for it would spill at 64 registers) the q8 x of out (n_head * D values, swizzle x_swz;
//   q8_handoff.Q8Vector), written with it for the output product (K4_ATTN_Q8).
// Thread mapping: scores: groups of tpg lanes per key (tpg = largest power of two <= lanes (a
//   power of two <= 32) dividing D/8), each lane dotting 8-value slices of ATT_KEYS keys at a
//   time; fewer lanes per key, fewer shuffles per score (ops.py attention_lanes); values: thread =
//   (slice c, key lane kl), accumulating 8 output dims over keys kl, kl + n_kl, ...; key lanes
//   are summed at the end.

// x_q8: a head's outputs tid and tid + ATT_THREADS (mine) quantized into the q8 x of the whole
// output (n_in values; the head's first is x0) with q8_lane_store: whole warps below D.
__device__ __forceinline__ void q8_store_mine(const float (&mine)[2], int x0, int D, int n_in, int swz, u8* x_q8, int tid) {
    if (tid < D) q8_lane_store(mine[0], x0 + tid, n_in, swz, x_q8, tid & 31);
    if (tid + ATT_THREADS < D) q8_lane_store(mine[1], x0 + tid + ATT_THREADS, n_in, swz, x_q8, tid & 31);
}

// Blocks a multiprocessor: DEEP (decode ranges past GQA_MIN_LIMIT keys, attention_launch.py
// attention_kernel) eight, at most 64 registers; else seven, 72 registers (what nvcc takes for
// fp16 keys unbounded; q8_0 keys took 78-80, six blocks). No spills (nvcc 13, sm_90). On the
// H200, Llama 2 7B's decode at 16,384 keys took 73.7 us a layer with seven blocks, 70.7 with
// eight, and eight cost 0.5% of tg64 at depth 0 (docs/PERF.md, session 16).
template <class KT, class VT, bool DEEP>
__global__ void __launch_bounds__(ATT_THREADS, DEEP ? ATT_BLOCKS_DEEP : ATT_BLOCKS)
attn_kv(const float* __restrict__ q, const typename KT::elem* __restrict__ k_cache, const u16* __restrict__ k_d,
        const typename VT::elem* __restrict__ v_cache, const u16* __restrict__ v_d,
        float* __restrict__ out, float* __restrict__ part, int* __restrict__ ticket, const int* __restrict__ pos,
        int n_head, int n_head_kv, int D, int split_len, int lanes, float scale, int window, float softcap, int ring,
        const float* __restrict__ fresh_q, const float* __restrict__ fresh_k, const float* __restrict__ fresh_v,
        typename KT::elem* k_store, u16* kd_store, typename VT::elem* v_store, u16* vd_store,
        const float* __restrict__ q_norm, const float* __restrict__ k_norm,
        const double* __restrict__ inv_freq, int rope_dim, int neox, float eps, float mscale, u8* __restrict__ x_q8, int x_swz) {
    pdl_trigger();
    pdl_wait();
    const int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z;
    const int n_split = gridDim.z;
    const int tid = threadIdx.x;
    const int hk = h / (n_head / n_head_kv);
    const int n_kv = *pos + t + 1;
    const int lo = window > 0 ? max(0, n_kv - window) : 0;    // the first key this query sees
    split_len = split_keys(split_len, n_kv - lo, n_split);
    const int n_active = (n_kv - lo + split_len - 1) / split_len;  // splits holding keys, from lo
    if (s >= n_active) return;
    const int begin = lo + s * split_len;
    const int end = min(n_kv, begin + split_len);  // this split's range
    const size_t kv_stride = (size_t)n_head_kv * D;
    const size_t head_off = (size_t)hk * D;  // element of this KV head's row at position 0

    extern __shared__ float smem[];
    float* qs = smem;            // (D,) query, pre-scaled
    float* sc = qs + D;          // (ATT_CHUNK,) scores, then probabilities
    float* red = sc + ATT_CHUNK; // (n_kl, D) per-key-lane accumulators; first the fresh key in f32 (D,)
    auto* kcur = reinterpret_cast<typename KT::elem*>(red + ATT_THREADS * 8);  // (D,) key of the fresh token, cache form
    auto* vcur = reinterpret_cast<typename VT::elem*>(kcur + D);               // (D,) its value
    u16* kdcur = reinterpret_cast<u16*>(vcur + D);  // (D / 32,) their q8_0 scales (q8_0 planes only)
    u16* vdcur = kdcur + D / QK8_0;

    const int p = n_kv - 1;  // this query's position
    const int cur = fresh_q && end == n_kv ? p : -1;  // the key taken from kcur / vcur, if in this split
    if (fresh_q) {
        const int warp = tid >> 5, lane = tid & 31;
        if (warp == 0) k4ops::rope_row(fresh_q + (size_t)h * D, qs, nullptr, q_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
        if (cur >= 0 && warp == 1) {
            if constexpr (KT::SCALED) {  // rotated in f32 (in red, free until the end), then quantized as rope.cu does
                k4ops::rope_row(fresh_k + head_off, red, nullptr, k_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
                __syncwarp();
                KT::store_row(red, D, kcur, kdcur, 0, lane);
            } else {
                k4ops::rope_row(fresh_k + head_off, nullptr, kcur, k_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
            }
        }
        if (cur >= 0 && warp == 2) VT::store_row(fresh_v + head_off, D, vcur, vdcur, 0, lane);
        __syncthreads();
        for (int i = tid; i < D; i += ATT_THREADS) qs[i] *= scale;
        if (cur >= 0 && h % (n_head / n_head_kv) == 0)
            store_fresh_row<KT, VT>(k_store, kd_store, v_store, vd_store, (size_t)(p & ring) * kv_stride + head_off, kcur, kdcur, vcur, vdcur, D,
                                    tid, ATT_THREADS);
    } else {
        const float* qh = q + ((size_t)t * n_head + h) * D;
        for (int i = tid; i < D; i += ATT_THREADS) qs[i] = qh[i] * scale;
    }
    __syncthreads();

    const int G = D / 8;  // 8-value slices per row
    int tpg = 1;
    while (tpg < lanes && G % (tpg * 2) == 0) tpg *= 2;
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
                typename KT::raw8 raw[ATT_KEYS];
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    const int j = j0 + grp + u * n_grp;
                    raw[u] = j >= n           ? KT::zero()
                             : c0 + j == cur ? KT::load(kcur, kdcur, cc * 8)
                                             : KT::load_once(k_cache, k_d, (size_t)((c0 + j) & ring) * kv_stride + head_off + cc * 8);
                }
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) KT::dot8(raw[u], qs + cc * 8, d[u]);
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
                typename VT::raw8 raw[ATT_KEYS];
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    const int j = j0 + u * n_kl;
                    raw[u] = j >= n           ? VT::zero()
                             : c0 + j == cur ? VT::load(vcur, vdcur, c * 8)
                                             : VT::load_once(v_cache, v_d, (size_t)((c0 + j) & ring) * kv_stride + head_off + c * 8);
                }
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    const int j = j0 + u * n_kl;
                    VT::axpy8(raw[u], j < n ? sc[j] : 0.0f, acc);
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
    // one split holding keys (n_split == 1, or the first positions of a split range): the output
    // directly, no partials, ticket or merge (the merge of one split gives these bits: e^0 = 1)
    const bool direct = n_active == 1;
    float* dst = direct ? out + row * D : part + (row * n_split + s) * (D + 2) + 2;
    const float inv_l = direct ? 1.0f / l : 1.0f;
    float mine[2] = {0.0f, 0.0f};  // outputs tid and tid + ATT_THREADS (x_q8: D <= 2 ATT_THREADS)
    for (int i = tid; i < D; i += ATT_THREADS) {
        float a = 0.0f;
        for (int r = 0; r < n_kl; ++r) a += red[r * D + i];
        dst[i] = mine[i != tid] = a * inv_l;
    }
    if (direct) {
        if (!DEEP && x_q8 != nullptr) q8_store_mine(mine, (int)row * D, D, n_head * D, x_swz, x_q8, tid);
        return;
    }
    if (tid == 0) {
        dst[-2] = m;
        dst[-1] = l;
    }
    // the last split of this (token, head) to finish merges the partials:
    // out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, summed in the order of the splits
    // both ways below (the bits the CUDA goldens were checked with)
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
    if constexpr (DEEP) {  // many splits: their (m, l) read once, together; 16 outputs' loads in flight
        __shared__ float pm[ATT_MAX_SPLIT], pl[ATT_MAX_SPLIT];
        for (int j = tid; j < n_active; j += ATT_THREADS) {
            pm[j] = __ldcg(pr + j * (D + 2));
            pl[j] = __ldcg(pr + j * (D + 2) + 1);
        }
        __syncthreads();
        float M = -k4ops::inf_f32();
        for (int j = 0; j < n_active; ++j) M = fmaxf(M, pm[j]);
        float L = 0.0f;
        for (int j = 0; j < n_active; ++j) L += pl[j] * __expf(pm[j] - M);
        const float inv_L = 1.0f / L;
        for (int i = tid; i < D; i += ATT_THREADS) {
            float a = 0.0f;
            int j = 0;
            for (; j + 16 <= n_active; j += 16) {
                float v[16];
#pragma unroll
                for (int u = 0; u < 16; ++u) v[u] = __ldcg(pr + (j + u) * (D + 2) + 2 + i);
#pragma unroll
                for (int u = 0; u < 16; ++u) a += v[u] * __expf(pm[j + u] - M);
            }
            for (; j < n_active; ++j) a += __ldcg(pr + j * (D + 2) + 2 + i) * __expf(pm[j] - M);
            out[row * D + i] = mine[i != tid] = a * inv_L;
        }
    } else {  // few splits (short ranges): each thread reads the (m, l) pairs itself, no barrier
        float M = -k4ops::inf_f32();
        for (int j = 0; j < n_active; ++j) M = fmaxf(M, __ldcg(pr + j * (D + 2)));
        float L = 0.0f;
        for (int j = 0; j < n_active; ++j) L += __ldcg(pr + j * (D + 2) + 1) * __expf(__ldcg(pr + j * (D + 2)) - M);
        const float inv_L = 1.0f / L;
        for (int i = tid; i < D; i += ATT_THREADS) {
            float a = 0.0f;
            for (int j = 0; j < n_active; ++j) a += __ldcg(pr + j * (D + 2) + 2 + i) * __expf(__ldcg(pr + j * (D + 2)) - M);
            out[row * D + i] = mine[i != tid] = a * inv_L;
        }
    }
    if (!DEEP && x_q8 != nullptr) q8_store_mine(mine, (int)row * D, D, n_head * D, x_swz, x_q8, tid);
    if (tid == 0) ticket[row] = 0;
}
