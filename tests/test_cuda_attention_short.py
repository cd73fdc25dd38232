"""attn_short (kernels_cu/attention_short.cu), decode attention over a short fp16 cache: which
decode ranges run it (Ops.short_limit, attention_kernel, decode_splits), and that its fused RoPE
and cache store give the bits of rope_qk_store followed by attn_short. Its outputs against the
float64 formula, with windows, soft-caps, rings and the quantized handoff, are checked where
every attention test runs its kernels (tests/attention_ref.py check_short)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.attention_ref import fresh_inputs
from tests.gpu import cupy_or_skip

cp = cupy_or_skip()
pytestmark = pytest.mark.cuda

from k4.runtime.cuda.op_args import FreshKV  # noqa: E402  (needs CuPy)


def test_short_limit_and_the_kernel_of_each_range(ops):
    """attn_short serves one query over an fp16 cache, head_dim 64, 128 or 256, in decode ranges
    of at most SHORT_SPLITS splits of short_keys(head_dim) keys (SHORT_DIMS / head_dim); the rest
    keeps attn_kv."""
    from k4.runtime.cuda.constants import SHORT_DIMS, short_keys
    from k4.runtime.kv_types import KVTypes

    f16, q8 = KVTypes("f16", "f16"), KVTypes("q8_0", "q8_0")
    assert [short_keys(d) for d in (64, 128, 256)] == [SHORT_DIMS // 64, SHORT_DIMS // 128, SHORT_DIMS // 256] == [256, 128, 64]
    assert ops.short_limit(128, f16) == 128 and ops.short_limit(96, f16) == 0 and ops.short_limit(128, q8) == 0
    assert ops.short_limit(128, KVTypes("f16", "q8_0")) == 0
    assert ops.attention_kernel(1, 128, f16, 4, limit=128) == "attn_short<128>"
    assert ops.attention_kernel(1, 128, f16, 4, limit=512) == "attn_short<128>"
    assert ops.attention_kernel(1, 128, f16, 4, limit=513).startswith("attn_kv")
    assert ops.attention_kernel(1, 128, f16, 4, limit=None).startswith("attn_gqa")
    assert ops.attention_kernel(2, 128, f16, 4, limit=128).startswith("attn_mma")
    assert ops.attention_kernel(1, 64, q8, 1, limit=64).startswith("attn_kv")
    assert ops.uses_attn_q8(1, 256, 2, 1, 64, f16)
    saved, ops.sw = ops.sw, replace(ops.sw, short_attn=False)
    try:
        assert ops.short_limit(128, f16) == 0 and ops.attention_kernel(1, 128, f16, 1, limit=128).startswith("attn_kv")
    finally:
        ops.sw = saved


def test_decode_ranges_start_with_the_short_ones(ops):
    """Ops.decode_splits puts attn_short's ranges first, one split of short_limit keys, then
    SHORT_SPLITS of them, in place of split_buckets' ranges they cover, for full and sliding
    layers alike (so their limits agree), split or not; cut to n_ctx; none for a head_dim
    without an instance."""
    from k4.runtime.cuda.attention_launch import SHORT_SPLITS

    assert SHORT_SPLITS == 4
    full = ops.decode_splits(4096, True, 128, 32, 8)
    assert full[:2] == [(128, 1, 128), (512, 4, 128)] and full[2][0] == 768 and full[-1][0] == 4096
    sliding = ops.decode_splits(4096, True, 128, 32, 8, window=1024)
    assert [r[0] for r in sliding] == [r[0] for r in full]
    assert ops.decode_splits(4096, False, 128, 32, 8) == [(128, 1, 128), (512, 4, 128), (4096, 1, 4096)]
    assert ops.decode_splits(100, True, 128, 32, 8) == [(100, 1, 128)]
    assert ops.decode_splits(300, False, 128, 32, 8) == [(128, 1, 128), (300, 4, 128)]
    assert ops.decode_splits(4096, True, 96, 32, 8)[0][0] == 512
    d64 = ops.decode_splits(4096, True, 64, 32, 4)
    assert d64[:2] == [(256, 1, 256), (1024, 4, 256)] and d64[2][0] == 1536


@pytest.mark.parametrize("arch,n_head,n_head_kv,D,pos0,window", [("llama", 8, 2, 64, 77, 0), ("qwen3", 4, 4, 128, 5, 0),
                                                                   ("qwen2", 8, 2, 128, 127, 0), ("llama", 4, 2, 256, 63, 0),
                                                                   ("llama", 8, 2, 64, 200, 32), ("llama", 4, 4, 128, 0, 0),
                                                                   ("qwen3", 4, 2, 128, 300, 0), ("llama", 8, 8, 64, 600, 0),
                                                                   ("qwen2", 8, 2, 128, 500, 200)])
def test_fused_rope_and_store_equal_rope_then_attention(ops, rng, arch, n_head, n_head_kv, D, pos0, window):
    """attn_short with RoPE and the cache store fused (FreshKV) gives the output bits of
    rope_qk_store followed by attn_short, and the same cache, in one split and in several; q/k
    norms (qwen3), GQA, NeoX pairs (qwen2), sliding windows, the first position."""
    from k4.runtime.cuda.attention_launch import SHORT_SPLITS
    from k4.runtime.cuda.op_args import AttnShape

    keys, shape = ops.short_limit(D), AttnShape(window=window)
    seen = min(pos0 + 1, window or pos0 + 1)
    limit, n_split = (keys, 1) if seen <= keys else (SHORT_SPLITS * keys, SHORT_SPLITS)
    assert seen <= limit
    (q_src, k_src, v_src), rope, pos, cache = fresh_inputs(rng, arch, n_head, n_head_kv, D, pos0, 640)
    part, ticket = cp.empty((1, n_head, n_split, D + 2), cp.float32), cp.zeros(n_head, cp.int32)
    splits = (n_split, keys, part, ticket)

    kc1, vc1 = (c.copy() for c in cache)
    q = cp.full((1, n_head, D), np.nan, cp.float32)
    ops.rope_qk_store(q_src, k_src, v_src, kc1, vc1, rope, pos, q_out=q)
    want = cp.full((1, n_head, D), np.nan, cp.float32)
    ops.attention(q, kc1, vc1, want, pos, *splits, shape=shape, limit=limit)

    kc2, vc2 = (c.copy() for c in cache)
    got = cp.full((1, n_head, D), np.nan, cp.float32)
    ops.attention(cp.full((1, n_head, D), np.nan, cp.float32), kc2, vc2, got, pos, *splits, FreshKV(q_src, k_src, v_src, rope),
                  shape=shape, limit=limit)
    assert not cp.isnan(want).any() and cp.array_equal(got, want)
    assert cp.array_equal(kc2, kc1) and cp.array_equal(vc2, vc1) and not ticket.any()
