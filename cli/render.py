"""The one place k4 talks to the terminal: a rich Console for stdout, one for stderr, tables,
and the error boundary that turns K4Error into a one-line message and an exit code."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
from typing import Callable, Iterable, Optional, Sequence

import typer
from rich.console import Console
from rich.table import Table

from k4.runtime.errors import K4Error

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> None:
    """Print `error: message` on stderr and exit with `code`."""
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    raise typer.Exit(code)


def errors_to_exit(fn: Callable) -> Callable:
    """Decorator for commands: K4Error -> one line on stderr + its exit code; MemoryError -> one
    line, exit 2; Ctrl-C -> 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except K4Error as exc:
            fail(str(exc).replace("[", r"\["), exc.exit_code)
        except MemoryError:
            fail("ran out of memory (RAM); free memory, lower --ctx-size or use a smaller model", 2)
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130)
        except BrokenPipeError:
            sys.stderr.close()
            raise typer.Exit(0)

    return wrapper


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[object]], right: Sequence[int] = ()) -> Table:
    """A rich Table with the given columns; columns whose index is in `right` are right-aligned."""
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i in right else "left")
    for r in rows:
        t.add_row(*(str(x) for x in r))
    return t


COUNTER_COLUMNS = (
    ("ms", "time ms"),
    ("gpu_ms", "GPU ms"),
    ("steps", "steps"),
    ("h2d_bytes", "H2D bytes"),
    ("h2d_count", "H2D #"),
    ("d2h_bytes", "D2H bytes"),
    ("d2h_count", "D2H #"),
    ("syncs", "syncs"),
    ("launches", "launches"),
    ("graph_replays", "graph replays"),
    ("allocs", "allocs"),
    ("alloc_bytes", "alloc bytes"),
)


def trace_table(trace, title: str = "per-phase counters") -> Table:
    """A table of runtime.trace.Trace: one row per phase, one column per counter."""
    rows = []
    for phase, c in trace.phases.items():
        d = c.as_dict()
        rows.append([phase] + [f"{d[k]:,.1f}" if k in ("ms", "gpu_ms") else f"{d[k]:,}" for k, _ in COUNTER_COLUMNS])
    return table(title, ["phase"] + [h for _, h in COUNTER_COLUMNS], rows, right=range(1, len(COUNTER_COLUMNS) + 1))


def memory_table(report: dict[str, int]) -> Table:
    """GPU memory by kind (weights, kv_cache, scratch), bytes."""
    return table("GPU memory", ("what", "bytes"), [(k, f"{v:,}") for k, v in report.items()], right=(1,))


def finite(value):
    """`value` with every NaN or infinite float (in dicts, lists and tuples, at any depth) made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_text(value, indent: Optional[int] = None) -> str:
    """The JSON text k4 prints (no trailing newline): strict JSON (RFC 8259), so NaN and
    Infinity become null rather than the bare tokens Python's json module writes by default."""
    return json.dumps(finite(value), ensure_ascii=False, indent=indent, allow_nan=False)


def rate_text(value: Optional[float], fmt: str = ",.1f") -> str:
    """A rate (tokens/s) formatted with `fmt`, or "-" where it is undefined (None, NaN)."""
    return "-" if value is None or value != value else f"{value:{fmt}}"


def generation_rates(result) -> tuple[Optional[float], Optional[float]]:
    """(prompt t/s, generation t/s) of a runtime.generate.GenerationResult, each None when its
    phase is empty: no prompt evaluation (-n 0), or fewer than two generated tokens (the first is
    timed with the prompt), or a zero duration."""
    evaluated = bool(result.token_ids) or result.stop_reason == "eog"
    prompt = result.prefill_tokens / (result.prompt_ms / 1e3) if evaluated and result.prompt_ms > 0 else None
    n_gen = len(result.token_ids) - 1
    gen = n_gen / (result.gen_ms / 1e3) if n_gen > 0 and result.gen_ms > 0 else None
    return prompt, gen


def stats_line(load_ms: float, result, seed: int) -> str:
    """One line of generation stats (runtime.generate.GenerationResult) and the sampling seed."""
    prompt_tps, gen_tps = generation_rates(result)
    return (
        f"load {load_ms:,.0f} ms | prompt {result.prompt_tokens} tok ({result.prefill_tokens} evaluated), "
        f"{rate_text(prompt_tps)} t/s | generated {len(result.token_ids)} tok, {rate_text(gen_tps)} t/s | "
        f"stop: {result.stop_reason} | seed {seed}"
    )


@contextlib.contextmanager
def progress_bar(description: str, min_bytes: int = 0):
    """A rich progress bar on stderr in bytes; yields update(done, total). Nothing is drawn for
    totals under min_bytes or when stderr is not a terminal."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal) as prog:
        task = prog.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            if total >= min_bytes:
                prog.update(task, completed=done, total=total)

        yield update
