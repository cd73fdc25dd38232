// Decode attention of one query over a short fp16 KV cache (kv_cache.cuh kv_f16): attn_short<D>,
// one block of SHORT_THREADS threads per query head and split of at most short_keys(D) = SHORT_DIMS
// / D keys (128 at head_dim 128; attention_sizes.cuh), for decode ranges of at most gridDim.y such
// splits (runtime/cuda/attention_launch.py: one split up to short_keys(D) keys, SHORT_SPLITS past
// it; Ops.attention_kernel, flag K4_SHORT_ATTN). Query head h reads KV head h / (n_head / n_head_kv).
//
// Why a kernel of its own: at short range attn_kv's work after its programmatic-dependent-launch
// wait is a chain of dependent steps (the cached keys and values from memory, then the split
// merge's ticket and reads: about 9 us at 100 keys on the H200, docs/PERF.md session 22). This
// block does what it can before the wait:
//  - the cached keys and values its split holds below the query's position go to shared memory
//    by cp.async. Earlier forward passes wrote them, and *pos (the step before wrote it): every
//    pass starts with a launch without programmatic dependent launch (the embedding lookup,
//    matmul.dequant_rows), so no kernel of a pass starts before the passes before it ended;
//  - the RoPE table of the position (ops_common.cuh rope_table).
// After the wait it reads only the token's q, k and v, rotates them (the bits of rope_row), and
// works from shared memory. One split holding keys writes the output itself; with several, each
// writes its partial (split_merge.cuh's layout) and the last of the head's to finish merges them
// (an atomic ticket, merge_row by one warp).
//
// q: (n_head, D) f32, the rotated query (read when fresh_q is null). k_cache, v_cache: (rows,
//   n_head_kv, D) fp16, this layer's cache; position p at row p & ring (ring -1: a plain cache).
// out: (n_head, D) f32. part: (n_head, gridDim.y, D + 2) f32 partials [m, l, O[D]], written when
//   more than one split holds keys; ticket: (n_head,) int32, zero on entry and left zero. pos:
//   (1,) int32, the query's position p. scale: of q.k. window > 0: a sliding layer, keys p -
//   window + 1 .. p only, the splits counted from the first. softcap > 0: scores -> softcap
//   tanh(s / softcap).
// fresh_q, fresh_k, fresh_v: null, or the token's unrotated q (n_head, D), k and v (n_head_kv,
//   D) f32 from the projections: rotated here (q_norm, k_norm (D,) or null, inv_freq (rope_dim /
//   2,) f64, rope_dim, neox, eps, mscale as rope.cu), and the block of the first query head of
//   each KV head holding the token writes its key and value to cache row p. Null: q is rotated
//   and row p is cached (rope.cu rope_qk_store ran before).
// x_q8: null, or the q8 x of out (n_head * D values, swizzle x_swz; q8_handoff.Q8Vector) for the
//   output product (K4_ATTN_Q8), as attn_kv writes it.
// Requires the keys seen to fit gridDim.y splits (the launcher's range; else the kernel traps).
//
// Held rows: row j of ks / vs is the split's key j, its D / 8 16-byte units u at slot (u + TPG j)
// % U (U = D / 8), so the 8 lanes of a quarter warp hit 8 bank groups in both passes. Scores: TPG
// threads a key (128 / keys, at least 1), KPT keys a thread (keys / 128, at least 1), each
// thread's share of a key U / TPG units, its TPG lanes summed by shuffles; one softmax over the
// split's keys (block_max's and block_sum's arithmetic, a barrier each). Values: thread t takes
// unit c = t % U of keys t / U, t / U + KL, ... (KL = SHORT_THREADS / U key lanes); the key lanes
// of a warp are summed by shuffles, the warps' in one pass over red.
#include "kv_cache.cuh"
#include "attention_sizes.cuh"
#include "gemv_common.cuh"  // q8_lane_store
#include "mma_common.cuh"   // cp.async
#include "split_merge.cuh"  // merge_row

template <int D>
__global__ void __maxnreg__(SHORT_REGS)  // constants.py SHORT_REGS: it fits beside the q/k/v product
attn_short(const float* __restrict__ q, u16* k_cache, u16* v_cache, float* __restrict__ out, float* __restrict__ part,
           int* __restrict__ ticket, const int* __restrict__ pos, int n_head, int n_head_kv, float scale, int window, float softcap,
           int ring,
           const float* __restrict__ fresh_q, const float* __restrict__ fresh_k, const float* __restrict__ fresh_v,
           const float* __restrict__ q_norm, const float* __restrict__ k_norm, const double* __restrict__ inv_freq,
           int rope_dim, int neox, float eps, float mscale, u8* __restrict__ x_q8, int x_swz) {
    constexpr int U = D / 8, KEYS = short_keys(D), KL = SHORT_THREADS / U, WARPS = SHORT_THREADS / 32;
    constexpr int TPG = KEYS < SHORT_THREADS ? SHORT_THREADS / KEYS : 1, KPT = KEYS > SHORT_THREADS ? KEYS / SHORT_THREADS : 1;
    static_assert(KEYS * TPG == SHORT_THREADS * KPT && U % TPG == 0 && U <= 32 && D % 32 == 0, "attn_short: the passes' mapping");
    extern __shared__ uint4 smem_u4[];
    u16* ks = reinterpret_cast<u16*>(smem_u4);            // (KEYS, D) held keys
    u16* vs = ks + KEYS * D;                               // (KEYS, D) held values
    float* qs = reinterpret_cast<float*>(vs + KEYS * D);   // (D,) the query, scaled
    float* tab = qs + D;                                   // (rope_dim,) cos, then sin
    float* sc = tab + D;                                   // (KEYS,) probabilities
    float* red = sc + KEYS;                                // (WARPS, D) the values' partial sums
    u16* kcur = reinterpret_cast<u16*>(red + WARPS * D);   // (D,) the token's key, fp16
    u16* vcur = kcur + D;                                  // (D,) its value
    static_assert(2 * 2 * KEYS * D + 4 * (2 * D + KEYS + WARPS * D) + 2 * 2 * D == short_smem(D), "short_smem: the layout above");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x, group = n_head / n_head_kv, split = blockIdx.y;
    const size_t kv_stride = (size_t)n_head_kv * D, head_off = (size_t)(h / group) * D;
    auto slot = [](int j, int u) { return j * D + 8 * ((u + TPG * j) % U); };  // element of unit u of held row j

    pdl_trigger();
    const int p = *pos;
    const int lo = window > 0 ? max(0, p + 1 - window) : 0;
    if (p + 1 - lo > KEYS * (int)gridDim.y) __trap();
    const int n_active = (p + 1 - lo + KEYS - 1) / KEYS;  // splits holding keys
    if (split >= n_active) return;
    const int begin = lo + split * KEYS;
    const int n = min(p + 1 - begin, KEYS);  // keys begin .. begin + n - 1
    const bool mine = begin + n == p + 1;    // the token's key is this split's last (held row n - 1)
    for (int i = tid; i < (n - mine) * U; i += SHORT_THREADS) {
        const int j = i / U, u = i % U;
        const size_t e = (size_t)((begin + j) & ring) * kv_stride + head_off + 8 * u;
        k4mma::cp_async16(k4mma::smem_u32(ks + slot(j, u)), k_cache + e, true);
        k4mma::cp_async16(k4mma::smem_u32(vs + slot(j, u)), v_cache + e, true);
    }
    k4mma::cp_async_commit();
    if (fresh_q) {
        k4ops::rope_table(inv_freq, (double)p, rope_dim, mscale, tab, tid, SHORT_THREADS);
        prefetch_l1_floats(q_norm, D);  // the q/k norms' weights, read after the wait (rope_apply)
        prefetch_l1_floats(k_norm, D);
    }
    __syncthreads();  // the table
    pdl_wait();

    const size_t row_p = (size_t)(p & ring) * kv_stride + head_off;
    if (fresh_q) {  // a warp each turns q (scaled as it is made) and k and converts v; k's and v's warps hold them
        const auto cs = [&](int i) { return make_float2(tab[i], tab[rope_dim / 2 + i]); };
        // the token's row (fp16, in kcur or vcur) to held row n - 1, and to the cache by the first
        // query head of its KV head
        const auto hold = [&](const u16* cur, u16* held, u16* cache) {
            __syncwarp();
            for (int u = lane; u < U; u += 32) {
                const uint4 w = reinterpret_cast<const uint4*>(cur)[u];
                *reinterpret_cast<uint4*>(held + slot(n - 1, u)) = w;
                if (h % group == 0) *reinterpret_cast<uint4*>(cache + row_p + 8 * u) = w;
            }
        };
        if (warp == 0) k4ops::rope_apply<D>(fresh_q + (size_t)h * D, qs, nullptr, q_norm, eps, D, rope_dim, neox, lane, cs, scale);
        if (warp == 1 && mine) {
            k4ops::rope_apply<D>(fresh_k + head_off, nullptr, kcur, k_norm, eps, D, rope_dim, neox, lane, cs);
            hold(kcur, ks, k_cache);
        }
        if (warp == 2 && mine) {
            for (int i = lane; i < D; i += 32) vcur[i] = f32_to_f16(fresh_v[head_off + i]);
            hold(vcur, vs, v_cache);
        }
    } else {
        for (int i = tid; i < D; i += SHORT_THREADS) qs[i] = q[(size_t)h * D + i] * scale;
        for (int u = tid; u < U && mine; u += SHORT_THREADS) {  // the token's key and value: held row n - 1
            *reinterpret_cast<uint4*>(ks + slot(n - 1, u)) = *reinterpret_cast<const uint4*>(k_cache + row_p + 8 * u);
            *reinterpret_cast<uint4*>(vs + slot(n - 1, u)) = *reinterpret_cast<const uint4*>(v_cache + row_p + 8 * u);
        }
    }
    k4mma::cp_async_wait_all();  // every key and value in shared memory
    __syncthreads();

    // scores (KPT keys a thread), then the softmax over every key at once
    const int piece = tid % TPG;  // the thread's piece of its key
    float sk[KPT];
    float mx = -k4ops::inf_f32();
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
        const int j = tid / TPG + k * (SHORT_THREADS / TPG);
        float s = -k4ops::inf_f32();
        if (j < n) {
            s = 0.0f;
#pragma unroll 4
            for (int i = 0; i < U / TPG; ++i) {
                const int u = piece + TPG * i;
                float v[8];
                k4ops::unpack_half8(*reinterpret_cast<const uint4*>(ks + slot(j, u)), v);
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d += v[e] * qs[8 * u + e];
                s += d;
            }
        }
#pragma unroll
        for (int off = TPG / 2; off > 0; off >>= 1) s += __shfl_xor_sync(k4ops::FULL_MASK, s, off);
        if (softcap > 0.0f && j < n) s = softcap * k4ops::tanh_f32(s / softcap);
        sk[k] = s;
        mx = fmaxf(mx, s);
    }
    // the block's max and sum: each warp's, one barrier, then every warp combines them (block_max's
    // and block_sum's order, so their bits, without their leading barriers: each runs once here)
    __shared__ float warp_m[WARPS], warp_l[WARPS];
    mx = ::warp_max(mx);
    if (lane == 0) warp_m[warp] = mx;
    __syncthreads();
    const float m = ::warp_max(lane < WARPS ? warp_m[lane] : -k4ops::inf_f32());
    float ps = 0.0f;
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
        const int j = tid / TPG + k * (SHORT_THREADS / TPG);
        const float e = j < n ? __expf(sk[k] - m) : 0.0f;
        if (piece == 0) {
            sc[j] = e;
            ps += e;
        }
    }
    ps = ::warp_sum(ps);
    if (lane == 0) warp_l[warp] = ps;
    __syncthreads();  // also publishes sc
    const float l = ::warp_sum(lane < WARPS ? warp_l[lane] : 0.0f), inv_l = 1.0f / l;

    // values
    const int c = tid % U;
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
#pragma unroll 4
    for (int jj = tid / U; jj < n; jj += KL) {
        float v[8];
        k4ops::unpack_half8(*reinterpret_cast<const uint4*>(vs + slot(jj, c)), v);
        const float pj = sc[jj];
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += pj * v[k];
    }
#pragma unroll
    for (int off = U; off < 32; off <<= 1) {
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += __shfl_xor_sync(k4ops::FULL_MASK, acc[k], off);
    }
    if (lane < U) {
#pragma unroll
        for (int k = 0; k < 8; ++k) red[warp * D + 8 * c + k] = acc[k];
    }
    __syncthreads();
    if (n_active == 1) {  // one split: the output itself
        for (int i = tid; i < D; i += SHORT_THREADS) {  // whole warps: D is a multiple of 32
            float a = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) a += red[w * D + i];
            const float o = a * inv_l;
            out[(size_t)h * D + i] = o;
            if (x_q8 != nullptr) q8_lane_store(o, h * D + i, n_head * D, x_swz, x_q8, lane);
        }
        return;
    }
    // several: the split's partial [m, l, unnormalized output] (split_merge.cuh's layout), and the
    // last split of the head to finish merges them (merge_row: a warp, the splits' loads together)
    float* pr = part + (size_t)h * gridDim.y * (D + 2);
    float* mine_row = pr + (size_t)split * (D + 2);
    for (int i = tid; i < D; i += SHORT_THREADS) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) a += red[w * D + i];
        mine_row[2 + i] = a;
    }
    if (tid == 0) {
        mine_row[0] = m;
        mine_row[1] = l;
    }
    __shared__ int last;
    __syncthreads();
    if (tid == 0) last = ticket_acq_rel(ticket + h) == n_active - 1;
    __syncthreads();
    if (!last || warp != 0) return;
    merge_row<false, D>(pr, n_active, out + (size_t)h * D, lane, x_q8, x_swz, n_head * D, h * D / 16);
    if (lane == 0) ticket[h] = 0;
}
