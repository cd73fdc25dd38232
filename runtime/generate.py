"""The generation loop: prompt ids in, streamed text out, with stop conditions and stats.

Works with any backend (runtime/backend.py). The KV cache is reused: only the prompt tokens
that differ from what the backend has cached are evaluated (chat turns share their prefix).
Stops on an end-of-generation token, a user stop string (the text before it is kept, the
stop string is not), the token budget, or a full context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from .backend import Backend
from .errors import ContextFullError
from .sampling import SamplingParams


@dataclass
class GenerationResult:
    """What one `Generator.stream` call produced. Times in milliseconds."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # generated ids, the stop token excluded
    prompt_tokens: int = 0  # prompt length
    prefill_tokens: int = 0  # prompt tokens actually evaluated (the rest came from the cache)
    prompt_ms: float = 0.0  # prefill and first sample
    gen_ms: float = 0.0  # every later token
    stop_reason: str = ""  # "eog", "stop", "length", "context"

    @property
    def prompt_tps(self) -> Optional[float]:
        """Prompt tokens evaluated per second, None where no prompt was evaluated (-n 0) or its
        time is zero."""
        evaluated = bool(self.token_ids) or self.stop_reason == "eog"
        return self.prefill_tokens / (self.prompt_ms / 1e3) if evaluated and self.prompt_ms > 0 else None

    @property
    def gen_tps(self) -> Optional[float]:
        """Generated tokens per second after the first (which is timed with the prompt), None for
        fewer than two tokens or a zero time."""
        n = len(self.token_ids) - 1
        return n / (self.gen_ms / 1e3) if n > 0 and self.gen_ms > 0 else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b (lists of int) share. Runs on slice comparisons (C loops):
    one when the shorter is a prefix of the longer, else a bisection on the first difference,
    about 2 min(len) element comparisons; speculative decoding asks it every verify step over
    contexts of up to n_ctx tokens."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class StopMatcher:
    """Holds back streamed text that could still become one of the stop strings."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, stopped)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generator:
    """Streams text from a backend and a tokenizer (runtime.tokenizer.Tokenizer)."""

    def __init__(self, backend: Backend, tokenizer, speculator=None):
        """speculator: a runtime.speculative.Speculator to generate with speculative decoding
        (None: the backend's own generate)."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.speculator = speculator
        self.result = GenerationResult()

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n_predict: int = -1,
        stop: Sequence[str] = (),
    ) -> Iterator[str]:
        """Yield text pieces as they are generated; `self.result` holds the totals after.

        n_predict < 0 generates until an end-of-generation token or a full context.
        Raises ContextFullError when the prompt alone does not fit in the context.
        """
        be, tok = self.backend, self.tokenizer
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        if len(prompt_ids) >= be.n_ctx:
            raise ContextFullError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {be.n_ctx}; raise --ctx-size or shorten the prompt"
            )
        keep = be.reusable(min(common_prefix(be.tokens, prompt_ids), len(prompt_ids) - 1))
        be.truncate(keep)
        res = self.result = GenerationResult(prompt_tokens=len(prompt_ids), prefill_tokens=len(prompt_ids) - keep)
        history = prompt_ids[:keep]
        budget = be.n_ctx - len(prompt_ids)  # every generated token gets a cache slot
        res.stop_reason = "context"
        if 0 <= n_predict <= budget:
            budget, res.stop_reason = n_predict, "length"
        decoder, stops = tok.stream_decoder(), StopMatcher(stop)
        t0 = time.perf_counter()
        t_first = None
        if self.speculator is not None:
            gen = self.speculator.generate(be, prompt_ids[keep:], params, history)
        else:
            gen = be.generate(prompt_ids[keep:], params, history)
        try:
            for _ in range(budget):
                token = next(gen)
                if t_first is None:
                    t_first = time.perf_counter()
                if tok.is_eog(token):
                    res.stop_reason = "eog"
                    break
                res.token_ids.append(token)
                with be.trace.in_phase("detokenize"):
                    text, stopped = stops.feed(decoder.add(token))
                if text:
                    res.text += text
                    yield text
                if stopped:
                    res.stop_reason = "stop"
                    break
            if res.stop_reason != "stop":
                text, stopped = stops.feed(decoder.flush())
                text += "" if stopped else stops.flush()
                res.stop_reason = "stop" if stopped else res.stop_reason
                if text:
                    res.text += text
                    yield text
        finally:
            gen.close()
            t_end = time.perf_counter()
            t_first = t_first or t_end
            res.prompt_ms = (t_first - t0) * 1e3
            res.gen_ms = (t_end - t_first) * 1e3
