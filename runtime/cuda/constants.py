"""Every number the CUDA kernels (kernels_cu/) and their Python launchers must agree on, defined
once, here. runtime/cuda/compile.py hands defines() to NVRTC as -D options for every module (and
tests/test_kernels_compile.py to nvcc); kernels_cu/constants.cuh stops the compile when one is
missing and checks the rest against the kernels' own structs and size formulas (static_assert),
so a drift fails to compile instead of corrupting results. Importable without CuPy.

Sources: block sizes and weights per block from the gguf package (GGML_QUANT_SIZES, ggml's
ggml-common.h); the planar groups are ggml-common.h field offsets of each block struct.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import IQ4_NL

from .kernel_names import GQA_TILE_KEYS, KV_PAIRS, MMA_TILE_KEYS, SHORT_HEAD_DIMS, gqa_stages

# ---- attention.cu ------------------------------------------------------------------------------
ATT_THREADS = 128  # threads per block of attn_kv (decode and fallback prefill attention)
ATT_BLOCKS, ATT_BLOCKS_DEEP = 7, 8  # attn_kv's launch bounds (blocks a multiprocessor): its short and deep instances
ATT_CHUNK = 128  # keys per chunk of attn_kv's online softmax
ATT_MAX_SPLIT = 64  # most splits of decode attention (split_merge.cuh merges them two per lane)
MERGE_SLICE = 32  # outputs of a shared merge's slice (split_merge.cuh merge_slice: a lane each; attention_launch.merge_helpers)
TILE_Q, TILE_K, TILE_THREADS = 32, 64, 128  # attn_tiled: queries and keys per tile, threads per block
TILE_PS = TILE_K + 16  # attn_tiled's row stride of probabilities (floats): the two half-warps hit other banks
MMA_WARPS = 4  # attn_mma: warps per block, 16 query rows each
MMA_THREADS = 32 * MMA_WARPS
MMA_BQ = 16 * MMA_WARPS  # attn_mma: queries per block
GQA_WARPS = 4  # attn_gqa: warps per block, 16 keys of each tile each (GQA_TILE_KEYS = 16 * GQA_WARPS)
GQA_THREADS = 32 * GQA_WARPS
SHORT_THREADS = 128  # attn_short (attention_short.cu): threads per block, one block per query head
SHORT_DIMS = 16384  # attn_short: keys x head_dim one block holds in shared memory (128 keys of 128)

# ---- sampling.cu -------------------------------------------------------------------------------
SAMPLE_THREADS = 1024  # threads of sample_finish (one block)
SAMPLE_CAP = 1024  # candidates kept after top-k
ARGMAX_PARTS = 8192  # argmax partials sample_finish can take: the output head's, one a warp (K4_HEAD_ARGMAX)
SAMPLER_PARAM_WORDS = 8  # 8-byte words of sampling.cu SamplerParams (ops.pack_sampler_params)
STATE_WORDS = 4  # int32 words of the decode state
ST_TOK, ST_POS, ST_RING, ST_DRAW = range(STATE_WORDS)  # token, its position, ring count, draws made


# ---- gemv.cu gemv_q8 ---------------------------------------------------------------------------
# The most warps of a gemv_q8 block that folds the RMSNorm's scale into its outputs (one pass over
# x: norm_prologue.cuh quantize_x_unscaled; q8_handoff.folds_norm). The 32-warp instances, at 64
# registers, keep two passes: the 7B's wide NQ output product spilled 28 bytes with both (session 47).
# The 20-warp q/k/v instances (QKV_WARPS) fold it, at 78-80 registers without spills.
FOLD_MAX_WARPS = 20

# The q/k/v products of few rows (gemv_choice.qkv_variant, flag K4_QKV_WIDE) run blocks of QKV_WARPS
# warps: one round of rows fewer than 16 warps' grid on the H200 (Qwen2.5 7B's 4,608 rows: 3 -> 2,
# TinyLlama's 2,560: 2 -> 1). Capped at QKV_REGS, the registers that leave attn_short's block (the
# launch after them, SHORT_THREADS x SHORT_REGS) room beside them (80 at 20 warps).
QKV_WARPS = 20

# ---- gemv.cu gemv_q8_pair ----------------------------------------------------------------------
# Its register cap. A decode product launches the attention after it early (programmatic dependent
# launch) only where the multiprocessor has registers left beside the product's 512-thread block.
# One of attn_kv's short blocks (at most 72 registers by its launch bound; at short range a step's
# attention has fewer blocks than there are multiprocessors) needs the pair at 110 or fewer,
# allocated in 8s: 104. Uncapped it took 116, and attention started only as its blocks left
# (Llama 2 7B: 8.3-9.0 against 5.5 µs a layer, docs/PERF.md session 17). attn_gqa's blocks (120 x 128)
# do not fit beside it (NVRTC gave the pair 99, allocated 104); a cap of 96 lets them in only where
# every kernel asks for one shared-memory split, and that costs more than it gains (session 20).
PAIR_THREADS = 512
PAIR_REGS = (65536 - ATT_THREADS * (65536 // (ATT_BLOCKS * ATT_THREADS) // 8 * 8)) // PAIR_THREADS // 8 * 8
# attn_short's register cap (attention_short.cu): its block fits beside the pair's, in the registers
# PAIR_REGS leaves (96).
SHORT_REGS = (65536 - PAIR_THREADS * PAIR_REGS) // SHORT_THREADS // 8 * 8
QKV_REGS = (65536 - SHORT_THREADS * SHORT_REGS) // (32 * QKV_WARPS) // 8 * 8


# ---- gemv_mma.cu -------------------------------------------------------------------------------
MMA8_TOKENS = 8  # tokens per gemv_mma launch: the n of its mma.sync shapes (m16n8k32, m16n8k16)
MMA8_STAGE_BYTES = 16 * 144  # gemv_mma_staged.cu: one Q4_K ring stage, 16 rows of one block_q4_K
MMA8_STAGE_BYTES_Q6_K = 16 * 208 + 16 * 16  # one Q6_K stage: 16 rows' ql, qh, scales, then their d chunks
MMA8_NQ_RUN = 17  # an NQ product's copy of a step's Y (mma8_step_nq): floats per run of 16 values (padded: no bank conflicts)


# ---- megakernel.cu (runtime/cuda/megakernel.py) ------------------------------------------------
MK_THREADS = 512  # threads of the persistent decode kernel's blocks (one per multiprocessor)
MK_SLOTS = 3  # weight tiles in flight per block (the shared-memory ring; 3 of ~54 KB beat 4 of ~37 KB, docs/PERF.md)
MK_SPLIT_KEYS = 256  # most keys of one attention work item (scores kept in shared memory)
MK_SPLIT_MIN = 128  # keys per attention work item below which a step takes fewer items
MK_MAX_SPLIT = 16  # most items per KV head: positions below MK_SPLIT_KEYS * MK_MAX_SPLIT
MK_MAX_GROUP, MK_MAX_D, MK_MAX_GD = 8, 256, 2048  # query heads per KV head, head_dim, their product
MK_GEMV, MK_ATTN = 0, 1  # instruction kinds
# fields of an instruction (int64 words; float values as their 32-bit patterns)
MK_OP_FIELDS = ("kind", "x", "norm", "n_in", "eps", "q", "k", "v", "k_cache", "v_cache", "out", "part", "ticket",
                "inv_freq", "q_norm", "k_norm", "rope_dim", "neox", "n_head", "n_head_kv", "head_dim", "scale", "mscale")
MK_MAT_FIELDS = ("w", "nblk", "type", "n_in", "y", "residual", "bias", "glu")  # a matrix of a product
MK_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0)  # the weight types it multiplies (planar layout)
MK_ATTN_SCRATCH_FLOATS = MK_MAX_GD + 2 * MK_MAX_D + MK_MAX_GROUP * MK_SPLIT_KEYS + 2 * MK_MAX_GROUP


# ---- quantized weights (common.cuh) ------------------------------------------------------------
@dataclass(frozen=True)
class QuantLayout:
    """What the kernels of one quantized ggml type and the host agree on.

    groups: byte offsets cutting a block into the planes of the planar layout (ggml-common.h
            field offsets; the last one is the block size): common.cuh T::cut.
    x_swizzle: the rotation of its q8 x units (common.cuh x_unit_slot): T::x_swizzle.
    handoff: its SwiGLU gemv instance can also write its output as a q8 x (gemv y_q8): T::handoff.
    expert_planar: its stacked expert tensors go to the device in the planar layout, expert by
            expert (layout.expert_layout), unless K4_PLANAR_EXPERTS=0: T::expert_planar. For types
            whose raw blocks are not 16-byte aligned, where a raw load shifts two wide words as
            they land and so stalls the warp that issues it (docs/PERF.md, session 33).
    """

    groups: tuple[int, ...]
    x_swizzle: int = 1
    handoff: bool = True
    expert_planar: bool = False


QUANT_LAYOUTS: dict[T, QuantLayout] = {
    T.Q4_K: QuantLayout((0, 16, 144)),                        # d dmin scales | qs
    T.Q5_K: QuantLayout((0, 16, 48, 176)),                    # d dmin scales | qh | qs
    T.Q6_K: QuantLayout((0, 128, 192, 208, 210), x_swizzle=2, expert_planar=True),  # ql | qh | scales | d
    T.Q8_0: QuantLayout((0, 2, 34)),                          # d | qs
    T.Q5_0: QuantLayout((0, 2, 6, 22), handoff=False),        # d | qh | qs
    T.Q5_1: QuantLayout((0, 2, 4, 8, 24), handoff=False),     # d | m | qh | qs
    T.Q2_K: QuantLayout((0, 16, 80, 84), x_swizzle=2, handoff=False),        # scales | qs | d dmin
    T.Q3_K: QuantLayout((0, 32, 96, 108, 110), x_swizzle=2, handoff=False),  # hmask | qs | scales | d
    T.Q4_0: QuantLayout((0, 2, 18), handoff=False),                          # d | qs
    T.IQ4_XS: QuantLayout((0, 8, 136), handoff=False),                       # d scales_h scales_l | qs
    T.IQ4_NL: QuantLayout((0, 2, 18), handoff=False),                        # d | qs
}
# IQ4_XS's and IQ4_NL's 16 dequantized values (ggml-common.h kvalues_iq4nl, the gguf package's
# IQ4_NL.kvalues): kernels_cu/decoders_lowbit.cuh builds its lookup table from them (K4_IQ4NL_VALUES).
IQ4NL_VALUES: tuple[int, ...] = tuple(int(v) for v in IQ4_NL.kvalues)


# ---- sizes both sides compute (checked at compile time, constants.cuh) -------------------------
def _round16(n: int) -> int:
    return (n + 15) & ~15


def q8x_offsets(n: int) -> tuple[int, int, int]:
    """Layout of n values quantized as gemv_q8 multiplies them (gemv.cu q8x_*), in bytes:
    (offset of d, offset of s, total). int8 units of 16 values padded to 128 bytes, then d, one
    float32 per 32 values padded to 16 bytes, then s, d * the unit's sum of quants per 16 values;
    the whole padded to 16 bytes."""
    d_off = ((n // 16 + 7) & ~7) * 16
    s_off = d_off + _round16(4 * (n // 32))
    return d_off, s_off, _round16(s_off + 4 * (n // 16))


def q8x_bytes(n: int) -> int:
    """Bytes of a q8 x of n values (q8x_offsets)."""
    return q8x_offsets(n)[2]


def att_smem(D: int) -> int:
    """Dynamic shared memory (bytes) of attn_kv for head_dim D: the query and the scores of a
    chunk, ATT_THREADS * 8 accumulators (floats), the fresh key and value in the cache's form
    (fp16: 4 D bytes; q8_0 quants and scales take less)."""
    return 4 * (D + ATT_CHUNK + ATT_THREADS * 8) + 2 * 2 * D


def short_keys(D: int) -> int:
    """The most keys attn_short<D> attends (its block holds them all in shared memory)."""
    return SHORT_DIMS // D


def short_smem(D: int) -> int:
    """Dynamic shared memory (bytes) of attn_short<D>: the keys and values it holds (fp16,
    short_keys(D) rows each), the query and the RoPE table (D floats each), the probabilities (a
    float per key), the values' partial sums (a row of D floats per warp), the token's key and
    value (fp16)."""
    return 2 * 2 * SHORT_DIMS + 4 * 2 * D + 4 * short_keys(D) + 4 * (SHORT_THREADS // 32) * D + 2 * 2 * D


def tiled_smem(D: int) -> int:
    """Dynamic shared memory (bytes) of attn_tiled<D, KT, VT>: query and key tiles in rows of
    D + 4 floats, the value tile, the probabilities in rows of TILE_PS floats."""
    return 4 * (TILE_Q * (D + 4) + TILE_K * (D + 4) + TILE_K * D + TILE_Q * TILE_PS)


def mma_smem(D: int, BK: int) -> int:
    """Dynamic shared memory (bytes) of attn_mma<D, BK, KT, VT>: the fp16 Q tile for D > 128,
    two K and two V tiles of BK keys (fp16 whatever the cache type), rows of D + 8 halves."""
    return 2 * (D + 8) * ((0 if D <= 128 else MMA_BQ) + 4 * BK)


def gqa_plane_bytes(D: int, BK: int, S: int, scaled: bool, i8: bool = False) -> int:
    """Shared memory (bytes) of one plane of attn_gqa: S fp16 tiles of BK keys (rows of D + 8
    halves), or for a q8_0 plane S raw tiles (BK rows of D int8 quants, then their fp16 scales,
    padded to 16 bytes) and one fp16 tile; i8 (keys read by int8 mma): the raw tiles only, rows
    of D + 16 bytes."""
    if scaled:
        row = D + 16 if i8 else D
        return S * ((BK * row + BK * (D // 32) * 2 + 15) // 16 * 16) + (0 if i8 else BK * 2 * (D + 8))
    return S * BK * 2 * (D + 8)


def gqa_smem(D: int, BK: int, S: int, k_scaled: bool, v_scaled: bool, k_i8: bool = False) -> int:
    """Dynamic shared memory (bytes) of attn_gqa<D, BK, S, KT, VT, COLS, I8K = k_i8>: 16 fp16
    query rows of D + 8 halves, the key and value planes (gqa_plane_bytes), a row of D floats per
    warp, the fresh key and value (2 D bytes each at most) and their q8_0 scales."""
    planes = gqa_plane_bytes(D, BK, S, k_scaled, k_i8) + gqa_plane_bytes(D, BK, S, v_scaled)
    return 2 * (D + 8) * 16 + planes + 4 * GQA_WARPS * D + 4 * D + D // 8


def mma8_smem(n_in: int, warps: int) -> int:
    """Dynamic shared memory (bytes) of gemv_mma<M, PLANAR, warps, ...> for rows of n_in inputs:
    per 32 inputs the MMA8_TOKENS tokens' int8 quants (32 bytes each) and their scale, sum and
    two half sums (16 bytes each), then two buffers of the warps' partial sums (a float4 per lane)."""
    return (n_in // 32) * MMA8_TOKENS * (32 + 16) + 2 * warps * 32 * 16


def mma8_lay_in(n_in: int, cl: int = 1) -> int:
    """Inputs of the x layout one block of gemv_mma_staged<..., cl> holds: its 1 / cl of each row's
    256-input blocks, rounded up (kernels_cu/gemv_mma_staged.cu nblk_lay, in inputs)."""
    return 256 * -(-(n_in // 256) // cl)


def mma8_staged_smem(n_in: int, warps: int, stages: int, stage_bytes: int, cl: int = 1) -> int:
    """Dynamic shared memory (bytes) of gemv_mma_staged<D, PLANAR, warps, ..., cl> with `stages`
    ring stages per warp of stage_bytes each (MMA8_STAGE_BYTES for Q4_K, MMA8_STAGE_BYTES_Q6_K):
    mma8_smem's x (of a block's 1 / cl of each row's 256-input blocks, rounded up) and partial
    sums (cl sets of them), then each warp's ring."""
    return mma8_smem(mma8_lay_in(n_in, cl), warps) + (cl - 1) * 2 * warps * 32 * 16 + warps * stages * stage_bytes


# arguments the size checks are evaluated at: the compiled instances and common model shapes
_CHECK_HEAD_DIMS = (64, 80, 96, 128, 256)
_CHECK_MMA = (*MMA_TILE_KEYS.items(), (128, 32))
_CHECK_Q8X_N = (32, 256, 2048, 4096, 5632, 11008, 14336, 18944)
_CHECK_MMA8 = ((256, 8), (4096, 8), (11008, 8), (14336, 16))  # (n_in, warps)


def _list(values) -> str:
    """A list of integers as a define value: "(0)K4_C(16)K4_C(144)", where constants.cuh defines
    K4_C as a comma (nvcc splits -D values at commas; NVRTC and nvcc then read the same text)."""
    return "K4_C".join(f"({v})" for v in values)


def _ggml(t: T) -> tuple[int, int]:
    return GGML_QUANT_SIZES[t]  # (weights per block, bytes per block)


# kernels_cu/moe.cu: warps per block of the expert products (one row per warp at a time), and the
# most experts a token may use (moe_topk keeps their weights in shared memory)
MOE_WARPS = 8
MOE_MAX_K = 64
# moe.cu moe_router's threads per block (a block per expert), the stride of its sums; moe_one.cu's
# router phase sums with the same stride so that its logits are moe_router's bits
ROUTER_THREADS = 256


def chunk_elems(t: T) -> int:
    """Weights of one chunk of quantized type t, a lane's unit of work in the matrix kernels
    (decoders.cuh T::chunk_elems, given as K4_CHUNK_<type>): 64, or the block when it is smaller."""
    return min(64, _ggml(t)[0])


def defines() -> tuple[str, ...]:
    """The -D options' values ("NAME=value") every kernels_cu module is compiled with: the
    constants above, each quantized type's weights and bytes per block (K4_QK_<type>,
    K4_BLOCK_BYTES_<type>), weights per chunk (K4_CHUNK_<type>), planar groups (K4_GROUPS_<type>, a comma list), x_swizzle and
    handoff, the IQ4 value table (K4_IQ4NL_VALUES), and tables of sizes computed here that
    constants.cuh compares with the kernels' formulas (K4_CHECK_*: flat lists of arguments, each
    followed by the result; lists as _list)."""
    out = [f"{name}={value}" for name, value in (
        ("ATT_THREADS", ATT_THREADS), ("ATT_BLOCKS", ATT_BLOCKS), ("ATT_BLOCKS_DEEP", ATT_BLOCKS_DEEP), ("PAIR_REGS", PAIR_REGS),
        ("PAIR_THREADS", PAIR_THREADS), ("FOLD_MAX_WARPS", FOLD_MAX_WARPS), ("ATT_CHUNK", ATT_CHUNK), ("ATT_MAX_SPLIT", ATT_MAX_SPLIT),
        ("QKV_WARPS", QKV_WARPS), ("QKV_REGS", QKV_REGS),
        ("MERGE_SLICE", MERGE_SLICE), ("TILE_Q", TILE_Q), ("TILE_K", TILE_K),
        ("TILE_THREADS", TILE_THREADS), ("TILE_PS", TILE_PS), ("MMA_WARPS", MMA_WARPS), ("MMA_THREADS", MMA_THREADS),
        ("MMA_BQ", MMA_BQ), ("GQA_WARPS", GQA_WARPS), ("GQA_THREADS", GQA_THREADS), ("SHORT_THREADS", SHORT_THREADS),
        ("SHORT_DIMS", SHORT_DIMS), ("SHORT_REGS", SHORT_REGS), ("SAMPLE_THREADS", SAMPLE_THREADS), ("SAMPLE_CAP", SAMPLE_CAP),
        ("SAMPLER_PARAM_WORDS", SAMPLER_PARAM_WORDS), ("STATE_WORDS", STATE_WORDS), ("ST_TOK", ST_TOK),
        ("ST_POS", ST_POS), ("ST_RING", ST_RING), ("ST_DRAW", ST_DRAW), ("MOE_WARPS", MOE_WARPS),
        ("MOE_MAX_K", MOE_MAX_K), ("ROUTER_THREADS", ROUTER_THREADS), ("MMA8_TOKENS", MMA8_TOKENS),
        ("MMA8_STAGE_BYTES", MMA8_STAGE_BYTES), ("MMA8_STAGE_BYTES_Q6_K", MMA8_STAGE_BYTES_Q6_K),
        ("MMA8_NQ_RUN", MMA8_NQ_RUN),
        ("MK_THREADS", MK_THREADS), ("MK_SLOTS", MK_SLOTS), ("MK_SPLIT_KEYS", MK_SPLIT_KEYS), ("MK_SPLIT_MIN", MK_SPLIT_MIN),
        ("MK_MAX_SPLIT", MK_MAX_SPLIT),
        ("MK_MAX_GROUP", MK_MAX_GROUP), ("MK_MAX_D", MK_MAX_D), ("MK_MAX_GD", MK_MAX_GD), ("MK_GEMV", MK_GEMV),
        ("MK_ATTN", MK_ATTN), ("MK_OP_WORDS", len(MK_OP_FIELDS)), ("MK_MAT_WORDS", len(MK_MAT_FIELDS)),
        ("MK_ATTN_SCRATCH_FLOATS", MK_ATTN_SCRATCH_FLOATS))]
    out += [f"MKO_{name.upper()}={i}" for i, name in enumerate(MK_OP_FIELDS)]
    out += [f"MKM_{name.upper()}={i}" for i, name in enumerate(MK_MAT_FIELDS)]
    out += [f"MK_TYPE_{t.name}={int(t)}" for t in MK_TYPES]
    for t, q in QUANT_LAYOUTS.items():
        elems, nbytes = _ggml(t)
        out += [f"K4_QK_{t.name}={elems}", f"K4_BLOCK_BYTES_{t.name}={nbytes}", f"K4_CHUNK_{t.name}={chunk_elems(t)}",
                f"K4_GROUPS_{t.name}={_list(q.groups)}", f"K4_X_SWIZZLE_{t.name}={q.x_swizzle}",
                f"K4_HANDOFF_{t.name}={int(q.handoff)}", f"K4_EXPERT_PLANAR_{t.name}={int(q.expert_planar)}"]
    tables = {
        "K4_CHECK_Q8X": [v for n in _CHECK_Q8X_N for v in (n, *q8x_offsets(n))],
        "K4_CHECK_ATT_SMEM": [v for d in _CHECK_HEAD_DIMS for v in (d, att_smem(d))],
        "K4_CHECK_TILED_SMEM": [v for d in _CHECK_HEAD_DIMS for v in (d, tiled_smem(d))],
        "K4_CHECK_SHORT_SMEM": [v for d in SHORT_HEAD_DIMS for v in (d, short_smem(d))],
        "K4_CHECK_MMA_SMEM": [v for d, bk in _CHECK_MMA for v in (d, bk, mma_smem(d, bk))],
        "K4_CHECK_GQA_SMEM": [v for d, bk in GQA_TILE_KEYS.items() for k, vt in KV_PAIRS
                              for i8 in ((False, True) if k == "q8_0" else (False,))
                              for v in (d, bk, gqa_stages(k, vt), int(k == "q8_0"), int(vt == "q8_0"), int(i8),
                                        gqa_smem(d, bk, gqa_stages(k, vt), k == "q8_0", vt == "q8_0", i8))],
        "K4_CHECK_MMA8_SMEM": [v for n, w in _CHECK_MMA8 for v in (n, w, mma8_smem(n, w))],
    }
    out += [f"{name}={_list(values)}" for name, values in tables.items()]
    out.append(f"K4_IQ4NL_VALUES={_list(IQ4NL_VALUES)}")
    return tuple(out)
