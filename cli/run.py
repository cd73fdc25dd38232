"""`k4 run`: generate text from a prompt, streamed to stdout; stats to stderr."""

from __future__ import annotations

import sys
from typing import Annotated, List, Optional

import typer

from k4.runtime.flags import Flags
from k4.runtime.sampling import SamplingParams

from . import common as c
from .speculation import DraftMaxOpt, DraftModelOpt, LookupOpt, make_speculator, spec_text
from .render import err, errors_to_exit, json_text, memory_table, stats_line, trace_table


@errors_to_exit
def run(
    prompt_arg: Annotated[Optional[str], typer.Argument(metavar="PROMPT", help="The prompt (or -p TEXT, -f FILE, or stdin).",
                                                        show_default=False)] = None,
    prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="The prompt (instead of the PROMPT argument).",
                                                  show_default=False)] = None,
    file: c.FileOpt = None,
    model: c.ModelOpt = None,
    n_predict: c.NPredictOpt = -1,
    ctx_size: c.GenCtxOpt = None,
    temp: c.TempOpt = 0.8,
    top_k: c.TopKOpt = 40,
    top_p: c.TopPOpt = 0.95,
    min_p: c.MinPOpt = 0.05,
    repeat_penalty: c.RepeatPenaltyOpt = 1.0,
    repeat_last_n: c.RepeatLastNOpt = 64,
    seed: c.SeedOpt = -1,
    no_bos: c.NoBosOpt = False,
    stop: Annotated[Optional[List[str]], typer.Option("--stop", help="Stop when this text appears (repeatable).")] = None,
    no_display_prompt: Annotated[bool, typer.Option("--no-display-prompt", help="Print only the generated text, not the prompt before it.")] = False,
    backend: c.BackendOpt = "auto",
    cache_type_k: c.CacheTypeKOpt = "f16",
    cache_type_v: c.CacheTypeVOpt = "f16",
    draft_model: DraftModelOpt = None,
    lookup: LookupOpt = 0,
    draft_max: DraftMaxOpt = 7,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, ids, counts, timings) instead of streaming.")] = False,
    verbose: c.VerboseOpt = False,
) -> None:
    """Generate text from a prompt (PROMPT, -p TEXT or -f FILE) with a GGUF model."""
    from k4.runtime.errors import UsageError
    from k4.runtime.generate import Generator

    flags = Flags()
    for warning in flags.warnings():
        err.print(f"warning: {warning}", style="yellow")
    params = SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, c.resolve_seed(seed)).validate()
    c.check_n_predict(n_predict)
    kv = c.kv_types(cache_type_k, cache_type_v)
    text = c.read_prompt(prompt_arg, prompt, file)
    s = c.load_session(model, backend, ctx_size, flags, kv)
    ids = s.tokenizer.encode(text, add_bos=False if no_bos else None)
    if not ids:
        ids = [s.tokenizer.bos_id] if s.tokenizer.bos_id is not None else []
    if not ids:
        raise UsageError("the prompt is empty; give some text")
    spec = make_speculator(s, draft_model, lookup, draft_max, flags)
    gen = Generator(s.backend, s.tokenizer, spec)
    if not as_json and not no_display_prompt:
        sys.stdout.write(text)
    for piece in gen.stream(ids, params, n_predict, stop or ()):
        if not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    res = gen.result
    if as_json:
        record = _record(s, c.model_path(model), text, ids, res, params.seed)
        if spec is not None:
            st = spec.stats
            record.update({"draft_steps": st.steps, "draft_tokens": st.drafted, "draft_accepted": st.accepted,
                           "draft_acceptance": st.acceptance, "tokens_per_step": st.tokens_per_step})
        sys.stdout.write(json_text(record) + "\n")
    else:
        sys.stdout.write("\n")
        line = stats_line(s.load_ms, res, params.seed)
        err.print(line + (f" | {spec_text(spec.stats)}" if spec is not None else ""), style="dim", markup=False)
        if res.stop_reason == "context":
            err.print(f"stopped: the context of {s.backend.n_ctx} tokens is full; raise --ctx-size for longer output", style="yellow")
    if verbose or flags.on("K4_TRACE"):
        err.print(trace_table(s.backend.trace))
        err.print(memory_table(s.backend.memory_report()))


def _record(s: c.Session, path, text: str, ids: list[int], res, seed: int) -> dict:
    """The --json object: times in ms, rates in tokens/s (null where the phase was empty)."""
    prompt_tps, gen_tps = res.prompt_tps, res.gen_tps
    return {
        "model": str(path),
        "backend": s.backend.name,
        "n_ctx": s.backend.n_ctx,
        "prompt": text,
        "text": res.text,
        "prompt_ids": ids,
        "token_ids": res.token_ids,
        "prompt_tokens": res.prompt_tokens,
        "generated_tokens": len(res.token_ids),
        "stop_reason": res.stop_reason,
        "seed": seed,
        "load_ms": round(s.load_ms, 3),
        "prompt_ms": round(res.prompt_ms, 3),
        "gen_ms": round(res.gen_ms, 3),
        "prompt_tps": None if prompt_tps is None else round(prompt_tps, 3),
        "gen_tps": None if gen_tps is None else round(gen_tps, 3),
    }


def register(app: typer.Typer) -> None:
    app.command("run")(run)
