"""Sampling parameters and the host (numpy) sampler.

The chain, in llama.cpp's default order: repeat penalty over the last `repeat_last_n` tokens
(llama.cpp's rule: a positive logit is divided by the penalty, a negative one multiplied),
then top-k, top-p (nucleus, on the softmax at temperature 1), min-p (relative to the most
probable token), temperature, and a draw. `temperature <= 0` is greedy (argmax, first index
on ties). The draw uses `uniform(seed, step)`, a counter-based generator (splitmix64), so the
CUDA sampler draws the same numbers without any state: same seed, same output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .errors import UsageError

MASK64 = (1 << 64) - 1
SEED_MULTIPLIER = 0x100000001B3  # uniform()'s seed mix (the 64-bit FNV prime); sampling.cu gets seed * it


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults. top_k <= 0 disables top-k; top_p = 1 and min_p = 0 disable theirs."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0

    def validate(self) -> "SamplingParams":
        """Raise UsageError naming the valid range of the first out-of-range value."""
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise UsageError(f"--temp {self.temperature} is invalid; use a value >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p {self.top_p} is invalid; use a value in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"--min-p {self.min_p} is invalid; use a value in [0, 1]")
        if not np.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise UsageError(f"--repeat-penalty {self.repeat_penalty} is invalid; use a value > 0 (1 = off)")
        if self.repeat_last_n < 0:
            raise UsageError(f"--repeat-last-n {self.repeat_last_n} is invalid; use a value >= 0")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes).validate()


def splitmix64(x: int) -> int:
    """One splitmix64 output for state x (Steele, Lea, Flood 2014), 64-bit unsigned."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform float in [0, 1) for draw number `step` under `seed` (53 random bits)."""
    return (splitmix64((seed * SEED_MULTIPLIER + step) & MASK64) >> 11) * (1.0 / (1 << 53))


def apply_repeat_penalty(logits: np.ndarray, history: Sequence[int], penalty: float, last_n: int) -> np.ndarray:
    """logits: (n_vocab,) float32 -> a penalized copy. Each distinct id in the last `last_n`
    tokens of `history` is penalized once."""
    if penalty == 1.0 or last_n == 0 or not history:
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(history[-last_n:], dtype=np.int64))
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a non-greedy draw can pick from logits (n_vocab,) float32 (already penalized)
    and their weights: (ids int64, weights float64 > 0), most likely first, after top-k, top-p
    and min-p, weights exp((logit - max) / temperature) (not normalized)."""
    order = np.argsort(-logits, kind="stable")  # (n_vocab,) ids, most likely first
    if params.top_k > 0:
        order = order[: params.top_k]
    top = logits[order].astype(np.float64)  # (k,)
    p = np.exp(top - top[0])
    p /= p.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), params.top_p) + 1)
        order, top, p = order[:keep], top[:keep], p[:keep]
    if params.min_p > 0.0:
        keep = int(np.count_nonzero(p >= params.min_p * p[0]))
        order, top = order[: max(keep, 1)], top[: max(keep, 1)]
    return order, np.exp((top - top[0]) / params.temperature)


def draw(order: np.ndarray, weights: np.ndarray, u: float) -> int:
    """The id of `order` whose cumulative weight interval holds u * total, u in [0, 1)."""
    cdf = np.cumsum(weights)
    return int(order[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(order) - 1)])


def sample(logits: np.ndarray, params: SamplingParams, history: Sequence[int], step: int) -> int:
    """Pick the next token id from logits (n_vocab,) float32. `step` numbers the draw for the RNG."""
    logits = apply_repeat_penalty(logits.astype(np.float32, copy=False), history, params.repeat_penalty, params.repeat_last_n)
    if params.greedy:
        return int(np.argmax(logits))
    order, weights = candidates(logits, params)
    return draw(order, weights, uniform(params.seed, step))
