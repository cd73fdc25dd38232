"""Which compiled gemv_q8 variant serves one product of a model best, measured in the model (GPU):
`k4 bench`'s tgN in one process, with the one-token products of one shape run in each variant in
turn, rounds alternating, so the machine and the rest of the step are the same for every variant.
A product measured alone (microbench.bench_gemv) runs beside copies of itself; in the model it runs
after the kernel it waits for, which is what decided K4_WO_WIDE (docs/PERF.md, session 42): the
output product after attention gained with 32 warps where the microbenchmark preferred 16.

A variant is (WARPS, U, PF) as quant_kernels names them; only compiled ones run (each type's
default, QUANT's glu, ROW_BLOCKS_VARIANT, EXTRA_GEMV_VARIANTS and EXTRA_GLU_VARIANTS, the last two
compiled on first use), else the bench stops with the kernel's name. The shape is the product's
(n_out, n_in) as gemv_variant sees it (SwiGLU pairs for --glu). Choosing a variant also decides
what gemv_variant decides: an output or down product in another variant than its type's default
hands the next RMSNorm no NQ handoff (matmul.norm_q8_blocks). The output product's own choice
(forward's after_attention_variant, K4_WO_WIDE) is set aside while the sweep runs.

Usage (from the repository root, k4 importable, on the GPU machine):
    python scripts/variant_sweep.py -m MODEL.gguf --shape 3584x3584 --variants 16,2,1 32,2,0 [--glu]
        [-n 128] [-r 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys

from take_away import bench_ts  # scripts/take_away.py: tgN of `k4 bench` in this process


def parse_variant(text: str) -> tuple[int, int, int]:
    """(WARPS, U, PF) of "W,U,PF" (SystemExit with a one-line error otherwise)."""
    try:
        warps, u, pf = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"error: variant {text!r} is not WARPS,U,PF (e.g. 16,2,1)") from None
    if not 1 <= warps <= 32 or u < 1 or pf not in (0, 1):
        raise SystemExit(f"error: variant {text!r}: WARPS from 1 to 32, U at least 1, PF 0 or 1")
    return warps, u, pf


def parse_shape(text: str) -> tuple[int, int]:
    """(n_out, n_in) of "N_OUTxN_IN" (SystemExit with a one-line error otherwise)."""
    try:
        n_out, n_in = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: shape {text!r} is not N_OUTxN_IN (e.g. 3584x3584)") from None
    return n_out, n_in


def use_variant(shape: tuple[int, int], glu: bool, variant: tuple[int, int, int] | None, modules=None):
    """Make matmul.gemv_variant answer `variant` for products of `shape` (and glu) and forward's
    after_attention_variant answer None (variant None: both as they were). modules: (matmul,
    forward), default runtime/cuda's. Returns the undo."""
    if modules is None:
        from k4.runtime.cuda import forward, matmul

        modules = (matmul, forward)
    matmul, forward = modules
    chosen, wide = matmul.gemv_variant, forward.after_attention_variant
    if variant is None:
        return lambda: None

    def gemv_variant(t, n_out, n_in, is_glu=False):
        return variant if (n_out, n_in) == shape and is_glu == glu else chosen(t, n_out, n_in, is_glu)

    matmul.gemv_variant, forward.after_attention_variant = gemv_variant, lambda t, n_in: None

    def undo():
        matmul.gemv_variant, forward.after_attention_variant = chosen, wide

    return undo


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--shape", required=True, help="N_OUTxN_IN of the products to vary (SwiGLU pairs with --glu)")
    ap.add_argument("--variants", nargs="+", required=True, help="WARPS,U,PF each; 'main' for the tree's own choice")
    ap.add_argument("--glu", action="store_true", help="the shape is a SwiGLU gate/up pair's")
    ap.add_argument("-n", type=int, default=128, help="tokens a tgN run generates (default 128)")
    ap.add_argument("-r", type=int, default=3, help="repetitions a run (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the variants (default 3)")
    a = ap.parse_args(argv)
    shape = parse_shape(a.shape)
    variants = {v: None if v == "main" else parse_variant(v) for v in a.variants}
    args = ["-m", a.model, "--backend", "cuda", "-p", "0", "-n", str(a.n), "-r", str(a.r)]
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for name, variant in variants.items():
            undo = use_variant(shape, a.glu, variant)
            try:
                runs[name].append(bench_ts(args, f"tg{a.n}"))
            finally:
                undo()
            print(f"{name:10s} tg{a.n} {runs[name][-1]:10.2f} t/s", flush=True)
    first = next(iter(runs))
    base = sum(runs[first]) / len(runs[first])
    for name, ts in runs.items():
        mean = sum(ts) / len(ts)
        print(f"{name:10s} mean {mean:10.2f} t/s ({mean / base - 1:+.1%} against {first})")


if __name__ == "__main__":
    main(sys.argv[1:])
