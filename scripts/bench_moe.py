"""Time the gathered expert products of Qwen3-30B-A3B (qwen3moe: 128 experts, 8 used, n_embd 2048,
n_ff_exp 768; Q4_K_M: gate/up Q4_K, down Q6_K), random weights (GPU): moe.cu's float-x kernel
(moe_gemv_q, the first version; now the router's) against moe_gemv.cu's 8-bit-x moe_gemv_q8.

For each matrix and slot count (8: one decode step's token; 4096: a 512-token prefill chunk):
µs per launch, and the effective TB/s: the bytes of the slots' expert matrices (each slot's
expert counted once per slot, as the kernel reads it) over the time; for gate/up also the
SwiGLU launch (gathered with up: gate and up experts in one launch, silu(gate) * up). Then one
decode step's expert products (48 layers of gate, up and down) summed. Timings: microbench.device_time (CUDA
graph of many launches, median). Each launch reads other experts of one of two copies of the
stacked tensor (each copy over 100 MB), so a graph replay streams more than twice the H200's
L2 and decode's 8 experts come from memory, as in a real step.

Usage (from the repository root, k4 importable): python scripts/bench_moe.py [--iters N] [--slots 8,4096]
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType as T

N_EXPERT, K, N_EMBD, N_FF, N_LAYER = 128, 8, 2048, 768, 48
# (name, ggml type, n_out, n_in, x_div: slots per x row)
MATRICES = (("gate/up 768x2048", T.Q4_K, N_FF, N_EMBD, K), ("down 2048x768", T.Q6_K, N_EMBD, N_FF, 1))
COPIES = 2


def bench(o, ggml_type: T, n_out: int, n_in: int, x_div: int, n_slots: int, iters: int, swiglu: bool) -> dict:
    """{"old": µs, "new": µs, "bytes": expert bytes read per launch} for one matrix and slot count;
    with swiglu also "glu": µs of the SwiGLU launch (gate and up experts, twice the bytes)."""
    import cupy as cp

    from k4.runtime.cuda.microbench import device_time
    from k4.runtime.cuda.moe import Experts, gathered
    from k4.runtime.synthetic import random_blocks

    rng = np.random.default_rng(0)
    raw = cp.asarray(random_blocks(ggml_type, N_EXPERT * n_out, n_in, rng, 1 / np.sqrt(n_in), full_range=True).reshape(-1))
    shape = (N_EXPERT, n_out, n_in)
    copies = [raw] + [raw.copy() for _ in range(COPIES - 1)]
    # decode: each launch 8 experts none of the others in its copy read; prefill: random ids
    if n_slots <= N_EXPERT:
        per_copy = N_EXPERT // n_slots
        ids = [cp.asarray(group) for _ in range(COPIES)
               for group in rng.permutation(N_EXPERT)[:per_copy * n_slots].astype(np.int32).reshape(per_copy, n_slots)]
    else:
        ids = [cp.asarray(rng.integers(0, N_EXPERT, n_slots, dtype=np.int32)) for _ in range(COPIES)]
    n_calls = len(ids)
    x = cp.asarray(rng.standard_normal((-(-n_slots // x_div), n_in)).astype(np.float32))
    y = cp.empty((n_slots, n_out), cp.float32)
    out = {}
    per = n_calls // COPIES
    for label, float_x, glu in (("old", True, False), ("new", False, False), ("glu", False, True)):
        if glu and not swiglu:
            continue
        experts = [Experts.from_raw(c, ggml_type, shape, float_x) for c in copies]

        def body(i):
            c = i // per  # with glu the up experts: the next copy (same bytes, other addresses)
            gathered(o, experts[c], ids[i], x, x_div, n_in, y, n_slots, up=experts[(c + 1) % COPIES] if glu else None)

        out[label] = device_time(body, n_calls, iters, graph=True)
    out["bytes"] = n_slots * experts[0].expert_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200, help="launches per timing (default 200)")
    ap.add_argument("--slots", default="8,4096", help="comma list of slot counts (default 8,4096)")
    args = ap.parse_args()
    from k4.runtime.cuda.ops import Ops
    from k4.runtime.trace import Trace

    o = Ops(Trace())
    print("| matrix | type | slots | moe_gemv_q (float x) | moe_gemv_q8 (8-bit x) | speed-up | gate+up SwiGLU launch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    step = {"old": 0.0, "new": 0.0, "glu": 0.0}
    for n_slots in (int(s) for s in args.slots.split(",")):
        for name, t, n_out, n_in, x_div in MATRICES:
            gate_up = n_out == N_FF
            r = bench(o, t, n_out, n_in, x_div, n_slots, args.iters, gate_up)
            cells = [f"{r[k]:.1f} µs {r['bytes'] / r[k] / 1e6:.2f} TB/s" for k in ("old", "new")]
            glu = f"{r['glu']:.1f} µs {2 * r['bytes'] / r['glu'] / 1e6:.2f} TB/s" if gate_up else "-"
            print(f"| {name} | {t.name} | {n_slots} | {cells[0]} | {cells[1]} | {r['old'] / r['new']:.2f}x | {glu} |")
            if n_slots == K:  # a decode step: gate and up two launches each (old, new) or one (glu)
                step["old"] += N_LAYER * r["old"] * (2 if gate_up else 1)
                step["new"] += N_LAYER * r["new"] * (2 if gate_up else 1)
                step["glu"] += N_LAYER * (r["glu"] if gate_up else r["new"])
    if step["new"]:
        print(f"\ndecode step, expert products only ({N_LAYER} layers x gate, up, down; without the swiglu kernel): "
              f"moe_gemv_q {step['old'] / 1e3:.2f} ms, moe_gemv_q8 {step['new'] / 1e3:.2f} ms, "
              f"with the SwiGLU launch {step['glu'] / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
