"""The host sampler's draws against the exact filtered softmax, at temperatures other than 1.

The oracle is llama.cpp's default sampler chain (common/common.h, `samplers`: penalties, dry,
top_n_sigma, top_k, typical_p, top_p, min_p, xtc, temperature; then `dist` draws), written
again here in float64 from llama.cpp's src/llama-sampling.cpp:
  top-k   keeps the k largest logits;
  top-p   softmax over what is left (temperature 1: the temperature sampler comes later), then
          keeps the smallest prefix, most probable first, whose cumulative probability is >= p;
  min-p   keeps the tokens whose probability is >= min_p times the largest one, i.e. whose logit
          is >= max logit + log(min_p);
  temp    divides the logits by T; `dist` draws from their softmax.
runtime/sampling.py applies the same order (its docstring says so), so the draws must follow it.

Statistics: N draws (steps 0..N-1 of the counter-based RNG, fixed seed, so the test is
deterministic). A token's count is binomial(N, p); every count expected >= 25 must lie within 5
standard errors, sqrt(N p (1 - p)), of N p, and the rarer tokens are pooled into one bucket held
to the same rule (or, expected below 25, to a Poisson bound). Under the correct sampler one check
exceeds 5 SE with probability about 6e-7 (normal tail), so over the ~80 checks here a false
failure has odds below 1e-4; the seed is fixed anyway. Each case also checks that the same draws
lie beyond 10 SE of the distribution a sampler multiplying the logits by T (instead of dividing)
gives, so the bound is known to catch that bug.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from k4.runtime.sampling import SamplingParams, sample

N_DRAWS = 20_000
Z_LIMIT = 5.0
MIN_EXPECTED = 25  # draws; rarer tokens are pooled (see max_z)
SEED = 20261124

# 12 logits in a shuffled order (token id != rank), spaced so that no filter boundary is within
# 1e-3 of its threshold in any case below (asserted in expected_probs).
LOGITS = np.array([1.0, -2.0, 2.6, 0.1, 3.0, -0.3, 1.7, 2.2, -1.0, 0.5, 2.0, 1.2], np.float32)


def expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """The exact probability of each token that survives llama.cpp's chain (token id -> p), float64."""
    x = {i: float(v) for i, v in enumerate(logits)}
    ranked = sorted(x, key=lambda i: (-x[i], i))  # most likely first
    if top_k > 0:
        ranked = ranked[:top_k]
    if top_p < 1.0:
        z = sum(math.exp(x[i]) for i in ranked)
        cum, keep = 0.0, len(ranked)
        for n, i in enumerate(ranked, start=1):
            cum += math.exp(x[i]) / z
            assert abs(cum - top_p) > 1e-3, "a cumulative sum sits on the top-p threshold: pick other logits"
            if cum >= top_p:
                keep = n
                break
        ranked = ranked[:keep]
    if min_p > 0.0:
        floor = x[ranked[0]] + math.log(min_p)
        assert all(abs(x[i] - floor) > 1e-3 for i in ranked), "a logit sits on the min-p threshold: pick other logits"
        ranked = [i for i in ranked if x[i] >= floor]
    w = {i: math.exp(x[i] / temperature) for i in ranked}
    total = sum(w.values())
    return {i: w[i] / total for i in ranked}


def draw_counts(params: SamplingParams, n: int = N_DRAWS) -> np.ndarray:
    """How often each token id was drawn in draws 0..n-1: (n_vocab,) int64."""
    counts = np.zeros(LOGITS.size, np.int64)
    for step in range(n):
        counts[sample(LOGITS, params, [], step)] += 1
    return counts


def max_z(counts: np.ndarray, probs: dict[int, float]) -> float:
    """How far the counts are from `probs`, in standard errors: the largest
    |count - N p| / sqrt(N p (1 - p)) over the tokens whose expected count N p is >= MIN_EXPECTED,
    and over one bucket pooling the rarer ones (the normal approximation needs a count of that
    size). A pooled bucket expected below MIN_EXPECTED passes when its count is within the Poisson
    quantile of tail probability 1e-7 (returns 0 for it), else counts as inf. inf too when a token
    outside `probs` was drawn."""
    n = int(counts.sum())
    if any(counts[i] for i in range(counts.size) if i not in probs):
        return math.inf
    buckets = [([i], p) for i, p in probs.items() if n * p >= MIN_EXPECTED]
    rare = [i for i, p in probs.items() if n * p < MIN_EXPECTED]
    rare_p = sum(probs[i] for i in rare)
    worst = 0.0
    if rare and n * rare_p < MIN_EXPECTED:
        worst = 0.0 if sum(counts[i] for i in rare) <= poisson_upper(n * rare_p, 1e-7) else math.inf
    elif rare:
        buckets.append((rare, rare_p))
    for ids, p in buckets:
        if p < 1.0:
            worst = max(worst, abs(sum(counts[i] for i in ids) - n * p) / math.sqrt(n * p * (1 - p)))
    return worst


def poisson_upper(mean: float, tail: float) -> int:
    """The smallest k with P(X > k) < tail for X ~ Poisson(mean)."""
    k, pmf = 0, math.exp(-mean)
    cdf = pmf
    while 1.0 - cdf >= tail:
        k += 1
        pmf *= mean / k
        cdf += pmf
    return k


# (temperature, top_k, top_p, min_p): each filter alone and together, temperatures on both sides of 1
CASES = [
    (1.3, 0, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (0.5, 5, 1.0, 0.0),
    (1.5, 0, 0.8, 0.0),
    (2.0, 0, 1.0, 0.1),
    (0.7, 8, 0.9, 0.05),
    (3.0, 6, 0.95, 0.2),
]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", CASES)
def test_draws_follow_the_filtered_softmax(temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=SEED)
    probs = expected_probs(LOGITS, temperature, top_k, top_p, min_p)
    counts = draw_counts(params)
    assert max_z(counts, probs) < Z_LIMIT, (counts.tolist(), probs)
    # the bound has the power to see a sampler that multiplies by T: its distribution is > 5 SE away
    multiplied = expected_probs(LOGITS, 1.0 / temperature, top_k, top_p, min_p)
    assert max_z(counts, multiplied) > 2 * Z_LIMIT


@pytest.mark.parametrize("top_k, top_p, min_p, kept", [
    # ids by logit: 4 (3.0), 2 (2.6), 7 (2.2), 10 (2.0), 6 (1.7), 11 (1.2), 0 (1.0), 9 (0.5), 3, 5, 8, 1
    (4, 1.0, 0.0, {4, 2, 7, 10}),
    (0, 0.5, 0.0, {4, 2}),  # cumulative probability at T = 1: 0.307, 0.512 >= 0.5
    (0, 0.6, 0.0, {4, 2, 7}),  # ... 0.512, 0.650 >= 0.6
    (0, 1.0, 0.3, {4, 2, 7, 10}),  # p / p_max = exp(l - 3): 0.368 for l = 2.0 is in, 0.273 for 1.7 is out
    (0, 1.0, 0.25, {4, 2, 7, 10, 6}),  # 0.273 >= 0.25, 0.165 for 1.2 is out
])
def test_each_filter_excludes_exactly_its_tokens(top_k, top_p, min_p, kept):
    # a flat temperature (T = 4) so that every kept token is drawn often and an excluded one would be
    probs = expected_probs(LOGITS, 4.0, top_k, top_p, min_p)
    assert set(probs) == kept
    counts = draw_counts(SamplingParams(temperature=4.0, top_k=top_k, top_p=top_p, min_p=min_p, seed=SEED), 4000)
    assert {i for i in range(LOGITS.size) if counts[i]} == kept
