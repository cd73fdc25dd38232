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

With a NormOut (flag K4_MOE_NQ) it also hands the next RMSNorm's products their input quantized,
as gemv.cu's NQ products do (runtime/cuda/forward.py handoff), launched in clusters of two blocks
(moe_one.cu NQ): nq_blocks says where.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from .constants import q8x_bytes
from .kernel_names import MOE_ONE_PAIRS, MOE_Q8_GLU_VARIANTS, moe_one_name
from .q8_handoff import Q8Vector
from .quant_kernels import QUANT

NQ_OWN = 4  # moe_one.cu MOE_NQ_OWN: the most 32-output groups a block of the NQ instance owns


def kernel_name(router_type, gate, down, nq: bool = False) -> str | None:
    """The moe_one.cu instance for a layer's router ggml type and gate/down Experts (runtime/cuda/moe.py),
    or None where there is none (a router other than F32, a decoder pair outside MOE_ONE_PAIRS);
    nq: its NQ instance."""
    if router_type != T.F32 or gate.ggml_type not in QUANT or down.ggml_type not in QUANT:
        return None
    pair = (QUANT[gate.ggml_type].decoder, QUANT[down.ggml_type].decoder)
    return moe_one_name(*pair, nq) if pair in MOE_ONE_PAIRS else None


def owned_groups(n_embd: int, grid: int) -> int:
    """The most 32-output groups of n_embd outputs one block of the NQ instance owns on `grid`
    blocks (grid / 2 clusters of two, whose groups alternate between the two blocks)."""
    return -(-(-(-(n_embd // 32) // (grid // 2))) // 2)


def shared_bytes(n_embd: int, n_ff: int, k: int, n_expert: int, own: int = 0) -> int:
    """moe_one's dynamic shared memory: the larger of the q8 x of gate/up and the k q8 rows of
    down's x, then the softmax's probabilities and the logits (n_expert floats each), then the
    outputs of the `own` groups a block of the NQ instance owns (32 floats each)."""
    return max(q8x_bytes(n_embd), k * q8x_bytes(n_ff)) + 8 * n_expert + 128 * own


@dataclass(frozen=True)
class NormOut:
    """The NQ handoff moe_one writes for the next RMSNorm's products: weight (n_embd,) f32, that
    norm's; q8 the Q8Vector (data, swizzle) of its readers' x; parts (at least n_embd / 32,) f32,
    each 32-output group's sum of y^2."""

    weight: object
    q8: Q8Vector
    parts: object

    def vector(self, eps: float) -> Q8Vector:
        """The handoff as its readers take it (forward.py Forward.nq): q8 with the parts of its
        n / 32 groups and the norm's eps."""
        return Q8Vector(self.q8.data, self.q8.n, self.q8.swizzle, self.parts, self.q8.n // 32, eps)


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


def nq_blocks(o, m, k: int) -> int:
    """The parts (32-output groups) of the NQ handoff moe_one writes for layer m (its MoeWeights; k
    experts a token),
    or 0 where it cannot write one: no NQ instance for its types, n_embd not a multiple of 32, an
    odd grid, more than NQ_OWN groups a block, or not every cluster of two resident at once
    (launch.clusters_fit)."""
    from .launch import allow_shared, clusters_fit, device_limits

    name = kernel_name(m.router.ggml_type, m.gate, m.down, nq=True)
    n_expert, n_ff, n_embd = m.gate.shape
    grid = device_limits()[0]
    if name is None or n_embd % 32 or grid % 2 or owned_groups(n_embd, grid) > NQ_OWN:
        return 0
    kernel = o.function("moe_one.cu", name)
    smem = shared_bytes(n_embd, n_ff, k, n_expert, owned_groups(n_embd, grid))
    allow_shared(kernel, smem)
    warps = MOE_Q8_GLU_VARIANTS[QUANT[m.gate.ggml_type].decoder][0]
    return n_embd // 32 if clusters_fit(kernel, grid, 32 * warps, smem, 2) else 0


def launch(o, m, x, norm_w, eps: float, h, handoff: Handoff, y, k: int, renorm: bool, nq: NormOut | None = None) -> bool:
    """Enqueue one token's feed-forward on ops.Ops o's stream: y (n_embd,) f32 = x + the experts'
    weighted sum for rmsnorm(x) * norm_w (y may be x). m: the layer's MoeWeights (router F32
    (1, n_expert, n_embd), gate/up/down Experts); h (k, n_ff) f32 receives the SwiGLU rows.
    nq: also write that NQ handoff of y (moe_one.cu NQ; only where nq_blocks is not 0).
    Returns False, enqueueing nothing, where no instance covers the layer or one block per
    multiprocessor does not fit. Raises ValueError for handoff buffers of other sizes or types,
    or an nq where nq_blocks is 0."""
    from .launch import allow_shared, blocks_per_sm, device_limits

    name = kernel_name(m.router.ggml_type, m.gate, m.down, nq is not None)
    if name is None:
        return False
    n_expert, n_ff, n_embd = m.gate.shape
    if nq is not None and (not nq_blocks(o, m, k) or nq.q8.n != n_embd or nq.parts.size < n_embd // 32):
        raise ValueError(f"moe_one cannot hand over this layer's output ({n_embd} values, a handoff of {nq.q8.n}, "
                         f"{nq.parts.size} parts); ask nq_blocks first")
    warps = MOE_Q8_GLU_VARIANTS[QUANT[m.gate.ggml_type].decoder][0]
    ho = handoff
    if ((ho.words.dtype, ho.arrived.dtype, ho.count.dtype) != (np.uint64, np.uint64, np.uint64) or ho.words.size < n_expert
            or ho.arrived.size < 1 or h.shape != (k, n_ff) or h.dtype != np.float32):
        raise ValueError(f"moe_one hands over {n_expert} uint64 words, a uint64 arrival count, a uint64 count and h "
                         f"({k}, {n_ff}) f32; got {ho.words.size} {ho.words.dtype}, {ho.arrived.size} {ho.arrived.dtype}, "
                         f"{ho.count.dtype}, h {h.shape} {h.dtype}")
    grid = device_limits()[0]
    smem = shared_bytes(n_embd, n_ff, k, n_expert, owned_groups(n_embd, grid) if nq is not None else 0)
    kernel = o.function("moe_one.cu", name)
    allow_shared(kernel, smem)
    if blocks_per_sm(kernel, 32 * warps, smem) < 1:
        return False
    args = (m.router.data, m.gate.data, m.up.data, np.int64(m.gate.expert_bytes), m.down.data, np.int64(m.down.expert_bytes),
            x, norm_w, np.float32(eps), ho.words, ho.arrived, h, ho.count, y, np.int32(n_expert), np.int32(k), np.int32(renorm),
            np.int32(n_embd), np.int32(n_ff))
    if nq is None:
        args += (np.uint64(0), np.uint64(0), np.int32(0), np.uint64(0))
    else:
        args += (nq.weight, nq.q8.data, np.int32(nq.q8.swizzle), nq.parts)
    o._launch("moe_one.cu", name, (grid,), (32 * warps,), args, shared_mem=smem, cluster=2 if nq is not None else 1)
    return True


def norm_out(fwd, m, k: int, nq) -> NormOut | None:
    """The NormOut a one-token moe_one launch of layer m (its MoeWeights, k experts a token) writes
    for nq = (the next RMSNorm's weights, the weight whose swizzle its readers take: forward.py
    Forward.readers), in the forward pass fwd's buffers (act.nq8, act.nq_parts), or None: flags
    K4_MOE_NQ, K4_NORM_Q8 or K4_FUSE_NORM off, no reader, or nq_blocks 0."""
    opts = fwd.opts
    if nq is None or nq[1] is None or not (opts.moe_nq and opts.norm_q8 and opts.fuse_norm) or not nq_blocks(fwd.ops, m, k):
        return None
    return NormOut(nq[0], Q8Vector.for_weight(nq[1], fwd.act.nq8), fwd.act.nq_parts)
