"""Which gemv_q8 instance a one-token product launches: the variant (WARPS, U, PF) of a matrix's
shape (gemv_variant, after_attention_variant, qkv_variant), thread-block clusters for a long x
(gemv_cluster), the NQ handoff to the next RMSNorm's products and its readers (nq_variants,
nq_balanced, nx_reads), and the type pairs gemv_q8_pair runs. Each rule states the H200
measurements that chose it. quant_kernels.py compiles exactly the instances these choose.
Importable without CuPy.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

from ..kquants import QK_K
from .constants import QKV_WARPS
from .quant_types import QUANT


# The gemv variant of a product without SwiGLU whose rows hold more than 16 QK_K blocks and 1 to 7
# over a multiple of 16 (ROW_BLOCKS_SLOW): there (16, 2, 1) runs at half to two thirds of its
# speed, whatever the row count. Measured on the H200 (bench_gemv, 8192 and 5120 rows, n_in 2,048
# to 28,672 in steps of 512, and the odd counts 17 to 53 blocks), Q4_K (16, 2, 1) against (32, 2,
# 0), TB/s: 4352 / 5120 / 5376 / 8960 / 17,920 inputs (17 / 20 / 21 / 35 / 70 blocks) 1.31 / 1.55 /
# 1.61 / 1.76 / 2.11 against 1.88 / 2.21 / 2.30 / 2.65 / 3.25; Q6_K alike. At 8 to 15 (and 0) over
# a multiple of 16, and at 16 blocks or fewer, (16, 2, 1) is the faster by 5-20%. A SwiGLU pair
# reads two rows per output and keeps its variant: Phi-4's 2 x 17920 x 5120 gate/up runs at 3.3 TB/s.
# With at most ROW_BLOCKS_FEW_ROWS rows (one a warp of (16, 2, 1)'s grid on the H200's 132
# multiprocessors) the default is the faster again: TinyLlama's down, 2048 x 5632 (22 blocks), Q4_K
# 4.42 µs against 4.79 for (32, 2, 0), Q6_K 5.55 against 5.87 (session 26; both give the same bits:
# the same U).
ROW_BLOCKS_SLOW = range(1, 8)
ROW_BLOCKS_FEW_ROWS = 132 * 16
ROW_BLOCKS_VARIANT: dict[T, tuple[int, int, int]] = {T.Q4_K: (32, 2, 0), T.Q6_K: (32, 2, 0)}
# The one-token output product right after decode attention, flag K4_WO_WIDE: nothing hides its
# arithmetic there, and ROW_BLOCKS_VARIANT's 32 warps without prefetch issue it faster than (16, 2,
# 1), with the same U, so the same bits. Measured on the H200 (tg128, in one process): Qwen2.5 7B
# (3,584 inputs) 686.4 against 679.6 (variants alternating, three rounds) and 679.1 / 681.9 against
# 677.4 / 675.7 (flag); Qwen3-30B-A3B (2,048 x 4,096) 760.5 against 743.7 (seven and six runs, every
# pair in the same direction). At TinyLlama's 2,048 inputs neither (32, 2, 0) nor (32, 1, 0) beat the
# default beyond the bench's order effect (docs/PERF.md, session 42), so it keeps it. Where the
# product hands the next RMSNorm its input (NQ: Llama 2 7B's 4,096 outputs; Qwen2.5 7B's 3,584, which
# nq_balanced admits only in 32-warp blocks) the variant's NQ instance runs (nq_variants): 721.4 /
# 721.3 against 718.4 / 720.2 with the flag off, Qwen2.5 7B +1.0-1.2% (session 43). Q4_K only: the
# other types were not measured (Q6_K's NQ instance of (32, 2, 0) spills 8 bytes).
AFTER_ATTENTION_TYPES = (T.Q4_K,)
AFTER_ATTENTION_MIN_IN = 2048  # inputs the product must exceed
# The one-token q/k/v product of one run (no gemv_q8_pair), flag K4_QKV_WIDE: blocks of QKV_WARPS
# (constants.py) warps where that takes a round of rows off 16 warps' grid and leaves at most
# QKV_MAX_ROUNDS (qkv_variant). Measured on the H200 (bench_gemv, x as floats, session 46): Qwen2.5
# 7B's 4,608 x 3,584 4.79 -> 4.57 µs (3 rounds -> 2), TinyLlama's 2,560 x 2,048 3.03 -> 2.81 (2 -> 1);
# where the rounds stay (4,096 x 4,096, 2) or are many (12,288 x 4,096, 6 -> 5) 0.1 µs slower. In a
# model (tg128, session 52): TinyLlama 2,214 -> 2,229-2,245 t/s, Qwen2.5 7B 682.5-684.6 -> 688.4-689.5,
# Qwen3-30B-A3B within its noise (761-771 either way); on by default since.
QKV_VARIANT: dict[T, tuple[int, int, int]] = {T.Q4_K: (QKV_WARPS, 2, 1)}
QKV_MAX_ROUNDS = 3


# Thread-block clusters for the gemv_q8 products that quantize a long x themselves without norm
# or post-norm (decode's down products): the X_CLUSTER blocks of a cluster each quantize a share of
# x and store it into every block's shared memory (gemv_common.cuh quantize_x_cluster), so each
# block reads 1 / X_CLUSTER of x from L2, where its reads queue behind the weight loads it issued
# before its wait. Measured on the H200 (docs/PERF.md, session 27): 4096 x 11008 Q4_K 9.44 ->
# 8.99 µs, 3584 x 18944 13.77 -> 12.98; but 2048 x 5632 4.47 -> 4.59 and 4096 x 4096 4.70 -> 4.80
# (the two cluster barriers cost more than the 22 or 16 KB of x save), and clusters of 4 took
# 60-70% longer. So clusters of 2, for n_in above X_CLUSTER_MIN_IN (x over 32 KB of floats), of the
# default variants of CLUSTER_TYPES (Q4_K_M's down products), in their own instances (gemv.cu
# CLUSTER): the cluster path in every instance took 6 more registers and TinyLlama, which never
# runs it, 1.2% (docs/PERF.md, session 27).
X_CLUSTER = 2
X_CLUSTER_MIN_IN = 8192
CLUSTER_TYPES = (T.Q4_K, T.Q6_K)


def gemv_cluster(t: T, n_out: int, n_in: int, variant: tuple[int, int, int]) -> int:
    """Blocks per thread-block cluster of a gemv_q8 launch (variant (WARPS, U, PF)) on a matrix
    of type t with n_out outputs that quantizes its own x of n_in values without norm or
    post-norm: X_CLUSTER past X_CLUSTER_MIN_IN inputs for QUANT[t].gemv of CLUSTER_TYPES (the
    instances compiled with CLUSTER) with at least two clusters' worth of outputs (the grid, at
    most one block an output, is cut to a multiple of the cluster), else 1 (no clusters)."""
    if n_in > X_CLUSTER_MIN_IN and n_out >= 2 * X_CLUSTER and t in CLUSTER_TYPES and variant == QUANT[t].gemv:
        return X_CLUSTER
    return 1


# The residual products that hand the next RMSNorm's products their input quantized (gemv.cu NQ,
# flag K4_NORM_Q8: decode's output and down products of llama-style layers): the default
# variants of NQ_TYPES, with and without clusters (CLUSTER_TYPES), in instances of their own.
NQ_TYPES = (T.Q4_K, T.Q6_K)


def gemv_variant(t: T, n_out: int, n_in: int, glu: bool = False) -> tuple[int, int, int]:
    """(WARPS, U, PF) of the gemv_q8 instance for a matrix of quantized type t with n_out outputs
    (SwiGLU pairs with glu) of n_in inputs: QUANT[t]'s gemv (glu for a SwiGLU pair), or
    ROW_BLOCKS_VARIANT[t] where a row holds more than 16 QK_K blocks, ROW_BLOCKS_SLOW over a
    multiple of 16, and there are more than ROW_BLOCKS_FEW_ROWS outputs."""
    blocks = n_in // QK_K
    if (not glu and t in ROW_BLOCKS_VARIANT and blocks > 16 and blocks % 16 in ROW_BLOCKS_SLOW
            and n_out > ROW_BLOCKS_FEW_ROWS):
        return ROW_BLOCKS_VARIANT[t]
    return QUANT[t].glu if glu else QUANT[t].gemv


def after_attention_variant(t: T, n_in: int) -> tuple[int, int, int] | None:
    """(WARPS, U, PF) of the one-token output product of type t and n_in inputs, with or without
    its handoff (nq_variants): ROW_BLOCKS_VARIANT[t] for AFTER_ATTENTION_TYPES past
    AFTER_ATTENTION_MIN_IN inputs, else None (gemv_variant's choice)."""
    return ROW_BLOCKS_VARIANT[t] if t in AFTER_ATTENTION_TYPES and n_in > AFTER_ATTENTION_MIN_IN else None


def qkv_variant(t: T, n_out: int, n_sm: int) -> tuple[int, int, int] | None:
    """(WARPS, U, PF) of the one-token q/k/v product of one run of type t with n_out outputs on a
    GPU of n_sm multiprocessors (K4_QKV_WIDE): QKV_VARIANT[t] where its grid of warps, one block a
    multiprocessor, gives the busiest warp fewer rows than QUANT[t].gemv's and at most QKV_MAX_ROUNDS;
    else None (gemv_variant's choice)."""
    if t not in QKV_VARIANT or QUANT[t].gemv[0] >= QKV_WARPS:
        return None
    rounds = [-(-n_out // (n_sm * warps)) for warps in (QUANT[t].gemv[0], QKV_VARIANT[t][0])]
    return QKV_VARIANT[t] if rounds[1] < rounds[0] and rounds[1] <= QKV_MAX_ROUNDS else None


# The type pairs of one token's q/k/v runs that gemv_q8_pair multiplies in one launch (first run's
# type, second's; runtime/cuda/gemv_pair.py): Q4_K_M's Q4_K q|k with a Q6_K v. Only types whose
# products run blocks of one size: the fused RMSNorm sums x over the block's threads, so x's 8
# bits, and the outputs, are those of two launches only then (Q5_K runs 32 warps, Q4_K and Q6_K
# 16). Q3_K_M's Q3_K with Q4_K and Q2_K's with Q4_K spill under the pair's register cap
# (constants.PAIR_REGS). The others stay two launches.
QKV_PAIRS: tuple[tuple[T, T], ...] = ((T.Q4_K, T.Q6_K),)


def nq_variants(t: T) -> tuple[tuple[int, int, int], ...]:
    """The gemv_q8 variants (WARPS, U, PF) with NQ instances of type t (NQ_TYPES): its default, and
    for AFTER_ATTENTION_TYPES the output product's wide variant (K4_WO_WIDE; no cluster instance)."""
    return (QUANT[t].gemv,) + ((ROW_BLOCKS_VARIANT[t],) if t in AFTER_ATTENTION_TYPES else ())


def nq_balanced(n_out: int, n_in: int, grid: int, warps: int) -> bool:
    """Whether whole 32-output groups per block (of `warps` warps, `grid` blocks) give no warp more
    of the n_out rows than rows round-robin over all warps do, and leave few enough blocks without
    rows (matmul.norm_q8_blocks): at most a tenth, or a quarter where the rows are long (n_in at
    least 4 n_out), whose stream the busy blocks still fill, or where a busy warp holds one row (32
    warps a block: the plain product's warps hold one too); and whose busiest block holds at most a
    quarter more rows than the plain product's (round-robin) busiest block. On the H200
    (docs/PERF.md, sessions 28, 42 and 43) the NQ product of 3,584 outputs (112 groups on 132 blocks of 16 warps) took 1.1 µs more
    than the plain one at 3,584 inputs, more than its reader saves, and 0.5 µs more at 18,944 inputs,
    less than its reader (Qwen2.5 7B's q/k/v) saves: tg128 +0.8% (three rounds; +1.4% in one). In
    blocks of 32 warps (K4_WO_WIDE) the 3,584 x 3,584 output product's handoff gained 1.0% (three
    rounds, every pair in the same direction); Phi-4's 5,120 x 5,120 one (160 groups: blocks of 64
    rows beside blocks of 32, where the plain product's hold 39) lost 0.3%."""
    groups = n_out // 32
    rows = 32 * -(-groups // grid)  # the busiest NQ block's
    idle_ok = 10 * groups >= 9 * grid or ((n_in >= 4 * n_out or rows <= warps) and 4 * groups >= 3 * grid)
    spread = 4 * rows <= 5 * -(-n_out // grid)
    return -(-rows // warps) <= -(-n_out // (grid * warps)) and idle_ok and spread


def nx_reads(t: T, variant: tuple[int, int, int], glu: bool) -> bool:
    """Whether a gemv_q8 launch of type t, variant (WARPS, U, PF), glu or not, has an NX instance
    (_nq_names, _qkv_names): it can read an NQ handoff (gemv x_q8 with parts)."""
    if t in NQ_TYPES and not glu and variant == QKV_VARIANT.get(t):
        return True
    return t in NQ_TYPES and variant == (QUANT[t].glu if glu else QUANT[t].gemv) and variant[0] <= 16
