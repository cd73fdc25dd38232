"""The one place k4 talks to the terminal: a rich Console for stdout, one for stderr, tables,
and the error boundary that turns K4Error into a one-line message and an exit code."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import sys
from typing import Callable, Iterable, Optional, Sequence

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from k4.runtime.errors import K4Error

# The width tables are laid out for when no terminal tells one (a CI log, `nohup k4 bench > f`,
# ssh without a tty): rich would take 80 columns and cut the figures of a wide table to "2,0…".
LOG_WIDTH = 240


@functools.cache
def _any_terminal() -> bool:
    """Whether stdin, stdout or stderr is a terminal that reports its size (rich's own probe);
    asked once a process, as every print asks the console's size."""
    for fd in (0, 1, 2):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            if os.get_terminal_size(fd).columns > 0:
                return True
    return False


class _Console(Console):
    """rich's Console, except that a closed pipe raises BrokenPipeError (rich exits with status 1;
    k4 exits 0 when the reader of its output has gone, as `| head` does), and that output going
    nowhere near a terminal (and no COLUMNS set) is laid out LOG_WIDTH columns wide instead of 80,
    so tables keep every figure whole."""

    def on_broken_pipe(self) -> None:
        _output_lost()
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    @Console.size.getter
    def size(self):
        dims = Console.size.fget(self)
        if self._width is None and not self.is_terminal and "COLUMNS" not in self._environ and not _any_terminal():
            return dims._replace(width=max(dims.width, LOG_WIDTH))
        return dims


out = _Console(highlight=False, soft_wrap=True)
err = _Console(stderr=True, highlight=False, soft_wrap=True)


# Terminal control characters: C0 (but tab and newline), DEL and C1; ESC among them.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with the lone surrogates that Python makes of bytes that are not UTF-8 (in argv,
    os.fsdecode) read as UTF-8 with U+FFFD for each invalid sequence, as tokenizers need."""
    if not _SURROGATE.search(text):
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates that stand for no byte
        return _SURROGATE.sub("\ufffd", text)


def clean(text: str) -> str:
    """`text` (from a file or the user) as printable text: valid_text, without terminal control
    characters, so that printing it cannot move the cursor, change colours or retitle the terminal."""
    return _CONTROL.sub("", valid_text(text))


DIM_ON, DIM_OFF = "\x1b[2m", "\x1b[22m"  # SGR 2 (faint) and 22 (normal intensity), ECMA-48


def dim(text: str) -> str:
    """`text` wrapped in the faint/normal-intensity escape codes when stdout is a terminal (rich's
    detection, so TERM=dumb and redirections get plain text); for the model's thinking in k4 chat.
    `text` must already be clean()ed."""
    return f"{DIM_ON}{text}{DIM_OFF}" if out.is_terminal and not out.is_dumb_terminal else text


def fail(message: str, code: int = 2) -> None:
    """Print `error: message` on stderr (the message as plain text: no markup, no control
    characters) and exit with `code`."""
    err.print(f"[bold red]error:[/] {escape(clean(message))}", markup=True, highlight=False)
    raise typer.Exit(code)


def _output_lost() -> None:
    """Point stdout at /dev/null, so that the flush at exit finds nowhere to fail."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def errors_to_exit(fn: Callable) -> Callable:
    """Decorator for commands: K4Error -> one line on stderr + its exit code; MemoryError -> one
    line, exit 2; Ctrl-C -> 130; a closed pipe on stdout (`| head`) -> exit 0; a full disk or
    device on stdout (`> /dev/full`) -> one line, exit 2. Stdout is flushed before returning, so
    a write error surfaces here rather than at interpreter exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            if sys.stdout is not None:
                sys.stdout.flush()
            return result
        except K4Error as exc:
            fail(str(exc), exc.exit_code)
        except MemoryError:
            fail("ran out of memory (RAM); free memory, lower --ctx-size or use a smaller model", 2)
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130)
        except BrokenPipeError:  # `k4 ... | head`: the reader has what it wanted
            _output_lost()
            raise typer.Exit(0)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
                raise
            _output_lost()
            fail(f"cannot write the output: {exc.strerror}", 2)

    return wrapper


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[object]], right: Sequence[int] = ()) -> Table:
    """A rich Table with the given columns; columns whose index is in `right` are right-aligned.
    Cells are shown as plain text (rich markup in them is not interpreted) without control characters."""
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i in right else "left")
    for r in rows:
        t.add_row(*(Text(clean(str(x))) for x in r))  # cells are plain text, never markup
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
    """The backend's memory by kind (GPU: weights, kv_cache, scratch; numpy: kv_cache, dequantized), bytes."""
    return table("memory", ("what", "bytes"), [(k, f"{v:,}") for k, v in report.items()], right=(1,))


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


def reply_stats(result, used: int, n_ctx: int) -> str:
    """The line after each reply: evaluated prompt tokens and reply tokens with their rates (t/s,
    "-" for an empty phase), and the context meter: tokens the conversation holds of n_ctx."""
    return (f"[ prompt {result.prefill_tokens:,} tok {rate_text(result.prompt_tps, ',.0f')} t/s | "
            f"reply {len(result.token_ids):,} tok {rate_text(result.gen_tps, ',.0f')} t/s | context {used:,} / {n_ctx:,} ]")


def stats_line(load_ms: float, result, seed: int) -> str:
    """One line of generation stats (runtime.generate.GenerationResult) and the sampling seed."""
    return (
        f"load {load_ms:,.0f} ms | prompt {result.prompt_tokens} tok ({result.prefill_tokens} evaluated), "
        f"{rate_text(result.prompt_tps)} t/s | generated {len(result.token_ids)} tok, {rate_text(result.gen_tps)} t/s | "
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
