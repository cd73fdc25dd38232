"""Options shared by several commands (llama.cpp's spellings) and model/session loading."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from k4.runtime.errors import UsageError
from k4.runtime.model import SAMPLE_MODEL


ModelOpt = Annotated[Optional[Path], typer.Option("-m", "--model", help="GGUF model file (default: the bundled sample).", show_default=False)]
BackendOpt = Annotated[str, typer.Option("--backend", help="auto (cuda when a GPU is present), numpy or cuda.")]
CtxOpt = Annotated[int, typer.Option("-c", "--ctx-size", help="Context size in tokens (0 = the model's training context, at most 4096).")]
NPredictOpt = Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate (-1 = until end of text or a full context).")]
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature (0 = greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k sampling (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (nucleus) sampling, in (0, 1] (1 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p sampling, in [0, 1] (0 = off).")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for repeated tokens (1 = off).")]
RepeatLastNOpt = Annotated[int, typer.Option("--repeat-last-n", help="How many recent tokens the repeat penalty looks at.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed (-1 = pick one).")]
NoBosOpt = Annotated[bool, typer.Option("--no-bos", help="Do not add the BOS token even if the model asks for it.")]
FileOpt = Annotated[Optional[Path], typer.Option("-f", "--file", help="Read the text from this file.", show_default=False)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Print per-phase timing and copy-traffic tables.")]


def model_path(model: Optional[Path]) -> Path:
    """The -m path, or the bundled sample model. Raises UsageError when neither exists."""
    if model is not None:
        return model
    if not SAMPLE_MODEL.exists():
        raise UsageError(f"no -m MODEL given and the bundled sample {SAMPLE_MODEL} is missing; pass -m MODEL")
    return SAMPLE_MODEL


def read_text(text: Optional[str], file: Optional[Path], what: str = "prompt") -> str:
    """TEXT argument, else -f FILE, else piped stdin. Raises UsageError if none or both."""
    if text is not None and file is not None:
        raise UsageError(f"give the {what} either as an argument or with -f, not both")
    if file is not None:
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read {file}: {getattr(exc, 'strerror', None) or exc}") from None
    if text is not None:
        return text
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise UsageError(f"no {what}: pass it as an argument, with -f FILE, or on stdin")


def check_n_predict(n_predict: int) -> None:
    """Raise UsageError for -n values below -1."""
    if n_predict < -1:
        raise UsageError(f"-n {n_predict} is invalid; use -1 (until end of text) or a number of tokens >= 0")


def resolve_seed(seed: int) -> int:
    return int.from_bytes(os.urandom(4), "little") if seed < 0 else seed


@dataclass
class Session:
    """A loaded model ready to generate: file, tokenizer, backend, and the load time (ms)."""

    mf: object
    tokenizer: object
    backend: object
    load_ms: float


PROGRESS_MIN_BYTES = 100 * 2**20  # models smaller than this load without a progress bar


def load_session(model: Optional[Path], backend: str, ctx_size: int) -> Session:
    """Open, validate and load a model on a backend (a progress bar on stderr for models over
    100 MiB). Raises K4Error subclasses on bad input."""
    from k4.runtime.backend import make_backend
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer

    from .render import progress_bar

    t0 = time.perf_counter()
    mf = open_model(model_path(model))
    tok = Tokenizer.from_model(mf)
    with progress_bar(f"loading {mf.path.name}", min_bytes=PROGRESS_MIN_BYTES) as update:
        be = make_backend(mf, backend, ctx_size, progress=update)
    return Session(mf, tok, be, (time.perf_counter() - t0) * 1e3)
