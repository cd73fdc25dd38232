"""`k4 bench`'s printers, one per -o format, as llama-bench has one per output (its md, csv,
json and jsonl printers) plus k4's rich tables: each takes the finished tests' results
(runtime.bench.BenchResult, in run order) and their records (runtime.bench.result_record dicts,
in the same order) and writes them to standard output. PRINTERS maps a format to its printer."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Callable

from .render import json_text, memory_table, out, rate_text, table


def write_json(records: list[dict]) -> None:
    """-o json: one indented array of the records, strict JSON (null for NaN)."""
    sys.stdout.write(json_text(records, indent=2) + "\n")


def write_jsonl(records: list[dict]) -> None:
    """-o jsonl: one record per line, strict JSON."""
    sys.stdout.write("".join(json_text(r) + "\n" for r in records))


def print_csv(results, records: list[dict]) -> None:
    """-o csv: a header and a row per record; lists (the raw samples) as space-separated numbers;
    the nested phases and memory are json's only."""
    buf = io.StringIO()
    flat = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in records]
    w = csv.DictWriter(buf, fieldnames=list(flat[0]))
    w.writeheader()
    for r in flat:
        w.writerow({k: (" ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v) for k, v in r.items()})
    sys.stdout.write(buf.getvalue())


def _config(test) -> str:
    """A test's backend configuration in the per-phase tables: its --flags and, when not f16,
    its KV cache types; "-" for the defaults."""
    parts = [test.flags_text] if test.flags_text else []
    if test.kv.quantized:
        parts.append(f"-ctk {test.kv.k} -ctv {test.kv.v}")
    return " ".join(parts) or "-"


def _summary_rows(records):
    for r in records:
        yield (Path(r["model"]).name, f"{r['model_size'] / 2**20:,.2f} MiB", f"{r['model_n_params'] / 1e6:,.2f} M",
               r["backend"], r["flags"] or "-", r["type_k"], r["type_v"], r["test"],
               f"{rate_text(r['avg_ts'], ',.2f')} ± {rate_text(r['stddev_ts'], ',.2f')}",
               rate_text(r["bound_ts"], ",.2f"), "-" if r["bound_fraction"] is None else f"{r['bound_fraction']:.1%}")


# bound t/s: the tokens/s of reading the weights and KV cache once per token at --bandwidth (runtime/bound.py)
SUMMARY_COLUMNS = ("model", "size", "params", "backend", "flags", "type_k", "type_v", "test", "t/s", "bound t/s", "% bound")


def print_md(results, records: list[dict]) -> None:
    """-o md: the throughput summary as a markdown table (llama-bench's default output)."""
    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "| " + " | ".join("---" for _ in SUMMARY_COLUMNS) + " |"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in _summary_rows(records)]
    sys.stdout.write("\n".join(lines) + "\n")


def speculative_lines(records: list[dict]) -> list[str]:
    """The speculative tests' lines of -o table: what one verify step costs (host-timed, and on the
    device where the backend timed it there), what the drafts gave."""
    lines = []
    for r in records:
        if r.get("verify_ratio"):
            n = r["test"].split("@")[0][2:]
            lines.append(f"{r['test']}: a verify step of {n} tokens takes {r['verify_ms']:.3f} ms, {r['verify_ratio']:.2f}x a "
                         f"one-token step ({r['verify1_ms']:.3f} ms): speculation gains at most {int(n) / r['verify_ratio']:.2f}x")
            if r.get("verify_gpu_ratio"):
                lines.append(f"{r['test']}: on the device {r['verify_gpu_ms']:.3f} ms against {r['verify1_gpu_ms']:.3f} ms, "
                             f"{r['verify_gpu_ratio']:.2f}x")
        if r.get("tokens_per_step"):
            lines.append(f"{r['test']}: {r['draft_accepted']}/{r['draft_tokens']} drafts accepted, "
                         f"{r['tokens_per_step']:.2f} tokens per verify step")
    return lines


def print_tables(results, records: list[dict]) -> None:
    """-o table: the throughput summary, the speculative tests' lines, time and copy traffic per
    phase, the load steps and GPU memory."""
    env = records[0]
    out.print(f"[dim]{env['gpu'] or env['cpu']} | backend {env['backend']} | k4 {env['k4_version']} ({env['git_commit'] or 'no git'}) "
              f"| cupy {env['cupy'] or '-'} | driver {env.get('driver', '-')} | cuda {env.get('cuda_runtime', '-')}[/]")
    out.print(table("throughput", SUMMARY_COLUMNS, _summary_rows(records), right=(1, 2, 8, 9, 10)))
    for line in speculative_lines(records):
        out.print(line)
    rows = []
    for r in results:
        ph = r.phases

        def ms(name: str, fmt: str = ",.1f") -> str:
            """host ms / GPU ms of a phase ("-" for what was not recorded)."""
            host, gpu = ph.get(name, {}).get("ms"), ph.get(name, {}).get("gpu_ms")
            return "-" if not host else f"{host:{fmt}}" + (f" / {gpu:{fmt}}" if gpu else "")

        def q(p: float) -> str:
            host, gpu = r.latency(p), r.latency(p, gpu=True)
            return "-" if host != host else f"{host:.3f}" + ("" if gpu != gpu else f" / {gpu:.3f}")

        rows.append((r.test.name, _config(r.test), f"{r.load.get('load', {}).get('ms', 0):,.0f}", ms("prefill"),
                     ms("decode"), ms("sample"), q(0.5), q(0.99)))
    out.print(table("time per phase, ms: host clock / GPU time from CUDA events (last run; load once per configuration)",
                    ("test", "config", "load", "prefill", "decode", "sample", "token p50", "token p99"), rows, right=range(2, 8)))
    rows = []
    for r in results:
        for phase, cnt in r.phases.items():
            steps = cnt.get("steps", 0)
            rows.append((r.test.name, phase, f"{cnt['h2d_bytes']:,}", cnt["h2d_count"], f"{cnt['d2h_bytes']:,}", cnt["d2h_count"],
                         cnt["syncs"], cnt["launches"], cnt["graph_replays"], rate_text(cnt["d2h_bytes"] / steps if steps else None)))
    out.print(table("copy traffic per phase (last run)",
                    ("test", "phase", "H2D bytes", "H2D #", "D2H bytes", "D2H #", "syncs", "launches", "graph replays", "D2H B/step"),
                    rows, right=range(2, 10)))
    steps = {(_config(r.test)): r.load_ms for r in results}
    names = list(dict.fromkeys(k for v in steps.values() for k in v))
    out.print(table("load steps (ms, once per configuration)", ("config", *names, "total"),
                    [(f, *(f"{v.get(n, 0):,.1f}" for n in names), f"{sum(v.values()):,.1f}") for f, v in steps.items()],
                    right=range(1, len(names) + 2)))
    for r in {(_config(r.test)): r for r in results}.values():
        if r.load_detail_ms:  # read and copy overlap inside read+upload
            out.print(f"[dim]{_config(r.test)}: read+upload = "
                      + "; ".join(f"{k} {v:,.1f} ms" for k, v in r.load_detail_ms.items()) + "[/]")
    mem = results[-1].memory
    if mem:
        out.print(memory_table(mem))


PRINTERS: dict[str, Callable[[list, list[dict]], None]] = {
    "table": print_tables,
    "md": print_md,
    "csv": print_csv,
    "json": lambda results, records: write_json(records),
    "jsonl": lambda results, records: write_jsonl(records),
}
