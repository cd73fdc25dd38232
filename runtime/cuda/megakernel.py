"""The decode step of a dense model as one persistent kernel (K4_MEGAKERNEL; issue 20, lever 1).

kernels_cu/megakernel.cu runs one block per multiprocessor over an instruction list built here at
load: per layer the q/k/v products (RMSNorm folded in, biases), the attention (RoPE, the cache
store, causal attention of the one query), the output product (+ residual), gate/up with SwiGLU,
down (+ residual); then the final norm and lm_head into the logits. Each product is cut into
tiles of a few whole rows, handed out round robin over the blocks; every block streams its own
tile list through a shared-memory ring for the whole step, so the weights keep arriving while
it waits for the op before (the design of Hazy Research's "Look Ma, No Bubbles" megakernel and
of Mirage's persistent kernel, written here from their descriptions).

What it runs, else `unsupported` says why and decode keeps its graph of one kernel per op:
dense llama-style layers (llama, qwen2, qwen3: no experts, post-norms, sliding windows or
soft-capping), matrices of MK_TYPES in the planar layout (K4_REPACK), gate/up interleaved for
SwiGLU (K4_FUSE_SWIGLU), an f16 KV cache without rings, and steps attending at most `max_keys`
keys (Runner.decode_body keeps the graph past them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ..kv_types import F16
from ..model import ModelConfig
from .constants import (MK_ATTN, MK_ATTN_SCRATCH_FLOATS, MK_GEMV, MK_MAT_FIELDS, MK_MAX_D, MK_MAX_GD, MK_MAX_GROUP,
                        MK_MAX_SPLIT, MK_OP_FIELDS, MK_SLOTS, MK_SPLIT_KEYS, MK_THREADS, MK_TYPES, QUANT_LAYOUTS, q8x_offsets)

MAX_KEYS = MK_SPLIT_KEYS * MK_MAX_SPLIT  # the most keys a step of the megakernel attends
TILE_ROWS = tuple(range(32, 0, -2))  # rows per tile, the most that fit a slot (even, up to twice the warps of a block)
STATIC_SMEM = 1 << 10  # room left for the kernel's static shared memory


@dataclass(frozen=True)
class MatSpec:
    """A matrix of a product as the planner sees it: type, rows (n_out as stored: gate/up pairs
    count twice), n_in."""

    ggml_type: T
    n_rows: int
    n_in: int


def tile_bytes(t: T, n_in: int, rows: int) -> int:
    """Shared-memory bytes of a tile of `rows` rows of a planar (., n_in) matrix of type t: each
    planar group of its rows' blocks, padded to 16 bytes (megakernel.cu stage)."""
    nblk = rows * n_in // GGML_QUANT_SIZES[t][0]
    groups = QUANT_LAYOUTS[t].groups
    return sum(-(-nblk * (b - a) // 16) * 16 for a, b in zip((0,) + groups[:-1], groups))


def tile_rows(m: MatSpec, slot_bytes: int) -> int:
    """Rows per tile of m: the most of TILE_ROWS whose tile fits `slot_bytes` (full slots keep the
    most bytes in flight while a tile is multiplied). Raises ValueError when not even two rows fit."""
    for rows in TILE_ROWS:
        if tile_bytes(m.ggml_type, m.n_in, rows) <= slot_bytes:
            return rows
    raise ValueError(f"two rows of a {m.ggml_type.name} matrix of {m.n_in} columns exceed a {slot_bytes}-byte slot")


def schedule(products: list[list[tuple[int, MatSpec]]], n_blocks: int, slot_bytes: int) -> np.ndarray:
    """The tile lists of the blocks: (n_blocks, stride, 4) int32 of (op, matrix, first row, rows),
    each block's tiles in op order, then op -1 up to the stride (at least MK_SLOTS + 1 of it: the
    ring reads that far ahead). products[op]: (matrix index, spec) of each matrix of the op (an
    empty list for attention). Tiles of an op go round robin over the blocks, the op's first tile
    on the block after the one that took the previous op's last, so that no block takes every
    remainder."""
    lists: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n_blocks)]
    turn = 0
    for op, mats in enumerate(products):
        for index, m in mats:
            rows = tile_rows(m, slot_bytes)
            for r0 in range(0, m.n_rows, rows):
                lists[turn].append((op, index, r0, min(rows, m.n_rows - r0)))
                turn = (turn + 1) % n_blocks
    stride = max(len(tl) for tl in lists) + MK_SLOTS + 1
    out = np.full((n_blocks, stride, 4), -1, np.int32)
    for b, tl in enumerate(lists):
        if tl:
            out[b, : len(tl)] = tl
    return out


def _products(w) -> list:
    """Every product matrix of the step (a DeviceWeight), in order."""
    mats = [p.w for L in w.layers for p in L.qkv] + [L.wo for L in w.layers] + [L.w_down for L in w.layers]
    return mats + [L.gate_up[0].w for L in w.layers if L.gate_up] + [w.output]


def unsupported(cfg: ModelConfig, w, kv) -> str | None:
    """Why the megakernel cannot run this model's decode step, or None when it can."""
    D, group = cfg.head_dim, cfg.n_head // cfg.n_head_kv
    if any(L.moe is not None for L in w.layers):
        return "mixture-of-experts layers"
    if any(L.attn_post_norm is not None or L.ffn_post_norm is not None for L in w.layers):
        return "post-norms"
    if any(cfg.sliding(li) for li in range(cfg.n_layer)) or any(kv.rings):
        return "sliding-window layers"
    if cfg.attn_softcap or cfg.final_softcap:
        return "soft-capping"
    if kv.types != F16:
        return f"a {kv.types.k}/{kv.types.v} KV cache (f16 only)"
    if D % 8 or (D // 8) & (D // 8 - 1) or D > MK_MAX_D or group > MK_MAX_GROUP or group * D > MK_MAX_GD or cfg.n_head % cfg.n_head_kv:
        return f"{cfg.n_head} heads of {D} over {cfg.n_head_kv} KV heads"
    if any(len(L.gate_up) != 1 or not L.gate_up[0].w.glu or L.gate_up[0].w.glu_act != "silu" for L in w.layers):
        return "gate/up not interleaved for SwiGLU (K4_FUSE_SWIGLU)"
    for m in _products(w):
        if m.ggml_type not in MK_TYPES or not m.planar:
            return f"{m.ggml_type.name} matrices{'' if m.planar else ' in the raw layout'} ({', '.join(t.name for t in MK_TYPES)}, planar)"
        if m.shape[0] % 2 or m.shape[1] % 256:
            return f"a {m.shape[0]}x{m.shape[1]} matrix (even rows, columns a multiple of 256)"
    return None


class MegaStep:
    """The instruction list, tile lists and scratch of one model's megakernel, on the device.
    launch() enqueues a decode step's layers and lm_head (the embedding of the token is already
    in act.x0[0]; the logits land in act.logits[0]). Raises PlanError when the model's products
    do not fit its shared memory (the caller keeps the graph)."""

    def __init__(self, cfg: ModelConfig, w, act, kv, mem, rope_mscale: float, query_scale: float):
        import cupy as cp

        from .compile import module
        from .launch import allow_shared, device_limits

        self.n_blocks, self.max_keys = device_limits()[0], MAX_KEYS
        max_smem = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
        mats: list[tuple] = []  # (DeviceWeight, y, residual, bias)
        ops: list[dict] = []
        products: list[list[tuple[int, MatSpec]]] = []
        D, eps = cfg.head_dim, cfg.rms_eps
        x, attn, ff, logits = act.x0[0], act.attn[0], act.ff[0], act.logits[0]

        def gemv(x_in, norm, n_in, outs) -> None:
            ops.append(dict(kind=MK_GEMV, x=x_in.data.ptr, norm=0 if norm is None else norm.data.ptr, n_in=n_in, eps=_bits(eps)))
            specs = []
            for m, y, res, bias in outs:
                specs.append((len(mats), MatSpec(m.ggml_type, m.shape[0], m.shape[1])))
                mats.append((m, y, res, bias))
            products.append(specs)

        for li, L in enumerate(w.layers):
            gemv(x, L.attn_norm, cfg.n_embd, [(p.w, p.out[0], None, p.bias) for p in L.qkv])
            cols = {name: c[0] for p in L.qkv for name, c in p.cols.items()}
            ops.append(dict(kind=MK_ATTN, q=cols["q"].data.ptr, k=cols["k"].data.ptr, v=cols["v"].data.ptr,
                            k_cache=kv.k[li].data.ptr, v_cache=kv.v[li].data.ptr, out=attn.data.ptr,
                            inv_freq=w.inv_freq.data.ptr,
                            q_norm=0 if L.q_norm is None else L.q_norm.data.ptr, k_norm=0 if L.k_norm is None else L.k_norm.data.ptr,
                            rope_dim=cfg.rope_dim, neox=int(cfg.rope_neox), n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
                            head_dim=D, scale=_bits(query_scale), eps=_bits(eps), mscale=_bits(rope_mscale)))
            products.append([])
            gemv(attn, None, cfg.q_dim, [(L.wo, x, x, None)])
            gemv(x, L.ffn_norm, cfg.n_embd, [(L.gate_up[0].w, ff, None, None)])
            gemv(ff, None, cfg.n_ff, [(L.w_down, x, x, None)])
        gemv(x, w.output_norm, cfg.n_embd, [(w.output, logits, None, None)])

        self.max_n_in = max(m.shape[1] for m, *_ in mats)
        self.scratch = -(-max(q8x_offsets(self.max_n_in)[2], 4 * MK_ATTN_SCRATCH_FLOATS) // 16) * 16
        tiles, self.slot, lists = plan_ring(products, len(mats), self.n_blocks, max_smem - STATIC_SMEM - self.scratch)
        self.ring_offset = self.scratch + lists
        self.smem = self.ring_offset + MK_SLOTS * self.slot
        # planned: the scratch of the attention's splits and the counters (nothing allocated before a PlanError)
        self.part = mem.zeros((cfg.n_head, MK_MAX_SPLIT, D + 2), cp.float32, "scratch")
        self.ticket = mem.zeros((cfg.n_head_kv,), cp.int32, "scratch")
        for o in ops:
            if o["kind"] == MK_ATTN:
                o.update(part=self.part.data.ptr, ticket=self.ticket.data.ptr)
        self.n_ops = len(ops)
        self.ops = cp.asarray(np.array([[int(o.get(f, 0)) for f in MK_OP_FIELDS] for o in ops], np.int64))
        self.mats = cp.asarray(np.array([_mat_record(m, y, res, bias) for m, y, res, bias in mats], np.int64))
        self.tiles = cp.asarray(tiles)
        self.counters = mem.zeros((self.n_ops + 1,), cp.int32, "scratch")
        self.kernel = module("megakernel.cu", ("megakernel",)).get_function("megakernel")
        allow_shared(self.kernel, self.smem)

    def launch(self, pos, stream=None, trace=None) -> None:
        """Enqueue the step at position pos[0] (a device int32 view of the decode state)."""
        from .launch import launch

        launch(self.kernel, (self.n_blocks,), (MK_THREADS,),
               (self.ops, np.int32(self.n_ops), self.mats, np.int32(self.mats.shape[0]), self.tiles, np.int32(self.tiles.shape[1]), self.counters, pos,
                np.int32(self.scratch), np.int32(self.ring_offset), np.int32(self.slot), np.int32(self.max_n_in)), self.smem, stream,
               trace)


class PlanError(ValueError):
    """The model's products do not fit the megakernel's shared memory."""


def list_bytes(stride: int, n_mats: int) -> int:
    """Shared-memory bytes of a block's tile list of `stride` records and n_mats matrix records,
    padded to 16 (the kernel finds the ring after them, at the offset it is given)."""
    return (16 * stride + 8 * len(MK_MAT_FIELDS) * n_mats + 15) // 16 * 16


def plan_ring(products: list[list[tuple[int, MatSpec]]], n_mats: int, n_blocks: int, budget: int) -> tuple[np.ndarray, int, int]:
    """The tile lists (schedule) and the ring for `budget` bytes of shared memory, which hold the
    lists, the matrix records and MK_SLOTS slots: (tiles, slot bytes, list bytes). Smaller slots
    mean longer lists, so the lists' room is grown until the tiles they hold were planned with it.
    Raises PlanError when even two rows of some matrix do not fit a slot."""
    stride = 0
    while True:
        room = budget - list_bytes(stride, n_mats)
        try:
            tiles = schedule(products, n_blocks, room // MK_SLOTS // 16 * 16)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        if tiles.shape[1] <= stride:
            break
        stride = tiles.shape[1]
    specs = {i: m for mats in products for i, m in mats}
    slot = max(tile_bytes(specs[m].ggml_type, specs[m].n_in, r) for m, r in {(int(t[1]), int(t[3])) for t in tiles.reshape(-1, 4) if t[0] >= 0})
    return tiles, -(-slot // 16) * 16, list_bytes(tiles.shape[1], n_mats)


def _bits(v: float) -> int:
    """The 32-bit pattern of float32 v, as the kernel reads float fields."""
    return int(np.array([v], np.float32).view(np.int32)[0])


def _mat_record(m, y, residual, bias) -> list[int]:
    ptr = lambda a: 0 if a is None else int(a.data.ptr)  # noqa: E731
    rec = dict(w=int(m.data.data.ptr), nblk=m.n_blocks, type=int(m.ggml_type), n_in=m.shape[1], y=ptr(y),
               residual=ptr(residual), bias=ptr(bias), glu=int(m.glu))
    return [rec[f] for f in MK_MAT_FIELDS]
