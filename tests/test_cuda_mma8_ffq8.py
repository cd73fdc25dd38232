"""The verify step's gate/up output handed to the down product quantized (flag K4_MMA8_FFQ8;
gemv_mma y_q8, kernels_cu/mma8_common.cuh mma8_step_nq without norm weights, runtime/cuda/forward.py
ff_rows): a product of 3 to 8 rows on int8 tensor cores whose steps hold whole 32-output groups
also writes its Y quantized, so no quantize_q8_rows kernel runs before the down product.

Limits: exact. y_q8's bytes are quantize_rows's of the Y the same launch wrote (the same float32
values through the same q8_unit), and that Y is bit for bit the Y of the launch without y_q8. The
forward pass with the flag on and off: greedy verify tokens equal the numpy backend's.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda.constants import MMA8_TOKENS
from k4.runtime.cuda.gemv_batch import quantize_rows
from k4.runtime.cuda.q8_handoff import Q8Rows
from k4.runtime.cuda.gemv_mma import _mma_plan, gemv_mma, writes_q8
from tests.matmul_ref import fresh_rng, glu_weight, nan_like, weight
from tests.test_cuda_gemv_batch import strided_rows

SWZ = 1  # any swizzle: the reader (gemv_mma) takes every one
# (type, outputs, n_in, glu): Llama 2 7B's gate/up (steps of four tiles, 32 outputs), TinyLlama's and
# Qwen2.5 7B's; a plain product in steps of two tiles (4096 x 4096 Q4_K, KS 8: 32 outputs) and a
# planar Q6_K one
CASES = [("Q4_K", 11008, 4096, True), ("Q4_K", 5632, 2048, True), ("Q4_K", 18944, 3584, True),
         ("Q4_K", 4096, 4096, False), ("Q6_K", 4096, 4096, False)]


def poisoned_rows(n_tok: int, n: int) -> Q8Rows:
    import cupy as cp

    return Q8Rows(cp.full(Q8Rows.nbytes(n_tok, n), 0xAB, cp.uint8), n_tok, n, SWZ)


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [3, 6, MMA8_TOKENS])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}{'-glu' if c[3] else ''}")
def test_y_q8_is_quantize_rows_of_the_same_y(case, n_tok):
    type_name, n_out, n_in, glu = case
    rng, seed = fresh_rng()
    w = glu_weight(T[type_name], n_out, n_in, rng)[0] if glu else weight(type_name, n_out, n_in, rng, True)[0]
    what = f"{type_name} {n_out}x{n_in}{' glu' if glu else ''}, {n_tok} tokens (seed {seed})"
    assert writes_q8(w, n_tok), f"{what}: plan {_mma_plan(w, None)}"
    X, _ = strided_rows(rng, n_tok, n_in)
    plain, Y = nan_like((n_tok, n_out)), nan_like((n_tok, n_out))
    gemv_mma(w, X, plain)
    got = poisoned_rows(n_tok, n_out)
    gemv_mma(w, X, Y, y_q8=got)
    assert np.array_equal(Y.get(), plain.get()), f"{what}: Y changed by writing y_q8"
    want = poisoned_rows(n_tok, n_out)
    quantize_rows(Y, want)
    assert np.array_equal(got.data.get(), want.data.get()), f"{what}: y_q8 differs from quantize_rows of Y"


@pytest.mark.cuda
def test_y_q8_argument_errors():
    import cupy as cp

    rng, _ = fresh_rng()
    w = glu_weight(T.Q4_K, 5632, 2048, rng)[0]
    X, _ = strided_rows(rng, 4, 2048)
    Y = nan_like((4, 5632))
    with pytest.raises(ValueError, match="y_q8 holds"):
        gemv_mma(w, X, Y, y_q8=poisoned_rows(4, 4096))
    with pytest.raises(ValueError, match="y_q8 holds .* with parts"):
        gemv_mma(w, X, Y, y_q8=Q8Rows(poisoned_rows(4, 5632).data, 4, 5632, SWZ, cp.zeros(64, cp.float32), 16, 1e-5))
    with pytest.raises(ValueError, match="cannot write y_q8"):
        gemv_mma(w, X, Y, y_q8=poisoned_rows(4, 5632), variant=(16, 4))
    assert not writes_q8(w, 2) and not writes_q8(w, MMA8_TOKENS + 1)  # gemv_mma runs 3 to 8 tokens
    # 48 outputs (no whole 32-output group a step); 2048 (KS 8: 16 outputs a step)
    for n_ff, n_in in ((48, 256), (2048, 2048)):
        other = glu_weight(T.Q4_K, n_ff, n_in, rng)[0]
        other.mma8_cluster = False  # in clusters of two (K4_MMA8_CLUSTER) its steps take 32 outputs
        assert not writes_q8(other, 4), (n_ff, _mma_plan(other, None))
        with pytest.raises(ValueError, match="cannot write y_q8"):
            gemv_mma(other, strided_rows(rng, 4, n_in)[0], nan_like((4, n_ff)), y_q8=poisoned_rows(4, n_ff))


@pytest.mark.cuda
@pytest.mark.parametrize("on", [True, False], ids=["K4_MMA8_FFQ8=1", "K4_MMA8_FFQ8=0"])
def test_the_verify_step_hands_gate_up_output_to_down(data, on, monkeypatch):
    """stories260K-pad (Q4_K, n_ff 256: its gate/up products run gemv_mma in steps of four tiles):
    with the flag each layer's gate/up product of a verify step writes y_q8 for its down product,
    none without; the accepted tokens equal the numpy backend's either way."""
    from tests.test_cuda_speculative import verify_product_calls

    monkeypatch.setenv("K4_MMA8_FFQ8", str(int(on)))
    n_layer, steps = verify_product_calls(data, monkeypatch)
    for calls in steps:
        made = sum(c.get("y_q8") is not None for c in calls)
        assert made == (n_layer if on else 0), made
