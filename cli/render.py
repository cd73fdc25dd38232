"""The one place k4 talks to the terminal: a rich Console for stdout, one for stderr, tables,
and the error boundary that turns K4Error into a one-line message and an exit code."""

from __future__ import annotations

import functools
import sys
from typing import Callable, Iterable, Sequence

import typer
from rich.console import Console
from rich.table import Table

from runtime.errors import K4Error

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> None:
    """Print `error: message` on stderr and exit with `code`."""
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    raise typer.Exit(code)


def errors_to_exit(fn: Callable) -> Callable:
    """Decorator for commands: K4Error -> one line on stderr + its exit code; Ctrl-C -> 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except K4Error as exc:
            fail(str(exc).replace("[", r"\["), exc.exit_code)
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
