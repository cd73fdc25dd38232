"""Where a one-token product's time goes inside it (GPU): `%globaltimer` stamps in every block of
gemv.cu gemv_q8 (its start, its programmatic-dependent-launch wait, the end of its x prologue) and
in every warp (after its last row), read back after microbench.bench_gemv's chain of launches of
that product. Prints, in µs from the first block's release, the percentiles of each stamp over
the blocks or warps of the last launch, and how long the average block idles before the last one
ends. docs/PERF.md (session 46) has the first figures.

The stamps are edits of a copy of kernels_cu in a temporary directory (scripts/take_away.py's
apply_cut and use_sources: the repository is never touched); each anchor must occur once in
today's gemv.cu, or the script stops and says which. Its figures describe one launch, not a
median, and come in steps of `%globaltimer`'s update interval, which differs between machines
(32 ns on one H200, 256 ns on another).

Usage (from the repository root, k4 importable, on the GPU machine):
    python scripts/block_stamps.py [TYPE:N_OUTxN_IN[:q8] ...]   (default: the 7B's and TinyLlama's products)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from take_away import apply_cut, use_sources  # scripts/take_away.py: the edited copy of kernels_cu

ROWS, SLOTS = 4, 8192  # stamp rows (block start, release, prologue end, warp end) x blocks or warps
_STAMP = "k4_st[{row}][{i}] = k4_gt();"
# (kernels_cu file, anchor, replacement): the anchor kept, the stamp added before or after it
EDITS: list[tuple[str, str, str]] = [
    ("gemv.cu", '#include "gemv_common.cuh"\n',
     f'extern "C" {{ __device__ unsigned long long k4_st[{ROWS}][{SLOTS}]; }}\n'
     '__device__ __forceinline__ unsigned long long k4_gt() {\n'
     '    unsigned long long t;\n    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));\n    return t;\n}\n'
     '#include "gemv_common.cuh"\n'),
    ("gemv.cu", "    typename T::chunk ch[U];\n    pdl_trigger();\n",
     "    typename T::chunk ch[U];\n    if (threadIdx.x == 0) " + _STAMP.format(row=0, i="blockIdx.x") + "\n    pdl_trigger();\n"),
    ("gemv.cu", "    if constexpr (CLUSTER) cluster_arrive_relaxed();\n    pdl_wait();\n",
     "    if constexpr (CLUSTER) cluster_arrive_relaxed();\n    pdl_wait();\n    if (threadIdx.x == 0) "
     + _STAMP.format(row=1, i="blockIdx.x") + "\n"),
    ("gemv.cu", "    __syncthreads();\n    const float out_scale = norm_part ? folded_scale(norm_part, n_in, eps) : 1.f;  // 1:",
     "    __syncthreads();\n    if (threadIdx.x == 0) " + _STAMP.format(row=2, i="blockIdx.x")
     + "\n    const float out_scale = norm_part ? folded_scale(norm_part, n_in, eps) : 1.f;  // 1:"),
    ("gemv.cu", "    if (AM && lane == 0) {  // no barrier",
     "    if (lane == 0) " + _STAMP.format(row=3, i="blockIdx.x * 32 + (threadIdx.x >> 5)")
     + "\n    if (AM && lane == 0) {  // no barrier"),
]
DEFAULT_SHAPES = ("Q4_K:22016x4096", "Q4_K:4096x11008:q8", "Q6_K:4096x11008:q8", "Q4_K:4096x4096", "Q6_K:32000x4096",
                  "Q4_K:11264x2048", "Q4_K:2048x2048")


def parse_shape(text: str) -> tuple[str, int, int, bool]:
    """"Q4_K:4096x11008:q8" -> ("Q4_K", 4096, 11008, True) (x handed in quantized). Raises SystemExit
    with a one-line error for anything else."""
    parts = text.split(":")
    try:
        n_out, n_in = (int(v) for v in parts[1].split("x"))
        if len(parts) > 3 or (len(parts) == 3 and parts[2] != "q8") or n_out < 1 or n_in < 1:
            raise ValueError
    except (IndexError, ValueError):
        raise SystemExit(f"error: {text!r} is not TYPE:N_OUTxN_IN[:q8], e.g. Q4_K:4096x11008:q8") from None
    return parts[0], n_out, n_in, len(parts) == 3


def summary(stamps, warps_per_block: int = 32) -> dict[str, list[float]]:
    """The stamps (ROWS, SLOTS) int64 ns of one launch -> name -> [p0, p10, p50, p90, p100] µs from the
    first release, for "start", "release", "prologue", "warp end", "block end", and "idle" (the
    mean µs the blocks end before the last one) as a one-item list. Blocks are the slots of row
    1 that are set; a block's warps are its non-zero slots of row 3."""
    import numpy as np

    n = int((stamps[1] > 0).sum())
    t0 = stamps[1][:n].min()
    us = lambda v: (np.asarray(v, np.float64) - t0) / 1000.0  # noqa: E731
    warps = stamps[3][: n * warps_per_block].reshape(n, warps_per_block)
    ends = [us(row[row > 0]) for row in warps]
    block_end = np.array([e.max() for e in ends])
    pct = lambda v: list(np.percentile(v, [0, 10, 50, 90, 100]))  # noqa: E731
    return {"start": pct(us(stamps[0][:n])), "release": pct(us(stamps[1][:n])), "prologue": pct(us(stamps[2][:n])),
            "warp end": pct(np.concatenate(ends)), "block end": pct(block_end), "idle": [float((block_end.max() - block_end).mean())]}


def main(argv: list[str]) -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    shapes = [parse_shape(s) for s in (argv or DEFAULT_SHAPES)]
    import cupy as cp

    from k4.kernels_cu import SOURCE_DIR
    from k4.runtime.cuda import compile as comp
    from k4.runtime.cuda import microbench as mb
    from k4.runtime.flags import Flags

    with tempfile.TemporaryDirectory(prefix="k4-stamps-") as tmp:
        apply_cut(SOURCE_DIR, Path(tmp), EDITS)
        use_sources(Path(tmp))
        try:
            for ty, n_out, n_in, q8 in shapes:
                mb.bench_gemv(ty, n_out, n_in, iters=20, x_q8=q8, flags=Flags({}))  # compile, warm up
                modules = [f.result() for k, f in comp._modules.items() if k[0] == "gemv.cu" and f.done() and not f.exception()]
                for m in modules:
                    cp.ndarray((ROWS, SLOTS), cp.uint64, m.get_global("k4_st")).fill(0)
                r = mb.bench_gemv(ty, n_out, n_in, iters=5, x_q8=q8, flags=Flags({}))
                for m in modules:
                    stamps = cp.ndarray((ROWS, SLOTS), cp.uint64, m.get_global("k4_st")).get().astype("int64")
                    if (stamps[1] > 0).any():
                        s = summary(stamps)
                        print(f"{ty} {n_out}x{n_in}{' x q8' if q8 else ''}: {r['us']:.2f} µs a product; µs from the "
                              f"first release, p0/p10/p50/p90/p100")
                        for name in ("start", "release", "prologue", "warp end", "block end"):
                            print(f"  {name:10s} " + " ".join(f"{v:6.2f}" for v in s[name]))
                        print(f"  a block ends {s['idle'][0]:.2f} µs before the last one, on average", flush=True)
        finally:
            use_sources(Path(SOURCE_DIR))


if __name__ == "__main__":
    main(sys.argv[1:])
