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
// first row, rows; op -1 ends it), copied into shared memory with the matrix records at the start.
// A ring of MK_SLOTS shared-memory slots streams the list by bulk copies (megakernel_ring.cuh)
// from the first instruction to the last, independent of the data dependencies: while the block
// waits for a counter or runs attention (megakernel_attention.cuh), MK_SLOTS tiles are in flight
// or landed. A tile is staged in the planar layout (quant_layouts.cuh) of its own rows, so the
// decoders of decoders.cuh read it unchanged (their loads are ld.shared here: K4_WEIGHTS_IN_SHARED).
//
// Activations written by one block and read by another inside the kernel are read with ld.cg
// (L2, never a stale L1 line); weights, norms, biases and the RoPE table are read-only.
// Shapes and limits the launcher checks: matrices of the MK_TYPE_* types in the planar layout,
// an even row count, n_in a multiple of 256; head_dim a multiple of 8 up to MK_MAX_D, at most
// MK_MAX_GROUP query heads per KV head and MK_MAX_GD values of them, positions below
// MK_SPLIT_KEYS * MK_MAX_SPLIT; f16 KV cache planes (n_ctx, n_head_kv, head_dim).
#define K4_WEIGHTS_IN_SHARED 1  // before any include: the decoders' weight loads are ld.shared (device.cuh)
#include "gemv_common.cuh"
#include "megakernel_attention.cuh"
#include "megakernel_ring.cuh"

namespace mk {

constexpr int SWZ = K4_X_SWIZZLE_Q4_K;  // the q8 x is made once per op, in Q4_K's unit order, for every type

__device__ __forceinline__ float4 ldcg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

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
        k4mma::cp_async_wait<MK_SLOTS - 2>();  // tile t - 1's group is not yet committed
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

}  // namespace mk

// Shared memory: the scratch (scratch_bytes: the q8 x of the widest product, or the attention's),
// the tile list and matrix records, then from ring_offset MK_SLOTS slots of slot_bytes
// (runtime/cuda/megakernel.py plan_ring). counters: n_ops + 1 zeros (left zero at the end).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
megakernel(const i64* __restrict__ ops, int n_ops, const i64* __restrict__ all_mats, int n_mats, const int4* __restrict__ all_tiles,
           int tile_stride, int* counters, const int* pos_word, int scratch_bytes, int ring_offset, int slot_bytes,
           int max_n_in) {
    extern __shared__ uint4 smem_raw[];
    u8* smem = reinterpret_cast<u8*>(smem_raw);
    // after the scratch: this block's tile list and the matrix records, read from shared memory
    // from here on (their reads would otherwise sit on every tile's critical path), then the ring
    int4* tiles = reinterpret_cast<int4*>(smem + scratch_bytes);
    i64* mats = reinterpret_cast<i64*>(tiles + tile_stride);
    u8* ring = smem + ring_offset;
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
