// attn_gqa's staging of the key and value tiles in shared memory (attention_gqa.cu): fp16 planes
// copied by cp.async into S stages, q8_0 planes copied raw and dequantized to fp16 tile by tile,
// with the bits of attn_mma's staging, or (I8: keys read by int8 mma) left raw. Tiles are
// addressed through a sliding layer's ring mask.
#pragma once
#include "mma_common.cuh"

namespace k4gqa {
using namespace k4mma;

// 4 int8 of a word times the fp16 scale d, as 4 fp16 in h[0] (values 0, 1) and h[1] (2, 3),
// each q * d rounded once to nearest even: the bits that converting q and d to f32, multiplying
// (exact: 8 by 11 significant bits) and rounding to fp16 give, in 3 instructions per pair
// instead of 8. Byte b + 128 as the low mantissa bits of fp16 1024 is 1024 + b + 128 (one byte
// permute for two values); minus 1152 is b, exactly; times d rounds once.
__device__ __forceinline__ void i8x4_to_f16_scaled(u32 w, u32 d, u32* h) {
    const u32 u = w ^ 0x80808080u, d2 = d | (d << 16);
    const u32 lo = __byte_perm(u, 0x64646464u, 0x5140), hi = __byte_perm(u, 0x64646464u, 0x7362);
    asm("{ .reg .b32 t; sub.rn.f16x2 t, %1, %2; mul.rn.f16x2 %0, t, %3; }" : "=r"(h[0]) : "r"(lo), "r"(0x64806480u), "r"(d2));
    asm("{ .reg .b32 t; sub.rn.f16x2 t, %1, %2; mul.rn.f16x2 %0, t, %3; }" : "=r"(h[1]) : "r"(hi), "r"(0x64806480u), "r"(d2));
}

// The staging of one plane (keys or values) of S tiles in flight, for cache type T; rows of the
// fp16 tile the mmas read are ROW_BYTES apart. Specialized below: fp16 planes copy straight into
// S fp16 stages; q8_0 planes copy their quants and scales into S raw stages and dequantize the
// tile about to be used into one fp16 tile (prepare). Thread tid copies the 16-byte chunks
// tid, tid + GQA_THREADS, ... of a tile, row-major: column c = tid % PER_ROW of rows r0 =
// tid / PER_ROW, r0 + RSTEP, ...; its addresses at position 0 are computed once (the
// constructor), a tile adds (j * BK) & ring rows, and tiles wholly inside [lo, hi) skip the row checks.
// I8 (q8_0 planes only): no fp16 tile; the raw stage is the tile, its rows of quants QROW = D + 16
// bytes apart (so ldmatrix's 8 rows of a 16-byte column fall in distinct banks), scales(j) its
// rows' scales.
template <class T, int D, int BK, int S, int ROW_BYTES, bool SCALED = T::SCALED, bool I8 = false>
struct Plane;

template <class T, int D, int BK, int S, int ROW_BYTES>
struct Plane<T, D, BK, S, ROW_BYTES, false, false> {
    static constexpr int STAGE = BK * ROW_BYTES;
    static constexpr int BYTES = S * STAGE;  // shared memory
    static constexpr int PER_ROW = D / 8, RSTEP = GQA_THREADS / PER_ROW, N = BK / RSTEP;  // 16-byte chunks
    static_assert(GQA_THREADS % PER_ROW == 0 && BK % RSTEP == 0, "a tile's chunks spread evenly over the block");
    u32 base, dst0;                    // the stages; this thread's first chunk in a stage
    const typename T::elem* src0;     // its first chunk at position 0
    size_t stride;                    // elements a position
    int r0;                           // its first row

    // x: the plane (element head_off at position 0 is this KV head's), kv_stride elements a position.
    __device__ __forceinline__ Plane(u32 smem, const typename T::elem* x, const u16*, size_t head_off, size_t kv_stride, int tid)
        : base(smem), stride(kv_stride), r0(tid / PER_ROW) {
        const int c = tid % PER_ROW;
        dst0 = (u32)(r0 * ROW_BYTES + 16 * c);
        src0 = x + head_off + (size_t)r0 * kv_stride + 8 * c;
    }

    // Keys j * BK .. + BK - 1 into stage j % S; keys outside [lo, hi) read nothing and stage zeros.
    // ring: attn_kv's (-1, or the row mask of a sliding layer's ring, whose rows BK divides).
    __device__ __forceinline__ void fetch(int j, int lo, int hi, int ring) const {
        const u32 dst = base + (u32)((j % S) * STAGE) + dst0;
        const typename T::elem* src = src0 + (size_t)((j * BK) & ring) * stride;
        const int k0 = j * BK + r0;
        const bool inside = j * BK >= lo && j * BK + BK <= hi;
#pragma unroll
        for (int it = 0; it < N; ++it) {
            const bool valid = inside || (k0 + RSTEP * it >= lo && k0 + RSTEP * it < hi);
            cp_async16(dst + (u32)(RSTEP * it * ROW_BYTES), valid ? src + (size_t)RSTEP * it * stride : src0, valid);
        }
    }
    __device__ __forceinline__ void prepare(int, int) const {}
    __device__ __forceinline__ u32 tile(int j) const { return base + (u32)((j % S) * STAGE); }
};

template <class T, int D, int BK, int S, int ROW_BYTES, bool I8>
struct Plane<T, D, BK, S, ROW_BYTES, true, I8> {
    static constexpr int SC_ROW = D / QK8_0 * 2;               // bytes of one row's scales (4, 8 or 16)
    static constexpr int QROW = I8 ? D + 16 : D;               // bytes from one row's quants to the next
    static constexpr int QUANTS = BK * QROW;                   // bytes of a stage's quants
    static constexpr int RAW = (QUANTS + BK * SC_ROW + 15) / 16 * 16;  // a raw stage: quants, then scales
    static constexpr int BYTES = S * RAW + (I8 ? 0 : BK * ROW_BYTES);  // shared memory: S raw stages, one fp16 tile (not I8)
    static constexpr int PER_ROW = D / 16, RSTEP = GQA_THREADS / PER_ROW, N = BK / RSTEP;  // 16-quant chunks
    static_assert(GQA_THREADS % PER_ROW == 0 && BK % RSTEP == 0 && BK <= GQA_THREADS, "a tile's chunks spread evenly over the block");
    u32 base, dst0;                    // the raw stages (the fp16 tile follows them); this thread's first chunk in a stage
    const typename T::elem* src0;     // its first chunk at position 0
    const u16* sc0;                   // the scales of row tid (tid < BK) at position 0
    size_t stride;
    int r0, c;

    __device__ __forceinline__ Plane(u32 smem, const typename T::elem* x, const u16* xd, size_t head_off, size_t kv_stride, int tid)
        : base(smem), stride(kv_stride), r0(tid / PER_ROW), c(tid % PER_ROW) {
        dst0 = (u32)(r0 * QROW + 16 * c);
        src0 = x + head_off + (size_t)r0 * kv_stride + 16 * c;
        sc0 = xd + (head_off + (size_t)tid * kv_stride) / QK8_0;
    }

    __device__ __forceinline__ void fetch(int j, int lo, int hi, int ring) const {
        const u32 dst = base + (u32)((j % S) * RAW);
        const size_t row = (size_t)((j * BK) & ring);  // the tile's first row
        const typename T::elem* src = src0 + row * stride;
        const int k0 = j * BK + r0;
        const bool inside = j * BK >= lo && j * BK + BK <= hi;
#pragma unroll
        for (int it = 0; it < N; ++it) {
            const bool valid = inside || (k0 + RSTEP * it >= lo && k0 + RSTEP * it < hi);
            cp_async16(dst + dst0 + (u32)(RSTEP * it * QROW), valid ? src + (size_t)RSTEP * it * stride : src0, valid);
        }
        const int tid = r0 * PER_ROW + c;
        if (tid < BK) {  // row tid's scales
            const int key = j * BK + tid;
            const bool valid = key >= lo && key < hi;
            cp_async_small<SC_ROW>(dst + (u32)(QUANTS + tid * SC_ROW), valid ? sc0 + row * stride / QK8_0 : sc0, valid);
        }
    }
    // Tile j's quants times their scales, rounded to fp16 (the bits of attn_mma's staging), into the
    // fp16 tile; I8: nothing.
    __device__ __forceinline__ void prepare(int j, int) const {
        if constexpr (I8) return;
        const u32 src = base + (u32)((j % S) * RAW), dst = base + (u32)(S * RAW);
#pragma unroll
        for (int it = 0; it < N; ++it) {
            const int row = r0 + RSTEP * it;
            const uint4 q = ld_shared16(src + (u32)(row * QROW + 16 * c));
            const u32 d = ld_shared_u16(src + (u32)(QUANTS + row * SC_ROW + 2 * (c / 2)));
            u32 h[8];
            i8x4_to_f16_scaled(q.x, d, h);
            i8x4_to_f16_scaled(q.y, d, h + 2);
            i8x4_to_f16_scaled(q.z, d, h + 4);
            i8x4_to_f16_scaled(q.w, d, h + 6);
            const u32 a = dst + (u32)(row * ROW_BYTES + 32 * c);
            st_shared16(a, make_uint4(h[0], h[1], h[2], h[3]));
            st_shared16(a + 16, make_uint4(h[4], h[5], h[6], h[7]));
        }
    }
    __device__ __forceinline__ u32 tile(int j) const { return base + (u32)(I8 ? (j % S) * RAW : S * RAW); }
    __device__ __forceinline__ u32 scales(int j) const { return base + (u32)((j % S) * RAW + QUANTS); }  // I8

    // I8: row r of tile j's raw stage := the quants q (D bytes, 16-byte aligned) and scales d (D / 32)
    // of a key; threads tid of n_threads share the work.
    __device__ __forceinline__ void put_row(int j, int r, const typename T::elem* q, const u16* d, int tid, int n_threads) const {
        static_assert(I8, "the fp16 tile takes rows through stage8_now");
        for (int i = tid; i < D / 16; i += n_threads)
            st_shared16(tile(j) + (u32)(r * QROW + 16 * i), reinterpret_cast<const uint4*>(q)[i]);
        for (int i = tid; i < D / QK8_0; i += n_threads) st_shared_u16(scales(j) + (u32)(r * SC_ROW + 2 * i), d[i]);
    }
};

}  // namespace k4gqa
