// The KV cache's element types (-ctk / -ctv, runtime/kv_types.py), as template arguments of the
// kernels that write the cache (rope.cu, attention.cu's fused store) and read it (attention.cu,
// attention_tiled.cu). A cache plane of one layer is (n_ctx, n_head_kv, D) values; element e of
// it is value e % D of head (e / D) % n_head_kv at position e / (n_head_kv * D).
//
// kv_f16: the values as IEEE half (2 bytes each); no scale plane (d is null).
// kv_q8_0: llama.cpp's block_q8_0 (ggml-common.h: fp16 d, 32 int8 quants; 34 bytes per 32
//   values) split into two planes so that quants load as aligned vectors: x holds the int8
//   quants, (n_ctx, n_head_kv, D); d the fp16 scales, (n_ctx, n_head_kv, D / 32); value e is
//   x[e] * d[e / 32]. D % 32 == 0 (checked on the host), so a block never crosses a head row.
//   Quantization (store_row) is llama.cpp's quantize_row_q8_0_ref in float32 with explicitly
//   rounded operations (the module is compiled with --use_fast_math): amax = max |x|,
//   d = amax / 127, id = 1 / d (0 for d = 0), q = roundf(x * id) (half away from zero), d stored
//   rounded to nearest even; runtime/kv_types.py computes the same bits on the CPU.
//
// Each type gives: elem (the x plane's type), SCALED, raw8 (8 consecutive values as loaded),
// zero(), load() (generic address: global or shared), load_once() (global, read once: the
// evict-first hint of ld_once16), unpack() (raw8 -> 8 floats), dot8() (acc += the 8 values . 8
// floats), axpy8() (acc[0..7] += p * the 8 values), and store_row() (one warp writes one head
// row of D float32 values).
#pragma once
#include "ops_common.cuh"

// 8 bytes of the KV cache (8-byte aligned, not written while the kernel runs), read once.
__device__ __forceinline__ uint2 ld_once8(const void* p) {
#if K4_EVICT_FIRST
    uint2 v;
    asm("ld.global.nc.L1::evict_first.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
#else
    return *reinterpret_cast<const uint2*>(p);
#endif
}

// 4 int8 of a word -> 4 floats, exactly, without I2F conversions (16 per clock per SM on sm_90,
// too few for decode attention at memory speed): byte b + 128 as the low mantissa bits of 2^23
// is the float 2^23 + b + 128 (one byte permute), minus 2^23 + 128 is b (one exact subtraction).
__device__ __forceinline__ void i8x4_to_f32(u32 w, float* out) {
    const u32 u = w ^ 0x80808080u;  // b + 128 in each byte
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __int_as_float(__byte_perm(u, 0x4B000000u, 0x7650u | i)) - 8388736.0f;
}

struct kv_f16 {
    using elem = u16;
    static constexpr bool SCALED = false;
    struct raw8 {
        uint4 h;  // 8 halves
    };
    __device__ static raw8 zero() { return {make_uint4(0, 0, 0, 0)}; }
    // values e .. e + 7 (e % 8 == 0)
    __device__ static raw8 load(const elem* x, const u16*, size_t e) { return {*reinterpret_cast<const uint4*>(x + e)}; }
    __device__ static raw8 load_once(const elem* x, const u16*, size_t e) { return {ld_once16(x + e)}; }
    __device__ static void unpack(const raw8& r, float* out) { k4ops::unpack_half8(r.h, out); }
    __device__ static void dot8(const raw8& r, const float* q, float& acc) {
        float v[8];
        unpack(r, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += v[e] * q[e];
    }
    __device__ static void axpy8(const raw8& r, float p, float* acc) {
        float v[8];
        unpack(r, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += p * v[e];
    }
    // Values y[0 .. D) (readable by every lane) to elements e .. e + D - 1; every lane of the warp calls it.
    __device__ static void store_row(const float* y, int D, elem* x, u16*, size_t e, int lane) {
        for (int i = lane; i < D; i += 32) x[e + i] = f32_to_f16(y[i]);
    }
};

// QK8_0 (common.cuh) is gguf's block size, handed over by runtime/cuda/constants.py; store_row
// quantizes a block with one warp, a lane per value.
static_assert(QK8_0 == 32, "kv_q8_0::store_row takes a q8_0 block as one warp of 32 lanes");

struct kv_q8_0 {
    using elem = signed char;
    static constexpr bool SCALED = true;
    struct raw8 {
        uint2 q;  // 8 int8 quants
        u16 d;    // the fp16 scale of their block
    };
    __device__ static raw8 zero() { return {make_uint2(0, 0), 0}; }
    __device__ static raw8 load(const elem* x, const u16* d, size_t e) {
        return {*reinterpret_cast<const uint2*>(x + e), d[e / QK8_0]};
    }
    __device__ static raw8 load_once(const elem* x, const u16* d, size_t e) { return {ld_once8(x + e), d[e / QK8_0]}; }
    __device__ static void unpack(const raw8& r, float* out) {  // q * d, as llama.cpp's dequantize_row_q8_0
        const float d = f16_to_f32(r.d);
        i8x4_to_f32(r.q.x, out);
        i8x4_to_f32(r.q.y, out + 4);
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] *= d;
    }
    __device__ static void dot8(const raw8& r, const float* q, float& acc) {  // the scale once per 8 values
        float v[8], s = 0.0f;
        i8x4_to_f32(r.q.x, v);
        i8x4_to_f32(r.q.y, v + 4);
#pragma unroll
        for (int e = 0; e < 8; ++e) s += v[e] * q[e];
        acc += s * f16_to_f32(r.d);
    }
    __device__ static void axpy8(const raw8& r, float p, float* acc) {
        float v[8];
        i8x4_to_f32(r.q.x, v);
        i8x4_to_f32(r.q.y, v + 4);
        const float pd = p * f16_to_f32(r.d);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += pd * v[e];
    }
    // Lane l quantizes value 32b + l of each block b; e % 32 == 0, D % 32 == 0.
    __device__ static void store_row(const float* y, int D, elem* x, u16* d, size_t e, int lane) {
        for (int b = 0; b < D / QK8_0; ++b) {
            const float v = y[QK8_0 * b + lane];
            const float amax = ::warp_max(fabsf(v));
            const float db = __fdiv_rn(amax, 127.0f);
            const float id = db != 0.0f ? __frcp_rn(db) : 0.0f;
            x[e + QK8_0 * b + lane] = (elem)(int)roundf(__fmul_rn(v, id));
            if (lane == 0) d[e / QK8_0 + b] = f32_to_f16(db);
        }
    }
};

// The decode token's key and value, in the cache's form in shared memory (kcur and vcur, D values;
// kdcur and vdcur, their q8_0 scales), to the element `row` (its head's first value at its
// position) of the planes k, kd, v, vd: attention's fused store (attention.cu, attention_gqa.cu).
// Threads tid, tid + n_threads, ... of the block share it.
template <class KT, class VT>
__device__ __forceinline__ void store_fresh_row(typename KT::elem* k, u16* kd, typename VT::elem* v, u16* vd, size_t row,
                                                const typename KT::elem* kcur, const u16* kdcur,
                                                const typename VT::elem* vcur, const u16* vdcur, int D, int tid, int n_threads) {
    for (int i = tid; i < D; i += n_threads) {
        k[row + i] = kcur[i];
        v[row + i] = vcur[i];
    }
    for (int i = tid; i < D / QK8_0; i += n_threads) {
        if constexpr (KT::SCALED) kd[row / QK8_0 + i] = kdcur[i];
        if constexpr (VT::SCALED) vd[row / QK8_0 + i] = vdcur[i];
    }
}
