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
