"""Which 8-bit handoff each product of a forward pass on the GPU gets: the q8 x a product copies
instead of quantizing its input in every block (attention's output for the output product, the
gate/up output for down, the verify step's rows), and the NQ handoff a residual product writes
for the products after the next RMSNorm (K4_NORM_Q8 for one token, K4_MMA8_NQ for the verify
step's rows) with the weight whose swizzle it is made in. Forward (forward.py) asks; these only
choose and describe buffers of `act`, they launch nothing. Formats: q8_handoff.py (Q8Vector,
Q8Rows).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

from ..model import ModelConfig
from . import gemv_pair, matmul, ops
from .constants import MMA8_TOKENS
from .gemv_choice import NQ_TYPES, gemv_variant, nx_reads
from .gemv_mma import nq_parts, uses_mma8, writes_q8
from .q8_handoff import Q8Rows, Q8Vector
from .quant_kernels import MMA8_MIN_TOKENS
from .quant_types import QUANT
from .weights import LayerWeights, Weights

# The unit order of the X the forward pass quantizes once for the few-token products (gemv_mma takes
# any; gemv_batch where it is its weight's: Q4_K's, the common case).
Q8_SWIZZLE = QUANT[T.Q4_K].x_swizzle


class Handoffs:
    """The handoffs of one model's forward pass: config `cfg`, weights `w`, activations `act`
    (buffers.activation_spec: the handoffs live in x_q8, h_q8, nq8, nq_parts and nq_rows_parts),
    kernels `o` (which attention kernels quantize their output), and the fusions `opts`
    (forward.ForwardOptions: norm_q8, fuse_norm, mma8_nq, mma8_ffq8, qkv_pair, x_cluster)."""

    def __init__(self, cfg: ModelConfig, w: Weights, act, o: ops.Ops, opts):
        self.cfg, self.w, self.act, self.ops, self.opts = cfg, w, act, o, opts
        self._readers: dict[int, tuple] = {}  # readers(li)

    def x_q8_rows(self, w, n: int) -> Q8Rows | None:
        """act.x_q8 as the Q8Rows (Q8_SWIZZLE) of n rows of w's inputs that w's product copies
        instead of every block quantizing its X, where that product runs as gemv_mma (n from
        MMA8_MIN_TOKENS to MMA8_TOKENS, inputs a multiple of 32) and the rows fit; else None."""
        n_in = w.shape[1]
        if not (MMA8_MIN_TOKENS <= n <= MMA8_TOKENS and n_in % 32 == 0 and matmul.uses_gemv(w, n) and uses_mma8(w, n)
                and Q8Rows.nbytes(n, n_in) <= self.act.x_q8.nbytes):
            return None
        return Q8Rows(self.act.x_q8, n, n_in, Q8_SWIZZLE)

    def ff_rows(self, L: LayerWeights, n: int) -> Q8Rows | None:
        """The Q8Rows that layer L's glu gate/up product of n rows also writes its output into for
        w_down (gemv_mma y_q8): x_q8_rows's for w_down (what quantized would give it: the same
        bytes), or None: mma8_ffq8 off, the gate/up product unable to (gemv_mma.writes_q8: steps
        of whole 32-output groups), or no x_q8_rows for w_down."""
        w = L.gate_up[0].w
        if not (self.opts.mma8_ffq8 and matmul.uses_gemv(w, n) and writes_q8(w, n)):
            return None
        return self.x_q8_rows(L.w_down, n)

    def attn_q8(self, wo, n: int, n_split: int, limit: int) -> Q8Vector | Q8Rows | None:
        """The q8 vector (in act.x_q8, free in decode) that decode attention hands the output
        product wo, its output quantized by the attention kernel (Ops.uses_attn_q8; K4_ATTN_Q8),
        or None where it does not: n tokens, the range's n_split splits and most keys `limit`,
        wo quantized. For several rows (the verify step) x_q8_rows's for wo, which wo's product
        copies instead of a quantize_q8_rows kernel running first (quantized: the same bytes)."""
        cfg = self.cfg
        if wo.ggml_type not in QUANT or not self.ops.uses_attn_q8(n, cfg.head_dim, cfg.n_head // cfg.n_head_kv, n_split, limit):
            return None
        return Q8Vector.for_weight(wo, self.act.x_q8) if n == 1 else self.x_q8_rows(wo, n)

    def handoff(self, w, nq, x_q8, variant=None) -> Q8Vector | None:
        """The q8 handoff (Q8Vector with parts, in act.nq8 and act.nq_parts) that w's one-token
        product of float x (x_q8 None) or of x_q8, in gemv_q8 variant `variant` (None: matmul's),
        writes for nq's reader (residual), or None where norm_q8 or fuse_norm is off, nq is None,
        or w's product has no NQ launch in that variant."""
        if nq is None or nq[1] is None or not (self.opts.norm_q8 and self.opts.fuse_norm):
            return None
        n_parts = matmul.norm_q8_blocks(w, self.opts.x_cluster and x_q8 is None, variant)
        if not n_parts:
            return None
        vec = Q8Vector.for_weight(nq[1], self.act.nq8)
        return Q8Vector(vec.data, vec.n, vec.swizzle, self.act.nq_parts, n_parts, self.cfg.rms_eps)

    def rows_handoff(self, w, nq, n: int) -> Q8Rows | None:
        """The NQ handoff (Q8Rows with parts, in act.h_q8 and act.nq_rows_parts) that w's product
        of n rows writes (gemv_mma nq_out) for the products of nq = (norm_w, their weights), or
        None: mma8_nq off, n outside MMA8_MIN_TOKENS..MMA8_TOKENS, nq or its weights None, w's
        product without an NQ launch (gemv_mma.nq_parts), or a reader that does not run as
        gemv_mma (matmul.uses_gemv and uses_mma8: only it reads the handoff). layers asks it for
        the down products (readers: the next q/k/v or the output head) only: on the H200 the
        handoff from the output product to gate/up gained 0.9 µs a layer on Llama 2 7B and lost on
        TinyLlama and Qwen2.5 7B, whose gate/up ramp then costs what the RMSNorm kernel did
        (docs/PERF.md, session 31)."""
        if nq is None or nq[1] is None or not (self.opts.mma8_nq and MMA8_MIN_TOKENS <= n <= MMA8_TOKENS):
            return None
        n_parts = nq_parts(w, n) if matmul.uses_gemv(w, n) else 0
        if not n_parts or n * n_parts > self.act.nq_rows_parts.size or Q8Rows.nbytes(n, w.shape[0]) > self.act.h_q8.nbytes:
            return None
        if not all(matmul.uses_gemv(r, n) and uses_mma8(r, n) for r in nq[1]):
            return None
        return Q8Rows(self.act.h_q8, n, w.shape[0], Q8_SWIZZLE, self.act.nq_rows_parts, n_parts, self.cfg.rms_eps)

    @staticmethod
    def reader(ws) -> object | None:
        """The weight whose swizzle a handoff to the one-token products of weights ws is made in,
        or None where one of them cannot read it: each with a gemv_q8 instance that reads it
        (gemv_choice.nx_reads), all of one swizzle."""
        for w in ws:
            if w.ggml_type not in NQ_TYPES or not matmul.uses_gemv(w, 1):
                return None
            if not nx_reads(w.ggml_type, gemv_variant(w.ggml_type, w.shape[0] // (2 if w.glu else 1), w.shape[1], w.glu), w.glu):
                return None
        return ws[0] if len({QUANT[w.ggml_type].x_swizzle for w in ws}) == 1 else None

    def readers(self, li: int) -> tuple:
        """(reader of layer li's gate/up, reader of the q/k/v of layer li + 1 or after the last
        layer of the output head), computed once per layer (the eager decode step asks each token)."""
        r = self._readers.get(li)
        if r is None:
            layers = self.w.layers
            nxt = self.qkv_reader(layers[li + 1]) if li + 1 < len(layers) else self.reader([self.w.output])
            r = self._readers[li] = (self.gate_up_reader(layers[li]), nxt)
        return r

    def qkv_reader(self, L: LayerWeights):
        """reader for layer L's one-token q/k/v products: a gemv_pair pair reads any swizzle (its
        first run's), separate runs must share one."""
        if self.opts.qkv_pair and len(L.qkv) == 2 and gemv_pair.pairs(L.qkv[0].w, L.qkv[1].w):
            return L.qkv[0].w
        return self.reader([p.w for p in L.qkv])

    def gate_up_reader(self, L: LayerWeights):
        """reader for layer L's one-token gate/up product: one glu weight, or None."""
        return self.reader([L.gate_up[0].w]) if len(L.gate_up) == 1 and L.gate_up[0].w.glu else None

