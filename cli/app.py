"""The k4 command-line app: wires one module per command into a Typer app."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="k4",
    help="Run GGUF K-quantized LLMs fast on one NVIDIA GPU (numpy reference backend on the CPU).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module defines register(app) which adds its command(s).
COMMAND_MODULES = ("run", "chat", "tokenize", "prompt", "info", "perplexity", "quantize", "synth", "bench")

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f"k4.cli.{_name}")
    except ModuleNotFoundError as exc:  # a command whose module is not written yet
        if exc.name != f"k4.cli.{_name}":
            raise
        continue
    _module.register(app)


def _version(value: bool) -> None:
    if value:
        from k4.runtime import __version__

        typer.echo(f"k4 {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Run GGUF K-quantized LLMs fast on one NVIDIA GPU (numpy reference backend on the CPU)."""


def main() -> None:
    """The console script: the Typer app, with click's usage errors (an unknown option, a value
    that is not a number) as one line, `error: MESSAGE (k4 COMMAND --help)`, exit 2, instead of
    rich's boxed panel."""
    import sys

    try:  # typer >= 0.2x carries its own copy of click
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
    except ImportError:
        from click.exceptions import NoArgsIsHelpError, UsageError

    from .render import clean, err

    try:
        code = app(standalone_mode=False, prog_name="k4")
    except NoArgsIsHelpError as exc:  # `k4` alone: the help, as before
        exc.show()
        sys.exit(2)
    except UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "k4"
        err.print(f"error: {clean(exc.format_message())} (see {where} --help)", style="red", markup=False, soft_wrap=True)
        sys.exit(2)
    except typer.Abort:
        err.print("interrupted", markup=False)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
