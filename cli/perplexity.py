"""`k4 perplexity`: llama.cpp's perplexity protocol over a text file."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from . import common as c
from .render import err, errors_to_exit, json_text

# -c is the chunk length, as llama-perplexity's n_ctx; 512 by default, the length llama.cpp's
# published wikitext perplexities use, so figures compare without options
ChunkOpt = Annotated[int, typer.Option("-c", "--ctx-size", help=f"Chunk length in tokens: the context each chunk is scored in "
                                                                f"(0 = {c.CTX_HELP}).")]


@errors_to_exit
def perplexity(
    file: c.FileOpt = None,
    model: c.ModelOpt = None,
    ctx_size: ChunkOpt = 512,
    backend: c.BackendOpt = "auto",
    cache_type_k: c.CacheTypeKOpt = "f16",
    cache_type_v: c.CacheTypeVOpt = "f16",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (running perplexity per chunk, PPL, its error) at the end.")] = False,
) -> None:
    """Perplexity of the text in -f FILE, in chunks of -c tokens (llama-perplexity's protocol).

    Prints llama-perplexity's lines: `[1]12.3456,[2]11.9876,...` as each chunk completes, then
    `Final estimate: PPL = x +/- err` (err: runtime.perplexity.ppl_estimate)."""
    from k4.runtime.errors import UsageError
    from k4.runtime.flags import Flags
    from k4.runtime.perplexity import perplexity as run_ppl

    if file is None:
        raise UsageError("perplexity needs a text file: pass -f FILE")
    kv = c.kv_types(cache_type_k, cache_type_v)
    text = c.read_text(None, file, "text")
    flags = Flags()  # parsed (and a malformed value refused) before the model loads, as in run/chat/bench
    for warning in flags.warnings():
        err.print(f"warning: {warning}", style="yellow", markup=False)
    s = c.load_session(model, backend, ctx_size, flags, kv)
    ctx_size = s.backend.n_ctx  # -c 0: fit_context's, as run and chat take it
    tokens = s.tokenizer.encode(text)
    add_bos = s.tokenizer.add_bos and s.tokenizer.bos_id is not None
    err.print(f"{len(tokens)} tokens, {len(tokens) // ctx_size} chunks of {ctx_size}", style="dim")
    results = []
    for r in run_ppl(s.backend, tokens, ctx_size, s.tokenizer.bos_id if add_bos else None):
        results.append(r)
        if not as_json:
            sys.stdout.write(f"[{r.index + 1}]{r.ppl:.4f},")
            sys.stdout.flush()
    last = results[-1]
    if as_json:
        sys.stdout.write(json_text(_record(c.model_path(model), s, len(tokens), results)) + "\n")
    elif last.ppl_error is None:
        sys.stdout.write(f"\nFinal estimate: PPL = {last.ppl:.4f}\n")
    else:
        sys.stdout.write(f"\nFinal estimate: PPL = {last.ppl:.4f} +/- {last.ppl_error:.5f}\n")


def _record(path, s: c.Session, n_tokens: int, results: list) -> dict:
    """The --json object: the running perplexity after each chunk, the final one and its
    standard error (null where undefined), and the token counts."""
    last = results[-1]
    return {
        "model": str(path),
        "backend": s.backend.name,
        "n_ctx": s.backend.n_ctx,
        "type_k": s.backend.kv_types.k,
        "type_v": s.backend.kv_types.v,
        "n_tokens": n_tokens,
        "n_chunks": len(results),
        "n_scored": sum(r.n_scored for r in results),
        "chunks": [r.ppl for r in results],
        "ppl": last.ppl,
        "ppl_error": last.ppl_error,
    }


def register(app: typer.Typer) -> None:
    app.command("perplexity")(perplexity)
