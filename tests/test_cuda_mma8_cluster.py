"""gemv_mma in thread-block clusters (flag K4_MMA8_CLUSTER; kernels_cu/gemv_mma_staged.cu CL,
runtime/cuda/gemv_mma.py mma8_cluster): the two blocks of a cluster split every weight row's
256-weight blocks, each staging half of the tokens' x, and rank 0 adds the other's partial sums
(in rank order) before it writes Y.

Limits (relative L2): the same integer dots and scales as the kernel without clusters, summed in
another order, so against it 1e-5 (2e-5 for the gate/up epilogue), the gemv_mma tests' limit
against gemv; against numpy on q8-rounded x LIMIT_Q8_ROUNDED (1e-4; twice for gate/up). Y is the
same bits on a second launch (the sums' order does not depend on timing). The NQ and y_q8
outputs with clusters: tests/test_cuda_mma8_nq.py and test_cuda_mma8_ffq8.py (their shapes run in
clusters by default); the forward pass with the flag off: test_cuda_switches.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import gemv_mma as gm
from k4.runtime.cuda import quant_kernels as qk
from k4.runtime.cuda.constants import MMA8_TOKENS
from tests.matmul_ref import LIMIT_Q8_ROUNDED, fresh_rng, glu_weight, nan_like, q8_rounded, rel_err, weight
from tests.test_cuda_gemv_batch import strided_rows

LIMIT_VS_ALONE = 1e-5


def alone(w):
    """The same device weight with clusters off (K4_MMA8_CLUSTER=0): its own plans."""
    return dataclasses.replace(w, mma8_cluster=False, _plans={})


@pytest.mark.cuda
def test_clusters_where_the_rule_says():
    """Clusters where a cluster takes at most MMA8_CLUSTER_STEPS steps or only clusters fit x."""
    rng, _ = fresh_rng()
    assert gm.mma8_cluster(weight("Q4_K", 4096, 4096, rng, True)[0]) == qk.MMA8_CLUSTER  # one step a cluster
    assert gm.mma8_cluster(weight("Q6_K", 4096, 11008, rng, True)[0]) == qk.MMA8_CLUSTER
    gate_up = glu_weight(T.Q4_K, 11008, 4096, rng)[0]  # six steps a cluster: the kernel without clusters
    assert gm.mma8_cluster(gate_up) == 1
    assert gm.mma8_cluster(weight("Q4_K", 2048, 2048, rng, True)[0]) == 1  # rows of fewer than MMA8_CLUSTER_MIN_IN inputs
    assert gm.mma8_cluster(alone(weight("Q4_K", 4096, 4096, rng, True)[0])) == 1
    wide = weight("Q4_K", 512, 18944, rng, True)[0]  # Qwen2.5 7B's down: x of 8 tokens fits only halved
    assert gm.mma_shape(T.Q4_K, 18944, True) is None and gm.uses_mma8(wide, 8) and gm.mma8_cluster(wide) == qk.MMA8_CLUSTER
    assert not gm.uses_mma8(alone(wide), 8)
    plan = gm._mma_plan(wide, None)
    assert plan[1][0] % qk.MMA8_CLUSTER == 0 and plan[6] == qk.MMA8_CLUSTER


# (type, n_out, n_in, glu, steps rule; every n_in admitted): one step a cluster with the rows' blocks split 8 / 8, 21 /
# 22 (Q6_K, 12 warps) and 2 / 2 (a partial tile, warps of rank 1 without blocks); several steps a
# cluster (the rule lifted): the gate/up epilogue over 6 steps, 3 steps of 4 tiles
CASES = [("Q4_K", 4096, 4096, False, None), ("Q6_K", 4096, 11008, False, None), ("Q4_K", 301, 1024, False, None),
         ("Q4_K", 11008, 4096, True, 99), ("Q6_K", 12288, 4096, False, 99)]


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [3, MMA8_TOKENS])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}{'-glu' if c[3] else ''}")
def test_cluster_products_agree_with_one_block(case, n_tok, monkeypatch):
    import cupy as cp

    t, n_out, n_in, glu, steps = case
    if steps:
        monkeypatch.setattr(gm, "MMA8_CLUSTER_STEPS", steps)
    monkeypatch.setattr(gm, "MMA8_CLUSTER_MIN_IN", 256)
    rng, seed = fresh_rng()
    if glu:
        w, ref_g, ref_u = glu_weight(T[t], n_out, n_in, rng)
    else:
        w, ref_w = weight(t, n_out, n_in, rng, True)
    assert gm.mma8_cluster(w) == qk.MMA8_CLUSTER, gm._mma_plan(w, None)
    X, x = strided_rows(rng, n_tok, n_in)
    xr = np.stack([q8_rounded(row) for row in x])
    if glu:
        ref = (ref_g @ xr.T).T
        ref = ref / (1 + np.exp(-ref)) * (ref_u @ xr.T).T
    else:
        ref = (ref_w @ xr.T).T
    case_id = f"{case} n_tok {n_tok} (seed {seed})"
    scale = 2 if glu else 1

    Y1, Y2, Y0 = (nan_like((n_tok, n_out)) for _ in range(3))
    gm.gemv_mma(w, X, Y1)
    gm.gemv_mma(w, X, Y2)
    gm.gemv_mma(alone(w), X, Y0)
    got = Y1.get()
    assert np.isfinite(got).all(), f"{case_id}: unwritten outputs"
    assert np.array_equal(got, Y2.get()), f"{case_id}: another launch gave other bits"
    assert rel_err(got, ref) < scale * LIMIT_Q8_ROUNDED, f"{case_id}: {rel_err(got, ref):.2e} from numpy"
    assert rel_err(got, Y0.get()) < scale * LIMIT_VS_ALONE, f"{case_id}: {rel_err(got, Y0.get()):.2e} from one block"

    if not glu:  # the residual added by rank 0, in place
        r = rng.standard_normal((n_tok, n_out)).astype(np.float32)
        Y = cp.asarray(r)
        gm.gemv_mma(w, X, Y, residual=Y)
        assert rel_err(Y.get(), ref + r) < LIMIT_Q8_ROUNDED, f"{case_id}: in place"


@pytest.mark.cuda
def test_a_row_of_18944_inputs_in_clusters_only():
    """Qwen2.5 7B's down product (18,944 inputs) for 8 tokens: only in clusters (half of x a block)."""
    rng, seed = fresh_rng()
    w, ref_w = weight("Q6_K", 300, 18944, rng, True)
    X, x = strided_rows(rng, MMA8_TOKENS, 18944)
    Y = nan_like((MMA8_TOKENS, 300))
    gm.gemv_mma(w, X, Y)
    ref = np.stack([ref_w @ q8_rounded(row) for row in x])
    assert rel_err(Y.get(), ref) < LIMIT_Q8_ROUNDED, f"seed {seed}: {rel_err(Y.get(), ref):.2e}"
    with pytest.raises(ValueError, match="shared memory"):
        gm.gemv_mma(alone(w), X, nan_like((MMA8_TOKENS, 300)))


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [3, MMA8_TOKENS])
def test_handoffs_with_every_product_in_clusters(n_tok, monkeypatch):
    """The y_q8 and NQ outputs (each step's, written by the rank that finishes it) with every
    product in clusters, several steps a cluster: test_cuda_mma8_ffq8's and test_cuda_mma8_nq's
    checks (the handoff's bytes are quantize_rows' / q8x_host's of this Y) on their shapes."""
    from tests import test_cuda_mma8_ffq8 as ffq8
    from tests import test_cuda_mma8_nq as nq

    monkeypatch.setattr(gm, "MMA8_CLUSTER_STEPS", 99)
    monkeypatch.setattr(gm, "MMA8_CLUSTER_MIN_IN", 256)
    rng, _ = fresh_rng()
    for type_name, n_out, n_in, glu in ffq8.CASES:
        w = glu_weight(T[type_name], n_out, n_in, rng)[0] if glu else weight(type_name, n_out, n_in, rng, True)[0]
        assert gm.mma8_cluster(w) == qk.MMA8_CLUSTER, (type_name, n_out, n_in)
        ffq8.test_y_q8_is_quantize_rows_of_the_same_y((type_name, n_out, n_in, glu), n_tok)
    for case in nq.CASES:
        assert gm.mma8_cluster(weight(case[0], *case[1], rng, True)[0]) == qk.MMA8_CLUSTER, case
        nq.test_nq_handoff_feeds_the_products_after_the_norm(case, n_tok)
