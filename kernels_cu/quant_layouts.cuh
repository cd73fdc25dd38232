// How the products' operands lie in memory: ggml's quantized blocks (block_q4_K, block_q5_K,
// block_q6_K, block_q8_0, block_q5_0, block_q5_1; the smaller types' blocks are in
// decoders_lowbit.cuh), the two device layouts of a weight tensor (raw and planar), and the
// matrix-vector kernels' 8-bit x in shared memory (q8x).
//
// Block layouts: ggml-common.h; the meaning of their bits: ggml-quants.c dequantize_row_*. Block
// sizes, planar groups, q8 x swizzles and the other numbers shared with Python come from
// runtime/cuda/constants.py as -D defines (constants.cuh).
#pragma once
#include "constants.cuh"
#include "device.cuh"

#define QK_K K4_QK_Q4_K
#define K_SCALE_SIZE 12
#define QK8_0 K4_QK_Q8_0
#define QK5_0 K4_QK_Q5_0
#define QK5_1 K4_QK_Q5_1
static_assert(K4_QK_Q5_K == QK_K && K4_QK_Q6_K == QK_K, "the K-quants share one super-block size");

// fp16 numbers are stored as their bits (ggml_half is uint16_t).
struct block_q4_K {  // 256 weights, 4.5 bits each: w = d*sc*q - dmin*m, q in 0..15
    u16 d;                     // super-block scale of the 6-bit scales
    u16 dmin;                  // super-block scale of the 6-bit mins
    u8 scales[K_SCALE_SIZE];   // 8 scales and 8 mins, 6 bits each (get_scale_min_k4)
    u8 qs[QK_K / 2];           // 4-bit quants: byte 32j+l holds weights 64j+l (low) and 64j+32+l (high)
};
static_assert(sizeof(block_q4_K) == K4_BLOCK_BYTES_Q4_K, "block_q4_K: gguf GGML_QUANT_SIZES has another size");

struct block_q5_K {  // 256 weights, 5.5 bits each: w = d*sc*q - dmin*m, q in 0..31
    u16 d;
    u16 dmin;
    u8 scales[K_SCALE_SIZE];
    u8 qh[QK_K / 8];           // 5th bit: bit s of byte l belongs to weight 32s+l
    u8 qs[QK_K / 2];           // low 4 bits, as in block_q4_K
};
static_assert(sizeof(block_q5_K) == K4_BLOCK_BYTES_Q5_K, "block_q5_K: gguf GGML_QUANT_SIZES has another size");

struct block_q6_K {  // 256 weights, 6.5625 bits each: w = d*sc*(q-32), q in 0..63
    u8 ql[QK_K / 2];           // low 4 bits: byte 64h+l holds weights 128h+l (low) and 128h+64+l (high), l<64
    u8 qh[QK_K / 4];           // high 2 bits: bits 2s..2s+1 of byte 32h+l belong to weight 128h+32s+l
    i8 scales[QK_K / 16];      // one signed 8-bit scale per 16 weights
    u16 d;
};
static_assert(sizeof(block_q6_K) == K4_BLOCK_BYTES_Q6_K, "block_q6_K: gguf GGML_QUANT_SIZES has another size");

struct block_q8_0 {  // 32 weights: w = d*q
    u16 d;
    i8 qs[QK8_0];
};
static_assert(sizeof(block_q8_0) == K4_BLOCK_BYTES_Q8_0, "block_q8_0: gguf GGML_QUANT_SIZES has another size");

struct block_q5_0 {  // 32 weights: w = d*(q-16), q = low nibble | (bit i of qh) << 4
    u16 d;
    u8 qh[4];
    u8 qs[QK5_0 / 2];          // byte i holds weights i (low) and i+16 (high)
};
static_assert(sizeof(block_q5_0) == K4_BLOCK_BYTES_Q5_0, "block_q5_0: gguf GGML_QUANT_SIZES has another size");

struct block_q5_1 {  // 32 weights: w = d*q + m, q = low nibble | (bit i of qh) << 4
    u16 d;
    u16 m;
    u8 qh[4];
    u8 qs[QK5_1 / 2];          // byte i holds weights i (low) and i+16 (high)
};
static_assert(sizeof(block_q5_1) == K4_BLOCK_BYTES_Q5_1, "block_q5_1: gguf GGML_QUANT_SIZES has another size");

// ---- device layouts --------------------------------------------------------------------------
// A quantized tensor of nblk blocks is either `raw` (ggml's array of structs, as in the file) or
// `planar`: each byte range ("group") [cut(g), cut(g+1)) of the block, the same range for every
// block, stored contiguously over all nblk blocks, group after group, each group's plane padded
// to 16 bytes. Planar makes every wide field 16-byte aligned whatever the block size (Q6_K's
// 210-byte blocks, Q8_0's 34). runtime/cuda/layout.py builds the same layout on the host.
// Group boundaries are sums of field sizes: the size asserts above rule out padding.

__host__ __device__ constexpr i64 round16(i64 n) { return (n + 15) & ~(i64)15; }

// Whether T's planar groups start at the offsets g... (the last one: the block size), as
// K4_GROUPS_<type> lists them.
template <class T, class... G>
__host__ __device__ constexpr bool cuts_are(G... g) {
    const int want[] = {g...};
    for (int i = 0; i < (int)sizeof...(G); ++i)
        if (T::cut(i) != want[i]) return false;
    return want[sizeof...(G) - 1] == T::block_bytes;
}

// Whether T's planar groups before group G all take a multiple of 16 bytes a block, so that each
// starts at nblk * cut(G) whatever nblk is (its round16 padding is zero).
template <class T, int G>
__host__ __device__ constexpr bool groups_unpadded() {
    for (int g = 0; g < G; ++g)
        if ((T::cut(g + 1) - T::cut(g)) % 16 != 0) return false;
    return true;
}

// Pointer to group G of block `blk` of the tensor at `w` (T supplies block_bytes and cut()).
// Where no group before G is padded its start is one product (the padded sum's value): the row
// loops address a chunk's groups in a few instructions instead of summing the pads again for each.
template <class T, int G, bool PLANAR>
__device__ __forceinline__ const u8* group_at(const u8* w, i64 nblk, i64 blk) {
    if (PLANAR) {
        if constexpr (groups_unpadded<T, G>()) return w + nblk * T::cut(G) + blk * (T::cut(G + 1) - T::cut(G));
        i64 base = 0;
#pragma unroll
        for (int g = 0; g < G; ++g) base += round16(nblk * (T::cut(g + 1) - T::cut(g)));
        return w + base + blk * (T::cut(G + 1) - T::cut(G));
    }
    return w + blk * T::block_bytes + T::cut(G);
}

// ---- quantized activations (q8 x) in shared memory ---------------------------------------------
// The matrix-vector kernels quantize x once per thread block: n_in int8 in 16-byte units (unit u
// holds elements 16u..16u+15), one float scale per 32 elements (d), and per unit that scale times
// the unit's sum of quants (s), so sum(w*x) over a unit is d*dot(q_w, q_x) and offsets cost one
// multiply. Unit u is stored at a position rotated within its 128-byte row by SWZ*(u/8), which
// makes each weight type's read pattern free of shared-memory bank conflicts.
// Unit u's row of 8 (u >= 0): the row's first slot and u rotated by swz * (u / 8). Unit u + k of
// the same row ((u + k) / 8 == u / 8) lies at byte x_row_byte(row, k), 16 x_unit_slot(u + k, swz), so the
// units of a chunk share one row computation (the decoders' dots). x_unit_slot keeps its own
// signed form: written through these, nvcc schedules the attention and gemv kernels differently.
// A row in bytes: its first slot's offset (a multiple of 128) and the rotated unit's, times 16, so
// a unit's offset is one add and one mask-and-or (x_row_byte).
struct x_row {
    u32 first, rot;  // 16 x (the row's first slot), 16 x (u rotated)
};
__device__ __forceinline__ x_row x_row_of(int u, int swz) { return {16u * ((u32)u & ~7u), 16u * ((u32)u + swz * ((u32)u >> 3))}; }
__device__ __forceinline__ u32 x_row_byte(x_row r, int k) { return r.first | ((r.rot + 16u * k) & 0x70u); }
__device__ __forceinline__ int x_unit_slot(int u, int swz) { return (u & ~7) | ((u + swz * (u >> 3)) & 7); }

template <int SWZ>
struct q8x {
    const u8* q;     // (round_up(n_in/16, 8) * 16) bytes, swizzled units
    const float* d;  // (n_in/32) scales
    const float* s;  // (n_in/16) d * sum of the unit's quants
    __device__ __forceinline__ uint4 unit(int u) const {
        return *reinterpret_cast<const uint4*>(q + 16 * x_unit_slot(u, SWZ));
    }
    // Unit k of row r (x_row_of(u, SWZ): unit u + k).
    __device__ __forceinline__ uint4 unit_at(x_row r, int k) const {
        return *reinterpret_cast<const uint4*>(q + x_row_byte(r, k));
    }
};
