// Tensor-core helpers of the attention kernels on mma.sync (attention_mma.cu: prefill,
// attention_gqa.cu: grouped-query decode): shared-memory addresses, cp.async, ldmatrix, the
// m16n8k16 fp16 mma with f32 accumulators (operand layouts: PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"), fp16 packing, and the staging of 8 cache values
// (kv_cache.cuh types) as fp16 into a shared tile.
#pragma once
#include "kv_cache.cuh"

namespace k4mma {

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, asynchronously; valid = false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Wait until at most N of this thread's newest cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// BYTES (4, 8 or 16) global -> shared through L1, asynchronously; valid = false writes zeros.
template <int BYTES>
__device__ __forceinline__ void cp_async_small(u32 dst, const void* src, bool valid) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(BYTES), "r"(valid ? BYTES : 0) : "memory");
}

// 16 bytes from shared memory.
__device__ __forceinline__ uint4 ld_shared16(u32 src) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(src) : "memory");
    return v;
}

__device__ __forceinline__ u16 ld_shared_u16(u32 src) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(src) : "memory");
    return v;
}

// Four 8x8 fp16 matrices; lane i gives the row address of matrix i / 8, row i % 8.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// c (16x8 f32) += a (16x16 fp16, row) * b (16x8 fp16, col).
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = a (16x32 s8, row) * b (32x8 s8, col), exact int32 (PTX ISA, "Matrix Fragments for
// mma.m16n8k32": lane 4g + t holds A rows g (a0, a2) and g + 8 (a1, a3), bytes 4t .. 4t + 3 of
// columns 0-15 (a0, a1) and 16-31 (a2, a3); B column g, rows 4t .. 4t + 3 (b0) and 16 + 4t ..
// (b1); D as mma16816's accumulator).
__device__ __forceinline__ void mma16832_s8(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ void st_shared_u16(u32 dst, u16 v) {
    asm volatile("st.shared.u16 [%0], %1;" ::"r"(dst), "h"(v) : "memory");
}

// 16 bytes to shared memory at dst.
__device__ __forceinline__ void st_shared16(u32 dst, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Two floats rounded to fp16, lo in the low half.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Cache values e .. e + 7 of a plane of type T (kv_cache.cuh) as 8 fp16 at shared address dst;
// valid = false stores zeros and reads nothing. fp16 planes are copied by cp.async (the caller
// commits the group); q8_0 planes are loaded, dequantized (q * d rounded to fp16) and stored.
template <class T>
__device__ __forceinline__ void stage8(u32 dst, const typename T::elem* x, const u16* d, size_t e, bool valid) {
    if constexpr (!T::SCALED) {
        cp_async16(dst, x + e, valid);  // e = 0 when not valid
    } else {
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (valid) T::unpack(T::load(x, d, e), v);
        st_shared16(dst, make_uint4(pack_f16x2(v[0], v[1]), pack_f16x2(v[2], v[3]), pack_f16x2(v[4], v[5]), pack_f16x2(v[6], v[7])));
    }
}

// The online softmax state of a warp's 16 rows (FlashAttention-2): O (NOC 8-column chunks in the
// accumulator layout) zero, the running max of rows g and g + 8 -inf, their partial sums 0.
template <int NOC>
__device__ __forceinline__ void softmax_state_init(float (&o)[NOC][4], float (&m)[2], float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m[r] = -k4ops::inf_f32();
        l[r] = 0.f;
    }
#pragma unroll
    for (int c = 0; c < NOC; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[c][e] = 0.f;
}

// stage8 of values e .. e + 7 from any address (global or shared), synchronously.
template <class T>
__device__ __forceinline__ void stage8_now(u32 dst, const typename T::elem* x, const u16* d, size_t e) {
    const typename T::raw8 r = T::load(x, d, e);
    if constexpr (!T::SCALED) {
        st_shared16(dst, r.h);
    } else {
        float v[8];
        T::unpack(r, v);
        st_shared16(dst, make_uint4(pack_f16x2(v[0], v[1]), pack_f16x2(v[2], v[3]), pack_f16x2(v[4], v[5]), pack_f16x2(v[6], v[7])));
    }
}

}  // namespace k4mma
