"""gemv_batch (runtime/cuda/gemv_batch.py, kernels_cu/gemv_batch.cu): up to 8 tokens per read of
a quantized weight, against gemv on each token alone and against numpy.

Against gemv: EXACT equality, bit for bit. The batched kernel quantizes each x row as gemv_q8
does (the same q8_unit), and each output's lane sums run over the same chunks in the same order
with the same warp_sum, so nothing may differ; a failure here means the kernel broke that
design (fix the kernel, do not loosen the test). Against numpy (gguf's dequantize, float64 with
x rounded as the kernels round it, q8_rounded): the gemv limits of tests/matmul_ref.py,
1e-4 relative L2 (2e-4 for the gate/up epilogue, whose act and product add one rounding each).
Inputs are seeded by the test id; outputs are poisoned with NaN, and the columns around a
strided Y view must stay NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import layout as lay
from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda import q8_handoff as hand
from k4.runtime.cuda import quant_kernels as qk
from k4.runtime.cuda import quant_types as qt
from k4.runtime.cuda.device_weight import make_weight
from k4.runtime.cuda.gemv_batch import gemv_batch, gemv_rows
from k4.runtime.cuda.matrix_jobs import compile_jobs
from k4.runtime.cuda.microbench import random_weight
from k4.runtime.trace import Trace
from tests.matmul_ref import GLU_REF, LIMIT_Q8_ROUNDED, QUANTIZED, fresh_rng, glu_weight, nan_like, q8_rounded, rel_err, weight

LAYOUTS = pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])


def shapes(type_name: str) -> list[tuple[int, int]]:
    """(n_out, n_in): an odd n_out (the last row group of two is half empty), a few rows of many
    chunks, and n_in 11008 (8 q8 x vectors: 121 KB of shared memory, past the 48 KB default)."""
    block = GGML_QUANT_SIZES[T[type_name]][0]
    return [(301, 3 * block), (37, 8 * block), (40, 11008)]


def strided_rows(rng, n_tok: int, n_in: int):
    """(X, host copy): X (n_tok, n_in) float32 rows of a wider device array (rows 16-byte aligned,
    not contiguous as a whole)."""
    import cupy as cp

    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    wide = cp.zeros((n_tok, n_in + 8), cp.float32)
    wide[:, :n_in] = cp.asarray(x)
    return wide[:, :n_in], x


def column_view(n_tok: int, n_out: int):
    """(wide, Y): Y is columns 3 .. 3 + n_out of a NaN (n_tok, n_out + 5) array, as forward.py's
    q/k/v column views are; rows n_out + 5 floats apart, not 16-byte aligned."""
    wide = nan_like((n_tok, n_out + 5))
    return wide, wide[:, 3 : 3 + n_out]


def assert_outside_untouched(wide, n_out: int) -> None:
    w = wide.get()
    assert np.isnan(w[:, :3]).all() and np.isnan(w[:, 3 + n_out :]).all(), "wrote outside the Y view"


def per_token(w, X, n_out: int, **kw) -> np.ndarray:
    """gemv on each row of X alone (the bit-exact reference), (n_tok, n_out)."""
    import cupy as cp

    rows = []
    for t in range(X.shape[0]):
        y = nan_like(n_out)
        res = kw.get("residual")
        extra = dict(kw, residual=None if res is None else cp.array(res[t]))
        mm.gemv(w, cp.ascontiguousarray(X[t]), y, **extra)
        rows.append(y.get())
    return np.stack(rows)


@pytest.mark.cuda
@LAYOUTS
@pytest.mark.parametrize("type_name", QUANTIZED)
def test_gemv_batch_equals_gemv_per_token_bit_for_bit(type_name, repack):
    rng, seed = fresh_rng()
    for n_out, n_in in shapes(type_name):
        w, ref_w = weight(type_name, n_out, n_in, rng, repack)
        X, x = strided_rows(rng, qk.BATCH_TOKENS, n_in)
        want = per_token(w, X, n_out)
        for n_tok in range(1, qk.BATCH_TOKENS + 1):
            wide, Y = column_view(n_tok, n_out)
            gemv_batch(w, X[:n_tok], Y)
            got = Y.get()
            case = f"{type_name} {n_out}x{n_in} n_tok {n_tok} (seed {seed})"
            assert np.array_equal(got, want[:n_tok]), f"{case}: differs from gemv per token"
            assert_outside_untouched(wide, n_out)
            ref = np.stack([ref_w @ q8_rounded(row) for row in x[:n_tok]])
            assert rel_err(got, ref) < LIMIT_Q8_ROUNDED, case


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", QUANTIZED)
def test_gemv_batch_residual_and_bias(type_name):
    """bias shared by all rows, residual per row: separate, and aliasing Y (in place)."""
    import cupy as cp

    rng, seed = fresh_rng()
    n_out, n_in = shapes(type_name)[0]
    w, ref_w = weight(type_name, n_out, n_in, rng, True)
    for n_tok in (2, 5, qk.BATCH_TOKENS):
        X, x = strided_rows(rng, n_tok, n_in)
        r = rng.standard_normal((n_tok, n_out)).astype(np.float32)
        b = rng.standard_normal(n_out).astype(np.float32)
        want = per_token(w, X, n_out, residual=r, bias=cp.asarray(b))
        ref = np.stack([ref_w @ q8_rounded(row) for row in x]) + r + b
        case = f"{type_name} n_tok {n_tok} (seed {seed})"

        wide, Y = column_view(n_tok, n_out)
        gemv_batch(w, X, Y, residual=cp.asarray(r), bias=cp.asarray(b))
        assert np.array_equal(Y.get(), want), f"{case}: residual + bias differ from gemv"
        assert rel_err(Y.get(), ref) < LIMIT_Q8_ROUNDED, case

        wide, Y = column_view(n_tok, n_out)
        Y[...] = cp.asarray(r)
        gemv_batch(w, X, Y, residual=Y, bias=cp.asarray(b))
        assert np.array_equal(Y.get(), want), f"{case}: in-place residual differs from gemv"
        assert_outside_untouched(wide, n_out)


@pytest.mark.cuda
@pytest.mark.parametrize("act", list(GLU_REF))
@LAYOUTS
@pytest.mark.parametrize("type_name", QUANTIZED)
def test_gemv_batch_glu_epilogue(type_name, repack, act):
    """A gate/up interleaved weight: Y[t] = act(gate x_t) * (up x_t), act silu or gelu_tanh."""
    rng, seed = fresh_rng()
    n_ff, n_in = shapes(type_name)[0]
    w, ref_g, ref_u = glu_weight(T[type_name], n_ff, n_in, rng, repack, act)
    X, x = strided_rows(rng, qk.BATCH_TOKENS, n_in)
    want = per_token(w, X, n_ff)
    f = GLU_REF[act]
    for n_tok in range(1, qk.BATCH_TOKENS + 1):
        Y = nan_like((n_tok, n_ff))
        gemv_batch(w, X[:n_tok], Y)
        case = f"{type_name} {act} n_tok {n_tok} (seed {seed})"
        assert np.array_equal(Y.get(), want[:n_tok]), f"{case}: differs from gemv per token"
        ref = np.stack([f(ref_g @ q8_rounded(row)) * (ref_u @ q8_rounded(row)) for row in x[:n_tok]])
        assert rel_err(Y.get(), ref) < 2 * LIMIT_Q8_ROUNDED, case
    with pytest.raises(ValueError, match="no residual"):
        gemv_batch(w, X[:2], Y[:2], residual=Y[:2])


@pytest.mark.cuda
@pytest.mark.parametrize("tensor_cores", [True, False])
def test_matmul_runs_few_tokens_through_gemv_batch(tensor_cores):
    """matmul of 2..GEMV_MAX_TOKENS tokens (and of any number with K4_PREFILL_TC=0) launches one
    gemv_batch per 8 tokens, with gemv's results; forward.py's gate/up path likewise (gemv_rows)."""
    import cupy as cp

    rng, seed = fresh_rng()
    w, _ = weight("Q4_K", 300, 512, rng, True)
    w.prefill_tc, w.mma8 = tensor_cores, False  # with K4_MMA8 these go to gemv_mma (tests/test_cuda_gemv_mma.py)
    for n_tok in (2, mm.GEMV_MAX_TOKENS) if tensor_cores else (19,):
        X = cp.asarray(rng.standard_normal((n_tok, 512)).astype(np.float32))
        trace = Trace()
        Y = nan_like((n_tok, 300))
        mm.matmul(w, X, Y, trace=trace)
        assert trace.get("load").launches == -(-n_tok // qk.BATCH_TOKENS)
        assert np.array_equal(Y.get(), per_token(w, X, 300)), f"n_tok {n_tok} (seed {seed})"
    glu, _, _ = glu_weight(T.Q6_K, 64, 256, rng)
    glu.mma8 = False  # with K4_MMA8 these go to gemv_mma (tests/test_cuda_gemv_mma.py)
    X = cp.asarray(rng.standard_normal((11, 256)).astype(np.float32))
    Y = nan_like((11, 64))
    gemv_rows(glu, X, Y)
    assert np.array_equal(Y.get(), per_token(glu, X, 64)), f"gate/up (seed {seed})"


@pytest.mark.cuda
def test_gemv_batch_argument_errors():
    import cupy as cp

    rng = np.random.default_rng(0)
    w, _ = weight("Q4_K", 64, 256, rng, True)
    f32, _ = weight("F32", 64, 256, rng, True)
    X, Y = cp.zeros((4, 256), cp.float32), cp.zeros((4, 64), cp.float32)
    with pytest.raises(ValueError, match="quantized weights"):
        gemv_batch(f32, X, Y)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        gemv_batch(w, cp.zeros((9, 256), cp.float32), cp.zeros((9, 64), cp.float32))
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv_batch(w, cp.zeros((4, 260), cp.float32)[:, 1:257], Y)
    with pytest.raises(ValueError, match="shape"):
        gemv_batch(w, X, cp.zeros((4, 63), cp.float32))
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv_batch(w, X, cp.zeros((64, 4), cp.float32).T)
    base = cp.zeros((8, 64), cp.float32)
    with pytest.raises(ValueError, match="Y itself"):
        gemv_batch(w, X, base[::2], residual=base[:4])
    with pytest.raises(ValueError, match="shape"):
        gemv_batch(w, X, Y, bias=cp.zeros(63, cp.float32))


def test_batch_instances_compile_with_the_model_types_one_module_each():
    """gemv_batch.cu's instances for a model: per quantized type both layouts, plain and SwiGLU,
    GeGLU only for a gelu_tanh model, none for float types, each its own module (compiled in
    parallel); NT is BATCH_TOKENS, at least the most tokens matmul multiplies without tensor
    cores (GEMV_MAX_TOKENS; with K4_PREFILL_TC=0 matmul batches rows BATCH_TOKENS at a time)."""
    assert qk.GEMV_MAX_TOKENS <= qk.BATCH_TOKENS == 8
    assert (qk._gemv_batch_name(T.Q6_K, True, (8, 1, 1, 2), True)
            == "gemv_q8_batch<type_q6_K, true, 8, 1, true, 2, 8, true>")
    jobs = lambda act: [g for f, g, _ in compile_jobs([T.Q4_K, T.F16], True, act) if f == "gemv_batch.cu"]  # noqa: E731
    silu = jobs("silu")
    assert all(len(g) == 1 and g[0].startswith("gemv_q8_batch<type_q4_K, ") for g in silu) and len(silu) == 4
    assert sorted(n.endswith("true>") for (n,) in silu) == [False, False, True, True]  # plain, glu
    gelu = jobs("gelu_tanh")
    assert gelu[:4] == silu and len(gelu) == 6 and all(n.endswith("true, true>") for (n,) in gelu[4:])
    assert all(qk.GROUPS["gemv_batch.cu"][n] == (n,) for (n,) in gelu)
    assert set(qk.BATCH_VARIANT) == set(qt.QUANT)


@pytest.mark.cuda
def test_bench_gemv_batch_times_every_token_count_against_gemv():
    from k4.runtime.cuda.microbench import bench_gemv_batch

    r = bench_gemv_batch("Q4_K", 512, 1024, (1, 8), iters=20)
    assert r["gemv_us"] > 0 and [row["n_tok"] for row in r["rows"]] == [1, 8]
    assert all(row["us"] > 0 and row["ratio"] == row["us"] / r["gemv_us"] and row["tb_s"] > 0 for row in r["rows"])
    assert bench_gemv_batch("Q6_K", 512, 1024, (3,), iters=20, glu=True)["rows"][0]["us"] > 0
    with pytest.raises(ValueError, match="quantized"):
        bench_gemv_batch("F16", 64, 256)
    with pytest.raises(ValueError, match="1 to 8"):
        bench_gemv_batch("Q4_K", 64, 256, (9,))


@pytest.mark.cuda
@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
@pytest.mark.parametrize("type_name,variant", [(t.name, v) for t, vs in qk.EXTRA_BATCH_VARIANTS.items() for v in vs])
def test_gemv_batch_variants_equal_the_default(type_name, variant, glu):
    """The bench group's instances (other WARPS, U, R) give the default instance's bits."""
    import cupy as cp

    rng, seed = fresh_rng()
    t = random_weight(T[type_name], 778, 1536, rng)
    w = make_weight(t, cp.asarray(lay.weight_layout(t, True)), True, glu=glu)
    X, _ = strided_rows(rng, qk.BATCH_TOKENS, 1536)
    n_y = 389 if glu else 778
    want, got = nan_like((qk.BATCH_TOKENS, n_y)), nan_like((qk.BATCH_TOKENS, n_y))
    gemv_batch(w, X, want)
    gemv_batch(w, X, got, variant=variant)
    assert np.array_equal(got.get(), want.get()), f"{type_name} {variant} (seed {seed})"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "IQ4_NL"])
def test_x_quantized_once_gives_the_same_bytes_and_products(type_name):
    """quantize_rows writes each row's q8 x exactly as q8_handoff.q8x_host (the reference of gemv's
    q8 handoff) lays it out for the weight's swizzle, and gemv_batch given it (x_q8) produces
    the bits it produces from the float rows; a q8 x of another swizzle or row count is refused."""
    import cupy as cp

    from k4.runtime.cuda.gemv_batch import quantize_rows
    from k4.runtime.cuda.q8_handoff import Q8Rows

    rng, seed = fresh_rng()
    n_out, n_in = shapes(type_name)[2]
    w, _ = weight(type_name, n_out, n_in, rng, True)
    swizzle = qt.QUANT[T[type_name]].x_swizzle
    for n_tok in (1, 3, qk.BATCH_TOKENS):
        X, x = strided_rows(rng, n_tok, n_in)
        X[n_tok // 2, :32] = 0  # an all-zero group: d 0
        x[n_tok // 2, :32] = 0
        q8 = Q8Rows(cp.zeros(Q8Rows.nbytes(n_tok, n_in), cp.uint8), n_tok, n_in, swizzle)
        quantize_rows(X, q8)
        assert np.array_equal(q8.data.get(), np.concatenate([hand.q8x_host(row, swizzle) for row in x])), f"n_tok {n_tok}"
        want, got = nan_like((n_tok, n_out)), nan_like((n_tok, n_out))
        gemv_batch(w, X, want)
        gemv_batch(w, nan_like((n_tok, n_in)), got, x_q8=q8)  # X not read
        assert np.array_equal(got.get(), want.get()), f"{type_name} n_tok {n_tok} (seed {seed})"
    other = Q8Rows(q8.data, n_tok, n_in, swizzle + 1)
    with pytest.raises(ValueError, match="swizzle"):
        gemv_batch(w, X, got, x_q8=other)
    with pytest.raises(ValueError, match="rows"):
        gemv_batch(w, X[:2], got[:2], x_q8=q8)
