"""`k4 quantize`: F32/F16/BF16 GGUF -> a llama.cpp K-quant mix, byte-identical to llama-quantize."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from k4.runtime.errors import UsageError

from .render import err, errors_to_exit, out, table

MIX_NAMES = "Q4_K_M, Q4_K_S, Q5_K_M, Q6_K, Q8_0"


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**10:,.1f} KiB" if n_bytes < 2**20 else f"{n_bytes / 2**20:,.2f} MiB"


def _summary(plan) -> str:
    return (
        f"{plan.mix.name}: {len(plan.tensors)} tensors, {plan.n_elements:,} weights, "
        f"{_size(plan.src_bytes)} -> {_size(plan.dst_bytes)} ({plan.bpw:.2f} bits per weight)"
    )


def _print_plan(plan) -> None:
    rows = [(t.name, " x ".join(str(d) for d in t.shape), t.src_type.name, t.dst_type.name, _size(t.dst_bytes)) for t in plan.tensors]
    out.print(table(None, ("name", "shape", "from", "to", "size"), rows, right=(4,)))
    out.print(_summary(plan))


@errors_to_exit
def quantize(
    model: Annotated[Path, typer.Argument(metavar="IN", help="Input GGUF with F32, F16 or BF16 weights.", show_default=False)],
    out_or_type: Annotated[str, typer.Argument(metavar="OUT", help="Output GGUF (with --dry-run: the TYPE).", show_default=False)],
    qtype: Annotated[Optional[str], typer.Argument(metavar="TYPE", help=f"One of {MIX_NAMES}.", show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the per-tensor plan and the resulting size; write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it exists.")] = False,
    threads: Annotated[int, typer.Option("-t", "--threads", help="Worker processes, as llama-quantize's nthread (0 = one per CPU core, 1 = no workers).")] = 0,
) -> None:
    """Quantize IN to TYPE as llama-quantize does (no importance matrix).

    `k4 quantize IN OUT TYPE` writes OUT; `k4 quantize --dry-run IN TYPE` shows the plan."""
    from k4.runtime.model import open_model
    from k4.runtime.quant_mix import get_mix
    from k4.runtime.quantize import plan_quantization

    if dry_run:
        if qtype is not None:
            raise UsageError("--dry-run takes IN TYPE, not an output file: k4 quantize --dry-run IN TYPE")
        plan = plan_quantization(open_model(model), get_mix(out_or_type))
        _print_plan(plan)
        return
    if qtype is None:
        raise UsageError(f"missing TYPE: k4 quantize IN OUT TYPE, with TYPE one of {MIX_NAMES}")
    if threads < 0:
        raise UsageError(f"--threads {threads} is negative; use 0 for one per core")
    plan = _quantize_with_progress(model, Path(out_or_type), qtype, force, threads)
    err.print(_summary(plan))
    err.print(f"wrote {out_or_type}")


def _quantize_with_progress(model: Path, target: Path, qtype: str, force: bool, threads: int):
    """quantize_model with a rich progress bar on stderr (only when stderr is a terminal)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from k4.runtime.quantize import quantize_model

    mix = qtype.upper()
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=24), TaskProgressColumn(),
               TextColumn("{task.fields[weights]} weights"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(f"{mix} reading", total=None, weights="")

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{mix} {name}", weights=f"{done / 1e6:,.1f}M/{total / 1e6:,.1f}M")

        return quantize_model(model, target, qtype, force=force, progress=update, threads=threads)


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)
