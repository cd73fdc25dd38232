"""Which gemv_q8 instance a matrix gets (runtime/cuda/quant_kernels.py gemv_variant): the
per-type default, or the row-blocks variant where the default runs at half speed; and how
gemv_q8_pair splits its grid between its two matrices (runtime/cuda/gemv_pair.py split_blocks).
No GPU."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import gemv_choice as gc

from k4.runtime.cuda import quant_types as qt

from k4.runtime.cuda import quant_kernels as qk
from k4.runtime.cuda.matrix_jobs import compile_jobs


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K])
def test_rows_of_slow_block_counts_take_the_row_blocks_variant(t):
    # 17, 18, 20, 21, 22, 23, 34, 35, 54, 70, 84 blocks
    for n_in in (4352, 4608, 5120, 5376, 5632, 5888, 8704, 8960, 13824, 17920, 21504):
        assert gc.gemv_variant(t, 4096, n_in) == gc.ROW_BLOCKS_VARIANT[t], n_in
    for n_in in (512, 768, 1792, 2048, 3072, 3584, 3840, 4096, 6144, 11008, 14336, 15360, 18944):
        assert gc.gemv_variant(t, 4096, n_in) == qt.QUANT[t].gemv, n_in


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K])
def test_products_of_at_most_one_row_a_warp_keep_the_default(t):
    # TinyLlama's down product: 2048 rows of 5632 inputs (22 blocks), where the row-blocks variant
    # leaves half its warps without a row
    assert gc.gemv_variant(t, 2048, 5632) == qt.QUANT[t].gemv
    assert gc.gemv_variant(t, gc.ROW_BLOCKS_FEW_ROWS, 5632) == qt.QUANT[t].gemv
    assert gc.gemv_variant(t, gc.ROW_BLOCKS_FEW_ROWS + 1, 5632) == gc.ROW_BLOCKS_VARIANT[t]


def test_swiglu_pairs_and_other_types_keep_their_variant():
    assert gc.gemv_variant(T.Q4_K, 5632, 5120, glu=True) == qt.QUANT[T.Q4_K].glu
    for t in (T.Q5_K, T.Q8_0, T.Q3_K):
        assert gc.gemv_variant(t, 4096, 5120) == qt.QUANT[t].gemv


def test_the_row_blocks_variant_is_compiled_with_the_type():
    for t, v in gc.ROW_BLOCKS_VARIANT.items():
        for planar in (False, True):
            assert qk._gemv_q8_name(t, planar, v) in qk.GROUPS["gemv.cu"][t.name]


def test_the_output_product_after_attention_runs_wide_where_measured():
    """gemv_choice.after_attention_variant (K4_WO_WIDE): Q4_K's one-token output product without a
    handoff runs the row-blocks variant (32, 2, 0) past 2,048 inputs (Qwen2.5 7B's 3,584,
    Qwen3-30B-A3B's 4,096), with the default's U (so its bits), compiled with the type; TinyLlama's
    2,048 and the other types keep matmul's choice."""
    assert gc.after_attention_variant(T.Q4_K, 3584) == gc.after_attention_variant(T.Q4_K, 4096) == (32, 2, 0)
    assert gc.after_attention_variant(T.Q4_K, 2048) is None and gc.after_attention_variant(T.Q4_K, 1536) is None
    assert gc.after_attention_variant(T.Q6_K, 3584) is None and gc.after_attention_variant(T.Q5_K, 4096) is None
    v = gc.after_attention_variant(T.Q4_K, 3584)
    assert v[1] == qt.QUANT[T.Q4_K].gemv[1]
    for planar in (False, True):
        assert qk._gemv_q8_name(T.Q4_K, planar, v) in qk.GROUPS["gemv.cu"]["Q4_K"]


class _Kernel:  # what launch.blocks_per_sm reads of a cupy Function
    def __init__(self, num_regs: int):
        self.num_regs = num_regs


def test_every_kernel_asks_for_one_carveout_unless_its_blocks_need_more():
    """K4_CARVEOUT (runtime/cuda/launch.py carveout_for): SHARED_CARVEOUT for kernels whose
    resident blocks fit in it; for attn_gqa-like blocks (two of 110 KB) the share they need, so
    the split never costs the occupancy the grid was sized for; the driver's choice when off."""
    from k4.runtime.cuda import launch

    assert launch.carveout_for(_Kernel(64), 512, 36_000) == launch.SHARED_CARVEOUT
    assert launch.carveout_for(_Kernel(32), 256, 0) == launch.SHARED_CARVEOUT
    big = launch.carveout_for(_Kernel(128), 128, 110_000)  # registers allow 4 blocks, shared memory 2
    assert big > launch.SHARED_CARVEOUT and big * launch.SM_SHARED >= 100 * 2 * (110_000 + 1024)
    assert launch.carveout_for(_Kernel(200), 128, 250_000 // 2) <= 100
    assert launch.carveout_for(_Kernel(64), 512, 36_000, on=False) == launch.CARVEOUT_DEFAULT


# (n1, bytes of a w1 row, n2, bytes of a w2 row): Q4_K q|k and Q6_K v of Llama 2 7B, Qwen3-30B-A3B,
# Qwen2.5 7B and TinyLlama, and a matrix pair with fewer rows than the grid has warps
PAIR_SHAPES = ((8192, 2304, 4096, 3360), (4608, 1152, 512, 1680), (4096, 2016, 512, 2940), (2304, 1152, 256, 1680),
               (300, 288, 44, 420))


@pytest.mark.parametrize("n1, rb1, n2, rb2", PAIR_SHAPES)
def test_the_pair_gives_each_matrix_blocks_in_proportion_to_its_bytes(n1, rb1, n2, rb2):
    from k4.runtime.cuda.gemv_pair import split_blocks

    grid, warps = min(132, n1 + n2), 16
    b2 = split_blocks(grid, warps, n1, rb1, n2, rb2)
    assert 1 <= b2 < grid
    busiest = max(-(-n2 // (b2 * warps)) * rb2, -(-n1 // ((grid - b2) * warps)) * rb1)
    # no warp holds more than an even share of the bytes plus one row of each matrix
    assert busiest <= (n1 * rb1 + n2 * rb2) / (grid * warps) + rb1 + rb2, (b2, busiest)
    # and the split is no worse than giving w2 the share of blocks its bytes ask for, either way rounded
    share = grid * n2 * rb2 / (n1 * rb1 + n2 * rb2)
    for b in {max(1, min(grid - 1, int(share))), max(1, min(grid - 1, int(share) + 1))}:
        assert busiest <= max(-(-n2 // (b * warps)) * rb2, -(-n1 // ((grid - b) * warps)) * rb1)


def test_clusters_only_for_a_long_x_on_the_compiled_cluster_instances():
    for t in gc.CLUSTER_TYPES:
        v = qt.QUANT[t].gemv
        assert gc.gemv_cluster(t, 4096, 11008, v) == gc.gemv_cluster(t, 3584, 18944, v) == gc.X_CLUSTER == 2
        assert gc.gemv_cluster(t, 4096, gc.X_CLUSTER_MIN_IN, v) == 1  # 4096 and 5632 were slower in clusters
        assert gc.gemv_cluster(t, 5120, 17920, gc.ROW_BLOCKS_VARIANT[t]) == 1  # no cluster instance
        assert gc.gemv_cluster(t, 4, 11008, v) == 2 and gc.gemv_cluster(t, 3, 11008, v) == 1  # a grid of whole clusters
        for p in (False, True):
            name = qk._gemv_q8_name(t, p, v, cluster=True)
            assert name.endswith(", false, false, true>") and name in qk.GROUPS["gemv.cu"][t.name]
    assert gc.gemv_cluster(T.Q8_0, 4096, 11008, qt.QUANT[T.Q8_0].gemv) == 1


def test_the_norm_handoff_only_where_blocks_of_whole_groups_stay_balanced():
    """gemv_choice.nq_balanced: NQ products (gemv norm_out) take whole 32-output groups per block, so
    only where that gives no warp more rows than the round-robin rows (TinyLlama's 2,048 outputs:
    2 against 1 on 132 blocks of 16 warps) and idles at most a tenth of the blocks (Qwen2.5 7B's
    3,584 of 3,584 inputs: 112 groups on 132 blocks), a quarter where n_in is at least 4 n_out
    (Qwen2.5 7B's down, 18,944 inputs; not TinyLlama's 2,048 x 5,632) or where a busy warp holds one
    row (Qwen2.5 7B's output product in blocks of 32 warps; not 2,048 outputs), and where no block
    holds more than 1.25x the plain product's busiest block's rows (not Phi-4's 5,120 outputs: 64
    against 39); the NQ instances (both clusterings of CLUSTER_TYPES) in
    their own compile group, left out for the gelu_tanh families."""
    nq_balanced = gc.nq_balanced
    assert nq_balanced(4096, 4096, 132, 16) and nq_balanced(8192, 4096, 132, 16) and nq_balanced(256, 256, 8, 16)
    assert not nq_balanced(2048, 2048, 132, 16) and not nq_balanced(3584, 3584, 132, 16) and not nq_balanced(5120, 5120, 132, 16)
    assert nq_balanced(3584, 18944, 132, 16) and not nq_balanced(3584, 14335, 132, 16)
    assert not nq_balanced(2048, 5632, 132, 16) and not nq_balanced(2048, 8192, 132, 16) and not nq_balanced(5120, 20480, 132, 16)
    assert nq_balanced(3584, 3584, 132, 32) and nq_balanced(4096, 4096, 132, 32) and not nq_balanced(5120, 5120, 132, 32)
    assert nq_balanced(8192, 4096, 132, 32) and not nq_balanced(5376, 5376, 132, 32) and nq_balanced(3840, 3840, 132, 32)
    assert not nq_balanced(2048, 2048, 132, 32) and not nq_balanced(2048, 4096, 132, 32) and not nq_balanced(2880, 2880, 132, 32)
    for t in gc.NQ_TYPES:
        names = qk.GROUPS["gemv.cu"][f"{t.name}.nq"]
        nq = [n for n in names if n.count(",") == 8]  # the rest, one template argument more, read the handoff (NX)
        assert len(nq) == (4 if t in gc.CLUSTER_TYPES else 2) + 2 * (len(gc.nq_variants(t)) - 1)
        assert all(n.endswith(", true>") for n in names)
        assert all(qk._gemv_q8_name(t, p, v, nq=True) in names for v in gc.nq_variants(t) for p in (False, True))
        assert len(names) - len(nq) == (4 if qt.QUANT[t].glu[0] <= 16 else 2)
        assert gc.nx_reads(t, qt.QUANT[t].gemv, False) and not gc.nx_reads(t, (32, 2, 0), False)
        assert gc.nx_reads(t, qt.QUANT[t].glu, True) == (qt.QUANT[t].glu[0] <= 16)
        assert not set(names) & set(qk.GROUPS["gemv.cu"][t.name])
        jobs = lambda act: [g for f, g, _ in compile_jobs([t], True, act) if f == "gemv.cu"]  # noqa: E731
        assert names in jobs("silu") and names not in jobs("gelu_tanh")


def test_the_head_argmax_instances_compile_only_for_the_heads_type():
    """K4_HEAD_ARGMAX: the AM instances (gemv.cu) of a quantized head type are their own compile
    group, asked for only with head=; NX readers only where the default variant has 16 warps or
    fewer (gemv.cu's NX instances)."""
    with_head = compile_jobs([T.Q4_K, T.Q6_K], head=T.Q6_K)
    assert (("gemv.cu", qk.GROUPS["gemv.cu"]["Q6_K.am"], ()) in with_head
            and qk.GROUPS["gemv.cu"]["Q4_K.am"] not in [g for _, g, _ in with_head])
    assert not any(g == qk.GROUPS["gemv.cu"]["Q6_K.am"] for _, g, _ in compile_jobs([T.Q6_K]))
    am_groups = [qk.GROUPS["gemv.cu"][f"{t.name}.am"] for t in qt.QUANT]
    assert not any(g in am_groups for _, g, _ in compile_jobs([T.F32], head=T.F32))
    for t, q in qt.QUANT.items():
        names = qk.GROUPS["gemv.cu"][f"{t.name}.am"]
        assert len(names) == (4 if q.gemv[0] <= 16 else 2), t.name
        assert all(n.endswith(", true>") and f"{q.gemv[0]}, {q.gemv[1]}," in n for n in names), t.name


def test_the_qkv_variant_takes_a_round_of_rows_off_few_row_products():
    """K4_QKV_WIDE (gemv_choice.qkv_variant): the one-token q/k/v of one Q4_K run takes
    QKV_VARIANT's 20-warp blocks where their grid leaves the busiest warp fewer rows than 16
    warps' and at most QKV_MAX_ROUNDS; on the H200's 132 multiprocessors Qwen2.5 7B's 4,608 rows
    (3 -> 2), TinyLlama's 2,560 (2 -> 1) and Qwen3-30B-A3B's 5,120 (3 -> 2), not Llama 2 7B's 12,288
    (6 -> 5: more than 3), 4,096 or 2,048 (the same rounds), nor a type without the variant."""
    wide = gc.QKV_VARIANT[T.Q4_K]
    assert wide[0] == 20 and wide[1:] == qt.QUANT[T.Q4_K].gemv[1:]  # the default's U and PF: the same row loop
    for n_out in (4608, 2560, 5120, 2113, 2640, 4225, 5280):
        assert gc.qkv_variant(T.Q4_K, n_out, 132) == wide, n_out
    for n_out in (12288, 6144, 4096, 2048, 2112, 2641, 4224, 5281, 64):
        assert gc.qkv_variant(T.Q4_K, n_out, 132) is None, n_out
    assert gc.qkv_variant(T.Q4_K, 4608, 100) is None  # another GPU: 4,608 rows over 100 x 16 warps or 100 x 20, 3 rounds each
    assert gc.qkv_variant(T.Q6_K, 4608, 132) is None and gc.qkv_variant(T.Q8_0, 2560, 132) is None


def test_the_qkv_variant_compiles_only_with_its_flag_and_reads_the_handoff():
    """The QKV_VARIANT instances (both layouts, reading x or an NQ handoff) are a compile group of
    their own that compile_jobs asks for only with qkv (K4_QKV_WIDE), and nx_reads admits the
    variant without glu: check_q8 lets its launch read a handoff."""
    from types import SimpleNamespace

    from k4.runtime.cuda import q8_handoff as hand

    wide = gc.QKV_VARIANT[T.Q4_K]
    names = qk.GROUPS["gemv.cu"]["Q4_K.qkv"]
    assert set(names) == {qk._gemv_q8_name(T.Q4_K, p, wide, nx=nx) for p in (False, True) for nx in (False, True)}
    assert not set(names) & {n for k, g in qk.GROUPS["gemv.cu"].items() if k != "Q4_K.qkv" for n in g}
    groups = lambda qkv: [g for f, g, _ in compile_jobs([T.Q4_K, T.Q6_K], qkv=qkv) if f == "gemv.cu"]  # noqa: E731
    assert names in groups(True) and names not in groups(False)
    assert gc.nx_reads(T.Q4_K, wide, False) and not gc.nx_reads(T.Q4_K, wide, True)
    handed = hand.Q8Vector(None, 256, 1, parts=object(), n_parts=4)
    hand.check_q8(SimpleNamespace(ggml_type=T.Q4_K, glu=False), handed, None, 256, 64, False, variant=wide)


def test_nx_reads_admits_exactly_the_compiled_handoff_readers():
    """A launch that nx_reads admits runs a gemv.cu NX instance: for every quantized type, every
    variant a rule can pick (the default, the GLU one, the row-blocks and q/k/v variants) and glu
    or not, nx_reads says yes exactly where both layouts' NX instances are in a compile group.
    A yes without the instance fails only on the GPU, at the launch."""
    compiled = {n for g in qk.GROUPS["gemv.cu"].values() for n in g}
    admitted = 0
    for t, q in qt.QUANT.items():
        variants = {q.gemv, q.glu, gc.ROW_BLOCKS_VARIANT.get(t), gc.QKV_VARIANT.get(t)} - {None}
        for v in variants:
            for glu in (False, True):
                have = all(qk._gemv_q8_name(t, p, v, glu, nx=True) in compiled for p in (False, True))
                assert gc.nx_reads(t, v, glu) == have, (t.name, v, glu)
                admitted += have
    assert admitted >= 4  # Q4_K and Q6_K: the default and the GLU variant at least


def test_the_pair_instances_compile_only_where_both_types_are_present():
    """compile_jobs asks for a QKV_PAIRS entry's gemv_q8_pair group only where the model has both of
    its types, and for no group of a type without CUDA kernels."""
    pair = qk.GROUPS["gemv.cu"]["pair.Q4_K.Q6_K"]
    assert pair in [g for _, g, _ in compile_jobs([T.Q4_K, T.Q6_K])]
    for alone in ([T.Q4_K], [T.Q6_K], [T.Q4_K, T.F32]):
        assert pair not in [g for _, g, _ in compile_jobs(alone)], alone
    assert compile_jobs([T.TQ1_0]) == compile_jobs([])  # a type k4 has no kernel for (refused at load)
