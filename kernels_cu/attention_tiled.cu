// attn_tiled: prefill attention on CUDA cores (flag K4_TILED_ATTN), launched by
// runtime/cuda/ops.py (Ops.attention) where attn_mma does not run. A block takes TILE_Q queries
// of one head and walks the keys in tiles of TILE_K staged in shared memory, so each key and
// value is read once per TILE_Q queries (the tiling of FlashAttention-2, Dao 2023). TILE_*
// come from runtime/cuda/constants.py (constants.cuh).
#include "kv_cache.cuh"
#include "attention_sizes.cuh"

// TILE_Q queries per block, TILE_K keys per shared-memory tile, TILE_THREADS threads; TILE_PS:
// the row stride of the probabilities (floats), TILE_K + 16 so the two half-warps hit other banks.

// Causal attention of n_tok queries (query t at position pos0 + t, pos0 = *pos) over the cache
// rows 0 .. pos0 + t. q, out: (n_tok, n_head, D) f32; k_cache, v_cache: (n_ctx, n_head_kv, D) of
// KT::elem / VT::elem, k_d, v_d their scale planes or null (kv_cache.cuh: fp16 or q8_0, dequantized
// to f32 as the tiles are staged).
// scale, window, softcap: as attn_kv (the block starts at the tile of its first query's window).
// Grid: (n_head, ceil(n_tok / TILE_Q)); block: TILE_THREADS; dynamic shared memory tiled_smem(D).
// Thread mapping: thread (rg, kg) = (tid / 16, tid % 16) owns query rows rg + 8i (i < 4); for
// scores the keys kg + 16j (j < 4) of the tile, for the output the columns 64c + 4kg .. + 3
// (c < D / 64). The 16 lanes of a half-warp share their rows, so row max and sum reduce by
// shuffles among them. Rows are padded by 4 floats so the 16-byte key reads are conflict-free.
template <int D, class KT, class VT>
__global__ void __launch_bounds__(TILE_THREADS)
attn_tiled(const float* __restrict__ q, const typename KT::elem* __restrict__ k_cache, const u16* __restrict__ k_d,
           const typename VT::elem* __restrict__ v_cache, const u16* __restrict__ v_d, float* __restrict__ out,
           const int* __restrict__ pos, int n_tok, int n_head, int n_head_kv, float scale, int window, float softcap, int ring) {
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
            typename KT::raw8 kr = KT::zero();
            typename VT::raw8 vr = VT::zero();
            if (k0 + r < n_keys) {
                const size_t at = (size_t)((k0 & ring) + r) * kv_stride + (size_t)hk * D + 8 * c8;  // k0: a multiple of TILE_K, which divides a ring's rows
                kr = KT::load(k_cache, k_d, at);
                vr = VT::load(v_cache, v_d, at);
            }
            float kf[8], vf[8];
            KT::unpack(kr, kf);
            VT::unpack(vr, vf);
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
