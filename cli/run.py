"""`k4 run`: generate text from a prompt, streamed to stdout; stats to stderr."""

from __future__ import annotations

import json
import sys
from typing import Annotated, List, Optional

import typer

from k4.runtime.flags import current as current_flags
from k4.runtime.sampling import SamplingParams

from . import common as c
from .render import err, errors_to_exit, memory_table, stats_line, trace_table


@errors_to_exit
def run(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt (or use -f FILE, or stdin).", show_default=False)] = None,
    model: c.ModelOpt = None,
    file: c.FileOpt = None,
    n_predict: c.NPredictOpt = -1,
    ctx_size: c.CtxOpt = 0,
    temp: c.TempOpt = 0.8,
    top_k: c.TopKOpt = 40,
    top_p: c.TopPOpt = 0.95,
    min_p: c.MinPOpt = 0.05,
    repeat_penalty: c.RepeatPenaltyOpt = 1.0,
    repeat_last_n: c.RepeatLastNOpt = 64,
    seed: c.SeedOpt = -1,
    no_bos: c.NoBosOpt = False,
    stop: Annotated[Optional[List[str]], typer.Option("--stop", help="Stop when this text appears (repeatable).")] = None,
    backend: c.BackendOpt = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, ids, counts, timings) instead of streaming.")] = False,
    verbose: c.VerboseOpt = False,
) -> None:
    """Generate text from PROMPT with a GGUF model."""
    from k4.runtime.generate import Generator

    flags = current_flags()
    for warning in flags.warnings():
        err.print(f"warning: {warning}", style="yellow")
    params = SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, c.resolve_seed(seed)).validate()
    c.check_n_predict(n_predict)
    text = c.read_text(prompt, file)
    s = c.load_session(model, backend, ctx_size)
    ids = s.tokenizer.encode(text, add_bos=False if no_bos else None)
    if not ids:
        ids = [s.tokenizer.bos_id] if s.tokenizer.bos_id is not None else []
    if not ids:
        from k4.runtime.errors import UsageError

        raise UsageError("the prompt is empty; give some text")
    gen = Generator(s.backend, s.tokenizer)
    if not as_json:
        sys.stdout.write(text)
    for piece in gen.stream(ids, params, n_predict, stop or ()):
        if not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    res = gen.result
    if as_json:
        sys.stdout.write(
            json.dumps(
                {
                    "model": str(c.model_path(model)),
                    "backend": s.backend.name,
                    "prompt": text,
                    "text": res.text,
                    "prompt_ids": ids,
                    "token_ids": res.token_ids,
                    "prompt_tokens": res.prompt_tokens,
                    "generated_tokens": len(res.token_ids),
                    "stop_reason": res.stop_reason,
                    "seed": params.seed,
                    "load_ms": round(s.load_ms, 3),
                    "prompt_ms": round(res.prompt_ms, 3),
                    "gen_ms": round(res.gen_ms, 3),
                    "prompt_tps": round(res.prompt_tps, 3),
                    "gen_tps": round(res.gen_tps, 3),
                },
                ensure_ascii=False,
            )
            + "\n"
        )
    else:
        sys.stdout.write("\n")
        err.print(stats_line(s.load_ms, res), style="dim")
        if res.stop_reason == "context":
            err.print(f"stopped: the context of {s.backend.n_ctx} tokens is full; raise --ctx-size for longer output", style="yellow")
    if verbose or flags.on("K4_TRACE"):
        err.print(trace_table(s.backend.trace))
        if hasattr(s.backend, "memory_report"):
            err.print(memory_table(s.backend.memory_report()))


def register(app: typer.Typer) -> None:
    app.command("run")(run)
