// The numbers kernels_cu shares with its Python launchers come from runtime/cuda/constants.py,
// which runtime/cuda/compile.py passes as -D options to every module (tests/test_kernels_compile.py
// passes the same to nvcc). A missing one stops the compile here; the checks below compare the
// rest with the kernels' own structs and formulas (common.cuh, gemv.cu, attention.cu).
//
// List values (K4_GROUPS_*, K4_CHECK_*) are written (a)K4_C(b)K4_C(c): K4_C is the comma,
// because nvcc splits -D values at commas.
#pragma once

#define K4_C ,

#ifndef ATT_THREADS
#error "ATT_THREADS comes from runtime/cuda/constants.py"
#endif
#ifndef ATT_BLOCKS
#error "ATT_BLOCKS comes from runtime/cuda/constants.py"
#endif
#ifndef ATT_BLOCKS_DEEP
#error "ATT_BLOCKS_DEEP comes from runtime/cuda/constants.py"
#endif
#ifndef PAIR_REGS
#error "PAIR_REGS comes from runtime/cuda/constants.py"
#endif
#ifndef PAIR_THREADS
#error "PAIR_THREADS comes from runtime/cuda/constants.py"
#endif
#ifndef FOLD_MAX_WARPS
#error "FOLD_MAX_WARPS comes from runtime/cuda/constants.py"
#endif
#ifndef QKV_WARPS
#error "QKV_WARPS comes from runtime/cuda/constants.py"
#endif
#ifndef QKV_REGS
#error "QKV_REGS comes from runtime/cuda/constants.py"
#endif
#ifndef ATT_CHUNK
#error "ATT_CHUNK comes from runtime/cuda/constants.py"
#endif
#ifndef TILE_Q
#error "TILE_Q comes from runtime/cuda/constants.py"
#endif
#ifndef TILE_K
#error "TILE_K comes from runtime/cuda/constants.py"
#endif
#ifndef TILE_THREADS
#error "TILE_THREADS comes from runtime/cuda/constants.py"
#endif
#ifndef TILE_PS
#error "TILE_PS comes from runtime/cuda/constants.py"
#endif
#ifndef MMA_WARPS
#error "MMA_WARPS comes from runtime/cuda/constants.py"
#endif
#ifndef MMA_THREADS
#error "MMA_THREADS comes from runtime/cuda/constants.py"
#endif
#ifndef MMA_BQ
#error "MMA_BQ comes from runtime/cuda/constants.py"
#endif
#ifndef ATT_MAX_SPLIT
#error "ATT_MAX_SPLIT comes from runtime/cuda/constants.py"
#endif
#ifndef MERGE_SLICE
#error "MERGE_SLICE comes from runtime/cuda/constants.py"
#endif
#ifndef GQA_WARPS
#error "GQA_WARPS comes from runtime/cuda/constants.py"
#endif
#ifndef GQA_THREADS
#error "GQA_THREADS comes from runtime/cuda/constants.py"
#endif
#ifndef SHORT_THREADS
#error "SHORT_THREADS comes from runtime/cuda/constants.py"
#endif
#ifndef SHORT_DIMS
#error "SHORT_DIMS comes from runtime/cuda/constants.py"
#endif
#ifndef SHORT_REGS
#error "SHORT_REGS comes from runtime/cuda/constants.py"
#endif
#ifndef SAMPLE_THREADS
#error "SAMPLE_THREADS comes from runtime/cuda/constants.py"
#endif
#ifndef SAMPLE_CAP
#error "SAMPLE_CAP comes from runtime/cuda/constants.py"
#endif
#ifndef SAMPLER_PARAM_WORDS
#error "SAMPLER_PARAM_WORDS comes from runtime/cuda/constants.py"
#endif
#ifndef STATE_WORDS
#error "STATE_WORDS comes from runtime/cuda/constants.py"
#endif
#ifndef ST_TOK
#error "ST_TOK comes from runtime/cuda/constants.py"
#endif
#ifndef ST_POS
#error "ST_POS comes from runtime/cuda/constants.py"
#endif
#ifndef ST_RING
#error "ST_RING comes from runtime/cuda/constants.py"
#endif
#ifndef ST_DRAW
#error "ST_DRAW comes from runtime/cuda/constants.py"
#endif
#ifndef MOE_WARPS
#error "MOE_WARPS comes from runtime/cuda/constants.py"
#endif
#ifndef MOE_MAX_K
#error "MOE_MAX_K comes from runtime/cuda/constants.py"
#endif
#ifndef ROUTER_THREADS
#error "ROUTER_THREADS comes from runtime/cuda/constants.py"
#endif
#ifndef MMA8_TOKENS
#error "MMA8_TOKENS comes from runtime/cuda/constants.py"
#endif
#ifndef MMA8_STAGE_BYTES
#error "MMA8_STAGE_BYTES comes from runtime/cuda/constants.py"
#endif
#ifndef MMA8_STAGE_BYTES_Q6_K
#error "MMA8_STAGE_BYTES_Q6_K comes from runtime/cuda/constants.py"
#endif
#ifndef MMA8_NQ_RUN
#error "MMA8_NQ_RUN comes from runtime/cuda/constants.py"
#endif

// Per quantized type T: K4_QK_T (weights per block), K4_CHUNK_T (weights per chunk), K4_BLOCK_BYTES_T, K4_GROUPS_T (planar
// group offsets), K4_X_SWIZZLE_T, K4_HANDOFF_T, K4_EXPERT_PLANAR_T (common.cuh checks and uses them).
#if !defined(K4_QK_Q4_K) || !defined(K4_CHUNK_Q4_K) || !defined(K4_BLOCK_BYTES_Q4_K) || !defined(K4_GROUPS_Q4_K) || !defined(K4_X_SWIZZLE_Q4_K) || !defined(K4_HANDOFF_Q4_K) || !defined(K4_EXPERT_PLANAR_Q4_K)
#error "K4_QK_Q4_K, K4_CHUNK_Q4_K, K4_BLOCK_BYTES_Q4_K, K4_GROUPS_Q4_K, K4_X_SWIZZLE_Q4_K, K4_HANDOFF_Q4_K, K4_EXPERT_PLANAR_Q4_K come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_Q5_K) || !defined(K4_CHUNK_Q5_K) || !defined(K4_BLOCK_BYTES_Q5_K) || !defined(K4_GROUPS_Q5_K) || !defined(K4_X_SWIZZLE_Q5_K) || !defined(K4_HANDOFF_Q5_K) || !defined(K4_EXPERT_PLANAR_Q5_K)
#error "K4_QK_Q5_K, K4_CHUNK_Q5_K, K4_BLOCK_BYTES_Q5_K, K4_GROUPS_Q5_K, K4_X_SWIZZLE_Q5_K, K4_HANDOFF_Q5_K, K4_EXPERT_PLANAR_Q5_K come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_Q6_K) || !defined(K4_CHUNK_Q6_K) || !defined(K4_BLOCK_BYTES_Q6_K) || !defined(K4_GROUPS_Q6_K) || !defined(K4_X_SWIZZLE_Q6_K) || !defined(K4_HANDOFF_Q6_K) || !defined(K4_EXPERT_PLANAR_Q6_K)
#error "K4_QK_Q6_K, K4_CHUNK_Q6_K, K4_BLOCK_BYTES_Q6_K, K4_GROUPS_Q6_K, K4_X_SWIZZLE_Q6_K, K4_HANDOFF_Q6_K, K4_EXPERT_PLANAR_Q6_K come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_Q8_0) || !defined(K4_CHUNK_Q8_0) || !defined(K4_BLOCK_BYTES_Q8_0) || !defined(K4_GROUPS_Q8_0) || !defined(K4_X_SWIZZLE_Q8_0) || !defined(K4_HANDOFF_Q8_0) || !defined(K4_EXPERT_PLANAR_Q8_0)
#error "K4_QK_Q8_0, K4_CHUNK_Q8_0, K4_BLOCK_BYTES_Q8_0, K4_GROUPS_Q8_0, K4_X_SWIZZLE_Q8_0, K4_HANDOFF_Q8_0, K4_EXPERT_PLANAR_Q8_0 come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_Q5_0) || !defined(K4_CHUNK_Q5_0) || !defined(K4_BLOCK_BYTES_Q5_0) || !defined(K4_GROUPS_Q5_0) || !defined(K4_X_SWIZZLE_Q5_0) || !defined(K4_HANDOFF_Q5_0) || !defined(K4_EXPERT_PLANAR_Q5_0)
#error "K4_QK_Q5_0, K4_CHUNK_Q5_0, K4_BLOCK_BYTES_Q5_0, K4_GROUPS_Q5_0, K4_X_SWIZZLE_Q5_0, K4_HANDOFF_Q5_0, K4_EXPERT_PLANAR_Q5_0 come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_Q5_1) || !defined(K4_CHUNK_Q5_1) || !defined(K4_BLOCK_BYTES_Q5_1) || !defined(K4_GROUPS_Q5_1) || !defined(K4_X_SWIZZLE_Q5_1) || !defined(K4_HANDOFF_Q5_1) || !defined(K4_EXPERT_PLANAR_Q5_1)
#error "K4_QK_Q5_1, K4_CHUNK_Q5_1, K4_BLOCK_BYTES_Q5_1, K4_GROUPS_Q5_1, K4_X_SWIZZLE_Q5_1, K4_HANDOFF_Q5_1, K4_EXPERT_PLANAR_Q5_1 come from runtime/cuda/constants.py"
#endif

#if !defined(K4_QK_Q2_K) || !defined(K4_CHUNK_Q2_K) || !defined(K4_BLOCK_BYTES_Q2_K) || !defined(K4_GROUPS_Q2_K) || !defined(K4_X_SWIZZLE_Q2_K) || !defined(K4_HANDOFF_Q2_K) || !defined(K4_EXPERT_PLANAR_Q2_K)
#error "K4_QK_Q2_K, K4_CHUNK_Q2_K, K4_BLOCK_BYTES_Q2_K, K4_GROUPS_Q2_K, K4_X_SWIZZLE_Q2_K, K4_HANDOFF_Q2_K, K4_EXPERT_PLANAR_Q2_K come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_Q3_K) || !defined(K4_CHUNK_Q3_K) || !defined(K4_BLOCK_BYTES_Q3_K) || !defined(K4_GROUPS_Q3_K) || !defined(K4_X_SWIZZLE_Q3_K) || !defined(K4_HANDOFF_Q3_K) || !defined(K4_EXPERT_PLANAR_Q3_K)
#error "K4_QK_Q3_K, K4_CHUNK_Q3_K, K4_BLOCK_BYTES_Q3_K, K4_GROUPS_Q3_K, K4_X_SWIZZLE_Q3_K, K4_HANDOFF_Q3_K, K4_EXPERT_PLANAR_Q3_K come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_Q4_0) || !defined(K4_CHUNK_Q4_0) || !defined(K4_BLOCK_BYTES_Q4_0) || !defined(K4_GROUPS_Q4_0) || !defined(K4_X_SWIZZLE_Q4_0) || !defined(K4_HANDOFF_Q4_0) || !defined(K4_EXPERT_PLANAR_Q4_0)
#error "K4_QK_Q4_0, K4_CHUNK_Q4_0, K4_BLOCK_BYTES_Q4_0, K4_GROUPS_Q4_0, K4_X_SWIZZLE_Q4_0, K4_HANDOFF_Q4_0, K4_EXPERT_PLANAR_Q4_0 come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_IQ4_XS) || !defined(K4_CHUNK_IQ4_XS) || !defined(K4_BLOCK_BYTES_IQ4_XS) || !defined(K4_GROUPS_IQ4_XS) || !defined(K4_X_SWIZZLE_IQ4_XS) || !defined(K4_HANDOFF_IQ4_XS) || !defined(K4_EXPERT_PLANAR_IQ4_XS)
#error "K4_QK_IQ4_XS, K4_CHUNK_IQ4_XS, K4_BLOCK_BYTES_IQ4_XS, K4_GROUPS_IQ4_XS, K4_X_SWIZZLE_IQ4_XS, K4_HANDOFF_IQ4_XS, K4_EXPERT_PLANAR_IQ4_XS come from runtime/cuda/constants.py"
#endif
#if !defined(K4_QK_IQ4_NL) || !defined(K4_CHUNK_IQ4_NL) || !defined(K4_BLOCK_BYTES_IQ4_NL) || !defined(K4_GROUPS_IQ4_NL) || !defined(K4_X_SWIZZLE_IQ4_NL) || !defined(K4_HANDOFF_IQ4_NL) || !defined(K4_EXPERT_PLANAR_IQ4_NL)
#error "K4_QK_IQ4_NL, K4_CHUNK_IQ4_NL, K4_BLOCK_BYTES_IQ4_NL, K4_GROUPS_IQ4_NL, K4_X_SWIZZLE_IQ4_NL, K4_HANDOFF_IQ4_NL, K4_EXPERT_PLANAR_IQ4_NL come from runtime/cuda/constants.py"
#endif
#ifndef K4_IQ4NL_VALUES
#error "K4_IQ4NL_VALUES (IQ4_XS's value table) comes from runtime/cuda/constants.py"
#endif

// Tables of sizes computed by runtime/cuda/constants.py, checked against gemv.cu, gemv_mma.cu and attention.cu.
#ifndef K4_CHECK_Q8X
#error "K4_CHECK_Q8X comes from runtime/cuda/constants.py"
#endif
#ifndef K4_CHECK_ATT_SMEM
#error "K4_CHECK_ATT_SMEM comes from runtime/cuda/constants.py"
#endif
#ifndef K4_CHECK_TILED_SMEM
#error "K4_CHECK_TILED_SMEM comes from runtime/cuda/constants.py"
#endif
#ifndef K4_CHECK_SHORT_SMEM
#error "K4_CHECK_SHORT_SMEM comes from runtime/cuda/constants.py"
#endif
#ifndef K4_CHECK_MMA_SMEM
#error "K4_CHECK_MMA_SMEM comes from runtime/cuda/constants.py"
#endif
#ifndef K4_CHECK_GQA_SMEM
#error "K4_CHECK_GQA_SMEM comes from runtime/cuda/constants.py"
#endif
#ifndef K4_CHECK_MMA8_SMEM
#error "K4_CHECK_MMA8_SMEM comes from runtime/cuda/constants.py"
#endif

// megakernel.cu: its sizes, instruction and matrix record fields, weight type codes.
#if !defined(MK_THREADS) || !defined(MK_SLOTS) || !defined(MK_SPLIT_KEYS) || !defined(MK_SPLIT_MIN) || !defined(MK_MAX_SPLIT) || \
    !defined(MK_MAX_GROUP) || !defined(MK_MAX_D) || !defined(MK_MAX_GD) || !defined(MK_GEMV) || \
    !defined(MK_ATTN) || !defined(MK_OP_WORDS) || !defined(MK_MAT_WORDS) || !defined(MK_ATTN_SCRATCH_FLOATS) || \
    !defined(MKO_KIND) || !defined(MKO_X) || !defined(MKO_NORM) || !defined(MKO_N_IN) || \
    !defined(MKO_EPS) || !defined(MKO_Q) || !defined(MKO_K) || !defined(MKO_V) || \
    !defined(MKO_K_CACHE) || !defined(MKO_V_CACHE) || !defined(MKO_OUT) || !defined(MKO_PART) || \
    !defined(MKO_TICKET) || !defined(MKO_INV_FREQ) || !defined(MKO_Q_NORM) || !defined(MKO_K_NORM) || \
    !defined(MKO_ROPE_DIM) || !defined(MKO_NEOX) || !defined(MKO_N_HEAD) || !defined(MKO_N_HEAD_KV) || \
    !defined(MKO_HEAD_DIM) || !defined(MKO_SCALE) || !defined(MKO_MSCALE) || !defined(MKM_W) || \
    !defined(MKM_NBLK) || !defined(MKM_TYPE) || !defined(MKM_N_IN) || !defined(MKM_Y) || \
    !defined(MKM_RESIDUAL) || !defined(MKM_BIAS) || !defined(MKM_GLU) || !defined(MK_TYPE_Q4_K) || \
    !defined(MK_TYPE_Q5_K) || !defined(MK_TYPE_Q6_K) || !defined(MK_TYPE_Q8_0)
#error "the megakernel constants (MK_*, MKO_*, MKM_*) come from runtime/cuda/constants.py"
#endif

static_assert(MMA_THREADS == 32 * MMA_WARPS && MMA_BQ == 16 * MMA_WARPS, "attn_mma: 32 threads and 16 query rows per warp");
static_assert(GQA_THREADS == 32 * GQA_WARPS, "attn_gqa: 32 threads per warp");
static_assert(ST_TOK < STATE_WORDS && ST_POS < STATE_WORDS && ST_RING < STATE_WORDS && ST_DRAW < STATE_WORDS,
              "the decode state holds every ST_* word");

