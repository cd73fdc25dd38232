"""What the attention kernels' tests share (tests/test_cuda_ops.py, tests/test_cuda_kv.py,
tests/test_cuda_gemma.py): their random inputs, the float64 attention they compare against, and
the run of every kernel that serves a shape (check_attention_kernels) with its error limits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from k4.runtime.cuda.kernel_names import GQA_TILE_KEYS

# attn_mma rounds the pre-scaled queries and the probabilities to fp16 (unit roundoff 2^-11 =
# 4.9e-4) and accumulates in f32; emulating exactly those two roundings in float64 gives rel L2
# errors of 3e-4 to 4e-4 on test_cuda_ops's cases, so 2e-3 leaves 5x margin and still catches any
# wrong index, mask or rescale (those give errors of order 1e-1); attn_gqa rounds the same two.
# The other kernels compute in f32 on exactly the values of the cache: 2e-5.
MMA_ATTN_REL_L2 = 2e-3
ATTN_REL_L2 = 2e-5


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def attention_inputs(rng, n_tok: int, pos0: int, n_head: int, n_head_kv: int, D: int):
    """Random inputs of an attention test, drawn from rng in this order: q (n_tok, n_head, D)
    float32, then the keys and the values of the n_kv = pos0 + n_tok positions a causal query of
    the batch can see, (n_kv, n_head_kv, D) float64 each, the keys with twice the values' spread."""
    q = rng.standard_normal((n_tok, n_head, D)).astype(np.float32)
    n_kv = pos0 + n_tok
    keys = 2 * rng.standard_normal((n_kv, n_head_kv, D))
    values = rng.standard_normal((n_kv, n_head_kv, D))
    return q, keys, values


def fresh_inputs(rng, arch: str, n_head: int, n_head_kv: int, D: int, pos0: int, n_ctx: int):
    """The inputs of a decode step whose RoPE and cache store the attention kernel may fuse (GPU):
    (q, k, v) as column views of one (1, (n_head + 2 n_head_kv) D) product, the RoPE arguments of
    a tiny `arch` model of that shape (random q/k norm weights where it has them), the position
    pos0 as a device int32, and two random fp16 cache planes (n_ctx, n_head_kv, D)."""
    import cupy as cp

    from k4.runtime.cuda.op_args import RopeArgs
    from k4.runtime.cuda.weights import rope_inv_freq
    from tests.tiny import tiny_config

    cfg = tiny_config(arch, head_dim=D, rope_dim=D, n_head=n_head, n_head_kv=n_head_kv)
    qkv = cp.asarray(rng.standard_normal((1, (n_head + 2 * n_head_kv) * D)).astype(np.float32))
    a, b = n_head * D, (n_head + n_head_kv) * D
    norms = [cp.asarray((1 + 0.2 * rng.standard_normal(D)).astype(np.float32)) if cfg.has_qk_norm else None for _ in range(2)]
    rope = RopeArgs(*norms, cp.asarray(rope_inv_freq(cfg, None)), D, cfg.rope_neox, cfg.rms_eps)
    cache = [cp.asarray(rng.standard_normal((n_ctx, n_head_kv, D)).astype(np.float16)) for _ in range(2)]
    return (qkv[:, :a], qkv[:, a:b], qkv[:, b:]), rope, cp.asarray([pos0], dtype=cp.int32), cache


def f16_plane(rows: np.ndarray, n_ctx: int) -> np.ndarray:
    """An fp16 cache plane (n_ctx, n_head_kv, D) whose first len(rows) rows hold `rows` rounded
    to fp16 and the rest NaN: rows past the causal range must stay unread."""
    plane = np.full((n_ctx, *rows.shape[1:]), np.nan, np.float16)
    plane[: len(rows)] = rows
    return plane


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


# The kernel choices a decode query (n_tok = 1) runs with, as (mma, tiled, gqa, gqa_cols, gqa_int8)
# switches of Ops: attn_gqa twice where the shape has an instance (the tickets must reset; its
# column instance for groups of up to 8, over q8_0 keys by int8 mma), the column instance with
# q8_0 keys dequantized, its row instance, then attn_kv; several queries run each prefill kernel
# (mma, tiled, neither).
DECODE_KERNELS = [(False, True, True, True, True), (False, True, True, True, True), (False, True, True, True, False),
                  (False, True, True, False, True), (False, True, False, True, True)]
PREFILL_KERNELS = [(True, True, True, True, True), (False, True, True, True, True), (False, False, True, True, True)]
# a split length both decode kernels take: attn_gqa's tile, a multiple of attn_kv's ATT_SPLIT_KEYS
# (checked in check_attention_kernels; attention_launch needs CuPy, kernel_names does not)
SPLIT_KEYS = max(GQA_TILE_KEYS.values())


def gqa_int8_queries(q: np.ndarray, scale: float) -> np.ndarray:
    """The queries q (..., D) float32 as attn_gqa's I8K instance multiplies them with the keys
    (kernels_cu/gqa_cols.cuh cols_quantize_query), in the units of q, float64: q times the query
    scale and log2(e) in float32, rounded to fp16, then per 32 dims d = max |v| / 127 and
    round(v / d) (float32, ties to even), times d; the kernel exponentiates base 2 the scores of
    these, so ln 2 / scale turns them back into q's units for a reference that scales by `scale`
    and exponentiates base e."""
    qscale = np.float32(scale) * np.float32(1.4426950408889634)
    v = (q.astype(np.float32) * qscale).astype(np.float16).astype(np.float32)
    blocks = v.reshape(*v.shape[:-1], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    qi = np.rint(np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0))
    return (qi.astype(np.float64) * d.astype(np.float64)).reshape(q.shape) * (np.log(2.0) / float(np.float32(scale)))


def tensor_cores(ops, n_tok: int, D: int, group: int) -> bool:
    """Whether ops (its current switches) runs attention of n_tok queries of head_dim D, group
    query heads per KV head, on tensor cores (attn_mma or attn_gqa: q and p rounded to fp16)."""
    return ops.attention_kernel(n_tok, D, group=group).startswith(("attn_mma", "attn_gqa"))


def check_attention_kernels(ops, q: np.ndarray, kc, vc, pos0: int, n_ctx: int, split: bool, want: np.ndarray,
                            reference=None, **options) -> None:
    """ops.attention (runtime/cuda/attention_launch.py) on q (n_tok, n_head, D) float32 and the
    device planes kc, vc (n_ctx rows, n_head_kv heads) with every kernel that serves the shape,
    each output poisoned (NaN) first and compared with want (n_tok, n_head, D): several queries
    through attn_mma, attn_tiled and the per-query kernel; one query (split if `split`, in
    SPLIT_KEYS multiples) through attn_gqa twice (so the split tickets must reset) where the
    shape has an instance (the column instance for groups of up to 8), its row instance, then
    attn_kv (its deep instance, then the short ranges' one, which must give the same bits); with
    splits, attn_gqa's merge by its last block alone must give the shared merge's bits; and
    attn_short where the keys seen are few enough (check_short).
    Relative L2 limits: MMA_ATTN_REL_L2 for the tensor-core kernels, ATTN_REL_L2 otherwise; the
    instance that rounds the query to 8 bits (q8_0 keys by int8 mma) is compared with
    reference(gqa_int8_queries(q, scale)) instead of want (reference: want's function of the
    queries; required with a q8_0 key plane). options: ops.attention's keywords (scales, shape).
    Leaves ops with the switches (ops.sw) it was given, whatever failed. attn_gqa runs for every
    group it takes (2 and up), below the selector's gqa_min_group too."""
    import cupy as cp

    from k4.runtime.cuda.attention_launch import ATT_SPLIT_KEYS, GQA_MIN_LIMIT, attention_split
    from k4.runtime.kv_types import KVTypes

    assert SPLIT_KEYS % ATT_SPLIT_KEYS == 0 and all(SPLIT_KEYS % bk == 0 for bk in GQA_TILE_KEYS.values())
    n_tok, n_head, D = q.shape
    group = n_head // kc.shape[1]
    n_split, split_len = attention_split(n_ctx, split, keys=SPLIT_KEYS)
    part = cp.empty((n_tok, n_head, n_split, D + 2), cp.float32) if n_split > 1 else None
    ticket = cp.zeros(n_tok * n_head, cp.int32)
    kv = KVTypes(*("q8_0" if p.dtype == cp.int8 else "f16" for p in (kc, vc)))
    shape = options.get("shape")
    scale = 1.0 / np.sqrt(D) if shape is None or shape.scale is None else shape.scale
    min_group, ops.gqa_min_group = ops.gqa_min_group, 2
    saved = ops.sw
    try:
        for mma, tiled, gqa, cols, int8 in PREFILL_KERNELS if n_tok > 1 else DECODE_KERNELS:
            ops.sw = replace(saved, mma=mma, tiled=tiled, gqa=gqa, gqa_cols=cols, gqa_int8=int8)
            out = cp.full((n_tok, n_head, D), np.nan, cp.float32)
            ops.attention(cp.asarray(q), kc, vc, out, cp.asarray([pos0], dtype=cp.int32), n_split, split_len, part, ticket,
                          **options)
            limit = MMA_ATTN_REL_L2 if tensor_cores(ops, n_tok, D, group) else ATTN_REL_L2
            expect = want
            if n_tok == 1 and ops.quantizes_query(D, kv, group):
                assert reference is not None, "a q8_0 key plane needs the reference of the 8-bit queries"
                expect = reference(gqa_int8_queries(q, scale))
            assert rel_l2(out.get(), expect) < limit, f"mma={mma} tiled={tiled} gqa={gqa} cols={cols} int8={int8}"
            assert not ticket.any()  # every split's ticket reset, the skipped ones included
            if n_tok == 1 and ops.attention_kernel(1, D, kv, group).startswith("attn_kv"):
                # the instance of short decode ranges (seven blocks a multiprocessor, each thread
                # merging on its own) gives the deep one's bits (attention.cu DEEP)
                short = cp.full_like(out, np.nan)
                ops.attention(cp.asarray(q), kc, vc, short, cp.asarray([pos0], dtype=cp.int32), n_split, split_len, part, ticket,
                              limit=GQA_MIN_LIMIT, **options)
                assert ops.attention_kernel(1, D, kv, group, GQA_MIN_LIMIT).endswith("false>")
                assert cp.array_equal(short, out) and not ticket.any()
            if n_tok == 1 and n_split > 1 and ops.attention_kernel(1, D, kv, group).startswith("attn_gqa"):
                # the merge by the last block alone (K4_SHARED_MERGE=0) gives the shared merge's bits
                chosen, ops.sw = ops.sw, replace(ops.sw, shared_merge=False)
                alone = cp.full_like(out, np.nan)
                ops.attention(cp.asarray(q), kc, vc, alone, cp.asarray([pos0], dtype=cp.int32), n_split, split_len, part, ticket,
                              **options)
                ops.sw = chosen
                assert cp.array_equal(alone, out) and not ticket.any()
            if n_tok == 1 and n_split > 1:
                check_dynamic_split(ops, q, kc, vc, expect, pos0, n_ctx, limit, options)
        check_short(ops, q, kc, vc, pos0, want, options)
    finally:
        ops.sw, ops.gqa_min_group = saved, min_group


def check_short(ops, q: np.ndarray, kc, vc, pos0: int, want: np.ndarray, options: dict) -> None:
    """One decode query on attn_short where it serves the shape (an fp16 cache, a head_dim of its
    instances, the keys the query sees within its ranges): in the range of one split where the
    keys fit it, and in the range of SHORT_SPLITS splits (merged where several hold keys; one
    holding them gives the bits of the first range), within ATTN_REL_L2 of want, the tickets left
    zero, its output handed over quantized (x_q8) with the bytes q8x_host makes of it in every
    products' swizzle. options: ops.attention's keywords."""
    import cupy as cp

    from k4.runtime.cuda.attention_launch import SHORT_SPLITS
    from k4.runtime.cuda.constants import q8x_bytes
    from k4.runtime.cuda.q8_handoff import Q8Vector, q8x_host
    from k4.runtime.cuda.quant_types import QUANT
    from k4.runtime.kv_types import KVTypes

    n_tok, n_head, D = q.shape
    kv = KVTypes(*("q8_0" if p.dtype == cp.int8 else "f16" for p in (kc, vc)))
    shape = options.get("shape")
    window = shape.window if shape is not None else 0
    seen = min(pos0 + 1, window) if window else pos0 + 1
    keys = ops.short_limit(D, kv)
    if n_tok != 1 or seen > SHORT_SPLITS * keys:
        return
    part, ticket = cp.empty((1, n_head, SHORT_SPLITS, D + 2), cp.float32), cp.zeros(n_head, cp.int32)
    ranges = ((keys, 1), (SHORT_SPLITS * keys, SHORT_SPLITS)) if seen <= keys else ((SHORT_SPLITS * keys, SHORT_SPLITS),)
    outs = []
    for limit, n_split in ranges:
        assert ops.attention_kernel(1, D, kv, n_head // kc.shape[1], limit) == f"attn_short<{D}>"
        for swz in sorted({k.x_swizzle for k in QUANT.values()}):
            out = cp.full((1, n_head, D), np.nan, cp.float32)
            x_q8 = Q8Vector(cp.zeros(q8x_bytes(n_head * D), cp.uint8), n_head * D, swz)
            ops.attention(cp.asarray(q), kc, vc, out, cp.asarray([pos0], dtype=cp.int32), n_split, keys, part, ticket,
                          limit=limit, x_q8=x_q8, **options)
            assert rel_l2(out.get(), want) < ATTN_REL_L2, (f"attn_short<{D}>", n_split)
            assert np.array_equal(x_q8.data.get(), q8x_host(out.get().reshape(-1), swz)), (swz, n_split)
            assert not ticket.any()
        outs.append(out)
    assert len(outs) == 1 or cp.array_equal(outs[0], outs[1])


def check_dynamic_split(ops, q, kc, vc, expect, pos0, n_ctx, limit, options) -> None:
    """One decode query with its splits sized by the kernel (K4_DYN_SPLIT: split_len -SPLIT_KEYS
    over the most splits n_ctx allows) gives the bits of the same kernel with that length fixed
    (split_keys, the kernel's rule restated), within `limit` (relative L2) of expect
    (numpy, as for the fixed plan). The fixed launch reads the cache cut to the keys the query
    sees, which its splits cover; a ring, or q8_0 planes (their scales), compare with expect alone."""
    import cupy as cp

    from k4.runtime.cuda.attention_launch import attention_split

    n_head = q.shape[1]
    D = q.shape[2]
    n_split, split_len = attention_split(n_ctx, True, keys=SPLIT_KEYS, dynamic=True)
    shape = options.get("shape")
    window = shape.window if shape is not None and shape.window else 0
    n_kv = pos0 + 1
    part = cp.empty((1, n_head, n_split, D + 2), cp.float32)
    ticket = cp.zeros(n_head, cp.int32)
    pos = cp.asarray([pos0], dtype=cp.int32)
    dyn = cp.full((1, n_head, D), np.nan, cp.float32)
    ops.attention(cp.asarray(q), kc, vc, dyn, pos, n_split, split_len, part, ticket, **options)
    assert not ticket.any()
    assert rel_l2(dyn.get(), expect) < limit
    if (shape is not None and shape.ring) or options.get("scales"):
        return
    fixed = cp.full_like(dyn, np.nan)
    keys = split_keys(split_len, n_kv - max(0, n_kv - window) if window else n_kv, n_split)
    ops.attention(cp.asarray(q), kc[:n_kv], vc[:n_kv], fixed, pos, n_split, keys, part, ticket, **options)
    assert cp.array_equal(dyn, fixed) and not ticket.any()


def split_keys(split_len: int, n_seen: int, n_split: int) -> int:
    """Keys per split of a decode step that sees n_seen keys, as kernels_cu/attention_sizes.cuh
    split_keys sizes them (restated for the tests): split_len, or (split_len < 0, K4_DYN_SPLIT)
    the shortest multiple of -split_len keys whose n_split splits cover them."""
    if split_len > 0:
        return split_len
    return max(1, -(-n_seen // (-split_len * n_split))) * -split_len
