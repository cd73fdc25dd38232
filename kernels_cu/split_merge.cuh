// The merge of split decode attention's partials (flash-decoding, Dao et al. 2023), run by the
// last block of a query group (attention_gqa.cu attn_gqa) to finish, or shared by its last few
// (merge_join, K4_SHARED_MERGE): out = sum_s w_s O_s / sum_s
// w_s l_s with w_s = e^(m_s - M) (2^ in log2 units), M the largest m_s.
//
// merge_row: a warp merges one head. Each lane issues its loads of the splits' (m, l) (a lane per
// split, two per lane) and of its outputs' partials (NP float2 pairs, of 32 / NP splits at once,
// 8-byte aligned as D + 2 and the offset 2 are even) before it uses any; the weights w_s / L are
// handed from lane s % 32 by a shuffle. No shared memory, no block barrier. The outputs are summed
// over the splits in order (the bits of session 16's merge, which staged the weights in shared
// memory and ran 4-5 dependent rounds of loads at 32 splits). On the H200 a block merging a group
// of 4 heads of 128 over 32 splits (66 KB of partials, in L2) takes 2.1-3.0 µs with 2 rounds as
// with 5 (8 rounds: 3.4 µs): the bytes one multiprocessor reads from L2 bound it, not the rounds.
// Merged by a launch of its own spread over 64 multiprocessors instead, the step was slower: the
// extra kernel boundary costs more (docs/PERF.md, session 18).
//
// merge_slice: the same merge for 32 outputs of a head, a lane each, so that several blocks can
// share a group's merge (merge_join's helpers): each reads 1 / K of the partials, and no single
// multiprocessor's L2 reads bound the merge. The same arithmetic, so the same bits.
//
// q8_head_store: with an output product to hand over to (K4_ATTN_Q8), the warp also writes its
// head's outputs quantized to 8 bits, in the q8 x layout that product's blocks would otherwise
// each make from the whole float output (gemv_common.cuh quantize_x), with its bits.
#pragma once
#include "ops_common.cuh"
#include "constants.cuh"
#include "gemv_common.cuh"

static_assert(ATT_MAX_SPLIT <= 64, "merge_row and merge_slice read the splits' (m, l) with two per lane");
static_assert(MERGE_SLICE == 32, "merge_slice merges one output a lane");

// A head's D outputs, lane holding the pairs lane + 32 p (p < D / 64) in a, quantized into the q8
// x of the whole attention output (n_in = n_head * D values) at xq, swizzle swz; the head's units
// are u0 .. u0 + D / 16 - 1 (u0 even). A unit's 16 values are the pairs of 8 adjacent lanes, its
// partner unit (the same scale) the next 8: the max, the quants, their sum and the scale of
// q8_pack16, by shuffles. All 32 lanes call it.
template <int D>
__device__ __forceinline__ void q8_head_store(const float2 (&a)[D / 64], u8* __restrict__ xq, int swz, int n_in, int u0, int lane) {
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_in));
    float* xs = xd + q8x_d_floats(n_in);
#pragma unroll
    for (int p = 0; p < D / 64; ++p) {
        const int u = u0 + 4 * p + (lane >> 3);  // the unit of the lane's pair, its place lane & 7
        float amax = fmaxf(fabsf(a[p].x), fabsf(a[p].y));
#pragma unroll
        for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(k4ops::FULL_MASK, amax, o));
        const float id = q8_inv_scale(amax);
        const int q0 = __float2int_rn(a[p].x * id), q1 = __float2int_rn(a[p].y * id);
        int sum = q0 + q1;
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(k4ops::FULL_MASK, sum, o);
        *reinterpret_cast<u16*>(xq + 16 * x_unit_slot(u, swz) + 2 * (lane & 7)) = (u16)((q0 & 0xFF) | ((q1 & 0xFF) << 8));
        if ((lane & 7) == 0) q8_unit_scales(u, q8_scale(amax), sum, xd, xs);
    }
}

// The (m, l) of a head's splits (partials pr as merge_row's), lane j holding splits j and j + 32
// (-inf and 0 past n_active).
template <int D>
__device__ __forceinline__ void load_ml(const float* pr, int n_active, int lane, float (&m)[2], float (&l)[2]) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int j = lane + 32 * u;
        const bool ok = j < n_active;
        m[u] = ok ? __ldcg(pr + (size_t)j * (D + 2)) : -k4ops::inf_f32();
        l[u] = ok ? __ldcg(pr + (size_t)j * (D + 2) + 1) : 0.0f;
    }
}

// The weights w_s / L of the lane's splits from load_ml's (m, l): w_s = e^(m_s - M) (2^ with LOG2),
// M the largest m_s, L = sum_s w_s l_s over the warp; 0 for splits past n_active. All 32 lanes
// of the warp call it.
template <bool LOG2>
__device__ __forceinline__ void split_weights(const float (&m)[2], const float (&l)[2], float (&w)[2]) {
    float M = -k4ops::inf_f32();
#pragma unroll
    for (int u = 0; u < 2; ++u) M = fmaxf(M, m[u]);
    M = ::warp_max(M);
    float L = 0.0f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        w[u] = m[u] == -k4ops::inf_f32() ? 0.0f : LOG2 ? exp2f(m[u] - M) : __expf(m[u] - M);
        L += l[u] * w[u];
    }
    L = ::warp_sum(L);
    const float inv_L = 1.0f / L;
#pragma unroll
    for (int u = 0; u < 2; ++u) w[u] *= inv_L;
}

// pr: one head's partials of its splits, (n_split, D + 2) f32 [m, l, O[D]], splits 0 ..
// n_active - 1 merged (n_active <= ATT_MAX_SPLIT); out_row: the head's (D,) f32 output, of which
// the lane writes pairs lane + 32 p, p < NP = D / 64. LOG2: m in log2 units. xq non-null: also
// q8_head_store(xq, swz, n_in, u0). All 32 lanes of the warp call it.
template <bool LOG2, int D>
__device__ __forceinline__ void merge_row(const float* pr, int n_active, float* __restrict__ out_row, int lane,
                                          u8* __restrict__ xq, int swz, int n_in, int u0) {
    static_assert(D % 64 == 0, "a lane merges D / 64 pairs of outputs");
    constexpr int NP = D / 64;
    constexpr int CH = 32 / NP;           // splits whose partials are in flight together
    constexpr int SPLIT2 = (D + 2) / 2;   // float2 from one split to the next
    const float2* po = reinterpret_cast<const float2*>(pr + 2) + lane;  // the lane's first pair, split 0
    float m[2], l[2], w[2];
    load_ml<D>(pr, n_active, lane, m, l);
    float2 v[CH][NP];
    auto load = [&](int j0) {
#pragma unroll
        for (int u = 0; u < CH; ++u)
#pragma unroll
            for (int p = 0; p < NP; ++p)
                v[u][p] = j0 + u < n_active ? __ldcg(po + (size_t)(j0 + u) * SPLIT2 + 32 * p) : make_float2(0.0f, 0.0f);
    };
    load(0);
    split_weights<LOG2>(m, l, w);
    float2 a[NP];
#pragma unroll
    for (int p = 0; p < NP; ++p) a[p] = make_float2(0.0f, 0.0f);
    for (int j0 = 0; j0 < n_active; j0 += CH) {
        if (j0 > 0) load(j0);
#pragma unroll
        for (int u = 0; u < CH; ++u) {
            const int j = j0 + u;  // the same for every lane
            const float wj = __shfl_sync(k4ops::FULL_MASK, j < 32 ? w[0] : w[1], j & 31);
            if (j >= n_active) break;
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                a[p].x += v[u][p].x * wj;
                a[p].y += v[u][p].y * wj;
            }
        }
    }
#pragma unroll
    for (int p = 0; p < NP; ++p) reinterpret_cast<float2*>(out_row)[lane + 32 * p] = a[p];
    if (xq != nullptr) q8_head_store<D>(a, xq, swz, n_in, u0, lane);
}

// The merge of MERGE_SLICE = 32 outputs c0 .. c0 + 31 (c0 % 32 == 0) of one head, lane l taking output c0 + l:
// pr, n_active, out_row, LOG2 and D as merge_row, with its arithmetic (the splits' weights from
// the lanes' (m, l) pairs, the outputs summed over the splits in order), so with its bits. xq
// non-null: the 32 outputs (one q8 group, two units sharing a scale) also into the q8 x of n_in
// values at xq, swizzle swz, as value i0 + c0 + l of it (gemv_common.cuh q8_lane_store: the bits of
// q8_head_store). All 32 lanes of the warp call it.
template <bool LOG2, int D>
__device__ __forceinline__ void merge_slice(const float* pr, int n_active, int c0, float* __restrict__ out_row, int lane,
                                            u8* __restrict__ xq, int swz, int n_in, int i0) {
    static_assert(D % 32 == 0, "a head's outputs in slices of 32");
    float m[2], l[2], w[2];
    load_ml<D>(pr, n_active, lane, m, l);
    const float* po = pr + 2 + c0 + lane;  // the lane's output, split 0
    float v[32];
    auto load = [&](int j0) {
#pragma unroll
        for (int u = 0; u < 32; ++u) v[u] = j0 + u < n_active ? __ldcg(po + (size_t)(j0 + u) * (D + 2)) : 0.0f;
    };
    load(0);
    split_weights<LOG2>(m, l, w);
    float a = 0.0f;
    for (int j0 = 0; j0 < n_active; j0 += 32) {
        if (j0 > 0) load(j0);
#pragma unroll
        for (int u = 0; u < 32; ++u) {
            const int j = j0 + u;  // the same for every lane
            const float wj = __shfl_sync(k4ops::FULL_MASK, j < 32 ? w[0] : w[1], j & 31);
            if (j >= n_active) break;
            a += v[u] * wj;
        }
    }
    out_row[c0 + lane] = a;
    if (xq != nullptr) q8_lane_store(a, i0 + c0 + lane, n_in, swz, xq, lane);
}

// ---- the merge shared by the last blocks of a group to finish (K4_SHARED_MERGE) --------------
// A group's blocks count themselves in at *count (one int32 per group, zero on entry and left
// zero): arrivals in the low 16 bits, the helpers' departures in the high 16. merge_join is called
// by every thread of a block once its partials are written; it returns the block's place h among
// the last K blocks to arrive (0 .. K - 1; below 0: not one of them, nothing to merge). The last
// (h = K - 1) acquired every other block's partials through its atomic (ticket_acq_rel); the others
// wait for the count to reach n_active (an acquire load, then the block's barrier). At most K - 1
// blocks of a group wait, so where (K - 1) x groups is below the multiprocessors
// (attention_launch.merge_helpers), the blocks still to arrive always find a place to run. A
// helper done with its share calls merge_leave (one thread); the last of the K to leave zeroes the
// count. Its atomic is relaxed: its value is needed only at the end.
__device__ __forceinline__ int merge_join(int* count, int n_active, int K, int tid) {
    __shared__ int arrival;
    __syncthreads();  // the block's partials are written
    if (tid == 0) arrival = ticket_acq_rel(count) & 0xFFFF;
    __syncthreads();
    const int h = arrival - (n_active - K);
    if (h >= 0 && h < K - 1) {
        if (tid == 0)
            while ((ld_acquire(count) & 0xFFFF) < n_active) __nanosleep(16);
        __syncthreads();
    }
    return h;
}

__device__ __forceinline__ int merge_leave(int* count) { return atomicAdd(count, 1 << 16) >> 16; }

// part: partials of n_split splits per head, (n_heads, n_split, D + 2) f32; heads h0 .. h0 + rows
// - 1 merged, of splits 0 .. n_active - 1; out: (n_heads, D) f32; xq: null, or the q8 x of out
// (n_heads * D values, swizzle swz) that the heads' units are written into. Every thread of the
// block calls it (n_threads, a multiple of 32); warps take heads in turn. No barrier.
template <bool LOG2, int D>
__device__ __forceinline__ void merge_splits(const float* part, int h0, int rows, int n_split, int n_active,
                                             float* __restrict__ out, int tid, int n_threads, u8* __restrict__ xq, int swz, int n_heads) {
    const int warp = tid >> 5, n_warps = n_threads >> 5;
    for (int r = warp; r < rows; r += n_warps)
        merge_row<LOG2, D>(part + (size_t)(h0 + r) * n_split * (D + 2), n_active, out + (size_t)(h0 + r) * D, tid & 31,
                           xq, swz, n_heads * D, (h0 + r) * (D / 16));
}
