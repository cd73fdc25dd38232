"""The mixture-of-experts feed-forward of the numpy reference backend (qwen2moe, qwen3moe).

Algorithm (llama.cpp src/llama-graph.cpp build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX,
as src/models/qwen2moe.cpp and qwen3moe.cpp call it; transformers' Qwen2MoeSparseMoeBlock and
Qwen3MoeSparseMoeBlock): per token, router logits = ffn_gate_inp x (n_expert,), probabilities =
softmax(logits), the n_expert_used largest selected, their probabilities the weights (divided by
their sum when cfg.expert_norm: qwen3moe's norm_topk_prob); the output is
sum_k weight_k * down_e(silu(gate_e x) * up_e x) over the selected experts e. qwen2moe adds a
shared expert: sigmoid(ffn_gate_inp_shexp . x) * down_s(silu(gate_s x) * up_s x).

Only the selected experts' matrices are multiplied: tokens are grouped by expert, each expert
used by any token runs once over its tokens' rows (runtime/model.py expert_view: one expert's
slice of a stacked tensor, dequantized on its own by runtime/weights.py).
"""

from __future__ import annotations

import numpy as np

from .model import ModelFile, expert_view
from .weights import Matrix, dequantize_tensor


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def route(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits (T, n_expert) float32 -> (ids (T, k) int64, weights (T, k) float32): the k
    experts of largest softmax probability, in decreasing order (ties: the lower id first), and
    their probabilities, divided by their sum when `renormalize`."""
    probs = softmax(logits.astype(np.float32))  # (T, n_expert)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # (T, k)
    w = np.take_along_axis(probs, ids, axis=-1)  # (T, k)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w.astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), float32, without overflow for large |x|."""
    return np.exp(-np.logaddexp(np.float32(0.0), -x)).astype(np.float32)


class MoeFfn:
    """One block's experts: router (n_expert, n_embd); per expert gate, up (n_ff_exp, n_embd) and
    down (n_embd, n_ff_exp) Matrix views; the shared expert (qwen2moe) when cfg.n_ff_shexp > 0."""

    def __init__(self, mf: ModelFile, i: int, block_bytes: int):
        cfg = mf.config
        assert cfg is not None and cfg.n_expert
        self.n_used, self.renormalize = cfg.n_expert_used, cfg.expert_norm
        t = lambda n: mf.tensor(f"blk.{i}.{n}.weight")  # noqa: E731
        self.router = Matrix(t("ffn_gate_inp"), block_bytes)  # (n_expert, n_embd)
        self.gate, self.up, self.down = ([Matrix(expert_view(t(n), e), block_bytes) for e in range(cfg.n_expert)]
                                         for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        self.shared = None
        if cfg.n_ff_shexp:
            self.shared_gate = dequantize_tensor(t("ffn_gate_inp_shexp")).reshape(-1)  # (n_embd,)
            self.shared = tuple(Matrix(t(n), block_bytes) for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"))

    def matrices(self) -> list[Matrix]:
        return [self.router, *self.gate, *self.up, *self.down, *(self.shared or ())]

    def forward(self, h: np.ndarray, act) -> np.ndarray:
        """h (T, n_embd) float32, the normed residual -> the FFN's output (T, n_embd) float32;
        act: the GLU activation (silu)."""
        ids, w = route(self.router.product(h), self.n_used, self.renormalize)  # (T, k) each
        out = np.zeros_like(h)  # (T, n_embd)
        for e in np.unique(ids):  # each expert any token selected, once over its tokens
            tok, slot = np.nonzero(ids == e)  # token rows and their slot in the top k
            x = h[tok]  # (n, n_embd)
            y = self.down[e].product(act(self.gate[e].product(x)) * self.up[e].product(x))  # (n, n_embd)
            np.add.at(out, tok, y * w[tok, slot][:, None])
        if self.shared is not None:
            g, u, d = self.shared
            s = d.product(act(g.product(h)) * u.product(h))  # (T, n_embd)
            out = out + s * sigmoid(h @ self.shared_gate)[:, None]
        return out
