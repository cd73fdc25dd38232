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
from k4.runtime.kv_types import CACHE_TYPES, F16, KVTypes
from k4.runtime.model import SAMPLE_MODEL

from .render import valid_text


ModelOpt = Annotated[Optional[Path], typer.Option("-m", "--model", help="GGUF model file (default: the bundled sample).", show_default=False)]
BackendOpt = Annotated[str, typer.Option("--backend", help="auto (cuda when a GPU is present), numpy or cuda.")]
CTX_HELP = ("the model's training context, or the largest multiple of 256 tokens whose KV cache fits in free "
            "memory beside the weights")
GenCtxOpt = Annotated[Optional[int], typer.Option(
    "-c", "--ctx-size", show_default=False, help=f"Context size in tokens (default 0: {CTX_HELP}).")]
NPredictOpt = Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate (-1 = until end of text or a full context).")]
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature (0 = greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k sampling (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (nucleus) sampling, in (0, 1] (1 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p sampling, in [0, 1] (0 = off).")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for repeated tokens (1 = off).")]
RepeatLastNOpt = Annotated[int, typer.Option("--repeat-last-n", help="How many recent tokens the repeat penalty looks at.")]
SeedOpt = Annotated[int, typer.Option("-s", "--seed", help="Random seed (-1 = pick one; the seed used is printed).")]
NoBosOpt = Annotated[bool, typer.Option("--no-bos", help="Do not add the BOS token even if the model asks for it.")]
FileOpt = Annotated[Optional[Path], typer.Option("-f", "--file", help="Read the text from this file.", show_default=False)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Print per-phase timing and copy-traffic tables.")]
CacheTypeKOpt = Annotated[str, typer.Option("-ctk", "--cache-type-k", help=f"KV cache type of the keys: {', '.join(CACHE_TYPES)}.")]
CacheTypeVOpt = Annotated[str, typer.Option("-ctv", "--cache-type-v", help=f"KV cache type of the values: {', '.join(CACHE_TYPES)}.")]


def kv_types(cache_type_k: str, cache_type_v: str) -> KVTypes:
    """The KVTypes of -ctk and -ctv. Raises UsageError (one line, the choices) for an unknown type."""
    return KVTypes(cache_type_k, cache_type_v)


def model_path(model: Optional[Path]) -> Path:
    """The -m path, or the bundled sample model. Raises UsageError when neither exists."""
    if model is not None:
        return model
    if not SAMPLE_MODEL.exists():
        raise UsageError(f"no -m MODEL given and the bundled sample {SAMPLE_MODEL} is missing; pass -m MODEL")
    return SAMPLE_MODEL


MAX_TEXT_BYTES = 64 * 2**20  # the most k4 reads of a prompt, text file, system prompt or stdin


def _read_capped(fh, name: str) -> str:
    """At most MAX_TEXT_BYTES of a binary stream, decoded as UTF-8. Raises UsageError when there
    is more or it is not UTF-8."""
    data = fh.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise UsageError(f"{name} holds more than {MAX_TEXT_BYTES // 2**20} MiB of text; k4 reads text inputs of at most that size")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"cannot read {name}: not UTF-8 text (byte {exc.start:,} is 0x{data[exc.start]:02x}); convert it to UTF-8") from None


def stdin_piped() -> bool:
    """Whether stdin is open and not a terminal (a pipe or a file)."""
    return sys.stdin is not None and not sys.stdin.closed and not sys.stdin.isatty()


def read_text(text: Optional[str], file: Optional[Path], what: str = "prompt") -> str:
    """TEXT argument (bytes of argv that are not UTF-8 become U+FFFD), else -f FILE, else piped
    stdin. Raises UsageError if none or both, or when the file or stdin is not UTF-8 or holds
    more than MAX_TEXT_BYTES."""
    if text is not None and file is not None:
        raise UsageError(f"give the {what} either as an argument or with -f, not both")
    if file is not None:
        try:
            with open(file, "rb") as fh:
                return _read_capped(fh, str(file))
        except OSError as exc:
            raise UsageError(f"cannot read {file}: {exc.strerror or exc}") from None
    if text is not None:
        return valid_text(text)
    if stdin_piped():
        return _read_capped(sys.stdin.buffer, "stdin")
    raise UsageError(f"no {what}: pass it as an argument, with -f FILE, or on stdin")


def read_prompt(positional: Optional[str], option: Optional[str], file: Optional[Path]) -> str:
    """The prompt from exactly one of: the PROMPT argument, -p TEXT, -f FILE (else piped stdin).
    Raises UsageError when two are given, none is, or the file cannot be read."""
    given = [name for name, value in (("as an argument", positional), ("with -p", option), ("with -f", file)) if value is not None]
    if len(given) > 1:
        raise UsageError(f"the prompt was given {' and '.join(given)}; give it once: PROMPT, -p TEXT or -f FILE")
    return read_text(option if option is not None else positional, file)


def check_n_predict(n_predict: int) -> None:
    """Raise UsageError for -n values below -1."""
    if n_predict < -1:
        raise UsageError(f"-n {n_predict} is invalid; use -1 (until end of text) or a number of tokens >= 0")


def resolve_seed(seed: int) -> int:
    """The seed to use: `seed` itself when >= 0, else a random one (32 bits from os.urandom)."""
    return int.from_bytes(os.urandom(4), "little") if seed < 0 else seed


@dataclass
class Session:
    """A loaded model ready to generate: file, tokenizer, backend, and the load time (ms)."""

    mf: object
    tokenizer: object
    backend: object
    load_ms: float


PROGRESS_MIN_BYTES = 100 * 2**20  # models smaller than this load without a progress bar


MAX_CTX = 2**31 - 1  # llama.cpp's n_ctx is a uint32; past this no model has memory anyway


def check_ctx_size(ctx_size: Optional[int]) -> None:
    """Raise UsageError for a negative -c or one over MAX_CTX (the backends check larger ones
    against memory before allocating)."""
    if ctx_size is not None and ctx_size < 0:
        raise UsageError(f"--ctx-size {ctx_size} is invalid; use a positive number of tokens, or 0 for the model's training context")
    if ctx_size is not None and ctx_size > MAX_CTX:
        raise UsageError(f"--ctx-size {ctx_size} is too large; use at most {MAX_CTX:,} tokens")


def resolve_ctx(ctx_size: Optional[int], mf, kind: str, flags=None, kv: KVTypes = F16) -> tuple[int, Optional[str]]:
    """(context size in tokens, note or None) for -c on backend `kind` ("cuda" or "numpy"):
    -c itself, or for None and 0 runtime.backend.fit_context's: the model's training context
    when its KV cache fits in free memory (GPU memory or RAM) beside the weights and buffers,
    else the largest multiple of 256 tokens that does, with a one-line note of the numbers.
    The one place run, chat and perplexity take their context from; kv: the cache types the
    KV bytes per token are counted for. Raises UsageError for a negative -c or one over MAX_CTX."""
    from k4.runtime.backend import fit_context

    check_ctx_size(ctx_size)
    if ctx_size:
        return ctx_size, None
    return fit_context(mf, kind, flags, kv)


def ctx_warning(n_ctx: int, n_ctx_train: int) -> Optional[str]:
    """The one-line warning when a context of n_ctx tokens exceeds the training context, else None."""
    if n_ctx <= n_ctx_train:
        return None
    return (f"warning: --ctx-size {n_ctx} exceeds the model's training context of {n_ctx_train} tokens; "
            "output past it may degrade")


def load_session(model: Optional[Path], backend: str, ctx_size: Optional[int], flags=None, kv: KVTypes = F16) -> Session:
    """Open, validate and load a model on a backend with the context resolve_ctx gives for -c
    and a KV cache of types kv (-ctk, -ctv) (a warning on stderr when the context exceeds the
    training context; a progress bar on stderr for models over 100 MiB). Raises K4Error
    subclasses on bad input."""
    from k4.runtime.backend import make_backend, resolve_kind
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer

    from .render import err, progress_bar

    check_ctx_size(ctx_size)
    t0 = time.perf_counter()
    mf = open_model(model_path(model))
    kind = resolve_kind(backend)
    kv.check(mf.config.head_dim)
    n_ctx, note = resolve_ctx(ctx_size, mf, kind, flags, kv)
    warning = ctx_warning(n_ctx, mf.config.n_ctx_train)
    for line, style in ((note, "yellow"), (warning, "yellow")):
        if line:
            err.print(line, style=style, markup=False)
    tok = Tokenizer.from_model(mf)
    with progress_bar(f"loading {mf.path.name}", min_bytes=PROGRESS_MIN_BYTES) as update:
        be = make_backend(mf, kind, n_ctx, progress=update, status=lambda text: err.print(text, style="dim", markup=False),
                          flags=flags, kv_types=kv)
    return Session(mf, tok, be, (time.perf_counter() - t0) * 1e3)
