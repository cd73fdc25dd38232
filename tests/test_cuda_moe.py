"""The mixture-of-experts kernels (kernels_cu/moe.cu, kernels_cu/moe_gemv.cu, runtime/cuda/moe.py)
against the numpy reference (runtime/moe.py route; gguf's dequantization) and the dense gemv.
The whole forward pass of qwen3moe and qwen2moe is checked against transformers in
test_oracles.py (cuda backend, F32 experts).

Limits: top-k ids equal and weights within 1e-5 relative (float32 softmax, __expf against
numpy's exp). Gathered products, relative L2 over all slots: on float x (float types, the
router) within 1e-5 (float32 dot products of the same dequantized weights, another summation
order); with 8-bit x (moe_gemv_q8) each slot's y bit for bit gemv's on that expert's matrix and
x (same quantization, same summation order), within 1e-4 of the float64 product with x rounded
as the kernels round it (matmul_ref.q8_rounded) and 1e-2 of the float x product (the
rounding of x: about 5e-3 on random data). The SwiGLU launch (gate and up experts): bit for bit
gemv's SwiGLU instance on the interleaved pair, twice those limits (two products). Prefill's
grouped products (moe_grouped.py): within 1e-5 of the gathered ones (another summation order)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from tests.gpu import cupy_or_skip
from tests.matmul_ref import LIMIT_Q8, LIMIT_Q8_ROUNDED, q8_rounded
from k4.runtime.cuda import moe as cmoe
from k4.runtime.cuda.device_weight import make_weight
from k4.runtime.cuda.quant_types import QUANT
from k4.runtime.moe import route
from k4.runtime.synthetic import random_blocks
from k4.runtime.trace import Trace

cp = cupy_or_skip()

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def o():
    from k4.runtime.cuda.ops import Ops

    return Ops(Trace())


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("n_expert,k", [(8, 2), (128, 8), (60, 4), (160, 8)])  # up to 128: warp 0 selects; 160: by rank
def test_topk_matches_the_reference(o, renorm, n_expert, k, ties):
    logits = np.random.default_rng(n_expert).standard_normal((5, n_expert)).astype(np.float32)  # (5 tokens, n_expert)
    if ties:  # logits in steps of 0.5: equal probabilities, taken by the lower id first
        logits = np.round(2 * logits) / 2
    ids, w = cp.zeros(5 * k, cp.int32), cp.zeros(5 * k, cp.float32)
    o._launch("moe.cu", "moe_topk", (5,), (128,), (cp.asarray(logits), np.int32(n_expert), np.int32(k), np.int32(renorm), ids, w),
              shared_mem=4 * n_expert, pdl=False)
    want_ids, want_w = route(logits, k, renorm)
    assert (cp.asnumpy(ids).reshape(5, k) == want_ids).all()
    np.testing.assert_allclose(cp.asnumpy(w).reshape(5, k), want_w, rtol=1e-5)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0, T.F32])
def test_float_x_gathered_product_reads_the_selected_experts(o, ggml_type):
    """The router's path (Experts.float_x) and float expert types: float32 x."""
    E, rows, n_in, rng = 4, 96, 512, np.random.default_rng(1)
    if ggml_type == T.F32:
        raw = (rng.standard_normal((E * rows, n_in)) / np.sqrt(n_in)).astype(np.float32)
        w = raw.reshape(E, rows, n_in)
    else:
        raw = random_blocks(ggml_type, E * rows, n_in, rng, 1 / np.sqrt(n_in))  # (E rows, bytes) uint8
        w = dequantize(raw, ggml_type).reshape(E, rows, n_in)
    e = cmoe.Experts.from_raw(cp.asarray(raw.reshape(-1).view(np.uint8)), ggml_type, (E, rows, n_in), float_x=True)
    x = rng.standard_normal((2, n_in)).astype(np.float32)  # 2 tokens
    ids = np.array([3, 1, 0, 3], np.int32)  # token 0: experts 3, 1; token 1: 0, 3
    y = cp.zeros((4, rows), cp.float32)
    cmoe.gathered(o, e, cp.asarray(ids), cp.asarray(x), 2, n_in, y, 4)
    want = np.stack([w[ids[s]] @ x[s // 2] for s in range(4)])
    got = cp.asnumpy(y)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def _q8_case(ggml_type, E: int, rows: int, n_in: int, n_slots: int, x_div: int, seed: int):
    """Random experts (E, rows, n_in) of ggml_type (raw bytes, dequantized float64), ids
    (n_slots,) int32 with repeats, x rows (ceil(n_slots / x_div), n_in + 32) float32 (32 floats
    of padding: x_stride is not n_in)."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(ggml_type, E * rows, n_in, rng, 1 / np.sqrt(n_in), full_range=True)  # (E rows, bytes)
    w = dequantize(raw, ggml_type).astype(np.float64).reshape(E, rows, n_in)
    ids = rng.integers(0, E, n_slots).astype(np.int32)
    x = rng.standard_normal((-(-n_slots // x_div), n_in + 32)).astype(np.float32)
    return raw.reshape(E, -1), w, ids, x


def _run_q8(o, ggml_type, raw, ids, x, x_div: int, rows: int, n_in: int):
    """moe_gemv_q8 through gathered: y (n_slots, rows) float32 on the host (y starts as NaN)."""
    e = cmoe.Experts.from_raw(cp.asarray(raw.reshape(-1)), ggml_type, (raw.shape[0], rows, n_in))
    assert e.kernel[0] == "moe_gemv.cu"
    y = cp.full((len(ids), rows), np.nan, cp.float32)
    cmoe.gathered(o, e, cp.asarray(ids), cp.asarray(x), x_div, x.shape[1], y, len(ids))
    return cp.asnumpy(y)


def _check_q8(ggml_type, raw, w, ids, x, x_div: int, got: np.ndarray, what: str) -> None:
    """got against the float64 products (q8-rounded and float x, every slot) and bit for bit
    against gemv on the slot's expert (every slot up to 64, then every 97th and the last)."""
    from k4.runtime.cuda import layout as lay
    from k4.runtime.cuda import matmul as mm
    from k4.runtime.model import Tensor

    n_slots, n_in = len(ids), w.shape[2]
    xs = x[np.arange(n_slots) // x_div, :n_in]  # (n_slots, n_in) each slot's x
    want_q8, want = np.empty(got.shape), np.empty(got.shape)
    for e in np.unique(ids):
        sel = ids == e
        want_q8[sel] = q8_rounded(xs[sel].reshape(-1)).reshape(-1, n_in) @ w[e].T
        want[sel] = xs[sel].astype(np.float64) @ w[e].T
    rel = lambda a: float(np.linalg.norm(got - a) / np.linalg.norm(a))  # noqa: E731
    assert rel(want_q8) < LIMIT_Q8_ROUNDED, f"{what}: {rel(want_q8):.2e} from the q8-rounded x product"
    assert rel(want) < LIMIT_Q8, f"{what}: {rel(want):.2e} from the float x product"
    weights = {}
    for s in [*range(min(n_slots, 64)), *range(64, n_slots, 97), n_slots - 1]:
        e = int(ids[s])
        if e not in weights:
            t = Tensor(f"expert {e}", ggml_type, (w.shape[1], n_in), raw[e].reshape(w.shape[1], -1))
            weights[e] = make_weight(t, cp.asarray(lay.weight_layout(t, False)), False)
        y = cp.full(w.shape[1], np.nan, cp.float32)
        mm.gemv(weights[e], cp.asarray(np.ascontiguousarray(x[s // x_div, :n_in])), y)
        assert (cp.asnumpy(y).view(np.uint32) == got[s].view(np.uint32)).all(), f"{what}: slot {s} differs from gemv"


# (rows, n_in, n_slots): decode (8 slots), one slot, prefill up to 4096 slots with repeated
# experts; 8192 inputs step each lane over several chunk groups of a row (U * 32 chunks).
Q8_CASES = [(200, 768, 1), (200, 768, 8), (200, 768, 64), (200, 768, 4096), (48, 8192, 8)]


@pytest.mark.parametrize("x_div", [1, 8])
@pytest.mark.parametrize("rows,n_in,n_slots", Q8_CASES)
@pytest.mark.parametrize("ggml_type", list(QUANT), ids=lambda t: t.name)
def test_q8_gathered_product_is_gemv_of_the_selected_expert(o, ggml_type, rows, n_in, n_slots, x_div):
    seed = zlib.crc32(f"{ggml_type.name} {rows} {n_in} {n_slots} {x_div}".encode())
    raw, w, ids, x = _q8_case(ggml_type, 6, rows, n_in, n_slots, x_div, seed)
    got = _run_q8(o, ggml_type, raw, ids, x, x_div, rows, n_in)
    _check_q8(ggml_type, raw, w, ids, x, x_div, got, f"{ggml_type.name} {rows}x{n_in}, {n_slots} slots, x_div {x_div}")


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_q8_gathered_product_steps_over_slots_beyond_the_grid(o, ggml_type, monkeypatch):
    """Each block takes several slots when grid.y is capped (CUDA's 65535, here 5): x is
    quantized again per slot without racing the previous slot's dots."""
    monkeypatch.setattr(cmoe, "MAX_GRID_Y", 5)
    raw, w, ids, x = _q8_case(ggml_type, 6, 200, 768, 64, 8, 7)
    got = _run_q8(o, ggml_type, raw, ids, x, 8, 200, 768)
    _check_q8(ggml_type, raw, w, ids, x, 8, got, f"{ggml_type.name}, grid.y 5")


@pytest.mark.parametrize("rows,n_in,n_slots", [(200, 768, 8), (200, 768, 4096), (48, 8192, 8)])
@pytest.mark.parametrize("ggml_type", list(QUANT), ids=lambda t: t.name)
def test_q8_gathered_swiglu_is_gemv_of_the_interleaved_pair(o, ggml_type, rows, n_in, n_slots):
    """gathered with up (one moe_gemv_q8 SwiGLU launch): each slot bit for bit gemv's SwiGLU
    instance on the expert's interleaved gate/up pair; all slots within 2e-4 of the float64
    silu(gate) * up of the q8-rounded x (twice the single product's limit: two products), 2e-2 of the float x."""
    from k4.runtime.cuda import layout as lay
    from k4.runtime.cuda import matmul as mm
    from k4.runtime.model import Tensor
    from tests.helpers_matmul import interleave_rows

    seed = zlib.crc32(f"glu {ggml_type.name} {rows} {n_in} {n_slots}".encode())
    raw_g, w_g, ids, x = _q8_case(ggml_type, 6, rows, n_in, n_slots, 8, seed)
    raw_u, w_u, _, _ = _q8_case(ggml_type, 6, rows, n_in, n_slots, 8, seed + 1)
    shape = (6, rows, n_in)
    gate, up = (cmoe.Experts.from_raw(cp.asarray(r.reshape(-1)), ggml_type, shape) for r in (raw_g, raw_u))
    assert cmoe.fused_glu(gate, up, "silu") and not cmoe.fused_glu(gate, up, "gelu_tanh")
    y = cp.full((n_slots, rows), np.nan, cp.float32)
    cmoe.gathered(o, gate, cp.asarray(ids), cp.asarray(x), 8, x.shape[1], y, n_slots, up=up)
    got = cp.asnumpy(y)

    xs = x[np.arange(n_slots) // 8, :n_in]
    want_q8, want = np.empty(got.shape), np.empty(got.shape)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    for e in np.unique(ids):
        sel = ids == e
        xq = q8_rounded(xs[sel].reshape(-1)).reshape(-1, n_in)
        want_q8[sel] = silu(xq @ w_g[e].T) * (xq @ w_u[e].T)
        xf = xs[sel].astype(np.float64)
        want[sel] = silu(xf @ w_g[e].T) * (xf @ w_u[e].T)
    rel = lambda a: float(np.linalg.norm(got - a) / np.linalg.norm(a))  # noqa: E731
    assert rel(want_q8) < 2 * LIMIT_Q8_ROUNDED, f"{rel(want_q8):.2e} from the q8-rounded x (seed {seed})"
    assert rel(want) < 2 * LIMIT_Q8, f"{rel(want):.2e} from the float x (seed {seed})"
    pairs = {}
    for s in [*range(min(n_slots, 64)), *range(64, n_slots, 97), n_slots - 1]:
        e = int(ids[s])
        if e not in pairs:
            g, u = (Tensor(n, ggml_type, (rows, n_in), r[e].reshape(rows, -1)) for n, r in (("gate", raw_g), ("up", raw_u)))
            t = interleave_rows(g, u, f"gate/up {e}")
            pairs[e] = make_weight(t, cp.asarray(lay.weight_layout(t, False)), False, glu=True)
        ye = cp.full(rows, np.nan, cp.float32)
        mm.gemv(pairs[e], cp.asarray(np.ascontiguousarray(x[s // 8, :n_in])), ye)
        assert (cp.asnumpy(ye).view(np.uint32) == got[s].view(np.uint32)).all(), f"slot {s} differs from gemv (seed {seed})"


def test_q8_gathered_swiglu_refuses_experts_it_cannot_fuse(o):
    rng = np.random.default_rng(3)
    q4, q5 = (cmoe.Experts.from_raw(cp.asarray(random_blocks(t, 2 * 64, 256, rng, 0.1).reshape(-1)), t, (2, 64, 256))
              for t in (T.Q4_K, T.Q5_K))
    ids, x, y = cp.zeros(8, cp.int32), cp.zeros((1, 256), cp.float32), cp.zeros((8, 64), cp.float32)
    with pytest.raises(ValueError, match="cannot run as one launch"):
        cmoe.gathered(o, q4, ids, x, 8, 256, y, 8, up=q5)


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


# ---- decode in three launches (runtime/cuda/moe.py decode_fused) ---------------------------------
# Limits: the routed SwiGLU launch normalizes x itself (the RMSNorm of gemv_common.cuh, summed in
# another order than numpy's, so a q8 quant can land one step off): within 2 * LIMIT_Q8 of the float
# x reference, as the unrouted launch. moe_down_combine: x given, quantized exactly as q8_rounded
# does, so within LIMIT_Q8_ROUNDED of the float64 sum over the q8-rounded x and LIMIT_Q8 of the float x.


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x) + eps) * w


@pytest.mark.parametrize("ggml_type,E,k,rows,n_in", [(T.Q4_K, 128, 8, 64, 1024), (T.Q6_K, 16, 4, 96, 512),
                                                     (T.Q8_0, 8, 2, 64, 256)], ids=lambda v: getattr(v, "name", str(v)))
def test_routed_swiglu_routes_and_normalizes_in_each_block(o, ggml_type, E, k, rows, n_in):
    rng = np.random.default_rng(E + k)
    raw_g, w_g, _, _ = _q8_case(ggml_type, E, rows, n_in, 1, 1, E)
    raw_u, w_u, _, _ = _q8_case(ggml_type, E, rows, n_in, 1, 1, E + 1)
    gate, up = (cmoe.Experts.from_raw(cp.asarray(r.reshape(-1)), ggml_type, (E, rows, n_in)) for r in (raw_g, raw_u))
    x1 = rng.standard_normal((1, n_in)).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    logits = rng.standard_normal(E).astype(np.float32)
    y = cp.full((k, rows), np.nan, cp.float32)
    route = cmoe.Route(cp.asarray(logits), E, True)
    cmoe.gathered(o, gate, None, cp.asarray(x1), k, n_in, y, k, up=up, route=route, norm=(cp.asarray(norm_w), 1e-6))
    ids, _ = route_of(logits, k)
    h = _rmsnorm(x1[0], norm_w, 1e-6)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    want = np.stack([silu(w_g[e] @ h) * (w_u[e] @ h) for e in ids])
    got = cp.asnumpy(y)
    assert rel_l2(got, want) < 2 * LIMIT_Q8, f"{rel_l2(got, want):.2e} from the float x (experts {ids})"


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_router_product_normalizes_x_in_each_block(o, ggml_type):
    """moe.cu moe_router: float32 dot products of the router's rows (as stored) with the RMSNorm of
    x, within 1e-5 relative (float32 sums in another order) of the float64 product."""
    E, n_in, rng = 128, 2048, np.random.default_rng(6)
    w = (rng.standard_normal((E, n_in)) / np.sqrt(n_in)).astype(np.float32)
    stored = {T.F32: w, T.F16: w.astype(np.float16), T.BF16: (w.view(np.uint32) >> 16).astype(np.uint16)}[ggml_type]
    exact = stored.astype(np.float64) if ggml_type != T.BF16 else (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    x = rng.standard_normal(n_in).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    y = cp.full(E, np.nan, cp.float32)
    o._launch("moe.cu", cmoe.router_name(ggml_type), (E,), (cmoe.ROUTER_THREADS,),
              (cp.asarray(stored.view(np.uint8)), cp.asarray(x), cp.asarray(norm_w), np.float32(1e-6), y, np.int32(n_in)))
    want = exact @ _rmsnorm(x, norm_w, 1e-6)
    assert rel_l2(cp.asnumpy(y), want) < 1e-5


def route_of(logits: np.ndarray, k: int):
    ids, w = route(logits[None], k, True)
    return ids[0], w[0]


def rel_l2(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("ggml_type,E,k,rows,n_in", [(T.Q4_K, 16, 8, 520, 768), (T.Q6_K, 32, 8, 200, 768),
                                                     (T.Q4_K, 16, 4, 300, 2560), (T.Q8_0, 8, 2, 64, 64),
                                                     (T.Q5_K, 8, 1, 40, 256)], ids=lambda v: getattr(v, "name", str(v)))
def test_down_combine_adds_the_weighted_chosen_experts(o, ggml_type, E, k, rows, n_in, renorm):
    rng = np.random.default_rng(rows + k)
    raw, w, _, _ = _q8_case(ggml_type, E, rows, n_in, 1, 1, rows)
    e = cmoe.Experts.from_raw(cp.asarray(raw.reshape(-1)), ggml_type, (E, rows, n_in))
    x = rng.standard_normal((k, n_in)).astype(np.float32)
    res = rng.standard_normal(rows).astype(np.float32)
    logits = rng.standard_normal(E).astype(np.float32)
    y = cp.full(rows, np.nan, cp.float32)
    cmoe.down_combine(o, e, cmoe.Route(cp.asarray(logits), E, renorm), cp.asarray(x), cp.asarray(res), y)
    ids, wts = route(logits[None], k, renorm)
    ids, wts = ids[0], wts[0]
    want_q8 = res + sum(wts[j] * (w[ids[j]] @ q8_rounded(x[j])) for j in range(k))
    want = res + sum(wts[j] * (w[ids[j]] @ x[j].astype(np.float64)) for j in range(k))
    got = cp.asnumpy(y)
    assert rel_l2(got, want_q8) < LIMIT_Q8_ROUNDED, f"{rel_l2(got, want_q8):.2e} from the q8-rounded x"
    assert rel_l2(got, want) < LIMIT_Q8, f"{rel_l2(got, want):.2e} from the float x"
    y2 = cp.asarray(res)  # y may be the residual itself
    cmoe.down_combine(o, e, cmoe.Route(cp.asarray(logits), E, renorm), cp.asarray(x), y2, y2)
    assert (cp.asnumpy(y2) == got).all()


def test_down_combine_refuses_what_its_lane_groups_cannot_split(o):
    rng = np.random.default_rng(4)
    e = cmoe.Experts.from_raw(cp.asarray(random_blocks(T.Q8_0, 8 * 64, 64, rng, 0.1).reshape(-1)), T.Q8_0, (8, 64, 64))
    route_ = cmoe.Route(cp.zeros(8, cp.float32), 8, True)
    with pytest.raises(ValueError, match="k dividing 32"):
        cmoe.down_combine(o, e, route_, cp.zeros((3, 64), cp.float32), cp.zeros(64, cp.float32), cp.zeros(64, cp.float32))


def _decode_steps(mf, monkeypatch, flag: str, values, module, attr: str, seed: int) -> tuple[dict, dict]:
    """The logits of three decode steps after a 12-token prompt of mf on the cuda backend for each
    value of the environment flag `flag`, and how often module.attr ran under each (wrapped)."""
    from k4.runtime.cuda.backend import CudaBackend

    prompt = np.random.default_rng(seed).integers(3, mf.config.n_vocab, size=12).tolist()
    calls = []
    real = getattr(module, attr)
    monkeypatch.setattr(module, attr, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    out, counts = {}, {}
    for v in values:
        monkeypatch.setenv(flag, v)
        before = len(calls)
        be = CudaBackend(mf, 64)
        try:
            be.eval(prompt)
            out[v] = [be.eval([t]) for t in (5, 9, 17)]
        finally:
            be.close()
        counts[v] = len(calls) - before
    return out, counts


def test_decode_runs_fused_and_matches_the_unfused_step(tiny_model, monkeypatch):
    """qwen3moe with Q4_K experts (k = 8): the decode step takes decode_fused on every layer (graph
    captures included), and its logits agree with the step of separate RMSNorm, top-k and combine
    kernels (K4_FUSE_MOE=0) within the 8-bit rounding both make (limit 5e-3 relative). The
    captured step (graph, PDL) is checked against numpy by test_cuda_backend.py
    test_logits_match_numpy_backend."""
    mf = tiny_model("qwen3moe-q4_k")
    monkeypatch.setenv("K4_MOE_ONE", "0")  # the three launches (the test below: one)
    out, counts = _decode_steps(mf, monkeypatch, "K4_FUSE_MOE", ("1", "0"), cmoe, "down_combine", 8)
    n = mf.config.n_layer
    assert counts["1"] >= 3 * n and counts["1"] % n == 0 and counts["0"] == 0
    for a, b in zip(out["1"], out["0"]):
        assert rel_l2(a, b) < 5e-3


def test_decode_in_one_launch_has_the_bits_of_three(tiny_model, monkeypatch):
    """K4_MOE_ONE: every layer of every decode step (graph captures included) runs moe_one.cu, and
    the logits are those of the three launches (K4_MOE_ONE=0), bit for bit."""
    from k4.runtime.cuda import moe_one

    mf = tiny_model("qwen3moe-q4_k")
    out, counts = _decode_steps(mf, monkeypatch, "K4_MOE_ONE", ("1", "0"), moe_one, "launch", 9)
    n = mf.config.n_layer
    assert counts["1"] >= 3 * n and counts["1"] % n == 0 and counts["0"] == 0
    for a, b in zip(out["1"], out["0"]):
        assert (a.view(np.uint32) == b.view(np.uint32)).all()


def test_planar_experts_change_no_bit(tiny_model, monkeypatch):
    """K4_PLANAR_EXPERTS: Q6_K expert tensors (gate, up and down of every layer) go to the device
    planar (layout.expert_layout at load, T::expert_planar in every MoE kernel, moe_one's down loads
    before its block's arrival), and the logits of the prompt's prefill and three decode steps are
    those of the raw blocks (K4_PLANAR_EXPERTS=0), bit for bit."""
    from k4.runtime.cuda import layout

    mf = tiny_model("qwen3moe-q6_k")
    out, counts = _decode_steps(mf, monkeypatch, "K4_PLANAR_EXPERTS", ("1", "0"), layout, "expert_layout", 10)
    assert counts == {"1": 3 * mf.config.n_layer, "0": 0}
    for a, b in zip(out["1"], out["0"]):
        assert (a.view(np.uint32) == b.view(np.uint32)).all()


# ---- prefill's slots grouped by expert (runtime/cuda/moe_grouped.py) -----------------------------

@pytest.mark.parametrize("n_slots,E", [(72, 6), (4096, 128), (4096, 5)])
def test_group_orders_every_slot_once_in_items_of_one_expert(o, n_slots, E):
    from k4.runtime.cuda import moe_grouped as mg

    rng = np.random.default_rng(n_slots + E)
    ids = rng.integers(0, E, n_slots).astype(np.int32)
    ids[ids == 1] = 0  # an expert nobody chose
    need = mg.max_items(n_slots, E)
    items, order = cp.full((need, 4), -1, cp.int32), cp.full(n_slots, -1, cp.int32)
    mg.group(o, cp.asarray(ids), n_slots, E, items, order)
    items, order = cp.asnumpy(items), cp.asnumpy(order)
    assert sorted(order) == list(range(n_slots))
    used = items[items[:, 2] > 0]
    assert (items[len(used):, 2] == 0).all() and (used[:, 2] <= mg.MOE_GROUP_TOKENS).all()
    assert used[:, 2].sum() == n_slots
    for e, first, count, _ in used:
        assert (ids[order[first : first + count]] == e).all()
    for e in range(E):  # each expert's slots in full items, one part-filled at most
        c = int((ids == e).sum())
        assert len(used[used[:, 0] == e]) == -(-c // mg.MOE_GROUP_TOKENS)


@pytest.mark.parametrize("passes", [None, 1])  # the default, and one row pass per lane group: several blocks an item
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_grouped_products_are_the_gathered_ones(o, ggml_type, glu, passes, monkeypatch):
    """moe_gemv_grouped against moe_gemv_q8 (itself bit for bit gemv's): every slot's y within 1e-5
    relative (the same 8-bit dot products summed in another order), over slots of experts chosen
    0 to ~60 times (items of 8 and part-filled ones), x_div 8 (gate/up) or 1 (down); rows of 768
    (lane groups of 4, 8 rows a warp) and 512 weights."""
    from k4.runtime.cuda import moe_grouped as mg

    if passes:
        monkeypatch.setattr(mg, "ROW_PASSES", passes)
    E, rows, n_in, n_tok, k = 12, 136, 768 if glu else 512, 61, 8
    x_div = 8 if glu else 1
    seed = zlib.crc32(f"grouped {ggml_type.name} {glu}".encode())
    raw, _, ids, x = _q8_case(ggml_type, E, rows, n_in, n_tok * k, x_div, seed)
    ids[ids == 3] = 2  # an expert nobody chose
    gate = cmoe.Experts.from_raw(cp.asarray(raw.reshape(-1)), ggml_type, (E, rows, n_in))
    up = None
    if glu:
        raw_u, _, _, _ = _q8_case(ggml_type, E, rows, n_in, 1, 1, seed + 1)
        up = cmoe.Experts.from_raw(cp.asarray(raw_u.reshape(-1)), ggml_type, (E, rows, n_in))
    n_slots, d_ids, d_x = n_tok * k, cp.asarray(ids), cp.asarray(x)
    want = cp.full((n_slots, rows), np.nan, cp.float32)
    cmoe.gathered(o, gate, d_ids, d_x, x_div, x.shape[1], want, n_slots, up=up)
    n_items = mg.max_items(n_slots, E)
    items, order = cp.empty((n_items, 4), cp.int32), cp.empty(n_slots, cp.int32)
    mg.group(o, d_ids, n_slots, E, items, order)
    got = cp.full((n_slots, rows), np.nan, cp.float32)
    mg.grouped(o, gate, items, order, n_items, d_x, x_div, x.shape[1], got, up=up)
    got, want = cp.asnumpy(got), cp.asnumpy(want)
    assert np.isfinite(got).all() and rel_l2(got, want) < 1e-5
