"""Decode's mixture-of-experts feed-forward in one launch (kernels_cu/moe_one.cu,
runtime/cuda/moe_one.py, K4_MOE_ONE) against the three launches it replaces (moe.cu moe_router, the
routed SwiGLU launch of moe_gemv.cu, moe_down.cu moe_down_combine), which test_cuda_moe.py checks
against numpy. Limit: none. The one launch shares their arithmetic, so the router's logits, the
SwiGLU rows and the output are the same bits, for every expert pair it is built for, with more
experts than blocks (the router phase's loop), renormalized weights or not, and in place; each
launch tags every logit and every block's flag anew."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.gpu import cupy_or_skip
from k4.runtime.cuda import moe as cmoe
from k4.runtime.cuda import moe_one
from k4.runtime.synthetic import random_blocks
from k4.runtime.trace import Trace

cp = cupy_or_skip()

pytestmark = pytest.mark.cuda
EPS = 1e-6


@pytest.fixture(scope="module")
def o():
    from k4.runtime.cuda.ops import Ops

    return Ops(Trace())


def _experts(rng, t, E: int, rows: int, n_in: int) -> cmoe.Experts:
    raw = random_blocks(t, E * rows, n_in, rng, 1 / np.sqrt(n_in), full_range=True)
    return cmoe.Experts.from_raw(cp.asarray(raw.reshape(-1)), t, (E, rows, n_in))


def _layer(seed: int, gate_t, down_t, E: int, n_embd: int, n_ff: int) -> cmoe.MoeWeights:
    rng = np.random.default_rng(seed)
    router = (rng.standard_normal((E, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    r = cmoe.Experts.from_raw(cp.asarray(router.view(np.uint8).reshape(-1)), T.F32, (1, E, n_embd), float_x=True)
    return cmoe.MoeWeights(r, _experts(rng, gate_t, E, n_ff, n_embd), _experts(rng, gate_t, E, n_ff, n_embd),
                           _experts(rng, down_t, E, n_embd, n_ff))


def _three(o, m: cmoe.MoeWeights, x, norm_w, k: int, renorm: bool):
    """(logits, SwiGLU rows, y) of moe.decode_fused's three launches."""
    E, n_ff, n_embd = m.gate.shape
    logits = cp.full(E, np.nan, cp.float32)
    o._launch("moe.cu", cmoe.router_name(T.F32), (E,), (cmoe.ROUTER_THREADS,),
              (m.router.data, x, norm_w, np.float32(EPS), logits, np.int32(n_embd)))
    route = cmoe.Route(logits, E, renorm)
    g = cp.full((k, n_ff), np.nan, cp.float32)
    cmoe.gathered(o, m.gate, None, x[None], k, n_embd, g, k, up=m.up, route=route, norm=(norm_w, EPS))
    y = cp.full(n_embd, np.nan, cp.float32)
    cmoe.down_combine(o, m.down, route, g, x, y)
    return logits, g, y


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("gate_t,down_t,E,k,n_embd,n_ff", [
    (T.Q4_K, T.Q4_K, 128, 8, 2048, 768),  # Qwen3-30B-A3B's shapes
    (T.Q4_K, T.Q6_K, 16, 4, 512, 256),
    (T.Q6_K, T.Q6_K, 160, 8, 256, 512),   # more experts than the H200's 132 blocks
], ids=lambda v: getattr(v, "name", str(v)))
def test_one_launch_has_the_bits_of_three(o, gate_t, down_t, E, k, n_embd, n_ff, renorm):
    m = _layer(E + k + n_ff, gate_t, down_t, E, n_embd, n_ff)
    rng = np.random.default_rng(n_embd)
    x = cp.asarray(rng.standard_normal(n_embd).astype(np.float32))
    norm_w = cp.asarray((1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32))
    want = [cp.asnumpy(a) for a in _three(o, m, x, norm_w, k, renorm)]
    G = cp.cuda.Device().attributes["MultiProcessorCount"]
    ho = moe_one.Handoff(cp.zeros(E, cp.uint64), cp.zeros(1, cp.uint64), cp.zeros(1, cp.uint64))
    h = cp.full((k, n_ff), np.nan, cp.float32)
    for launch in (1, 2):
        y = cp.full(n_embd, np.nan, cp.float32)
        assert moe_one.launch(o, m, x, norm_w, EPS, h, ho, y, k, renorm)
        words = cp.asnumpy(ho.words)
        assert ((words >> 32) == launch).all()  # every logit written, with this launch's tag
        got = ((words & 0xFFFFFFFF).astype(np.uint32), cp.asnumpy(h).view(np.uint32), cp.asnumpy(y).view(np.uint32))
        for g, w, what in zip(got, want, ("logits", "SwiGLU rows", "output")):
            assert (g == w.view(np.uint32)).all(), what
        assert int(ho.arrived[0]) == launch * G  # every block arrived once
        assert int(ho.count[0]) == launch * G  # and finished once
    x2 = x.copy()  # y may be x
    assert moe_one.launch(o, m, x2, norm_w, EPS, h, ho, x2, k, renorm)
    assert (cp.asnumpy(x2).view(np.uint32) == want[2].view(np.uint32)).all()


def test_other_types_keep_three_launches():
    m = _layer(1, T.Q8_0, T.Q8_0, 8, 256, 256)
    assert moe_one.kernel_name(T.F32, m.gate, m.down) is None
    m = _layer(1, T.Q4_K, T.Q6_K, 8, 256, 256)
    assert moe_one.kernel_name(T.F16, m.gate, m.down) is None  # a router of another type
    assert moe_one.kernel_name(T.F32, m.gate, m.down) is not None
