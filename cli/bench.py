"""`k4 bench`: llama-bench-style throughput, plus where the time and the bytes go."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from . import common as c
from .bench_printers import PRINTERS, write_json, write_jsonl
from .render import err, errors_to_exit, out, table

FORMATS = tuple(PRINTERS)
KERNEL_FORMATS = ("table", "json", "jsonl")  # --kernels: its gemv and attention records have different fields, so no csv or md


@errors_to_exit
def bench(
    model: c.ModelOpt = None,
    synthetic: Annotated[Optional[str], typer.Option("--synthetic", help="Bench a synthetic model of this preset (written to a temporary file).")] = None,
    n_prompt: Annotated[str, typer.Option("-p", "--n-prompt", help="Prompt sizes, comma list.")] = "512",
    n_gen: Annotated[str, typer.Option("-n", "--n-gen", help="Generated tokens, comma list.")] = "128",
    pg: Annotated[Optional[List[str]], typer.Option("--pg", help="Prompt,generation pair (repeatable), e.g. 512,128.")] = None,
    depth: Annotated[str, typer.Option("-d", "--depth", help="KV cache depths before each test, comma list.")] = "0",
    reps: Annotated[int, typer.Option("-r", "--repetitions", help="Measured runs per test (after one warm-up).")] = 5,
    flags: Annotated[Optional[List[str]], typer.Option("--flags", help="A flag configuration \"K4_X=0;K4_Y=1\" (repeatable).")] = None,
    cache_type_k: Annotated[str, typer.Option("-ctk", "--cache-type-k", help="KV cache types of the keys, comma list (f16, q8_0).")] = "f16",
    cache_type_v: Annotated[str, typer.Option("-ctv", "--cache-type-v", help="KV cache types of the values, comma list (f16, q8_0).")] = "f16",
    output: Annotated[str, typer.Option("-o", "--output", help="table, md, csv, json or jsonl.")] = "table",
    backend: c.BackendOpt = "auto",
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", help="Context size in tokens (0 = what the longest test needs, as llama-bench sizes it: depth + prompt + generated).")] = 0,
    kernels: Annotated[bool, typer.Option("--kernels", help="Microbenchmark the matrix-vector and attention kernels instead (GPU).")] = False,
    verify: Annotated[str, typer.Option("--verify", help="Speculative verify steps of N tokens (tests tvN), comma list; timed against one-token steps.")] = "",
    lookup: Annotated[int, typer.Option("--lookup", help="Also run each tg test with prompt lookup of n-grams up to N, every draft right (tgN/lookupN).")] = 0,
    draft_max: Annotated[int, typer.Option("--draft-max", help="Most draft tokens per verify step with --lookup.")] = 7,
    bandwidth: Annotated[float, typer.Option("--bandwidth", help="Memory bandwidth in GB/s for the decode bound of tgN tests "
                                                                 "(4200: the H200's HBM3e).")] = 4200.0,
) -> None:
    """Measure prompt processing (ppN) and generation (tgN) speed, llama-bench style."""
    from k4.runtime import bench as rb
    from k4.runtime.errors import UsageError
    from k4.runtime.speculative import DRAFT_LIMIT

    from k4.runtime.flags import Flags
    from k4.runtime.kv_types import KVTypes

    for warning in Flags().warnings():
        err.print(f"warning: {warning}", style="yellow")
    if output not in FORMATS:
        raise UsageError(f"-o {output!r} is unknown; use one of {', '.join(FORMATS)}")
    if reps < 1:
        raise UsageError(f"-r {reps} is invalid; use at least 1")
    c.check_ctx_size(ctx_size)
    if not bandwidth > 0 or bandwidth == float("inf"):
        raise UsageError(f"--bandwidth {bandwidth} is invalid; give the memory bandwidth in GB/s, e.g. 4200")
    if kernels:
        if output not in KERNEL_FORMATS:
            raise UsageError(f"-o {output} does not apply to --kernels; use -o {', -o '.join(KERNEL_FORMATS)}")
        return _kernels(output)
    pairs = [tuple(rb.parse_list(x, "--pg")) for x in (pg or [])]
    if any(len(p) != 2 for p in pairs):
        raise UsageError("--pg takes a pair PROMPT,GEN, e.g. --pg 512,128")
    if lookup < 0 or not 1 <= draft_max <= DRAFT_LIMIT:
        raise UsageError(f"--lookup {lookup} / --draft-max {draft_max}: use --lookup >= 0 and --draft-max 1 to {DRAFT_LIMIT}")
    kv_sets = [KVTypes(k, v) for k in rb.parse_cache_types(cache_type_k, "--cache-type-k")
               for v in rb.parse_cache_types(cache_type_v, "--cache-type-v")]
    tests = rb.expand(rb.parse_list(n_prompt, "-p"), rb.parse_list(n_gen, "-n"), pairs, rb.parse_list(depth, "--depth"),
                      [rb.parse_flags(f) for f in (flags or [])], rb.parse_list(verify, "--verify") if verify else (),
                      lookup, draft_max, kv_sets)
    if not tests:
        raise UsageError("nothing to run: every -p, -n and --pg is 0")
    if synthetic and model:
        raise UsageError("give either -m MODEL or --synthetic PRESET, not both")
    with tempfile.TemporaryDirectory(prefix="k4-bench-") as tmp:
        path = _synthetic(synthetic, Path(tmp)) if synthetic else c.model_path(model)
        _run(path, tests, reps, output, backend, ctx_size, bandwidth)


def _synthetic(preset: str, folder: Path) -> Path:
    from k4.runtime.synthetic import write_synthetic

    from .render import progress_bar

    with progress_bar(f"writing synthetic {preset}") as update:
        return write_synthetic(preset, folder / f"{preset}.gguf", progress=update)


def _run(path: Path, tests, reps: int, output: str, backend: str, ctx_size: int, bandwidth: float) -> None:
    from rich.progress import Progress

    from k4.runtime import bench as rb
    from k4.runtime.backend import make_backend
    from k4.runtime.bound import decode_bound
    from k4.runtime.model import open_model

    mf = open_model(path)
    cfg = mf.config
    need = max(t.ctx_tokens for t in tests)
    n_ctx = ctx_size or max(need, 16)
    warning = c.ctx_warning(n_ctx, cfg.n_ctx_train)
    if warning:
        err.print(warning, style="yellow", markup=False)
    model_info = {"model_type": f"{cfg.arch} {cfg.name}", "model_size": mf.file_size, "model_n_params": mf.n_params,
                  "bandwidth_gbs": bandwidth}
    bounds = {t: decode_bound(mf, t.depth, t.n_gen, bandwidth, t.kv) for t in tests if t.n_gen and not t.n_prompt}
    results, env = [], None
    with Progress(console=err, transient=True, disable=not err.is_terminal) as prog:
        task = prog.add_task("benchmarking", total=len(tests) * reps)
        try:
            for res in rb.iter_results(tests, lambda flags, kv: make_backend(mf, backend, n_ctx, flags=flags, kv_types=kv), reps, cfg.n_vocab,
                                       on_rep=lambda: prog.advance(task)):
                env = env or rb.environment(path, res.backend)
                results.append(res)
        except KeyboardInterrupt:
            err.print(f"interrupted: showing the {len(results)} finished test(s)")
            _print(results, env, model_info, output, bounds)
            raise typer.Exit(130)
    _print(results, env, model_info, output, bounds)


def _print(results, env, model_info, output: str, bounds: dict) -> None:
    """Print `results` with `output`'s printer; bounds: BenchTest -> runtime.bound.DecodeBound (tgN tests)."""
    from k4.runtime.bench import result_record

    if results:
        PRINTERS[output](results, [result_record(r, env, model_info, bounds.get(r.test)) for r in results])


def _kernels(output: str) -> None:
    from k4.runtime.backend import cuda_available
    from k4.runtime.errors import BackendUnavailableError

    if not cuda_available():
        raise BackendUnavailableError("--kernels needs an NVIDIA GPU and CuPy; install k4 with the cuda13 or cuda12 extra")
    from k4.runtime.cuda.microbench import bench_attention, bench_gemv, bench_read

    # x "q8": x comes quantized, as the down product (4096x11008) gets it in decode with K4_FUSE_QUANT=1
    shapes = [("Q4_K", 4096, 4096, "f32"), ("Q4_K", 11008, 4096, "f32"), ("Q4_K", 4096, 11008, "f32"), ("Q4_K", 4096, 11008, "q8"),
              ("Q4_K", 32000, 4096, "f32"), ("Q6_K", 4096, 4096, "f32"), ("Q6_K", 4096, 11008, "q8"), ("Q6_K", 32000, 4096, "f32"),
              ("Q5_K", 4096, 4096, "f32"), ("Q8_0", 4096, 4096, "f32"), ("Q5_0", 4096, 4096, "f32"), ("Q5_1", 4096, 4096, "f32"),
              ("Q2_K", 4096, 4096, "f32"), ("Q3_K", 4096, 4096, "f32"), ("Q4_0", 4096, 4096, "f32"), ("IQ4_XS", 4096, 4096, "f32"),
              ("F16", 4096, 4096, "f32")]
    gemv = []
    for qtype, n_out, n_in, x in shapes:
        r = bench_gemv(qtype, n_out, n_in, x_q8=x == "q8")
        read = bench_read(r["bytes"])  # the same bytes read by a kernel that only streams them
        dep = bench_read(r["bytes"], dependent=True)  # ... and waits for the previous launch, as a product waits for x
        gemv.append({"kernel": "gemv", "type": qtype, "n_out": n_out, "n_in": n_in, "x": x, "us": r["us"], "gb_s": r["gb_s"],
                     "fraction_of_4.2TB/s": r["gb_s"] / 4200.0, "read_us": read["us"], "fraction_of_read": read["us"] / r["us"],
                     "dependent_read_us": dep["us"], "fraction_of_dependent_read": dep["us"] / r["us"]})
    # prefill (causal, from position 0) and decode (one query at a depth); 32 heads of 128 as Llama 2 7B
    # (32 KV heads), or as Llama 3 8B (8 KV heads: GQA), over f16 and q8_0 keys and values
    from k4.runtime.kv_types import KVTypes

    attn = []
    for name, n_tok, n_ctx, n_kv_head, kv in (
            ("prefill", 4096, 4096, 32, "f16"), ("prefill", 512, 512, 32, "f16"), ("prefill", 4096, 4096, 32, "q8_0"),
            ("decode", 1, 4096, 32, "f16"), ("decode", 1, 16384, 32, "f16"), ("decode", 1, 16384, 32, "q8_0"),
            ("decode", 1, 131072, 8, "f16"), ("decode", 1, 131072, 8, "q8_0")):
        r = bench_attention(n_tok, n_ctx, n_head_kv=n_kv_head, kv=KVTypes(kv, kv))
        attn.append({"kernel": f"attention {name}", "kv_type": kv, "n_tok": n_tok, "n_ctx": n_ctx, "n_head": 32,
                     "n_head_kv": n_kv_head, "head_dim": 128, "us": r["us"], "tflop_s": r["tflop_s"], "gb_s": r["gb_s"]})
    records = gemv + attn
    if output in ("json", "jsonl"):
        (write_json if output == "json" else write_jsonl)(records)
        return
    out.print(table("matrix-vector kernels (median of CUDA-event timings; read: a kernel that only streams the same bytes; "
                    "dep. read: the same, waiting for the previous launch as a product waits for its x)",
                    ("type", "n_out x n_in", "x", "µs", "GB/s", "of 4.2 TB/s", "read µs", "of read", "dep. read µs", "of dep. read"),
                    [(r["type"], f"{r['n_out']}x{r['n_in']}", r["x"], f"{r['us']:.2f}", f"{r['gb_s']:,.0f}", f"{r['fraction_of_4.2TB/s']:.0%}",
                      f"{r['read_us']:.2f}", f"{r['fraction_of_read']:.0%}", f"{r['dependent_read_us']:.2f}",
                      f"{r['fraction_of_dependent_read']:.0%}") for r in gemv], right=(3, 4, 5, 6, 7, 8, 9)))
    out.print(table("attention, 32 heads of 128 (causal; TFLOP/s counts the causal half; KV GB/s: quants and scales)",
                    ("kernel", "KV type", "KV heads", "queries", "keys", "µs", "TFLOP/s", "KV GB/s"),
                    [(r["kernel"], r["kv_type"], r["n_head_kv"], r["n_tok"], r["n_ctx"], f"{r['us']:,.1f}", f"{r['tflop_s']:,.1f}",
                      f"{r['gb_s']:,.0f}") for r in attn], right=(2, 3, 4, 5, 6, 7)))


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
