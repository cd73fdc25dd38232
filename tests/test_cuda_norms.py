"""The CUDA RMSNorms where eps matters: the rms_norm kernel (norm.cu), the norm prologue of the
matrix-vector product (gemv.cu, flag K4_FUSE_NORM; plain and gate/up, at n_in = 896 as in
Qwen2.5-0.5B, not only multiples of 256) and qwen3's per-head q/k norm before RoPE
(ops_common.cuh rope_row through Ops.rope_qk_store). Inputs: rows with mean(x^2) from 0 to 100
eps (tests/norm_inputs.py), seeded; each compared with the float64 formula, row by row.

A correct kernel errs by float32 roundings; the mistakes (eps outside the sqrt, eps dropped)
move each non-zero row by 5e-3 (at 100 eps) to 0.4 (at 1 eps) or more, and every test checks
that its limit rejects them on its own inputs. The limits are derived below, each with its
reason; they were not measured on a GPU when written (the bounds are worst cases)."""

from __future__ import annotations


import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from k4.runtime.cuda import layout as lay
from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda.device_weight import make_weight
from k4.runtime.cuda.microbench import random_weight
from k4.runtime.reference import apply_rope, rope_tables
from k4.runtime.rope import rope_table
from tests.helpers_matmul import interleave_rows
from tests.norm_inputs import RATIOS, eps_outside_sqrt64, eps_rows, norm_weight, rms_norm64, row_errors
from tests.matmul_ref import q8_rounded
from tests.tiny import tiny_config

pytestmark = pytest.mark.cuda

# float32 output: the sum of squares (at most 8 sequential terms per thread, then a tree of 10
# levels: under 1e-6 relative in mean(x^2) at worst, 5e-7 in its root), rsqrtf (2 ulp, 2.4e-7)
# and two products per element (1.2e-7): under 9e-7 per row at worst; limit 2e-6.
LIMIT_F32 = 2e-6
# fp16 output: rounding to 11 bits, at most 4.9e-4 per element (about 2.8e-4 over a row); limit
# 1e-3, below the 5e-3 of the mildest mistake.
LIMIT_FP16 = 1e-3
# gemv on float weights: the norm above plus a float32 dot product over n_in terms; limit 1e-5
# (matmul_ref's float limit).
LIMIT_GEMV_FLOAT = 1e-5
# gemv on quantized weights against the product with x normalized in float64 and rounded to q8
# as the kernel does (q8_rounded): float32 rounding (1e-4, matmul_ref's LIMIT_Q8_ROUNDED),
# plus the values whose q8 rounding flips because the kernel's scale differs from numpy's in its
# last bits (about 1 value in 25,000; each moves y by one q8 step of one x value,
# 2.5 / (127 sqrt(n_in)) = 7e-4 at n_in 896). 2e-3 allows two such flips in one vector. (The
# same products in numpy with the scale off by 3e-7: 3e-7 per vector, 3e-4 and 5e-4 in the two
# of 144 vectors where a value flipped.) The limit against the float x (1e-2, the q8 error
# itself) would pass the 5e-3 mistake.
LIMIT_GEMV_Q8 = 2e-3

EPS = (1e-5, 1e-6)  # llama's and qwen2's rms eps



def assert_rows(got, want, limit, what: str) -> None:
    errs = row_errors(got, want)
    assert (errs < limit).all(), f"{what}: row errors {errs.round(8).tolist()}, rows at mean(x^2)/eps {RATIOS}"


def assert_mistakes_fail(x, w, eps, limit, to_output=lambda xn: xn) -> None:
    """The limit rejects both eps mistakes on every row of x but the first (the zero row of each
    eps_rows block, last axis of the row errors), seen through to_output."""
    want = to_output(rms_norm64(x, w, eps))
    with np.errstate(invalid="ignore", divide="ignore"):
        for wrong in (eps_outside_sqrt64(x, w, eps), rms_norm64(x, w, 0.0)):
            assert (row_errors(to_output(wrong), want)[..., 1:] > limit).all()


# ---- rms_norm kernel ---------------------------------------------------------------------------

@pytest.mark.parametrize("eps", EPS)
@pytest.mark.parametrize("n", [64, 896, 1000, 4096, 5120])
def test_rms_norm_kernel_where_eps_matters(ops, n, eps):
    import cupy as cp

    rng = np.random.default_rng([16, n, int(1 / eps)])
    x, w = eps_rows(rng, n, eps), norm_weight(rng, n)  # (8, n), (n,)
    want = rms_norm64(x, w, eps)
    assert_mistakes_fail(x, w, eps, LIMIT_F32)
    y = cp.full(x.shape, np.nan, cp.float32)
    ops.rms_norm(cp.asarray(x), cp.asarray(w), y, eps)
    assert_rows(y.get(), want, LIMIT_F32, f"f32 n={n}")
    xd = cp.asarray(x)
    ops.rms_norm(xd, cp.asarray(w), xd, eps)  # in place
    assert_rows(xd.get(), want, LIMIT_F32, f"in place n={n}")
    h = cp.full(x.shape, np.nan, cp.float16)  # the tensor-core input of prefill
    ops.rms_norm(cp.asarray(x), cp.asarray(w), h, eps)
    assert_mistakes_fail(x, w, eps, LIMIT_FP16)
    assert_rows(h.get(), want, LIMIT_FP16, f"fp16 n={n}")


@pytest.mark.parametrize("swizzle", [1, 2])
@pytest.mark.parametrize("n", [64, 896, 4096, 5120])
def test_rms_norm_with_q8_rows_is_the_norm_and_its_quantize_rows(ops, n, swizzle):
    """rms_norm with q8 (norm.cu rms_norm_q8, the verify step's few-token products' input): y as
    rms_norm within LIMIT_F32 (also in place), and the q8 rows bit for bit what quantize_rows
    makes of that y; an fp16 y or rows of another size are refused."""
    import cupy as cp

    from k4.runtime.cuda.gemv_batch import quantize_rows
    from k4.runtime.cuda.q8_handoff import Q8Rows

    eps = EPS[0]
    rng = np.random.default_rng([17, n, swizzle])
    x, w = eps_rows(rng, n, eps), norm_weight(rng, n)  # (8, n), (n,)
    want = rms_norm64(x, w, eps)
    q8 = Q8Rows(cp.zeros(Q8Rows.nbytes(8, n), cp.uint8), 8, n, swizzle)
    for inplace in (False, True):
        xd = cp.asarray(x)
        y = xd if inplace else cp.full(x.shape, np.nan, cp.float32)
        q8.data.fill(0)
        ops.rms_norm(xd, cp.asarray(w), y, eps, q8=q8)
        assert_rows(y.get(), want, LIMIT_F32, f"q8 n={n} in place {inplace}")
        again = Q8Rows(cp.zeros_like(q8.data), 8, n, swizzle)
        quantize_rows(y, again)
        assert (q8.data.get() == again.data.get()).all()
    with pytest.raises(ValueError, match="q8"):
        ops.rms_norm(cp.asarray(x), cp.asarray(w), cp.zeros(x.shape, cp.float16), eps, q8=q8)
    with pytest.raises(ValueError, match="q8"):
        ops.rms_norm(cp.asarray(x[:4]), cp.asarray(w), cp.zeros((4, n), cp.float32), eps, q8=q8)


# ---- the norm prologue of gemv -----------------------------------------------------------------

GEMV_CASES = [  # (type, n_in): 896 = 28 blocks of 32 (llama.cpp keeps such rows in Q5_0/Q8_0)
    ("Q8_0", 896), ("Q5_0", 896), ("Q5_1", 896), ("F32", 896), ("F16", 896), ("BF16", 896),
    ("Q4_K", 512), ("Q5_K", 768), ("Q6_K", 2048),
]


def silu(v):
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize("glu", [False, True], ids=["plain", "gate_up"])
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("eps", EPS)
@pytest.mark.parametrize("type_name,n_in", GEMV_CASES)
def test_gemv_norm_prologue_where_eps_matters(type_name, n_in, eps, repack, glu):
    import cupy as cp

    rng = np.random.default_rng([16, n_in, int(1 / eps), int(repack), int(glu), zlib.crc32(type_name.encode())])
    n_out = 300
    parts = [random_weight(T[type_name], n_out, n_in, rng) for _ in range(2 if glu else 1)]
    t = interleave_rows(*parts, "ffn_gate_up") if glu else parts[0]
    w = make_weight(t, cp.asarray(lay.weight_layout(t, repack)), repack, glu=glu)
    mats = [dequantize(p.raw_bytes(), p.ggml_type).astype(np.float64) for p in parts]  # (n_out, n_in) each
    quantized = T[type_name] in mm.QUANT
    limit = (LIMIT_GEMV_Q8 if quantized else LIMIT_GEMV_FLOAT) * (2 if glu else 1)  # glu: two products' errors

    def product(xn):  # rows (k, n_in) of normalized x, float64 -> (k, n_out) as the kernel computes it
        xs = np.stack([q8_rounded(r) if quantized else r.astype(np.float32).astype(np.float64) for r in xn])
        ys = [xs @ m.T for m in mats]
        return silu(ys[0]) * ys[1] if glu else ys[0]

    x, norm_w = eps_rows(rng, n_in, eps), norm_weight(rng, n_in)  # (8, n_in), (n_in,)
    assert_mistakes_fail(x, norm_w, eps, limit, product)
    want = product(rms_norm64(x, norm_w, eps))  # (8, n_out)
    got = np.empty_like(want)
    for r in range(len(x)):
        y = cp.full(n_out, np.nan, cp.float32)
        mm.gemv(w, cp.asarray(x[r]), y, norm=(cp.asarray(norm_w), eps))
        got[r] = y.get()
    assert_rows(got, want, limit, f"{type_name} {n_out}x{n_in}")


# ---- qwen3's q/k norm, then RoPE ---------------------------------------------------------------

@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
def test_qk_norm_before_rope_where_eps_matters(ops, neox):
    """Every head of q and k a row of eps_rows (mean square 0 to 100 eps, one ratio per head),
    norm weights unequal within each rotated pair, so both the eps mistakes and the norm after
    RoPE move the output (by 0.11 or more per row). q (f32) against the float64 norm-then-rope:
    the norm's worst case (LIMIT_F32's 9e-7) plus the rotation's float products (2e-7), limit
    5e-6 (a float32 model of the kernel errs 1.3e-7); k in the fp16 cache within LIMIT_FP16
    (the model: 3.1e-4)."""
    import cupy as cp

    from k4.runtime.cuda.ops import RopeArgs
    from k4.runtime.cuda.weights import rope_inv_freq

    n_tok, n_head, n_head_kv, D, pos0 = 2, 8, 8, 64, 37
    cfg = tiny_config("qwen3", head_dim=D, rope_dim=D, n_head=n_head, n_head_kv=n_head_kv, rope_neox=neox)
    eps = cfg.rms_eps
    rng = np.random.default_rng([16, int(neox)])
    q = np.stack([eps_rows(rng, D, eps) for _ in range(n_tok)])  # (n_tok, n_head = 8 ratios, D)
    k = np.stack([eps_rows(rng, D, eps) for _ in range(n_tok)])  # (n_tok, n_head_kv, D)
    v = rng.standard_normal((n_tok, n_head_kv, D)).astype(np.float32)
    qn, kn = norm_weight(rng, D), norm_weight(rng, D)
    cos, sin = rope_tables(rope_table(cfg, cfg.n_ctx_train, None), np.arange(pos0, pos0 + n_tok))  # (n_tok, D/2) each

    def rope(x):  # (n_tok, heads, D) float64
        return apply_rope(x, cos.astype(np.float64), sin.astype(np.float64), D, neox)

    limit_q = 5e-6
    q_want, k_want = rope(rms_norm64(q, qn, eps)), rope(rms_norm64(k, kn, eps))
    for x, nw, limit in ((q, qn, limit_q), (k, kn, LIMIT_FP16)):
        assert_mistakes_fail(x, nw, eps, limit, rope)
        after = rms_norm64(rope(x.astype(np.float64)), nw, eps)  # the norm after RoPE
        assert (row_errors(after, rope(rms_norm64(x, nw, eps)))[:, 1:] > limit).all()

    n_ctx = pos0 + n_tok
    kc, vc = cp.full((n_ctx, n_head_kv, D), np.nan, cp.float16), cp.full((n_ctx, n_head_kv, D), np.nan, cp.float16)
    qd = cp.asarray(q)
    rope = RopeArgs(cp.asarray(qn), cp.asarray(kn), cp.asarray(rope_inv_freq(cfg, None)), D, neox, eps)
    ops.rope_qk_store(qd, cp.asarray(k), cp.asarray(v), kc, vc, rope, cp.asarray([pos0], dtype=cp.int32))
    assert_rows(qd.get().reshape(-1, D), q_want.reshape(-1, D), limit_q, "q")
    assert_rows(kc.get()[pos0:].reshape(-1, D), k_want.reshape(-1, D), LIMIT_FP16, "k")
