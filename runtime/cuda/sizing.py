"""How long a context fits on the GPU: the answer `-c 0` needs before anything is allocated.

The sizes are the ones CudaBackend checks with memory.check_fits before it uploads (weights as
in the file, the buffer specs of runtime/cuda/buffers.py, the cuBLAS workspace, the reserve),
with the buffers sized for the training context: every buffer but the KV cache grows at most
with the context (the token ids) or not at all, so what fits at the training context's buffers
fits at any shorter one.
"""

from __future__ import annotations

from ..flags import Flags
from ..model import ModelFile
from ..trace import Trace
from . import blas, layout, memory, ops
from .backend import PREFILL_CHUNK, options
from .buffers import KVCache, activation_spec, matmul_scratch_bytes, sampler_spec, spec_bytes
from .weights import matrix_plan, weight_bytes


def fixed_bytes(mf: ModelFile, flags: Flags) -> int:
    """Device bytes the backend needs besides the KV cache (weights, buffers, cuBLAS workspace,
    memory.RESERVED_BYTES), with buffers for a context of the training length."""
    cfg = mf.config
    w_opts, _, o_opts = options(flags)
    n_ctx = cfg.n_ctx_train
    chunk = min(n_ctx, PREFILL_CHUNK)
    capacity = ops.Ops(Trace(), **o_opts).attention_capacity(cfg.head_dim) // cfg.n_head
    n_split = max(n for _, n, _ in ops.split_buckets(n_ctx, flags.on("K4_SPLIT_ATTN"), capacity))
    specs = [layout.combined(tensors, tensors[0].name, glu) for _, tensors, glu in matrix_plan(mf, cfg, w_opts)]
    act = activation_spec(cfg, chunk, n_ctx, n_split, matmul_scratch_bytes(specs, chunk, w_opts.matrix.tensor_cores),
                          flags.on("K4_FUSE_QUANT"))
    workspace = blas.WORKSPACE_BYTES if flags.on("K4_PREFILL_GRAPH") else 0
    return weight_bytes(mf, cfg) + spec_bytes(act) + spec_bytes(sampler_spec(cfg)) + workspace + memory.RESERVED_BYTES


def max_context(mf: ModelFile, flags: Flags | None = None, free: int | None = None) -> tuple[int, int, int]:
    """(largest n_ctx in tokens whose fp16 KV cache fits, bytes free for the cache, KV bytes per
    token) on this GPU, free: device bytes available (default memory.free_bytes()). The first is
    0 when not even the weights and buffers fit."""
    flags = flags if flags is not None else Flags()
    left = (memory.free_bytes() if free is None else free) - fixed_bytes(mf, flags)
    per_token = KVCache.nbytes(mf.config, 1)
    return max(0, left // per_token), max(0, left), per_token
