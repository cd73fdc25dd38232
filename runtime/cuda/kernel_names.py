"""The kernels of kernels_cu's non-matmul files that runtime/cuda/ops.py launches, by name as
written in the .cu sources (template instances and extern "C" names alike), and the compile
groups they build in. Importable without CuPy: the nvcc compile check (tests) instantiates
exactly these names, so the .cu files keep no list of their own.
"""

from __future__ import annotations

TILED_HEAD_DIMS = (64, 128, 256)  # head_dim instances of attn_tiled
MMA_TILE_KEYS = {64: 64, 128: 64, 256: 32}  # head_dim -> keys per shared-memory tile of its attn_mma instance
GQA_TILE_KEYS = {64: 64, 128: 64, 256: 64}  # head_dim -> keys per tile of its attn_gqa instance (16 per warp)
SHORT_HEAD_DIMS = (64, 128, 256)  # head_dim instances of attn_short (attention_short.cu: 128 dims of a key a thread)

# the decoder structs of kernels_cu/decoders.cuh (quant_types.QUANT and FLOAT name the same): the
# instances of moe.cu's expert products, one compile group each
MOE_QUANT_DECODERS = ("type_q4_K", "type_q5_K", "type_q6_K", "type_q8_0", "type_q5_0", "type_q5_1", "type_q2_K",
                      "type_q3_K", "type_q4_0", "type_iq4_xs", "type_iq4_nl")
MOE_FLOAT_DECODERS = ("type_f32", "type_f16", "type_bf16")
# moe_gemv.cu moe_gemv_q8's (WARPS, U, PF) per decoder: warps per block, chunks in flight per lane,
# next chunks loaded during the dots. Not yet measured on expert shapes (scripts/bench_moe.py
# times them): gemv_q8's choices for the dense products (quant_types.QUANT gemv), except Q6_K
# (16, 1, 1), as (16, 2, 1) spills 12 bytes with the slot loop (ptxas, sm_90) and rows of up
# to 2048 weights (Qwen3-30B-A3B's experts) fill one chunk per lane anyway.
MOE_Q8_VARIANTS = {"type_q4_K": (16, 2, 1), "type_q5_K": (32, 1, 0), "type_q6_K": (16, 1, 1), "type_q8_0": (32, 4, 0),
                   "type_q5_0": (32, 4, 0), "type_q5_1": (32, 4, 0), "type_q2_K": (16, 2, 1), "type_q3_K": (16, 2, 1),
                   "type_q4_0": (32, 4, 0), "type_iq4_xs": (16, 2, 1), "type_iq4_nl": (32, 4, 0)}
# the SwiGLU instances' where they differ: with the up row's chunks these spill (ptxas, sm_90: Q8_0
# 36 bytes, Q3_K 8), so gemv_q8's GLU choices (quant_types.QUANT glu)
MOE_Q8_GLU_VARIANTS = {**MOE_Q8_VARIANTS, "type_q8_0": (32, 2, 0), "type_q3_K": (32, 1, 0)}


def moe_q8_name(decoder: str, glu: bool = False) -> str:
    """The moe_gemv.cu instance for expert tensors of a decoders.cuh decoder, with the SwiGLU
    epilogue (gate and up experts in one launch) or without: "moe_gemv_q8<type_q4_K, 16, 2, true, false>"."""
    warps, u, pf = (MOE_Q8_GLU_VARIANTS if glu else MOE_Q8_VARIANTS)[decoder]
    b = lambda v: "true" if v else "false"  # noqa: E731
    return f"moe_gemv_q8<{decoder}, {warps}, {u}, {b(pf)}, {b(glu)}>"


# moe_down.cu moe_down_combine's (WARPS, U): decode's down product of the k chosen experts with
# their weighted sum. U chunks in flight per lane of a group of 32 / k lanes: Qwen3-30B-A3B's rows
# of 768 weights are 12 chunks, 3 per lane of its groups of 4 (k = 8). 8 warps: Q6_K's wide
# unaligned loads need about 140 registers, past the 128 of 16-warp blocks.
MOE_DOWN_VARIANT = (8, 4)


def moe_down_name(decoder: str) -> str:
    """The moe_down.cu moe_down_combine instance for down experts of a decoders.cuh decoder."""
    warps, u = MOE_DOWN_VARIANT
    return f"moe_down_combine<{decoder}, {warps}, {u}>"


# moe_one.cu moe_one (decode's expert feed-forward in one launch): the (gate/up, down) decoder pairs
# it is built for, Q4_K_M's and Q6_K's, and per down decoder (DU, EARLY): its down rows' chunks in
# flight per lane (3: a row of 768 weights in one round; 4 spilled with Q6_K), and whether a warp
# loads its first down row before its block's flag goes out (Q4_K: measured faster) or after (raw
# Q6_K's loads stall the warp; before, they held the flag back: PERF.md session 23). Experts stored
# planar (constants.QuantLayout.expert_planar: Q6_K unless K4_PLANAR_EXPERTS=0) load before it
# whatever the flag says (moe_one.cu). The block is the
# SwiGLU launch's (MOE_Q8_GLU_VARIANTS: 16 warps for these), so the RMSNorm's block sums, and x's
# 8 bits, are that launch's.
MOE_ONE_PAIRS = (("type_q4_K", "type_q4_K"), ("type_q4_K", "type_q6_K"), ("type_q6_K", "type_q6_K"))
MOE_ONE_DOWN = {"type_q4_K": (3, True), "type_q6_K": (3, False)}


def moe_one_name(gate: str, down: str) -> str:
    """The moe_one.cu instance for gate/up experts of decoder gate and down experts of decoder down."""
    warps, u, pf = MOE_Q8_GLU_VARIANTS[gate]
    du, early = MOE_ONE_DOWN[down]
    b = lambda v: "true" if v else "false"  # noqa: E731
    return f"moe_one<{gate}, {down}, {warps}, {u}, {b(pf)}, {du}, {b(early)}>"


# moe_grouped.cu moe_gemv_grouped (prefill's experts grouped by expert): (WARPS, U) and the slots
# per work item (NT). Measured on the H200 (Qwen3-30B-A3B pp512, t/s): (8, 4) 6,196, (16, 4) 6,424,
# (4, 4) 6,381, (8, 8) 5,572, (8, 2) 5,235; NT 16 with (8, 4) 5,638 (fewer weight reads, more
# registers); two rows per lane group sharing each x load, (8, 2) 4,536. (4, 4) and (16, 4) are
# within 4% of (8, 4), but (4, 4) spills in Q5_1's SwiGLU instance (ptxas, sm_90) and (16, 4)'s
# 512 threads cap registers at 128 (Q5_K and Q6_K use about 160); (8, 4) spills in none.
MOE_GROUPED_VARIANT = (8, 4)
MOE_GROUP_TOKENS = 8


def moe_grouped_name(decoder: str, glu: bool = False) -> str:
    """The moe_grouped.cu moe_gemv_grouped instance for expert tensors of a decoders.cuh decoder."""
    warps, u = MOE_GROUPED_VARIANT
    return f"moe_gemv_grouped<{decoder}, {warps}, {u}, {MOE_GROUP_TOKENS}, {'true' if glu else 'false'}>"


# the KV cache's element types (runtime/kv_types.py CACHE_TYPES) -> their kernels_cu/kv_cache.cuh structs
KV_STRUCTS = {"f16": "kv_f16", "q8_0": "kv_q8_0"}
KV_PAIRS = tuple((k, v) for k in KV_STRUCTS for v in KV_STRUCTS)  # (key type, value type)


def kv_args(k: str, v: str) -> str:
    """The template arguments of the kernels over a cache of key type k and value type v
    ("f16" or "q8_0"): "kv_f16, kv_q8_0"."""
    return f"{KV_STRUCTS[k]}, {KV_STRUCTS[v]}"


def attn_kv_name(k: str, v: str, deep: bool = False) -> str:
    """The attention.cu instance over a cache of key type k and value type v; deep: the one held to
    eight blocks a multiprocessor, for decode ranges of more than GQA_MIN_LIMIT keys (attention.cu
    DEEP, with its measurements)."""
    return f"attn_kv<{kv_args(k, v)}, {'true' if deep else 'false'}>"


def gqa_stages(k: str, v: str) -> int:
    """Tiles attn_gqa keeps in flight per block over a cache of key type k and value type v: 3
    with fp16 keys and values, 2 with a q8_0 plane (whose block then takes about 76 KB of shared
    memory at head_dim 128; constants.gqa_smem). Measured on the H200 (8 KV heads of 128, one
    query; µs at 32,768 / 131,072 keys): fp16 S = 2 44.7 / 143.4, S = 3 44.3 / 143.1; q8_0 S = 2
    46.9 / 127.5, S = 3 45.0 / 139.5, S = 4 45.5 / 140.6. The tiles' processing, not the loads
    in flight, bounds the kernel there."""
    return 3 if k == v == "f16" else 2


GQA_COLS_GROUP = 8  # attn_gqa: groups of up to this many query heads run with them as the mma's columns (gqa_cols.cuh)


def gqa_int8_keys(k: str, group: int, int8: bool = True) -> bool:
    """Whether attn_gqa reads keys of type k by int8 mma (its I8K instance: the query quantized to
    8 bits per 32 dims) for `group` query heads per KV head: with `int8` (K4_GQA_INT8), q8_0 keys,
    the column instance."""
    return int8 and k == "q8_0" and group <= GQA_COLS_GROUP


def gqa_name(D: int, k: str, v: str, group: int = GQA_COLS_GROUP, int8: bool = True) -> str:
    """The attention_gqa.cu instance for head_dim D over a cache of key type k, value type v, for
    `group` query heads per KV head (the query heads as the mma's columns up to GQA_COLS_GROUP,
    as its rows above; q8_0 keys by int8 mma with `int8`, gqa_int8_keys)."""
    cols = "true" if group <= GQA_COLS_GROUP else "false"
    i8 = "true" if gqa_int8_keys(k, group, int8) else "false"
    return f"attn_gqa<{D}, {GQA_TILE_KEYS[D]}, {gqa_stages(k, v)}, {kv_args(k, v)}, {cols}, {i8}>"


# name expressions of the kernels of each file (templates and extern "C" names alike)
KERNELS = {
    "norm.cu": ("rms_norm<float>", "rms_norm<u16>", "rms_norm_add", "rms_norm_q8"),
    "rope.cu": tuple(f"rope_qk_store<{kv_args(k, v)}>" for k, v in KV_PAIRS),
    "attention.cu": tuple(attn_kv_name(k, v, deep) for k, v in KV_PAIRS for deep in (False, True)),
    "attention_short.cu": tuple(f"attn_short<{d}>" for d in SHORT_HEAD_DIMS),
    "attention_tiled.cu": tuple(f"attn_tiled<{d}, {kv_args(k, v)}>" for d in TILED_HEAD_DIMS for k, v in KV_PAIRS),
    "attention_mma.cu": tuple(f"attn_mma<{d}, {bk}, {kv_args(k, v)}>" for d, bk in MMA_TILE_KEYS.items() for k, v in KV_PAIRS),
    "attention_gqa.cu": tuple(dict.fromkeys(gqa_name(d, k, v, g, i8) for d in GQA_TILE_KEYS for k, v in KV_PAIRS
                                            for g in (GQA_COLS_GROUP, 16) for i8 in (True, False))),
    "elementwise.cu": ("swiglu<float>", "swiglu<u16>", "geglu<float>", "geglu<u16>", "softcap_f32", "set_i32"),
    "sampling.cu": ("sample_argmax_partial", "sample_finish"),
    "speculative.cu": ("spec_argmax", "spec_accept"),
    "moe.cu": ("moe_topk", "moe_combine", *(f"moe_gemv_q<{d}>" for d in MOE_QUANT_DECODERS),
               *(f"moe_gemv_f<{d}>" for d in MOE_FLOAT_DECODERS), *(f"moe_router<{d}>" for d in MOE_FLOAT_DECODERS)),
    "moe_grouped.cu": ("moe_group", *(moe_grouped_name(d, glu) for d in MOE_QUANT_DECODERS for glu in (False, True))),
    "moe_gemv.cu": tuple(moe_q8_name(d, glu) for d in MOE_QUANT_DECODERS for glu in (False, True)),
    "moe_down.cu": tuple(moe_down_name(d) for d in MOE_QUANT_DECODERS),
    "moe_one.cu": tuple(moe_one_name(g, d) for g, d in MOE_ONE_PAIRS),
    "megakernel.cu": ("megakernel",),
}
# Compile groups: one module per group, so a model compiles only the attention and RoPE-store
# kernels of its head_dim and KV cache types; the other small files are one group each.
GROUPS: dict[str, tuple[tuple[str, ...], ...]] = {
    f: tuple((n,) for n in names) if f.startswith(("attention", "moe", "rope")) else (names,) for f, names in KERNELS.items()}
GROUP_OF = {(f, name): group for f, groups in GROUPS.items() for group in groups for name in group}
FILE_OF = {name: f for f, names in KERNELS.items() for name in names}  # kernel -> its .cu file
