"""Launchers of k4's non-matmul kernels (kernels_cu/norm.cu, rope.cu, elementwise.cu,
sampling.cu, and through AttentionLaunchers (runtime/cuda/attention_launch.py) the attention
kernels): each checks shapes and dtypes on the host, picks the grid, and launches on the current
CuPy stream through runtime.cuda.launch, counted in the trace.

Arrays are CuPy arrays, C-contiguous unless a method says otherwise; shapes are given per
method. The kernels trust their inputs: everything they index is validated here.

Inside a CUDA graph capture, with `sw.pdl` set (flag K4_PDL), the kernels that begin with
griddepcontrol.wait (all but set_i32) launch with programmatic dependent launch
(runtime/cuda/launch.py), so each one's launch overlaps the tail of the kernel before it.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from ..kv_types import F16, KVTypes
from ..sampling import MASK64, SEED_MULTIPLIER, SamplingParams
from ..trace import Trace
from .attention_launch import GQA_MIN_LIMIT, AttentionLaunchers
from .compile import module
from .constants import ARGMAX_PARTS, SAMPLE_THREADS, SAMPLER_PARAM_WORDS, STATE_WORDS, short_keys
from .constants import ST_DRAW, ST_POS, ST_RING, ST_TOK  # noqa: F401 (ops.ST_*: the decode state's words)
from .kernel_names import FILE_OF, GROUP_OF, KERNELS, kv_args
from .kv_cache import NO_SCALES, cache_types, planes as _planes
from .launch import launch
from .op_switches import OpSwitches
from .op_args import OUT_TYPES, RopeArgs, check_f32, check_out, ring_mask, row_stride


# Launch parameters of the host only; what the kernels share is in constants.py.
ROPE_WARPS = 4  # rows per block of rope_qk_store (the kernel takes its warp count from blockDim)


GLU_KERNELS = {"silu": "swiglu", "gelu_tanh": "geglu"}  # ModelConfig.activation -> elementwise.cu kernel


def argmax_parts(n_vocab: int) -> int:
    """Blocks of sample_argmax_partial for a vocabulary of n_vocab: one per 2048 logits, at most 1024."""
    return min(SAMPLE_THREADS, -(-n_vocab // 2048))


def pack_sampler_params(p: SamplingParams) -> np.ndarray:
    """SamplingParams -> the 64-byte sampling.cu SamplerParams as (8,) uint64 words."""
    words = np.zeros(SAMPLER_PARAM_WORDS, dtype=np.uint64)  # (8,)
    words[:4].view(np.float64)[:] = (p.temperature, p.top_p, p.min_p, p.repeat_penalty)
    words[4:6].view(np.int64)[:] = (p.top_k, p.repeat_last_n)
    words[6] = (p.seed * SEED_MULTIPLIER) & MASK64
    return words


RMS_NORM_Q8_MAX = 16 * 1024  # rms_norm with q8: one thread per 16 values, at most 1,024 threads a row

class Ops(AttentionLaunchers):
    """The kernel launchers. `trace` receives one launch per kernel; the backend swaps it for a
    scratch Trace while it captures a CUDA graph (runtime/cuda/runner.py). `kv`: the model's KV
    cache types (-ctk, -ctv), whose kernel instances kernels_for lists; the launchers take the
    types of the planes they are given (cache_types). `sw`: which kernels to launch
    (runtime/cuda/op_switches.py; sw.pdl: programmatic dependent launch while a graph is being
    captured, module docstring)."""

    def __init__(self, trace: Trace, kv: KVTypes = F16, sw: OpSwitches = OpSwitches()):
        self.trace, self.kv, self.sw = trace, kv, sw
        self._n_sm: int | None = None  # multiprocessors of the device, when a launcher first needs them
        self._functions: dict[tuple[str, str], object] = {}

    def function(self, filename: str, name: str):
        """Kernel `name` of kernels_cu/`filename` (a cupy RawKernel), from its compile group's module
        built with the switches' defines; compiled once, then cached. Raises KeyError for a kernel no
        compile group holds."""
        key = (filename, name)
        if key not in self._functions:
            self._functions[key] = module(filename, GROUP_OF[key], self._defines()).get_function(name)
        return self._functions[key]

    def _defines(self) -> tuple[str, ...]:
        return (() if self.sw.evict_first else ("K4_EVICT_FIRST=0",)) + (() if self.sw.planar_experts else ("K4_PLANAR_EXPERTS=0",))

    def kernels_for(self, head_dim: int, group: int = 1) -> list[tuple[str, str]]:
        """(file, kernel) of every kernel a model of head_dim and `group` query heads per KV
        head launches: the small files' kernels, the RoPE + cache store, the decode (for short and
        long ranges: GQA_MIN_LIMIT) and prefill attention kernels that attention() picks for it,
        of the cache types self.kv only."""
        # moe: moe_load.compile_jobs; speculative.cu: on the first verify step (runtime/cuda/speculative.py);
        # megakernel.cu: runtime/cuda/megakernel.py, with K4_MEGAKERNEL
        out = [(f, n) for f, names in KERNELS.items() if not f.startswith(("attention", "moe", "rope", "speculative", "megakernel")) for n in names]
        decode = {self.attention_kernel(1, head_dim, group=group, limit=limit)  # the shortest, short and long ranges
                  for limit in (short_keys(head_dim), GQA_MIN_LIMIT, None)}
        prefill = self.attention_kernel(2, head_dim)
        out += [("rope.cu", f"rope_qk_store<{kv_args(self.kv.k, self.kv.v)}>"), *((FILE_OF[d], d) for d in sorted(decode)),
                (FILE_OF[prefill], prefill)]
        return list(dict.fromkeys(out))

    def compile_jobs(self, head_dim: int, group: int = 1) -> list:
        """compile.module() arguments of the modules kernels_for(head_dim, group) live in (for
        compile.compile_async at load)."""
        return list(dict.fromkeys((f, GROUP_OF[(f, n)], self._defines()) for f, n in self.kernels_for(head_dim, group)))

    def compile_all(self, head_dim: int, group: int = 1) -> None:
        """Compile and load every kernel a model of head_dim and group launches, now
        (compilation cannot happen inside graph capture)."""
        for filename, name in self.kernels_for(head_dim, group):
            self.function(filename, name)

    def _launch(self, filename: str, name: str, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0,
                pdl: bool = True, per_sm: int | None = None) -> None:
        pdl = pdl and self.sw.pdl and cp.cuda.get_current_stream().is_capturing()
        launch(self.function(filename, name), grid, block, args, shared_mem, None, self.trace, pdl, per_sm)

    def rms_norm(self, x: cp.ndarray, w: cp.ndarray, y: cp.ndarray, eps: float, q8=None) -> None:
        """y = x / sqrt(mean(x^2, last axis) + eps) * w. x: (n_rows, n) f32; y: (n_rows, n) f32
        (may be x) or fp16 (a tensor-core input); w: (n,) f32. q8: None, or a q8_handoff.Q8Rows of
        n_rows rows of n (n a multiple of 32, at most 16,384; y f32) that also receives y quantized
        as the few-token products quantize their X (kernels_cu/norm.cu rms_norm_q8), so they copy it
        instead of each block quantizing y."""
        n_rows, n = x.shape
        check_f32(x, n_rows, n)
        out = check_out(y, n_rows, n)
        check_f32(w, n)
        if q8 is not None:
            if out != "float" or n % 32 or n > RMS_NORM_Q8_MAX or (q8.n_tok, q8.n) != (n_rows, n) or q8.data.nbytes < q8.nbytes(n_rows, n):
                raise ValueError(f"rms_norm with q8: y f32 and q8 rows of {n_rows} x {n} (n a multiple of 32, at most 16384), "
                                 f"got y {y.dtype}, q8 {q8.n_tok} x {q8.n} ({q8.data.nbytes} bytes)")
            threads = 32 * -(-n // 512)
            self._launch("norm.cu", "rms_norm_q8", (n_rows,), (threads,),
                         (x, w, y, q8.data, np.int32(n), np.float32(eps), np.int32(q8.swizzle)))
            return
        threads = 32 * min(32, max(1, -(-n // 256)))
        self._launch("norm.cu", f"rms_norm<{out}>", (n_rows,), (threads,), (x, w, y, np.int32(n), np.float32(eps)))

    def rope_qk_store(self, q: cp.ndarray, k: cp.ndarray, v: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray,
                      rope: RopeArgs, pos: cp.ndarray, q_out: cp.ndarray | None = None, scales: tuple = NO_SCALES,
                      ring: int = 0) -> None:
        """RoPE on q and k (rope: optional per-head RMSNorm first), k and v stored in the cache.

        q_out: (n_tok, n_head, D) f32, receives q normalized and rotated; None: q itself (then
        contiguous). q: (n_tok, n_head, D) f32, or a 2-D (n_tok, n_head * D) view with contiguous
        rows (columns of a stacked q|k|v product); k, v: likewise (n_tok, n_head_kv, D) or
        (n_tok, n_head_kv * D). k_cache, v_cache: (n_ctx, n_head_kv, D) fp16, or int8 quants of
        a q8_0 plane with its scales in `scales` (cache_types; one layer); pos: (1,) int32 device
        scalar, the position of token 0. The caller guarantees pos + n_tok <= n_ctx (the kernel
        writes cache rows pos .. pos + n_tok - 1). ring > 0: the planes are a sliding layer's
        ring of that many rows (AttnShape.ring), position p written to row p & (ring - 1). A
        q8_0 plane gets llama.cpp's quantization of each head row (kernels_cu/kv_cache.cuh; the
        same bits as runtime/kv_types.py).
        """
        q_out = q if q_out is None else q_out
        n_tok, n_head, D = q_out.shape
        check_f32(q_out, n_tok, n_head, D)
        n_head_kv = k_cache.shape[1]
        ld_q = row_stride(q, n_tok, n_head * D)
        ld_k = row_stride(k, n_tok, n_head_kv * D)
        ld_v = row_stride(v, n_tok, n_head_kv * D)
        types = cache_types(k_cache, v_cache, scales)
        assert k_cache.shape[1:] == (n_head_kv, D) and (not ring or k_cache.shape[0] == ring)
        assert pos.dtype == cp.int32 and pos.size == 1
        rope.check(D)
        rows = n_tok * (n_head + n_head_kv)
        smem = 4 * D * ROPE_WARPS if types.k == "q8_0" else 0  # the rotated keys in f32, one row per warp
        self._launch("rope.cu", f"rope_qk_store<{kv_args(types.k, types.v)}>", (-(-rows // ROPE_WARPS),), (32 * ROPE_WARPS,),
                     (q, np.int32(ld_q), k, np.int32(ld_k), v, np.int32(ld_v), q_out, *_planes(k_cache, v_cache, scales),
                      *rope.kernel_args(), pos, np.int32(n_tok), np.int32(n_head), np.int32(n_head_kv), np.int32(D),
                      np.int32(rope.rope_dim), np.int32(rope.neox), np.float32(rope.eps), np.float32(rope.mscale), ring_mask(ring)),
                     shared_mem=smem)

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
        check_f32(gate, n_tok, n_ff)
        check_f32(up, n_tok, n_ff)
        check_out(out, n_tok, n_ff)
        self._swiglu(gate, up, out, n_tok, n_ff, n_ff, 1, act)

    def swiglu_rows(self, gu: cp.ndarray, out: cp.ndarray, interleaved: bool, act: str = "silu") -> None:
        """out = act(gate) * up (see swiglu) from one gate/up product gu: (n_tok, 2 n_ff) f32, whose rows hold
        gate | up (stacked weights) or, interleaved, gate_0 up_0 gate_1 up_1 ... (a glu weight,
        layout.combined(glu=True)). out: (n_tok, n_ff) f32 or fp16."""
        n_tok, two_ff = gu.shape
        n_ff = two_ff // 2
        check_f32(gu, n_tok, 2 * n_ff)
        check_out(out, n_tok, n_ff)
        up = gu.reshape(-1)[1:] if interleaved else gu.reshape(-1)[n_ff:]
        self._swiglu(gu, up, out, n_tok, n_ff, 2 * n_ff, 2 if interleaved else 1, act)

    def rms_norm_add(self, t: cp.ndarray, w: cp.ndarray, res: cp.ndarray, y: cp.ndarray, eps: float) -> None:
        """y = res + t / sqrt(mean(t^2, last axis) + eps) * w (Gemma's post-norm, then the residual
        add). t, res, y: (n_rows, n) f32 (y may be res); w: (n,) f32."""
        n_rows, n = t.shape
        for a in (t, res, y):
            check_f32(a, n_rows, n)
        check_f32(w, n)
        threads = 32 * min(32, max(1, -(-n // 256)))
        self._launch("norm.cu", "rms_norm_add", (n_rows,), (threads,), (t, w, res, y, np.int32(n), np.float32(eps)))

    def softcap(self, x: cp.ndarray, cap: float) -> None:
        """x = cap * tanh(x / cap) in place (Gemma 2's final logit soft-cap). x: contiguous f32; cap > 0."""
        assert x.dtype == cp.float32 and x.flags.c_contiguous and cap > 0
        self._launch("elementwise.cu", "softcap_f32", (min(-(-x.size // 256), 4096),), (256,), (x, np.int64(x.size), np.float32(cap)))

    def set_i32(self, dst: cp.ndarray, value: int) -> None:
        """dst[0] = value on the stream (the value travels as a kernel argument). dst: (1,) int32."""
        assert dst.dtype == cp.int32 and dst.size == 1
        self._launch("elementwise.cu", "set_i32", (1,), (1,), (dst, np.int32(value)), pdl=False)

    def sample(self, logits: cp.ndarray, params: cp.ndarray, state: cp.ndarray, ring: cp.ndarray, seen: cp.ndarray,
               part_val: cp.ndarray, part_idx: cp.ndarray, advance: bool, head_parts: int = 0) -> None:
        """Sample the next token on the device (sampling.cu) and update the decode state.

        logits: (n_vocab,) f32, penalized in place; params: (8,) uint64 from pack_sampler_params;
        state: (4,) int32 [tok, pos, ring_count, draw]; ring: (ring_cap,) int32 token history;
        seen: (n_vocab,) int32 zeros; part_val, part_idx: (ARGMAX_PARTS,) f32 / int32 argmax
        partials. head_parts: how many the output head wrote into them (matmul.gemv argmax,
        K4_HEAD_ARGMAX; at most ARGMAX_PARTS), or 0: sample_argmax_partial writes
        argmax_parts(n_vocab) of them.
        advance: also increment state[pos] (after a decode step).
        """
        n_vocab = logits.shape[0]
        check_f32(logits, n_vocab)
        n_part = head_parts or argmax_parts(n_vocab)
        assert params.dtype == cp.uint64 and params.shape == (SAMPLER_PARAM_WORDS,)
        assert state.dtype == ring.dtype == seen.dtype == part_idx.dtype == cp.int32
        assert state.shape == (STATE_WORDS,) and seen.shape == (n_vocab,) and ring.ndim == 1
        check_f32(part_val, ARGMAX_PARTS)
        assert part_idx.shape == (ARGMAX_PARTS,) and 0 <= head_parts <= ARGMAX_PARTS
        ring_cap = np.int32(ring.shape[0])
        if not head_parts:
            self._launch("sampling.cu", "sample_argmax_partial", (n_part,), (256,), (logits, np.int32(n_vocab), part_val, part_idx))
        self._launch("sampling.cu", "sample_finish", (1,), (SAMPLE_THREADS,),
                     (logits, np.int32(n_vocab), seen, part_val, part_idx, np.int32(n_part), state, ring, ring_cap, params,
                      np.int32(advance)))

