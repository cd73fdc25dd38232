"""Decode's mixture-of-experts feed-forward of one token in one launch (kernels_cu/moe_one.cu,
K4_MOE_ONE): the router product with its RMSNorm, the k chosen experts' gate/up with SwiGLU, and
their down product with the weighted sum and the residual. The logits pass between the blocks as
tagged words they poll, the SwiGLU rows behind a count of the blocks that wrote theirs, instead
of across kernel boundaries. Its output has the bits of the three launches of runtime/cuda/moe.py
decode_fused (moe_router, the routed SwiGLU launch, moe_down_combine), whose arithmetic it shares
(kernels_cu/moe_route.cuh router_logit and moe_route, gemv_common.cuh q8_rows, moe_down.cuh).
Layers it does not cover (another router type, expert types outside kernel_names.MOE_ONE_PAIRS)
keep the three launches.

Every block waits for the others, so all must be resident at once: the grid is one block per
multiprocessor, and the launch is refused (three launches instead) where one block does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from .constants import q8x_bytes
from .kernel_names import MOE_ONE_PAIRS, MOE_Q8_GLU_VARIANTS, moe_one_name
from .quant_types import QUANT


def kernel_name(router_type, gate, down) -> str | None:
    """The moe_one.cu instance for a layer's router ggml type and gate/down Experts (runtime/cuda/moe.py),
    or None where there is none (a router other than F32, a decoder pair outside MOE_ONE_PAIRS)."""
    if router_type != T.F32 or gate.ggml_type not in QUANT or down.ggml_type not in QUANT:
        return None
    pair = (QUANT[gate.ggml_type].decoder, QUANT[down.ggml_type].decoder)
    return moe_one_name(*pair) if pair in MOE_ONE_PAIRS else None


def shared_bytes(n_embd: int, n_ff: int, k: int, n_expert: int) -> int:
    """moe_one's dynamic shared memory: the larger of the q8 x of gate/up and the k q8 rows of
    down's x, then the softmax's probabilities and the logits (n_expert floats each)."""
    return max(q8x_bytes(n_embd), k * q8x_bytes(n_ff)) + 8 * n_expert


@dataclass(frozen=True)
class Handoff:
    """What moe_one's blocks hand each other, on the device, zero before the first launch: words
    (n_expert,) uint64, the logits tagged (high 32 bits: the launch's tag, low: the float32's
    bits); arrived (1,) uint64, the blocks whose SwiGLU rows are written; count
    (1,) uint64, the blocks that finished a launch. The launches sharing one must share the grid
    (the device's multiprocessors)."""

    words: object
    arrived: object
    count: object


def launch(o, m, x, norm_w, eps: float, h, handoff: Handoff, y, k: int, renorm: bool) -> bool:
    """Enqueue one token's feed-forward on ops.Ops o's stream: y (n_embd,) f32 = x + the experts'
    weighted sum for rmsnorm(x) * norm_w (y may be x). m: the layer's MoeWeights (router F32
    (1, n_expert, n_embd), gate/up/down Experts); h (k, n_ff) f32 receives the SwiGLU rows.
    Returns False, enqueueing nothing, where no instance covers the layer or one block per
    multiprocessor does not fit. Raises ValueError for handoff buffers of other sizes or types."""
    from .launch import allow_shared, blocks_per_sm, device_limits

    name = kernel_name(m.router.ggml_type, m.gate, m.down)
    if name is None:
        return False
    n_expert, n_ff, n_embd = m.gate.shape
    warps = MOE_Q8_GLU_VARIANTS[QUANT[m.gate.ggml_type].decoder][0]
    ho = handoff
    if ((ho.words.dtype, ho.arrived.dtype, ho.count.dtype) != (np.uint64, np.uint64, np.uint64) or ho.words.size < n_expert
            or ho.arrived.size < 1 or h.shape != (k, n_ff) or h.dtype != np.float32):
        raise ValueError(f"moe_one hands over {n_expert} uint64 words, a uint64 arrival count, a uint64 count and h "
                         f"({k}, {n_ff}) f32; got {ho.words.size} {ho.words.dtype}, {ho.arrived.size} {ho.arrived.dtype}, "
                         f"{ho.count.dtype}, h {h.shape} {h.dtype}")
    smem = shared_bytes(n_embd, n_ff, k, n_expert)
    kernel = o.function("moe_one.cu", name)
    allow_shared(kernel, smem)
    grid = device_limits()[0]
    if blocks_per_sm(kernel, 32 * warps, smem) < 1:
        return False
    args = (m.router.data, m.gate.data, m.up.data, np.int64(m.gate.expert_bytes), m.down.data, np.int64(m.down.expert_bytes),
            x, norm_w, np.float32(eps), ho.words, ho.arrived, h, ho.count, y, np.int32(n_expert), np.int32(k), np.int32(renorm),
            np.int32(n_embd), np.int32(n_ff))
    o._launch("moe_one.cu", name, (grid,), (32 * warps,), args, shared_mem=smem)
    return True
