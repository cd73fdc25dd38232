"""`k4 perplexity`: llama.cpp's perplexity protocol over a text file."""

from __future__ import annotations

import typer

from . import common as c
from .render import err, errors_to_exit, out


@errors_to_exit
def perplexity(
    file: c.FileOpt = None,
    model: c.ModelOpt = None,
    ctx_size: c.CtxOpt = 512,
    backend: c.BackendOpt = "auto",
) -> None:
    """Perplexity of the text in -f FILE, in chunks of -c tokens (llama-perplexity's protocol)."""
    from k4.runtime.errors import UsageError
    from k4.runtime.perplexity import perplexity as run_ppl

    if file is None:
        raise UsageError("perplexity needs a text file: pass -f FILE")
    text = c.read_text(None, file, "text")
    s = c.load_session(model, backend, ctx_size)
    ctx_size = s.backend.n_ctx  # -c 0: the model's training context
    tokens = s.tokenizer.encode(text)
    add_bos = s.tokenizer.add_bos and s.tokenizer.bos_id is not None
    err.print(f"{len(tokens)} tokens, {len(tokens) // ctx_size} chunks of {ctx_size}", style="dim")
    last = None
    for r in run_ppl(s.backend, tokens, ctx_size, s.tokenizer.bos_id if add_bos else None):
        out.print(f"[{r.index + 1}]{r.ppl:.4f}", markup=False)
        last = r
    out.print(f"Final estimate: PPL = {last.ppl:.4f}", markup=False)


def register(app: typer.Typer) -> None:
    app.command("perplexity")(perplexity)
