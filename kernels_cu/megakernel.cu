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
// Weights: every product is cut into tiles of a few whole rows (MKT_ROWS, even), handed out round
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

namespace mk {

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
__device__ __forceinline__ void cp16(u8* dst, const u8* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp8(u8* dst, const u8* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp4(u8* dst, const u8* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}

// len bytes from src to dst (shared) by the whole block, in the widest copies both allow (4
// bytes at least: the launcher keeps every plane range 4-byte aligned).
__device__ __forceinline__ void copy_range(u8* dst, const u8* src, int len) {
    const int a = (int)(reinterpret_cast<unsigned long long>(src) | (unsigned long long)len);
    if (!(a & 15)) {
        for (int i = 16 * threadIdx.x; i < len; i += 16 * MK_THREADS) cp16(dst + i, src + i);
    } else if (!(a & 7)) {
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
// planar tensor of nblk blocks (group_at<T, G, true>(slot, nblk, ...) finds them).
template <class T>
__device__ __forceinline__ void stage(u8* slot, const u8* w, i64 nblk_all, i64 blk0, int nblk) {
    i64 src = 0;
    int dst = 0;
#pragma unroll
    for (int g = 0; g < n_groups<T>(); ++g) {
        const int size = T::cut(g + 1) - T::cut(g);
        copy_range(slot + dst, w + src + blk0 * size, nblk * size);
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

// Issue tile t's copies into its slot and commit them as one group (an empty group past the end
// of the list, so that every thread commits once per tile).
__device__ __forceinline__ void issue(const int4* tiles, int t, const i64* mats, u8* ring, int slot_bytes) {
    const int4 tl = tiles[t];
    if (tl.x >= 0) {
        const Mat m(mats + (i64)tl.y * MK_MAT_WORDS);
        u8* slot = ring + (t % MK_SLOTS) * slot_bytes;
        const int per_row = m.n_in / QK_K;  // blocks per row (every MK type has 256-weight rows of blocks, or 32: Q8_0)
        switch (m.type) {
            case MK_TYPE_Q4_K: stage<type_q4_K>(slot, m.w, m.nblk, (i64)tl.z * per_row, tl.w * per_row); break;
            case MK_TYPE_Q5_K: stage<type_q5_K>(slot, m.w, m.nblk, (i64)tl.z * per_row, tl.w * per_row); break;
            case MK_TYPE_Q6_K: stage<type_q6_K>(slot, m.w, m.nblk, (i64)tl.z * per_row, tl.w * per_row); break;
            case MK_TYPE_Q8_0: {
                const int per = m.n_in / QK8_0;
                stage<type_q8_0>(slot, m.w, m.nblk, (i64)tl.z * per, tl.w * per);
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

// The tiles of op `op` at the head of this block's list: consume each from the ring (then refill
// its slot with the tile MK_SLOTS further on), rows split over the warps, partial sums through
// red, the epilogue (SwiGLU pairs; bias, residual) by one thread per output.
__device__ void product(int op, const int4* tiles, int& t, int& next, const i64* mats, u8* ring, int slot_bytes,
                        const q8x<SWZ>& xv, float* red) {
    const int warp = threadIdx.x >> 5;
    while (tiles[t].x == op) {
        const int4 tl = tiles[t];
        const Mat m(mats + (i64)tl.y * MK_MAT_WORDS);
        const u8* slot = ring + (t % MK_SLOTS) * slot_bytes;
        asm volatile("cp.async.wait_group %0;" ::"n"(MK_SLOTS - 1));
        __syncthreads();
        const int rows = tl.w, rsplit = rows >= WARPS ? WARPS : rows;  // rows <= WARPS (launcher), a power of two
        const int parts = WARPS / rsplit, r = warp % rsplit, part = warp / rsplit;
        float acc = 0.f;
        if (r < rows && part < parts) {
            switch (m.type) {
                case MK_TYPE_Q4_K: acc = row_part<type_q4_K>(slot, rows, m.n_in, r, part, parts, xv); break;
                case MK_TYPE_Q5_K: acc = row_part<type_q5_K>(slot, rows, m.n_in, r, part, parts, xv); break;
                case MK_TYPE_Q6_K: acc = row_part<type_q6_K>(slot, rows, m.n_in, r, part, parts, xv); break;
                case MK_TYPE_Q8_0: acc = row_part<type_q8_0>(slot, rows, m.n_in, r, part, parts, xv); break;
            }
        }
        if ((threadIdx.x & 31) == 0) red[warp] = acc;
        __syncthreads();  // the slot is free, red is complete
        issue(tiles, next++, mats, ring, slot_bytes);
        const int i = threadIdx.x;
        if (m.glu ? i < rows / 2 : i < rows) {
            auto sum = [&](int row) {
                float s = 0.f;
                for (int p = 0; p < parts; ++p) s += red[row + rsplit * p];
                return s;
            };
            if (m.glu) {
                m.y[tl.z / 2 + i] = glu_act<false>(sum(2 * i), sum(2 * i + 1));
            } else {
                const int row = tl.z + i;
                float v = sum(i);
                if (m.bias) v += __ldg(m.bias + row);
                if (m.residual) v += __ldcg(m.residual + row);
                m.y[row] = v;
            }
        }
        ++t;
    }
}

// ---- attention ----------------------------------------------------------------------------------
// Scratch (floats): the group's queries (MK_MAX_GD), the fresh key and value (MK_MAX_D each),
// scores (MK_MAX_GROUP x MK_SPLIT_KEYS), max and sum per head, P.V partial sums (MK_THREADS).
constexpr int S_Q = 0, S_K = MK_MAX_GD, S_V = S_K + MK_MAX_D, S_SC = S_V + MK_MAX_D, S_M = S_SC + MK_MAX_GROUP * MK_SPLIT_KEYS,
              S_L = S_M + MK_MAX_GROUP, S_PV = S_L + MK_MAX_GROUP, S_END = S_PV + MK_THREADS;
static_assert(S_END == MK_ATTN_SCRATCH_FLOATS, "megakernel attention scratch: runtime/cuda/constants.py has another size");

// Work item (KV head g, split s) of one layer's attention at position pos: split s covers keys
// [s L, min((s + 1) L, pos + 1)); the split holding pos also rotates the fresh key and stores it
// and the value into the cache. One split: the output directly; several: partials (max, sum,
// unnormalized P.V) merged by the block that finishes a head's last split (a ticket per KV head).
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
    const int group = (int)o[MKO_N_HEAD] / n_head_kv, GD = group * D;
    const float scale = f32_bits(o[MKO_SCALE]), eps = f32_bits(o[MKO_EPS]), mscale = f32_bits(o[MKO_MSCALE]);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_keys = pos + 1;
    const int n_split = min(MK_MAX_SPLIT, (n_keys + MK_SPLIT_KEYS - 1) / MK_SPLIT_KEYS);
    const int L = (n_keys + n_split - 1) / n_split;
    float *qs = sm + S_Q, *ks = sm + S_K, *vs = sm + S_V, *sc = sm + S_SC, *mh = sm + S_M, *lh = sm + S_L, *pv = sm + S_PV;
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
        // scores: one thread per key, the whole row in 8-value pieces against every query head
        for (int jj = threadIdx.x; jj < n; jj += MK_THREADS) {
            const int j = j0 + jj;
            float acc[MK_MAX_GROUP];
#pragma unroll
            for (int h = 0; h < MK_MAX_GROUP; ++h) acc[h] = 0.f;
            for (int c = 0; c < D; c += 8) {
                float kv8[8];
                if (j == pos) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) kv8[e] = ks[c + e];
                } else {
                    kv_f16::unpack(kv_f16::load_once(kc, nullptr, ((size_t)j * n_head_kv + g) * D + c), kv8);
                }
#pragma unroll
                for (int h = 0; h < MK_MAX_GROUP; ++h)
                    if (h < group)
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[h] += kv8[e] * qs[h * D + c + e];
            }
#pragma unroll
            for (int h = 0; h < MK_MAX_GROUP; ++h)
                if (h < group) sc[h * MK_SPLIT_KEYS + jj] = acc[h] * scale;
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
        // P.V: output od = (head, dim); KQ threads per output take every KQ-th key
        const int KQ = GD >= MK_THREADS ? 1 : MK_THREADS / GD;
        for (int base = 0; base < GD * KQ; base += MK_THREADS) {
            const int t = base + threadIdx.x, kq = t / GD, od = t % GD, h = od / D, d = od % D;
            float acc = 0.f;
            if (t < GD * KQ) {
                for (int jj = kq; jj < n; jj += KQ) {
                    const int j = j0 + jj;
                    const float v = j == pos ? vs[d] : f16_to_f32(vc[((i64)j * n_head_kv + g) * D + d]);
                    acc += sc[h * MK_SPLIT_KEYS + jj] * v;
                }
            }
            if (KQ > 1) {
                pv[threadIdx.x] = acc;
                __syncthreads();
                if (threadIdx.x < GD) {
                    acc = 0.f;
                    for (int k = 0; k < KQ; ++k) acc += pv[k * GD + threadIdx.x];
                }
            }
            if (KQ > 1 ? threadIdx.x < GD : t < GD) {
                const int head = g * group + h;
                if (n_split == 1) {
                    out[(i64)head * D + d] = acc / lh[h];
                } else {
                    float* p = part + ((i64)head * MK_MAX_SPLIT + s) * (D + 2);
                    p[d] = acc;
                    if (d == 0) {
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
                    float m = -k4ops::inf_f32();
                    for (int k = 0; k < n_split; ++k) m = fmaxf(m, __ldcg(p + k * (D + 2) + D));
                    float num = 0.f, den = 0.f;
                    for (int k = 0; k < n_split; ++k) {
                        const float w = __expf(__ldcg(p + k * (D + 2) + D) - m);
                        num += w * __ldcg(p + k * (D + 2) + d);
                        den += w * __ldcg(p + k * (D + 2) + D + 1);
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
// then MK_SLOTS slots of slot_bytes. counters: n_ops + 1 zeros (left zero at the end).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
megakernel(const i64* __restrict__ ops, int n_ops, const i64* __restrict__ mats, const int4* __restrict__ all_tiles,
           int tile_stride, int* counters, const int* pos_word, int scratch_bytes, int slot_bytes, int max_n_in) {
    extern __shared__ uint4 smem_raw[];
    u8* smem = reinterpret_cast<u8*>(smem_raw);
    u8* ring = smem + scratch_bytes;
    __shared__ float red[mk::WARPS];
    const int4* tiles = all_tiles + (i64)blockIdx.x * tile_stride;
    const int pos = __ldcg(pos_word);  // the decode state's position (runtime/cuda/runner.py)
    int t = 0, next = 0;
    for (int k = 0; k < MK_SLOTS; ++k) mk::issue(tiles, next++, mats, ring, slot_bytes);
    u8* xq = smem;
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(max_n_in));
    float* xs = xd + q8x_d_floats(max_n_in);
    const q8x<mk::SWZ> xv{xq, xd, xs};
    for (int op = 0; op < n_ops; ++op) {
        const i64* o = ops + (i64)op * MK_OP_WORDS;
        if (op > 0) mk::wait_count(counters + op - 1, gridDim.x);
        if (o[MKO_KIND] == MK_GEMV) {
            mk::prologue(reinterpret_cast<const float*>(o[MKO_X]), reinterpret_cast<const float*>(o[MKO_NORM]),
                         mk::f32_bits(o[MKO_EPS]), (int)o[MKO_N_IN], xq, xd, xs, red);
            mk::product(op, tiles, t, next, mats, ring, slot_bytes, xv, red);
        } else {
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
