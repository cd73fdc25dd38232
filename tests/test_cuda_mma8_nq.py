"""The verify step's handoff of an RMSNorm's input (flag K4_MMA8_NQ; gemv_mma nq_out,
kernels_cu/mma8_common.cuh mma8_step_nq and mma8_stage_x with parts, runtime/cuda/forward.py
rows_handoff): a residual product of 3 to 8 rows also writes y * norm_w quantized without the
norm's scale and its steps' sums of y^2; the products after the norm copy it and scale it by the
norm instead of an RMSNorm kernel running between them.

Limits: the handoff's bytes are q8x_host's of y * norm_w (the same float32 products, the same
rounding: exact); the parts add up to sum(y^2) within float32 summation (1e-5 relative); the
reader's products against numpy on the handed-over x (q8-rounded y * norm_w times the norm's
scale, float64): LIMIT_Q8_ROUNDED (1e-4), the gemv limit. The forward pass with the flag on and
off: the speculative tests (test_cuda_speculative, test_cuda_switches) compare tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import quant_types as qt
from k4.runtime.cuda.constants import MMA8_TOKENS, q8x_bytes
from k4.runtime.cuda.q8_handoff import Q8Rows
from k4.runtime.cuda.gemv_mma import _mma_plan, gemv_mma, nq_parts
from k4.runtime.cuda.q8_handoff import q8x_host
from tests.matmul_ref import LIMIT_Q8_ROUNDED, fresh_rng, nan_like, q8_rounded, rel_err, weight
from tests.test_cuda_gemv_batch import strided_rows

EPS = 1e-5
# (producer type, its (n_out, n_in), reader type, reader n_out): steps of two tiles (4096 x 4096 Q4_K,
# KS 8; 4096 x 11008 Q6_K, 12 warps, KS 6) and of four (11008 x 4096 Q4_K, KS 4)
CASES = [("Q4_K", (4096, 4096), "Q6_K", 512), ("Q6_K", (4096, 11008), "Q4_K", 1024), ("Q4_K", (11008, 4096), "Q6_K", 256)]


def handoff_rows(n_tok: int, n: int, n_parts: int, swizzle: int) -> Q8Rows:
    import cupy as cp

    data = cp.full(Q8Rows.nbytes(n_tok, n), 0xAB, cp.uint8)  # poisoned: every byte read must be written
    parts = cp.full(n_tok * n_parts, np.nan, cp.float32)
    return Q8Rows(data, n_tok, n, swizzle, parts, n_parts, EPS)


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [3, 5, MMA8_TOKENS])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1][0]}x{c[1][1]}")
def test_nq_handoff_feeds_the_products_after_the_norm(case, n_tok):
    import cupy as cp

    p_type, (n_out, n_in), r_type, r_out = case
    rng, seed = fresh_rng()
    w, ref_w = weight(p_type, n_out, n_in, rng, True)
    reader, ref_r = weight(r_type, r_out, n_out, rng, True)
    X, x = strided_rows(rng, n_tok, n_in)
    res = rng.standard_normal((n_tok, n_out)).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(n_out)).astype(np.float32)
    n_parts = nq_parts(w, n_tok)
    tiles = _mma_plan(w, None)[2][0] // 32 // _mma_plan(w, None)[4]
    assert n_parts == -(-n_out // (16 * tiles)) and tiles in (2, 4), (n_parts, tiles)
    swz = qt.QUANT[T.Q4_K].x_swizzle
    rows = handoff_rows(n_tok, n_out, n_parts, swz)
    Y = nan_like((n_tok, n_out))
    gemv_mma(w, X, Y, residual=cp.asarray(res), x_q8=None, nq_out=(cp.asarray(norm_w), rows))
    y = Y.get()
    what = f"{p_type} {n_out}x{n_in} -> {r_type}, {n_tok} tokens (seed {seed})"
    ref_y = np.stack([ref_w @ q8_rounded(row) for row in x]) + res
    assert rel_err(y, ref_y) < LIMIT_Q8_ROUNDED, f"{what}: y"

    got_q8 = rows.data.get()
    parts = rows.parts.get().reshape(n_tok, n_parts)
    stride = q8x_bytes(n_out)
    for t in range(n_tok):
        want = q8x_host(y[t] * norm_w, swz)
        assert np.array_equal(got_q8[t * stride : t * stride + want.size], want), f"{what}: token {t}'s handoff bytes"
        ss = float(np.sum(y[t].astype(np.float64) ** 2))
        assert abs(float(parts[t].sum(dtype=np.float64)) - ss) < 1e-5 * ss, f"{what}: token {t}'s sums of squares"

    got = nan_like((n_tok, r_out))
    gemv_mma(reader, nan_like((n_tok, n_out)), got, x_q8=rows)  # X not read
    ref = []
    for t in range(n_tok):
        scale = 1 / np.sqrt(np.float32(parts[t].sum(dtype=np.float32)) / n_out + EPS)
        ref.append(ref_r @ (q8_rounded(y[t] * norm_w) * scale))
    assert rel_err(got.get(), np.stack(ref)) < LIMIT_Q8_ROUNDED, f"{what}: the reader's products"
    # what the handoff stands for: the products of RMSNorm(y) * norm_w, quantized after the norm
    normed = [ref_r @ q8_rounded((y[t] / np.sqrt(np.mean(y[t].astype(np.float64) ** 2) + EPS) * norm_w).astype(np.float32))
              for t in range(n_tok)]
    assert rel_err(got.get(), np.stack(normed)) < 2 * LIMIT_Q8_ROUNDED, f"{what}: against RMSNorm then quantization"


@pytest.mark.cuda
def test_nq_handoff_argument_errors():
    import cupy as cp

    from k4.runtime.cuda.gemv_batch import gemv_batch, gemv_rows

    rng, _ = fresh_rng()
    w, _ = weight("Q4_K", 4096, 4096, rng, True)
    X, _ = strided_rows(rng, 4, 4096)
    Y = nan_like((4, 4096))
    n_parts = nq_parts(w, 4)
    norm_w = cp.ones(4096, cp.float32)
    rows = handoff_rows(4, 4096, n_parts, 1)
    with pytest.raises(ValueError, match="nq_out holds"):
        gemv_mma(w, X, Y, nq_out=(norm_w, handoff_rows(4, 4096, n_parts + 1, 1)))
    with pytest.raises(ValueError, match="norm weights"):
        gemv_mma(w, X, Y, nq_out=(norm_w[:100], rows))
    with pytest.raises(ValueError, match="cannot hand off"):
        gemv_mma(w, X, Y, nq_out=(norm_w, rows), variant=(16, 8))
    assert nq_parts(w, 2) == 0 and nq_parts(w, 9) == 0  # gemv_mma runs 3 to 8 tokens
    with pytest.raises(ValueError, match="gemv_batch does not read an NQ handoff"):
        gemv_batch(w, X[:2], Y[:2], x_q8=handoff_rows(2, 4096, n_parts, 1))
    with pytest.raises(ValueError, match="read only by gemv_mma"):
        gemv_rows(w, X[:2], Y[:2], x_q8=handoff_rows(2, 4096, n_parts, 1))
    with pytest.raises(ValueError, match="parts hold"):
        bad = handoff_rows(4, 4096, n_parts, 1)
        gemv_mma(w, X, Y, x_q8=Q8Rows(bad.data, 4, 4096, 1, bad.parts[:10], n_parts, EPS))


@pytest.mark.cuda
@pytest.mark.parametrize("on", [True, False], ids=["K4_MMA8_NQ=1", "K4_MMA8_NQ=0"])
def test_the_verify_step_hands_each_down_products_output_over(data, on, monkeypatch):
    """stories260K-pad (Q4_K, n_embd 256: its down products run gemv_mma in steps of four tiles):
    with the flag each layer's down product of a verify step hands its output to the next q/k/v
    (the last layer's to the output head) through forward.py's direct gemv_mma call, none without;
    the accepted tokens equal the numpy backend's either way."""
    from tests.test_cuda_speculative import verify_product_calls

    monkeypatch.setenv("K4_MMA8_NQ", str(int(on)))
    n_layer, steps = verify_product_calls(data, monkeypatch)
    for calls in steps:
        residual = [c.get("nq_out") is not None for c in calls if c.get("y_q8") is None]  # not gate/up (K4_MMA8_FFQ8)
        assert all(residual) and len(residual) % n_layer == 0 and (len(residual) > 0) == on, residual
