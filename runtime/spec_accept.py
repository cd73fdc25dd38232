"""Speculative decoding's acceptance rules on the host, for drafts that are single token ids
(a prompt-lookup match, or a draft model decoding greedily): the proposal distribution of a
draft is a point mass, which makes the standard rule simple.

Source: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", and Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling": draft d is accepted with probability min(1, p(d) / q(d)); on rejection the token is
drawn from norm(max(0, p - q)). With q the point mass on d that is: accept with probability
p(d), else draw from p with d removed and renormalized. Each emitted token is then distributed
exactly as p, the distribution the plain sampler draws from (runtime/sampling.py); the draws
use different random numbers, so one seed gives another text than without speculation. Greedy
decoding accepts d exactly when d is the argmax, so its output is the plain greedy output.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling import SamplingParams, apply_repeat_penalty, candidates, draw, sample, uniform


def accept_greedy(ids: Sequence[int], best: Sequence[int]) -> list[int]:
    """ids: [t, d_1 .. d_k] the evaluated tokens; best: the argmax after each of them (k + 1).
    Returns d_1 .. d_m, the longest run of drafts with d_i == best[i - 1], then best[m]."""
    m = 0
    while m + 1 < len(ids) and ids[m + 1] == best[m]:
        m += 1
    return [int(t) for t in ids[1 : m + 1]] + [int(best[m])]


def accept_sampled(logits: np.ndarray, ids: Sequence[int], params: SamplingParams, history: Sequence[int],
                   step: int) -> tuple[list[int], int]:
    """The sampled rule over logits (k + 1, n_vocab) float32, row i the logits after ids[i]
    (ids = [t, d_1 .. d_k]); history: the tokens before ids[0] for the repeat penalty (t's row
    sees history + [t], d_i's row history + ids[: i + 1]). step: the draw number of the first
    random number; returns (emitted ids: the accepted drafts then one drawn token, the next
    draw number). Greedy params take accept_greedy's rule on the penalized logits."""
    out: list[int] = []
    recent = list(history[max(0, len(history) - params.repeat_last_n) :])  # all the penalty can see of it
    for i in range(len(ids)):
        seen = recent + list(ids[: i + 1])
        row = logits[i]
        if i + 1 == len(ids):  # every draft accepted: the last row's token, as the plain sampler draws it
            out.append(sample(row, params, seen, step))
            return out, step + 1
        d = int(ids[i + 1])
        if params.greedy:
            best = sample(row, params, seen, step)
            if best != d:
                return out + [best], step
            out.append(d)
            continue
        order, weights = candidates(apply_repeat_penalty(row.astype(np.float32, copy=False), seen,
                                                         params.repeat_penalty, params.repeat_last_n), params)
        hit = np.flatnonzero(order == d)
        p_d = float(weights[hit[0]] / weights.sum()) if hit.size else 0.0
        u = uniform(params.seed, step)
        step += 1
        if u < p_d:
            out.append(d)
            continue
        rest = weights.copy()
        rest[hit] = 0.0  # p with d removed; not empty, since p_d < 1
        out.append(draw(order, rest, uniform(params.seed, step)))
        return out, step + 1
    raise AssertionError("unreachable: the loop returns at its last row")
