"""Where a decode step's time goes, kernel by kernel (GPU): runs `k4 bench` under torch's profiler
(CUPTI records every kernel of the replayed CUDA graphs, k4's included) and prints, for the last
complete decode step, each kernel's marginal time: its end minus the end of the kernel before, and in brackets its
start minus that end (negative: it started while the one before drained). Launched with
programmatic dependent launch, a kernel starts while the one before drains, so its own duration
overlaps; the marginals add up to the step. One line per attention kernel (it and
the kernels after it up to the next one: the output product, the feed-forward, the next layer's
q/k/v), then the step's kernels summed by name.

torch is not a k4 dependency; the GPU machine has it. A step starts at the token embedding's
dequant_q and ends with sample_finish.

With `--verify N` (and -n 0) it shows a speculative verify step instead: dequant_q ... spec_accept,
the longer of the last two (the bench alternates N-token and one-token steps).

Usage (from the repository root, k4 importable):
    python scripts/decode_timeline.py -m MODEL.gguf [k4 bench options, e.g. -d 16384 -c 16400]
The bench runs with -p 0 -n 8 -r 1 unless the options say otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import re
import sys
import tempfile


def short(name: str) -> str:
    """A kernel's name without its arguments, its template arguments cut to 64 characters."""
    name = name.removeprefix("void ")
    m = re.match(r"(\w+)(<[^(]*>)?", name)
    if not m:
        return name[:48]
    return m.group(1) + (m.group(2)[:64] if m.group(2) else "")


def last_step(kernels: list[tuple[float, float, str]], end: str = "sample_finish") -> list[tuple[float, float, str]]:
    """The kernels (start µs, end µs, name) of the last complete step (dequant_q ... a kernel
    named end), with the kernel before it first (the origin of the first marginal)."""
    starts = [i for i, (_, _, n) in enumerate(kernels) if n.startswith("void dequant_q") or n.startswith("dequant_q")]
    ends = [i for i, (_, _, n) in enumerate(kernels) if n.startswith(end)]
    for i in reversed(starts):
        after = [e for e in ends if e > i]
        if after and i > 0:
            return kernels[i - 1 : after[0] + 1]
    raise SystemExit(f"no complete step in the trace (is the model's step a dequant_q ... {end} chain?)")


def main(argv: list[str]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from k4.cli.app import main as k4_main

    args = list(argv)
    for flag, value in (("-p", "0"), ("-n", "8"), ("-r", "1")):
        if flag not in args:
            args += [flag, value]
    torch.zeros(1, device="cuda")  # the CUDA context, before the profiler starts
    sys.argv = ["k4", "bench", *args]
    with profile(activities=[ProfilerActivity.CUDA]) as prof, contextlib.redirect_stdout(io.StringIO()):
        try:  # the bench's own tables are not printed
            k4_main()
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel")
    if "--verify" in args:  # the longer of the last two verify steps: the N-token one
        last = last_step(kernels, "spec_accept")
        before = last_step([k for k in kernels if k[0] < last[1][0]], "spec_accept")
        step = max(last, before, key=lambda st: st[-1][1] - st[0][1])
    else:
        step = last_step(kernels)
    prev_end, rows = step[0][1], []
    for start, end, name in step[1:]:
        rows.append((short(name), end - prev_end, end - start, start - prev_end))
        prev_end = max(prev_end, end)
    print(f"decode step: {prev_end - step[0][1]:.1f} µs in {len(rows)} kernels (marginal µs each)")
    line: list[str] = []
    for name, marginal, _, lead in rows:  # a line from each attention kernel to the next
        if name.startswith("attn") and line:
            print("  " + "  ".join(line))
            line = []
        line.append(f"{name.split('<')[0]} {marginal:.1f} [{lead:+.1f}]")
    print("  " + "  ".join(line))
    total = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, marginal, duration, _ in rows:
        t = total[name]
        t[0] += 1
        t[1] += marginal
        t[2] += duration
    for name, (n, marginal, duration) in sorted(total.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:60s} x{n:4d}  marginal {marginal:8.1f} µs ({marginal / n:6.2f} each), duration {duration / n:6.2f} each")


if __name__ == "__main__":
    main(sys.argv[1:])
