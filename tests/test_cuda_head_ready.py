"""K4_HEAD_READY: decode's q/k/v product counts the rows each warp wrote (kernels_cu/gemv.cu's RD
instances, device.cuh count_rows_done) and attn_short starts each query head once its rows are
counted, instead of waiting for the whole product (attention_short.cu `ready`). Checked here: each
row counted once, in its head's count, by the plain product and the pair; the same output bits
with and without counting (the RD instances run the plain instances' row loops; attention computes
the same after either wait); the counts left zero; that attention really waits for them (its
inputs written after it started); and the decode logits of a model, bit for bit, with the flag on
and off, reading x or the down product's handoff, in 16 and 20 warps."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.attention_ref import fresh_inputs
from tests.gpu import cupy_or_skip
from tests.matmul_ref import fresh_rng, nan_like, weight

cp = cupy_or_skip()
pytestmark = pytest.mark.cuda

from k4.runtime.cuda import gemv_choice as gc  # noqa: E402  (needs CuPy)
from k4.runtime.cuda import matmul as mm  # noqa: E402
from k4.runtime.cuda.op_args import FreshKV  # noqa: E402

PER = 64  # rows a count: a head of 64 dims


@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
@pytest.mark.parametrize("type_name,wide", [("Q4_K", False), ("Q4_K", True), ("Q6_K", False)])
def test_gemv_counts_every_row_once_and_keeps_its_bits(type_name, wide, repack):
    """gemv with ready: the outputs of the same launch without it, bit for bit (bias and the
    RMSNorm folded in), and counts[h] = 64 for each head of 64 rows, the spare count untouched;
    rows over several rounds of the grid's warps (5,120 = 80 heads) and fewer than its warps."""
    rng, seed = fresh_rng()
    variant = gc.QKV_VARIANT[T.Q4_K] if wide else None
    for n_out, n_in in ((640, 512), (5120, 1024)):
        w, _ = weight(type_name, n_out, n_in, rng, repack)
        x = cp.asarray((2 * rng.standard_normal(n_in) + 0.3).astype(np.float32))
        bias = cp.asarray(rng.standard_normal(n_out).astype(np.float32))
        norm = (cp.asarray((1 + 0.2 * rng.standard_normal(n_in)).astype(np.float32)), 1e-5)
        plain, counted = nan_like(n_out), nan_like(n_out)
        counts = cp.zeros(n_out // PER + 1, cp.int32)
        mm.gemv(w, x, plain, bias=bias, norm=norm, variant=variant)
        mm.gemv(w, x, counted, bias=bias, norm=norm, variant=variant, ready=(counts, PER))
        what = f"{type_name} {n_out}x{n_in} wide={wide} (seed {seed})"
        assert cp.array_equal(plain, counted) and not cp.isnan(plain).any(), what
        assert counts.get().tolist() == [PER] * (n_out // PER) + [0], what


def test_gemv_refuses_counts_where_it_cannot_count():
    """ready needs a plain product in an RD variant: not with a residual, a gate/up weight's
    SwiGLU, a variant without RD instances, or too few counts."""
    rng, _ = fresh_rng()
    w, _ = weight("Q4_K", 256, 512, rng, True)
    x, y = cp.zeros(512, cp.float32), cp.zeros(256, cp.float32)
    counts = cp.zeros(256 // PER + 1, cp.int32)
    with pytest.raises(ValueError, match="ready counts"):
        mm.gemv(w, x, y, residual=y, ready=(counts, PER))
    with pytest.raises(ValueError, match="ready counts"):
        mm.gemv(w, x, y, variant=gc.ROW_BLOCKS_VARIANT[T.Q4_K], ready=(counts, PER))
    with pytest.raises(ValueError, match="ready counts"):
        mm.gemv(w, x, y, ready=(counts[:2], PER))
    assert mm.ready_ok(w) and mm.ready_ok(w, gc.QKV_VARIANT[T.Q4_K]) and not mm.ready_ok(w, gc.ROW_BLOCKS_VARIANT[T.Q4_K])


@pytest.mark.parametrize("repack", [True, False], ids=["planar", "raw"])
def test_the_pair_counts_its_second_matrix_after_its_first(repack):
    """gemv_pair with ready (Q4_K q|k, Q6_K v): the bits of the pair without it, and every row
    counted in its head's count, the v rows as rows n1 + r."""
    from k4.runtime.cuda.gemv_pair import gemv_pair

    rng, seed = fresh_rng()
    for n1, n2, n_in in ((384, 128, 512), (5120, 1024, 4096)):
        (w1, _), (w2, _) = (weight(t, n, n_in, rng, repack) for t, n in (("Q4_K", n1), ("Q6_K", n2)))
        x = cp.asarray((2 * rng.standard_normal(n_in)).astype(np.float32))
        norm = (cp.asarray((1 + 0.2 * rng.standard_normal(n_in)).astype(np.float32)), 1e-5)
        want, got = [nan_like(n1), nan_like(n2)], [nan_like(n1), nan_like(n2)]
        counts = cp.zeros((n1 + n2) // PER + 1, cp.int32)
        gemv_pair(w1, w2, x, *want, norm=norm)
        gemv_pair(w1, w2, x, *got, norm=norm, ready=(counts, PER))
        what = f"{n1}+{n2}x{n_in} (seed {seed})"
        assert all(cp.array_equal(a, b) for a, b in zip(got, want)) and not cp.isnan(want[0]).any(), what
        assert counts.get().tolist() == [PER] * ((n1 + n2) // PER) + [0], what


def _short_case(ops, rng, arch, n_head, n_head_kv, D, pos0):
    """(fresh inputs, attention arguments, limit) of one attn_short decode step at pos0, one split
    up to its keys and SHORT_SPLITS past them."""
    from k4.runtime.cuda.attention_launch import SHORT_SPLITS

    keys = ops.short_limit(D)
    limit, n_split = (keys, 1) if pos0 + 1 <= keys else (SHORT_SPLITS * keys, SHORT_SPLITS)
    srcs, rope, pos, cache = fresh_inputs(rng, arch, n_head, n_head_kv, D, pos0, 640)
    part, ticket = cp.empty((1, n_head, n_split, D + 2), cp.float32), cp.zeros(n_head, cp.int32)
    return srcs, rope, pos, cache, (n_split, keys, part, ticket), limit


@pytest.mark.parametrize("arch,n_head,n_head_kv,D,pos0", [("llama", 8, 2, 64, 77), ("qwen3", 4, 4, 128, 5),
                                                          ("qwen2", 8, 2, 128, 300), ("llama", 4, 2, 256, 0)])
def test_attention_with_counts_done_gives_the_bits_and_zeroes_them(ops, rng, arch, n_head, n_head_kv, D, pos0):
    """attn_short given counts that are already complete (D for every q, k and v head): the output
    and the cache of the launch without them, bit for bit, in one split and in several; the counts
    and the blocks' tally are zero afterwards, for the next layer's product."""
    srcs, rope, pos, cache, splits, limit = _short_case(ops, rng, arch, n_head, n_head_kv, D, pos0)
    outs, caches = [], []
    for ready in (None, cp.asarray([D] * (n_head + 2 * n_head_kv) + [0], cp.int32)):
        kc, vc = (c.copy() for c in cache)
        out = cp.full((1, n_head, D), np.nan, cp.float32)
        ops.attention(cp.full((1, n_head, D), np.nan, cp.float32), kc, vc, out, pos, *splits, FreshKV(*srcs, rope),
                      limit=limit, ready=ready)
        outs.append(out)
        caches.append((kc, vc))
        if ready is not None:
            assert not ready.any()
    assert not cp.isnan(outs[0]).any() and cp.array_equal(outs[1], outs[0])
    assert all(cp.array_equal(a, b) for a, b in zip(*caches))


def test_attention_waits_for_its_heads_rows(ops, rng):
    """attn_short launched before its q, k and v exist (NaN, counts zero) on one stream, then on
    another stream the rows are written and counted: the output is that of the finished rows, so
    every block waited for its counts (without the wait it reads NaN)."""
    n_head, n_head_kv, D, pos0 = 8, 2, 128, 40
    srcs, rope, pos, cache, splits, limit = _short_case(ops, rng, "qwen2", n_head, n_head_kv, D, pos0)
    want = cp.full((1, n_head, D), np.nan, cp.float32)
    kc, vc = (c.copy() for c in cache)
    ops.attention(cp.full((1, n_head, D), np.nan, cp.float32), kc, vc, want, pos, *splits, FreshKV(*srcs, rope), limit=limit)
    qkv = srcs[0].base if srcs[0].base is not None else srcs[0]
    rows = qkv.copy()
    qkv.fill(np.nan)
    counts = cp.zeros(n_head + 2 * n_head_kv + 1, cp.int32)
    cp.cuda.Device().synchronize()
    waiting, writer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    got = cp.full((1, n_head, D), np.nan, cp.float32)
    kc, vc = (c.copy() for c in cache)
    cp.cuda.Device().synchronize()
    with waiting:
        ops.attention(cp.full((1, n_head, D), np.nan, cp.float32), kc, vc, got, pos, *splits, FreshKV(*srcs, rope),
                      limit=limit, ready=counts)
    time.sleep(0.05)  # the blocks are spinning by now
    assert not waiting.done, "attention ended before its rows were counted"
    with writer:
        qkv[...] = rows
        counts[:-1] = D
    deadline = time.monotonic() + 10
    while not waiting.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waiting.done, "attention still waits after every row was counted"
    assert cp.array_equal(got, want) and not counts.any()


@pytest.mark.parametrize("handoff,wide", [(False, False), (True, False), (True, True)])
def test_decode_logits_are_the_same_bits_with_head_ready(tiny_model, monkeypatch, handoff, wide):
    """A tiny Q4_K llama model with heads of 64 (attn_short's smallest): the decode logits with
    K4_HEAD_READY on and off are the same bits, and on, every layer's q/k/v launch counts its rows
    (the down product's handoff read where forced, QKV_VARIANT's 20 warps where forced), off, none."""
    from k4.runtime.cuda import forward as fw
    from tests.cuda_backend_cases import ARCH_CASES, K_CFG, decode_by_flag

    monkeypatch.setitem(ARCH_CASES, "llama-q4_k-hd64", ("llama", T.Q4_K, {**K_CFG, "n_head": 4, "n_head_kv": 2, "head_dim": 64,
                                                                          "rope_dim": 64}))
    if handoff:
        monkeypatch.setattr(mm, "nq_balanced", lambda *a: True)
    if wide:
        monkeypatch.setattr(fw, "qkv_variant", lambda t, n_out, n_sm: gc.QKV_VARIANT.get(t))
    calls, gemv = [], mm.gemv

    def counted(*a, **k):
        calls.append(k.get("ready") is not None and (not handoff or k.get("x_q8") is not None)
                     and (not wide or k.get("variant") == gc.QKV_VARIANT[T.Q4_K]))
        return gemv(*a, **k)

    monkeypatch.setattr(mm, "gemv", counted)
    small = tiny_model("llama-q4_k-hd64")
    prompt = np.random.default_rng(6).integers(3, small.config.n_vocab, size=21).tolist()
    n = small.config.n_layer
    logits = decode_by_flag(monkeypatch, small, "K4_HEAD_READY", prompt, (5, 6, 7), calls,
                            lambda on, calls: sum(calls) >= n - handoff if on else not any(calls))
    assert all(np.array_equal(a, b) for a, b in zip(logits[True], logits[False]))
