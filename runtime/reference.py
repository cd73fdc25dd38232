"""The numpy reference backend: the whole forward pass in float32 on the CPU.

It is the oracle every CUDA kernel is tested against, and what runs where there is no GPU.
Written to be read top to bottom, in the order a token flows through the model:
weights -> KV cache -> forward (embedding, layers, output) -> generation loop.

Algorithms: the llama architecture as implemented by llama.cpp (RMSNorm, RoPE "normal"
(interleaved pairs) for llama GGUFs and "NeoX" (halves) for qwen2/qwen3, grouped-query
attention, SwiGLU feed-forward); weights dequantized by the gguf package (gguf.quants), one
matrix at a time as the forward reaches it (runtime/weights.py).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from . import hostmem
from .token_cache import TokenCache
from .model import ModelConfig, ModelFile, Tensor, expected_shapes, expert_view, layer_matrices
from .moe import MoeFfn
from .rope import RopeTable, factor_tensor, rope_table
from .kv_types import F16, KVTypes, round_trip
from .sampling import SamplingParams, sample
from .spec_accept import accept_greedy
from .trace import Trace
from .weights import DEQUANT_PIECE_BYTES, Matrix, dequantize_tensor, read_pages

DEFAULT_CACHE_BYTES = 64 * 2**20  # keep every dequantized matrix when all of them fit in this


class Layer:
    """One transformer block's weights: matrices (n_out, n_in) in their GGUF types, vectors float32."""

    def __init__(self, mf: ModelFile, i: int, block_bytes: int):
        cfg = mf.config
        m = layer_matrices(mf, i)  # fused q|k|v and gate|up (phi3) come as row views
        mat = lambda name: Matrix(m[name], block_bytes)  # noqa: E731
        vec = lambda name: dequantize_tensor(mf.tensor(f"blk.{i}.{name}"))  # noqa: E731
        self.attn_norm = vec("attn_norm.weight")  # (n_embd,)
        self.wq = mat("attn_q")  # (n_head * head_dim, n_embd)
        self.wk = mat("attn_k")  # (n_head_kv * head_dim, n_embd)
        self.wv = mat("attn_v")  # (n_head_kv * head_dim, n_embd)
        self.wo = mat("attn_output")  # (n_embd, n_head * head_dim)
        self.ffn_norm = vec("ffn_norm.weight")  # (n_embd,)
        self.moe = MoeFfn(mf, i, block_bytes) if cfg.n_expert else None  # the experts, in place of the dense FFN
        self.w_gate = None if self.moe else mat("ffn_gate")  # (n_ff, n_embd)
        self.w_up = None if self.moe else mat("ffn_up")  # (n_ff, n_embd)
        self.w_down = None if self.moe else mat("ffn_down")  # (n_embd, n_ff)
        self.bq = vec("attn_q.bias") if cfg.has_qkv_bias else None  # (n_head * head_dim,)
        self.bk = vec("attn_k.bias") if cfg.has_qkv_bias else None  # (n_head_kv * head_dim,)
        self.bv = vec("attn_v.bias") if cfg.has_qkv_bias else None  # (n_head_kv * head_dim,)
        self.q_norm = vec("attn_q_norm.weight") if cfg.has_qk_norm else None  # (head_dim,)
        self.k_norm = vec("attn_k_norm.weight") if cfg.has_qk_norm else None  # (head_dim,)
        self.attn_post_norm = vec("post_attention_norm.weight") if cfg.has_post_norms else None  # (n_embd,) gemma
        self.ffn_post_norm = vec("post_ffw_norm.weight") if cfg.has_post_norms else None  # (n_embd,)

    def matrices(self) -> list[Matrix]:
        if self.moe is not None:
            return [self.wq, self.wk, self.wv, self.wo, *self.moe.matrices()]
        return [self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n) float32 -> x / sqrt(mean(x^2) + eps) * w, over the last axis."""
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(ms + np.float32(eps))) * w


def rope_tables(table: RopeTable, positions: np.ndarray):
    """cos, sin of shape (T, rope_dim // 2) float32 for the given positions (T,): theta_i =
    pos * table.inv_freq[i] (runtime/rope.py: base frequencies, rope_freqs / LongRoPE factors,
    linear or YaRN scaling), each times table.mscale (1.0 unless the file scales RoPE)."""
    theta = positions.astype(np.float64)[:, None] * table.inv_freq[None, :]  # (T, half)
    return (np.cos(theta) * table.mscale).astype(np.float32), (np.sin(theta) * table.mscale).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, neox: bool) -> np.ndarray:
    """x (T, n_heads, head_dim) -> rotated copy; only the first rope_dim dims of each head turn.

    neox=False: pairs (2i, 2i+1) (llama.cpp's "normal" mode); neox=True: pairs (i, i + rope_dim/2).
    """
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, half)
    if neox:
        half = rope_dim // 2
        a, b = x[..., :half], x[..., half:rope_dim]  # (T, n_heads, half) each
        out[..., :half] = a * c - b * s
        out[..., half:rope_dim] = a * s + b * c
    else:
        a, b = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]  # (T, n_heads, half) each
        out[..., 0:rope_dim:2] = a * c - b * s
        out[..., 1:rope_dim:2] = a * s + b * c
    return out


def swa_rope_tables(cfg: ModelConfig, positions: np.ndarray):
    """cos, sin (T, rope_dim // 2) float32 of the sliding-window layers (gemma): theta_i = pos *
    rope_freq_base_swa^(-2i / rope_dim), no factors and no scaling (llama.cpp's
    rope_freq_scale_train_swa = 1)."""
    inv_freq = cfg.rope_freq_base_swa ** (-np.arange(cfg.rope_dim // 2, dtype=np.float64) * 2.0 / cfg.rope_dim)
    theta = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (T, half)
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (Hendrycks & Gimpel 2016), float32: ggml's op_gelu,
    transformers' gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))."""
    inner = np.float32(0.7978845608028654) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}  # ModelConfig.activation -> act of act(gate) * up


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap), float32 (Gemma 2's logit soft-capping); x itself when cap is 0."""
    if not cap:
        return x
    return np.float32(cap) * np.tanh(x / np.float32(cap))


# Most attention scores one block of query rows may hold (float32 elements: 16 MiB).
ATTN_SCORES_MAX = 1 << 22


def causal_attention(qg: np.ndarray, keys: np.ndarray, vals: np.ndarray, p0: int, scale: float | None = None,
                     window: int = 0, cap: float = 0.0) -> np.ndarray:
    """Grouped-query causal softmax attention of T queries at positions p0..p0+T-1 over the
    cache, computed in blocks of query rows so that one block's scores hold at most
    ATTN_SCORES_MAX elements (a 4,000-token prompt no longer holds all T x S x heads at once;
    each row's arithmetic is unchanged, so results are bit-identical to the unblocked form).

    qg: (T, nkv, gqa, hd) float32 queries grouped by KV head; keys, vals: (S, nkv, hd), S = p0 + T.
    scale: of q.k (default 1/sqrt(hd)); window > 0: the query at position p sees only keys
    p - window + 1 .. p (a sliding layer, llama.cpp's LLAMA_SWA_TYPE_STANDARD; each block of rows
    reads only the keys its rows can see); cap > 0: scores -> cap * tanh(score / cap) before the
    mask (Gemma 2's attention soft-cap). Returns (T, nkv * gqa * hd) float32.
    """
    T, nkv, gqa, hd = qg.shape
    S = keys.shape[0]
    scale = np.float32(1.0 / np.sqrt(hd) if scale is None else scale)
    rows = max(1, ATTN_SCORES_MAX // max(1, nkv * gqa * S))
    out = np.empty((T, nkv * gqa * hd), dtype=np.float32)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        lo = max(0, p0 + t0 - window + 1) if window > 0 else 0  # the first key any row of the block sees
        # causal mask: query t (at p0 + t) sees cache positions 0..p0 + t (window: from p0 + t - window + 1)
        key_pos, q_pos = np.arange(lo, S)[None, :], np.arange(p0 + t0, p0 + t1)[:, None]
        mask = key_pos > q_pos  # (t1 - t0, S - lo) bool
        if window > 0:
            mask |= key_pos <= q_pos - window
        scores = np.einsum("tkgd,skd->kgts", qg[t0:t1], keys[lo:]) * scale  # (nkv, gqa, t1 - t0, S - lo)
        scores = np.where(mask, np.float32(-np.inf), softcap(scores, cap))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)  # (nkv, gqa, t1 - t0, S - lo)
        out[t0:t1] = np.einsum("kgts,skd->tkgd", probs, vals[lo:]).reshape(t1 - t0, -1)
    return out


def ram_besides_kv(file_bytes: int, matrices: list[Matrix], cache_bytes: int) -> tuple[dict[str, int], bool]:
    """({"weights": file bytes, "dequantized": bytes}, keep): the RAM the numpy backend needs
    besides its KV cache, keep: every dequantized matrix is kept (they fit in cache_bytes), else
    only the largest product's block of rows is dequantized at a time."""
    dequantized = sum(m.f32_bytes for m in matrices)
    keep = dequantized <= cache_bytes
    largest = max(min(m.f32_bytes, 4 * m.block_rows * m.shape[1]) for m in matrices)
    return {"weights": file_bytes, "dequantized": dequantized if keep else largest}, keep


def max_context(mf: ModelFile, mem_available: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES) -> tuple[int, int, int]:
    """(largest n_ctx in tokens whose float32 KV cache fits, bytes left for it, KV bytes per
    token) on the numpy backend with mem_available bytes of RAM (default hostmem.available_ram()),
    by the sizes NumpyBackend checks (ram_besides_kv; a fused tensor counted whole, which only
    overstates the largest block). The first is 0 when not even the weights fit."""
    cfg = mf.config
    shapes = expected_shapes(cfg)
    file_bytes = sum(mf.tensor(n).n_bytes for n in shapes)
    block_bytes = max(DEQUANT_PIECE_BYTES, file_bytes // 8)
    matrices = [Matrix(mf.tensor(n), block_bytes) for n, s in shapes.items() if len(s) == 2]
    matrices += [Matrix(expert_view(mf.tensor(n), e), block_bytes) for n, s in shapes.items() if len(s) == 3
                 for e in range(s[0])]  # stacked experts: one matrix each
    parts, _ = ram_besides_kv(file_bytes, matrices, cache_bytes)
    left = (hostmem.available_ram() if mem_available is None else mem_available) - sum(parts.values())
    per_token = 2 * 4 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim
    return max(0, left // per_token), max(0, left), per_token


class NumpyBackend(TokenCache):
    """The reference backend (see runtime/backend.py for the protocol).

    Weights stay memory-mapped in their GGUF types; each matrix is dequantized to float32 when
    the forward reaches it (runtime/weights.py: whole, or in blocks of rows of at most
    block_bytes of float32), unless all dequantized matrices fit in cache_bytes: then they are
    dequantized once at load and kept (small models, where dequantizing costs more than the
    product). The KV cache is float32, (n_layer, n_ctx, n_head_kv, head_dim) for keys and values
    each; with kv_types q8_0 for keys (values) each stored head row holds what llama.cpp's q8_0
    gives back (runtime/kv_types.py round_trip), as the CUDA backend's q8_0 cache does.
    Peak RAM: the file's bytes + the kept matrices or one block + the KV cache.

    progress(done_bytes, total_bytes) is called after each tensor is read at load.
    cached: whether the dequantized matrices are kept (they fit in cache_bytes).
    mem_available: bytes of RAM free for the model (default: hostmem.available_ram()).
    block_bytes: default max(DEQUANT_PIECE_BYTES, file bytes // 8).
    Raises OutOfMemoryError up front when the weights, what is dequantized and the KV cache need
    more than mem_available.
    """

    name = "numpy"

    def __init__(self, mf: ModelFile, n_ctx: int, progress: Callable[[int, int], None] | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, block_bytes: int | None = None, mem_available: int | None = None,
                 kv_types: KVTypes = F16):
        cfg = mf.config
        assert cfg is not None
        kv_types.check(cfg.head_dim)
        self.config, self.n_ctx, self.trace, self.kv_types = cfg, n_ctx, Trace(), kv_types
        t0 = time.perf_counter()
        with self.trace.in_phase("load"):
            tensors = [mf.tensor(name) for name in expected_shapes(cfg)]  # every tensor the forward reads
            file_bytes = sum(t.n_bytes for t in tensors)
            block_bytes = block_bytes or max(DEQUANT_PIECE_BYTES, file_bytes // 8)
            self.token_embd = Matrix(mf.tensor("token_embd.weight"), block_bytes)  # (n_vocab, n_embd)
            self.output_norm = dequantize_tensor(mf.tensor("output_norm.weight"))  # (n_embd,)
            self.output = self.token_embd if cfg.tied_embeddings else Matrix(mf.tensor("output.weight"), block_bytes)  # (n_vocab, n_embd)
            factors = factor_tensor(cfg, n_ctx)  # rope_freqs, or LongRoPE's long or short factors
            self.rope = rope_table(cfg, n_ctx, dequantize_tensor(mf.tensor(factors)) if factors else None)  # (rope_dim/2,) f64
            self.layers = [Layer(mf, i, block_bytes) for i in range(cfg.n_layer)]
            kv_shape = (cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim)
            self.cached = self._check_ram(mf, file_bytes, 2 * 4 * math.prod(kv_shape), cache_bytes, mem_available)  # Python ints: no overflow
            self._read(tensors, progress)
            self.k_cache = np.zeros(kv_shape, dtype=np.float32)  # (n_layer, n_ctx, n_head_kv, head_dim)
            self.v_cache = np.zeros(kv_shape, dtype=np.float32)  # (n_layer, n_ctx, n_head_kv, head_dim)
        self.tokens: list[int] = []
        self.load_ms = {"read+dequantize": (time.perf_counter() - t0) * 1e3}  # wall time of each load step
        self.load_detail_ms: dict[str, float] = {}

    def memory_report(self) -> dict[str, int]:
        """Host bytes by kind: kv_cache (float32 keys and values), dequantized (matrices kept in
        float32, when the model is small enough to keep them)."""
        kept = sum(m.f32_bytes for m in self.matrices()) if self.cached else 0
        return {"kv_cache": self.k_cache.nbytes + self.v_cache.nbytes, "dequantized": kept}

    def matrices(self) -> list[Matrix]:
        """Every weight matrix the forward multiplies by, each once (tied embeddings are one)."""
        found = [self.token_embd, self.output] + [m for L in self.layers for m in L.matrices()]
        return list({id(m): m for m in found}.values())

    def _check_ram(self, mf: ModelFile, file_bytes: int, kv_bytes: int, cache_bytes: int, mem_available: int | None) -> bool:
        """Whether to keep every dequantized matrix (they fit in cache_bytes); raises
        OutOfMemoryError when the file's bytes, the dequantized bytes (all kept, or the largest
        product's) and the KV cache do not fit in mem_available."""
        parts, keep = ram_besides_kv(file_bytes, self.matrices(), cache_bytes)
        hostmem.require_ram(f"{mf.path.name} on the numpy backend", {**parts, "KV cache": kv_bytes},
                            hostmem.available_ram() if mem_available is None else mem_available)
        return keep

    def _read(self, tensors: list[Tensor], progress: Callable[[int, int], None] | None) -> None:
        """Dequantize the kept matrices and read every other tensor's pages from disk, reporting
        progress(done_bytes, total_bytes) in bytes of the file after each tensor."""
        kept = {id(m.tensor): m for m in self.matrices()} if self.cached else {}
        total, done = sum(t.n_bytes for t in tensors), 0
        for t in tensors:
            if id(t) in kept:
                kept[id(t)].keep()
            read_pages(t)
            done += t.n_bytes
            if progress is not None:
                progress(done, total)

    def eval(self, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)  # (T,)
        if ids.size == 0:
            raise ValueError("eval() needs at least one token")
        self._check_room(ids.size)
        phase = "prefill" if ids.size > 1 else "decode"
        with self.trace.in_phase(phase) as c:
            logits = self._forward(ids, all_logits)
            c.steps += 1
        self.tokens.extend(int(t) for t in ids)
        return logits

    def verify(self, token_ids: Sequence[int]) -> list[int]:
        """See runtime/backend.py; here every row's logits and its argmax on the host."""
        logits = self.eval(token_ids, all_logits=True)  # (len(token_ids), n_vocab)
        out = accept_greedy(token_ids, np.argmax(logits, axis=1))
        self.truncate(self.n_past - len(token_ids) + len(out))  # keep t and the accepted drafts
        return out

    def _forward(self, ids: np.ndarray, all_logits: bool) -> np.ndarray:
        cfg = self.config
        T, p0 = ids.size, self.n_past
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        positions = np.arange(p0, p0 + T)  # (T,)
        cos, sin = rope_tables(self.rope, positions)  # (T, rope_dim/2) each
        local = swa_rope_tables(cfg, positions) if cfg.swa_layers else None  # sliding layers' (cos, sin)
        act = ACTIVATIONS[cfg.activation]

        x = self.token_embd.rows(ids)  # (T, n_embd) the residual stream: only these rows are dequantized
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)  # gemma: times sqrt(n_embd)
        for li, L in enumerate(self.layers):
            window = cfg.n_swa if cfg.sliding(li) else 0
            c, s = local if window else (cos, sin)
            # attention: norm, projections, rope, cache write, grouped-query attention, output
            h = rms_norm(x, L.attn_norm, cfg.rms_eps)  # (T, n_embd)
            q = L.wq.product(h)  # (T, nh * hd)
            k = L.wk.product(h)  # (T, nkv * hd)
            v = L.wv.product(h)  # (T, nkv * hd)
            if L.bq is not None:
                q, k, v = q + L.bq, k + L.bk, v + L.bv
            q = q.reshape(T, nh, hd)  # (T, nh, hd)
            k = k.reshape(T, nkv, hd)  # (T, nkv, hd)
            if L.q_norm is not None:
                q = rms_norm(q, L.q_norm, cfg.rms_eps)
                k = rms_norm(k, L.k_norm, cfg.rms_eps)
            q = apply_rope(q, c, s, cfg.rope_dim, cfg.rope_neox)
            k = apply_rope(k, c, s, cfg.rope_dim, cfg.rope_neox)
            self.k_cache[li, p0 : p0 + T] = round_trip(k, self.kv_types.k)  # q8_0: quantized and back
            self.v_cache[li, p0 : p0 + T] = round_trip(v.reshape(T, nkv, hd), self.kv_types.v)
            keys = self.k_cache[li, : p0 + T]  # (S, nkv, hd), S = p0 + T
            vals = self.v_cache[li, : p0 + T]  # (S, nkv, hd)
            attn = causal_attention(q.reshape(T, nkv, cfg.n_gqa, hd), keys, vals, p0, cfg.query_scale, window,
                                    cfg.attn_softcap)  # (T, nh * hd)
            o = L.wo.product(attn)  # (T, n_embd)
            x = x + (o if L.attn_post_norm is None else rms_norm(o, L.attn_post_norm, cfg.rms_eps))
            # feed-forward: norm, act(gate) * up (SwiGLU or GeGLU), down projection
            h = rms_norm(x, L.ffn_norm, cfg.rms_eps)  # (T, n_embd)
            if L.moe is not None:  # routed experts (runtime/moe.py)
                d = L.moe.forward(h, act)  # (T, n_embd)
            else:
                d = L.w_down.product(act(L.w_gate.product(h)) * L.w_up.product(h))  # (T, n_embd)
            x = x + (d if L.ffn_post_norm is None else rms_norm(d, L.ffn_post_norm, cfg.rms_eps))

        if not all_logits:
            x = x[-1:]
        h = rms_norm(x, self.output_norm, cfg.rms_eps)  # (T or 1, n_embd)
        logits = softcap(self.output.product(h).astype(np.float32), cfg.final_softcap)  # (T or 1, n_vocab)
        return logits if all_logits else logits[0]

    def generate(self, token_ids: Sequence[int], params: SamplingParams, history: Sequence[int] = ()) -> Iterator[int]:
        recent = list(history) + list(token_ids)
        logits = self.eval(token_ids)
        step = 0
        while True:
            with self.trace.in_phase("sample"):
                tok = sample(logits, params, recent, step)
            step += 1
            recent.append(tok)
            yield tok
            logits = self.eval([tok])
