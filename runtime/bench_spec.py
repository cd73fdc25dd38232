"""The speculative-decoding tests of `k4 bench` (runtime/bench.py runs them):

- tvN: the verify step of N tokens (one forward pass of N rows, greedy acceptance on the
  device, N random ids so almost every draft is rejected and the cache grows by one per step).
  Reported as tokens verified per second, and as the ratio of its median step time to the
  median of one-token verify steps timed alternately in the same run: what speculation can
  gain at most is N over that ratio. The same ratio of device times (CUDA events around each
  step's work, runtime/cuda/timer.py) where the backend records them: the host-timed ratio
  moves by a few percent between runs, the device-timed one much less (docs/PERF.md, session 45).
- tgN with --lookup: generation with prompt lookup where every draft is right: the drafter has
  seen the model's own greedy continuation (computed untimed first), as when a model repeats
  a text it was given. The upper bound of prompt lookup's speed-up.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import numpy as np

from .sampling import SamplingParams
from .speculative import LookupDrafter, Speculator

GREEDY = SamplingParams(temperature=0.0)
VERIFY_STEPS = 24  # verify steps of each size per repetition


class PrimedLookup:
    """Prompt lookup over a primer text followed by the context."""

    def __init__(self, primer: Sequence[int], ngram: int):
        self.primer, self.lookup = list(primer), LookupDrafter(ngram)

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        return self.lookup.draft(self.primer + list(context), k)


def run_verify(backend, n: int, prompt: list[int], n_vocab: int, seed: int,
               clock: Callable[[], float]) -> tuple[float, dict]:
    """VERIFY_STEPS verify steps of n random tokens after prompt, alternating with one-token
    steps. Returns (tokens/s of the n-token steps, {"verify_ms", "verify1_ms", "verify_ratio"}, and
    where backend.trace.gpu_steps["verify"] gains a device time for each of those steps,
    "verify_gpu_ms", "verify1_gpu_ms", "verify_gpu_ratio" of their medians). A step's device time
    lands once its end event is seen done (runtime/cuda/timer.py collect, at a later call), so the
    last step's may be missing, and the eval before the steps collects any earlier run's last."""
    rng = np.random.default_rng(seed)
    backend.eval(prompt)
    trace = getattr(backend, "trace", None)
    first = len(trace.gpu_steps.get("verify", [])) if trace is not None else 0
    times: dict[int, list[float]] = {n: [], 1: []}
    for i in range(VERIFY_STEPS):
        for size in (n, 1):
            batch = rng.integers(3, n_vocab, size=size).tolist()
            t0 = clock()
            backend.verify(batch)
            times[size].append(clock() - t0)
    step, step1 = statistics.median(times[n]), statistics.median(times[1])
    out = {"verify_ms": step * 1e3, "verify1_ms": step1 * 1e3, "verify_ratio": step / step1}
    device = trace.gpu_steps.get("verify", [])[first:] if trace is not None else []  # ms: n, 1, n, 1, ...
    if len(device) in (2 * VERIFY_STEPS - 1, 2 * VERIFY_STEPS) and all(ms > 0 for ms in device):
        gpu, gpu1 = statistics.median(device[0::2]), statistics.median(device[1::2])
        out.update(verify_gpu_ms=gpu, verify1_gpu_ms=gpu1, verify_gpu_ratio=gpu / gpu1)
    return n / step, out


def run_lookup(backend, prompt: list[int], n_gen: int, ngram: int, draft_max: int,
               clock: Callable[[], float]) -> tuple[float, list[float], dict]:
    """tgN with prompt lookup primed with the model's greedy continuation of prompt. Returns
    (tokens/s, per-token ms as run_once measures them, the speculation counters)."""
    gen = backend.generate(prompt, GREEDY)
    try:
        reference = [next(gen) for _ in range(n_gen)]
    finally:
        gen.close()
    backend.reset()
    spec = Speculator(PrimedLookup(prompt + reference, ngram), draft_max)
    t0 = t_prev = clock()
    token_ms: list[float] = []
    gen = spec.generate(backend, prompt, GREEDY)
    try:
        for i in range(n_gen):
            next(gen)
            t = clock()
            if i:
                token_ms.append((t - t_prev) * 1e3)
            t_prev = t
        elapsed = clock() - t0
    finally:
        gen.close()
    st = spec.stats
    return n_gen / elapsed, token_ms, {"draft_steps": st.steps, "draft_tokens": st.drafted, "draft_accepted": st.accepted,
                                       "tokens_per_step": st.tokens_per_step}
