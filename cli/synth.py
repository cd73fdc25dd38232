"""`k4 synth`: write a synthetic Q4_K_M model in the shape of a real one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .render import err, errors_to_exit, progress_bar

# runtime/synthetic.py PRESETS' names, written out so `k4 --help` needs no numpy (test_cli_results checks them)
PRESET_HELP = ("Model shape: tinyllama-1.1b, llama2-7b, llama3-8b, qwen2.5-0.5b, qwen2.5-7b, qwen3-8b, gemma3-12b, "
               "gemma3-27b, phi4-14b, qwen3-30b-a3b, or test-tiny (two small layers, for tests).")


@errors_to_exit
def synth(
    preset: Annotated[str, typer.Argument(help=PRESET_HELP)],
    out: Annotated[Path, typer.Argument(help="Output .gguf path.")],
    vocab: Annotated[Optional[Path], typer.Option("--vocab", help="Take the vocabulary from this GGUF (default: the sample model's, padded).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it exists.")] = False,
) -> None:
    """Write a model with the exact shape and Q4_K_M tensor types of PRESET, random weights."""
    from k4.runtime.synthetic import write_synthetic

    with progress_bar(f"writing {out.name}") as update:
        write_synthetic(preset, out, vocab, seed, progress=update, force=force)
    err.print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB)")


def register(app: typer.Typer) -> None:
    app.command("synth")(synth)
