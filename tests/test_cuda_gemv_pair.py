"""gemv_q8_pair (runtime/cuda/gemv_pair.py): two products of one x in one launch give, output for
output, the bits of two gemv launches, which the gemv tests check against numpy, for every type
pair it is compiled for, both layouts, with the fused RMSNorm, biases and Gemma's folded
post-norm; and a decode step of a Q4_K_M model gives the same logits with it on and off
(tests/test_cuda_switches.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import gemv_choice as gc
from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda import quant_kernels as qk
from k4.runtime.cuda.matrix_jobs import compile_jobs
from tests.matmul_ref import LIMIT_Q8, fresh_rng, nan_like, rel_err, rms_normed, weight

# (n1, n2, n_in): fewer outputs than warps, fewer than the grid's blocks (one block on w2's
# rows), and several rows of both per warp (Llama 3 8B's q|k and v)
SHAPES = ((300, 44, 512), (40, 8, 256), (5120, 1024, 4096))


@pytest.mark.cuda
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("types", gc.QKV_PAIRS, ids=lambda p: f"{p[0].name}+{p[1].name}")
def test_pair_gives_the_bits_of_two_products(types, repack):
    import cupy as cp

    from k4.runtime.cuda.gemv_pair import gemv_pair, pairs

    rng, seed = fresh_rng()
    eps = 1e-6
    for n1, n2, n_in in SHAPES:
        (w1, ref1), (w2, _) = (weight(t.name, n, n_in, rng, repack) for t, n in zip(types, (n1, n2)))
        assert pairs(w1, w2) and not pairs(w2, w1)
        x, t, post_w, norm_w = (rng.standard_normal((4, n_in)) * [[3], [1], [0.3], [0.3]] + [[0.5], [0], [1], [1]]).astype(np.float32)
        b1, b2 = cp.asarray(rng.standard_normal(n1), cp.float32), cp.asarray(rng.standard_normal(n2), cp.float32)
        norm = (cp.asarray(norm_w), eps)
        for post in (False, True):
            what = f"{types[0].name}+{types[1].name} {n1}+{n2}x{n_in} repack={repack} post={post} (seed {seed})"
            outs = []
            for paired in (True, False):
                y1, y2, x_out = nan_like(n1), nan_like(n2), nan_like(n_in)
                p = (cp.asarray(t), cp.asarray(post_w), x_out) if post else None
                if paired:
                    gemv_pair(w1, w2, cp.asarray(x), y1, y2, bias1=b1, bias2=b2, norm=norm, post=p)
                else:
                    mm.gemv(w1, cp.asarray(x), y1, bias=b1, norm=norm, post=p)
                    mm.gemv(w2, cp.asarray(x), y2, bias=b2, norm=norm, post=p)
                outs.append((y1.get(), y2.get(), x_out.get()))
            (p1, p2, px), (s1, s2, sx) = outs
            assert np.isfinite(p1).all() and np.isfinite(p2).all(), f"{what}: unwritten outputs"
            assert np.array_equal(p1, s1) and np.array_equal(p2, s2), f"{what}: not the bits of two launches"
            if post:
                assert np.array_equal(px, sx), f"{what}: the post-norm's input"
            else:  # and the first product against float64 (the q8 limit of the fused norm)
                assert rel_err(p1 - b1.get(), ref1 @ rms_normed(x, norm_w, eps)) < LIMIT_Q8, what


@pytest.mark.cuda
def test_pair_rejects_what_it_cannot_multiply():
    import cupy as cp

    from k4.runtime.cuda.gemv_pair import gemv_pair

    rng, _ = fresh_rng()
    (w1, _), (w2, _), (w3, _) = (weight(t, n, n_in, rng, True) for t, n, n_in in (("Q4_K", 64, 512), ("Q6_K", 32, 512), ("Q6_K", 32, 256)))
    x, y1, y2 = cp.zeros(512, cp.float32), nan_like(64), nan_like(32)
    with pytest.raises(ValueError, match="no paired product"):
        gemv_pair(w2, w1, x, y2, y1)  # the pair is (Q4_K, Q6_K), in that order
    with pytest.raises(ValueError, match="no paired product"):
        gemv_pair(w1, w3, x, y1, y2[:32])  # rows of different lengths
    with pytest.raises(ValueError, match="y2"):
        gemv_pair(w1, w2, x, y1, nan_like(31))


def test_every_pair_is_compiled_only_where_both_types_are_present():
    """Each QKV_PAIRS entry has its compile group, which a model compiles when it holds both types."""
    for a, b in gc.QKV_PAIRS:
        names = qk.GROUPS["gemv.cu"][f"pair.{a.name}.{b.name}"]
        nx = (False, True) if a in gc.NQ_TYPES and b in gc.NQ_TYPES else (False,)  # the readers of an NQ handoff
        assert names == tuple(qk.gemv_pair_name(a, b, p, x) for x in nx for p in (False, True))
    groups = lambda types: [g for f, g, _ in compile_jobs(types) if f == "gemv.cu" and "pair" in g[0]]  # noqa: E731
    assert groups([T.Q4_K, T.Q6_K, T.F32]) == [qk.GROUPS["gemv.cu"]["pair.Q4_K.Q6_K"]]
    assert groups([T.Q4_K, T.F32]) == [] and groups([T.Q6_K]) == []
