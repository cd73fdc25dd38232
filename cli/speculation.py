"""The speculative-decoding options of `k4 run`, `k4 chat` and `k4 bench` (llama.cpp's
spellings: -md/--draft-model, --draft-max; --lookup N for prompt lookup), and the Speculator
they build (runtime/speculative.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from k4.runtime.errors import UsageError
from k4.runtime.speculative import DRAFT_LIMIT, DRAFT_MAX, LookupDrafter, ModelDrafter, Speculator, SpecStats, check_draft_vocab

DraftModelOpt = Annotated[Optional[Path], typer.Option(
    "-md", "--draft-model", help="Speculative decoding: a small GGUF model with the same vocabulary drafts tokens.",
    show_default=False)]
LookupOpt = Annotated[int, typer.Option(
    "--lookup", help="Speculative decoding with prompt lookup: draft from the text so far, n-grams up to N tokens (0 = off).")]
DraftMaxOpt = Annotated[int, typer.Option("--draft-max", help="Most draft tokens per verify step (speculative decoding).")]


def make_speculator(session, draft_model: Optional[Path], lookup: int, draft_max: int = DRAFT_MAX,
                    flags=None) -> Optional[Speculator]:
    """The Speculator for the options, or None when neither --draft-model nor --lookup is given.
    The draft model is loaded on the target's backend kind with the target's context. Raises
    UsageError for both options at once, a negative --lookup or --draft-max, or a draft model
    whose vocabulary differs; K4Error subclasses for a bad draft file."""
    if lookup < 0:
        raise UsageError(f"--lookup {lookup} is invalid; use an n-gram size of at least 1 (0 = off)")
    if not 0 <= draft_max <= DRAFT_LIMIT:
        raise UsageError(f"--draft-max {draft_max} is invalid; use 0 to {DRAFT_LIMIT} tokens")
    if draft_model is not None and lookup:
        raise UsageError("--draft-model and --lookup are two ways to draft; give one of them")
    if lookup:
        return Speculator(LookupDrafter(lookup), draft_max)
    if draft_model is None:
        return None
    from k4.runtime.backend import make_backend
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer

    mf = open_model(draft_model)
    check_draft_vocab(session.tokenizer.tokens, Tokenizer.from_model(mf).tokens)
    backend = make_backend(mf, session.backend.name, session.backend.n_ctx, flags=flags)
    return Speculator(ModelDrafter(backend), draft_max)


def spec_text(stats: SpecStats) -> str:
    """The stats-line part of speculative decoding: acceptance rate and tokens per verify step."""
    if not stats.steps:
        return "draft: no verify step"
    acc = "-" if stats.acceptance is None else f"{100 * stats.acceptance:.1f}%"
    return f"draft: {stats.accepted}/{stats.drafted} accepted ({acc}), {stats.tokens_per_step:.2f} tok/step"
