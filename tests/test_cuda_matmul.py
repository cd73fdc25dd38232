"""The dequant-matmul family (runtime/cuda/matmul.py) against numpy: gguf's dequantize of random
valid blocks, then a float64 product.

Error limits (relative L2, ||got - ref|| / ||ref||). gemv on quantized weights quantizes x to 8
bits per 32 values: against numpy with x rounded the same way (q8_rounded), float32 rounding
only, limit 1e-4; against the float x, the error of that rounding, about 5e-3 on random data,
limit 1e-2 (checked on shapes with many rows, where the norm is stable). gemv on float weights,
float32: 1e-5. Prefill on tensor cores rounds X and W to fp16: about 4e-4, limit 2e-3.
dequant_rows is exact. Quantized blocks use the full ranges of real files' scale fields (Q6_K's
int8 scales -128..127, all 6-bit K-quant scale and min codes; runtime.synthetic.random_blocks
full_range). Inputs are seeded by the test id (the seed is in the failure message); outputs are
poisoned with NaN before each call.
"""

from __future__ import annotations

import os
import zlib
from itertools import pairwise

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from k4.runtime.cuda import layout as lay
from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda import q8_handoff as hand
from k4.runtime.cuda import quant_kernels as qk
from k4.runtime.cuda.microbench import bench_gemv, bench_matmul, random_weight
from k4.runtime.model import Tensor
from tests.helpers_matmul import interleave_rows, stack_rows

QUANTIZED = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_0", "IQ4_XS", "IQ4_NL"]
FLOATS = ["F16", "BF16", "F32"]
LIMIT_Q8 = 1e-2
LIMIT_Q8_ROUNDED = 1e-4
LIMIT_F32 = 1e-5
LIMIT_FP16 = 2e-3


def shapes(type_name: str) -> list[tuple[int, int]]:
    """(n_out, n_in) cases: n_out from 1 to more rows than the grid has warps, n_in from one
    block to many; float types also get rows that are not a multiple of 16 bytes."""
    block = GGML_QUANT_SIZES[T[type_name]][0] if type_name in QUANTIZED else 32
    second = (37, 37) if type_name in FLOATS else (37, 2 * block)
    return [(5, block), second, (300, 3 * block), (4133, 8 * block)]


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def q8_rounded(x: np.ndarray) -> np.ndarray:
    """x (float32, length a multiple of 32) as the q8 gemv kernels see it, float64: rounded to
    int8 per 32 values with scale max|x|/127 (kernels_cu/gemv.cu quantize_x)."""
    g = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(g).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    return (np.rint(g * inv) * (amax * np.float32(1 / 127))).astype(np.float64).reshape(-1)


def gemv_ref(type_name: str, ref_w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, float]:
    """(reference y, error limit) for gemv of x on a weight of type_name."""
    if type_name in QUANTIZED:
        return ref_w @ q8_rounded(x), LIMIT_Q8_ROUNDED
    return ref_w @ x.astype(np.float64), LIMIT_F32


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator seeded by the running test's id (crc32), so every run draws the same inputs."""
    seed = zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())
    return np.random.default_rng(seed), seed


def weight(type_name: str, n_out: int, n_in: int, rng, repack: bool):
    """(device weight, float64 reference matrix (n_out, n_in))."""
    import cupy as cp

    t = random_weight(T[type_name], n_out, n_in, rng)
    w = mm.make_weight(t, cp.asarray(lay.weight_layout(t, repack)), repack)
    return w, dequantize(t.raw_bytes(), t.ggml_type).astype(np.float64)


def nan_like(shape):
    import cupy as cp

    return cp.full(shape, cp.nan, cp.float32)


# ---- host layout (CPU) -------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", QUANTIZED)
def test_planar_layout_holds_every_group_contiguously(type_name):
    rng = np.random.default_rng(1)
    t = random_weight(T[type_name], 3, 2 * GGML_QUANT_SIZES[T[type_name]][0], rng)
    raw = t.raw_bytes().reshape(-1)
    groups = mm.QUANT[t.ggml_type].groups
    blocks = raw.reshape(-1, groups[-1])
    planar = lay.weight_layout(t, repack=True)
    assert planar.nbytes == lay.planar_nbytes(t.ggml_type, blocks.shape[0])
    off = 0
    for a, b in pairwise(groups):
        n = blocks.shape[0] * (b - a)
        assert np.array_equal(planar[off : off + n], blocks[:, a:b].reshape(-1))
        assert off % 16 == 0
        off += -(-n // 16) * 16
    assert np.array_equal(lay.weight_layout(t, repack=False), raw)


def test_stack_rows_needs_one_type_and_width():
    rng = np.random.default_rng(0)
    a, b = random_weight(T.Q4_K, 4, 256, rng), random_weight(T.Q6_K, 4, 256, rng)
    with pytest.raises(ValueError, match="cannot stack"):
        stack_rows([a, b], "ab")
    s = stack_rows([a, a], "aa")
    assert np.array_equal(lay.weight_layout(s, False), np.concatenate([a.raw_bytes().reshape(-1)] * 2))


def test_interleave_rows_alternates_gate_and_up():
    rng = np.random.default_rng(0)
    gate, up = random_weight(T.Q4_K, 3, 512, rng), random_weight(T.Q4_K, 3, 512, rng)
    t = interleave_rows(gate, up, "blk.0.ffn_gate.weight")
    assert t.shape == (6, 512)
    rows = t.raw_bytes()
    assert np.array_equal(rows[0::2], gate.raw_bytes()) and np.array_equal(rows[1::2], up.raw_bytes())
    with pytest.raises(ValueError, match="cannot stack"):
        interleave_rows(gate, random_weight(T.Q6_K, 3, 512, rng), "x")
    with pytest.raises(ValueError, match="two matrices of one shape"):
        interleave_rows(gate, random_weight(T.Q4_K, 4, 512, rng), "x")


def _device_layout_cases(xp):
    """(host layout, device_layout's result on xp arrays) for stacked and gate/up-interleaved
    matrices of every type, raw and planar."""
    rng = np.random.default_rng(3)
    for type_name in (*QUANTIZED, "F16", "F32"):
        t = T[type_name]
        a, b, c = (random_weight(t, n, 2 * GGML_QUANT_SIZES[t][0], rng) for n in (5, 5, 3))
        for repack in (False, True):
            for tensors, glu in (([a, b, c], False), ([a, b], True), ([c], False)):
                spec = lay.combined(tensors, "m", glu)
                host = lay.weight_layout(interleave_rows(a, b, "m") if glu else stack_rows(tensors, "m"), repack)
                src = xp.asarray(np.concatenate([x.raw_bytes().reshape(-1) for x in tensors]))
                dst = xp.full(lay.layout_nbytes(spec, repack), 0xA5, xp.uint8)  # pads must be written too
                lay.device_layout(dst, src, spec, repack, glu)
                yield f"{type_name} repack={repack} glu={glu} n={len(tensors)}", host, dst


def test_device_layout_equals_the_host_layout():
    """The load path rearranges file bytes on the device; numpy arrays take the same code path."""
    for case, host, got in _device_layout_cases(np):
        assert np.array_equal(got, host), case


@pytest.mark.cuda
def test_device_layout_equals_the_host_layout_on_the_gpu():
    import cupy as cp

    for case, host, got in _device_layout_cases(cp):
        assert np.array_equal(got.get(), host), case


def test_combined_rejects_what_stack_and_interleave_reject():
    rng = np.random.default_rng(0)
    a, b = random_weight(T.Q4_K, 4, 256, rng), random_weight(T.Q6_K, 4, 256, rng)
    with pytest.raises(ValueError, match="cannot stack"):
        lay.combined([a, b], "ab")
    with pytest.raises(ValueError, match="two matrices of one shape"):
        lay.combined([a, random_weight(T.Q4_K, 6, 256, rng)], "g", glu=True)
    assert lay.combined([a, a], "aa").shape == (8, 256)


def test_weight_layout_rejects_partial_blocks():
    t = random_weight(T.F32, 2, 8, np.random.default_rng(0))
    bad = Tensor("w", T.Q4_K, (2, 100), t.raw)
    with pytest.raises(ValueError, match="multiple of the Q4_K block"):
        lay.weight_layout(bad, repack=True)


# ---- decode: gemv ------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("type_name", QUANTIZED + FLOATS)
def test_gemv_matches_numpy(type_name, repack):
    import cupy as cp

    rng, seed = fresh_rng()
    for n_out, n_in in shapes(type_name):
        w, ref_w = weight(type_name, n_out, n_in, rng, repack)
        x = rng.standard_normal(n_in).astype(np.float32)
        y = nan_like(n_out)
        mm.gemv(w, cp.asarray(x), y)
        got = y.get()
        what = f"{type_name} {n_out}x{n_in} repack={repack} (seed {seed})"
        assert np.isfinite(got).all(), f"{what}: unwritten or non-finite outputs"
        ref, limit = gemv_ref(type_name, ref_w, x)
        assert rel_err(got, ref) < limit, f"{what}: relative error {rel_err(got, ref):.2e}"
        if type_name in QUANTIZED and n_out >= 300:
            err = rel_err(got, ref_w @ x.astype(np.float64))
            assert err < LIMIT_Q8, f"{what}: relative error to float x {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "F16"])
def test_gemv_programmatic_dependent_launch(type_name):
    import cupy as cp

    rng, seed = fresh_rng()
    w, ref_w = weight(type_name, 300, 512, rng, True)
    x = rng.standard_normal(512).astype(np.float32)
    y = nan_like(300)
    mm.gemv(w, cp.asarray(x), y, pdl=True)
    ref, limit = gemv_ref(type_name, ref_w, x)
    assert rel_err(y.get(), ref) < limit, f"seed {seed}"


@pytest.mark.cuda
def test_gemv_chain_with_pdl_in_a_graph():
    """Two dependent products launched with programmatic dependent launch, replayed from a CUDA
    graph on new x: the second must see the first's output."""
    import cupy as cp

    rng, seed = fresh_rng()
    w1, ref1 = weight("Q4_K", 512, 768, rng, True)
    w2, ref2 = weight("Q6_K", 300, 512, rng, True)
    x, y1, y2 = cp.zeros(768, cp.float32), nan_like(512), nan_like(300)
    cp.cuda.Device().synchronize()  # the inputs were built on the default stream, which `stream` does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        mm.gemv(w1, x, y1, pdl=True)
        mm.gemv(w2, y1, y2, pdl=True)
        graph = stream.end_capture()
        for _ in range(3):
            xh = rng.standard_normal(768).astype(np.float32)
            x.set(xh, stream=stream)
            graph.launch()
            stream.synchronize()
            h1 = y1.get()
            assert rel_err(h1, ref1 @ q8_rounded(xh)) < LIMIT_Q8_ROUNDED, f"first product (seed {seed})"
            assert rel_err(y2.get(), ref2 @ q8_rounded(h1)) < LIMIT_Q8_ROUNDED, f"second product (seed {seed})"


@pytest.mark.cuda
def test_stacked_rows_multiply_as_one_matrix():
    import cupy as cp

    rng, seed = fresh_rng()
    parts = [random_weight(T.Q4_K, n, 512, rng) for n in (256, 64, 64)]
    t = stack_rows(parts, "blk.0.attn_qkv.weight")
    assert t.shape == (384, 512)
    w = mm.make_weight(t, cp.asarray(lay.weight_layout(t, True)), True)
    x = rng.standard_normal(512).astype(np.float32)
    y = nan_like(384)
    mm.gemv(w, cp.asarray(x), y)
    ref = np.concatenate([dequantize(p.raw_bytes(), p.ggml_type).astype(np.float64) @ q8_rounded(x) for p in parts])
    assert rel_err(y.get(), ref) < LIMIT_Q8_ROUNDED, f"seed {seed}"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name,variant", [(t, v) for t, vs in qk.EXTRA_GEMV_VARIANTS.items() for v in vs])
def test_gemv_variants_match_numpy(type_name, variant):
    import cupy as cp

    rng, seed = fresh_rng()
    w, ref_w = weight(type_name.name, 777, 1536, rng, True)
    x = rng.standard_normal(1536).astype(np.float32)
    y = nan_like(777)
    mm.gemv(w, cp.asarray(x), y, variant=variant)
    assert rel_err(y.get(), ref_w @ q8_rounded(x)) < LIMIT_Q8_ROUNDED, f"seed {seed}"


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "F32"])
def test_gemv_epilogues(type_name):
    import cupy as cp

    rng, seed = fresh_rng()
    n_out, n_in = 300, 512
    w, ref_w = weight(type_name, n_out, n_in, rng, True)
    x = rng.standard_normal(n_in).astype(np.float32)
    r = rng.standard_normal(n_out).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    ref, limit = gemv_ref(type_name, ref_w, x)
    dx = cp.asarray(x)

    y = nan_like(n_out)
    mm.gemv(w, dx, y, residual=cp.asarray(r), bias=cp.asarray(b))
    assert rel_err(y.get(), ref + r + b) < limit, f"residual + bias (seed {seed})"

    y = cp.asarray(r)
    mm.gemv(w, dx, y, residual=y)
    assert rel_err(y.get(), ref + r) < limit, f"in-place residual (seed {seed})"

    y = nan_like(n_out)
    mm.gemv(w, dx, y, bias=cp.asarray(b))
    assert rel_err(y.get(), ref + b) < limit, f"bias (seed {seed})"


def rms_normed(x: np.ndarray, norm_w: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * norm_w in float64 (runtime/reference.py rms_norm)."""
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64) + eps) * norm_w.astype(np.float64)


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "F32", "F16"])
def test_gemv_fused_rms_norm(type_name):
    """The RMSNorm prologue against the norm computed in float64: the kernel quantizes its own
    normalized x, whose q8 rounding may differ in a few last bits from numpy's, so the float-x
    limits apply (1e-2 quantized, float32 rounding otherwise)."""
    import cupy as cp

    rng, seed = fresh_rng()
    for n_out, n_in in ((300, 512), (4133, 2048), (40, 17408)):
        w, ref_w = weight(type_name, n_out, n_in, rng, True)
        x = (3 * rng.standard_normal(n_in) + 0.5).astype(np.float32)
        norm_w = (1 + 0.3 * rng.standard_normal(n_in)).astype(np.float32)
        r = rng.standard_normal(n_out).astype(np.float32)
        y = cp.asarray(r)
        mm.gemv(w, cp.asarray(x), y, residual=y, norm=(cp.asarray(norm_w), 1e-5))
        ref = ref_w @ rms_normed(x, norm_w, 1e-5)
        err = rel_err(y.get() - r, ref)
        assert err < (LIMIT_Q8 if type_name in QUANTIZED else 1e-5), f"{type_name} {n_out}x{n_in}: {err:.2e} (seed {seed})"


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def gelu_tanh(v: np.ndarray) -> np.ndarray:
    """runtime/reference.py's formula in float64: 0.5 v (1 + tanh(sqrt(2/pi) v (1 + 0.044715 v^2)))."""
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * v * (1 + 0.044715 * v * v)))


GLU_REF = {"silu": silu, "gelu_tanh": gelu_tanh}  # the epilogue's act against numpy


@pytest.mark.cuda
@pytest.mark.parametrize("act", list(GLU_REF))
@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("type_name", QUANTIZED + FLOATS)
def test_gemv_swiglu_epilogue(type_name, repack, act):
    """A gate/up interleaved weight (glu): y = act(gate x) * (up x) from one launch, with and
    without the norm prologue; act silu (SwiGLU) or gemma's gelu_tanh (GeGLU). The gelu case
    fails if its instance applied silu: on these |g| ~ 1-3 the two differ by ~30%."""
    import cupy as cp

    rng, seed = fresh_rng()
    n_ff, n_in = shapes(type_name)[2]
    gate, up = (random_weight(T[type_name], n_ff, n_in, rng) for _ in range(2))
    t = interleave_rows(gate, up, "ffn_gate_up")
    w = mm.make_weight(t, cp.asarray(lay.weight_layout(t, repack)), repack, glu=True, glu_act=act)
    ref_g, ref_u = (dequantize(p.raw_bytes(), p.ggml_type).astype(np.float64) for p in (gate, up))
    x = rng.standard_normal(n_in).astype(np.float32)
    y = nan_like(n_ff)
    mm.gemv(w, cp.asarray(x), y)
    (g, limit), (u, _) = gemv_ref(type_name, ref_g, x), gemv_ref(type_name, ref_u, x)
    f = GLU_REF[act]
    err = rel_err(y.get(), f(g) * u)
    assert err < 2 * limit, f"{type_name} {act} {n_ff}x{n_in}: {err:.2e} (seed {seed})"
    norm_w = (1 + 0.3 * rng.standard_normal(n_in)).astype(np.float32)
    y = nan_like(n_ff)
    mm.gemv(w, cp.asarray(x), y, norm=(cp.asarray(norm_w), 1e-6))
    xn = rms_normed(x, norm_w, 1e-6)
    err = rel_err(y.get(), f(ref_g @ xn) * (ref_u @ xn))
    assert err < (3 * LIMIT_Q8 if type_name in QUANTIZED else 2e-5), f"{type_name} with norm: {err:.2e} (seed {seed})"
    with pytest.raises(ValueError, match="no residual"):
        mm.gemv(w, cp.asarray(x), y, residual=y)


@pytest.mark.cuda
@pytest.mark.parametrize("type_name,variant", [(t, v) for t, vs in qk.EXTRA_GLU_VARIANTS.items() for v in vs])
def test_gemv_swiglu_variants_match_numpy(type_name, variant):
    import cupy as cp

    rng, seed = fresh_rng()
    gate, up = (random_weight(type_name, 777, 1536, rng) for _ in range(2))
    t = interleave_rows(gate, up, "ffn_gate_up")
    w = mm.make_weight(t, cp.asarray(lay.weight_layout(t, True)), True, glu=True)
    x = rng.standard_normal(1536).astype(np.float32)
    y = nan_like(777)
    mm.gemv(w, cp.asarray(x), y, variant=variant)
    g, u = (dequantize(p.raw_bytes(), p.ggml_type).astype(np.float64) @ q8_rounded(x) for p in (gate, up))
    assert rel_err(y.get(), silu(g) * u) < 2 * LIMIT_Q8_ROUNDED, f"seed {seed}"


def test_glu_instances_keep_the_swiglu_names_and_add_gelu_ones():
    """The SwiGLU instances keep their names (the GELU template argument left at its default);
    the GeGLU ones, one group per type, compile only for a gelu_tanh model; make_weight names
    an unknown activation."""
    assert qk._gemv_q8_name(T.Q4_K, True, (16, 2, 1), True) == "gemv_q8<type_q4_K, true, 16, 2, true, true>"
    assert qk._gemv_q8_name(T.Q4_K, True, (16, 2, 1), True, "gelu_tanh") == "gemv_q8<type_q4_K, true, 16, 2, true, true, true>"
    assert qk._gemv_q8_name(T.Q4_K, True, (16, 2, 1), False, "gelu_tanh") == "gemv_q8<type_q4_K, true, 16, 2, true, false>"
    assert qk._gemv_f_name(T.F32, True, True, "gelu_tanh") == "gemv_f<type_f32, 8, 4, true, true, true>"
    gelu = qk.GROUPS["gemv.cu"]["Q6_K.gelu_tanh"]
    assert len(gelu) == 2 and all(n.endswith("true, true>") for n in gelu)
    assert not any(n.endswith("true, true, true>") for n in qk.GROUPS["gemv.cu"]["Q6_K"])
    groups = lambda act: [g for f, g, _ in qk.compile_jobs([T.Q6_K, T.F32], True, act) if f == "gemv.cu"]  # noqa: E731
    assert groups("silu") == [qk.GROUPS["gemv.cu"]["Q6_K"], qk.GROUPS["gemv.cu"]["F32"]]
    assert qk.GROUPS["gemv.cu"]["F32.gelu_tanh"] in groups("gelu_tanh") and len(groups("gelu_tanh")) == 4
    gate_up = Tensor("ffn_gate_up", T.F32, (4, 32), 0, None)
    with pytest.raises(ValueError, match="relu"):
        mm.make_weight(gate_up, np.zeros(512, np.uint8), False, glu=True, glu_act="relu")


@pytest.mark.parametrize("swizzle", [1, 2])
def test_q8x_host_is_q8_rounded_in_the_kernel_layout(swizzle):
    """q8x_host (the handoff's reference): unit u's 16 quants at slot x_unit_slot(u), d per 32,
    d * sum per 16, padding zero; its values are q8_rounded's. 416 values: 26 units padded to 32."""
    x = np.random.default_rng(3).standard_normal(416).astype(np.float32)
    x[32:64] = 0  # an all-zero group: d 0, quants 0
    raw = hand.q8x_host(x, swizzle)
    assert raw.shape == (mm.q8x_bytes(416),) == (512 + 64 + 112,)
    u = np.arange(26)
    slot = (u & ~7) | ((u + swizzle * (u >> 3)) & 7)
    assert (slot != u).any()
    quants = raw[16 * slot[:, None] + np.arange(16)].view(np.int8).reshape(-1, 32)
    d, s = raw[512:564].view(np.float32), raw[576:680].view(np.float32)
    np.testing.assert_array_equal((quants * d[:, None]).astype(np.float64).reshape(-1), q8_rounded(x))
    np.testing.assert_array_equal(s, np.repeat(d, 2) * quants.reshape(-1, 16).sum(axis=1).astype(np.float32))
    pad = np.r_[16 * np.setdiff1d(np.arange(32), slot)[:, None] + np.arange(16)].reshape(-1)
    assert not raw[pad].any() and not raw[564:576].any() and not raw[680:].any() and d[1] == 0 and np.abs(quants).max() == 127


@pytest.mark.cuda
@pytest.mark.parametrize("act", list(GLU_REF))
@pytest.mark.parametrize("down_type", QUANTIZED)
@pytest.mark.parametrize("glu_type", [t for t in QUANTIZED if mm.QUANT[T[t]].handoff])
def test_gemv_q8_handoff_is_the_quantization_of_y(glu_type, down_type, act):
    """y_q8 from a SwiGLU (or GeGLU) product holds y quantized (q8_rounded) in the down type's layout;
    down with x_q8 = it equals down on y itself to the bit, and never reads x. 4352 outputs =
    136 groups of 32: more than the grid has blocks, so blocks take unequal runs."""
    import cupy as cp

    rng, seed = fresh_rng()
    for n_ff in (256, 4352):
        n_in = 512
        gate, up = (random_weight(T[glu_type], n_ff, n_in, rng) for _ in range(2))
        t = interleave_rows(gate, up, "ffn_gate_up")
        glu = mm.make_weight(t, cp.asarray(lay.weight_layout(t, True)), True, glu=True, glu_act=act)
        down, _ = weight(down_type, 300, n_ff, rng, True)
        assert hand.can_hand_off(glu, down)
        x = cp.asarray(rng.standard_normal(n_in).astype(np.float32))
        y, y_plain = nan_like(n_ff), nan_like(n_ff)
        q8 = hand.Q8Vector.for_weight(down, cp.zeros(mm.q8x_bytes(n_ff), cp.uint8))
        mm.gemv(glu, x, y, y_q8=q8)
        mm.gemv(glu, x, y_plain)
        assert cp.array_equal(y, y_plain), f"{glu_type} y_q8 changed y (seed {seed})"
        np.testing.assert_array_equal(q8.data.get(), hand.q8x_host(y.get(), q8.swizzle))
        z, z_q8 = nan_like(300), nan_like(300)
        mm.gemv(down, y, z)
        mm.gemv(down, nan_like(n_ff), z_q8, x_q8=q8)
        assert cp.array_equal(z, z_q8), f"{glu_type} -> {down_type} n_ff {n_ff} (seed {seed})"


@pytest.mark.cuda
def test_gemv_q8_handoff_rejects_what_does_not_fit():
    import cupy as cp

    rng = np.random.default_rng(0)
    w, _ = weight("Q4_K", 64, 256, rng, True)
    w6, _ = weight("Q6_K", 64, 256, rng, True)
    buf = cp.zeros(mm.q8x_bytes(256), cp.uint8)
    x, y = cp.zeros(256, cp.float32), cp.zeros(64, cp.float32)
    with pytest.raises(ValueError, match="swizzle"):
        mm.gemv(w, x, y, x_q8=hand.Q8Vector.for_weight(w6, buf))
    with pytest.raises(ValueError, match="no fused norm"):
        mm.gemv(w, x, y, x_q8=hand.Q8Vector.for_weight(w, buf), norm=(x, 1e-6))
    with pytest.raises(ValueError, match="glu"):
        mm.gemv(w, x, y, y_q8=hand.Q8Vector(buf, 64, 1))
    with pytest.raises(ValueError, match="needs 352 uint8 bytes"):
        hand.Q8Vector.for_weight(w, cp.zeros(100, cp.uint8))
    f32, _ = weight("F32", 64, 256, rng, True)
    with pytest.raises(ValueError, match="float x"):
        hand.Q8Vector.for_weight(f32, buf)
    gate, up = (random_weight(T.Q5_0, 64, 256, rng) for _ in range(2))
    t = interleave_rows(gate, up, "ffn_gate_up")
    glu = mm.make_weight(t, cp.asarray(lay.weight_layout(t, True)), True, glu=True)
    assert not hand.can_hand_off(glu, w6)
    with pytest.raises(ValueError, match="handoff"):
        mm.gemv(glu, x, y, y_q8=hand.Q8Vector(buf, 64, 1))


@pytest.mark.cuda
def test_gemv_rejects_bad_arguments():
    import cupy as cp

    w, _ = weight("Q4_K", 8, 256, np.random.default_rng(0), True)
    with pytest.raises(ValueError, match="x must be"):
        mm.gemv(w, cp.zeros(255, cp.float32), cp.zeros(8, cp.float32))
    with pytest.raises(ValueError, match="y must be"):
        mm.gemv(w, cp.zeros(256, cp.float32), cp.zeros(8, cp.float64))
    with pytest.raises(ValueError, match="16-byte aligned"):
        mm.gemv(w, cp.zeros(260, cp.float32)[1:257], cp.zeros(8, cp.float32))


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
    gate, up = (random_weight(T.Q4_K, 300, 512, rng) for _ in range(2))
    t = interleave_rows(gate, up, "ffn_gate_up")
    w = mm.make_weight(t, cp.asarray(lay.weight_layout(t, True)), True, glu=True)
    X = rng.standard_normal((9, 512)).astype(np.float32)
    Y = nan_like((9, 600))
    mm.matmul(w, cp.asarray(X), Y, scratch=cp.empty(mm.matmul_scratch_bytes([w], 9), cp.uint8))
    ref = X.astype(np.float64) @ dequantize(t.raw_bytes(), T.Q4_K).astype(np.float64).T
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
    mm.dequant_rows(w, cp.asarray(ids), out)
    assert np.array_equal(out.get(), ref_w[ids].astype(np.float32)), f"{type_name} repack={repack} (seed {seed})"
    # gemma's embedding scale inside the launch: numpy's one float32 product per value, over
    # 301 rows (many thread blocks, the last one partly idle)
    ids = rng.integers(0, n_out, size=301).astype(np.int32)
    out = nan_like((301, n_in))
    mm.dequant_rows(w, cp.asarray(ids), out, scale=61.96773)
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
