// The merge of split decode attention's partials (flash-decoding, Dao et al. 2023), run by the
// last block of a query group (attention_gqa.cu attn_gqa) to finish: out = sum_s w_s O_s / sum_s w_s l_s with w_s = e^(m_s - M) (2^ in log2 units), M the
// largest m_s.
//
// A warp per head first reads the splits' (m, l) pairs with a lane per split (two loads per
// lane, all in flight together) and leaves the weights w_s / L in shared memory; then every
// thread sums its pairs of outputs' O_s over the splits, 16 float2 loads in flight per round
// (8-byte aligned: D + 2 and the offset 2 are even). Four scalar loads a round measured 43.8 us
// at 32,768 keys against 42.8 (docs/PERF.md, session 16). The splits'
// partials are in L2 (written by this launch), so the merge costs a few L2 round trips rather
// than two per split, as a loop over the splits with the max, then the sums, would (attn_kv's
// merge, kept there: its bits are what the CUDA goldens were checked with, and it measured the
// same speed with this merge). On the H200, attn_gqa at 4,096 keys (8 KV heads of 128, 32
// splits): 22.2 us with attn_kv's loop, 14.0 with this merge.
#pragma once
#include "ops_common.cuh"
#include "constants.cuh"

static_assert(ATT_MAX_SPLIT <= 64, "merge_splits reads the splits' (m, l) with two per lane");

// part: partials of n_split splits per head, (n_heads, n_split, D + 2) f32 [m, l, O[D]], heads
// h0 .. h0 + rows - 1 merged, of splits first .. n_active - 1 (n_active - first <= ATT_MAX_SPLIT);
// out: (n_heads, D) f32. LOG2: m in log2 units. wsh: shared memory of rows * (ATT_MAX_SPLIT + 1)
// floats. Every thread of the block calls it (n_threads of them, a multiple of 32); it begins
// with no barrier (the caller's partials are published by the ticket's fences) and ends with one.
template <bool LOG2>
__device__ __forceinline__ void merge_splits(const float* part, int h0, int rows, int n_split, int first, int n_active, int D,
                                             float* __restrict__ out, float* wsh, int tid, int n_threads) {
    const int warp = tid >> 5, lane = tid & 31, n_warps = n_threads >> 5;
    const size_t stride = (size_t)n_split * (D + 2);  // floats of one head's partials
    for (int r = warp; r < rows; r += n_warps) {
        const float* pr = part + (h0 + r) * stride;
        float m[2], l[2], M = -k4ops::inf_f32();
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int j = first + lane + 32 * u;
            const bool ok = j < n_active;
            m[u] = ok ? __ldcg(pr + (size_t)j * (D + 2)) : -k4ops::inf_f32();
            l[u] = ok ? __ldcg(pr + (size_t)j * (D + 2) + 1) : 0.0f;
            M = fmaxf(M, m[u]);
        }
        M = ::warp_max(M);
        float L = 0.0f, w[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            w[u] = m[u] == -k4ops::inf_f32() ? 0.0f : LOG2 ? exp2f(m[u] - M) : __expf(m[u] - M);
            L += l[u] * w[u];
        }
        L = ::warp_sum(L);
        const float inv_L = 1.0f / L;
#pragma unroll
        for (int u = 0; u < 2; ++u) wsh[r * (ATT_MAX_SPLIT + 1) + lane + 32 * u] = w[u] * inv_L;
    }
    __syncthreads();
    const int n = n_active - first;
    for (int i = tid; i < rows * D / 2; i += n_threads) {  // output pairs (D is even), 16 loads in flight
        const int r = 2 * i / D, c = 2 * i % D;
        const float* pr = part + (h0 + r) * stride + (size_t)first * (D + 2) + 2 + c;
        const float* wr = wsh + r * (ATT_MAX_SPLIT + 1);
        float2 a = make_float2(0.0f, 0.0f);
        for (int j0 = 0; j0 < n; j0 += 16) {
            float2 v[16];
#pragma unroll
            for (int u = 0; u < 16; ++u) v[u] = j0 + u < n ? __ldcg(reinterpret_cast<const float2*>(pr + (size_t)(j0 + u) * (D + 2))) : make_float2(0.0f, 0.0f);
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const float w = j0 + u < n ? wr[j0 + u] : 0.0f;
                a.x += v[u].x * w;
                a.y += v[u].y * w;
            }
        }
        *reinterpret_cast<float2*>(out + (size_t)(h0 + r) * D + c) = a;
    }
    __syncthreads();
}
