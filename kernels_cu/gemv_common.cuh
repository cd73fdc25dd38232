// The device helpers the q8 matrix-vector products share (kernels_cu/gemv.cu gemv_q8 and gemv_f,
// kernels_cu/gemv_batch.cu gemv_q8_batch, kernels_cu/moe_gemv.cu): the epilogues (write_row, glu_act), the RMSNorm scale,
// x quantized to 8 bits per 32 values (q8_unit, and norm_prologue.cuh's quantize_x: llama.cpp's q8_1 idea), its copy
// when another kernel quantized it (copy_q8x), the layout of that q8 x in shared memory
// (q8x_bytes, checked against runtime/cuda/constants.py), and the row loop (q8_rows, q8_load).
#pragma once
#include "common.cuh"
#include "ops_common.cuh"  // k4ops::gelu_tanh_f32

// y[row] = acc (+ bias[row]) (+ residual[row]); residual may alias y.
__device__ __forceinline__ void write_row(float* y, const float* residual, const float* bias, int row, float acc) {
    if (bias) acc += bias[row];
    if (residual) acc += residual[row];
    y[row] = acc;
}

// silu(g) * u, rounded as elementwise.cu swiglu rounds it; with GELU gelu_tanh(g) * u, the
// accurate form of ops_common.cuh that elementwise.cu geglu uses (k4ops::gelu_tanh_f32).
template <bool GELU>
__device__ __forceinline__ float glu_act(float g, float u) {
    return (GELU ? k4ops::gelu_tanh_f32(g) : __fdiv_rn(g, 1.0f + __expf(-g))) * u;
}

// The 128-byte lines of n floats at p (null: none) fetched into L1 by the block's threads: a hint,
// no register, no wait. For what a kernel reads after its programmatic-dependent-launch wait but
// no kernel writes (an RMSNorm's weights), so that it is on its way while the kernel before ends.
__device__ __forceinline__ void prefetch_l1_floats(const float* p, int n) {
    if (p != nullptr)
        for (int i = 32 * threadIdx.x; i < n; i += 32 * blockDim.x) asm volatile("prefetch.global.L1 [%0];" ::"l"(p + i));
}

// 1 / sqrt(mean(x^2) + eps) of x (n floats, n a multiple of 4, 16-byte aligned), in every thread
// of the block (all must call it). rms_norm (norm.cu) computes the same, summed in another order.
__device__ float rms_scale(const float* __restrict__ x, int n, float eps) {
    __shared__ float part[32];
    float ss = 0.f;
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(x) + i);
        ss += f.x * f.x + f.y * f.y + f.z * f.z + f.w * f.w;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = warp_sum((int)(threadIdx.x & 31) < (int)(blockDim.x >> 5) ? part[threadIdx.x & 31] : 0.f);
    return rsqrtf(ss / (float)n + eps);
}

// The q8 scheme's numbers, in one place for every quantizer of x (q8_pack16, q8_lane_store,
// split_merge.cuh q8_head_store), whose bytes must agree: from the largest |x| of a scale's 32
// values, the factor the values are multiplied by before rounding (IEEE division, as numpy rounds
// it) and the scale d; unit u's d * (sum of its quants) into xs[u], and d into xd[u / 2] by the
// even unit of the pair.
__device__ __forceinline__ float q8_inv_scale(float amax) { return amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f; }
__device__ __forceinline__ float q8_scale(float amax) { return amax * (1.f / 127.f); }
__device__ __forceinline__ void q8_unit_scales(int u, float d, int sum, float* xd, float* xs) {
    xs[u] = d * (float)sum;
    if (!(u & 1)) xd[u >> 1] = d;
}

// Quantize 16 values v of unit u (elements 16u..16u+15) into q8 x arrays (shared or global
// memory): the int8 quants at unit slot x_unit_slot(u, swz) of xq, d at xd[u / 2] (written by the
// even unit), d * sum of the quants at xs[u]. Units 2i and 2i+1 share one scale, so they must sit
// in adjacent lanes of one warp, every lane of which calls this (ok false: a lane with no unit).
// The arithmetic of q8_unit (and mma8_common.cuh's x staging): the 16 values v of a unit as int8
// quants, four to a word in packed, their sum in sum; returns the scale d, max |x| / 127 over the
// unit and its partner in the adjacent lane (every lane of the warp calls it).
__device__ __forceinline__ float q8_pack16(const float (&v)[16], u32 (&packed)[4], int& sum) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const float id = q8_inv_scale(amax);
    sum = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        packed[k] = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int q = __float2int_rn(v[4 * k + b] * id);
            sum += q;
            packed[k] |= (u32)(q & 0xFF) << (8 * b);
        }
    }
    return q8_scale(amax);
}

// 16 floats at p (16-byte aligned) into v, or zeros when !ok (p not read).
__device__ __forceinline__ void load_unit16(const float* p, bool ok, float (&v)[16]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 a = ok ? __ldg(reinterpret_cast<const float4*>(p) + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        v[4 * k] = a.x; v[4 * k + 1] = a.y; v[4 * k + 2] = a.z; v[4 * k + 3] = a.w;
    }
}

__device__ __forceinline__ void q8_unit(const float (&v)[16], bool ok, int u, int swz, u8* xq, float* xd, float* xs) {
    u32 packed[4];
    int sum;
    const float d = q8_pack16(v, packed, sum);
    if (ok) {
        *reinterpret_cast<uint4*>(xq + 16 * x_unit_slot(u, swz)) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        q8_unit_scales(u, d, sum, xd, xs);
    }
}

// The q8 x of n_in values (bytes): int8 units padded to 128 bytes, then d (n_in / 32 floats,
// padded to 16 bytes), then s (n_in / 16 floats); the whole padded to 16 bytes. gemv_q8 keeps it
// at the start of its shared memory; the launcher computes the same (runtime/cuda/constants.py
// q8x_offsets, whose values for several n are checked here at compile time).
__host__ __device__ __forceinline__ constexpr int q8x_bytes_q(int n_in) { return ((n_in / 16 + 7) & ~7) * 16; }
__host__ __device__ __forceinline__ constexpr int q8x_d_floats(int n_in) { return (n_in / 32 + 3) & ~3; }
__host__ __device__ __forceinline__ constexpr int q8x_bytes(int n_in) { return (q8x_bytes_q(n_in) + 4 * q8x_d_floats(n_in) + 4 * (n_in / 16) + 15) & ~15; }

#include "norm_prologue.cuh"  // the RMSNorm prologue: quantize_x, quantize_x_unscaled

// Thread-block clusters (sm_90): the blocks of a cluster, this block's rank among them, the
// cluster barrier (every thread of every block calls arrive, then wait; relaxed: no ordering,
// only "this block runs"), and the address of shared-memory location p in the block of rank r.
__device__ __forceinline__ u32 cluster_blocks() {
    u32 n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ u32 peer_addr(const void* p, u32 r) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((u32)__cvta_generic_to_shared(p)), "r"(r));
    return a;
}

// quantize_x without norm or post-norm, its units shared out over the blocks of a cluster: block
// rank r of n quantizes units [r * per, (r + 1) * per) (per even, so a scale's two units stay in
// adjacent lanes) and stores each into the shared memory of every block of the cluster. Every
// block then reads 1/n of x from L2 (its x reads arrive behind the weight loads issued before
// the wait: docs/PERF.md, session 27). The bits are quantize_x's (q8_pack16, q8_unit_scales'
// values). Every thread of every block calls it, after cluster_arrive_relaxed (this pairs its
// wait: no block writes into a block that has not started); on return the whole q8 x is in this
// block's shared memory, and no peer writes into it any more.
template <int SWZ>
__device__ void quantize_x_cluster(const float* __restrict__ x, int n_in, u8* xq, float* xd, float* xs) {
    const u32 n = cluster_blocks(), r = cluster_rank();
    const int n_units = n_in >> 4;
    const int per = ((n_units + (int)n - 1) / (int)n + 1) & ~1;
    const int u_begin = min(n_units, (int)r * per), u_end = min(n_units, u_begin + per);
    cluster_wait();
    for (int base = u_begin; base < u_end; base += blockDim.x) {  // block-uniform trip count
        const int u = base + threadIdx.x;
        const bool ok = u < u_end;
        float v[16];
        load_unit16(x + 16 * u, ok, v);
        u32 packed[4];
        int sum;
        const float d = q8_pack16(v, packed, sum);
        if (ok) {
            const float s = d * (float)sum;  // q8_unit_scales' xs[u]
            for (u32 k = 0; k < n; ++k) {
                asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(peer_addr(xq + 16 * x_unit_slot(u, SWZ), k)),
                             "r"(packed[0]), "r"(packed[1]), "r"(packed[2]), "r"(packed[3]) : "memory");
                asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(peer_addr(xs + u, k)), "f"(s) : "memory");
                if (!(u & 1)) asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(peer_addr(xd + (u >> 1), k)), "f"(d) : "memory");
            }
        }
    }
    cluster_arrive();
    cluster_wait();
}

// The q8 x of n_in values at q (shared memory, units in swizzle from_swz) copied to out (global
// memory) for a product of swizzle to_swz: each unit's 16 bytes to its slot there, d and s as
// they are. Every thread of the block calls it (after the barrier that published q).
// q8x_units: the int8 units alone (n_in / 16 of them), into shared or global memory.
__device__ __forceinline__ void q8x_units(const u8* q, int n_in, int from_swz, u8* out, int to_swz) {
    for (int u = threadIdx.x; u < (n_in >> 4); u += blockDim.x)
        *reinterpret_cast<uint4*>(out + 16 * x_unit_slot(u, to_swz)) = *reinterpret_cast<const uint4*>(q + 16 * x_unit_slot(u, from_swz));
}

__device__ void q8x_store(const u8* q, int n_in, int from_swz, u8* __restrict__ out, int to_swz) {
    q8x_units(q, n_in, from_swz, out, to_swz);
    const int tail = (q8x_bytes(n_in) - q8x_bytes_q(n_in)) / 4;  // d and s, as words
    for (int i = threadIdx.x; i < tail; i += blockDim.x)
        reinterpret_cast<u32*>(out + q8x_bytes_q(n_in))[i] = reinterpret_cast<const u32*>(q + q8x_bytes_q(n_in))[i];
}

// Copy a q8 x made by another kernel (n16 16-byte words, the layout quantize_x leaves in shared
// memory) into shared memory: up to four loads per thread in flight before the first store.
__device__ __forceinline__ void copy_q8x(const uint4* __restrict__ src, int n16, uint4* dst) {
    for (int base = 0; base < n16; base += 4 * blockDim.x) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = base + threadIdx.x + k * blockDim.x;
            if (i < n16) v[k] = __ldg(src + i);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = base + threadIdx.x + k * blockDim.x;
            if (i < n16) dst[i] = v[k];
        }
    }
}

// The RMSNorm scale 1 / sqrt(sum / n + eps) of a vector whose sum of squares is split into
// parts[0 .. n_parts) (gemv_q8 NQ's nq_parts), summed in one order: every lane of one warp calls
// it and gets the same value, as does every warp of every block that calls it.
__device__ __forceinline__ float parts_rms_scale(const float* __restrict__ parts, int n_parts, int n, float eps) {
    float s = 0.f;
    for (int i = threadIdx.x & 31; i < n_parts; i += 32) s += __ldg(parts + i);
    return rsqrtf(warp_sum(s) / (float)n + eps);
}

// An NQ product's handoff (gemv.cu gemv_q8 NQ: y * norm_w quantized without the norm's scale, at
// q in swizzle from_swz, and its blocks' sums of y^2 in parts[0 .. n_parts)) made the q8 x of
// RMSNorm(y) * norm_w in shared memory dst, swizzle to_swz: copied as copy_q8x copies, each unit
// moved to its slot (x_unit_slot rotates units within runs of 8, so source slot i lands in i's
// run, rotated by the swizzles' difference: x_unit_slot(i, to_swz - from_swz)), every d and
// d * sum multiplied by the norm's scale on the way (each output's sum is linear in them). Every
// warp sums the parts itself (the same value in each), after its first loads of q are issued, so
// no barrier waits for one warp's sum. (Summing them only in the warps that copy scales measured
// the same on the H200.) Every thread of the block calls it; the caller's barrier publishes dst.
__device__ __forceinline__ void copy_q8x_normed(const u8* __restrict__ q, int n_in, int from_swz, int to_swz,
                                                const float* __restrict__ parts, int n_parts, float eps, uint4* dst) {
    const int n16 = q8x_bytes(n_in) / 16, n_units = n_in >> 4, n_q16 = q8x_bytes_q(n_in) / 16, delta = to_swz - from_swz;
    float s = 0.f;
    for (int base = 0; base < n16; base += 4 * blockDim.x) {  // block-uniform trip count
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = base + threadIdx.x + k * blockDim.x;
            if (i < n16) v[k] = __ldg(reinterpret_cast<const uint4*>(q) + i);
        }
        if (base == 0) s = parts_rms_scale(parts, n_parts, n_in, eps);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = base + threadIdx.x + k * blockDim.x;
            if (i >= n16) continue;
            if (i >= n_q16)
                v[k] = make_uint4(__float_as_uint(__uint_as_float(v[k].x) * s), __float_as_uint(__uint_as_float(v[k].y) * s),
                                  __float_as_uint(__uint_as_float(v[k].z) * s), __float_as_uint(__uint_as_float(v[k].w) * s));
            // x_unit_slot(i, delta) spelt out: through the call, nvcc schedules gemv.cu's kernels otherwise
            dst[i < n_units ? (i & ~7) | ((i + delta * (i >> 3)) & 7) : i] = v[k];
        }
    }
}

// The first U chunks of a warp's output r, from lane's chunk c0 on: chunks c0, c0 + 32, ... of the
// output's weights in one matrix of planar or raw layout (both rows of a GLU pair, consecutive:
// chunk c is in block c / chunks per block).
template <class T, bool PLANAR, int U, bool GLU>
__device__ __forceinline__ void q8_load(typename T::chunk (&dst)[U], const u8* __restrict__ w, i64 nblk, int nblk_row, int n_chunks,
                                        int r, int c0) {
    constexpr int cpb = T::block_elems / T::chunk_elems;
    constexpr int span = GLU ? 2 : 1;
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const int c = c0 + 32 * k;
        if (c < span * n_chunks)  // c >= 0: unsigned division, a shift
            dst[k] = T::template load<PLANAR>(w, nblk, (i64)r * span * nblk_row + (u32)c / cpb, (int)((u32)c % cpb));
    }
}

// The row loop of the q8 matrix-vector products (gemv.cu gemv_q8 and gemv_q8_pair, moe_gemv.cu):
// a warp's outputs row, row + row_step, ... below row_end, each the sum over its n_chunks chunks
// (2 n_chunks for a GLU pair: the gate row's, then the up row's) of T::dot with x (xv), lane l
// taking chunks l, l + 32, ..., U at a time; with PF the next U chunks load while the current
// ones are multiplied. load(dst, r, c0) fetches output r's U chunks from c0 on; ch holds the
// first output's first chunks when `loaded` (issued by the caller before its wait). Each
// output's sums, reduced over the warp, go to out(r, acc, acc_up) in lane 0 (acc_up: the up row).
// The loop's code size counts (docs/PERF.md, session 38): unrolled twice to drop the copy of nx
// it ran 7-15% slower.
template <class T, int U, bool PF, bool GLU, class Load, class Out>
__device__ __forceinline__ void q8_rows(int n_chunks, int row, int row_end, int row_step, int lane, typename T::chunk (&ch)[U],
                                        bool loaded, const q8x<T::x_swizzle>& xv, Load load, Out out) {
    const int out_chunks = (GLU ? 2 : 1) * n_chunks;  // per output (both rows of a GLU pair)
    if (!loaded && row < row_end) load(ch, row, lane);
    typename T::chunk nx[U];  // the next U chunks, in flight during the dots of ch (PF)
    float acc = 0.f, acc_up = 0.f;
    int c0 = lane;
    while (row < row_end) {
        int next_row = row, next_c0 = c0 + 32 * U;
        if (next_c0 >= out_chunks) {
            next_row += row_step;
            next_c0 = lane;
        }
        if (PF && next_row < row_end) load(nx, next_row, next_c0);
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int c = c0 + 32 * k;
            if (!GLU) {
                if (c < n_chunks) acc += T::dot(ch[k], c, xv);
            } else if (c < out_chunks) {  // one copy of the dot for both rows (half the loop's code), as `a += dot` (same bits)
                const bool up = c >= n_chunks;
                float a = up ? acc_up : acc;
                a += T::dot(ch[k], up ? c - n_chunks : c, xv);
                acc = up ? acc : a;
                acc_up = up ? a : acc_up;
            }
        }
        if (next_row != row) {  // output done
            acc = warp_sum(acc);
            if (GLU) acc_up = warp_sum(acc_up);
            if (lane == 0) out(row, acc, acc_up);
            acc = acc_up = 0.f;
        }
        row = next_row;
        c0 = next_c0;
        if (row >= row_end) break;
        if (PF) {
#pragma unroll
            for (int k = 0; k < U; ++k) ch[k] = nx[k];
        } else {
            load(ch, row, c0);
        }
    }
}

__host__ __device__ constexpr bool q8x_layout_agrees() {
    constexpr int rows[] = {K4_CHECK_Q8X};  // n, offset of d, offset of s, total bytes
    for (int i = 0; i < (int)(sizeof(rows) / sizeof(int)); i += 4) {
        const int n = rows[i];
        if (q8x_bytes_q(n) != rows[i + 1] || q8x_bytes_q(n) + 4 * q8x_d_floats(n) != rows[i + 2] || q8x_bytes(n) != rows[i + 3])
            return false;
    }
    return true;
}
static_assert(q8x_layout_agrees(), "the q8 x layout differs from runtime/cuda/constants.py q8x_offsets");

// Value i of x (n_in values) held by lane i % 32 of a warp that holds its whole group of 32 (two
// units sharing a scale), quantized into x's q8 x at q (q8x_bytes(n_in) bytes), swizzle swz: the
// bits quantize_x gives (q8_pack16's max, quants, sum and scale), by shuffles. attn_kv hands its
// outputs over this way (K4_ATTN_Q8). Every lane of the warp calls it.
__device__ __forceinline__ void q8_lane_store(float v, int i, int n_in, int swz, u8* __restrict__ q, int lane) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int qv = __float2int_rn(v * q8_inv_scale(amax));
    int sum = qv;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);  // over the lane's unit
    u32 word = (u32)(qv & 0xFF) << (8 * (lane & 3));
    word |= __shfl_xor_sync(0xffffffffu, word, 1);
    word |= __shfl_xor_sync(0xffffffffu, word, 2);
    const int u = i >> 4;
    if ((lane & 3) == 0) *reinterpret_cast<u32*>(q + 16 * x_unit_slot(u, swz) + (i & 15)) = word;
    if ((lane & 15) == 0) {
        float* xd = reinterpret_cast<float*>(q + q8x_bytes_q(n_in));
        q8_unit_scales(u, q8_scale(amax), sum, xd, xd + q8x_d_floats(n_in));
    }
}

// Unit u's 16 values v quantized into a row's q8 x at q (q8x_bytes(n_in) bytes, the layout
// quantize_x leaves), swizzle swz: q8_unit with the row's d and s arrays, and its pairing rule.
__device__ __forceinline__ void q8_row_put(const float (&v)[16], bool ok, int u, int n_in, int swz, u8* q) {
    float* d = reinterpret_cast<float*>(q + q8x_bytes_q(n_in));
    q8_unit(v, ok, u, swz, q, d, d + q8x_d_floats(n_in));
}

// Unit u (values 16u .. 16u + 15) of one row of x (n_in floats at row, 16-byte aligned) into
// that row's q8 x at q (q8_row_put): the bits quantize_x gives (ok false: nothing read or stored).
__device__ __forceinline__ void q8_row_unit(const float* __restrict__ row, int n_in, int u, bool ok, int swz, u8* q) {
    float v[16];
    load_unit16(row + 16 * u, ok, v);
    q8_row_put(v, ok, u, n_in, swz, q);
}
