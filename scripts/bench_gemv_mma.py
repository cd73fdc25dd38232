"""Time gemv_mma (int8 tensor cores, up to 8 tokens per read of the weights: speculative
decoding's verify step) against gemv_batch (dp4a) and one gemv on the Llama 2 7B matrices,
Q4_K and Q6_K, random weights (GPU).

For each matrix and n_tok = 1..8: µs per launch of gemv_batch and of gemv_mma and their ratio
to one gemv (one token); then the products of one 7B forward pass (32 layers of q/k/v, wo,
gate/up, down, and the output matrix) summed, as if every matrix were of that type: the verify
step's product time against a one-token step's (issue 20's target: 8 tokens in at most 1.3x).
Timings: microbench.bench_gemv_batch (CUDA graphs with PDL, weights streamed from memory,
median of CUDA-event timings).

Usage (from the repository root, k4 importable): python scripts/bench_gemv_mma.py [--iters N]
[--variant 8,0] (Q4_K only: WARPS of a compiled instance, quant_kernels.MMA8_KERNELS, KS, 0 for
the launcher's choice, and optionally STAGES, e.g. 16,4,2) [--x-q8] (X
given quantized by quantize_rows beforehand, to both products: their time without the
prologue that reads and quantizes X in every block)
"""

from __future__ import annotations

import argparse

from k4.runtime.cuda.microbench import bench_gemv_batch
from k4.runtime.cuda.quant_kernels import BATCH_TOKENS

from bench_gemv_batch import SHAPES, TYPES  # scripts/bench_gemv_batch.py: the same Llama 2 7B products


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200, help="graph replays per timing (default 200)")
    ap.add_argument("--variant", help="a gemv_mma instance WARPS,KS for Q4_K (default: quant_kernels.MMA8_WARPS, gemv_mma.mma_ks)")
    ap.add_argument("--x-q8", action="store_true", help="X comes quantized (x_q8, made before the timing)")
    args = ap.parse_args()
    variant = tuple(int(v) for v in args.variant.split(",")) if args.variant else None
    tokens = tuple(range(1, BATCH_TOKENS + 1))
    head = " | ".join(f"n={n}" for n in tokens)
    print(f"| type | matrix | product | gemv µs | {head} |")
    print("|" + " --- |" * (4 + len(tokens)))
    for qtype in TYPES:
        step = {(kind, n): 0.0 for kind in ("batch", "mma8") for n in (0, *tokens)}  # n 0: one gemv per product
        for name, n_out, n_in, glu, count in SHAPES:
            for kind in ("batch", "mma8"):
                r = bench_gemv_batch(qtype, n_out, n_in, tokens, args.iters, glu=glu, mma8=kind == "mma8",
                                     variant=variant if kind == "mma8" and qtype == "Q4_K" else None, x_q8=args.x_q8)
                step[kind, 0] += count * r["gemv_us"]
                cells = []
                for row in r["rows"]:
                    step[kind, row["n_tok"]] += count * row["us"]
                    cells.append(f"{row['us']:.1f} µs {row['ratio']:.2f}x")
                print(f"| {qtype} | {name} | {kind} | {r['gemv_us']:.1f} | " + " | ".join(cells) + " |")
        for kind in ("batch", "mma8"):
            cells = [f"{step[kind, n] / 1e3:.2f} ms {step[kind, n] / step[kind, 0]:.2f}x" for n in tokens]
            print(f"| {qtype} | 7B step, products only | {kind} | {step[kind, 0] / 1e3:.2f} ms | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
