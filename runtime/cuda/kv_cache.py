"""The KV cache on the device, by type (-ctk / -ctv, runtime/kv_types.py), and the checks the
launchers of runtime/cuda/ops.py apply to one layer's cache planes.

Layout (kernels_cu/kv_cache.cuh), per layer: an f16 plane is (rows, n_head_kv, head_dim) fp16, 2
bytes a value. A q8_0 plane is llama.cpp's block_q8_0 split in two: the int8 quants (rows,
n_head_kv, head_dim) and the fp16 scales (rows, n_head_kv, head_dim / 32), 34 bytes per 32
values as block_q8_0; value e is quants[e] * scales[e / 32]. rows is n_ctx, or on a sliding
layer (Gemma) the rows of its ring (runtime/swa_ring.py: position p at row p & (rows - 1)).
Bytes per token and layer: n_head_kv * head_dim * (2 + 2) for f16 keys and values,
n_head_kv * head_dim * (34/32 + 34/32) for q8_0 ones (KVTypes.bytes_per_token).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from ..kv_types import F16, QK8_0, KVTypes
from ..model import ModelConfig
from ..swa_ring import cache_bytes, layer_rings, rewind_slack
from .memory import DeviceMemory

NULL = np.uint64(0)  # a null device pointer argument
CACHE_DTYPES = {np.dtype(np.float16): "f16", np.dtype(np.int8): "q8_0"}  # a plane's dtype -> its cache type
NO_SCALES = (None, None)  # the scales of fp16 key and value planes


class KVCache:
    """Keys and values of every layer, of types `types`, for a context of n_ctx positions in
    passes of at most `chunk` tokens. Per layer li: k[li], v[li] (rows, n_head_kv, head_dim)
    fp16 (f16) or int8 (q8_0 quants); k_d[li], v_d[li] the q8_0 scales (rows, n_head_kv,
    head_dim / 32) fp16, None for an f16 plane; rings[li] the rows of its ring (0: rows = n_ctx,
    a plain cache). ring=False (K4_SWA_RING=0) gives every layer n_ctx rows, and so does a chunk
    left None (a pass may then take the whole context). All of memory kind "kv_cache"."""

    def __init__(self, mem: DeviceMemory, cfg: ModelConfig, n_ctx: int, types: KVTypes = F16, chunk: int | None = None,
                 ring: bool = True):
        self.types, self.n_ctx = types, n_ctx
        self.rings = layer_rings(cfg, n_ctx, chunk or n_ctx, ring)
        self.slack = rewind_slack(cfg, self.rings)
        self.k, self.k_d, self.v, self.v_d = [], [], [], []
        for r in self.rings:
            shape = (r or n_ctx, cfg.n_head_kv, cfg.head_dim)
            for x, d, t in ((self.k, self.k_d, types.k), (self.v, self.v_d, types.v)):
                plane, scales = self._plane(mem, shape, t)
                x.append(plane)
                d.append(scales)

    @staticmethod
    def _plane(mem: DeviceMemory, shape: tuple, cache_type: str) -> tuple:
        if cache_type == "f16":
            return mem.empty(shape, cp.float16, "kv_cache"), None
        return mem.empty(shape, cp.int8, "kv_cache"), mem.empty((*shape[:-1], shape[-1] // QK8_0), cp.float16, "kv_cache")

    def layer(self, li: int, limit: int | None = None) -> tuple:
        """Layer li's planes, positions 0 .. limit - 1 (default all; a ring's rows whatever the
        limit): (k, v, (k_d, v_d)), the arguments of ops.rope_qk_store and ops.attention (with
        ring=self.rings[li])."""
        cut = slice(None, None if self.rings[li] else limit)
        scale = [None if d[li] is None else d[li][cut] for d in (self.k_d, self.v_d)]
        return self.k[li][cut], self.v[li][cut], tuple(scale)

    @staticmethod
    def nbytes(cfg: ModelConfig, n_ctx: int, types: KVTypes = F16, chunk: int | None = None, ring: bool = True) -> int:
        """Device bytes of the cache (keys and values, quants and scales; rings as __init__ allocates them)."""
        return cache_bytes(cfg, n_ctx, types, layer_rings(cfg, n_ctx, chunk or n_ctx, ring))


def cache_types(k_cache: cp.ndarray, v_cache: cp.ndarray, scales: tuple) -> KVTypes:
    """The KVTypes of one layer's cache planes, checked: k_cache, v_cache (n_ctx, n_head_kv, D),
    fp16 (f16) or int8 (q8_0 quants); scales = (k_d, v_d), for each int8 plane its
    (n_ctx, n_head_kv, D / 32) fp16 scales, None for an fp16 plane. All C-contiguous."""
    types = []
    for x, d in zip((k_cache, v_cache), scales):
        assert x.dtype in CACHE_DTYPES and x.shape == k_cache.shape and x.flags.c_contiguous, (x.dtype, x.shape)
        t = CACHE_DTYPES[x.dtype]
        if t == "q8_0":
            n_ctx, n_head_kv, D = x.shape
            assert D % QK8_0 == 0 and d is not None and d.dtype == cp.float16 and d.flags.c_contiguous
            assert d.shape == (n_ctx, n_head_kv, D // QK8_0), (d.shape, x.shape)
        else:
            assert d is None
        types.append(t)
    return KVTypes(*types)


def planes(k_cache: cp.ndarray, v_cache: cp.ndarray, scales: tuple) -> tuple:
    """Kernel arguments k, k_d, v, v_d of one layer's planes (NULL for an fp16 plane's scales)."""
    k_d, v_d = scales
    return k_cache, NULL if k_d is None else k_d, v_cache, NULL if v_d is None else v_d
