// Generic device helpers every k4 kernel may use: integer types, 16/4/2-byte loads (with the
// L1 evict-first hint for data read once), fp16/bf16 conversions, programmatic dependent launch,
// warp reductions, 16-byte vector words and their int8 dot products (dp4a), 16-value stores.
// Nothing here knows a quantized type (quant_layouts.cuh, decoders.cuh). Compiles under NVRTC
// and nvcc alike, so it includes no system header.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// ---- loads ------------------------------------------------------------------------------------
// Data read once per token, weights (load16 with ALIGN 16) and the decode attention's keys and
// values (ld_once16), is loaded with the L1::evict_first cache hint, unless compiled with
// K4_EVICT_FIRST=0 (runtime/cuda/matmul.py and ops.py do so when flag K4_EVICT_FIRST is 0).
// Measured on the H200 (docs/PERF.md): Q4_K 22016x4096 14.4 -> 13.9 µs, Q6_K 4096x11008
// 12.2 -> 11.7 µs, Llama 2 7B tg128 +2.3%, tg64@d16384 +2.9%; the small products are unchanged.
#ifndef K4_EVICT_FIRST
#define K4_EVICT_FIRST 1
#endif
// K4_PLANAR_EXPERTS=0 keeps every expert tensor in raw blocks (decoders.cuh T::expert_planar;
// runtime/cuda/ops.py defines it so when flag K4_PLANAR_EXPERTS is 0).
#ifndef K4_PLANAR_EXPERTS
#define K4_PLANAR_EXPERTS 1
#endif

// 16 bytes from p (16-byte aligned, not written while the kernel runs) with the evict-first hint.
__device__ __forceinline__ uint4 ld_evict_first16(const void* p) {
    uint4 v;  // not volatile: the compiler may schedule it like any load of read-only data
    asm("ld.global.nc.L1::evict_first.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// 16 bytes of the KV cache (16-byte aligned; rows this kernel writes are not read through it).
__device__ __forceinline__ uint4 ld_once16(const void* p) {
#if K4_EVICT_FIRST
    return ld_evict_first16(p);
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

// Weights read from shared memory instead of the read-only global path: defined by
// megakernel.cu, whose decoders read weight stages there (ld.shared: a generic load would
// first resolve the window).
#ifdef K4_WEIGHTS_IN_SHARED
__device__ __forceinline__ u16 lds_u16(const void* p) {
    u16 v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"((u32)__cvta_generic_to_shared(p)));
    return v;
}
__device__ __forceinline__ u32 lds_u32(const void* p) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"((u32)__cvta_generic_to_shared(p)));
    return v;
}
template <class T>
__device__ __forceinline__ T lds(const void* p) {
    if constexpr (sizeof(T) == 2) return lds_u16(p);
    else return lds_u32(p);
}
#define K4_WLD(T, p) lds<T>(p)
#else
#define K4_WLD(T, p) __ldg(reinterpret_cast<const T*>(p))
#endif

// 16 bytes of weights at p (16-byte aligned).
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
#ifdef K4_WEIGHTS_IN_SHARED
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"((u32)__cvta_generic_to_shared(p)));
    return v;
#elif K4_EVICT_FIRST
    return ld_evict_first16(p);
#else
    return __ldg(reinterpret_cast<const uint4*>(p));
#endif
}

// 16 bytes from p, which is ALIGN-byte aligned. 16: one vector load. Less: eight 16-bit loads,
// or with WIDE the two aligned 16-byte words holding p and p + 15 (the same word twice when p is
// aligned) funnel-shifted to p's offset, two wide loads for more registers. Both words lie
// inside the allocation, whose 16-byte words are whole. WIDE is for raw Q6_K's 210-byte blocks
// in the expert products (decoders.cuh type_q6_K, K4_WIDE_RAW_Q6_K; docs/PERF.md, session 13).
template <int ALIGN, bool WIDE = false>
__device__ __forceinline__ uint4 load16(const u8* p) {
    if (ALIGN >= 16) return ld_weight16(p);
    if (!WIDE) {
        const u16* h = reinterpret_cast<const u16*>(p);
        uint4 v;
        v.x = K4_WLD(u16, h + 0) | ((u32)K4_WLD(u16, h + 1) << 16);
        v.y = K4_WLD(u16, h + 2) | ((u32)K4_WLD(u16, h + 3) << 16);
        v.z = K4_WLD(u16, h + 4) | ((u32)K4_WLD(u16, h + 5) << 16);
        v.w = K4_WLD(u16, h + 6) | ((u32)K4_WLD(u16, h + 7) << 16);
        return v;
    }
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    const u8* q = reinterpret_cast<const u8*>(a & ~15ull);
    const int off = (int)(a & 15), s = off >> 2, b = 8 * (off & 3);
    const uint4 lo = ld_weight16(q), hi = ld_weight16(q + (off ? 16 : 0));
    const u32 w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    u32 r[5];
#pragma unroll
    for (int i = 0; i < 5; ++i) r[i] = s == 0 ? w[i] : s == 1 ? w[i + 1] : s == 2 ? w[i + 2] : w[min(i + 3, 7)];
    return make_uint4(__funnelshift_r(r[0], r[1], b), __funnelshift_r(r[1], r[2], b), __funnelshift_r(r[2], r[3], b),
                      __funnelshift_r(r[3], r[4], b));
}

// 4 bytes from p, which is ALIGN-byte aligned (4 or more: one load; 2: two 16-bit loads).
template <int ALIGN>
__device__ __forceinline__ u32 load4(const u8* p) {
    if (ALIGN >= 4) return K4_WLD(u32, p);
    const u16* h = reinterpret_cast<const u16*>(p);
    return K4_WLD(u16, h) | ((u32)K4_WLD(u16, h + 1) << 16);
}

__device__ __forceinline__ u16 load2(const u8* p) { return K4_WLD(u16, p); }

// ---- number formats ---------------------------------------------------------------------------
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float((u32)b << 16); }

// ---- programmatic dependent launch (sm_90; both are no-ops in a kernel launched without it) ----
// pdl_trigger: the next kernel in the stream may begin launching. pdl_wait: block until the
// previous kernel has completed and its writes are visible. Before pdl_wait a kernel may read
// only what no earlier kernel of the chain writes: weights, and (attention_gqa.cu) the KV cache
// rows and the position that earlier steps wrote, each step's graph launching after the step
// before has completed. See runtime/cuda/launch.py.
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// ---- a block's arrival at a counter shared by the blocks of a grid ---------------------------
// One thread adds 1 to *ticket (global memory) and gets the value before: an atom.acq_rel.gpu
// (PTX ISA, memory consistency model), so the writes its block ordered before the call (by a
// block barrier) are released with it, and the arrival that sees n - 1 acquires what the n - 1
// before it released; a barrier after the call extends that to its whole block. One atomic in
// place of a fence, a relaxed atomic and a second fence (docs/PERF.md, session 18).
__device__ __forceinline__ int ticket_acq_rel(int* ticket) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
    return old;
}

// *p read with acquire semantics at GPU scope: what the writer released before the value it
// stored is visible to this thread after the load (and to its block after a barrier).
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// *p read relaxed at GPU scope (coherent in L2, no L1 invalidation): a poll's load. After the last
// poll, acquire_fence() makes what the writer released before the value visible, as one acquire
// load would; an acquire load in every poll invalidates the multiprocessor's L1 each time (sm_90:
// CCTL.IVALL after each load), under whatever else runs there.
__device__ __forceinline__ int ld_relaxed(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void acquire_fence() { asm volatile("fence.acquire.gpu;" ::: "memory"); }  // PTX ISA 8.6

// ---- warp reductions (all 32 lanes must take part) ---------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---- 16-byte vector words and int8 dot products -----------------------------------------------
__device__ __forceinline__ u32 word(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// CUDA's __dp4a is an `asm volatile` (sm_61_intrinsics.hpp), across which the compiler neither
// moves nor merges loads. A file that defines K4_DP4A_PURE before including common.cuh gets the
// same instruction as a plain asm (same results), so that identical shared-memory loads merge:
// gemv_batch.cu's loads of one token's x serve several rows. Other files keep __dp4a.
__device__ __forceinline__ int dp4a(int a, int b, int acc) {
#ifdef K4_DP4A_PURE
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(acc));
    return r;
#else
    return __dp4a(a, b, acc);
#endif
}

__device__ __forceinline__ int dot16(const uint4& a, const uint4& b, int acc) {
    acc = dp4a((int)a.x, (int)b.x, acc);
    acc = dp4a((int)a.y, (int)b.y, acc);
    acc = dp4a((int)a.z, (int)b.z, acc);
    return dp4a((int)a.w, (int)b.w, acc);
}

// dot16 with a's bytes unsigned (0..255) and b's signed: dp4a.u32.s32.
__device__ __forceinline__ int dot16_u8(const uint4& a, const uint4& b, int acc) {
#pragma unroll
    for (int k = 0; k < 4; ++k) asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(acc) : "r"(word(a, k)), "r"(word(b, k)));
    return acc;
}

__device__ __forceinline__ uint4 map4(const uint4& v, u32 shift, u32 mask) {
    return make_uint4((v.x >> shift) & mask, (v.y >> shift) & mask, (v.z >> shift) & mask, (v.w >> shift) & mask);
}

__device__ __forceinline__ uint4 or4(const uint4& a, const uint4& b) { return make_uint4(a.x | b.x, a.y | b.y, a.z | b.z, a.w | b.w); }

// ---- dequantized output: 16 consecutive values at p (float, or fp16 bits), 16-byte aligned ------
__device__ __forceinline__ void store16(float* p, const float (&v)[16]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) reinterpret_cast<float4*>(p)[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}

__device__ __forceinline__ void store16(u16* p, const float (&v)[16]) {
    u32 h[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = f32_to_f16(v[2 * k]) | ((u32)f32_to_f16(v[2 * k + 1]) << 16);
    reinterpret_cast<uint4*>(p)[0] = make_uint4(h[0], h[1], h[2], h[3]);
    reinterpret_cast<uint4*>(p)[1] = make_uint4(h[4], h[5], h[6], h[7]);
}

__device__ __forceinline__ int nibble(const uint4& v, int i, int shift) { return (word(v, i >> 2) >> (8 * (i & 3) + shift)) & 0xF; }
