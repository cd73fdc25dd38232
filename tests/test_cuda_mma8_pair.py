"""gemv_mma_pair (runtime/cuda/gemv_mma_pair.py, kernels_cu/gemv_mma_staged.cu gemv_mma_pair; flag
K4_MMA8_PAIR): the verify step's Q4_K q|k and Q6_K v products of one x in one launch.

Limits (relative L2): each part is gemv_mma's product on a share of the grid, the same integer
dots with float sums in an order that may differ (its KS): against gemv_mma on the weight alone
1e-5 (the gemv_mma tests' limit against gemv); against numpy on q8-rounded x LIMIT_Q8_ROUNDED.
Outputs are poisoned with NaN; the same bits on a second launch. The forward pass with the flag
on and off: test_cuda_switches and test_cuda_speculative.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import gemv_mma_pair as gp
from k4.runtime.cuda.constants import MMA8_TOKENS
from k4.runtime.cuda.gemv_batch import Q8Rows, quantize_rows
from k4.runtime.cuda.gemv_mma import gemv_mma
from tests.matmul_ref import LIMIT_Q8_ROUNDED, fresh_rng, glu_weight, nan_like, q8_rounded, rel_err, weight
from tests.test_cuda_gemv_batch import strided_rows

LIMIT_VS_ALONE = 1e-5
# (q|k rows, v rows, n_in): Llama 2 7B's (in clusters), Qwen2.5 7B's (in clusters, 512 v rows),
# TinyLlama's (2,048 inputs: without clusters)
SHAPES = [(8192, 4096, 4096), (4096, 512, 3584), (2304, 256, 2048)]


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [3, MMA8_TOKENS])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}+{s[1]}x{s[2]}")
def test_pair_agrees_with_each_product_alone(shape, n_tok):
    import cupy as cp

    n_a, n_b, n_in = shape
    rng, seed = fresh_rng()
    a, ref_a = weight("Q4_K", n_a, n_in, rng, True)
    b, ref_b = weight("Q6_K", n_b, n_in, rng, True)
    assert gp.pairs(a, b, n_tok)
    X, x = strided_rows(rng, n_tok, n_in)
    xr = np.stack([q8_rounded(row) for row in x])
    bias_b = rng.standard_normal(n_b).astype(np.float32)
    case = f"{shape} n_tok {n_tok} (seed {seed})"
    outs = []
    for _ in range(2):
        Ya, Yb = nan_like((n_tok, n_a)), nan_like((n_tok, n_b))
        gp.gemv_mma_pair(a, b, X, Ya, Yb, bias_b=cp.asarray(bias_b))
        outs.append((Ya.get(), Yb.get()))
    (ga, gb), (ga2, gb2) = outs
    assert np.isfinite(ga).all() and np.isfinite(gb).all(), f"{case}: unwritten outputs"
    assert np.array_equal(ga, ga2) and np.array_equal(gb, gb2), f"{case}: another launch gave other bits"
    assert rel_err(ga, (ref_a @ xr.T).T) < LIMIT_Q8_ROUNDED, case
    assert rel_err(gb, (ref_b @ xr.T).T + bias_b) < LIMIT_Q8_ROUNDED, case
    Ya, Yb = nan_like((n_tok, n_a)), nan_like((n_tok, n_b))
    gemv_mma(a, X, Ya)
    gemv_mma(b, X, Yb, bias=cp.asarray(bias_b))
    assert rel_err(ga, Ya.get()) < LIMIT_VS_ALONE and rel_err(gb, Yb.get()) < LIMIT_VS_ALONE, f"{case}: from gemv_mma alone"


@pytest.mark.cuda
def test_pair_reads_x_quantized_once():
    """x_q8 (quantize_rows' rows) gives both parts the products of X quantized by every block."""
    import cupy as cp

    rng, seed = fresh_rng()
    a, b = weight("Q4_K", 1024, 4096, rng, True)[0], weight("Q6_K", 512, 4096, rng, True)[0]
    X, _ = strided_rows(rng, 5, 4096)
    q8 = Q8Rows(cp.zeros(Q8Rows.nbytes(5, 4096), cp.uint8), 5, 4096, 3)
    quantize_rows(X, q8)
    got, want = [], []
    for x_q8, out in ((q8, got), (None, want)):
        Ya, Yb = nan_like((5, 1024)), nan_like((5, 512))
        gp.gemv_mma_pair(a, b, X, Ya, Yb, x_q8=x_q8)
        out += [Ya.get(), Yb.get()]
    assert all(np.array_equal(g, w) for g, w in zip(got, want)), f"seed {seed}"


@pytest.mark.cuda
def test_pair_argument_errors():
    rng, _ = fresh_rng()
    a, b = weight("Q4_K", 512, 2048, rng, True)[0], weight("Q6_K", 256, 2048, rng, True)[0]
    X, _ = strided_rows(rng, 4, 2048)
    Ya, Yb = nan_like((4, 512)), nan_like((4, 256))
    for bad in ((b, a), (a, weight("Q6_K", 256, 2048, rng, False)[0]), (a, weight("Q6_K", 256, 1024, rng, True)[0]),
                (a, glu_weight(T.Q6_K, 128, 2048, rng)[0]),
                (a, dataclasses.replace(b, mma8=False, _plans={}))):
        assert not gp.pairs(*bad, 4)
        with pytest.raises(ValueError, match="gemv_mma_pair multiplies"):
            gp.gemv_mma_pair(*bad, X, Ya, Yb)
    assert not gp.pairs(a, b, 2) and gp.pairs(a, b, 3)  # gemv_mma runs 3 to 8 tokens
    with pytest.raises(ValueError, match="shape"):
        gp.gemv_mma_pair(a, b, X, Ya, nan_like((4, 255)))
