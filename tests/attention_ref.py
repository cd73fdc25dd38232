"""The float64 attention the attention kernels' tests compare against (tests/test_cuda_ops.py,
tests/test_cuda_kv.py)."""

from __future__ import annotations

import numpy as np


def attention_reference(q, kc, vc, pos0):
    """q (T, H, D); kc, vc (n_ctx or more rows, Hkv, D), the values the kernels read -> (T, H, D)
    float64: query t at position pos0 + t attends rows 0 .. pos0 + t (causal), 1/sqrt(D) scale,
    query head h reads KV head h // (H / Hkv)."""
    T, H, D = q.shape
    g = H // kc.shape[1]
    out = np.empty((T, H, D))
    for t in range(T):
        n = pos0 + t + 1
        for h in range(H):
            keys, vals = kc[:n, h // g].astype(np.float64), vc[:n, h // g].astype(np.float64)
            s = keys @ q[t, h].astype(np.float64) / np.sqrt(D)
            p = np.exp(s - s.max())
            out[t, h] = p @ vals / p.sum()
    return out


# The kernel choices the attention tests run a decode query (n_tok = 1) with, as (mma, tiled,
# gqa) switches of Ops: attn_gqa twice where the shape has an instance (the tickets reset), then
# attn_kv; several queries run each prefill kernel (mma, tiled, neither) with gqa left on.
DECODE_KERNELS = [(False, True, True), (False, True, True), (False, True, False)]
SPLIT_KEYS = 64  # a split length both decode kernels take: a multiple of attn_kv's 32 and attn_gqa's tile


def tensor_cores(ops, n_tok: int, D: int, group: int) -> bool:
    """Whether ops (its current switches) runs attention of n_tok queries of head_dim D, group
    query heads per KV head, on tensor cores (attn_mma or attn_gqa: q and p rounded to fp16)."""
    return ops.attention_kernel(n_tok, D, group=group).startswith(("attn_mma", "attn_gqa"))
