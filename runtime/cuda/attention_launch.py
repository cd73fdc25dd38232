"""Launchers of k4's attention kernels (kernels_cu/attention.cu attn_kv, attention_short.cu,
attention_tiled.cu, attention_mma.cu, attention_gqa.cu), the one selector among them
(attention_kernel), and the sizing of decode attention's split over the sequence
(flash-decoding): how many splits of how many keys, per range of context lengths.

AttentionLaunchers is a part of ops.Ops (it uses its function(), _launch() and switches): the
attention family's launchers live here, the other kernels' in ops.py. Shapes and dtypes are
checked on the host; the kernels trust their inputs.
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from ..kv_types import KVTypes
from .constants import ATT_MAX_SPLIT, ATT_THREADS, GQA_THREADS, MERGE_SLICE, MMA_BQ, MMA_THREADS, SHORT_THREADS, TILE_K, TILE_Q
from .constants import TILE_THREADS, att_smem, gqa_smem, short_keys, short_smem, tiled_smem
from .constants import mma_smem as _mma_smem
from .kernel_names import FILE_OF, GQA_TILE_KEYS, MMA_TILE_KEYS, SHORT_HEAD_DIMS, TILED_HEAD_DIMS, attn_kv_name, gqa_int8_keys, gqa_name
from .kernel_names import gqa_stages, kv_args
from .kv_cache import NO_SCALES, cache_types, planes as _planes
from .launch import allow_shared, blocks_per_sm, device_limits
from .op_args import NULL, PLAIN, AttnShape, FreshKV, check_f32, row_stride

ATT_SPLIT_KEYS = 32  # attn_kv's decode splits are multiples of this many keys (one round of the kernel)
MAX_HEAD_DIM = 8 * ATT_THREADS
MAX_GROUP = 16  # attn_gqa: query heads per KV head, the rows of one mma tile
# The fewest query heads per KV head that decode on attn_gqa by default (Ops.gqa_min_group; the
# kernel takes 2 and up). Measured on the H200 (synthetic Q4_K_M, tg64 at depth 0 / 4,096 / 16,384,
# t/s, attn_gqa against attn_kv): Gemma 3 12B (2 query heads per KV head, head_dim 256) 254.2 /
# 223.7 / 183.7 against 277.2 / 241.6 / 188.1; Phi-4 (4 per KV head, head_dim 128) 250.9 / 234.8 /
# 202.9 against 253.8 / 209.1 / 167.8. Two query heads fill 2 of the tile's 16 rows: attn_kv's
# second read of each key, from L2, costs less than the tile's work.
GQA_MIN_GROUP = 4
# Decode ranges (split_buckets limits) up to this many keys run attn_kv even where attn_gqa would
# serve the model: attn_gqa's fixed cost per launch (its tile staging and merge, about 12 µs in the
# microbenchmark) outweighs its per-key gain at short depth. Measured on the H200 (session 12,
# tg64 at depth 0 / 768 / 1,536 / 3,072, t/s, attn_gqa / attn_kv for every range): Qwen2.5 7B
# 486.8 / 449.3 / 435.1 / 418.8 against 550.2 / 504.9 / 490.5 / 474.6; Llama 3 8B 499.3 / 477.8 /
# 456.3 / 441.9 against 541.2 / 502.0 / 486.5 / 462.3. attn_gqa wins from about 4,096 keys: Phi-4
# at depth 4,096 234.8 against 209.1 (session 9), Llama 3 8B at 32,768 329.3 against 223.3.
GQA_MIN_LIMIT = 4096
# attn_short's splits in the decode range past its first (short_keys(head_dim) keys each: 512 keys at
# head_dim 128). A split is a block of 70 KB of shared memory, one a multiprocessor beside a
# product: 32 query heads x 4 splits fill the H200's 132 once; models with more heads (Phi-4's 40)
# run a second round of blocks when every split holds keys.
SHORT_SPLITS = 4
RING_ONE_SPLIT = 1 << 30  # split_len of an unsplit decode over a ring: past any position (a multiple of every tile)


def mma_smem(D: int) -> int:
    """Dynamic shared memory (bytes) of the attn_mma instance for head_dim D (constants.mma_smem
    with the instance's keys per tile, kernel_names.MMA_TILE_KEYS)."""
    return _mma_smem(D, MMA_TILE_KEYS[D])


def attention_split(n_ctx: int, split: bool, max_split: int = ATT_MAX_SPLIT, keys: int = ATT_SPLIT_KEYS,
                    dynamic: bool = False) -> tuple[int, int]:
    """(n_split, split_len) for decode attention over a cache of n_ctx positions: at most
    max_split splits (ATT_MAX_SPLIT at most), each a multiple of `keys` keys (the kernel's granularity:
    ATT_SPLIT_KEYS for attn_kv, its tile for attn_gqa); (1, n_ctx) when split is off. Splits
    past the current position exit at once. Measured on the H200 (attn_kv, 32 heads of 128, one
    query): the best split is about the shortest whose blocks all fit on the GPU at once
    (max_split = resident blocks / blocks per split, Ops.decode_plan): 1,100 keys 11.9 µs
    (18 x 64) against 16.3 (35 x 32); 4,160 keys 26.8 (26 x 160) against 30.9 (44 x 96); 16,448
    keys 73.7 (28 x 608) against 77.9 (58 x 288) and 104.4 (31 x 544, 992 blocks: two rounds).
    dynamic (K4_DYN_SPLIT): where that gives several splits, as many as the keys allow, up to
    max_split, with split_len -keys: the kernel sizes each step's splits for its own keys
    (kernels_cu/attention_sizes.cuh split_keys)."""
    if not split:
        return 1, n_ctx
    max_split = max(1, min(ATT_MAX_SPLIT, max_split))
    split_len = -(-math.ceil(n_ctx / max_split) // keys) * keys
    n_split = -(-n_ctx // split_len)
    if dynamic and n_split > 1:
        return min(max_split, -(-n_ctx // keys)), -keys
    return n_split, split_len


def attention_lanes(n_head: int, n_head_kv: int, head_dim: int) -> int:
    """Lanes of attn_kv that dot one key with the query (its `lanes` argument): 8, or 4 for a
    grouped-query model of head_dim 128 or less, whose query heads share their keys through L2
    and so wait less on memory than on the shuffles that sum a score (log2 lanes per key). Each
    lane loads head_dim / 8 / lanes slices of a key one after another, so longer heads keep 8.
    Measured on the H200 (tg32, GPU ms per token), 16 / 8 / 4 / 2 lanes: Llama 2 7B at depth
    16,384 3.789 / 3.717 / 4.061 / 4.196; Llama 3 8B (4 query heads per KV head, head_dim 128)
    at 32,768 5.030 / 4.595 / 4.435 / 5.068. Gemma 3 12B (2 per KV head, head_dim 256; tg128 t/s
    at depth 0 / 2,048 / 16,384), 32 / 16 / 8 / 4 lanes: 308.4 / 272.4 / 183.8, 312.3 / 279.7 /
    199.5, 308.0 / 283.2 / 206.2, 299.2 / 275.2 / 202.7."""
    return 4 if n_head > n_head_kv and head_dim <= 128 else 8


def split_buckets(n_ctx: int, split: bool, max_split: int = ATT_MAX_SPLIT, keys: int = ATT_SPLIT_KEYS,
                  window: int = 0, dynamic: bool = False) -> list[tuple[int, int, int]]:
    """The decode attention configurations of a cache of n_ctx positions, one per range of
    context lengths: [(limit, n_split, split_len)], limits ascending (512, 768, 1024, 1536, ...,
    then n_ctx), each attention_split(limit, split, max_split, keys) and valid while the keys
    attended (position + 1) are at most its limit. A step then launches the splits its length
    needs, of a length suited to it, whatever n_ctx is. One entry when split is off. window > 0:
    for a sliding layer, whose splits count from the first key it sees (attention.cu): each
    range's configuration is attention_split(min(limit, window)), the same limits. dynamic:
    attention_split's (K4_DYN_SPLIT)."""
    limits = []
    limit = 512
    while split and limit < n_ctx:
        limits.append(limit)
        limit = limit * 3 // 2 if limit & (limit - 1) == 0 else limit * 4 // 3  # 512, 768, 1024, 1536, ...
    return [(L, *attention_split(min(L, window) if window else L, split, max_split, keys, dynamic)) for L in (*limits, n_ctx)]


def merge_helpers(group_outputs: int, groups: int, n_sm: int) -> int:
    """How many of attn_gqa's last blocks of a KV head to finish share the merge of its splits
    (K4_SHARED_MERGE; kernels_cu/split_merge.cuh merge_join): groups is n_head_kv, group_outputs
    the outputs of a KV head's query heads. One helper per slice of MERGE_SLICE outputs at most,
    and few enough that the blocks waiting for their group's last, (helpers - 1) per group, leave
    a multiprocessor free for the blocks still to run; 1 (the last block alone) where
    group_outputs is not a whole number of slices or that leaves no room. attn_kv keeps its merge
    by the last block: a query head's merge is small (14 KB at 28 splits of 128 outputs), and the
    shared merge measured slower there (docs/PERF.md, session 21)."""
    if group_outputs % MERGE_SLICE:
        return 1
    return max(1, min(group_outputs // MERGE_SLICE, (n_sm - 1) // groups))


def _fresh_args(fresh: FreshKV, n_head: int, n_head_kv: int, D: int) -> tuple[tuple, tuple]:
    """The decode kernels' arguments of the fused RoPE and cache store (FreshKV), checked: (the
    token's q, k and v), (q_norm, k_norm, inv_freq, rope_dim, neox, eps, mscale)."""
    row_stride(fresh.q, 1, n_head * D)
    row_stride(fresh.k, 1, n_head_kv * D)
    row_stride(fresh.v, 1, n_head_kv * D)
    r = fresh.rope
    r.check(D)
    return (fresh.q, fresh.k, fresh.v), (*r.kernel_args(), np.int32(r.rope_dim), np.int32(r.neox), np.float32(r.eps), np.float32(r.mscale))


def _gqa_smem(D: int, kv: KVTypes, int8_keys: bool) -> int:
    """Dynamic shared memory (bytes) of the attn_gqa instance for head_dim D over cache types kv
    (int8_keys: its I8K instance, gqa_int8_keys)."""
    return gqa_smem(D, GQA_TILE_KEYS[D], gqa_stages(kv.k, kv.v), kv.k == "q8_0", kv.v == "q8_0", int8_keys)


class AttentionLaunchers:
    """The attention part of ops.Ops. Its switches are `self.sw` (runtime/cuda/op_switches.py
    OpSwitches): `mma` (prefill on attn_mma), `tiled` (else attn_tiled), `gqa` (decode of a
    grouped-query model of at least `gqa_min_group` query heads per KV head on attn_gqa),
    `gqa_cols` (attn_gqa with a group of up to 8 query heads as the mma's columns, else as its
    rows), `gqa_int8` (then q8_0 keys by int8 mma, the query quantized), `attn_q8` (decode
    attention may also write its output quantized for the output product, uses_attn_q8),
    `dyn_split` (decode_splits' ranges size each step's splits on the device), `shared_merge`
    (attn_gqa's last blocks of a KV head share the merge of its splits, merge_helpers),
    `short_attn` (decode ranges of at most SHORT_SPLITS x short_keys(head_dim) keys over an fp16
    cache on attn_short, short_limit). `kv`: the cache types the kernels are listed for."""

    gqa_min_group = GQA_MIN_GROUP

    def attention_kernel(self, n_tok: int, D: int, kv: KVTypes | None = None, group: int = 1, limit: int | None = None) -> str:
        """The attention kernel for n_tok queries of head_dim D over a cache of types kv (default
        self.kv), group query heads per KV head (the selector): several queries run attn_mma
        (tensor cores) with `mma`, else attn_tiled with `tiled`, where D has an instance; one
        query of a grouped-query model (gqa_min_group <= group <= MAX_GROUP) runs attn_gqa with
        `gqa` where D has an instance (its column instance for groups of up to GQA_COLS_GROUP
        with `gqa_cols`), unless `limit`, the decode range's most keys (split_buckets), is at most
        GQA_MIN_LIMIT (None: any depth); the rest runs attn_kv (one query past GQA_MIN_LIMIT keys:
        its deep instance, attn_kv_name), except that one query over a range of at most
        SHORT_SPLITS x short_limit(D, kv) keys runs attn_short."""
        kv = kv or self.kv
        if n_tok == 1 and limit is not None and limit <= SHORT_SPLITS * self.short_limit(D, kv):
            return f"attn_short<{D}>"
        types = kv_args(kv.k, kv.v)
        if n_tok > 1 and self.sw.mma and D in MMA_TILE_KEYS:
            return f"attn_mma<{D}, {MMA_TILE_KEYS[D]}, {types}>"
        if n_tok > 1 and self.sw.tiled and D in TILED_HEAD_DIMS:
            return f"attn_tiled<{D}, {types}>"
        if (n_tok == 1 and self.sw.gqa and max(2, self.gqa_min_group) <= group <= MAX_GROUP and D in GQA_TILE_KEYS
                and (limit is None or limit > GQA_MIN_LIMIT)):
            return gqa_name(D, kv.k, kv.v, self._gqa_group(group), self.sw.gqa_int8)
        return attn_kv_name(kv.k, kv.v, n_tok == 1 and (limit is None or limit > GQA_MIN_LIMIT))

    def uses_attn_q8(self, n_tok: int, D: int, group: int, n_split: int, limit: int | None, kv: KVTypes | None = None) -> bool:
        """Whether the attention of n_tok queries (head_dim D, group query heads per KV head,
        n_split splits, a range of at most `limit` keys, cache types kv) hands its output
        quantized to the output product (attention's x_q8), with `attn_q8` (K4_ATTN_Q8) on: one
        query, on attn_gqa with splits (its merge writes it), or on attn_kv's short-range
        instance with D a multiple of 32 up to 2 * ATT_THREADS (a thread per output, or two; the
        deep instance would spill); several queries (the verify step's rows) on attn_mma with D
        a multiple of 32 (its rows staged in shared memory, a thread per 16-value unit)."""
        if not self.sw.attn_q8:
            return False
        if n_tok > 1:
            return self.attention_kernel(n_tok, D, kv, group=group).startswith("attn_mma") and D % 32 == 0
        name = self.attention_kernel(1, D, kv, group=group, limit=limit)
        if name.startswith("attn_gqa"):
            return n_split > 1
        if name.startswith("attn_short"):
            return True
        return name.startswith("attn_kv") and name.endswith("false>") and D % 32 == 0 and D <= 2 * ATT_THREADS

    def quantizes_query(self, D: int, kv: KVTypes, group: int, limit: int | None = None) -> bool:
        """Whether decode attention (one query; attention_kernel's choice) rounds the query to 8
        bits per 32 dims (attn_gqa's I8K instance, gqa_int8_keys; kernels_cu/gqa_cols.cuh
        cols_quantize_query)."""
        return (self.attention_kernel(1, D, kv, group, limit).startswith("attn_gqa")
                and gqa_int8_keys(kv.k, self._gqa_group(group), self.sw.gqa_int8))

    def short_limit(self, D: int, kv: KVTypes | None = None) -> int:
        """The keys of one split of attn_short, so the most a decode range of one split may hold
        (short_keys(D); SHORT_SPLITS of them the most of any range it serves): with
        `short_attn`, head_dim D of an instance (SHORT_HEAD_DIMS) and an fp16 cache of types kv
        (default self.kv); else 0."""
        kv = kv or self.kv
        return short_keys(D) if self.sw.short_attn and D in SHORT_HEAD_DIMS and kv.k == kv.v == "f16" else 0

    def _gqa_group(self, group: int) -> int:
        """The group attn_gqa's instance is chosen for: the model's, or (not gqa_cols) one past
        the column instances'."""
        return group if self.sw.gqa_cols else MAX_GROUP

    def _merge_helpers(self, group_outputs: int, groups: int) -> int:
        """attn_gqa's helpers argument: merge_helpers on this device with `shared_merge`, else 1."""
        if not self.sw.shared_merge:
            return 1
        if self._n_sm is None:
            self._n_sm = device_limits()[0]
        return merge_helpers(group_outputs, groups, self._n_sm)

    def _gqa_smem_of(self, D: int, kv: KVTypes, group: int) -> int:
        return _gqa_smem(D, kv, gqa_int8_keys(kv.k, self._gqa_group(group), self.sw.gqa_int8))

    def decode_plan(self, head_dim: int, n_head: int, n_head_kv: int, limit: int | None = None) -> tuple[int, int]:
        """(max_split, keys) of split decode attention for a model of this shape over a range of at
        most `limit` keys (None: any): the splits one round of the decode kernel runs (its
        resident blocks on this GPU / its blocks per split: n_head for attn_kv, n_head_kv for
        attn_gqa) and the keys a split length is a multiple of."""
        name = self.attention_kernel(1, head_dim, group=n_head // n_head_kv, limit=limit)
        kernel = self.function(FILE_OF[name], name)
        if name.startswith("attn_gqa"):
            smem = self._gqa_smem_of(head_dim, self.kv, n_head // n_head_kv)
            allow_shared(kernel, smem)
            blocks = device_limits()[0] * blocks_per_sm(kernel, GQA_THREADS, smem)
            return max(1, blocks // n_head_kv), GQA_TILE_KEYS[head_dim]
        blocks = device_limits()[0] * blocks_per_sm(kernel, ATT_THREADS, att_smem(head_dim))
        return max(1, blocks // n_head), ATT_SPLIT_KEYS

    def decode_splits(self, n_ctx: int, split: bool, head_dim: int, n_head: int, n_head_kv: int,
                      window: int = 0) -> list[tuple[int, int, int]]:
        """split_buckets of a cache of n_ctx positions for a model of this shape, each range planned
        for the kernel it runs (decode_plan of its limit: attn_kv up to GQA_MIN_LIMIT keys, where
        attention_kernel says so); window > 0: those of its sliding layers (split_buckets window).
        Where attn_short serves the shape (short_limit: keys a split), split or not, its ranges
        come first: (keys, 1, keys), then (SHORT_SPLITS x keys, SHORT_SPLITS, keys), each cut to
        n_ctx, in place of the ranges they cover (window or not, so the limits of both lists agree)."""
        keys = self.short_limit(head_dim)
        top = SHORT_SPLITS * keys
        first = []
        if keys:
            first.append((min(keys, n_ctx), 1, keys))
            if n_ctx > keys:
                first.append((min(top, n_ctx), SHORT_SPLITS, keys))
        if not split:
            rest = split_buckets(n_ctx, False, 1, ATT_SPLIT_KEYS, window)
        else:
            dyn = self.sw.dyn_split
            short = split_buckets(n_ctx, True, *self.decode_plan(head_dim, n_head, n_head_kv, GQA_MIN_LIMIT), window, dyn)
            long = split_buckets(n_ctx, True, *self.decode_plan(head_dim, n_head, n_head_kv), window, dyn)
            rest = [s if s[0] <= GQA_MIN_LIMIT else g for s, g in zip(short, long)]  # the same limits
        return first + [r for r in rest if r[0] > top]

    def attention(self, q: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray, out: cp.ndarray, pos: cp.ndarray,
                  n_split: int = 1, split_len: int = 0, part: cp.ndarray | None = None,
                  ticket: cp.ndarray | None = None, fresh: FreshKV | None = None, shape: AttnShape = PLAIN,
                  scales: tuple = NO_SCALES, limit: int | None = None, x_q8=None) -> None:
        """Causal attention of q over the cache; query t sits at position pos + t.

        q, out: (n_tok, n_head, D) f32; k_cache, v_cache: (n_ctx, n_head_kv, D) fp16, or int8
        quants of a q8_0 plane with its scales in `scales` (cache_types; one layer); pos: (1,)
        int32 device scalar. The kernel is attention_kernel's choice (limit: the decode range's, as
        decode_splits planned n_split and split_len for). For attn_kv and attn_gqa
        (one query), n_split > 1 splits each query's keys into blocks of split_len (n_split *
        split_len >= n_ctx; a multiple of decode_plan's keys; or -keys: sized per step by the
        kernel, attention_sizes.cuh split_keys) whose partials go to part: (n_tok, n_head,
        n_split, D + 2) f32, merged by the last block of each head (group) to
        finish, counted in ticket: (n_tok * n_head,) int32, zeros (and left so); the prefill
        kernels take n_split = 1. attn_short (one query over a range of decode_splits' first two)
        takes n_split blocks of short_limit(D) keys, which must hold the range (`limit`), with part
        and ticket as those where n_split > 1. attn_mma and attn_gqa round Q and P to fp16 (f32
        accumulation).

        fresh: None, or for one query (decode) the RoPE and cache store of rope_qk_store done
        inside the kernel (FreshKV); q is then not read, and the token's k and v are written to
        cache row pos. shape: the query scale, sliding window, score soft-cap and the ring of
        a sliding layer's cache (AttnShape; a ring's rows are a multiple of every kernel's key
        tile). x_q8: None, or (where uses_attn_q8) a q8_handoff.Q8Vector of n_head * D values (one
        query), or a q8_handoff.Q8Rows of n_tok rows of them (attn_mma), that the kernel also
        writes its output into, for the output product to copy (K4_ATTN_Q8).
        """
        n_tok, n_head, D = q.shape
        n_ctx, n_head_kv, _ = k_cache.shape
        assert not shape.ring or (n_ctx == shape.ring and shape.ring % max(TILE_K, *MMA_TILE_KEYS.values(),
                                                                            *GQA_TILE_KEYS.values()) == 0)
        check_f32(q, n_tok, n_head, D)
        check_f32(out, n_tok, n_head, D)
        types = cache_types(k_cache, v_cache, scales)
        assert k_cache.shape == (n_ctx, n_head_kv, D)
        assert D % 8 == 0 and D <= MAX_HEAD_DIM and n_head % n_head_kv == 0
        assert pos.dtype == cp.int32 and pos.size == 1
        name = self.attention_kernel(n_tok, D, types, n_head // n_head_kv, limit)
        planes = _planes(k_cache, v_cache, scales)
        assert x_q8 is None or (self.uses_attn_q8(n_tok, D, n_head // n_head_kv, n_split, limit, types) and x_q8.n == n_head * D)
        if name.startswith(("attn_mma", "attn_tiled")):
            assert n_split == 1 and fresh is None and (x_q8 is None or x_q8.n_tok == n_tok)
            self._attention_tiles(name, q, planes, out, pos, shape, x_q8)
        elif name.startswith("attn_short"):
            assert limit <= n_split * self.short_limit(D, types), "attn_short's splits must hold the range (decode_splits)"
            self._attention_short(name, q, planes, out, pos, n_split, part, ticket, fresh, shape, x_q8)
        else:
            self._attention_rows(name, q, planes, types, out, pos, n_split, split_len, part, ticket, fresh, shape, x_q8)

    def _attention_short(self, name: str, q, planes: tuple, out, pos, n_split: int, part, ticket, fresh: FreshKV | None,
                         shape: AttnShape, x_q8) -> None:
        """Launch attn_short (one query; planes: k, k_d, v, v_d of an fp16 cache, whose scale planes
        are null): a block per query head and split of short_keys(D) keys (n_split of them: the
        range's; part and ticket as attn_kv's where n_split > 1), its shared memory asked for as one
        block a multiprocessor (the carveout of the products it launches beside, K4_CARVEOUT)."""
        n_tok, n_head, D = q.shape
        n_head_kv = planes[0].shape[1]
        assert n_tok == 1
        if n_split > 1:
            check_f32(part, 1, n_head, n_split, D + 2)
            assert ticket.dtype == cp.int32 and ticket.size >= n_head and ticket.flags.c_contiguous
        head, tail = (NULL,) * 3, (NULL,) * 3 + (np.int32(0), np.int32(0), np.float32(0), np.float32(1))
        if fresh is not None:
            head, tail = _fresh_args(fresh, n_head, n_head_kv, D)
        smem = short_smem(D)
        allow_shared(self.function(FILE_OF[name], name), smem)
        self._launch(FILE_OF[name], name, (n_head, n_split), (SHORT_THREADS,),
                     (q, planes[0], planes[2], out, NULL if n_split == 1 else part, NULL if n_split == 1 else ticket, pos,
                      np.int32(n_head), np.int32(n_head_kv), *shape.kernel_args(D), *head, *tail,
                      NULL if x_q8 is None else x_q8.data, np.int32(0 if x_q8 is None else x_q8.swizzle)), shared_mem=smem, per_sm=1)

    def _attention_tiles(self, name: str, q, planes: tuple, out, pos, shape: AttnShape, x_q8=None) -> None:
        """Launch attn_mma or attn_tiled (planes: k, k_d, v, v_d): several queries per block,
        keys staged in shared memory; attn_mma also writes its output quantized into x_q8 (a
        q8_handoff.Q8Rows of n_tok rows) unless None. Without programmatic dependent launch, whatever the Ops'
        switch: with it, the prefill graph of 512 tokens of the synthetic Qwen3-30B-A3B stopped
        with an illegal address (H200; from session 8 to 10 MoE models ran without PDL at all).
        Session 11's bisection: PDL off for these launches alone ended it; off for the RoPE
        store, the norms, the products or the element-wise kernels did not. The mechanism is not
        found; a prefill chunk loses one overlapped launch per layer (docs/PERF.md)."""
        n_tok, n_head, D = q.shape
        n_head_kv = planes[0].shape[1]
        mma = name.startswith("attn_mma")
        smem = mma_smem(D) if mma else tiled_smem(D)
        allow_shared(self.function(FILE_OF[name], name), smem)
        rows, threads = (MMA_BQ, MMA_THREADS) if mma else (TILE_Q, TILE_THREADS)
        self._launch(FILE_OF[name], name, (n_head, -(-n_tok // rows)), (threads,),
                     (q, *planes, out, pos, np.int32(n_tok), np.int32(n_head), np.int32(n_head_kv), *shape.kernel_args(D),
                      *((NULL if x_q8 is None else x_q8.data, np.int32(0 if x_q8 is None else x_q8.swizzle)) if mma else ())),
                     shared_mem=smem, pdl=False)

    def _attention_rows(self, name: str, q, planes: tuple, types: KVTypes, out, pos, n_split: int, split_len: int, part, ticket,
                        fresh: FreshKV | None, shape: AttnShape, x_q8=None) -> None:
        """Launch attn_kv (one block per (head, query, split)) or attn_gqa (one block per (KV
        head, split), one query) (planes: k, k_d, v, v_d, of types), optionally with RoPE and the cache
        store of the token fused in (fresh) and the output also quantized (x_q8)."""
        n_tok, n_head, D = q.shape
        n_ctx, n_head_kv, _ = planes[0].shape
        gqa = name.startswith("attn_gqa")
        if n_split == 1:  # one split over every position (a ring's rows are fewer than the positions)
            split_len = RING_ONE_SPLIT if shape.ring else n_ctx
        else:  # the splits cover the keys a query sees: at most the window (a sliding layer's count from its first)
            if split_len < 0:  # sized per step by the kernel (attention_sizes.cuh split_keys): they cover what it sees
                assert -split_len % (GQA_TILE_KEYS[D] if gqa else ATT_SPLIT_KEYS) == 0
            else:
                assert shape.ring or n_split * split_len >= min(n_ctx, shape.window or n_ctx)
                assert not gqa or split_len % GQA_TILE_KEYS[D] == 0
            assert part is not None and ticket is not None
            check_f32(part, n_tok, n_head, n_split, D + 2)
            assert ticket.dtype == cp.int32 and ticket.size == n_tok * n_head and ticket.flags.c_contiguous
        rope = (NULL,) * 10 + (np.int32(0), np.int32(0), np.float32(0), np.float32(1))
        if fresh is not None:
            assert n_tok == 1
            head, tail = _fresh_args(fresh, n_head, n_head_kv, D)
            rope = (*head, *planes, *tail)
        head = (q, *planes, out, NULL if n_split == 1 else part, NULL if n_split == 1 else ticket, pos)
        if gqa:
            assert n_tok == 1
            smem = self._gqa_smem_of(D, types, n_head // n_head_kv)
            allow_shared(self.function(FILE_OF[name], name), smem)
            self._launch(FILE_OF[name], name, (n_head_kv, n_split), (GQA_THREADS,),
                         (*head, np.int32(n_head), np.int32(n_head_kv), np.int32(split_len), *shape.kernel_args(D), *rope,
                          NULL if x_q8 is None else x_q8.data, np.int32(0 if x_q8 is None else x_q8.swizzle),
                          np.int32(self._merge_helpers(n_head // n_head_kv * D, n_head_kv))),
                         shared_mem=smem)
            return
        self._launch("attention.cu", name, (n_head, n_tok, n_split), (ATT_THREADS,),
                     (*head, np.int32(n_head), np.int32(n_head_kv), np.int32(D), np.int32(split_len),
                      np.int32(attention_lanes(n_head, n_head_kv, D)), *shape.kernel_args(D), *rope,
                      NULL if x_q8 is None else x_q8.data, np.int32(0 if x_q8 is None else x_q8.swizzle)), shared_mem=att_smem(D))
