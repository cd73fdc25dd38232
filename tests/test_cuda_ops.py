"""Each non-matmul CUDA kernel (runtime/cuda/ops.py) against numpy on fresh random inputs, at
shapes that are and are not multiples of the block and tile sizes. Limits are relative L2
errors: 1e-5 for float32 paths, 1e-3 where values pass through fp16 (2e-3 for the tensor-core
attention, tests/attention_ref.py MMA_ATTN_REL_L2). Outputs are poisoned (NaN) before each
launch, so an element the kernel fails to write fails the test.
The numpy side is runtime/reference.py (the oracle) and runtime/sampling.py."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from tests.gpu import cupy_or_skip
from k4.runtime import reference
from k4.runtime.rope import rope_table
from k4.runtime.sampling import SamplingParams, apply_repeat_penalty, sample
from tests.tiny import tiny_config
from tests.attention_ref import SPLIT_KEYS, attention_inputs, attention_reference, check_attention_kernels, f16_plane, fresh_inputs

cp = cupy_or_skip()
from k4.runtime.cuda.op_args import FreshKV, RopeArgs  # noqa: E402  (needs CuPy)
pytestmark = pytest.mark.cuda


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))




def nan_like(shape, dtype) -> "cp.ndarray":
    return cp.full(shape, np.nan, dtype=dtype)


@pytest.mark.parametrize("rows,n", [(1, 64), (3, 4096), (5, 1000), (7, 8), (2, 5120)])
def test_rms_norm(ops, rng, rows, n):
    x = (3 * rng.standard_normal((rows, n))).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    want = reference.rms_norm(x.astype(np.float64), w.astype(np.float64), 1e-5)
    y = nan_like((rows, n), cp.float32)
    ops.rms_norm(cp.asarray(x), cp.asarray(w), y, 1e-5)
    assert rel_l2(y.get(), want) < 1e-5
    xd = cp.asarray(x)
    ops.rms_norm(xd, cp.asarray(w), xd, 1e-5)  # in place
    assert rel_l2(xd.get(), want) < 1e-5


def test_rms_norm_fp16_output(ops, rng):
    x = (3 * rng.standard_normal((5, 2048))).astype(np.float32)
    w = rng.standard_normal(2048).astype(np.float32)
    y = cp.full((5, 2048), np.nan, cp.float16)
    ops.rms_norm(cp.asarray(x), cp.asarray(w), y, 1e-6)
    assert rel_l2(y.get(), reference.rms_norm(x.astype(np.float64), w.astype(np.float64), 1e-6)) < 1e-3


ROPE_CASES = [
    # arch, head_dim, rope_dim, n_head, n_head_kv, n_tok, pos0, freq factors
    ("llama", 128, 128, 8, 2, 3, 17, False),
    ("qwen3", 64, 32, 6, 3, 5, 1000, False),
    ("llama", 8, 8, 32, 16, 7, 0, True),
    ("qwen2", 128, 128, 4, 4, 1, 40000, True),
    ("qwen3", 96, 64, 5, 1, 33, 123, True),
]


@pytest.mark.parametrize("arch,D,rope_dim,n_head,n_head_kv,n_tok,pos0,factors", ROPE_CASES)
def test_rope_qk_store(ops, rng, arch, D, rope_dim, n_head, n_head_kv, n_tok, pos0, factors):
    from k4.runtime.cuda.weights import rope_inv_freq

    cfg = tiny_config(arch, head_dim=D, rope_dim=rope_dim, n_head=n_head, n_head_kv=n_head_kv, rope_freq_base=500000.0)
    ff = (1.0 + 7.0 * rng.random(rope_dim // 2)).astype(np.float32) if factors else None
    q = rng.standard_normal((n_tok, n_head, D)).astype(np.float32)
    k = rng.standard_normal((n_tok, n_head_kv, D)).astype(np.float32)
    v = rng.standard_normal((n_tok, n_head_kv, D)).astype(np.float32)
    qn = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32) if cfg.has_qk_norm else None
    kn = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32) if cfg.has_qk_norm else None
    cos, sin = reference.rope_tables(rope_table(cfg, cfg.n_ctx_train, ff), np.arange(pos0, pos0 + n_tok))
    q_want, k_want = q, k
    if cfg.has_qk_norm:
        q_want, k_want = reference.rms_norm(q, qn, cfg.rms_eps), reference.rms_norm(k, kn, cfg.rms_eps)
    q_want = reference.apply_rope(q_want, cos, sin, rope_dim, cfg.rope_neox)
    k_want = reference.apply_rope(k_want, cos, sin, rope_dim, cfg.rope_neox)

    n_ctx = pos0 + n_tok + 3
    kc, vc = nan_like((n_ctx, n_head_kv, D), cp.float16), nan_like((n_ctx, n_head_kv, D), cp.float16)
    qd = cp.asarray(q)
    rope = RopeArgs(None if qn is None else cp.asarray(qn), None if kn is None else cp.asarray(kn),
                    cp.asarray(rope_inv_freq(cfg, ff)), rope_dim, cfg.rope_neox, cfg.rms_eps)
    ops.rope_qk_store(qd, cp.asarray(k), cp.asarray(v), kc, vc, rope, cp.asarray([pos0], dtype=cp.int32))
    assert rel_l2(qd.get(), q_want) < 1e-5
    kc, vc = kc.get(), vc.get()
    assert rel_l2(kc[pos0 : pos0 + n_tok], k_want) < 1e-3
    assert rel_l2(vc[pos0 : pos0 + n_tok], v) < 1e-3
    assert np.isnan(kc[:pos0]).all() and np.isnan(kc[pos0 + n_tok :]).all()  # nothing else written
    assert np.isnan(vc[:pos0]).all() and np.isnan(vc[pos0 + n_tok :]).all()


def test_rope_reads_stacked_product_columns(ops, rng):
    """q, k, v as column views of one (n_tok, q_dim + 2 kv_dim) stacked product, q rotated into
    its own buffer: the same results as from separate arrays."""
    from k4.runtime.cuda.weights import rope_inv_freq

    n_tok, n_head, n_head_kv, D = 6, 4, 2, 64
    cfg = tiny_config("llama", head_dim=D, rope_dim=D, n_head=n_head, n_head_kv=n_head_kv)
    qkv = rng.standard_normal((n_tok, (n_head + 2 * n_head_kv) * D)).astype(np.float32)
    q, k, v = np.split(qkv, [n_head * D, (n_head + n_head_kv) * D], axis=1)
    args = (RopeArgs(None, None, cp.asarray(rope_inv_freq(cfg, None)), D, False, 1e-5), cp.asarray([3], dtype=cp.int32))
    want = cp.asarray(q.reshape(n_tok, n_head, D))
    kc1, vc1 = cp.zeros((16, n_head_kv, D), cp.float16), cp.zeros((16, n_head_kv, D), cp.float16)
    ops.rope_qk_store(want, cp.asarray(k), cp.asarray(v), kc1, vc1, *args)
    d = cp.asarray(qkv)
    q_out = nan_like((n_tok, n_head, D), cp.float32)
    kc2, vc2 = cp.zeros_like(kc1), cp.zeros_like(vc1)
    a, b = n_head * D, (n_head + n_head_kv) * D
    ops.rope_qk_store(d[:, :a], d[:, a:b], d[:, b:], kc2, vc2, *args, q_out=q_out)
    assert cp.array_equal(q_out, want) and cp.array_equal(kc2, kc1) and cp.array_equal(vc2, vc1)
    assert cp.array_equal(d, cp.asarray(qkv))  # the product is only read


ATTN_CASES = [
    # n_tok, pos0, n_head, n_head_kv, head_dim, n_ctx, split
    (1, 0, 4, 2, 64, 64, False),
    (1, 99, 8, 8, 128, 512, True),
    (1, 776, 32, 4, 8, 4096, True),
    (1, 2047, 6, 2, 80, 2048, True),
    (1, 300, 4, 1, 256, 1000, False),
    # decode at the most keys attn_short takes in one split (its head_dims: 64, 128, 256), in
    # several, at the most of those
    (1, 255, 16, 4, 64, 300, False),
    (1, 127, 32, 32, 128, 4096, True),
    (1, 63, 16, 8, 256, 128, True),
    (1, 400, 32, 8, 128, 512, True),
    (1, 1023, 8, 2, 64, 1024, False),
    (1, 130, 16, 8, 256, 4096, True),
    (37, 50, 4, 2, 64, 100, False),
    (130, 0, 8, 2, 128, 200, False),
    (5, 300, 2, 1, 8, 400, False),
    (70, 200, 4, 4, 256, 300, False),
    (100, 900, 32, 4, 64, 1000, False),
    (200, 77, 4, 2, 128, 400, False),
    (128, 64, 2, 1, 128, 192, False),
    (2, 5, 2, 2, 64, 16, False),
    (300, 1100, 2, 1, 128, 1500, False),
    # decode of grouped-query shapes: 7 query heads per KV head (Qwen2.5 7B), head_dim 256 with 2
    # (Gemma 3 12B), 16 per KV head; long splits
    (1, 5000, 28, 4, 128, 8192, True),
    (1, 3000, 16, 8, 256, 4096, True),
    (1, 1000, 32, 2, 128, 2048, True),
]


@pytest.mark.parametrize("n_tok,pos0,n_head,n_head_kv,D,n_ctx,split", ATTN_CASES)
def test_attention(ops, rng, n_tok, pos0, n_head, n_head_kv, D, n_ctx, split):
    """Every kernel serving the shape against the float64 formula (tests/attention_ref.py): the
    fp16 keys and values are exact on both sides; only attn_mma rounds q and p."""
    q, keys, values = attention_inputs(rng, n_tok, pos0, n_head, n_head_kv, D)
    kc, vc = f16_plane(keys, n_ctx), f16_plane(values, n_ctx)
    check_attention_kernels(ops, q, cp.asarray(kc), cp.asarray(vc), pos0, n_ctx, split, attention_reference(q, kc, vc, pos0))


@pytest.mark.parametrize("n_head,n_head_kv,D,gqa,split", [(8, 2, 64, True, True), (32, 8, 128, True, True), (16, 2, 256, True, True),
                                                         (8, 2, 64, False, True), (32, 32, 128, False, True), (32, 8, 128, False, False),
                                                         (16, 8, 256, False, True), (8, 8, 256, False, False)])
def test_decode_attention_hands_over_the_output_quantized(ops, rng, n_head, n_head_kv, D, gqa, split):
    """Decode attention writes its output quantized (x_q8, K4_ATTN_Q8) with the bytes gemv_q8
    would make of it (q8_handoff.q8x_host), in every products' swizzle: attn_gqa in the merge
    of its splits, attn_kv's short-range instance with and without splits."""
    from k4.runtime.cuda.attention_launch import GQA_MIN_LIMIT, attention_split
    from k4.runtime.cuda.constants import q8x_bytes
    from k4.runtime.cuda.q8_handoff import Q8Vector, q8x_host
    from k4.runtime.cuda.quant_types import QUANT

    pos0, n_ctx, limit = 700, 768, None if gqa else GQA_MIN_LIMIT
    q, keys, values = attention_inputs(rng, 1, pos0, n_head, n_head_kv, D)
    kc, vc = cp.asarray(f16_plane(keys, n_ctx)), cp.asarray(f16_plane(values, n_ctx))
    n_split, split_len = attention_split(n_ctx, split, keys=SPLIT_KEYS)
    group = n_head // n_head_kv
    assert ops.attention_kernel(1, D, group=group, limit=limit).startswith("attn_gqa" if gqa else "attn_kv")
    assert ops.uses_attn_q8(1, D, group, n_split, limit) and (n_split > 1) == split
    part, ticket = cp.empty((1, n_head, n_split, D + 2), cp.float32), cp.zeros(n_head, cp.int32)
    saved = ops.sw
    try:
        for swz, shared in itertools.product(sorted({k.x_swizzle for k in QUANT.values()}), (True, False) if gqa else (True,)):
            ops.sw = replace(saved, shared_merge=shared)  # attn_gqa: the merge shared by the last blocks (K4_SHARED_MERGE), or the last alone
            x_q8 = Q8Vector(cp.zeros(q8x_bytes(n_head * D), cp.uint8), n_head * D, swz)
            out = cp.full((1, n_head, D), np.nan, cp.float32)
            ops.attention(cp.asarray(q), kc, vc, out, cp.asarray([pos0], dtype=cp.int32), n_split, split_len, part, ticket,
                          limit=limit, x_q8=x_q8)
            assert np.array_equal(x_q8.data.get(), q8x_host(out.get().reshape(-1), swz)), (swz, shared)
            assert not ticket.any()
    finally:
        ops.sw = saved


@pytest.mark.parametrize("n_tok,n_head,n_head_kv,D", [(3, 32, 32, 128), (8, 28, 4, 128), (5, 8, 2, 64), (6, 16, 8, 256), (70, 4, 2, 128)])
def test_attn_mma_hands_over_its_rows_quantized(ops, rng, n_tok, n_head, n_head_kv, D):
    """attn_mma (several queries: the verify step's) writes its output rows quantized too (x_q8
    a Q8Rows, K4_ATTN_Q8) with the bytes gemv_q8 would make of each row (q8x_host), in every
    products' swizzle; 70 queries: two query blocks, the second with rows past the last query."""
    from k4.runtime.cuda.q8_handoff import Q8Rows
    from k4.runtime.cuda.q8_handoff import q8x_host
    from k4.runtime.cuda.quant_types import QUANT

    pos0, n_ctx = 300, 512
    q, keys, values = attention_inputs(rng, n_tok, pos0, n_head, n_head_kv, D)
    kc, vc = cp.asarray(f16_plane(keys, n_ctx)), cp.asarray(f16_plane(values, n_ctx))
    group = n_head // n_head_kv
    assert ops.attention_kernel(n_tok, D, group=group).startswith("attn_mma") and ops.uses_attn_q8(n_tok, D, group, 1, None)
    n = n_head * D
    plain = cp.full((n_tok, n_head, D), np.nan, cp.float32)
    ops.attention(cp.asarray(q), kc, vc, plain, cp.asarray([pos0], dtype=cp.int32), 1, n_ctx, None, None)
    for swz in sorted({k.x_swizzle for k in QUANT.values()}):
        x_q8 = Q8Rows(cp.zeros(Q8Rows.nbytes(n_tok, n), cp.uint8), n_tok, n, swz)
        out = cp.full((n_tok, n_head, D), np.nan, cp.float32)
        ops.attention(cp.asarray(q), kc, vc, out, cp.asarray([pos0], dtype=cp.int32), 1, n_ctx, None, None, x_q8=x_q8)
        got, y = x_q8.data.get().reshape(n_tok, -1), out.get().reshape(n_tok, n)
        assert np.array_equal(y, plain.get().reshape(n_tok, n)), f"swizzle {swz}: the float output changed"
        for t in range(n_tok):
            assert np.array_equal(got[t], q8x_host(y[t], swz)), f"swizzle {swz}: row {t}"


@pytest.mark.parametrize("arch,n_head,n_head_kv,D,pos0,n_ctx", [("llama", 8, 2, 64, 77, 256), ("qwen3", 4, 4, 128, 5, 4096),
                                                                  ("qwen2", 6, 3, 96, 300, 320)])
def test_attention_with_fused_rope_equals_rope_then_attention(ops, rng, arch, n_head, n_head_kv, D, pos0, n_ctx):
    """Decode: RoPE and the cache store inside the attention kernel give the same output and
    the same cache as rope_qk_store followed by attention."""
    from k4.runtime.cuda.attention_launch import attention_split

    (q_src, k_src, v_src), rope, pos, cache = fresh_inputs(rng, arch, n_head, n_head_kv, D, pos0, n_ctx)
    n_split, split_len = attention_split(n_ctx, True, keys=SPLIT_KEYS)
    part = cp.empty((1, n_head, n_split, D + 2), cp.float32) if n_split > 1 else None
    ticket = cp.zeros(n_head, cp.int32)

    kc1, vc1 = (c.copy() for c in cache)
    q = nan_like((1, n_head, D), cp.float32)
    ops.rope_qk_store(q_src, k_src, v_src, kc1, vc1, rope, pos, q_out=q)
    want = nan_like((1, n_head, D), cp.float32)
    ops.attention(q, kc1, vc1, want, pos, n_split, split_len, part, ticket)

    kc2, vc2 = (c.copy() for c in cache)
    got = nan_like((1, n_head, D), cp.float32)
    fresh = FreshKV(q_src, k_src, v_src, rope)
    ops.attention(nan_like((1, n_head, D), cp.float32), kc2, vc2, got, pos, n_split, split_len, part, ticket, fresh)
    assert rel_l2(got.get(), want.get()) < 1e-6
    assert cp.array_equal(kc2, kc1) and cp.array_equal(vc2, vc1)
    assert not ticket.any()


@pytest.mark.parametrize("shape", [(1, 1), (3, 1000), (5, 11008), (2, 96)])
def test_swiglu(ops, rng, shape):
    g = (4 * rng.standard_normal(shape)).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    out = nan_like(shape, cp.float32)
    ops.swiglu(cp.asarray(g), cp.asarray(u), out)
    assert rel_l2(out.get(), reference.silu(g.astype(np.float64)) * u) < 1e-5
    gd = cp.asarray(g)
    ops.swiglu(gd, cp.asarray(u), gd)  # in place
    assert rel_l2(gd.get(), reference.silu(g.astype(np.float64)) * u) < 1e-5


@pytest.mark.parametrize("interleaved", [False, True])
def test_swiglu_rows(ops, rng, interleaved):
    n_tok, n_ff = 7, 1000
    g = (4 * rng.standard_normal((n_tok, n_ff))).astype(np.float32)
    u = rng.standard_normal((n_tok, n_ff)).astype(np.float32)
    gu = np.stack([g, u], axis=2).reshape(n_tok, 2 * n_ff) if interleaved else np.concatenate([g, u], axis=1)
    want = reference.silu(g.astype(np.float64)) * u
    out = nan_like((n_tok, n_ff), cp.float32)
    ops.swiglu_rows(cp.asarray(gu), out, interleaved)
    assert rel_l2(out.get(), want) < 1e-5
    out16 = cp.full((n_tok, n_ff), np.nan, cp.float16)
    ops.swiglu_rows(cp.asarray(gu), out16, interleaved)
    assert rel_l2(out16.get(), want) < 1e-3


def test_set_i32(ops):
    a = cp.zeros(3, cp.int32)
    ops.set_i32(a[1:2], -123456)
    assert a.get().tolist() == [0, -123456, 0]


# ---- sampling --------------------------------------------------------------------------------

class DeviceSampler:
    """The buffers ops.sample works on, for one vocabulary size; draw() runs it on host data."""

    def __init__(self, ops, n_vocab: int, ring_cap: int = 1024):
        from k4.runtime.cuda.ops import ARGMAX_PARTS, STATE_WORDS

        self.ops = ops
        self.state = cp.zeros(STATE_WORDS, cp.int32)
        self.ring = cp.zeros(ring_cap, cp.int32)
        self.seen = cp.zeros(n_vocab, cp.int32)
        self.part_val = cp.empty(ARGMAX_PARTS, cp.float32)
        self.part_idx = cp.empty(ARGMAX_PARTS, cp.int32)

    def draw(self, logits: np.ndarray, params: SamplingParams, history: list[int], step: int):
        """-> (token, penalized logits) after one ops.sample on fresh buffers."""
        from k4.runtime.cuda.ops import ST_DRAW, ST_RING, ST_TOK, pack_sampler_params

        window = history[len(history) - min(params.repeat_last_n, len(history)) :]
        self.ring[: len(window)] = cp.asarray(window, dtype=cp.int32)
        self.state[:] = 0
        self.state[ST_RING] = len(window)
        self.state[ST_DRAW] = step
        d_logits = cp.asarray(logits)
        self.ops.sample(d_logits, cp.asarray(pack_sampler_params(params)), self.state, self.ring, self.seen,
                        self.part_val, self.part_idx, advance=False)
        state = self.state.get()
        assert state[ST_RING] == len(window) + 1 and state[ST_DRAW] == step + 1
        assert self.ring[len(window) % self.ring.shape[0]].item() == state[ST_TOK]
        assert not self.seen.any()  # the penalty's scratch is left clean
        return int(state[ST_TOK]), d_logits.get()


@pytest.mark.parametrize("n_vocab", [7, 512, 32000, 151936])
def test_greedy_is_argmax_with_first_index_on_ties(ops, rng, n_vocab):
    s = DeviceSampler(ops, n_vocab)
    greedy = SamplingParams(temperature=0.0, repeat_penalty=1.0)
    for trial in range(4):
        logits = rng.standard_normal(n_vocab).astype(np.float32)
        if trial % 2:  # the maximum twice
            i, j = sorted(rng.choice(n_vocab, 2, replace=False))
            logits[i] = logits[j] = logits.max() + 1
        tok, _ = s.draw(logits, greedy, [], trial)
        assert tok == int(np.argmax(logits))
    logits = np.full(n_vocab, -np.inf, np.float32)  # nothing finite: the first id
    assert s.draw(logits, greedy, [], 0)[0] == 0


def test_repeat_penalty_matches_host_bit_for_bit(ops, rng):
    n_vocab = 32000
    s = DeviceSampler(ops, n_vocab)
    logits = (3 * rng.standard_normal(n_vocab)).astype(np.float32)
    history = rng.integers(0, 300, size=200).tolist()  # many repeats
    for params in (SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=64),
                   SamplingParams(temperature=0.0, repeat_penalty=0.7, repeat_last_n=1000)):
        tok, penalized = s.draw(logits, params, history, 0)
        want = apply_repeat_penalty(logits, history, params.repeat_penalty, params.repeat_last_n)
        assert np.array_equal(penalized, want)
        assert tok == sample(logits, params, history, 0)


SAMPLER_CASES = [
    # n_vocab, logit scale, params; every kept set here is within the device's 1024 candidates
    (512, 3.0, SamplingParams()),
    (32000, 3.0, SamplingParams()),
    (151936, 4.0, SamplingParams(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0)),
    (32000, 3.0, SamplingParams(temperature=1.5, top_k=200, top_p=0.9, min_p=0.0, repeat_penalty=1.1)),
    (32000, 3.0, SamplingParams(temperature=1.0, top_k=1024, top_p=1.0, min_p=0.0)),
    (512, 1.0, SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0)),
    (32000, 6.0, SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0)),
    (32000, 3.0, SamplingParams(temperature=0.9, top_k=5000, top_p=0.95, min_p=0.2)),
    (32000, 3.0, SamplingParams(temperature=1.2, top_k=100, top_p=0.5, min_p=0.02, seed=12345)),
    (1000, 1.0, SamplingParams(temperature=2.0, top_k=10, top_p=1.0, min_p=0.0, seed=-7)),
]


def host_candidates(logits, params, history) -> set[int]:
    """The ids numpy's sampler can draw from (after top-k, top-p, min-p)."""
    lg = apply_repeat_penalty(logits, history, params.repeat_penalty, params.repeat_last_n)
    order = np.argsort(-lg, kind="stable")[: params.top_k if params.top_k > 0 else None]
    top = lg[order].astype(np.float64)
    p = np.exp(top - top[0])
    p /= p.sum()
    keep = len(order)
    if params.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), params.top_p) + 1))
    if params.min_p > 0.0:
        keep = max(1, int(np.count_nonzero(p[:keep] >= params.min_p * p[0])))
    return set(order[:keep].tolist())


@pytest.mark.parametrize("case", range(len(SAMPLER_CASES)))
def test_sampling_draws_match_host(ops, rng, case):
    n_vocab, scale, params = SAMPLER_CASES[case]
    s = DeviceSampler(ops, n_vocab)
    for trial in range(3):
        logits = (scale * rng.standard_normal(n_vocab)).astype(np.float32)
        if trial == 2:  # integer logits: many ties at every cut
            logits = np.round(logits).astype(np.float32)
        history = rng.integers(0, n_vocab, size=40).tolist()
        allowed = host_candidates(logits, params, history)
        got = [s.draw(logits, params, history, step)[0] for step in range(40)]
        want = [sample(logits, params, history, step) for step in range(40)]
        assert set(got) <= allowed
        assert got == want


def test_same_seed_same_token(ops, rng):
    s = DeviceSampler(ops, 32000)
    logits = rng.standard_normal(32000).astype(np.float32)
    params = SamplingParams(temperature=1.5, top_k=0, top_p=0.99, min_p=0.0, seed=99)
    first = [s.draw(logits, params, [], step)[0] for step in range(20)]
    again = [s.draw(logits, params, [], step)[0] for step in range(20)]
    assert first == again
    assert len(set(first)) > 5  # draws do move with the step


@pytest.mark.cuda
def test_decode_attention_selector_keeps_small_groups_on_attn_kv(ops):
    """attn_gqa serves a decode query from GQA_MIN_GROUP query heads per KV head (measured: two
    heads per KV head run faster on attn_kv); below that only when the policy is lowered."""
    from k4.runtime.cuda.attention_launch import GQA_MIN_GROUP

    assert ops.attention_kernel(1, 128, group=GQA_MIN_GROUP - 1).startswith("attn_kv")
    assert ops.attention_kernel(1, 128, group=GQA_MIN_GROUP).startswith("attn_gqa")
    assert ops.attention_kernel(1, 128, group=16).startswith("attn_gqa")
    assert ops.attention_kernel(1, 128, group=1).startswith("attn_kv")
    min_group, ops.gqa_min_group = ops.gqa_min_group, 2
    try:
        assert ops.attention_kernel(1, 256, group=2).startswith("attn_gqa")
    finally:
        ops.gqa_min_group = min_group
