"""The CUDA backend's buffers, all allocated before the first token: one spec per group
(activations, sampler state) from which both the up-front memory check and the allocation take
their sizes, so the two cannot disagree (the KV cache: runtime/cuda/kv_cache.py).

Shapes use P = rows of one prefill chunk, the model's n_embd, q_dim = n_head * head_dim,
kv_dim = n_head_kv * head_dim, n_ff, n_vocab, and n_ctx positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import cupy as cp
import numpy as np

from ..model import ModelConfig
from . import device_weight, matmul, ops
from .constants import ARGMAX_PARTS, MMA8_TOKENS
from .memory import DeviceMemory, PinnedBuffer
from .moe import moe_spec

RING_MIN = 1024  # slots of the device token ring (repeat penalty window and readback source)


@dataclass(frozen=True)
class Buffer:
    """One device buffer of a spec: shape, dtype, kind (memory_report's key), zero-filled or not."""

    shape: tuple[int, ...]
    dtype: type
    kind: str = "scratch"
    zero: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


Spec = dict[str, Buffer]


def spec_bytes(spec: Spec) -> int:
    """Device bytes of every buffer of `spec`."""
    return sum(b.nbytes for b in spec.values())


def allocate(mem: DeviceMemory, spec: Spec) -> SimpleNamespace:
    """Allocate every buffer of `spec` (zero-filled where it says so); attribute per name, None
    for an empty spec entry (a buffer with a 0 dimension is not allocated)."""
    out = SimpleNamespace()
    for name, b in spec.items():
        alloc = mem.zeros if b.zero else mem.empty
        setattr(out, name, alloc(b.shape, b.dtype, b.kind) if b.nbytes else None)
    return out


def matmul_scratch_bytes(specs, chunk: int, opts: device_weight.WeightOptions) -> int:
    """matmul.matmul_scratch_bytes for weights described by `specs` (objects with ggml_type and
    shape: layout.MatrixSpec or DeviceWeight) before they are uploaded, with options `opts`
    (its tensor_cores and mma8 switches choose the products' paths)."""
    sized = [SimpleNamespace(ggml_type=s.ggml_type, shape=s.shape, prefill_tc=opts.tensor_cores, mma8=opts.mma8) for s in specs]
    return matmul.matmul_scratch_bytes(sized, chunk)


def activation_spec(cfg: ModelConfig, chunk: int, n_ctx: int, n_split: int, mm_scratch: int, fuse_quant: bool) -> Spec:
    """The activations of a forward pass of up to `chunk` tokens (see runtime/cuda/forward.py),
    the partials of decode attention split n_split ways, the ids of one call (n_ctx), the
    matmul scratch (bytes) and, with K4_FUSE_QUANT, the q8 handoff of the SwiGLU output."""
    P, f32, f16 = chunk, np.float32, np.float16
    return {
        "x0": Buffer((P, cfg.n_embd), f32),  # residual stream
        "x1": Buffer((P, cfg.n_embd), f32),  # residual stream after attention
        "h": Buffer((P, cfg.n_embd), f32),  # normalized input of a projection
        "h16": Buffer((P, cfg.n_embd), f16),  # the same in fp16 (prefill on tensor cores)
        "h_q8": Buffer((MMA8_TOKENS * matmul.q8x_bytes(cfg.n_embd),), np.uint8),  # h quantized, for up to 8 tokens (verify)
        "x_q8": Buffer((MMA8_TOKENS * matmul.q8x_bytes(max(cfg.n_ff, cfg.q_dim)),), np.uint8),  # attn or ff quantized (verify)
        "qkv": Buffer((P * (cfg.q_dim + 2 * cfg.kv_dim),), f32),  # q, k, v products, packed per layer (place)
        "gate_up": Buffer((P * 2 * cfg.n_ff,), f32),  # gate and up products (place)
        "q": Buffer((P, cfg.n_head, cfg.head_dim), f32),  # q after RoPE
        "attn": Buffer((P, cfg.n_head, cfg.head_dim), f32),  # attention output
        "ff": Buffer((P, cfg.n_ff), f32),  # silu(gate) * up
        "ff16": Buffer((P, cfg.n_ff), f16),
        "nq8": Buffer((matmul.q8x_bytes(cfg.n_embd),), np.uint8),  # decode's norm input handed over quantized (K4_NORM_Q8)
        "nq_parts": Buffer((cfg.n_embd,), f32),  # its producer's per-block sums of squares (at most a block per output)
        "nq_rows_parts": Buffer((MMA8_TOKENS * (cfg.n_embd // 32),), f32),  # the verify step's (K4_MMA8_NQ): a step per 32 rows at most
        "ff_q8": Buffer((matmul.q8x_bytes(cfg.n_ff) if fuse_quant else 0,), np.uint8),  # one, the layers take turns
        "logits": Buffer((P, cfg.n_vocab), f32),
        # partials of split decode attention: (1, n_head, n_split, head_dim + 2) of the range in use
        "part": Buffer((cfg.n_head * n_split * (cfg.head_dim + 2) if n_split > 1 else 0,), f32),
        "ticket": Buffer((cfg.n_head,), np.int32, zero=True),  # splits of decode attention done, per head
        "ids": Buffer((n_ctx,), np.int32),  # token ids of one eval/prefill
        "mm_scratch": Buffer((mm_scratch,), np.uint8),  # fp16 X and dequantized W chunks of matmul
        **moe_spec(cfg, P),  # mixture of experts: router logits, top-k ids and weights, expert outputs
    }


def sampler_spec(cfg: ModelConfig, ring: int = RING_MIN) -> Spec:
    """The decode state and the on-device sampler's buffers (kernels_cu/sampling.cu)."""
    return {
        "state": Buffer((ops.STATE_WORDS,), np.int32, zero=True),  # [tok, pos, ring_count, draw] (ops.ST_*)
        "params": Buffer((ops.SAMPLER_PARAM_WORDS,), np.uint64, zero=True),  # ops.pack_sampler_params
        "seen": Buffer((cfg.n_vocab,), np.int32, zero=True),  # repeat-penalty counts
        "part_val": Buffer((ARGMAX_PARTS,), np.float32),  # argmax partials (sample_argmax_partial's or the head's)
        "part_idx": Buffer((ARGMAX_PARTS,), np.int32),
        "ring": Buffer((ring,), np.int32, zero=True),  # recent tokens: penalty window, readback source
    }


def staging_bytes(n_ctx: int, ring: int) -> int:
    """Pinned host bytes staging one call's uploads: ids (n_ctx), the ring, sampler parameters."""
    return 4 * (n_ctx + ring) + 8 * ops.SAMPLER_PARAM_WORDS


def place(projections: tuple, flat: cp.ndarray, chunk: int) -> None:
    """Give each projection of one layer its output view: consecutive (chunk, n_out) blocks of
    `flat`, and the column view of each part (weights.Projection out, cols)."""
    off = 0
    for p in projections:
        n_out = p.w.shape[0]
        p.out = flat[chunk * off : chunk * (off + n_out)].reshape(chunk, n_out)
        p.cols, col = {}, 0
        for name, rows in p.parts:
            p.cols[name] = p.out[:, col : col + rows]
            col += rows
        off += n_out


class Readback:
    """Host side of the token stream: pinned staging for uploads and two 4-byte slots, each with
    an event, for the ping-pong readback of sampled ids."""

    def __init__(self, n_ctx: int, ring: int):
        self.staging = PinnedBuffer(staging_bytes(n_ctx, ring))
        self.slots = [PinnedBuffer(4), PinnedBuffer(4)]  # int32 readback slots, one event each
        self.computed = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
