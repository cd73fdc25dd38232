"""Launchers of k4's non-matmul kernels (kernels_cu/norm.cu, rope.cu, attention.cu,
attention_tiled.cu, attention_mma.cu, elementwise.cu, sampling.cu): each checks shapes and
dtypes on the host, picks the grid, and launches on the current CuPy stream through
runtime.cuda.launch, counted in the trace.

Arrays are CuPy arrays, C-contiguous unless a method says otherwise; shapes are given per
method. The kernels trust their inputs: everything they index is validated here.

Inside a CUDA graph capture, with `pdl` set (flag K4_PDL), the kernels that begin with
griddepcontrol.wait (all but set_i32) launch with programmatic dependent launch
(runtime/cuda/launch.py), so each one's launch overlaps the tail of the kernel before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cupy as cp
import numpy as np

from ..kv_types import F16, KVTypes
from ..sampling import MASK64, SamplingParams
from ..trace import Trace
from .compile import module
from .constants import (ATT_THREADS, MMA_BQ, MMA_THREADS, SAMPLE_THREADS, SAMPLER_PARAM_WORDS, STATE_WORDS, TILE_Q,
                        TILE_THREADS, att_smem, tiled_smem)
from .constants import ST_DRAW, ST_POS, ST_RING, ST_TOK  # noqa: F401 (ops.ST_*: the decode state's words)
from .constants import mma_smem as _mma_smem
from .kv_cache import NO_SCALES, cache_types, planes as _planes
from .kernel_names import FILE_OF, GROUP_OF, KERNELS, MMA_TILE_KEYS, TILED_HEAD_DIMS, kv_args
from .launch import blocks_per_sm, device_limits, launch

NULL = np.uint64(0)  # a null device pointer argument

# Launch parameters of the host only; what the kernels share is in constants.py.
ATT_SPLIT_KEYS = 32  # decode attention splits are multiples of this many keys (one round of the kernel)
MAX_HEAD_DIM = 8 * ATT_THREADS
ROPE_WARPS = 4  # rows per block of rope_qk_store (the kernel takes its warp count from blockDim)
FNV_PRIME = 0x100000001B3  # the seed multiplier of runtime/sampling.py uniform()


OUT_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "u16"}  # output dtype -> kernel template argument
GLU_KERNELS = {"silu": "swiglu", "gelu_tanh": "geglu"}  # ModelConfig.activation -> elementwise.cu kernel


def _f32(a: cp.ndarray, *shape: int) -> None:
    assert a.dtype == cp.float32 and a.flags.c_contiguous, (a.dtype, a.flags.c_contiguous)
    assert a.shape == shape, (a.shape, shape)


def _out(a: cp.ndarray, *shape: int) -> str:
    """Check a contiguous f32 or fp16 output of `shape`; its kernel template argument."""
    assert a.dtype in OUT_TYPES and a.flags.c_contiguous and a.shape == shape, (a.dtype, a.shape, shape)
    return OUT_TYPES[a.dtype]


def _row_stride(a: cp.ndarray, n_tok: int, width: int) -> int:
    """Floats between token rows of `a`: f32, either contiguous with n_tok rows of `width` values
    (any shape (n_tok, ...)), or a 2-D (n_tok, width) view whose rows are contiguous (a column
    slice of a wider product output)."""
    assert a.dtype == cp.float32 and a.shape[0] == n_tok, (a.dtype, a.shape, n_tok)
    if a.flags.c_contiguous:
        assert a.size == n_tok * width, (a.shape, width)
        return width
    assert a.ndim == 2 and a.shape[1] == width and a.strides[1] == 4 and a.strides[0] % 4 == 0, (a.shape, a.strides)
    return a.strides[0] // 4


def mma_smem(D: int) -> int:
    """Dynamic shared memory (bytes) of the attn_mma instance for head_dim D (constants.mma_smem
    with the instance's keys per tile, kernel_names.MMA_TILE_KEYS)."""
    return _mma_smem(D, MMA_TILE_KEYS[D])


def attention_split(n_ctx: int, split: bool, max_split: int = 64) -> tuple[int, int]:
    """(n_split, split_len) for decode attention over a cache of n_ctx positions: at most
    max_split splits (64 at most), each a multiple of ATT_SPLIT_KEYS keys; (1, n_ctx) when split
    is off. Splits past the current position exit at once. Measured on the H200 (32 heads of
    128, one query): the best split is about the shortest whose blocks all fit on the GPU at
    once (max_split = resident blocks / n_head, Ops.attention_capacity): 1,100 keys 11.9 µs
    (18 x 64) against 16.3 (35 x 32); 4,160 keys 26.8 (26 x 160) against 30.9 (44 x 96); 16,448
    keys 73.7 (28 x 608) against 77.9 (58 x 288) and 104.4 (31 x 544, 992 blocks: two rounds)."""
    if not split:
        return 1, n_ctx
    max_split = max(1, min(64, max_split))
    split_len = -(-math.ceil(n_ctx / max_split) // ATT_SPLIT_KEYS) * ATT_SPLIT_KEYS
    return -(-n_ctx // split_len), split_len


def attention_lanes(n_head: int, n_head_kv: int) -> int:
    """Lanes of attn_kv that dot one key with the query (its `lanes` argument): 8, or 4 for a
    grouped-query model, whose query heads share their keys through L2 and so wait less on
    memory than on the shuffles that sum a score (log2 lanes per key). Measured on the H200
    (head_dim 128, tg32, GPU ms per token), 16 / 8 / 4 / 2 lanes: Llama 2 7B at depth 16,384
    3.789 / 3.717 / 4.061 / 4.196; Llama 3 8B (4 query heads per KV head) at 32,768
    5.030 / 4.595 / 4.435 / 5.068."""
    return 4 if n_head > n_head_kv else 8


def split_buckets(n_ctx: int, split: bool, max_split: int = 64) -> list[tuple[int, int, int]]:
    """The decode attention configurations of a cache of n_ctx positions, one per range of
    context lengths: [(limit, n_split, split_len)], limits ascending (512, 768, 1024, 1536, ...,
    then n_ctx), each attention_split(limit, split, max_split) and valid while the keys attended
    (position + 1) are at most its limit. A step then launches the splits its length needs, of
    a length suited to it, whatever n_ctx is. One entry when split is off."""
    limits = []
    limit = 512
    while split and limit < n_ctx:
        limits.append(limit)
        limit = limit * 3 // 2 if limit & (limit - 1) == 0 else limit * 4 // 3  # 512, 768, 1024, 1536, ...
    return [(L, *attention_split(L, split, max_split)) for L in (*limits, n_ctx)]


def argmax_parts(n_vocab: int) -> int:
    """Blocks of sample_argmax_partial for a vocabulary of n_vocab: one per 2048 logits, at most 1024."""
    return min(SAMPLE_THREADS, -(-n_vocab // 2048))


def pack_sampler_params(p: SamplingParams) -> np.ndarray:
    """SamplingParams -> the 64-byte sampling.cu SamplerParams as (8,) uint64 words."""
    words = np.zeros(SAMPLER_PARAM_WORDS, dtype=np.uint64)  # (8,)
    words[:4].view(np.float64)[:] = (p.temperature, p.top_p, p.min_p, p.repeat_penalty)
    words[4:6].view(np.int64)[:] = (p.top_k, p.repeat_last_n)
    words[6] = (p.seed * FNV_PRIME) & MASK64
    return words


@dataclass(frozen=True)
class RopeArgs:
    """RoPE of one layer as rope_qk_store and fused attention apply it: optional per-head
    RMSNorm of q and k first (qwen3; (D,) f32 weights or None), then rotation of the first
    rope_dim dims of each head by pos * inv_freq ((rope_dim/2,) f64), NeoX halves or
    interleaved pairs; eps of the norm; mscale: the factor on the rotated pairs' cos and sin
    (runtime/rope.py RopeTable.mscale: YaRN / LongRoPE magnitude, 1.0 otherwise)."""

    q_norm: cp.ndarray | None
    k_norm: cp.ndarray | None
    inv_freq: cp.ndarray
    rope_dim: int
    neox: bool
    eps: float
    mscale: float = 1.0

    def check(self, D: int) -> None:
        assert self.inv_freq.dtype == cp.float64 and self.inv_freq.shape == (self.rope_dim // 2,)
        assert self.rope_dim % 2 == 0 and self.rope_dim <= D
        for w in (self.q_norm, self.k_norm):
            if w is not None:
                _f32(w, D)

    def kernel_args(self) -> tuple:
        return (NULL if self.q_norm is None else self.q_norm, NULL if self.k_norm is None else self.k_norm, self.inv_freq)


@dataclass(frozen=True)
class AttnShape:
    """What a layer's attention computes beyond plain causal softmax (Gemma): scale of q.k (None:
    1/sqrt(head_dim)); window > 0: the query at position p sees keys p - window + 1 .. p only
    (a sliding layer); softcap > 0: scores -> softcap * tanh(score / softcap) (Gemma 2). The
    default is the llama families' attention, with the same kernels and arguments' effect."""

    scale: float | None = None
    window: int = 0
    softcap: float = 0.0

    def kernel_args(self, D: int) -> tuple:
        assert self.window >= 0 and self.softcap >= 0
        scale = 1.0 / math.sqrt(D) if self.scale is None else self.scale
        return np.float32(scale), np.int32(self.window), np.float32(self.softcap)


PLAIN = AttnShape()


@dataclass(frozen=True)
class FreshKV:
    """For one decode query: the token's unrotated products, q (1, n_head * D), k and v
    (1, n_head_kv * D) f32 views, that the attention kernel rotates (rope) and stores itself."""

    q: cp.ndarray
    k: cp.ndarray
    v: cp.ndarray
    rope: RopeArgs


class Ops:
    """The kernel launchers. `trace` receives one launch per kernel; the backend swaps it for a
    scratch Trace while it captures a CUDA graph (runtime/cuda/runner.py). `pdl`: launch with
    programmatic dependent launch while a graph is being captured (module docstring, K4_PDL).
    Prefill attention: attn_mma with `mma` (K4_MMA_ATTN), else attn_tiled with `tiled`
    (K4_TILED_ATTN), where head_dim has an instance (attention_kernel). `evict_first`: decode
    attention reads the KV cache with the L1 evict-first hint (K4_EVICT_FIRST). `kv`: the model's
    KV cache types (-ctk, -ctv), whose kernel instances kernels_for lists; the launchers take
    the types of the planes they are given (cache_types)."""

    def __init__(self, trace: Trace, pdl: bool = False, tiled: bool = True, mma: bool = True, evict_first: bool = True,
                 kv: KVTypes = F16):
        self.trace = trace
        self.pdl, self.tiled, self.mma, self.evict_first, self.kv = pdl, tiled, mma, evict_first, kv
        self._functions: dict[tuple[str, str], object] = {}

    def function(self, filename: str, name: str):
        key = (filename, name)
        if key not in self._functions:
            self._functions[key] = module(filename, GROUP_OF[key], self._defines()).get_function(name)
        return self._functions[key]

    def _defines(self) -> tuple[str, ...]:
        return () if self.evict_first else ("K4_EVICT_FIRST=0",)

    def kernels_for(self, head_dim: int) -> list[tuple[str, str]]:
        """(file, kernel) of every kernel a model of head_dim launches: the small files' kernels,
        the RoPE + cache store, decode attention and the prefill attention kernel that
        attention() picks for head_dim, of the cache types self.kv only."""
        # moe: moe.compile_jobs; speculative.cu: on the first verify step (runtime/cuda/speculative.py)
        out = [(f, n) for f, names in KERNELS.items() if not f.startswith(("attention", "moe", "rope", "speculative")) for n in names]
        out += [("rope.cu", f"rope_qk_store<{kv_args(self.kv.k, self.kv.v)}>"), ("attention.cu", self.attention_kernel(1, head_dim)),
                (FILE_OF[self.attention_kernel(2, head_dim)], self.attention_kernel(2, head_dim))]
        return list(dict.fromkeys(out))

    def compile_jobs(self, head_dim: int) -> list:
        """compile.module() arguments of the modules kernels_for(head_dim) live in (for
        compile.compile_async at load)."""
        return list(dict.fromkeys((f, GROUP_OF[(f, n)], self._defines()) for f, n in self.kernels_for(head_dim)))

    def attention_capacity(self, head_dim: int) -> int:
        """Blocks of the decode attention kernel (attn_kv of the cache types self.kv) resident on
        the GPU at once for head_dim: what one round of split decode attention can run
        (attention_split max_split = this / n_head)."""
        kernel = self.function("attention.cu", self.attention_kernel(1, head_dim))
        return device_limits()[0] * blocks_per_sm(kernel, ATT_THREADS, att_smem(head_dim))

    def compile_all(self, head_dim: int) -> None:
        """Compile and load every kernel a model of head_dim launches, now (compilation cannot
        happen inside graph capture)."""
        for filename, name in self.kernels_for(head_dim):
            self.function(filename, name)

    def _launch(self, filename: str, name: str, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0,
                pdl: bool = True) -> None:
        pdl = pdl and self.pdl and cp.cuda.get_current_stream().is_capturing()
        launch(self.function(filename, name), grid, block, args, shared_mem, None, self.trace, pdl)

    def rms_norm(self, x: cp.ndarray, w: cp.ndarray, y: cp.ndarray, eps: float) -> None:
        """y = x / sqrt(mean(x^2, last axis) + eps) * w. x: (n_rows, n) f32; y: (n_rows, n) f32
        (may be x) or fp16 (a tensor-core input); w: (n,) f32."""
        n_rows, n = x.shape
        _f32(x, n_rows, n)
        out = _out(y, n_rows, n)
        _f32(w, n)
        threads = 32 * min(32, max(1, -(-n // 256)))
        self._launch("norm.cu", f"rms_norm<{out}>", (n_rows,), (threads,), (x, w, y, np.int32(n), np.float32(eps)))

    def rope_qk_store(self, q: cp.ndarray, k: cp.ndarray, v: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray,
                      rope: RopeArgs, pos: cp.ndarray, q_out: cp.ndarray | None = None, scales: tuple = NO_SCALES) -> None:
        """RoPE on q and k (rope: optional per-head RMSNorm first), k and v stored in the cache.

        q_out: (n_tok, n_head, D) f32, receives q normalized and rotated; None: q itself (then
        contiguous). q: (n_tok, n_head, D) f32, or a 2-D (n_tok, n_head * D) view with contiguous
        rows (columns of a stacked q|k|v product); k, v: likewise (n_tok, n_head_kv, D) or
        (n_tok, n_head_kv * D). k_cache, v_cache: (n_ctx, n_head_kv, D) fp16, or int8 quants of
        a q8_0 plane with its scales in `scales` (cache_types; one layer); pos: (1,) int32 device
        scalar, the position of token 0. The caller guarantees pos + n_tok <= n_ctx (the kernel
        writes cache rows pos .. pos + n_tok - 1). A q8_0 plane gets llama.cpp's quantization of
        each head row (kernels_cu/kv_cache.cuh; the same bits as runtime/kv_types.py).
        """
        q_out = q if q_out is None else q_out
        n_tok, n_head, D = q_out.shape
        _f32(q_out, n_tok, n_head, D)
        n_head_kv = k_cache.shape[1]
        ld_q = _row_stride(q, n_tok, n_head * D)
        ld_k = _row_stride(k, n_tok, n_head_kv * D)
        ld_v = _row_stride(v, n_tok, n_head_kv * D)
        types = cache_types(k_cache, v_cache, scales)
        assert k_cache.shape[1:] == (n_head_kv, D)
        assert pos.dtype == cp.int32 and pos.size == 1
        rope.check(D)
        rows = n_tok * (n_head + n_head_kv)
        smem = 4 * D * ROPE_WARPS if types.k == "q8_0" else 0  # the rotated keys in f32, one row per warp
        self._launch("rope.cu", f"rope_qk_store<{kv_args(types.k, types.v)}>", (-(-rows // ROPE_WARPS),), (32 * ROPE_WARPS,),
                     (q, np.int32(ld_q), k, np.int32(ld_k), v, np.int32(ld_v), q_out, *_planes(k_cache, v_cache, scales),
                      *rope.kernel_args(), pos, np.int32(n_tok), np.int32(n_head), np.int32(n_head_kv), np.int32(D),
                      np.int32(rope.rope_dim), np.int32(rope.neox), np.float32(rope.eps), np.float32(rope.mscale)),
                     shared_mem=smem)

    def attention_kernel(self, n_tok: int, D: int, kv: KVTypes | None = None) -> str:
        """The attention kernel for n_tok queries of head_dim D over a cache of types kv (default
        self.kv) (the selector): several queries run attn_mma (tensor cores) with `mma`, else
        attn_tiled with `tiled`, where D has an instance; one query, or a D without one, runs
        attn_kv."""
        kv = kv or self.kv
        types = kv_args(kv.k, kv.v)
        if n_tok > 1 and self.mma and D in MMA_TILE_KEYS:
            return f"attn_mma<{D}, {MMA_TILE_KEYS[D]}, {types}>"
        if n_tok > 1 and self.tiled and D in TILED_HEAD_DIMS:
            return f"attn_tiled<{D}, {types}>"
        return f"attn_kv<{types}>"

    def attention(self, q: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray, out: cp.ndarray, pos: cp.ndarray,
                  n_split: int = 1, split_len: int = 0, part: cp.ndarray | None = None,
                  ticket: cp.ndarray | None = None, fresh: FreshKV | None = None, shape: AttnShape = PLAIN,
                  scales: tuple = NO_SCALES) -> None:
        """Causal attention of q over the cache; query t sits at position pos + t.

        q, out: (n_tok, n_head, D) f32; k_cache, v_cache: (n_ctx, n_head_kv, D) fp16, or int8
        quants of a q8_0 plane with its scales in `scales` (cache_types; one layer); pos: (1,)
        int32 device scalar. The kernel is attention_kernel's choice. For attn_kv,
        n_split > 1 splits each query's keys into blocks of split_len (n_split * split_len >=
        n_ctx) whose partials go to part: (n_tok, n_head, n_split, D + 2) f32, merged by the
        last block of each head to finish, counted in ticket: (n_tok * n_head,) int32, zeros
        (and left so); the tensor-core and tiled kernels take n_split = 1. attn_mma rounds Q and
        P to fp16 (f32 accumulation).

        fresh: None, or for one query (decode) the RoPE and cache store of rope_qk_store done
        inside the kernel (FreshKV); q is then not read, and the token's k and v are written to
        cache row pos. shape: the query scale, sliding window and score soft-cap (AttnShape).
        """
        n_tok, n_head, D = q.shape
        n_ctx, n_head_kv, _ = k_cache.shape
        _f32(q, n_tok, n_head, D)
        _f32(out, n_tok, n_head, D)
        types = cache_types(k_cache, v_cache, scales)
        assert k_cache.shape == (n_ctx, n_head_kv, D)
        assert D % 8 == 0 and D <= MAX_HEAD_DIM and n_head % n_head_kv == 0
        assert pos.dtype == cp.int32 and pos.size == 1
        name = self.attention_kernel(n_tok, D, types)
        planes = _planes(k_cache, v_cache, scales)
        if not name.startswith("attn_kv"):
            assert n_split == 1 and fresh is None
            self._attention_tiles(name, q, planes, out, pos, shape)
        else:
            self._attention_rows(name, q, planes, out, pos, n_split, split_len, part, ticket, fresh, shape)

    def _attention_tiles(self, name: str, q, planes: tuple, out, pos, shape: AttnShape) -> None:
        """Launch attn_mma or attn_tiled (planes: k, k_d, v, v_d): several queries per block,
        keys staged in shared memory."""
        n_tok, n_head, D = q.shape
        n_head_kv = planes[0].shape[1]
        mma = name.startswith("attn_mma")
        smem = mma_smem(D) if mma else tiled_smem(D)
        kernel = self.function(FILE_OF[name], name)
        if kernel.max_dynamic_shared_size_bytes < smem:
            kernel.max_dynamic_shared_size_bytes = smem
        rows, threads = (MMA_BQ, MMA_THREADS) if mma else (TILE_Q, TILE_THREADS)
        self._launch(FILE_OF[name], name, (n_head, -(-n_tok // rows)), (threads,),
                     (q, *planes, out, pos, np.int32(n_tok), np.int32(n_head), np.int32(n_head_kv),
                      *shape.kernel_args(D)), shared_mem=smem)

    def _attention_rows(self, name: str, q, planes: tuple, out, pos, n_split: int, split_len: int, part, ticket,
                        fresh: FreshKV | None, shape: AttnShape) -> None:
        """Launch attn_kv (planes: k, k_d, v, v_d): one block per (head, query, split),
        optionally with RoPE and the cache store of the token fused in (fresh)."""
        n_tok, n_head, D = q.shape
        n_ctx, n_head_kv, _ = planes[0].shape
        if n_split == 1:
            split_len = n_ctx
        else:
            assert split_len > 0 and n_split * split_len >= n_ctx
            assert part is not None and ticket is not None
            _f32(part, n_tok, n_head, n_split, D + 2)
            assert ticket.dtype == cp.int32 and ticket.size == n_tok * n_head and ticket.flags.c_contiguous
        rope = (NULL,) * 10 + (np.int32(0), np.int32(0), np.float32(0), np.float32(1))
        if fresh is not None:
            assert n_tok == 1
            _row_stride(fresh.q, 1, n_head * D)
            _row_stride(fresh.k, 1, n_head_kv * D)
            _row_stride(fresh.v, 1, n_head_kv * D)
            r = fresh.rope
            r.check(D)
            rope = (fresh.q, fresh.k, fresh.v, *planes, *r.kernel_args(), np.int32(r.rope_dim), np.int32(r.neox),
                    np.float32(r.eps), np.float32(r.mscale))
        self._launch("attention.cu", name, (n_head, n_tok, n_split), (ATT_THREADS,),
                     (q, *planes, out, NULL if n_split == 1 else part, NULL if n_split == 1 else ticket, pos,
                      np.int32(n_head), np.int32(n_head_kv), np.int32(D), np.int32(split_len),
                      np.int32(attention_lanes(n_head, n_head_kv)), *shape.kernel_args(D),
                      *rope), shared_mem=att_smem(D))

    def _swiglu(self, gate: cp.ndarray, up: cp.ndarray, out: cp.ndarray, n_tok: int, n_ff: int, ld: int, step: int,
                act: str = "silu") -> None:
        blocks = min(-(-(n_tok * n_ff) // 256), 4096)
        self._launch("elementwise.cu", f"{GLU_KERNELS[act]}<{OUT_TYPES[out.dtype]}>", (blocks,), (256,),
                     (gate, up, out, np.int32(n_tok), np.int32(n_ff), np.int32(ld), np.int32(step)))

    def swiglu(self, gate: cp.ndarray, up: cp.ndarray, out: cp.ndarray, act: str = "silu") -> None:
        """out = act(gate) * up, element-wise: silu (SwiGLU) or, with act "gelu_tanh", the
        tanh-approximated GELU (GeGLU, Gemma). gate, up: (n_tok, n_ff) f32; out: (n_tok, n_ff)
        f32 (may be gate) or fp16."""
        n_tok, n_ff = gate.shape
        _f32(gate, n_tok, n_ff)
        _f32(up, n_tok, n_ff)
        _out(out, n_tok, n_ff)
        self._swiglu(gate, up, out, n_tok, n_ff, n_ff, 1, act)

    def swiglu_rows(self, gu: cp.ndarray, out: cp.ndarray, interleaved: bool, act: str = "silu") -> None:
        """out = act(gate) * up (see swiglu) from one gate/up product gu: (n_tok, 2 n_ff) f32, whose rows hold
        gate | up (stacked weights) or, interleaved, gate_0 up_0 gate_1 up_1 ... (a glu weight,
        layout.combined(glu=True)). out: (n_tok, n_ff) f32 or fp16."""
        n_tok, two_ff = gu.shape
        n_ff = two_ff // 2
        _f32(gu, n_tok, 2 * n_ff)
        _out(out, n_tok, n_ff)
        up = gu.reshape(-1)[1:] if interleaved else gu.reshape(-1)[n_ff:]
        self._swiglu(gu, up, out, n_tok, n_ff, 2 * n_ff, 2 if interleaved else 1, act)

    def rms_norm_add(self, t: cp.ndarray, w: cp.ndarray, res: cp.ndarray, y: cp.ndarray, eps: float) -> None:
        """y = res + t / sqrt(mean(t^2, last axis) + eps) * w (Gemma's post-norm, then the residual
        add). t, res, y: (n_rows, n) f32 (y may be res); w: (n,) f32."""
        n_rows, n = t.shape
        for a in (t, res, y):
            _f32(a, n_rows, n)
        _f32(w, n)
        threads = 32 * min(32, max(1, -(-n // 256)))
        self._launch("norm.cu", "rms_norm_add", (n_rows,), (threads,), (t, w, res, y, np.int32(n), np.float32(eps)))

    def scale(self, x: cp.ndarray, s: float) -> None:
        """x *= s in place (Gemma's embedding scale). x: contiguous f32, any shape."""
        assert x.dtype == cp.float32 and x.flags.c_contiguous
        self._launch("elementwise.cu", "scale_f32", (min(-(-x.size // 256), 4096),), (256,), (x, np.int64(x.size), np.float32(s)))

    def softcap(self, x: cp.ndarray, cap: float) -> None:
        """x = cap * tanh(x / cap) in place (Gemma 2's final logit soft-cap). x: contiguous f32; cap > 0."""
        assert x.dtype == cp.float32 and x.flags.c_contiguous and cap > 0
        self._launch("elementwise.cu", "softcap_f32", (min(-(-x.size // 256), 4096),), (256,), (x, np.int64(x.size), np.float32(cap)))

    def set_i32(self, dst: cp.ndarray, value: int) -> None:
        """dst[0] = value on the stream (the value travels as a kernel argument). dst: (1,) int32."""
        assert dst.dtype == cp.int32 and dst.size == 1
        self._launch("elementwise.cu", "set_i32", (1,), (1,), (dst, np.int32(value)), pdl=False)

    def sample(self, logits: cp.ndarray, params: cp.ndarray, state: cp.ndarray, ring: cp.ndarray, seen: cp.ndarray,
               part_val: cp.ndarray, part_idx: cp.ndarray, advance: bool) -> None:
        """Sample the next token on the device (sampling.cu) and update the decode state.

        logits: (n_vocab,) f32, penalized in place; params: (8,) uint64 from pack_sampler_params;
        state: (4,) int32 [tok, pos, ring_count, draw]; ring: (ring_cap,) int32 token history;
        seen: (n_vocab,) int32 zeros; part_val, part_idx: (argmax_parts(n_vocab),) f32 / int32.
        advance: also increment state[pos] (after a decode step).
        """
        n_vocab = logits.shape[0]
        _f32(logits, n_vocab)
        n_part = argmax_parts(n_vocab)
        assert params.dtype == cp.uint64 and params.shape == (SAMPLER_PARAM_WORDS,)
        assert state.dtype == ring.dtype == seen.dtype == part_idx.dtype == cp.int32
        assert state.shape == (STATE_WORDS,) and seen.shape == (n_vocab,) and ring.ndim == 1
        _f32(part_val, n_part)
        assert part_idx.shape == (n_part,)
        ring_cap = np.int32(ring.shape[0])
        self._launch("sampling.cu", "sample_penalty", (1,), (SAMPLE_THREADS,), (logits, seen, ring, state, ring_cap, params))
        self._launch("sampling.cu", "sample_argmax_partial", (n_part,), (256,), (logits, np.int32(n_vocab), part_val, part_idx))
        self._launch("sampling.cu", "sample_finish", (1,), (SAMPLE_THREADS,),
                     (logits, np.int32(n_vocab), part_val, part_idx, np.int32(n_part), state, ring, ring_cap, params,
                      np.int32(advance)))

