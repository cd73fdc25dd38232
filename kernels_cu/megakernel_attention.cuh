// The megakernel's attention op (kernels_cu/megakernel.cu): one layer's RoPE, f16 cache store and
// causal attention of the step's one query, in work items of (KV head, split of the keys).
#pragma once
#include "kv_cache.cuh"

namespace mk {

constexpr int WARPS = MK_THREADS / 32;
__device__ __forceinline__ float f32_bits(i64 w) { return __int_as_float((int)w); }  // a float field of a record

// Scratch (floats): the group's queries (MK_MAX_GD), the fresh key and value (MK_MAX_D each),
// scores (MK_MAX_GROUP x MK_SPLIT_KEYS), then the max and the sum of each head.
constexpr int S_Q = 0, S_K = MK_MAX_GD, S_V = S_K + MK_MAX_D, S_SC = S_V + MK_MAX_D, S_M = S_SC + MK_MAX_GROUP * MK_SPLIT_KEYS,
              S_L = S_M + MK_MAX_GROUP, S_END = S_L + MK_MAX_GROUP;
static_assert(S_END == MK_ATTN_SCRATCH_FLOATS, "megakernel attention scratch: runtime/cuda/constants.py has another size");

// Sum v over the aligned groups of n lanes (n a power of two up to 32); every lane of the warp calls it.
__device__ __forceinline__ float group_sum(float v, int n) {
    for (int off = n >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// 8 values of a head row: the fresh row (shared memory) at position pos, else the f16 cache.
__device__ __forceinline__ void row8(const u16* cache, const float* fresh, int j, int pos, int n_head_kv, int g, int D, int c,
                                     bool ok, float (&v)[8]) {
    if (ok && j != pos) {
        kv_f16::unpack(kv_f16::load_once(cache, nullptr, ((size_t)j * n_head_kv + g) * D + 8 * c), v);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = ok ? fresh[8 * c + e] : 0.f;
    }
}

// Work item (KV head g, split s) of one layer's attention at position pos: split s covers keys
// [s L, min((s + 1) L, pos + 1)), n_split = min(MK_MAX_SPLIT, ceil((pos + 1) / MK_SPLIT_MIN));
// the split holding pos also rotates the fresh key and stores it and the value into the cache.
// Scores: D / 8 adjacent lanes per key, 16 bytes each, summed by shuffles; P.V: lanes of one
// 8-value column of a query head take every KQ-th key, summed by shuffles. One split: the output
// directly; several: partials (max, sum, unnormalized P.V) merged by the block that finishes a
// KV head's last split (a ticket per KV head).
__device__ void attention(const i64* o, int pos, float* sm) {
    const float* q = reinterpret_cast<const float*>(o[MKO_Q]);
    const float* kf = reinterpret_cast<const float*>(o[MKO_K]);
    const float* vf = reinterpret_cast<const float*>(o[MKO_V]);
    u16* kc = reinterpret_cast<u16*>(o[MKO_K_CACHE]);
    u16* vc = reinterpret_cast<u16*>(o[MKO_V_CACHE]);
    float* out = reinterpret_cast<float*>(o[MKO_OUT]);
    float* part = reinterpret_cast<float*>(o[MKO_PART]);
    int* ticket = reinterpret_cast<int*>(o[MKO_TICKET]);
    const double* inv_freq = reinterpret_cast<const double*>(o[MKO_INV_FREQ]);
    const float* q_norm = reinterpret_cast<const float*>(o[MKO_Q_NORM]);
    const float* k_norm = reinterpret_cast<const float*>(o[MKO_K_NORM]);
    const int rope_dim = (int)o[MKO_ROPE_DIM], neox = (int)o[MKO_NEOX], n_head_kv = (int)o[MKO_N_HEAD_KV], D = (int)o[MKO_HEAD_DIM];
    const int group = (int)o[MKO_N_HEAD] / n_head_kv, GD = group * D, C = D / 8;
    const float scale = f32_bits(o[MKO_SCALE]), eps = f32_bits(o[MKO_EPS]), mscale = f32_bits(o[MKO_MSCALE]);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_keys = pos + 1;
    const int n_split = min(MK_MAX_SPLIT, (n_keys + MK_SPLIT_MIN - 1) / MK_SPLIT_MIN);
    const int L = (n_keys + n_split - 1) / n_split;
    const int columns = GD / 8;
    int KQ = 32;  // lanes per P.V column: the largest power of two that fits
    while (KQ > 1 && KQ * columns > MK_THREADS) KQ >>= 1;
    float *qs = sm + S_Q, *ks = sm + S_K, *vs = sm + S_V, *sc = sm + S_SC, *mh = sm + S_M, *lh = sm + S_L;
    __shared__ int last;
    for (int item = blockIdx.x; item < n_head_kv * n_split; item += gridDim.x) {
        const int g = item % n_head_kv, s = item / n_head_kv;
        const int j0 = s * L, j1 = min(n_keys, j0 + L), n = j1 - j0;
        const bool fresh = j1 == n_keys;
        for (int i = threadIdx.x; i < GD; i += MK_THREADS) qs[i] = __ldcg(q + (i64)g * GD + i);
        if (fresh)
            for (int i = threadIdx.x; i < D; i += MK_THREADS) {
                ks[i] = __ldcg(kf + (i64)g * D + i);
                vs[i] = __ldcg(vf + (i64)g * D + i);
            }
        __syncthreads();
        for (int h = warp; h < group; h += WARPS)
            k4ops::rope_row(qs + h * D, qs + h * D, nullptr, q_norm, eps, inv_freq, (double)pos, D, rope_dim, neox, lane, mscale);
        if (fresh && warp == WARPS - 1)
            k4ops::rope_row(ks, ks, nullptr, k_norm, eps, inv_freq, (double)pos, D, rope_dim, neox, lane, mscale);
        __syncthreads();
        if (fresh)
            for (int i = threadIdx.x; i < D; i += MK_THREADS) {
                const i64 e = ((i64)pos * n_head_kv + g) * D + i;
                kc[e] = f32_to_f16(ks[i]);
                vc[e] = f32_to_f16(vs[i]);
            }
        {  // scores, four keys per thread in flight
            const int c = threadIdx.x % C, per_step = MK_THREADS / C;
            for (int base = 0; base < n; base += 4 * per_step) {
                float kv8[4][8];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int jj = base + u * per_step + threadIdx.x / C;
                    row8(kc, ks, j0 + jj, pos, n_head_kv, g, D, c, jj < n, kv8[u]);
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int jj = base + u * per_step + threadIdx.x / C;
#pragma unroll
                    for (int h = 0; h < MK_MAX_GROUP; ++h) {
                        if (h >= group) break;
                        float a = 0.f;
#pragma unroll
                        for (int e = 0; e < 8; ++e) a += kv8[u][e] * qs[h * D + 8 * c + e];
                        a = group_sum(a, C);
                        if (c == 0 && jj < n) sc[h * MK_SPLIT_KEYS + jj] = a * scale;
                    }
                }
            }
        }
        __syncthreads();
        for (int h = warp; h < group; h += WARPS) {  // softmax numerators in place, max and sum per head
            float m = -k4ops::inf_f32();
            for (int jj = lane; jj < n; jj += 32) m = fmaxf(m, sc[h * MK_SPLIT_KEYS + jj]);
            m = warp_max(m);
            float l = 0.f;
            for (int jj = lane; jj < n; jj += 32) {
                const float p = __expf(sc[h * MK_SPLIT_KEYS + jj] - m);
                sc[h * MK_SPLIT_KEYS + jj] = p;
                l += p;
            }
            l = warp_sum(l);
            if (lane == 0) {
                mh[h] = m;
                lh[h] = l;
            }
        }
        __syncthreads();
        {  // P.V: column col (head h, values 8 c8 .. + 7), lane kq of its KQ takes keys kq, kq + KQ, ...
            const int col = threadIdx.x / KQ, kq = threadIdx.x % KQ, h = col / C, c8 = col % C;
            const bool active = col < columns;
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int base = kq; base < n; base += 4 * KQ) {
                float v8[4][8];
#pragma unroll
                for (int u = 0; u < 4; ++u) row8(vc, vs, j0 + base + u * KQ, pos, n_head_kv, g, D, c8, active && base + u * KQ < n, v8[u]);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const float p = active && base + u * KQ < n ? sc[h * MK_SPLIT_KEYS + base + u * KQ] : 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[e] += p * v8[u][e];
                }
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = group_sum(acc[e], KQ);
            if (active && kq == 0) {
                const int head = g * group + h;
                if (n_split == 1) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) out[(i64)head * D + 8 * c8 + e] = acc[e] / lh[h];
                } else {
                    float* p = part + ((i64)head * MK_MAX_SPLIT + s) * (D + 2);
#pragma unroll
                    for (int e = 0; e < 8; ++e) p[8 * c8 + e] = acc[e];
                    if (c8 == 0) {
                        p[D] = mh[h];
                        p[D + 1] = lh[h];
                    }
                }
            }
        }
        if (n_split > 1) {  // the last split of KV head g to finish merges its query heads
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                last = atomicAdd(ticket + g, 1) == n_split - 1;
                if (last) {
                    ticket[g] = 0;
                    __threadfence();
                }
            }
            __syncthreads();
            if (last) {
                for (int od = threadIdx.x; od < GD; od += MK_THREADS) {
                    const int head = g * group + od / D, d = od % D;
                    const float* p = part + (i64)head * MK_MAX_SPLIT * (D + 2);
                    float m[MK_MAX_SPLIT], den = 0.f, num = 0.f, mx = -k4ops::inf_f32();
#pragma unroll
                    for (int k = 0; k < MK_MAX_SPLIT; ++k) {
                        m[k] = k < n_split ? __ldcg(p + k * (D + 2) + D) : -k4ops::inf_f32();
                        mx = fmaxf(mx, m[k]);
                    }
#pragma unroll
                    for (int k = 0; k < MK_MAX_SPLIT; ++k) {
                        if (k < n_split) {
                            const float w = __expf(m[k] - mx);
                            num += w * __ldcg(p + k * (D + 2) + d);
                            den += w * __ldcg(p + k * (D + 2) + D + 1);
                        }
                    }
                    out[(i64)head * D + d] = num / den;
                }
            }
        }
        __syncthreads();  // scratch reused by the next item
    }
}

}  // namespace mk
