// The megakernel's weight ring (kernels_cu/megakernel.cu): bulk copies of a block's weight tiles
// into shared-memory slots, each with an mbarrier that completes when its tile has landed, and
// the tile staging in the planar layout the decoders read (quant_layouts.cuh group_at).
#pragma once
#include "decoders.cuh"
#include "mma_common.cuh"

namespace mk {

typedef unsigned long long u64;

// Slot k of the ring has an mbarrier (full[k]) that completes a phase when the tile staged there
// has landed. The 16-byte aligned plane ranges of a tile (all but a 2-byte scale plane whose
// range is not) go by bulk copies of the tensor memory accelerator, issued by thread 0 and
// counted on the slot's mbarrier: they do not queue in the multiprocessor's load path ahead of
// the block's own reads of x, the counters and the cache, as per-thread copies would (docs/PERF.md,
// session 15). The rest goes by per-thread cp.async (4 or 8 bytes), one commit group per tile.
using k4mma::smem_u32;

__device__ __forceinline__ void bar_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)));
}

__device__ __forceinline__ void bar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_copy(u8* dst, const u8* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ bool aligned16(const u8* src, i64 len) {
    return !((reinterpret_cast<unsigned long long>(src) | (unsigned long long)len) & 15);
}

// len bytes from src to dst (shared) by per-thread copies of 8 or 4 bytes (the launcher keeps
// every plane range 4-byte aligned).
__device__ __forceinline__ void copy_small(u8* dst, const u8* src, int len) {
    if (!((reinterpret_cast<unsigned long long>(src) | (unsigned long long)len) & 7)) {
        for (int i = 8 * threadIdx.x; i < len; i += 8 * MK_THREADS) k4mma::cp_async_small<8>(smem_u32(dst + i), src + i, true);
    } else {
        for (int i = 4 * threadIdx.x; i < len; i += 4 * MK_THREADS) k4mma::cp_async_small<4>(smem_u32(dst + i), src + i, true);
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
    k4mma::cp_async_commit();
}

}  // namespace mk
