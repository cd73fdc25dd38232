"""Speculative decoding: draft a few tokens cheaply, verify them with one forward pass of the
target model, keep the ones it agrees with (Leviathan et al. 2023; Chen et al. 2023).

Drafts come from prompt lookup (`--lookup N`: the tokens that followed the latest earlier
occurrence of the text's last n-gram, Saxena 2023, llama.cpp's lookup example) or from a draft
model with the same vocabulary (`--draft-model`, decoding greedily). A verify step evaluates
[t, d_1 .. d_k] (t the last emitted token) as one batch, which reads the weights once: greedy
decoding runs the backend's verify() (argmax, acceptance and cache rollback on the device for
CUDA), so the output is the plain greedy output; sampling reads the rows' logits and applies
the speculative-sampling rule (runtime/spec_accept.py), so every token keeps the sampler's
distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

from .backend import Backend
from .errors import UsageError
from .generate import common_prefix
from .sampling import SamplingParams, sample
from .spec_accept import accept_sampled

DRAFT_MAX = 7  # --draft-max default: a verify step of 8 tokens
DRAFT_LIMIT = 63  # the most drafts a verify step takes: 64 tokens, within a prefill chunk's buffers
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)


class Drafter(Protocol):
    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k draft ids to follow context (every token so far, the last one included)."""


class LookupDrafter:
    """Prompt-lookup drafts: for n = ngram .. 1, find the latest earlier occurrence of the
    context's last n tokens and propose the k tokens that followed it (where they run past the
    context's end, the text is taken to repeat: the drafts so far continue it). An index per n
    maps each n-gram to where its latest occurrence ends; it grows with the context and is
    rebuilt when the context is not an extension of the one indexed (a new chat, an edit)."""

    def __init__(self, ngram: int):
        if ngram < 1:
            raise UsageError(f"--lookup {ngram} is invalid; use an n-gram size of at least 1")
        self.ngram = ngram
        self.ctx: list[int] = []
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram + 1)]  # [n]: n-gram -> end (exclusive)
        self.done = 0  # n-grams ending before ctx[done] are indexed

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        self._sync(context)
        ctx, L = self.ctx, len(self.ctx)
        for n in range(min(self.ngram, L - 1), 0, -1):
            end = self.index[n].get(tuple(ctx[L - n :]))
            if end is not None:  # what followed; past the context's end, the drafts so far (a repeating text)
                drafts: list[int] = []
                for j in range(end, end + k):  # j - L < len(drafts): end < L
                    drafts.append(ctx[j] if j < L else drafts[j - L])
                return drafts
        return []

    def _sync(self, context: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token of context."""
        if common_prefix(self.ctx, context) < len(self.ctx):
            self.ctx, self.done = [], 0
            self.index = [{} for _ in range(self.ngram + 1)]
        self.ctx.extend(context[len(self.ctx) :])
        for end in range(max(self.done, 1), len(self.ctx)):  # the n-grams ctx[end - n : end]
            for n in range(1, min(self.ngram, end) + 1):
                self.index[n][tuple(self.ctx[end - n : end])] = end
        self.done = max(self.done, len(self.ctx))


class ModelDrafter:
    """Drafts from a smaller model with the same vocabulary, decoding greedily on its own
    backend; its cache keeps what it shares with the context (common prefix)."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        be = self.backend
        keep = be.reusable(min(common_prefix(be.tokens, context), len(context) - 1))
        be.truncate(keep)
        k = min(k, be.n_ctx - len(context))  # the draft model's own cache holds context and k - 1 drafts
        if k <= 0:
            return []
        gen = be.generate(list(context[keep:]), GREEDY, list(context[:keep]))
        try:
            return [next(gen) for _ in range(k)]
        finally:
            gen.close()


def check_draft_vocab(target_tokens: Sequence[str], draft_tokens: Sequence[str], max_difference: int = 128) -> None:
    """Raise UsageError unless a draft model's vocabulary can stand for the target's: the same
    token text for every id both have, and sizes within max_difference (Qwen2.5 0.5B has 151,936
    ids and 7B 152,064: padding; llama.cpp's speculative example allows 128)."""
    n = min(len(target_tokens), len(draft_tokens))
    if abs(len(target_tokens) - len(draft_tokens)) > max_difference:
        raise UsageError(f"the draft model has {len(draft_tokens):,} tokens and the model {len(target_tokens):,}; "
                         "use a draft model with the same vocabulary")
    for i in range(n):
        if target_tokens[i] != draft_tokens[i]:
            raise UsageError(f"the draft model's token {i} is {draft_tokens[i]!r}, the model's {target_tokens[i]!r}; "
                             "use a draft model with the same vocabulary")


@dataclass
class SpecStats:
    """Counts over the verify steps of one or more generations."""

    steps: int = 0  # verify steps
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted; None before any draft."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts + the one the target adds); None before any step."""
        return (self.accepted + self.steps) / self.steps if self.steps else None


class Speculator:
    """Generates with speculative decoding on a target backend: `generate` has the contract of
    Backend.generate (runtime/backend.py) and is what runtime/generate.Generator calls."""

    def __init__(self, drafter: Drafter, draft_max: int = DRAFT_MAX):
        if not 0 <= draft_max <= DRAFT_LIMIT:
            raise UsageError(f"--draft-max {draft_max} is invalid; use 0 to {DRAFT_LIMIT} tokens")
        self.drafter, self.draft_max, self.stats = drafter, draft_max, SpecStats()

    def generate(self, be: Backend, token_ids: Sequence[int], params: SamplingParams,
                 history: Sequence[int] = ()) -> Iterator[int]:
        """Evaluate token_ids after the cached ones, then yield tokens forever, drafting up to
        draft_max per verify step. When closed, the cache holds token_ids and the tokens
        consumed except the last. Raises ContextFullError when the cache is full."""
        ids = [int(t) for t in token_ids]
        params.validate()
        context = list(history) + ids
        base = be.n_past  # cache length before ids
        step = 0  # the next draw number
        consumed = 0
        try:
            first = sample(be.eval(ids), params, context, step)
            step += 1
            consumed = 1
            yield first
            last = first
            device_greedy = params.greedy and params.repeat_penalty == 1.0
            while True:
                k = min(self.draft_max, be.n_ctx - be.n_past - 1)
                drafts = self.drafter.draft(context + [last], k) if k > 0 else []
                batch = [last] + drafts
                if device_greedy:
                    out = be.verify(batch)
                else:
                    n0 = be.n_past
                    out, step = accept_sampled(be.eval(batch, all_logits=True), batch, params, context, step)
                    be.truncate(n0 + len(out))  # t and the accepted drafts
                self.stats.steps += 1
                self.stats.drafted += len(drafts)
                self.stats.accepted += len(out) - 1
                context.append(last)
                for t in out:
                    consumed += 1
                    yield t
                context.extend(out[:-1])
                last = out[-1]
        finally:
            keep = base + len(ids) + consumed - 1
            if consumed and be.n_past > keep:
                be.truncate(keep)
