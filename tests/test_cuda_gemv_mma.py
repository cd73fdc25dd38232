"""gemv_mma (runtime/cuda/gemv_mma.py, kernels_cu/gemv_mma_staged.cu and gemv_mma.cu): up to 8 tokens per read of a Q4_K
or Q6_K weight on int8 tensor cores, against numpy and against gemv on each token alone; its
selection by matmul (flag K4_MMA8).

Limits (relative L2). Against numpy (gguf's dequantize, float64, x rounded to 8 bits per 32
values as the kernels round it, q8_rounded): 1e-4, the gemv and gemv_batch limit
(tests/test_cuda_matmul.py LIMIT_Q8_ROUNDED); 2e-4 for the gate/up epilogue. The mma's integer
dots are exact and x is quantized exactly as gemv quantizes it, so what differs from gemv is
the float epilogue's order of summation: against gemv per token 1e-5 (float32 sums over up to
11008 products give a few 1e-7). Inputs are seeded by the test id; outputs are poisoned with
NaN, and the columns around a strided Y view must stay NaN.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from k4.runtime.cuda import gemv_batch as gb
from k4.runtime.cuda import layout as lay
from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda import quant_kernels as qk
from k4.runtime.cuda import quant_types as qt
from k4.runtime.cuda.constants import MMA8_TOKENS
from k4.runtime.cuda.device_weight import make_weight
from k4.runtime.cuda.gemv_mma import gemv_mma, uses_mma8
from k4.runtime.cuda.matrix_jobs import compile_jobs
from k4.runtime.cuda.microbench import random_weight
from k4.runtime.flags import Flags
from k4.runtime.trace import Trace
from tests.helpers_matmul import interleave_rows
from tests.test_cuda_gemv_batch import assert_outside_untouched, column_view, per_token, strided_rows
from tests.matmul_ref import GLU_REF, LIMIT_Q8_ROUNDED, fresh_rng, nan_like, q8_rounded, rel_err, weight

TYPES = pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
LIMIT_VS_GEMV = 1e-5
# (n_out, n_in): the 7B's q/k/v-sized square, gate/up-sized and down-sized products, and an
# n_out that is neither a multiple of 16 (a tile) nor of 32 (a step of two tiles)
REAL = [(4096, 4096), (11008, 4096), (4096, 11008)]
ODD = (301, 1024)


def assert_products(w, ref_w, X, x, n_out: int, case: str) -> None:
    """gemv_mma of 1..8 rows of X into a column view of NaNs: within the limits of numpy and of
    gemv per token, nothing written beside the view."""
    want = per_token(w, X, n_out)
    for n_tok in range(1, MMA8_TOKENS + 1):
        wide, Y = column_view(n_tok, n_out)
        gemv_mma(w, X[:n_tok], Y)
        got = Y.get()
        assert np.isfinite(got).all(), f"{case} n_tok {n_tok}: unwritten outputs"
        assert_outside_untouched(wide, n_out)
        ref = np.stack([ref_w @ q8_rounded(row) for row in x[:n_tok]])
        assert rel_err(got, ref) < LIMIT_Q8_ROUNDED, f"{case} n_tok {n_tok}: {rel_err(got, ref):.2e} from numpy"
        assert rel_err(got, want[:n_tok]) < LIMIT_VS_GEMV, f"{case} n_tok {n_tok}: {rel_err(got, want[:n_tok]):.2e} from gemv"


@pytest.mark.cuda
@TYPES
@pytest.mark.parametrize("shape", REAL, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_mma_matches_numpy_on_real_shapes(type_name, shape):
    rng, seed = fresh_rng()
    w, ref_w = weight(type_name, *shape, rng, True)
    X, x = strided_rows(rng, MMA8_TOKENS, shape[1])
    assert_products(w, ref_w, X, x, shape[0], f"{type_name} {shape} (seed {seed})")


@pytest.mark.cuda
@TYPES
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
def test_gemv_mma_odd_rows_both_layouts(type_name, repack):
    """301 rows: the last step's tiles are partly past the matrix (rows loaded again, not written)."""
    rng, seed = fresh_rng()
    w, ref_w = weight(type_name, *ODD, rng, repack)
    X, x = strided_rows(rng, MMA8_TOKENS, ODD[1])
    X[3, :64] = 0  # an all-zero sub-block: scale 0
    x[3, :64] = 0
    assert_products(w, ref_w, X, x, ODD[0], f"{type_name} {ODD} repack {repack} (seed {seed})")


@pytest.mark.cuda
@TYPES
def test_gemv_mma_residual_and_bias(type_name):
    """bias shared by all rows, residual per row: separate, and aliasing Y (in place)."""
    import cupy as cp

    rng, seed = fresh_rng()
    n_out, n_in = ODD
    w, ref_w = weight(type_name, n_out, n_in, rng, True)
    for n_tok in (2, 5, MMA8_TOKENS):
        X, x = strided_rows(rng, n_tok, n_in)
        r = rng.standard_normal((n_tok, n_out)).astype(np.float32)
        b = rng.standard_normal(n_out).astype(np.float32)
        ref = np.stack([ref_w @ q8_rounded(row) for row in x]) + r + b
        case = f"{type_name} n_tok {n_tok} (seed {seed})"

        wide, Y = column_view(n_tok, n_out)
        gemv_mma(w, X, Y, residual=cp.asarray(r), bias=cp.asarray(b))
        assert rel_err(Y.get(), ref) < LIMIT_Q8_ROUNDED, case

        wide, Y = column_view(n_tok, n_out)
        Y[...] = cp.asarray(r)
        gemv_mma(w, X, Y, residual=Y, bias=cp.asarray(b))
        assert rel_err(Y.get(), ref) < LIMIT_Q8_ROUNDED, f"{case}: in place"
        assert_outside_untouched(wide, n_out)


@pytest.mark.cuda
@pytest.mark.parametrize("act", list(GLU_REF))
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@TYPES
def test_gemv_mma_glu_epilogue(type_name, repack, act):
    """A gate/up interleaved weight: Y[t] = act(gate x_t) * (up x_t), act silu or gelu_tanh; 150
    outputs (300 weight rows: the last tile half past the matrix)."""
    import cupy as cp

    rng, seed = fresh_rng()
    n_ff, n_in = 150, 1024
    gate, up = (random_weight(T[type_name], n_ff, n_in, rng) for _ in range(2))
    t = interleave_rows(gate, up, "ffn_gate_up")
    w = make_weight(t, cp.asarray(lay.weight_layout(t, repack)), repack, glu=True, glu_act=act)
    ref_g, ref_u = (dequantize(p.raw_bytes(), p.ggml_type).astype(np.float64) for p in (gate, up))
    X, x = strided_rows(rng, MMA8_TOKENS, n_in)
    want = per_token(w, X, n_ff)
    f = GLU_REF[act]
    for n_tok in range(1, MMA8_TOKENS + 1):
        Y = nan_like((n_tok, n_ff))
        gemv_mma(w, X[:n_tok], Y)
        case = f"{type_name} {act} n_tok {n_tok} (seed {seed})"
        ref = np.stack([f(ref_g @ q8_rounded(row)) * (ref_u @ q8_rounded(row)) for row in x[:n_tok]])
        assert rel_err(Y.get(), ref) < 2 * LIMIT_Q8_ROUNDED, case
        assert rel_err(Y.get(), want[:n_tok]) < 2 * LIMIT_VS_GEMV, f"{case}: from gemv"
    with pytest.raises(ValueError, match="no residual"):
        gemv_mma(w, X[:2], Y[:2], residual=Y[:2])


@pytest.mark.cuda
@TYPES
def test_x_quantized_once_gives_the_same_products(type_name):
    """gemv_mma given X quantized by quantize_rows (x_q8), in the weight type's swizzle or any
    other, stages the quants and scales its own quantization makes: the same bits of Y, X not
    read; an x_q8 of other rows is refused."""
    import cupy as cp

    from k4.runtime.cuda.gemv_batch import quantize_rows
    from k4.runtime.cuda.q8_handoff import Q8Rows

    rng, seed = fresh_rng()
    n_out, n_in = ODD
    w, _ = weight(type_name, n_out, n_in, rng, True)
    swizzle = qt.QUANT[T[type_name]].x_swizzle
    for n_tok, swz in ((1, swizzle), (3, 3), (MMA8_TOKENS, swizzle), (MMA8_TOKENS, 0)):
        X, _ = strided_rows(rng, n_tok, n_in)
        X[n_tok // 2, :32] = 0  # an all-zero sub-block: d 0
        q8 = Q8Rows(cp.zeros(Q8Rows.nbytes(n_tok, n_in), cp.uint8), n_tok, n_in, swz)
        quantize_rows(X, q8)
        want, got = nan_like((n_tok, n_out)), nan_like((n_tok, n_out))
        gemv_mma(w, X, want)
        gemv_mma(w, nan_like((n_tok, n_in)), got, x_q8=q8)  # X not read
        assert np.array_equal(got.get(), want.get()), f"{type_name} n_tok {n_tok} swizzle {swz} (seed {seed})"
    with pytest.raises(ValueError, match="x_q8 holds"):
        gemv_mma(w, X[:2], got[:2], x_q8=q8)


_VARIANTS = ([("Q6_K", False, (w, ks)) for w in (12, 8) for ks in (0, 4, w)]  # the register kernel, raw
             + [(t.name, True, (w, ks, st)) for t in qk.MMA8_DECODERS for w in qk.MMA8_KERNELS[t][0][2] for ks, st in ((w, 0), (4, 2), (4, 3))])


@pytest.mark.cuda
@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
@pytest.mark.parametrize("type_name,planar,variant", _VARIANTS)
def test_gemv_mma_variants_agree_with_the_default(type_name, planar, variant, glu):
    """The bench group's instances (other WARPS), other splits of a tile's blocks (KS) and ring
    depths (STAGES) sum the same partials in another grouping."""
    import cupy as cp

    rng, seed = fresh_rng()
    t = random_weight(T[type_name], 778, 1536, rng)
    w = make_weight(t, cp.asarray(lay.weight_layout(t, planar)), planar, glu=glu)
    X, _ = strided_rows(rng, MMA8_TOKENS, 1536)
    n_y = 389 if glu else 778
    want, got = nan_like((MMA8_TOKENS, n_y)), nan_like((MMA8_TOKENS, n_y))
    gemv_mma(w, X, want)
    gemv_mma(w, X, got, variant=variant)
    assert rel_err(got.get(), want.get()) < LIMIT_VS_GEMV, f"{type_name} {variant} (seed {seed})"


@pytest.mark.cuda
@pytest.mark.parametrize("mma8", [True, False], ids=["K4_MMA8=1", "K4_MMA8=0"])
@TYPES
def test_matmul_takes_gemv_mma_for_3_to_8_tokens_with_the_flag(type_name, mma8, monkeypatch):
    """With K4_MMA8 matmul runs MMA8_MIN_TOKENS .. 8 tokens of Q4_K/Q6_K as one gemv_mma launch
    and fewer as gemv_batch; without it up to GEMV_MAX_TOKENS as gemv_batch, more on fp16 tensor
    cores. Either way within the limits of its path against numpy."""
    import cupy as cp

    calls = []
    real = gb.gemv_mma
    monkeypatch.setattr(gb, "gemv_mma", lambda *a, **k: (calls.append(a[1].shape[0]), real(*a, **k)))
    rng, seed = fresh_rng()
    n_out, n_in = ODD
    w, ref_w = weight(type_name, n_out, n_in, rng, True)
    w.mma8 = mma8
    for n_tok in range(2, MMA8_TOKENS + 1):
        X = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        Y, trace = nan_like((n_tok, n_out)), Trace()
        mm.matmul(w, cp.asarray(X), Y, scratch=cp.empty(max(1, mm.matmul_scratch_bytes([w], n_tok)), cp.uint8), trace=trace)
        tensor_cores = not mma8 and n_tok > mm.GEMV_MAX_TOKENS
        ref = X.astype(np.float64) @ ref_w.T if tensor_cores else np.stack([ref_w @ q8_rounded(row) for row in X])
        limit = 2e-3 if tensor_cores else LIMIT_Q8_ROUNDED  # tests/test_cuda_matmul.py LIMIT_FP16
        assert rel_err(Y.get(), ref) < limit, f"{type_name} n_tok {n_tok} mma8 {mma8} (seed {seed})"
        if not tensor_cores:
            assert trace.get("load").launches == 1
    assert calls == (list(range(qk.MMA8_MIN_TOKENS, MMA8_TOKENS + 1)) if mma8 else [])


@pytest.mark.cuda
def test_gemv_mma_argument_errors():
    import cupy as cp

    rng = np.random.default_rng(0)
    w, _ = weight("Q4_K", 64, 256, rng, True)
    q8, _ = weight("Q8_0", 64, 256, rng, True)
    X, Y = cp.zeros((4, 256), cp.float32), cp.zeros((4, 64), cp.float32)
    with pytest.raises(ValueError, match="Q4_K, Q6_K weights, not Q8_0"):
        gemv_mma(q8, X, Y)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        gemv_mma(w, cp.zeros((9, 256), cp.float32), cp.zeros((9, 64), cp.float32))
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv_mma(w, cp.zeros((4, 260), cp.float32)[:, 1:257], Y)
    with pytest.raises(ValueError, match="shape"):
        gemv_mma(w, X, Y, bias=cp.zeros(63, cp.float32))
    big = SimpleNamespace(**{**vars(w), "shape": (64, 57344), "_plans": {}})  # too wide even in clusters of two
    with pytest.raises(ValueError, match="shared memory"):
        gemv_mma(big, cp.zeros((2, 57344), cp.float32), cp.zeros((2, 64), cp.float32))


@pytest.mark.cuda
def test_bench_gemv_batch_times_gemv_mma():
    from k4.runtime.cuda.microbench import bench_gemv_batch

    r = bench_gemv_batch("Q4_K", 512, 1024, (1, 8), iters=20, mma8=True)
    assert [row["n_tok"] for row in r["rows"]] == [1, 8] and all(row["us"] > 0 for row in r["rows"])
    assert bench_gemv_batch("Q6_K", 512, 1024, (3,), iters=20, glu=True, mma8=True, variant=(8, 8))["rows"][0]["us"] > 0
    assert bench_gemv_batch("Q4_K", 512, 1024, (8,), iters=20, mma8=True, x_q8=True)["rows"][0]["us"] > 0
    with pytest.raises(ValueError, match="not Q5_K"):
        bench_gemv_batch("Q5_K", 64, 256, mma8=True)


# ---- CPU: selection, flag, compile jobs ----------------------------------------------------------

def _spec(type_name: str, n_in: int = 4096, mma8: bool = True, prefill_tc: bool = True, cluster: bool = True):
    return SimpleNamespace(ggml_type=T[type_name], shape=(4096, n_in), mma8=mma8, prefill_tc=prefill_tc, planar=True,
                           mma8_cluster=cluster)


def test_uses_mma8_for_3_to_8_tokens_of_q4_k_and_q6_k_that_fit():
    for name in ("Q4_K", "Q6_K"):
        assert [n for n in range(1, 12) if uses_mma8(_spec(name), n)] == list(range(qk.MMA8_MIN_TOKENS, 9)) == [3, 4, 5, 6, 7, 8]
        assert [n for n in range(1, 12) if mm.uses_gemv(_spec(name), n)] == list(range(1, 9))
        assert not any(uses_mma8(_spec(name, mma8=False), n) for n in range(1, 9))
        assert [n for n in range(1, 12) if mm.uses_gemv(_spec(name, mma8=False), n)] == [1, 2, 3, 4]
        assert uses_mma8(_spec(name, n_in=14336), 8)  # Llama 3 8B's down: 170 KB of shared memory
        assert not uses_mma8(_spec(name, n_in=28672, cluster=False), 8)  # Llama 3 70B's down does not fit one block
        # in clusters of two (K4_MMA8_CLUSTER), half of x a block: Q4_K's 8 warps fit, Q6_K's 12 do not
        assert uses_mma8(_spec(name, n_in=28672), 8) == (name == "Q4_K")
        assert not uses_mma8(_spec(name, n_in=57344), 8)
    for name in ("Q5_K", "Q8_0", "F16"):
        assert not any(uses_mma8(_spec(name), n) for n in range(1, 9))
    from k4.runtime.cuda.gemv_mma import mma_shape

    for t in qk.MMA8_DECODERS:
        for planar in (False, True):
            assert mma_shape(t, 14336, planar) is not None and mma_shape(t, 28672, planar) is None
            assert (mma_shape(t, 28672, planar, cl=qk.MMA8_CLUSTER) is not None) == (t == T.Q4_K)
    assert mma_shape(T.Q4_K, 4096, True) == (True, 16, 4) and mma_shape(T.Q4_K, 11008, False) == (True, 16, 2)
    assert mma_shape(T.Q4_K, 14336, True) == (True, 8, 2) and mma_shape(T.Q6_K, 4096, False) == (False, 8, 0)
    assert mma_shape(T.Q6_K, 4096, True) == (True, 16, 2) and mma_shape(T.Q6_K, 11008, True) == (True, 12, 2)
    assert mma_shape(T.Q6_K, 14336, True) == (False, 8, 0)  # the rings do not fit beside x: the register kernel


@pytest.mark.cuda  # runtime/cuda/sizing.py imports CuPy
def test_flag_k4_mma8_reaches_the_weight_options():
    from k4.runtime.cuda.sizing import options

    assert options(Flags({}))[0].matrix.mma8 is True  # on by default (runtime/flags.py)
    assert options(Flags({"K4_MMA8": "1"}))[0].matrix.mma8 is True
    assert options(Flags({"K4_MMA8": "0"}))[0].matrix.mma8 is False


def test_mma8_instances_compile_with_the_model_types_one_module_each():
    """The gemv_mma instances for a model: Q4_K (both layouts) and planar Q6_K in gemv_mma_staged.cu,
    16 and 8 warps (12 for Q6_K), each also for clusters of MMA8_CLUSTER blocks; Q6_K (both layouts)
    in gemv_mma.cu; plain and SwiGLU, GeGLU only for a gelu_tanh model, none for other types or with
    K4_MMA8=0, each its own module."""
    assert qk._gemv_mma_name(T.Q6_K, False, 12, True, staged=False) == "gemv_mma<mma_q6_K, false, 12, true>"
    assert qk._gemv_mma_name(T.Q6_K, True, 16, True) == "gemv_mma_staged<staged_q6_K, true, 16, true>"
    assert qk._gemv_mma_name(T.Q4_K, False, 8, True, "gelu_tanh") == "gemv_mma_staged<staged_q4_K, false, 8, true, true>"
    assert qk._gemv_mma_name(T.Q4_K, False, 8, True, "gelu_tanh", cl=2) == "gemv_mma_staged<staged_q4_K, false, 8, true, true, 2>"
    assert qk._gemv_mma_name(T.Q6_K, True, 12, False, cl=2) == "gemv_mma_staged<staged_q6_K, true, 12, false, false, 2>"
    jobs = lambda types, act, on=True: [(f, g) for f, g, _ in compile_jobs(types, True, act, on) if "gemv_mma" in f]  # noqa: E731
    silu = jobs([T.Q4_K, T.Q8_0, T.F16], "silu")
    assert len(silu) == 16 and all(f == "gemv_mma_staged.cu" and len(g) == 1 and g[0].startswith("gemv_mma_staged<staged_q4_K, ")
                                   for f, g in silu)
    assert sum(g[0].endswith(f", {qk.MMA8_CLUSTER}>") for _, g in silu) == 8
    gelu = jobs([T.Q6_K], "gelu_tanh")
    assert [f for f, _ in gelu] == ["gemv_mma_staged.cu"] * 8 + ["gemv_mma.cu"] * 4 + ["gemv_mma_staged.cu"] * 4 + ["gemv_mma.cu"] * 2
    assert all(n.endswith(("true, true>", f"true, true, {qk.MMA8_CLUSTER}>")) for _, (n,) in gelu[12:])
    assert jobs([T.Q5_K, T.Q8_0], "silu") == [] and jobs([T.Q4_K, T.Q6_K], "silu", False) == []


def test_mma_ks_spreads_the_steps_over_the_grid():
    """KS divides WARPS, is at least 4, and is the split whose busiest warp has the fewest blocks:
    a 4096-row matrix on 16 warps takes 2 tiles per step (128 steps), not 4 (64 steps, half the
    grid idle); a matrix too small for the grid takes fewer blocks, one per step."""
    from k4.runtime.cuda.gemv_mma import mma_ks

    assert mma_ks(4096, 4096, 16, 132) == (8, 128)
    assert mma_ks(22016, 4096, 16, 132) == (4, 132)
    assert mma_ks(4096, 11008, 16, 132) == (8, 128)
    assert mma_ks(32000, 4096, 16, 132) == (4, 132)
    assert mma_ks(256, 4096, 8, 264) == (8, 16)
    for rows, n_in in ((12288, 4096), (4096, 11008), (778, 1536)):
        for warps in (8, 12, 16):
            ks, grid = mma_ks(rows, n_in, warps, 132)
            assert ks >= 4 and warps % ks == 0 and 1 <= grid <= 132
