"""Perplexity with llama.cpp's protocol (tools/perplexity, `llama-perplexity -c N`).

The text is tokenized once (BOS first when the model adds one) and cut into chunks of n_ctx
tokens; the last partial chunk is dropped. Each chunk is evaluated from an empty cache with
its first token replaced by BOS; only the second half is scored: the logits at positions
n_ctx/2 .. n_ctx-2 predict the tokens after them. The running perplexity after each chunk is
exp(total negative log-likelihood / tokens scored so far).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .backend import Backend
from .errors import UsageError


@dataclass(frozen=True)
class ChunkResult:
    index: int  # 0-based chunk number
    n_chunks: int
    ppl: float  # running perplexity after this chunk
    nll: float  # this chunk's summed negative log-likelihood (nats)
    n_scored: int  # tokens scored in this chunk


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits (n, n_vocab) float32, targets (n,) -> -log p(target) per row, float64 (n,)."""
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(axis=1)) + m[:, 0]  # (n,)
    return lse - z[np.arange(len(targets)), targets]


def perplexity(backend: Backend, tokens: Sequence[int], n_ctx: int, bos_id: int | None) -> Iterator[ChunkResult]:
    """Yield one ChunkResult per chunk of `n_ctx` tokens of `tokens` (already tokenized, BOS
    included when the model adds one). Raises UsageError when fewer than 2 * n_ctx tokens.
    """
    if n_ctx < 4:
        raise UsageError(f"--ctx-size {n_ctx} is too small for perplexity; use at least 4")
    if n_ctx > backend.n_ctx:
        raise UsageError(f"--ctx-size {n_ctx} exceeds the backend context of {backend.n_ctx}")
    n_chunks = len(tokens) // n_ctx
    if len(tokens) < 2 * n_ctx:
        raise UsageError(f"the text has {len(tokens)} tokens; perplexity with -c {n_ctx} needs at least {2 * n_ctx}")
    first = n_ctx // 2
    total_nll, total_n = 0.0, 0
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])  # (n_ctx,)
        if bos_id is not None:
            chunk[0] = bos_id
        backend.reset()
        logits = backend.eval(chunk, all_logits=True)  # (n_ctx, n_vocab)
        targets = np.asarray(tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx])  # (n_ctx - first - 1,)
        nll = float(log_softmax_nll(logits[first : n_ctx - 1], targets).sum())
        total_nll += nll
        total_n += len(targets)
        yield ChunkResult(i, n_chunks, float(np.exp(total_nll / total_n)), nll, len(targets))
