"""Perplexity with llama.cpp's protocol (tools/perplexity, `llama-perplexity -c N`).

The text is tokenized once (BOS first when the model adds one) and cut into chunks of n_ctx
tokens; the last partial chunk is dropped. Each chunk is evaluated from an empty cache with
its first token replaced by BOS; only the second half is scored: the logits at positions
n_ctx/2 .. n_ctx-2 predict the tokens after them. The running perplexity after each chunk is
exp(total negative log-likelihood / tokens scored so far).

Its uncertainty is llama-perplexity's: the standard error of the mean negative log-likelihood
over the N tokens scored, sqrt((mean(nll^2) - mean(nll)^2) / (N - 1)), carried to the
perplexity by its derivative (d exp(m) = exp(m) dm): ppl_error = ppl * that standard error.
"""

from __future__ import annotations

import math
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
    ppl_error: float | None  # its standard error (ppl_estimate); None while it is undefined
    nll: float  # this chunk's summed negative log-likelihood (nats)
    nll2: float  # this chunk's summed squared negative log-likelihood (nats^2)
    n_scored: int  # tokens scored in this chunk


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits (n, n_vocab) float32, targets (n,) -> -log p(target) per row, float64 (n,)."""
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(axis=1)) + m[:, 0]  # (n,)
    return lse - z[np.arange(len(targets)), targets]


def ppl_estimate(nll: float, nll2: float, n: int) -> tuple[float, float | None]:
    """(perplexity, its standard error) from the sums over n scored tokens of the negative
    log-likelihood (nll, nats) and of its square (nll2). The error is None where llama.cpp prints
    none: fewer than 2 tokens, or a variance that rounds to zero or below.
    Source: llama.cpp tools/perplexity/perplexity.cpp, the "Final estimate" lines."""
    mean = nll / n
    ppl = math.exp(mean)
    var = nll2 / n - mean * mean  # variance of the per-token nll
    if n < 2 or var <= 0:
        return ppl, None
    return ppl, ppl * math.sqrt(var / (n - 1))


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
        raise UsageError(f"the text has {len(tokens)} tokens; perplexity in chunks of {n_ctx} (-c) needs at least "
                         f"{2 * n_ctx}; give a longer text or a smaller -c")
    first = n_ctx // 2
    total_nll, total_nll2, total_n = 0.0, 0.0, 0
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])  # (n_ctx,)
        if bos_id is not None:
            chunk[0] = bos_id
        backend.reset()
        logits = backend.eval(chunk, all_logits=True)  # (n_ctx, n_vocab)
        targets = np.asarray(tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx])  # (n_ctx - first - 1,)
        per_token = log_softmax_nll(logits[first : n_ctx - 1], targets)  # (n_ctx - first - 1,) nats
        nll, nll2 = float(per_token.sum()), float((per_token * per_token).sum())
        total_nll, total_nll2, total_n = total_nll + nll, total_nll2 + nll2, total_n + len(targets)
        ppl, err = ppl_estimate(total_nll, total_nll2, total_n)
        yield ChunkResult(i, n_chunks, ppl, err, nll, nll2, len(targets))
