"""What one piece of a decode step's critical path is worth, before anyone builds a faster way to
do it (GPU): `k4 bench`'s tgN in one process, alternating main's kernels with a temporary build
that leaves the piece out. The build's outputs are wrong; only its speed means anything, and what
it gains is the most that any fusion, handoff or rewrite of that piece could gain. docs/PERF.md
(session 36) has the first figures: decode attention after its wait, the down products' x, and
moe_one's route and x quantization.

A cut is a few exact edits of kernels_cu sources, applied to a copy in a temporary directory (the
repository is never touched); the bench compiles from that copy through runtime/cuda/compile.py
(its SOURCE_DIR and include path, and a fresh module cache). Each edit's anchor must occur once in
today's source: when a kernel changes under it, the script stops and says which. A launch cut
(LAUNCH_CUTS) instead leaves a whole launch out of the forward pass, patched in this process only;
a kernel cut may also patch a choice of the forward pass while its sources are in use (CUT_PATCHES:
nq16 admits the handoff its kernels make).

Usage (from the repository root, k4 importable, on the GPU machine):
    python scripts/take_away.py CUT -m MODEL.gguf [-n 128] [-r 3] [--rounds 2] [--verify 8]
    python scripts/take_away.py --list
--verify N times the speculative verify step of N tokens (tvN) instead of tgN (the verify-* cuts).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

# mma8_stage_x's store of a unit of x handed in quantized, the anchor of the verify-* cuts
_X_PUT = "                mma8_put_unit<NATURAL>(f - f0, total - f0, q, sum, d, n_lay, xq, xsc);\n            }\n        }\n        return;"

# name -> (what the build leaves out, [(kernels_cu file, anchor, replacement)])
CUTS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "attention": (
        "attn_short's work after its programmatic-dependent-launch wait (its keys and values still go "
        "to shared memory before it); the output product reads a stale input",
        [("attention_short.cu", "    __syncthreads();  // the table\n    pdl_wait();\n",
          "    __syncthreads();  // the table\n    pdl_wait();\n    if (true) return;\n")]),
    "down-x": (
        "the x quantization of the down products that quantize x in clusters (their barriers stay)",
        [("gemv_common.cuh", "for (int base = u_begin; base < u_end; base += blockDim.x) {",
          "for (int base = u_begin; base < u_end && false; base += blockDim.x) {")]),
    "norm-sum": (
        "the sum of squares of the RMSNorm in a decode product's two-pass prologue (quantize_x: the "
        "block's reads of x, its reduction and barrier; x is then quantized unscaled). Since session 47 "
        "only 32-warp products, post-norms and K4_QKV_Q8's first run take two passes",
        [("norm_prologue.cuh", "make_float2(0.f, norm_w ? rms_scale(x, n_in, eps) : 1.f)", "make_float2(0.f, 1.f)")]),
    "verify-x-half": (
        "half of the x each block of a verify product (gemv_mma, x handed in quantized) stages: half the "
        "L2 reads and conversions, half the x stale (measure with --verify N)",
        [("mma8_common.cuh", "                const bool ok = f < total && tok < n_tok;\n                const u8* row",
          "                const bool ok = f < f0 + (total - f0) / 2 && tok < n_tok;\n                const u8* row"),
         ("mma8_common.cuh", _X_PUT, _X_PUT.replace("(f - f0, total - f0,", "(f - f0, (total - f0) / 2,"))]),
    "verify-x-copy": (
        "the conversion in a verify product's x staging (x handed in quantized): each unit's 16 bytes and "
        "scale stored as loaded, no sums, shuffles or layout (what a producer writing the staged layout "
        "would leave; measure with --verify N)",
        [("mma8_common.cuh", _X_PUT,
          "                if (f < total) {\n                    reinterpret_cast<uint4*>(xq)[f - f0] = v[r];\n"
          "                    if (!(f & 1)) reinterpret_cast<float*>(xsc)[(f - f0) >> 1] = d;\n                }\n"
          "            }\n        }\n        return;")]),
    "moe-route": (
        "moe_one's router logits, their exchange and the choice (a fixed choice of k spread experts, weights 1/k)",
        [("moe_one.cu", "for (int e = blockIdx.x; e < n_expert; e += G) {\n        const float v = router_logit",
          "for (int e = blockIdx.x; e < n_expert && false; e += G) {\n        const float v = router_logit"),
         ("moe_one.cu", "        if (warp == 0)\n            moe_choose_warp(",
          "        if (warp == 0) {\n            if (lane < k) {\n                ids_w[lane] = (lane * 16 + 3) % n_expert;\n"
          "                w_w[lane] = 1.0f / k;\n            }\n        } else if (false)\n            moe_choose_warp(")]),
    "moe-quant": (
        "moe_one's normalization and quantization of x (the route as usual, which then follows stale x)",
        [("moe_one.cu", "        else\n            quantize_x_past_warp0<",
          "        else if (false)\n            quantize_x_past_warp0<")]),
    "moe-barrier": (
        "moe_one's wait for every block's SwiGLU rows before the down phase (each block goes on when its own "
        "rows are in h, reading the others' stale): what per-expert arrivals could save at most",
        [("moe_one.cu", "            if (n >= (u64)tag * (u64)G) break;\n", "            if (true) break;\n")]),
    "moe-hq": (
        "moe_one's quantization of the k SwiGLU rows in every block before the down phase (the down rows "
        "read stale shared memory): what the gate/up phase handing h over quantized could save at most",
        [("moe_one.cu", "    quantize_k_rows<true>(h, k, n_ff, TD::x_swizzle, base, xb);\n", "")]),
    "attention-nowait": (
        "attn_short's programmatic-dependent-launch wait for the q/k/v product (it works on stale q, k and v as "
        "soon as it runs): the most a fused q/k/v and attention, each head starting when its rows are done, could gain",
        [("attention_short.cu", "    __syncthreads();  // the table\n    pdl_wait();\n", "    __syncthreads();  // the table\n")]),
    # gemv.cu's NQ instances (the residual products' norm handoff) with 16-output units: block b computes
    # outputs 16b .. 16b + 15 (one row a warp of 16) and quantizes them with a scale of their own, as a
    # q8 format of 16-value units would let a block do, instead of whole 32-output groups (which at
    # n_out 2,048 fill 64 of 132 blocks, so the balance rule leaves TinyLlama without handoffs). The odd
    # unit's scale is not stored (the 32-value format holds one a pair): the readers decode it with its
    # neighbour's, so the values are wrong; the work of producer and reader is a 16-value format's,
    # less the reader's second scale a 32-value group (about 4 instructions a chunk). With the patch
    # that admits the NQ launch wherever the units fit the grid (_nq16_balance).
    "nq16": (
        "nothing: the residual products hand the next RMSNorm's products their input in 16-output units "
        "(see _nq16_balance; models whose n_embd is at most 16 x the multiprocessors, e.g. TinyLlama)",
        [("gemv.cu", "    if (HANDOFF && y_q8) {\n        row = 32 * group(blockIdx.x) + (threadIdx.x >> 5);\n",
          "    if (NQ) {  // the nq16 cut: block b takes outputs 16b .. 16b + 15, a row a warp\n"
          "        row = 16 * blockIdx.x + (threadIdx.x >> 5);\n        row_end = min(n_out, 16 * (int)blockIdx.x + 16);\n"
          "        row_step = WARPS;\n    } else if (HANDOFF && y_q8) {\n        row = 32 * group(blockIdx.x) + (threadIdx.x >> 5);\n"),
         ("gemv.cu", "        const int g0 = group(blockIdx.x), n16 = 8 * (group(blockIdx.x + 1) - g0);\n"
          "        if ((int)threadIdx.x < n16)\n"
          "            k4mma::cp_async16(k4mma::smem_u32(y_smem() + 4 * (n16 + threadIdx.x)), nq_w + 32 * g0 + 4 * threadIdx.x, true);\n",
          "        if ((int)threadIdx.x < 4 && 16 * (int)blockIdx.x < n_out)  // the nq16 cut: its 16 weights after its 16 outputs\n"
          "            k4mma::cp_async16(k4mma::smem_u32(y_smem() + 4 * (4 + threadIdx.x)), nq_w + 16 * blockIdx.x + 4 * threadIdx.x, true);\n"),
         ("gemv.cu", "            y_smem()[r - 32 * group(blockIdx.x)] = acc;\n", "            y_smem()[r - 16 * blockIdx.x] = acc;\n"),
         ("gemv.cu", "            const int g0 = group(blockIdx.x), n = group(blockIdx.x + 1) - g0;\n"
          "            const float* yo = y_smem();\n            float ss = 0.f;\n            for (int j = 0; j < n; ++j) {\n"
          "                const float v = yo[32 * j + lane];\n                ss += v * v;\n"
          "                q8_lane_store(v * yo[32 * (n + j) + lane], 32 * (g0 + j) + lane, n_out, y_swz, y_q8, lane);\n            }\n",
          "            // the nq16 cut: the block's 16 outputs as one unit with a scale of its own (lanes\n"
          "            // 16..31 mirror 0..15 and store the same bytes; an odd unit's scale is not stored)\n"
          "            const float* yo = y_smem();\n            const bool mine = 16 * (int)blockIdx.x < n_out;\n"
          "            const float v = mine ? yo[lane & 15] : 0.f;\n            float ss = lane < 16 ? v * v : 0.f;\n"
          "            if (mine) q8_lane_store(v * yo[16 + (lane & 15)], 16 * blockIdx.x + (lane & 15), n_out, y_swz, y_q8, lane);\n")]),
}
CUTS["moe-route-quant"] = ("both moe-route and moe-quant", CUTS["moe-route"][1] + CUTS["moe-quant"][1])



def _no_output_product(forward_class=None):
    """Forward.residual (of forward_class, default runtime/cuda/forward.py's Forward) without the
    one-token output product (w's inputs q_dim, no post-norm): its launch is left out and the
    feed-forward reads the residual stream as it was. Returns the undo."""
    if forward_class is None:
        from k4.runtime.cuda.forward import Forward as forward_class

    residual = forward_class.residual

    def patched(self, w, X, res, Y, post_norm, **kw):
        if X.shape[0] == 1 and post_norm is None and w.shape[1] == self.cfg.q_dim:
            return None
        return residual(self, w, X, res, Y, post_norm, **kw)

    forward_class.residual = patched
    return lambda: setattr(forward_class, "residual", residual)


def _zeroed_handoff(fwd, reader):
    """A zeroed NQ handoff (Q8Vector with one part, in fwd.act.nq8 and nq_parts, the norm's eps)
    for reader's products. The buffers are zeroed outside graph captures only (a fill would be
    captured into the step), so no NaN reaches the sampler."""
    from k4.runtime.cuda import launch
    from k4.runtime.cuda.q8_handoff import Q8Vector

    if not launch.capturing(None):
        fwd.act.nq8.fill(0)
        fwd.act.nq_parts.fill(0)
    vec = Q8Vector.for_weight(reader, fwd.act.nq8)
    return Q8Vector(vec.data, vec.n, vec.swizzle, fwd.act.nq_parts, 1, fwd.cfg.rms_eps)


def _zeroed_moe_handoff(moe_module=None):
    """runtime/cuda/moe.py moe_ffn (of moe_module, default runtime/cuda/moe.py) that, after one
    token's expert feed-forward, hands the next layer's q/k/v products (after the last layer the
    output head) a zeroed NQ handoff of their input (Forward.nq, as residual leaves a real one), so
    they copy it instead of normalizing and quantizing x: the most an NQ epilogue in moe_one could
    give its readers (docs/PERF.md, session 47). The buffers are zeroed outside graph captures
    only (a fill would be captured into the step), so no NaN reaches the sampler. Returns the undo."""
    if moe_module is None:
        from k4.runtime.cuda import moe as moe_module

    ffn = moe_module.moe_ffn

    def patched(fwd, L, x1, x, n, *args, **kwargs):
        ffn(fwd, L, x1, x, n, *args, **kwargs)
        layers = list(fwd.w.layers)
        li = next(i for i, layer in enumerate(layers) if layer is L)
        reader = fwd.hand.readers(li)[1]
        if n != 1 or reader is None:
            return
        norm_w = layers[li + 1].attn_norm if li + 1 < len(layers) else fwd.w.output_norm
        fwd.nq = (_zeroed_handoff(fwd, reader), norm_w)

    moe_module.moe_ffn = patched
    return lambda: setattr(moe_module, "moe_ffn", ffn)


def _zeroed_dense_handoff(forward_class=None):
    """Forward.residual (of forward_class, default runtime/cuda/forward.py's Forward) that, where a
    one-token residual product without a post-norm hands its readers nothing (no NQ launch: the
    balance rule, or its variant), leaves Forward.nq a zeroed NQ handoff for the products after
    the next RMSNorm (those that can read one: the `nq` reader forward passes), so they copy it
    instead of normalizing and quantizing x: the most a handoff from every such product could give
    (a q8 format of 8- or 16-value units, which no block would have to share; docs/PERF.md,
    session 48). The buffers are zeroed outside graph captures only. Returns the undo."""
    if forward_class is None:
        from k4.runtime.cuda.forward import Forward as forward_class

    residual = forward_class.residual

    def patched(self, w, X, res, Y, post_norm, x_q8=None, nq=None, variant=None):
        residual(self, w, X, res, Y, post_norm, x_q8=x_q8, nq=nq, variant=variant)
        if X.shape[0] != 1 or post_norm is not None or nq is None or nq[1] is None or self.nq is not None:
            return
        self.nq = (_zeroed_handoff(self, nq[1]), nq[0])

    forward_class.residual = patched
    return lambda: setattr(forward_class, "residual", residual)


def _nq16_balance(matmul_module=None):
    """matmul.nq_balanced (of matmul_module, default runtime/cuda/matmul.py) for the nq16 cut: the
    NQ launch wherever its 16-output units fit the grid, one a block of 16 warps (one row a warp),
    so the one-token residual products hand the next RMSNorm's products their input. A product
    whose 32-output groups the rule admits today would lose its handoff to the cut's mapping: that
    stops the run with a one-line error (models wider than 16 x the multiprocessors). Returns the undo."""
    if matmul_module is None:
        from k4.runtime.cuda import matmul as matmul_module

    balanced = matmul_module.nq_balanced

    def patched(n_out: int, n_in: int, grid: int, warps: int) -> bool:
        fits = warps == 16 and n_out // 16 <= grid
        if not fits and balanced(n_out, n_in, grid, warps):
            raise SystemExit(f"error: the nq16 cut cannot map the {n_out}-output NQ product onto {grid} blocks of {warps} "
                             "warps; use it on a model whose n_embd is at most 16 x the multiprocessors")
        return fits

    matmul_module.nq_balanced = patched
    return lambda: setattr(matmul_module, "nq_balanced", balanced)


# python-side patches a kernel cut needs besides its edits: name -> a function that patches and returns the undo
CUT_PATCHES = {"nq16": _nq16_balance}

# name -> (what the run leaves out, a function that patches it out and returns the undo)
LAUNCH_CUTS = {"wo": ("the one-token output product's launch (attention's output never reaches the residual stream)",
                      _no_output_product),
               "moe-nx": ("the x prologue of the products after a MoE layer: they read a zeroed NQ handoff "
                          "(what moe_one handing them their input could save at most)", _zeroed_moe_handoff),
               "dense-nx": ("the x prologue of the products after every residual product that hands them nothing: "
                            "they read a zeroed NQ handoff (what handoffs without the balance rule could save at most)",
                            _zeroed_dense_handoff)}


def apply_cut(src: Path, dst: Path, edits: list[tuple[str, str, str]]) -> None:
    """Copy the kernel sources (*.cu, *.cuh) of src into dst with the edits applied. Raises
    SystemExit naming the file when an anchor does not occur exactly once."""
    for path in [*src.glob("*.cu"), *src.glob("*.cuh")]:
        shutil.copy2(path, dst / path.name)
    for name, anchor, replacement in edits:
        text = (dst / name).read_text()
        if text.count(anchor) != 1:
            raise SystemExit(f"error: the cut's anchor occurs {text.count(anchor)} times in kernels_cu/{name}, not once; "
                             "update scripts/take_away.py CUTS to today's source")
        (dst / name).write_text(text.replace(anchor, replacement))


def use_sources(directory: Path) -> None:
    """Make runtime/cuda/compile.py compile from `directory` from now on: its SOURCE_DIR, its -I
    option, the headers' digest (part of CuPy's cache key), a fresh module cache, and a fresh
    cache of the products' kernel lookups (quant_kernels._kernel; each Ops keeps its own)."""
    from k4.runtime.cuda import compile as comp
    from k4.runtime.cuda import quant_kernels

    comp.SOURCE_DIR = directory
    comp.OPTIONS = tuple(f"-I{directory}" if o.startswith("-I") else o for o in comp.OPTIONS)
    comp.headers_digest.cache_clear()
    comp._modules.clear()
    quant_kernels._kernel.cache_clear()


def bench_ts(bench_args: list[str], test: str = "tg") -> float:
    """tgN t/s (the mean over its repetitions) of `k4 bench bench_args -o json`, in this process;
    with test "tvN" (--verify N in bench_args) that test's: N over its verify step's seconds."""
    from k4.cli.app import main as k4_main

    sys.argv = ["k4", "bench", *bench_args, "-o", "json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            k4_main()
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
    records = json.loads(buf.getvalue())
    return next(r["avg_ts"] for r in records if r["test"].startswith(test))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cut", nargs="?", choices=sorted([*CUTS, *LAUNCH_CUTS]))
    ap.add_argument("-m", "--model")
    ap.add_argument("-n", type=int, default=128, help="tokens a tgN run generates (default 128)")
    ap.add_argument("-r", type=int, default=3, help="repetitions a run (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="main / cut pairs, alternated (default 2)")
    ap.add_argument("--verify", type=int, default=0, help="time the speculative verify step of this many tokens (tvN) "
                    "instead of tgN")
    ap.add_argument("--list", action="store_true", help="print the cuts and exit")
    a = ap.parse_args(argv)
    if a.list or a.cut is None:
        for name, (what, _) in [*CUTS.items(), *LAUNCH_CUTS.items()]:
            print(f"{name:16s} {what}")
        return
    if a.model is None:
        raise SystemExit("error: give the model with -m MODEL.gguf")

    from k4.kernels_cu import SOURCE_DIR
    from k4.runtime.model import open_model

    n_layer = open_model(a.model).config.n_layer
    args = ["-m", a.model, "--backend", "cuda", "-p", "0", "-n", str(a.n), "-r", str(a.r)]
    test = f"tv{a.verify}" if a.verify else f"tg{a.n}"
    if a.verify:
        args += ["--verify", str(a.verify)]
    runs: dict[str, list[float]] = {"main": [], a.cut: []}
    with tempfile.TemporaryDirectory(prefix="k4-cut-") as tmp:
        if a.cut in LAUNCH_CUTS:
            install = LAUNCH_CUTS[a.cut][1]
        else:
            apply_cut(SOURCE_DIR, Path(tmp), CUTS[a.cut][1])

            def install():  # compile from the cut's copy (and patch what CUT_PATCHES says) until the undo
                use_sources(Path(tmp))
                unpatch = CUT_PATCHES[a.cut]() if a.cut in CUT_PATCHES else (lambda: None)

                def undo():
                    unpatch()
                    use_sources(SOURCE_DIR)
                return undo
        for _ in range(a.rounds):
            for name in runs:
                undo = install() if name == a.cut else None
                runs[name].append(bench_ts(args, test))
                if undo:
                    undo()
                print(f"{name:16s} {test} {runs[name][-1]:10.2f} t/s", flush=True)
    base, cut = (sum(v) / len(v) for v in runs.values())
    step_us = (a.verify or 1) * (1e6 / base - 1e6 / cut)  # a tvN step makes N tokens
    print(f"{a.cut}: {(CUTS.get(a.cut) or LAUNCH_CUTS[a.cut])[0]}")
    print(f"main {base:.2f} t/s, without it {cut:.2f} t/s ({cut / base - 1:+.1%}): {step_us:.1f} µs a step, "
          f"{step_us / n_layer:.2f} µs a layer ({n_layer} layers) on the critical path")


if __name__ == "__main__":
    main(sys.argv[1:])
