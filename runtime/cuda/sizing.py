"""What the CUDA backend allocates, sized before anything is: its options from the flags, the
size plan CudaBackend checks and allocates from (SizePlan), and how long a context fits on the
GPU (the answer `-c 0` needs).

The sizes are the ones CudaBackend checks with memory.check_fits before it uploads (weights as
in the file, the buffer specs of runtime/cuda/buffers.py, the cuBLAS workspace, the reserve),
with the buffers sized for the training context: every buffer but the KV cache grows at most
with the context (the token ids) or not at all, so what fits at the training context's buffers
fits at any shorter one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..flags import Flags
from ..kv_types import F16, KVTypes
from .. import swa_ring
from ..model import ModelFile
from ..trace import Trace
from . import blas, device_weight, layout, memory, ops
from .buffers import activation_spec, matmul_scratch_bytes, sampler_spec, spec_bytes
from .kv_cache import KVCache
from .op_switches import OpSwitches
from .forward import ForwardOptions
from .weights import WeightOptions, matrix_plan, weight_bytes


PREFILL_CHUNK = 512  # tokens per prefill batch (rows of the activation buffers)


def options(flags: Flags) -> tuple:
    """(WeightOptions, ForwardOptions, OpSwitches) of a Flags value."""
    on = flags.on
    pdl = on("K4_PDL")
    mat = device_weight.WeightOptions(tensor_cores=on("K4_PREFILL_TC"), pdl=pdl, evict_first=on("K4_EVICT_FIRST"),
                                      mma8=on("K4_MMA8"), mma8_cluster=on("K4_MMA8_CLUSTER"))
    w = WeightOptions(repack=on("K4_REPACK"), stack=on("K4_STACK"), glu=on("K4_FUSE_SWIGLU"), pinned=on("K4_PINNED_UPLOAD"),
                      planar_experts=on("K4_PLANAR_EXPERTS"), matrix=mat)
    f = ForwardOptions(fuse_norm=on("K4_FUSE_NORM"), fuse_rope=on("K4_FUSE_ROPE"), fuse_moe=on("K4_FUSE_MOE"),
                       moe_one=on("K4_MOE_ONE"), qkv_q8=on("K4_QKV_Q8"), qkv_pair=on("K4_QKV_PAIR"),
                       x_cluster=on("K4_X_CLUSTER"), norm_q8=on("K4_NORM_Q8"),
                       mma8_nq=on("K4_MMA8_NQ"), mma8_ffq8=on("K4_MMA8_FFQ8"), wo_wide=on("K4_WO_WIDE"),
                       head_argmax=on("K4_HEAD_ARGMAX"),
                       qkv_wide=on("K4_QKV_WIDE"))
    o = OpSwitches.from_flags(flags)
    return w, f, o


@dataclass(frozen=True)
class SizePlan:
    """What CudaBackend allocates for a context of n_ctx tokens, besides the KV cache: the weights'
    bytes (as in the file; vectors f32), the activation spec, the decode attention configurations
    (limit, n_split, split_len) per range of context lengths (Ops.decode_splits: a decode graph
    per range, eager steps take the last), all buffers' bytes (activations, sampler, cuBLAS
    workspace), and per range the sliding layers' configuration (swa_splits)."""

    chunk: int
    splits: list
    act_spec: dict
    weights: int
    buffers: int
    swa_splits: dict  # range limit -> (n_split, split_len) of the sliding layers (splits counted from the window's start)


def size_plan(mf: ModelFile, n_ctx: int, flags: Flags, o: ops.Ops) -> SizePlan:
    """The SizePlan of model `mf` at n_ctx tokens with switches `flags`; o: the Ops the backend
    launches with (its decode attention's occupancy sizes the splits)."""
    cfg = mf.config
    w_opts = options(flags)[0]
    chunk = min(n_ctx, PREFILL_CHUNK)
    split = flags.on("K4_SPLIT_ATTN")
    splits = o.decode_splits(n_ctx, split, cfg.head_dim, cfg.n_head, cfg.n_head_kv)
    swa = o.decode_splits(n_ctx, split, cfg.head_dim, cfg.n_head, cfg.n_head_kv, cfg.n_swa) if cfg.n_swa else splits
    n_split = max(n for _, n, _ in splits + swa)  # the most splits of any range: the partials buffer
    specs = [layout.combined(tensors, tensors[0].name, glu) for _, tensors, glu in matrix_plan(mf, cfg, w_opts)]
    act = activation_spec(cfg, chunk, n_ctx, n_split, matmul_scratch_bytes(specs, chunk, w_opts.matrix),
                          flags.on("K4_FUSE_QUANT"))
    workspace = blas.WORKSPACE_BYTES if flags.on("K4_PREFILL_GRAPH") else 0
    return SizePlan(chunk, splits, act, weight_bytes(mf, cfg), spec_bytes(act) + spec_bytes(sampler_spec(cfg)) + workspace,
                    {limit: (n, length) for limit, n, length in swa})


def fixed_bytes(mf: ModelFile, flags: Flags, kv_types: KVTypes = F16) -> int:
    """Device bytes the backend needs besides the KV cache (weights, buffers, cuBLAS workspace,
    memory.RESERVED_BYTES), with buffers for a context of the training length (the decode
    attention of kv_types sizes the split partials)."""
    plan = size_plan(mf, mf.config.n_ctx_train, flags, ops.Ops(Trace(), kv_types, options(flags)[2]))
    return plan.weights + plan.buffers + memory.RESERVED_BYTES


def max_context(mf: ModelFile, flags: Flags | None = None, free: int | None = None,
                kv_types: KVTypes = F16) -> tuple[int, int, int, int]:
    """(largest n_ctx in tokens whose KV cache of kv_types fits, bytes free for the cache, KV
    bytes per token past the sliding layers' rings, the cache's bytes at the training context)
    on this GPU, free: device bytes available (default memory.free_bytes()). The first is 0 when
    not even the weights and buffers fit. A q8_0 cache takes 34/32 bytes a value against f16's 2
    (runtime/cuda/kv_cache.py), so about 1.9 times the context fits; a sliding layer's ring
    (K4_SWA_RING, runtime/swa_ring.py) stops growing at its window plus one prefill chunk."""
    flags = flags if flags is not None else Flags()
    cfg, ring = mf.config, flags.on("K4_SWA_RING")
    left = (memory.free_bytes() if free is None else free) - fixed_bytes(mf, flags, kv_types)
    n_ctx = swa_ring.max_context(cfg, left, kv_types, PREFILL_CHUNK, ring)
    rings = swa_ring.layer_rings(cfg, cfg.n_ctx_train, PREFILL_CHUNK, ring)
    per_token = kv_types.bytes_per_token(sum(1 for r in rings if not r), cfg.n_head_kv * cfg.head_dim)
    need = KVCache.nbytes(cfg, cfg.n_ctx_train, kv_types, min(cfg.n_ctx_train, PREFILL_CHUNK), ring)
    return n_ctx, max(0, left), per_token, need
