"""How decode attention is cut into splits and how the splits' merge is shared
(runtime/cuda/attention_launch.py): the split plans of each range of positions, the per-step
sizing the kernels do (kernels_cu/attention_sizes.cuh split_keys, restated in
tests/attention_ref.py), and the bound on attn_gqa's merge helpers. Pure functions of the
shapes; they need CuPy only because attention_launch imports it. The kernels themselves are
checked against numpy in test_cuda_ops.py."""

from __future__ import annotations

import pytest

from tests.gpu import cupy_or_skip
from tests.attention_ref import split_keys

cupy_or_skip()
pytestmark = pytest.mark.cuda


def test_attention_split_covers_context():
    from k4.runtime.cuda.attention_launch import ATT_SPLIT_KEYS, attention_split
    from k4.runtime.cuda.kernel_names import GQA_TILE_KEYS

    for max_split in (1, 28, 64, 500):
        for n_ctx in (1, 255, 256, 257, 4096, 16385, 131072):
            for keys in (ATT_SPLIT_KEYS, *GQA_TILE_KEYS.values()):  # attn_kv's granularity, attn_gqa's tiles
                n_split, split_len = attention_split(n_ctx, True, max_split, keys)
                assert split_len % keys == 0
                assert n_split * split_len >= n_ctx > (n_split - 1) * split_len and n_split <= min(max_split, 64)
    assert attention_split(4096, False) == (1, 4096)
    assert attention_split(16448, True, 28) == (28, 608) and attention_split(1100, True, 28) == (18, 64)


def test_split_buckets_grow_by_half_and_a_third_and_end_at_the_context():
    from k4.runtime.cuda.attention_launch import attention_split, split_buckets

    assert split_buckets(4096, True, 28) == [(512, 16, 32), (768, 24, 32), (1024, 16, 64), (1536, 24, 64), (2048, 22, 96),
                                             (3072, 24, 128), (4096, 26, 160)]
    assert split_buckets(640, True) == [(512, 16, 32), (640, 20, 32)]
    assert split_buckets(512, True) == [(512, 16, 32)] and split_buckets(100, True) == [(100, 4, 32)]
    assert split_buckets(4096, False) == [(4096, 1, 4096)]
    for n_ctx in (1, 511, 513, 5000, 131072):
        buckets = split_buckets(n_ctx, True, 30)
        assert buckets[-1] == (n_ctx, *attention_split(n_ctx, True, 30))
        assert all(n * length >= limit for limit, n, length in buckets)
        assert [b[0] for b in buckets] == sorted({b[0] for b in buckets})
    # a sliding layer's: the same ranges, each split over at most the window's keys
    assert split_buckets(4096, True, 28, window=1000) == [(512, 16, 32), (768, 24, 32), (1024, 16, 64), (1536, 16, 64),
                                                          (2048, 16, 64), (3072, 16, 64), (4096, 16, 64)]


def test_dynamic_splits_are_the_shortest_that_cover_the_step():
    """K4_DYN_SPLIT: a range keeps the most splits its keys allow (up to max_split) and the kernel
    sizes them for each step's keys (kernels_cu/attention_sizes.cuh split_keys, restated in
    attention_ref; its static_assert holds the same table): the shortest multiple of the tile
    whose splits cover them."""
    from k4.runtime.cuda.attention_launch import attention_split, split_buckets

    assert [split_keys(64, 5, 3), split_keys(-64, 32769, 33), split_keys(-64, 1, 33), split_keys(-32, 2112, 33),
            split_keys(-32, 2113, 33)] == [64, 1024, 64, 64, 96]
    assert attention_split(43690, True, 33, 64, dynamic=True) == (33, -64)  # fixed: 33 x 1344 (25 hold keys at 32,769)
    assert attention_split(100, True, 28, 32, dynamic=True) == (4, -32)
    assert attention_split(20, True, 28, 32, dynamic=True) == attention_split(20, True, 28, 32) == (1, 32)
    low = 0
    for limit, n, length in split_buckets(131072, True, 33, 64, dynamic=True):
        assert length < 0 and -length == 64
        for n_seen in {low + 1, (low + limit) // 2, limit, *range(low + 1, limit + 1, 997)}:
            keys = split_keys(length, n_seen, n)
            assert keys % 64 == 0 and -(-n_seen // keys) <= n  # covered by the range's splits
            assert keys == 64 or -(-n_seen // (keys - 64)) > n  # and none shorter would be
        low = limit


@pytest.mark.parametrize("n_sm", [132, 78, 16, 8, 1])
def test_merge_helpers_leave_a_multiprocessor_for_the_blocks_still_to_run(n_sm):
    """attn_gqa's shared merge of its splits (K4_SHARED_MERGE): one helper per 32 outputs
    of a KV head's group at most, none for groups of other lengths, and the waiting helpers of
    all groups, (helpers - 1) per group, fewer than the multiprocessors, so they cannot hold
    every place the groups' last blocks need."""
    from k4.runtime.cuda.attention_launch import merge_helpers

    for group_outputs, groups in [(512, 8), (1024, 4), (512, 16), (128, 32), (256, 16), (96, 6), (128, 64), (80, 2), (128, 400)]:
        k = merge_helpers(group_outputs, groups, n_sm)
        assert 1 <= k <= max(1, group_outputs // 32)
        assert k == 1 or (k - 1) * groups < n_sm and group_outputs % 32 == 0
    assert merge_helpers(4 * 128, 8, 132) == 16  # Llama 3 8B on the H200 (attn_gqa): every slice its own block
    assert merge_helpers(96, 3, 132) == 3 and merge_helpers(80, 2, 132) == 1
