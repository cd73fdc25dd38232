"""The mixture-of-experts kernels (kernels_cu/moe.cu, runtime/cuda/moe.py) against the numpy
reference (runtime/moe.py route; gguf's dequantization). The whole forward pass of qwen3moe and
qwen2moe is checked against transformers in test_oracles.py (cuda backend, F32 experts).

Limits: top-k ids equal and weights within 1e-5 relative (float32 softmax, __expf against
numpy's exp); the gathered products within 1e-5 relative L2 (float32 dot products of the same
dequantized weights, another summation order)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from tests.gpu import cupy_or_skip
from k4.runtime.moe import route
from k4.runtime.synthetic import random_blocks
from k4.runtime.trace import Trace

cp = cupy_or_skip()

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def o():
    from k4.runtime.cuda.ops import Ops

    return Ops(Trace())


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("n_expert,k", [(8, 2), (128, 8), (60, 4)])
def test_topk_matches_the_reference(o, renorm, n_expert, k):
    logits = np.random.default_rng(n_expert).standard_normal((5, n_expert)).astype(np.float32)  # (5 tokens, n_expert)
    ids, w = cp.zeros(5 * k, cp.int32), cp.zeros(5 * k, cp.float32)
    o._launch("moe.cu", "moe_topk", (5,), (128,), (cp.asarray(logits), np.int32(n_expert), np.int32(k), np.int32(renorm), ids, w),
              shared_mem=4 * n_expert, pdl=False)
    want_ids, want_w = route(logits, k, renorm)
    assert (cp.asnumpy(ids).reshape(5, k) == want_ids).all()
    np.testing.assert_allclose(cp.asnumpy(w).reshape(5, k), want_w, rtol=1e-5)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0, T.F32])
def test_gathered_product_reads_the_selected_experts(o, ggml_type):
    from k4.runtime.cuda.moe import Experts, gathered

    E, rows, n_in, rng = 4, 96, 512, np.random.default_rng(1)
    if ggml_type == T.F32:
        raw = (rng.standard_normal((E * rows, n_in)) / np.sqrt(n_in)).astype(np.float32)
        w = raw.reshape(E, rows, n_in)
    else:
        raw = random_blocks(ggml_type, E * rows, n_in, rng, 1 / np.sqrt(n_in))  # (E rows, bytes) uint8
        w = dequantize(raw, ggml_type).reshape(E, rows, n_in)
    e = Experts(cp.asarray(raw.reshape(-1).view(np.uint8)), ggml_type, (E, rows, n_in))
    x = rng.standard_normal((2, n_in)).astype(np.float32)  # 2 tokens
    ids = np.array([3, 1, 0, 3], np.int32)  # token 0: experts 3, 1; token 1: 0, 3
    y = cp.zeros((4, rows), cp.float32)
    gathered(o, e, cp.asarray(ids), cp.asarray(x), 2, n_in, y, 4)
    want = np.stack([w[ids[s]] @ x[s // 2] for s in range(4)])
    got = cp.asnumpy(y)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_combine_adds_the_weighted_experts_and_the_gated_shared_expert(o):
    rng, n, k, T_ = np.random.default_rng(2), 64, 2, 3
    d, wts = rng.standard_normal((T_, k, n)).astype(np.float32), rng.random((T_, k)).astype(np.float32)
    res, shared, h, g = (rng.standard_normal((T_, n)).astype(np.float32) for _ in range(4))
    gate = g[0]
    y = cp.zeros((T_, n), cp.float32)
    o._launch("moe.cu", "moe_combine", (T_,), (256,), tuple(cp.asarray(a) for a in (d, wts)) + (np.int32(k), cp.asarray(res), y,
              np.int32(n), cp.asarray(shared), cp.asarray(h), cp.asarray(gate)), pdl=False)
    sig = 1 / (1 + np.exp(-(h @ gate)))  # (T_,)
    want = res + np.einsum("tk,tkn->tn", wts, d) + sig[:, None] * shared
    np.testing.assert_allclose(cp.asnumpy(y), want, rtol=1e-5, atol=1e-5)
