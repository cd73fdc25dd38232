"""The forward pass on the GPU: the twin of runtime/reference.py's NumpyBackend._forward, in the
same order and with the same names, one line per op. It only enqueues kernels on the current
stream: no allocation, no host copy, no sync, so prefill chunks and the decode step can be
captured as CUDA graphs (runtime/cuda/runner.py).

Speed tricks are options (each a K4_* flag) applied from outside the model's order: in decode,
each RMSNorm folded into the matrix-vector product after it (fuse_norm), RoPE with the KV-cache
store inside the attention kernel (fuse_rope); the q/k/v and gate/up layouts come with the
weights (runtime/cuda/weights.py); which 8-bit handoff each product gets, runtime/cuda/handoffs.py.
Prefill runs on fp16 activations when every product takes them (matmul.takes_half).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp

from ..model import ModelConfig
from . import dequant, gemv_pair, matmul, moe, ops
from .constants import MMA8_TOKENS
from .gemv_batch import gemv_rows, quantize_rows
from .gemv_choice import after_attention_variant, gemv_variant, qkv_variant
from .gemv_mma import gemv_mma
from .handoffs import Q8_SWIZZLE, Handoffs
from .kv_cache import KVCache
from .launch import device_limits
from .op_args import AttnShape, FreshKV, RopeArgs
from .q8_handoff import Q8Rows, Q8Vector, folds_norm
from .quant_kernels import MMA8_MIN_TOKENS
from .quant_types import QUANT
from .weights import LayerWeights, Weights



@dataclass(frozen=True)
class ForwardOptions:
    """The forward pass's fusions (each a K4_* flag, runtime/flags.py)."""

    fuse_norm: bool = True  # K4_FUSE_NORM: decode RMSNorm inside the next product's prologue
    fuse_rope: bool = True  # K4_FUSE_ROPE: decode RoPE + cache store inside attention
    fuse_moe: bool = True  # K4_FUSE_MOE: decode's expert feed-forward in three launches (moe.decode_fused)
    moe_one: bool = True  # K4_MOE_ONE: with fuse_moe, those three as one launch where moe_one.py covers the layer
    qkv_q8: bool = True  # K4_QKV_Q8: decode's later q/k/v runs copy the x the first one quantized (qkv)
    qkv_pair: bool = True  # K4_QKV_PAIR: decode's q/k/v in two runs of paired types as one launch (qkv)
    x_cluster: bool = True  # K4_X_CLUSTER: decode's products quantizing a long x in clusters of blocks (linear)
    norm_q8: bool = True  # K4_NORM_Q8: decode's residual products hand the next norm's products their input quantized
    mma8_nq: bool = True  # K4_MMA8_NQ: the same from the verify step's down products on int8 tensor cores (Handoffs.rows_handoff)
    mma8_ffq8: bool = True  # K4_MMA8_FFQ8: the verify step's gate/up product writes its output quantized for down (gate_up)
    wo_wide: bool = True  # K4_WO_WIDE: decode's output product in gemv_choice.after_attention_variant (residual)
    head_argmax: bool = True  # K4_HEAD_ARGMAX: decode's output head writes the sampler's argmax partials (output)
    qkv_wide: bool = True  # K4_QKV_WIDE: decode's q/k/v of one run in gemv_choice.qkv_variant (qkv)


class Forward:
    """Enqueues forward passes of one model: weights `w`, activations `act` (buffers.activation_spec),
    cache `kv`, kernels `ops`, on `stream`. splits: the decode attention configurations
    (limit, n_split, split_len) per range of context lengths (Ops.decode_splits), swa_splits
    the sliding layers' (n_split, split_len) per range limit (default: splits'); pos: the
    device int32 position of the first token (decode state). blas: cuBLAS handle for prefill
    graphs, or None."""

    def __init__(self, cfg: ModelConfig, w: Weights, act, kv: KVCache, o: ops.Ops, opts: ForwardOptions,
                 splits: list[tuple[int, int, int]], pos: cp.ndarray, stream, swa_splits: dict | None = None):
        self.cfg, self.w, self.act, self.kv, self.ops, self.opts = cfg, w, act, kv, o, opts
        self.splits, self.pos, self.stream = splits, pos, stream
        self.swa_splits = swa_splits or {limit: (n, length) for limit, n, length in splits}
        self.blas = None
        self.n_sm = device_limits()[0]  # multiprocessors (qkv_variant)
        # per layer: the attention's query scale, window (sliding layers), score soft-cap and cache ring
        self.shapes = [AttnShape(cfg.query_scale, cfg.n_swa if cfg.sliding(li) else 0, cfg.attn_softcap, kv.rings[li])
                       for li in range(cfg.n_layer)]
        self.n_ctx, self.chunk = kv.n_ctx, act.x0.shape[0]
        # one token with fuse_norm: a post-norm (t, post_w, res, Y) the next products fold in (normed)
        self.post: tuple | None = None
        # one token with norm_q8: the q8 handoff of the residual stream's next RMSNorm input and
        # that norm's weight (residual's nq), taken by normed
        self.nq: tuple | None = None
        self.hand = Handoffs(cfg, w, act, o, opts)  # which 8-bit handoff each product gets
        self.mega = None  # megakernel.MegaStep (K4_MEGAKERNEL), set by the backend where the model allows it

    def layers(self, n: int, row_ids: cp.ndarray, split: tuple[int, int, int] | None = None) -> cp.ndarray:
        """Enqueue the layers for n tokens (ids row_ids (n,) int32 on the device) at positions
        pos .. pos + n - 1, writing their keys/values into the cache. split: for one token, the
        decode attention configuration (default the last, valid at any position); the position
        must be below its limit. Returns the residual stream (n, n_embd) f32 after the last layer."""
        cfg, o, a = self.cfg, self.ops, self.act
        x, x1 = a.x0[:n], a.x1[:n]  # (n, n_embd) each
        q, attn = a.q[:n], a.attn[:n]  # (n, n_head, head_dim)
        half = n > 1 and self.half(n)
        ff = (a.ff16 if half else a.ff)[:n]  # (n, n_ff)
        limit, n_split, split_len = (split or self.splits[-1]) if n == 1 else (self.n_ctx, 1, self.n_ctx)
        # per layer kind (full, sliding): its decode attention's (n_split, split_len) and partials
        configs = {False: (n_split, split_len), True: self.swa_splits[limit] if n == 1 else (1, self.n_ctx)}
        parts = {k: None if c[0] == 1 else a.part[: cfg.n_head * c[0] * (cfg.head_dim + 2)].reshape(1, cfg.n_head, c[0], cfg.head_dim + 2)
                 for k, c in configs.items()}
        self.post = self.nq = None  # a pending post-norm or handoff of an earlier pass that no output() took
        # gemma: the embedding rows times sqrt(n_embd), inside the lookup (embed_scale 1: none)
        dequant.dequant_rows(self.w.token_embd, row_ids, x, stream=self.stream, trace=o.trace, scale=cfg.embed_scale)
        for li, L in enumerate(self.w.layers):
            # attention: norm, q/k/v projections (+bias), [q/k norm] + RoPE + cache store, attention, output + residual
            h, norm, h_q8 = self.normed(x, L.attn_norm, half)
            cols = self.qkv(L, h, norm, n, h_q8)
            k_cache, v_cache, scales = self.kv.layer(li)  # (n_ctx or ring rows, n_head_kv, head_dim); q8_0: + scales
            rope = RopeArgs(L.q_norm, L.k_norm, self.w.inv_freq, cfg.rope_dim, cfg.rope_neox, cfg.rms_eps, self.w.rope_mscale)
            if cfg.sliding(li):  # gemma's sliding layers: their own RoPE base, no scaling
                rope = RopeArgs(L.q_norm, L.k_norm, self.w.inv_freq_swa, cfg.rope_dim, cfg.rope_neox, cfg.rms_eps)
            if n == 1 and self.opts.fuse_rope:  # RoPE and the cache store inside the attention kernel
                fresh = FreshKV(cols["q"], cols["k"], cols["v"], rope)
            else:
                o.rope_qk_store(cols["q"], cols["k"], cols["v"], k_cache, v_cache, rope, self.pos, q_out=q, scales=scales,
                                ring=self.kv.rings[li])
                fresh = None
            k_rows, v_rows, row_scales = self.kv.layer(li, limit)  # the positions below the decode range's limit
            sliding = cfg.sliding(li)
            attn_q8 = self.hand.attn_q8(L.wo, n, configs[sliding][0], limit)
            o.attention(q, k_rows, v_rows, attn, self.pos, *configs[sliding], parts[sliding], a.ticket, fresh, self.shapes[li],
                        scales=row_scales, limit=limit if n == 1 else None, x_q8=attn_q8)
            # a few rows: the output product hands nothing over (Handoffs.rows_handoff: the gate/up product's ramp costs
            # what the RMSNorm does there)
            nq = None if L.moe is not None or n > 1 else (L.ffn_norm, self.hand.readers(li)[0])
            wide = after_attention_variant(L.wo.ggml_type, cfg.q_dim) if self.opts.wo_wide else None
            self.residual(L.wo, attn.reshape(n, cfg.q_dim), x, x1, L.attn_post_norm, x_q8=attn_q8, nq=nq, variant=wide)
            if L.moe is not None:  # routed experts (+ shared expert) + residual: runtime/cuda/moe.py
                self.settle()
                moe.moe_ffn(self, L, x1, x, n)
                continue
            # feed-forward: norm, gate and up with SwiGLU (GeGLU), down (+ post-norm) + residual
            ff_q8 = self.gate_up(L, x1, ff, half)
            # the next layer's q/k/v, or after the last layer the output head
            nxt = self.w.layers[li + 1] if li + 1 < len(self.w.layers) else None
            nq = (nxt.attn_norm if nxt else self.w.output_norm,
                  self.hand.readers(li)[1] if n == 1 else [p.w for p in nxt.qkv] if nxt else [self.w.output])
            self.residual(L.w_down, ff, x1, x, L.ffn_post_norm, x_q8=ff_q8, nq=nq)
        return x

    def decode_mega(self, row_ids: cp.ndarray) -> None:
        """The decode step's forward pass in one persistent kernel (self.mega): the embedding of
        the token (row_ids (1,) int32 on the device) into act.x0, then every layer and lm_head
        into act.logits[0]."""
        dequant.dequant_rows(self.w.token_embd, row_ids, self.act.x0[:1], stream=self.stream, trace=self.ops.trace,
                            scale=self.cfg.embed_scale)
        self.mega.launch(self.pos, self.stream, self.ops.trace)

    def residual(self, w, X: cp.ndarray, res: cp.ndarray, Y: cp.ndarray, post_norm, x_q8=None, nq=None, variant=None) -> None:
        """Y = res + X W^T, or with a post-norm weight (gemma) Y = res + rmsnorm(X W^T) * post_norm:
        the product into the scratch h, then rms_norm_add, or for one token with fuse_norm the
        next products' prologue (self.post, taken by normed). X: (n, n_in); res, Y: (n, n_embd) f32.
        A product on int8 tensor cores (gemv_mma, 3 to 8 rows) gets X quantized once (act.x_q8).
        nq: None or (norm_w, reader), the RMSNorm after Y and a weight of the products that read
        its output (None: none can take a handoff): for one token with norm_q8 and fuse_norm, the
        product also writes rmsnorm(Y) * norm_w's q8 handoff (matmul.gemv norm_out, act.nq8 and
        act.nq_parts) for them, and normed gives it to them (self.nq). For 3 to 8 rows nq's second
        item is the list of those weights instead (Handoffs.rows_handoff). variant: the gemv_q8 (WARPS, U, PF) of
        one token's product (None: matmul's choice), its handoff's too where it has NQ instances."""
        if x_q8 is None:
            x_q8 = self.quantized(w, X)
        if post_norm is None and X.shape[0] > 1:
            rows = self.hand.rows_handoff(w, nq, X.shape[0])
            if rows is not None:
                gemv_mma(w, X, Y, residual=res, stream=self.stream, trace=self.ops.trace, x_q8=x_q8, nq_out=(nq[0], rows))
                self.nq = (rows, nq[0])
                return
            self.linear(w, X, Y, residual=res, x_q8=x_q8)
            return
        if post_norm is None:
            handoff, v = self.hand.handoff(w, nq, x_q8, variant), variant
            if handoff is None and variant is not None:  # no NQ launch in that variant: the default's
                handoff, v = self.hand.handoff(w, nq, x_q8), None
            if handoff is not None:
                self.linear(w, X, Y, residual=res, x_q8=x_q8, y_q8=handoff, norm_out=(nq[0], handoff.parts), variant=v)
                self.nq = (handoff, nq[0])
                return
            self.linear(w, X, Y, residual=res, x_q8=x_q8, variant=variant)
            return
        t = self.act.h[: X.shape[0]]  # (n, n_embd) f32: free once the q/k/v (or gate/up) products have read it
        self.linear(w, X, t, x_q8=x_q8)
        self.post = (t, post_norm, res, Y)
        if X.shape[0] > 1 or not self.opts.fuse_norm:
            self.settle()

    def quantized(self, w, X: cp.ndarray):
        """X (n, n_in) f32 quantized into act.x_q8 (gemv_batch.quantize_rows: one launch) where
        Handoffs.x_q8_rows gives w's product of n rows its x that way (docs/PERF.md); else None."""
        q8 = self.hand.x_q8_rows(w, X.shape[0]) if X.dtype == cp.float32 else None
        if q8 is not None:
            quantize_rows(X, q8, stream=self.stream, trace=self.ops.trace)
        return q8

    def settle(self) -> None:
        """Apply a pending post-norm (self.post) with the rms_norm_add kernel."""
        if self.post is not None:
            t, post_norm, res, Y = self.post
            self.post = None
            self.ops.rms_norm_add(t, post_norm, res, Y, self.cfg.rms_eps)

    def output(self, x: cp.ndarray, logits: cp.ndarray, argmax=None) -> int:
        """logits (n, n_vocab) = output · rmsnorm(x (n, n_embd)) * output_norm. argmax: None or the
        sampler's (part_val, part_idx): for one token with head_argmax, where matmul.argmax_ok allows
        and no soft-cap follows, the product also writes its warps' argmax partials there.
        Returns how many it wrote (0: none)."""
        n = x.shape[0]
        h, norm, h_q8 = self.normed(x, self.w.output_norm, n > 1 and self.half(n))
        am = n == 1 and argmax is not None and self.opts.head_argmax and not self.cfg.final_softcap
        parts = self.linear(self.w.output, h, logits, norm=norm, x_q8=h_q8,
                            argmax=argmax if am and matmul.argmax_ok(self.w.output) else None)
        if self.cfg.final_softcap:
            self.ops.softcap(logits, self.cfg.final_softcap)  # gemma 2: cap * tanh(logits / cap)
        return parts

    def qkv(self, L: LayerWeights, h: cp.ndarray, norm, n: int, h_q8=None) -> dict[str, cp.ndarray]:
        """The q, k, v products (+ bias) of h (n, n_embd) (h_q8: h quantized, residual's NQ handoff
        of rmsnorm(h) for one token, or None): name -> (n,
        rows) column views. One token with the norm folded in and runs of several quantized types
        (Q4_K_M's q|k and v; K4_QKV_Q8): the first run also writes its normalized x quantized
        (act.h_q8) for the others, which copy it instead of repeating the norm and post-norm
        prologue; the same bytes, so the same outputs (so not where they fold the norm's scale
        into their outputs: q8_handoff.folds_norm). Two runs of a type pair gemv_pair takes
        (K4_QKV_PAIR): one launch for both, the same bits again."""
        cols, x_q8, x_q8_out, later = {}, h_q8, None, L.qkv[1:]
        handed = n == 1 and h_q8 is not None and h_q8.parts is not None  # residual's NQ handoff
        if (n == 1 and self.opts.qkv_pair and len(L.qkv) == 2 and (h_q8 is None or handed)
                and gemv_pair.pairs(L.qkv[0].w, L.qkv[1].w)):
            (a, b), post = L.qkv, None
            if norm is not None and len(norm) == 3:  # normed's folded post-norm
                norm, post = norm[:2], norm[2]
            gemv_pair.gemv_pair(a.w, b.w, h[0], a.out[0], b.out[0], bias1=a.bias, bias2=b.bias, norm=norm, post=post,
                                stream=self.stream, trace=self.ops.trace, x_q8=h_q8)
            return {name: c[:1] for p in L.qkv for name, c in p.cols.items()}
        if (n == 1 and self.opts.qkv_q8 and later and norm is not None and h_q8 is None
                and all(p.w.ggml_type in QUANT for p in L.qkv)
                and len({QUANT[p.w.ggml_type].x_swizzle for p in later}) == 1):
            # only where no later run folds the norm's scale into its outputs (q8_handoff.folds_norm: with
            # a post-norm none does): a run that folds it computes other bits than the first run's q8 x
            # would give it, and its one-pass prologue costs about what the copy does
            if len(norm) == 3 or not any(folds_norm(gemv_variant(p.w.ggml_type, *p.w.shape)) for p in later):
                x_q8_out = Q8Vector.for_weight(later[0].w, self.act.h_q8)
        wide = self.qkv_variant(L) if n == 1 else None
        for p in L.qkv:
            self.linear(p.w, h, p.out[:n], bias=p.bias, norm=norm, x_q8=x_q8, x_q8_out=x_q8_out, variant=wide)
            cols.update({name: c[:n] for name, c in p.cols.items()})
            if x_q8_out is not None:  # the later runs: the first one's q8 x, no prologue
                norm, x_q8, x_q8_out = None, x_q8_out, None
        return cols

    def qkv_variant(self, L: LayerWeights) -> tuple[int, int, int] | None:
        """The gemv_q8 variant of layer L's one-token q/k/v product where it is one quantized run
        (K4_QKV_WIDE, gemv_choice.qkv_variant), else None (matmul's choice)."""
        (p, *more), t = L.qkv, L.qkv[0].w.ggml_type
        if more or not self.opts.qkv_wide or t not in QUANT or p.w.glu:
            return None
        return qkv_variant(t, p.w.shape[0], self.n_sm)

    def gate_up(self, L: LayerWeights, x1: cp.ndarray, ff: cp.ndarray, half: bool):
        """ff (n, n_ff) = act(gate) * up of rmsnorm(x1 (n, n_embd)) * ffn_norm, act cfg.activation
        (silu, gemma's gelu_tanh): in the product's epilogue for a glu weight on the matrix-vector
        path (its glu_act; quantized: gemv_batch.gemv_rows, 8 tokens per launch), else by the
        swiglu (geglu) kernel. Returns the q8 ff the epilogue also wrote for w_down, else None:
        L.ff_q8 for one token, Handoffs.ff_rows's for the verify step's rows."""
        n = x1.shape[0]
        h, norm, h_q8 = self.normed(x1, L.ffn_norm, half)
        if len(L.gate_up) == 2:  # separate gate and up
            g, u = (p.out[:n] for p in L.gate_up)
            self.linear(L.gate_up[0].w, h, g, norm=norm)
            self.linear(L.gate_up[1].w, h, u, norm=norm)
            self.ops.swiglu(g, u, ff, self.cfg.activation)
            return None
        p = L.gate_up[0]
        if p.w.glu and matmul.uses_gemv(p.w, n):  # the matrix-vector path: SwiGLU (GeGLU) in the epilogue
            if n == 1:
                self.linear(p.w, h, ff, norm=norm, y_q8=L.ff_q8, x_q8=h_q8)
                return L.ff_q8
            ff_q8 = self.hand.ff_rows(L, n)
            if ff_q8 is not None:  # the verify step: ff also quantized for w_down, in the same launch
                gemv_mma(p.w, h, ff, stream=self.stream, trace=self.ops.trace, x_q8=h_q8, y_q8=ff_q8)
                return ff_q8
            if p.w.ggml_type in QUANT:  # up to BATCH_TOKENS tokens per read of the weight
                gemv_rows(p.w, h, ff, stream=self.stream, trace=self.ops.trace, x_q8=h_q8)
                return None
            for i in range(n):
                self.linear(p.w, h[i : i + 1], ff[i : i + 1])
            return None
        self.linear(p.w, h, p.out[:n], norm=norm)
        self.ops.swiglu_rows(p.out[:n], ff, interleaved=p.w.glu, act=self.cfg.activation)
        return None

    def linear(self, w, X: cp.ndarray, Y: cp.ndarray, residual: cp.ndarray | None = None, bias=None, norm=None,
               x_q8=None, y_q8=None, x_q8_out=None, norm_out=None, variant=None, argmax=None) -> int:
        """Y = X W^T (+ bias) (+ residual). X: (n, n_in) f32 (or fp16 on the tensor-core path),
        Y and residual: (n, n_out) f32 views; a glu weight yields silu(gate) * up, (n, n_out / 2),
        on one row. One row: matmul.gemv, with norm = (norm_w, eps) folded into it and the q8
        handoff x_q8, y_q8, x_q8_out (q8_handoff.Q8Vector) and norm_out, in thread-block clusters where
        K4_X_CLUSTER allows (matmul.gemv x_cluster), in gemv_q8 variant `variant` if given; more:
        matmul.matmul (tensor cores unless K4_PREFILL_TC=0; up to GEMV_MAX_TOKENS rows: gemv_batch,
        reading w once per BATCH_TOKENS rows). argmax: one row only, matmul.gemv's. Returns the
        argmax partials written (0: none)."""
        if X.shape[0] == 1:
            post = None
            if norm is not None and len(norm) == 3:  # normed's folded post-norm
                norm, post = norm[:2], norm[2]
            warps = matmul.gemv(w, X[0], Y[0], residual=None if residual is None else residual[0], bias=bias, norm=norm,
                                 stream=self.stream, trace=self.ops.trace, x_q8=x_q8, y_q8=y_q8, post=post, x_q8_out=x_q8_out,
                                 x_cluster=self.opts.x_cluster, norm_out=norm_out, variant=variant, argmax=argmax)
            return warps if argmax is not None else 0
        matmul.matmul(w, X, Y, residual=residual, bias=bias, scratch=self.act.mm_scratch, stream=self.stream,
                      trace=self.ops.trace, blas=self.blas, x_q8=x_q8)
        return 0

    def normed(self, x: cp.ndarray, norm_w: cp.ndarray, half: bool):
        """The input of the products after an RMSNorm of x (n, n_embd): (X, norm, X_q8) for linear.
        One row with fuse_norm and a handoff of residual's (self.nq): (x, None, that Q8Vector).
        One row with fuse_norm otherwise: x itself, the norm folded into the product, and a pending
        post-norm whose result x is (self.post) folded in too: then (res, (norm_w, eps, (t,
        post_w, x)), None), the products computing x and writing it; otherwise the norm kernel's
        output, fp16 when `half`, and for MMA8_MIN_TOKENS to MMA8_TOKENS rows in f32 also that
        output quantized (q8_handoff.Q8Rows in act.h_q8, Q4_K's swizzle), which the few-token
        products copy instead of quantizing it in every block (else None)."""
        n = x.shape[0]
        if self.nq is not None and isinstance(self.nq[0], Q8Rows):  # residual's handoff of n rows (Handoffs.rows_handoff)
            (q8, handed_w), self.nq = self.nq, None
            assert handed_w is norm_w and self.post is None
            if q8.n_tok == n:
                return x, None, q8
            # a prefill's output of its last row only: x is written, the norm runs as usual
        if n == 1 and self.opts.fuse_norm and self.nq is not None:  # residual's q8 handoff of this norm's output
            (q8, handed_w), self.nq = self.nq, None
            assert handed_w is norm_w and self.post is None
            return x, None, q8
        if n == 1 and self.opts.fuse_norm:
            post, self.post = self.post, None
            if post is not None:
                t, post_w, res, y = post
                assert y.data.ptr == x.data.ptr and y.shape == x.shape
                return res, (norm_w, self.cfg.rms_eps, (t[0], post_w, x[0])), None
            return x, (norm_w, self.cfg.rms_eps), None
        self.settle()
        h = (self.act.h16 if half else self.act.h)[:n]
        q8 = None
        if not half and MMA8_MIN_TOKENS <= n <= MMA8_TOKENS and x.shape[1] % 32 == 0 and x.shape[1] <= ops.RMS_NORM_Q8_MAX:
            q8 = Q8Rows(self.act.h_q8, n, x.shape[1], Q8_SWIZZLE)
        self.ops.rms_norm(x, norm_w, h, self.cfg.rms_eps, q8=q8)
        return h, None, q8

    def half(self, n: int) -> bool:
        """Whether a forward pass of n tokens runs on fp16 activations: every product of it takes
        them (matmul.takes_half)."""
        return all(matmul.takes_half(w, n) for w in self.w.matrices)
