"""Prefill's dequant-matmul (runtime/cuda/matmul.py matmul: tensor cores, its few-token gemv path,
fp16 inputs and weight copies, GLU weights, scratch), the embedding rows (dequant_rows, exact) and
the product microbenchmarks, against numpy: gguf's dequantize of random valid blocks, then a
float64 product. Error limits and inputs: tests/matmul_ref.py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda.dequant import dequant_rows
from k4.runtime.cuda.microbench import bench_gemv, bench_matmul
from tests.matmul_ref import (FLOATS, LIMIT_F32, LIMIT_FP16, LIMIT_Q8_ROUNDED, QUANTIZED, fresh_rng, glu_weight, nan_like, q8_rounded,
                              rel_err, shapes, weight)

# ---- prefill: matmul ---------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("type_name", QUANTIZED + FLOATS)
def test_matmul_matches_numpy(type_name, monkeypatch):
    import cupy as cp

    monkeypatch.setattr(mm, "DEQUANT_CHUNK_BYTES", 128 * 2 * 1024)  # several row chunks below
    rng, seed = fresh_rng()
    limit = LIMIT_F32 if type_name == "F32" else LIMIT_FP16
    for n_out, n_in in shapes(type_name)[1:]:
        w, ref_w = weight(type_name, n_out, n_in, rng, True)
        w.mma8 = False  # 5 tokens of Q4_K/Q6_K: the tensor-core path, not gemv_mma (tests/test_cuda_gemv_mma.py)
        for n_tok in (5, 67):
            X = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            Y = nan_like((n_tok, n_out))
            scratch = cp.empty(max(1, mm.matmul_scratch_bytes([w], n_tok)), cp.uint8)
            mm.matmul(w, cp.asarray(X), Y, scratch=scratch)
            got = Y.get()
            assert np.isfinite(got).all(), f"{type_name} {n_tok}x{n_out}x{n_in}: unwritten outputs (seed {seed})"
            err = rel_err(got, X.astype(np.float64) @ ref_w.T)
            assert err < limit, f"{type_name} {n_tok}x{n_out}x{n_in}: relative error {err:.2e} (seed {seed})"


@pytest.mark.cuda
def test_matmul_epilogues():
    import cupy as cp

    rng, seed = fresh_rng()
    n_tok, n_out, n_in = 33, 300, 512
    w, ref_w = weight("Q4_K", n_out, n_in, rng, True)
    X = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    R = rng.standard_normal((n_tok, n_out)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    ref = X.astype(np.float64) @ ref_w.T
    scratch = cp.empty(mm.matmul_scratch_bytes([w], n_tok), cp.uint8)
    dX = cp.asarray(X)

    Y = nan_like((n_tok, n_out))
    mm.matmul(w, dX, Y, residual=cp.asarray(R), bias=cp.asarray(b), scratch=scratch)
    assert rel_err(Y.get(), ref + R + b) < LIMIT_FP16, f"residual + bias (seed {seed})"

    Y = cp.asarray(R)
    mm.matmul(w, dX, Y, residual=Y, bias=cp.asarray(b), scratch=scratch)
    assert rel_err(Y.get(), ref + R + b) < LIMIT_FP16, f"in-place residual + bias (seed {seed})"


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok,tensor_cores", [(mm.GEMV_MAX_TOKENS, True), (9, False)])
def test_matmul_gemv_path(n_tok, tensor_cores):
    import cupy as cp

    rng, seed = fresh_rng()
    w, ref_w = weight("Q6_K", 300, 512, rng, True)
    w.prefill_tc = tensor_cores
    assert mm.matmul_scratch_bytes([w], n_tok) == 0
    X = rng.standard_normal((n_tok, 512)).astype(np.float32)
    R = rng.standard_normal((n_tok, 300)).astype(np.float32)
    Y = cp.asarray(R)
    mm.matmul(w, cp.asarray(X), Y, residual=Y)
    ref = np.stack([ref_w @ q8_rounded(row) for row in X]) + R
    assert rel_err(Y.get(), ref) < LIMIT_Q8_ROUNDED, f"seed {seed}"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "BF16"])
def test_matmul_fp16_input_and_fp16_weight_copy(type_name):
    """X given in fp16, W from the fp16 copy made by make_half: the same products (and the
    copy holds gguf's dequantized values, rounded to fp16)."""
    import cupy as cp

    rng, seed = fresh_rng()
    n_tok, n_out, n_in = 37, 300, 512
    w, ref_w = weight(type_name, n_out, n_in, rng, True)
    X = rng.standard_normal((n_tok, n_in)).astype(np.float16)
    ref = X.astype(np.float64) @ ref_w.T
    scratch = cp.empty(mm.matmul_scratch_bytes([w], n_tok), cp.uint8)
    assert mm.takes_half(w, n_tok) and not mm.takes_half(w, mm.GEMV_MAX_TOKENS)
    Y = nan_like((n_tok, n_out))
    mm.matmul(w, cp.asarray(X), Y, scratch=scratch)
    assert rel_err(Y.get(), ref) < LIMIT_FP16, f"fp16 X (seed {seed})"
    half = cp.full((n_out, n_in), cp.nan, cp.float16)
    mm.make_half(w, half)
    assert np.array_equal(half.get(), ref_w.astype(np.float16))
    Y = nan_like((n_tok, n_out))
    mm.matmul(w, cp.asarray(X), Y)  # no scratch needed any more
    assert rel_err(Y.get(), ref) < LIMIT_FP16, f"fp16 copy (seed {seed})"
    with pytest.raises(ValueError, match="takes float32 X"):
        mm.matmul(w, cp.zeros((2, n_in), cp.float16), cp.zeros((2, n_out), cp.float32))


@pytest.mark.cuda
def test_matmul_of_a_glu_weight_gives_interleaved_products():
    import cupy as cp

    rng, seed = fresh_rng()
    w, ref_g, ref_u = glu_weight(T.Q4_K, 300, 512, rng)
    X = rng.standard_normal((9, 512)).astype(np.float32)
    Y = nan_like((9, 600))
    mm.matmul(w, cp.asarray(X), Y, scratch=cp.empty(mm.matmul_scratch_bytes([w], 9), cp.uint8))
    ref = X.astype(np.float64) @ np.stack([ref_g, ref_u], axis=1).reshape(600, 512).T  # rows gate 0, up 0, gate 1, ...
    assert rel_err(Y.get(), ref) < LIMIT_FP16, f"seed {seed}"
    with pytest.raises(ValueError, match="runs through gemv"):
        mm.matmul(w, cp.asarray(X[:2]), Y[:2])


@pytest.mark.cuda
def test_matmul_needs_scratch():
    import cupy as cp

    w, _ = weight("Q4_K", 300, 512, np.random.default_rng(0), True)
    X, Y = cp.zeros((16, 512), cp.float32), cp.zeros((16, 300), cp.float32)
    need = mm.matmul_scratch_bytes([w], 16)
    assert need >= 16 * 512 * 2 + 300 * 512 * 2
    with pytest.raises(ValueError, match="scratch"):
        mm.matmul(w, X, Y, scratch=cp.empty(need - 1, cp.uint8))


# ---- embeddings: dequant_rows --------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("type_name", QUANTIZED + FLOATS)
def test_dequant_rows_is_exact(type_name, repack):
    import cupy as cp

    rng, seed = fresh_rng()
    n_out, n_in = shapes(type_name)[2]
    w, ref_w = weight(type_name, n_out, n_in, rng, repack)
    ids = rng.integers(0, n_out, size=9).astype(np.int32)
    ids[:2] = [0, n_out - 1]
    ids[-1] = ids[2]
    out = nan_like((9, n_in))
    dequant_rows(w, cp.asarray(ids), out)
    assert np.array_equal(out.get(), ref_w[ids].astype(np.float32)), f"{type_name} repack={repack} (seed {seed})"
    # gemma's embedding scale inside the launch: numpy's one float32 product per value, over
    # 301 rows (many thread blocks, the last one partly idle)
    ids = rng.integers(0, n_out, size=301).astype(np.int32)
    out = nan_like((301, n_in))
    dequant_rows(w, cp.asarray(ids), out, scale=61.96773)
    want = ref_w[ids].astype(np.float32) * np.float32(61.96773)
    assert np.array_equal(out.get(), want), f"{type_name} repack={repack} scaled (seed {seed})"


# ---- microbenchmarks ---------------------------------------------------------------------------

@pytest.mark.cuda
def test_bench_gemv_and_matmul_report_rates():
    r = bench_gemv("Q4_K", 512, 1024, iters=20)
    assert r["bytes"] == 512 * 1024 // 256 * 144 + 4 * (512 + 1024)
    assert r["us"] > 0 and r["gb_s"] == pytest.approx(r["bytes"] / r["us"] / 1e3)
    q = bench_gemv("Q6_K", 512, 1024, iters=20, x_q8=True)
    assert q["bytes"] == 512 * 1024 // 256 * 210 + mm.q8x_bytes(1024) + 4 * 512 and q["us"] > 0
    with pytest.raises(ValueError, match="float x"):
        bench_gemv("F16", 64, 256, x_q8=True)
    m = bench_matmul("Q4_K", 64, 512, 1024, iters=5)
    assert m["us"] > 0 and m["tok_s"] == pytest.approx(64 / m["us"] * 1e6)
    with pytest.raises(ValueError, match="no CUDA kernels"):
        bench_gemv("Q4_1", 256, 256)
