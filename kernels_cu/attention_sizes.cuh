// Shared-memory sizes of the attention kernels (attention.cu, attention_short.cu, attention_tiled.cu,
// attention_mma.cu, attention_gqa.cu), checked at compile time against runtime/cuda/constants.py, which the
// launchers in runtime/cuda/ops.py use.
#pragma once
#include "constants.cuh"

// attn_kv<KT, VT>: qs, sc, red (floats), kcur and vcur (the fresh key and value: fp16, or q8_0
// quants and scales, 2 D + D / 8 bytes, less).
__host__ __device__ constexpr int att_smem(int D) { return 4 * (D + ATT_CHUNK + ATT_THREADS * 8) + 2 * 2 * D; }

// attn_short<D>: the keys and values it holds (fp16, short_keys(D) rows each), the query and the
// RoPE table (D floats each), the probabilities, a row of D floats per warp, the token's key and
// value (fp16).
__host__ __device__ constexpr int short_keys(int D) { return SHORT_DIMS / D; }
__host__ __device__ constexpr int short_smem(int D) {
    return 2 * 2 * SHORT_DIMS + 4 * 2 * D + 4 * short_keys(D) + 4 * (SHORT_THREADS / 32) * D + 2 * 2 * D;
}

// attn_tiled<D>: the Q, K and V tiles (rows padded by 4 floats) and the probabilities (TILE_PS
// floats a row, TILE_K + 16 so the two half-warps hit other banks).
__host__ __device__ constexpr int tiled_smem(int D) { return 4 * (TILE_Q * (D + 4) + TILE_K * (D + 4) + TILE_K * D + TILE_Q * TILE_PS); }

// Shared memory of attn_mma<D, BK> in bytes (the Q tile for D > 128, two K and two V tiles, rows
// of D + 8 halves); runtime/cuda/ops.py computes the same.
__host__ __device__ constexpr int mma_smem(int D, int BK) { return 2 * (D + 8) * ((D <= 128 ? 0 : MMA_BQ) + 4 * BK); }

// Shared memory of attn_gqa<D, BK, S, KT, VT> in bytes: the 16 query rows (rows of D + 8 halves);
// per plane S fp16 tiles of BK keys (fp16 cache), or S raw tiles (BK rows of D int8 quants, then
// their fp16 scales, padded to 16 bytes) and one fp16 tile (q8_0 cache); a row of D floats per
// warp; the fresh key and value (2 D bytes each at most) and their q8_0 scales (D / 16 bytes each).
// I8 (keys read by int8 mma): a q8_0 plane's raw tiles only, rows of D + 16 bytes.
__host__ __device__ constexpr int gqa_plane_bytes(int D, int BK, int S, bool scaled, bool i8 = false) {
    return scaled ? S * ((BK * (i8 ? D + 16 : D) + BK * (D / 32) * 2 + 15) / 16 * 16) + (i8 ? 0 : BK * 2 * (D + 8)) : S * BK * 2 * (D + 8);
}
__host__ __device__ constexpr int gqa_smem(int D, int BK, int S, bool k_scaled, bool v_scaled, bool k_i8 = false) {
    return 2 * (D + 8) * 16 + gqa_plane_bytes(D, BK, S, k_scaled, k_i8) + gqa_plane_bytes(D, BK, S, v_scaled) + 4 * GQA_WARPS * D + 4 * D + D / 8;
}

// Keys per split of split decode attention (attn_kv, attn_gqa): split_len where positive; else
// (K4_DYN_SPLIT) sized on the device for the step's own n_seen keys (from the first the query
// sees): the shortest multiple of -split_len keys whose n_split splits cover them. A decode range's
// graph keeps its split count, planned for its longest context, and its splits stay balanced at
// every position in it, not only at its end (docs/PERF.md, session 19). tests/attention_ref.py
// restates the rule to check the kernels against it.
__host__ __device__ constexpr int split_units(int n_seen, int per) { return n_seen > per ? (n_seen + per - 1) / per : 1; }
__host__ __device__ constexpr int split_keys(int split_len, int n_seen, int n_split) {
    return split_len > 0 ? split_len : split_units(n_seen, -split_len * n_split) * -split_len;
}
static_assert(split_keys(64, 5, 3) == 64 && split_keys(-64, 32769, 33) == 1024 && split_keys(-64, 1, 33) == 64 &&
              split_keys(-32, 2112, 33) == 64 && split_keys(-32, 2113, 33) == 96, "split_keys");

// The launcher's sizes (runtime/cuda/constants.py att_smem, tiled_smem, mma_smem) are these.
__host__ __device__ constexpr bool smem_sizes_agree() {
    constexpr int att[] = {K4_CHECK_ATT_SMEM};      // D, bytes
    constexpr int tiled[] = {K4_CHECK_TILED_SMEM};  // D, bytes
    constexpr int short_[] = {K4_CHECK_SHORT_SMEM};  // D, bytes
    constexpr int mma[] = {K4_CHECK_MMA_SMEM};      // D, BK, bytes
    constexpr int gqa[] = {K4_CHECK_GQA_SMEM};      // D, BK, S, keys scaled, values scaled, keys int8, bytes
    for (int i = 0; i < (int)(sizeof(att) / sizeof(int)); i += 2)
        if (att_smem(att[i]) != att[i + 1]) return false;
    for (int i = 0; i < (int)(sizeof(tiled) / sizeof(int)); i += 2)
        if (tiled_smem(tiled[i]) != tiled[i + 1]) return false;
    for (int i = 0; i < (int)(sizeof(short_) / sizeof(int)); i += 2)
        if (short_smem(short_[i]) != short_[i + 1]) return false;
    for (int i = 0; i < (int)(sizeof(mma) / sizeof(int)); i += 3)
        if (mma_smem(mma[i], mma[i + 1]) != mma[i + 2]) return false;
    for (int i = 0; i < (int)(sizeof(gqa) / sizeof(int)); i += 7)
        if (gqa_smem(gqa[i], gqa[i + 1], gqa[i + 2], gqa[i + 3], gqa[i + 4], gqa[i + 5]) != gqa[i + 6]) return false;
    return true;
}
static_assert(smem_sizes_agree(), "a shared-memory size differs from runtime/cuda/constants.py");
