"""`k4 tokenize`: token ids (and pieces) of a text, like llama.cpp's llama-tokenize."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from . import common as c
from .render import errors_to_exit, out


@errors_to_exit
def tokenize(
    text: Annotated[Optional[str], typer.Argument(help="Text to tokenize (or -f FILE, or stdin).", show_default=False)] = None,
    model: c.ModelOpt = None,
    file: c.FileOpt = None,
    ids: Annotated[bool, typer.Option("--ids", help="Print only the ids, as a Python-style list.")] = False,
    no_bos: c.NoBosOpt = False,
    parse_special: Annotated[bool, typer.Option("--parse-special", help="Map special-token text (e.g. <|im_end|>) to its id.")] = False,
) -> None:
    """Print the tokens of TEXT: one `id -> 'piece'` line each, or the id list with --ids."""
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer

    body = c.read_text(text, file, "text")
    tok = Tokenizer.from_model(open_model(c.model_path(model), require_weights=False))
    token_ids = tok.encode(body, add_bos=False if no_bos else None, parse_special=parse_special)
    if ids:
        out.print(str(token_ids), markup=False)
        return
    for t in token_ids:
        out.print(f"{t:6d} -> {tok.piece(t)!r}", markup=False)


def register(app: typer.Typer) -> None:
    app.command("tokenize")(tokenize)
