// The decode step of a dense model in one persistent kernel (K4_MEGAKERNEL; issue 20, lever 1):
// one block per multiprocessor walks an instruction list built at load (runtime/cuda/megakernel.py)
// and runs every layer's products and attention, from the embedded token in x to the logits.
//
// Instructions (ops, MK_OP_WORDS int64 words each, fields MKO_*): a matrix-vector product
// (MK_GEMV) of one input vector, normalized (RMSNorm) or not, by one or more matrices (the q/k/v
// runs of one layer), or a layer's attention (MK_ATTN: RoPE, the cache store, causal attention of
// the one query over positions 0 .. pos). Op i starts when every block has finished op i - 1: a
// counter per op in global memory (release: barrier, fence, atomic add; acquire: one thread spins
// on an acquire load, then the barrier). Nothing is a grid-wide barrier: while a block waits, the
// weights of its next tiles keep arriving.
//
// Weights: every product is cut into tiles of a few whole rows (2 to 32, even), handed out round
// robin to the blocks at load; each block owns a list of its tiles in op order (int4: op, matrix,
// first row, rows; op -1 ends it). A ring of MK_SLOTS shared-memory slots streams the list with
// cp.async from the first instruction to the last, independent of the data dependencies: while
// the block waits for a counter or runs attention, MK_SLOTS tiles are in flight or landed. A
// tile is staged in the planar layout (quant_layouts.cuh) of its own rows, so the decoders of
// decoders.cuh read it unchanged (their loads are generic here: K4_WEIGHTS_IN_SHARED).
//
// Activations written by one block and read by another inside the kernel are read with ld.cg
// (L2, never a stale L1 line); weights, norms, biases and the RoPE table are read-only.
// Shapes and limits the launcher checks: matrices of the MK_TYPE_* types in the planar layout,
// an even row count, n_in a multiple of 256; head_dim a multiple of 8 up to MK_MAX_D, at most
// MK_MAX_GROUP query heads per KV head and MK_MAX_GD values of them, positions below
// MK_SPLIT_KEYS * MK_MAX_SPLIT; f16 KV cache planes (n_ctx, n_head_kv, head_dim).
#define K4_WEIGHTS_IN_SHARED 1
#include "decoders.cuh"
#include "gemv_common.cuh"
#include "kv_cache.cuh"

// Bytes of a block's tile list (stride int4 records) and the matrix records in shared memory,
// padded to 16 (runtime/cuda/megakernel.py list_bytes computes the same).
__host__ __device__ constexpr int mk_list_bytes(int stride, int n_mats) { return (16 * stride + 8 * MK_MAT_WORDS * n_mats + 15) & ~15; }

namespace mk {

typedef unsigned long long u64;

constexpr int WARPS = MK_THREADS / 32;
constexpr int SWZ = K4_X_SWIZZLE_Q4_K;  // the q8 x is made once per op, in Q4_K's unit order, for every type

__device__ __forceinline__ float4 ldcg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float f32_bits(i64 w) { return __int_as_float((int)w); }

__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Wait until *c reaches target (every block of the grid arrived), then the whole block goes on.
__device__ __forceinline__ void wait_count(const int* c, int target) {
    if (threadIdx.x == 0)
        while (ld_acquire(c) < target) __nanosleep(32);
    __syncthreads();
}

// This block's writes of the op are done: publish them and count the block in.
__device__ __forceinline__ void arrive(int* c) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(c, 1);
    }
}

// ---- the weight ring -------------------------------------------------------------------------
// Slot k of the ring has an mbarrier (full[k]) that completes a phase when the tile staged there
// has landed. The 16-byte aligned plane ranges of a tile (all but a 2-byte scale plane whose
// range is not) go by bulk copies of the tensor memory accelerator, issued by thread 0 and
// counted on the slot's mbarrier: they do not queue in the multiprocessor's load path ahead of
// the block's own reads of x, the counters and the cache, as per-thread copies would (docs/PERF.md,
// session 15). The rest goes by per-thread cp.async (4 or 8 bytes), one commit group per tile.
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp8(u8* dst, const u8* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp4(u8* dst, const u8* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ void bar_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
}

__device__ __forceinline__ void bar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_copy(u8* dst, const u8* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ bool aligned16(const u8* src, i64 len) {
    return !((reinterpret_cast<unsigned long long>(src) | (unsigned long long)len) & 15);
}

// len bytes from src to dst (shared) by per-thread copies of 8 or 4 bytes (the launcher keeps
// every plane range 4-byte aligned).
__device__ __forceinline__ void copy_small(u8* dst, const u8* src, int len) {
    if (!((reinterpret_cast<unsigned long long>(src) | (unsigned long long)len) & 7)) {
        for (int i = 8 * threadIdx.x; i < len; i += 8 * MK_THREADS) cp8(dst + i, src + i);
    } else {
        for (int i = 4 * threadIdx.x; i < len; i += 4 * MK_THREADS) cp4(dst + i, src + i);
    }
}

template <class T>
__host__ __device__ constexpr int n_groups() {
    int g = 0;
    while (T::cut(g) < T::block_bytes) ++g;
    return g;
}

// Stage blocks blk0 .. blk0 + nblk - 1 of the planar tensor w (nblk_all blocks) into slot as a
// planar tensor of nblk blocks (group_at<T, G, true>(slot, nblk, ...) finds them); bar: the slot's
// mbarrier. Every thread calls it.
template <class T>
__device__ __forceinline__ void stage(u8* slot, const u8* w, i64 nblk_all, i64 blk0, int nblk, u64* bar) {
    constexpr int G = n_groups<T>();
    if (threadIdx.x == 0) {
        i64 src = 0;
        u32 bytes = 0;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const int size = T::cut(g + 1) - T::cut(g);
            if (aligned16(w + src + blk0 * size, (i64)nblk * size)) bytes += nblk * size;
            src += round16(nblk_all * size);
        }
        bar_expect(bar, bytes);
    }
    i64 src = 0;
    int dst = 0;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int size = T::cut(g + 1) - T::cut(g);
        const u8* from = w + src + blk0 * size;
        if (aligned16(from, (i64)nblk * size)) {
            if (threadIdx.x == 0) bulk_copy(slot + dst, from, nblk * size, bar);
        } else {
            copy_small(slot + dst, from, nblk * size);
        }
        src += round16(nblk_all * size);
        dst += (int)round16((i64)nblk * size);
    }
}

struct Mat {  // a matrix record, unpacked
    const u8* w;
    i64 nblk;
    int type, n_in;
    float* y;
    const float* residual;
    const float* bias;
    int glu;
    __device__ explicit Mat(const i64* m)
        : w(reinterpret_cast<const u8*>(m[MKM_W])), nblk(m[MKM_NBLK]), type((int)m[MKM_TYPE]), n_in((int)m[MKM_N_IN]),
          y(reinterpret_cast<float*>(m[MKM_Y])), residual(reinterpret_cast<const float*>(m[MKM_RESIDUAL])),
          bias(reinterpret_cast<const float*>(m[MKM_BIAS])), glu((int)m[MKM_GLU]) {}
};

// Issue tile t's copies into its slot (its mbarrier full[t % MK_SLOTS]) and commit its per-thread
// copies as one group (an empty group past the end of the list, so that every thread commits
// once per tile). Every thread calls it, after the barrier that freed the slot.
__device__ __forceinline__ void issue(const int4* tiles, int t, const i64* mats, u8* ring, int slot_bytes, u64* full) {
    const int4 tl = tiles[t];
    if (tl.x >= 0) {
        const Mat m(mats + (i64)tl.y * MK_MAT_WORDS);
        u8* slot = ring + (t % MK_SLOTS) * slot_bytes;
        u64* bar = full + t % MK_SLOTS;
        if (threadIdx.x == 0) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's last reads before the bulk writes
        const int per_row = m.n_in / QK_K;  // blocks per row (K-quants; Q8_0 below)
        switch (m.type) {
            case MK_TYPE_Q4_K: stage<type_q4_K>(slot, m.w, m.nblk, (i64)tl.z * per_row, tl.w * per_row, bar); break;
            case MK_TYPE_Q5_K: stage<type_q5_K>(slot, m.w, m.nblk, (i64)tl.z * per_row, tl.w * per_row, bar); break;
            case MK_TYPE_Q6_K: stage<type_q6_K>(slot, m.w, m.nblk, (i64)tl.z * per_row, tl.w * per_row, bar); break;
            case MK_TYPE_Q8_0: {
                const int per = m.n_in / QK8_0;
                stage<type_q8_0>(slot, m.w, m.nblk, (i64)tl.z * per, tl.w * per, bar);
                break;
            }
        }
    }
    asm volatile("cp.async.commit_group;");
}

// Row r of a staged tile of `rows` rows times the q8 x: this warp's share (chunks part, part +
// parts, ... of 32 each), summed over the warp.
template <class T>
__device__ __forceinline__ float row_part(const u8* slot, int rows, int n_in, int r, int part, int parts, const q8x<SWZ>& xv) {
    constexpr int cpb = T::block_elems / T::chunk_elems;
    const int per_row = n_in / T::block_elems, n_chunks = n_in / T::chunk_elems;
    const i64 nblk = (i64)rows * per_row;
    float acc = 0.f;
    for (int c = 32 * part + (threadIdx.x & 31); c < n_chunks; c += 32 * parts)
        acc += T::dot(T::template load<true>(slot, nblk, (i64)r * per_row + c / cpb, c % cpb), c, xv);
    return warp_sum(acc);
}

// ---- a product ----------------------------------------------------------------------------------
// x (n_in floats, global) -> the q8 x in shared memory, times rms_scale * norm_w when norm_w is
// non-null (gemv_common.cuh quantize_x's arithmetic, with the loads through L2).
__device__ void prologue(const float* x, const float* __restrict__ norm_w, float eps, int n_in, u8* xq, float* xd, float* xs,
                         float* red) {
    float scale = 1.f;
    if (norm_w) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < n_in / 4; i += MK_THREADS) {
            const float4 f = ldcg4(x + 4 * i);
            ss += f.x * f.x + f.y * f.y + f.z * f.z + f.w * f.w;
        }
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
        __syncthreads();
        ss = warp_sum((threadIdx.x & 31) < WARPS ? red[threadIdx.x & 31] : 0.f);
        scale = rsqrtf(ss / (float)n_in + eps);
    }
    const int n_units = n_in >> 4;
    for (int base = 0; base < n_units; base += MK_THREADS) {
        const int u = base + threadIdx.x;
        const bool ok = u < n_units;
        float v[16];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float4 f = ok ? ldcg4(x + 16 * u + 4 * k) : make_float4(0.f, 0.f, 0.f, 0.f);
            if (norm_w && ok) {
                const float4 g = __ldg(reinterpret_cast<const float4*>(norm_w) + 4 * u + k);
                f = make_float4(f.x * scale * g.x, f.y * scale * g.y, f.z * scale * g.z, f.w * scale * g.w);
            }
            v[4 * k] = f.x; v[4 * k + 1] = f.y; v[4 * k + 2] = f.z; v[4 * k + 3] = f.w;
        }
        q8_unit(v, ok, u, SWZ, xq, xd, xs);
    }
    __syncthreads();
}

// The tiles of op `op` at the head of this block's list, one barrier each: wait for tile t to
// land, then (the barrier having also seen every warp finish tile t - 1) refill t - 1's slot with
// the tile MK_SLOTS further on and write t - 1's outputs (SwiGLU pairs; bias, residual) from its
// partial sums, one thread per output, while the warps multiply tile t: rows split over the warps,
// each warp's sum into red[t & 1]. The op's last tile is finished after a last barrier.
__device__ void product(int op, const int4* tiles, int& t, int& next, const i64* mats, u8* ring, int slot_bytes, u64* full,
                        const q8x<SWZ>& xv, float (*red)[2 * WARPS]) {
    const int warp = threadIdx.x >> 5, i = threadIdx.x;
    int4 prev = make_int4(-1, 0, 0, 0);
    float prev_pre = 0.f;
    auto finish = [&](const int4& tl, float pre, const float* part) {  // the outputs of tile tl
        const Mat m(mats + (i64)tl.y * MK_MAT_WORDS);
        const int rows = tl.w, rsplit = rows >= WARPS ? WARPS : rows, parts = WARPS / rsplit;
        if (m.glu ? i < rows / 2 : i < rows) {
            auto sum = [&](int row) {
                float s = 0.f;
                for (int p = 0; p < parts; ++p) s += part[row + rsplit * p];
                return s;
            };
            if (m.glu) m.y[tl.z / 2 + i] = glu_act<false>(sum(2 * i), sum(2 * i + 1));
            else m.y[tl.z + i] = sum(i) + pre;
        }
    };
    while (tiles[t].x == op) {
        const int4 tl = tiles[t];
        const Mat m(mats + (i64)tl.y * MK_MAT_WORDS);
        const u8* slot = ring + (t % MK_SLOTS) * slot_bytes;
        float pre = 0.f;  // bias + residual of output row tl.z + i, loaded before the wait
        if (!m.glu && i < tl.w) {
            if (m.bias) pre += __ldg(m.bias + tl.z + i);
            if (m.residual) pre += __ldcg(m.residual + tl.z + i);
        }
        bar_wait(full + t % MK_SLOTS, (t / MK_SLOTS) & 1);
        asm volatile("cp.async.wait_group %0;" ::"n"(MK_SLOTS - 2));  // tile t - 1's group is not yet committed
        __syncthreads();
        if (prev.x >= 0) {
            issue(tiles, next++, mats, ring, slot_bytes, full);
            finish(prev, prev_pre, red[(t - 1) & 1]);
        }
        // rows (even, at most 2 WARPS): up to WARPS rows split into WARPS / rows parts (red[row +
        // rows * part]; warps past the last whole part idle), more rows taken by each warp in turn (red[row])
        const int rows = tl.w, rsplit = rows >= WARPS ? WARPS : rows;
        const int parts = WARPS / rsplit, part = warp / rsplit;
        for (int r = warp % rsplit; r < rows; r += WARPS) {
            float acc = 0.f;
            if (part < parts) {
                switch (m.type) {
                    case MK_TYPE_Q4_K: acc = row_part<type_q4_K>(slot, rows, m.n_in, r, part, parts, xv); break;
                    case MK_TYPE_Q5_K: acc = row_part<type_q5_K>(slot, rows, m.n_in, r, part, parts, xv); break;
                    case MK_TYPE_Q6_K: acc = row_part<type_q6_K>(slot, rows, m.n_in, r, part, parts, xv); break;
                    case MK_TYPE_Q8_0: acc = row_part<type_q8_0>(slot, rows, m.n_in, r, part, parts, xv); break;
                }
            }
            if ((threadIdx.x & 31) == 0) red[t & 1][r + rsplit * part] = acc;
        }
        prev = tl;
        prev_pre = pre;
        ++t;
    }
    if (prev.x >= 0) {
        __syncthreads();
        issue(tiles, next++, mats, ring, slot_bytes, full);
        finish(prev, prev_pre, red[(t - 1) & 1]);
    }
}

// ---- attention ----------------------------------------------------------------------------------
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

// Shared memory: the scratch (scratch_bytes: the q8 x of the widest product, or the attention's),
// the tile list and matrix records (mk_list_bytes), then MK_SLOTS slots of slot_bytes. counters: n_ops + 1 zeros (left zero at the end).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
megakernel(const i64* __restrict__ ops, int n_ops, const i64* __restrict__ all_mats, int n_mats, const int4* __restrict__ all_tiles,
           int tile_stride, int* counters, const int* pos_word, int scratch_bytes, int slot_bytes, int max_n_in) {
    extern __shared__ uint4 smem_raw[];
    u8* smem = reinterpret_cast<u8*>(smem_raw);
    // after the scratch: this block's tile list and the matrix records, read from shared memory
    // from here on (their reads would otherwise sit on every tile's critical path), then the ring
    int4* tiles = reinterpret_cast<int4*>(smem + scratch_bytes);
    i64* mats = reinterpret_cast<i64*>(tiles + tile_stride);
    u8* ring = smem + scratch_bytes + mk_list_bytes(tile_stride, n_mats);
    __shared__ float red[2][2 * mk::WARPS];  // the products' partial sums, double-buffered (red[0]: also the prologue's)
    __shared__ alignas(8) mk::u64 full[MK_SLOTS];  // the ring's mbarriers
    if (threadIdx.x == 0) {
        for (int k = 0; k < MK_SLOTS; ++k) mk::bar_init(full + k);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    for (int i = threadIdx.x; i < tile_stride; i += MK_THREADS) tiles[i] = all_tiles[(i64)blockIdx.x * tile_stride + i];
    for (int i = threadIdx.x; i < n_mats * MK_MAT_WORDS; i += MK_THREADS) mats[i] = all_mats[i];
    __syncthreads();
    const int pos = __ldcg(pos_word);  // the decode state's position (runtime/cuda/runner.py)
    int t = 0, next = 0;
    for (int k = 0; k < MK_SLOTS; ++k) mk::issue(tiles, next++, mats, ring, slot_bytes, full);
    u8* xq = smem;
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(max_n_in));
    float* xs = xd + q8x_d_floats(max_n_in);
    const q8x<mk::SWZ> xv{xq, xd, xs};
    for (int op = 0; op < n_ops; ++op) {
        const i64* o = ops + (i64)op * MK_OP_WORDS;
        const i64 kind = o[MKO_KIND], x = o[MKO_X], norm = o[MKO_NORM], eps = o[MKO_EPS], n_in = o[MKO_N_IN];  // before the wait
        if (op > 0) mk::wait_count(counters + op - 1, gridDim.x);
        if (kind == MK_GEMV) {
            mk::prologue(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(norm), mk::f32_bits(eps), (int)n_in, xq, xd,
                         xs, red[0]);
            mk::product(op, tiles, t, next, mats, ring, slot_bytes, full, xv, red);
        } else if (kind == MK_ATTN) {
            mk::attention(o, pos, reinterpret_cast<float*>(smem));
        }
        mk::arrive(counters + op);
    }
    asm volatile("cp.async.wait_all;");
    if (threadIdx.x == 0) {  // the last block out resets the counters for the next step
        if (atomicAdd(counters + n_ops, 1) == (int)gridDim.x - 1) {
            for (int i = 0; i <= n_ops; ++i) counters[i] = 0;
            __threadfence();
        }
    }
}
