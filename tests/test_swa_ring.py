"""The sliding-window layers' ring cache (runtime/swa_ring.py) without a GPU: the rows each layer
keeps, the cache's bytes, the longest context that fits, and how far the shared token bookkeeping
(runtime/token_cache.py) lets a cache with rings be cut back. The kernels and the CUDA backend
on rings: tests/test_cuda_gemma.py."""

from __future__ import annotations

import pytest

from k4.runtime import swa_ring
from k4.runtime.kv_types import F16, KVTypes
from k4.runtime.token_cache import TokenCache
from tests.test_gemma import gemma_tiny


def gemma3(window: int = 1024, n_layer: int = 12):
    """A gemma3 config of n_layer layers, every sixth global (llama.cpp's pattern), window `window`."""
    return gemma_tiny("gemma3", {"attention.sliding_window": window}, n_layer=n_layer, head_dim=32)


def test_ring_rows_hold_the_window_and_one_pass():
    assert swa_ring.ring_rows(1024, 512, 131072) == 2048  # 1,535 rounded up to a power of two
    assert swa_ring.ring_rows(4096, 512, 131072) == 8192  # gemma 2
    assert swa_ring.ring_rows(5, 64, 4096) == swa_ring.RING_MIN_ROWS  # the kernels' largest key tile divides it
    assert swa_ring.ring_rows(1024, 512, 2048) == 0  # not smaller than the context: a plain cache
    assert swa_ring.ring_rows(1537, 512, 131072) == 2048  # window + chunk - 1 = 2,048 exactly: no doubling
    for window, chunk in ((1, 1), (100, 9), (1024, 512), (1025, 512), (1538, 512), (4096, 512)):  # 1538: 2,049 rows needed
        r = swa_ring.ring_rows(window, chunk, 1 << 30)
        assert r & (r - 1) == 0 and r >= window + chunk - 1 and r // 2 < max(swa_ring.RING_MIN_ROWS, window + chunk - 1)


def test_layer_rings_follow_the_sliding_pattern():
    cfg = gemma3()
    rings = swa_ring.layer_rings(cfg, 32768, 512)
    assert rings == [2048 if cfg.sliding(li) else 0 for li in range(cfg.n_layer)]
    assert rings.count(0) == 2 and rings[5] == rings[11] == 0  # layers 5 and 11 attend globally
    assert swa_ring.layer_rings(cfg, 32768, 512, ring=False) == [0] * cfg.n_layer
    assert swa_ring.layer_rings(cfg, 2048, 512) == [0] * cfg.n_layer  # the context is no longer than a ring
    llama = gemma_tiny("gemma3", {"attention.sliding_window": 0}, n_layer=4)  # no window: no ring
    assert swa_ring.layer_rings(llama, 32768, 512) == [0] * 4


def test_cache_bytes_and_rewind_slack():
    cfg = gemma3()
    per_row = F16.bytes_per_token(1, cfg.n_head_kv * cfg.head_dim)
    rings = swa_ring.layer_rings(cfg, 131072, 512)
    assert swa_ring.cache_bytes(cfg, 131072, F16, rings) == (2 * 131072 + 10 * 2048) * per_row
    assert swa_ring.cache_bytes(cfg, 131072, F16, [0] * cfg.n_layer) == 12 * 131072 * per_row
    q8 = KVTypes("q8_0", "q8_0")
    assert swa_ring.cache_bytes(cfg, 131072, q8, rings) * 64 == swa_ring.cache_bytes(cfg, 131072, F16, rings) * 34
    assert swa_ring.rewind_slack(cfg, rings) == 2048 - 1024 + 1
    assert swa_ring.rewind_slack(cfg, [0] * cfg.n_layer) is None


@pytest.mark.parametrize("types", [F16, KVTypes("q8_0", "f16")], ids=["f16", "q8_0-f16"])
@pytest.mark.parametrize("ring", [True, False])
def test_max_context_is_the_largest_that_fits(types, ring):
    cfg = gemma3()
    per_row = types.bytes_per_token(1, cfg.n_head_kv * cfg.head_dim)
    for budget in (0, 5 * per_row, 12 * 1000 * per_row, 10 * 2048 * per_row + 2 * 3000 * per_row, 10**9, 3 * 10**10 + 7):
        n = swa_ring.max_context(cfg, budget, types, 512, ring)
        size = lambda n_ctx: swa_ring.cache_bytes(cfg, n_ctx, types, swa_ring.layer_rings(cfg, n_ctx, 512, ring))
        assert size(n) <= budget < size(n + 1), (budget, n)
    if ring:  # past the rings, only the 2 global layers grow: about 6 times the plain context
        assert swa_ring.max_context(cfg, 10**9, types, 512) > 5 * swa_ring.max_context(cfg, 10**9, types, 512, ring=False)


class Cache(TokenCache):
    def __init__(self, n_ctx: int, slack: int | None):
        self.n_ctx, self.rewind_slack = n_ctx, slack
        self.reset()


def test_cut_back_within_the_slack_or_to_zero():
    c = Cache(100000, slack=1025)
    c.tokens = list(range(5000))
    assert c.reusable(4000) == 4000 and c.reusable(3975) == 3975 and c.reusable(3974) == 0
    assert c.reusable(9000) == 5000  # never past what is cached
    with pytest.raises(ValueError, match="only truncate\\(0\\)"):
        c.truncate(3000)
    c.truncate(4500)
    c.tokens += [7] * 100  # positions 4,500 .. 4,599 again: 5,000 stays the highest stored
    assert c.written == 5000 and c.reusable(3975) == 3975 and c.reusable(3974) == 0
    c.truncate(4550)  # a second cut below 5,000: the rings still hold positions up to 4,999
    assert c.written == 5000 and c.reusable(3974) == 0
    c.truncate(0)
    assert c.written == 0 and c.n_past == 0
    c.tokens = [1] * 10
    assert c.reusable(0) == 0 and c.reusable(3) == 3
    c.written = 2000  # what a verify step with rejected drafts reports (runtime/cuda/backend.py)
    assert c.reusable(9) == 0


def test_without_rings_any_cut_is_fine():
    c = Cache(100000, slack=None)
    c.tokens = list(range(5000))
    assert c.reusable(1) == 1
    c.truncate(1)
    assert c.tokens == [0]

