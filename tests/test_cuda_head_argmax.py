"""The output head's argmax partials (K4_HEAD_ARGMAX: kernels_cu/gemv.cu gemv_q8's AM instances,
runtime/cuda/matmul.py gemv argmax) and sample_finish reading them (kernels_cu/sampling.cu): the
partials give exactly np.argmax of the logits the same launch writes (the lowest row on equal
values, across blocks too), the logits are the plain product's bits, and greedy sampling ignores
partials made before a repeat penalty changed the logits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.gpu import cupy_or_skip
from k4.runtime.sampling import SamplingParams, apply_repeat_penalty
from tests.matmul_ref import fresh_rng, nan_like, weight

cp = cupy_or_skip()
from k4.runtime.cuda import matmul as mm  # noqa: E402  (needs CuPy)
from k4.runtime.cuda import ops as ops_mod  # noqa: E402
from k4.runtime.cuda.constants import ARGMAX_PARTS  # noqa: E402
from k4.runtime.cuda.device_weight import make_weight  # noqa: E402

pytestmark = pytest.mark.cuda


NO_INDEX = 0x7FFFFFFF  # argmax.cuh: a warp without rows


def combine(vals: np.ndarray, idx: np.ndarray) -> int:
    """sample_finish's reduction of partials on the host: the largest value, the lowest row on ties."""
    pairs = [(v, i) for v, i in zip(vals, idx) if i != NO_INDEX]
    best = max(v for v, _ in pairs)
    return int(min(i for v, i in pairs if v == best))


def head_with_partials(w, x, norm=None):
    """(logits, the partials' argmax, their count) of one gemv with argmax on x."""
    n_out = w.shape[0]
    y, pv, pi = nan_like(n_out), cp.full(ARGMAX_PARTS, cp.nan, cp.float32), cp.full(ARGMAX_PARTS, -1, cp.int32)
    n = mm.gemv(w, cp.asarray(x), y, argmax=(pv, pi), norm=norm)
    assert 0 < n <= ARGMAX_PARTS
    return y.get(), combine(pv.get()[:n], pi.get()[:n]), n


@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("type_name, n_out, n_in", [("Q6_K", 32000, 2048), ("Q6_K", 5003, 4096), ("Q4_K", 2051, 256),
                                                    ("Q8_0", 1000, 512), ("Q5_K", 300, 1024)])
def test_partials_give_the_argmax_of_the_logits_written(type_name, n_out, n_in, repack):
    rng, seed = fresh_rng()
    w, _ = weight(type_name, n_out, n_in, rng, repack)
    assert mm.argmax_ok(w)
    x = rng.standard_normal(n_in).astype(np.float32)
    plain = nan_like(n_out)
    mm.gemv(w, cp.asarray(x), plain)
    norm_w = cp.asarray(rng.uniform(0.5, 1.5, n_in).astype(np.float32))
    for norm in (None, (norm_w, 1e-5)):  # x as is, and the RMSNorm prologue the head runs after a layer
        logits, top, n = head_with_partials(w, x, norm)
        what = f"{type_name} {n_out}x{n_in} repack={repack} norm={norm is not None} (seed {seed})"
        assert top == int(np.argmax(logits)), what
        if norm is None:  # the AM instance computes every output as the plain one does
            assert np.array_equal(logits, plain.get()), what


@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
def test_equal_logits_go_to_the_lowest_row(repack):
    """Rows copied from the winner into rows of other blocks: the first copy wins, as np.argmax."""
    from k4.runtime.cuda import layout as lay
    from k4.runtime.cuda.microbench import random_weight

    rng, seed = fresh_rng()
    n_out, n_in = 4096, 1024
    t = random_weight(T.Q6_K, n_out, n_in, rng)
    x = rng.standard_normal(n_in).astype(np.float32)
    first = make_weight(t, cp.asarray(lay.weight_layout(t, repack)), repack)
    logits, top, _ = head_with_partials(first, x)
    raw, copies = np.array(t.raw, copy=True), [top]
    for row in ((top + 1) % n_out, 3 * n_out // 4, 17, 5):  # later, then earlier rows, in other blocks than top's
        raw[row] = raw[top]
        copies.append(row)
        t2 = replace(t, raw=raw)
        w = make_weight(t2, cp.asarray(lay.weight_layout(t2, repack)), repack)
        logits, got, _ = head_with_partials(w, x)
        assert logits[row] == logits[top], f"row {row} (seed {seed})"
        assert got == int(np.argmax(logits)) == min(copies), f"row {row} (seed {seed})"


def test_argmax_refuses_what_it_does_not_cover():
    rng, _ = fresh_rng()
    w, _ = weight("Q6_K", 512, 256, rng, True)
    x, y = cp.zeros(256, cp.float32), cp.zeros(512, cp.float32)
    parts = (cp.zeros(ARGMAX_PARTS, cp.float32), cp.zeros(ARGMAX_PARTS, cp.int32))
    with pytest.raises(ValueError, match="argmax"):
        mm.gemv(w, x, y, argmax=parts, residual=y)
    with pytest.raises(ValueError, match="argmax"):
        mm.gemv(w, x, y, argmax=(parts[0][:1], parts[1][:1]))
    f32, _ = weight("F32", 512, 256, rng, True)
    assert not mm.argmax_ok(f32)
    with pytest.raises(ValueError, match="argmax"):
        mm.gemv(f32, x, y, argmax=parts)


def _finish(ops, logits, params, history, parts):
    """The token ops.sample picks from host logits with the head's partials `parts` (values, rows)."""
    n_vocab = logits.shape[0]
    state, ring, seen = cp.zeros(ops_mod.STATE_WORDS, cp.int32), cp.zeros(1024, cp.int32), cp.zeros(n_vocab, cp.int32)
    window = history[len(history) - min(params.repeat_last_n, len(history)) :]
    ring[: len(window)] = cp.asarray(window, dtype=cp.int32)
    state[ops_mod.ST_RING] = len(window)
    pv, pi = cp.full(ARGMAX_PARTS, -np.inf, cp.float32), cp.zeros(ARGMAX_PARTS, cp.int32)
    pv[: len(parts[0])], pi[: len(parts[1])] = cp.asarray(parts[0], cp.float32), cp.asarray(parts[1], cp.int32)
    d_logits = cp.asarray(logits)
    ops.sample(d_logits, cp.asarray(ops_mod.pack_sampler_params(params)), state, ring, seen, pv, pi, advance=False,
               head_parts=len(parts[0]))
    return int(state.get()[ops_mod.ST_TOK]), d_logits.get()


def test_greedy_takes_the_head_partials_unless_a_penalty_changed_the_logits(ops):
    rng, seed = fresh_rng()
    n_vocab = 32000
    logits = (3 * rng.standard_normal(n_vocab)).astype(np.float32)
    # partials that name row 123 (not the argmax): without a penalty the sampler trusts them
    parts = ([-1.0, 50.0, 50.0, 2.0], [7, 9000, 123, 5])
    plain = SamplingParams(temperature=0.0, repeat_penalty=1.0)
    assert _finish(ops, logits, plain, [1, 2, 3], parts)[0] == 123
    # with the penalty on a window that holds the argmax, the partials (made before it) are ignored
    history = [int(np.argmax(logits))] + rng.integers(0, 300, size=40).tolist()
    penalized = SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=64)
    tok, got = _finish(ops, logits, penalized, history, parts)
    want = apply_repeat_penalty(logits, history, 1.5, 64)
    assert np.array_equal(got, want) and tok == int(np.argmax(want)), f"seed {seed}"
    # an empty window leaves the logits alone: the partials again
    assert _finish(ops, logits, SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=0), history, parts)[0] == 123
