"""The CUDA backend's Python run on the CPU over tests/cupy_stub.py, every kernel launch checked
against the kernel's parameter list (tests/kernel_params.py).

    python -m tests.dry_run DIR CASE[:K4_FLAG=V,...][@deep] ...
    python -m tests.dry_run --cli K4_ARGS...    (a k4 command, its launches checked the same way)
    python -m tests.dry_run --pytest PYTEST_ARGS...    (e.g. -m cuda: the GPU tests over the stub)

The last form is a check for a session without a GPU, not a test: every GPU test that compares
numbers fails over the stub (its kernels write nothing), so what it shows is the failures of
another kind, a test or launcher that raises before any number is compared.

For each case (a tiny model of tests/cuda_backend_cases.py ARCH_CASES, DRY_CASES or Gemma's, or
`synth-PRESET`, written into DIR, with the K4_* flags given), in one process with the stub
installed: load, a prefill with all logits, greedy generation (the decode graphs), sampled
generation with a repeat penalty, and speculative verify steps of 8 tokens (eager, then captured)
and 4; `@deep`: generation and a verify step past 4,096 keys instead (exercise). Prints one JSON
line a case: the kernels launched and the problems found, each a line naming the kernel:
- kernel_params.launch_problems for every launch (argument count and kinds, geometry);
- what a CUDA graph capture refuses, done during one (cupy_stub.CAPTURE_VIOLATIONS: a device
  allocation, a synchronization, a synchronous copy), with the source line that did it.
Exit status 0 when no case found a problem.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tests import cupy_stub
from tests.cuda_backend_cases import K_CFG

DATA = Path(__file__).resolve().parent / "data"
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]  # more than a verify step: MoE prefill grouped by expert
DEEP_CTX, DEEP_PROMPT = 8192, 4200

_MOE = {"n_expert": 8, "n_expert_used": 2, "n_ff_exp": 32}
ROUTER = "router_type"  # a DRY_CASES key: the router's type, where not F32

# Tiny models beyond ARCH_CASES: the shapes that take the decode kernels' other paths.
# hd64: heads of 64 on an fp16 cache, attn_short (its smallest head); its 4 query heads a KV head
# take attn_gqa where K4_SHORT_ATTN is off.
DRY_CASES = {
    "llama-q4_k-hd64": ("llama", "Q4_K", {"n_embd": 256, "n_ff": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "rope_dim": 64}),
    "qwen2-q4_k-hd128": ("qwen2", "Q4_K", {"n_embd": 256, "n_ff": 512, "n_head": 2, "n_head_kv": 1, "head_dim": 128,
                                           "rope_dim": 128}),
    # float experts (moe.cu moe_gemv_f), a shared expert (qwen2moe), a quantized router (moe_gemv_q on float x)
    "qwen3moe-f16": ("qwen3moe", "F16", {**_MOE, "has_qk_norm": True, "expert_norm": True}),
    "qwen2moe-q8_0-shexp": ("qwen2moe", "Q8_0", {**_MOE, "n_ff_shexp": 64, "has_qkv_bias": True}),
    "qwen3moe-q4_k-q8_0-router": ("qwen3moe", "Q4_K", {**K_CFG, **_MOE, "n_ff_exp": 256, "has_qk_norm": True,
                                                       "expert_norm": True, ROUTER: "Q8_0"}),
}


# Synthetic Q4_K_M models of runtime/synthetic.py's presets cut to SYNTH_LAYERS layers and at most
# SYNTH_VOCAB tokens: the real widths, so the kernels and variants the real models take (paired q|k
# and v runs, wide products, clusters, the MoE's one launch); `synth-` and the preset's name.
SYNTH_LAYERS = 2
SYNTH_VOCAB = 8192


_written: set[Path] = set()


def write_case(case: str, folder: Path):
    """The ModelFile of a model `case` (ARCH_CASES, DRY_CASES, GEMMA_CASES or synth-PRESET), written in folder."""
    from dataclasses import replace

    from gguf import GGMLQuantizationType as T
    from k4.runtime import synthetic
    from k4.runtime.model import open_model

    from tests import tiny
    from tests.cuda_backend_cases import ARCH_CASES
    from tests.quant_blocks import blocks_like

    tiny.quantize = blocks_like  # random valid blocks of every type (as tests/conftest.py's tiny_model)
    vocab = DATA / "models" / "stories260K.gguf"
    path = folder / f"{case}.gguf"
    if path in _written:  # written by this process: the same bytes again
        return open_model(path)
    _written.add(path)
    if case.startswith("synth-"):
        preset = synthetic.PRESETS[case.removeprefix("synth-")]
        synthetic.PRESETS[case] = replace(preset, n_layer=SYNTH_LAYERS, n_vocab=min(preset.n_vocab, SYNTH_VOCAB))
        synthetic.write_synthetic(case, path, force=True)
        return open_model(path)
    if case in ARCH_CASES:
        arch, ttype, over = ARCH_CASES[case]
        cfg = tiny.tiny_config(arch, **over)
    elif case in DRY_CASES:
        arch, tname, over = DRY_CASES[case]
        over = dict(over)
        router, ttype = over.pop(ROUTER, None), T[tname]
        cfg = tiny.tiny_config(arch, **over)
        if router:  # the routers written in that type instead of F32
            names = [f"blk.{i}.ffn_gate_inp.weight" for i in range(cfg.n_layer)]
            rng = np.random.default_rng(1)
            extra = {n: (blocks_like(rng.standard_normal((cfg.n_expert, cfg.n_embd)).astype(np.float32), T[router]), T[router])
                     for n in names}
            tiny.write_tiny(path, vocab, cfg, ttype, seed=7, skip=tuple(names), extra=extra)
            return open_model(path)
    else:
        from tests.test_gemma import GEMMA_CASES, gemma_tiny

        arch, keys, over = GEMMA_CASES[case]
        cfg, ttype = gemma_tiny(arch, keys, head_dim=64, **over), T.Q8_0
    tiny.write_tiny(path, vocab, cfg, ttype, seed=7)
    return open_model(path)


def exercise(mf, flags, deep: bool = False) -> None:
    """On a CudaBackend of mf with `flags` (runtime/flags.py Flags): load, prefill, generate
    (greedy, then sampled with a penalty), verify 8 tokens twice (the second step captured as a
    graph) and 4 tokens; deep: with a context of DEEP_CTX, greedy generation and a verify step
    after a prompt of DEEP_PROMPT tokens (decode attention past 4,096 keys: split, attn_gqa)."""
    from k4.runtime.cuda.backend import CudaBackend
    from k4.runtime.sampling import SamplingParams

    from tests.cuda_backend_cases import GREEDY, take

    be = CudaBackend(mf, DEEP_CTX if deep else 64, flags=flags)
    try:
        if deep:
            long = [(7 * i) % 500 + 1 for i in range(DEEP_PROMPT)]
            take(be.generate(long, GREEDY), 3)
            be.reset()
            be.eval(long)
            be.verify([3, 4, 5, 6, 7, 8, 9, 10])
            return
        be.eval(PROMPT, all_logits=True)
        be.reset()
        take(be.generate(PROMPT, GREEDY), 5)
        be.reset()
        take(be.generate(PROMPT, SamplingParams(temperature=0.8, repeat_penalty=1.1, seed=3)), 3)
        be.reset()
        be.eval(PROMPT)
        be.verify([3, 4, 5, 6, 7, 8, 9, 10])  # eagerly, then captured as a graph and replayed
        be.verify([3, 4, 5, 6, 7, 8, 9, 10])
        be.verify([11, 12, 13, 14])
    finally:
        be.close()


def run_case(spec: str, folder: Path) -> dict:
    """One case of the module docstring's spec syntax, run and checked (summary)."""
    from k4.runtime.flags import Flags

    spec_case, deep = spec.removesuffix("@deep"), spec.endswith("@deep")
    case, _, flags = spec_case.partition(":")
    cupy_stub.reset()
    exercise(write_case(case, folder), Flags(dict(kv.split("=", 1) for kv in flags.split(",") if kv)), deep)
    return summary(spec)


def summary(name: str) -> dict:
    """The launches recorded since LAUNCHES was cleared, checked: {case, launches, kernels, problems}."""
    from tests.kernel_params import base_name, launch_problems

    launches = [la for la in cupy_stub.LAUNCHES if isinstance(la, cupy_stub.Launch)]
    problems = {p for la in launches for p in launch_problems(la, cupy_stub.ndarray)}
    problems |= set(cupy_stub.CAPTURE_VIOLATIONS)
    return {"case": name, "launches": len(launches), "kernels": sorted({base_name(la.kernel.name) for la in launches}),
            "problems": sorted(problems)}


def run_cli(args: list[str]) -> int:
    """`k4 ARGS` (cli/app.py main) over the stub; then the launches' summary as the last line of
    stdout. Its exit status: the command's, or 1 where a launch has a problem."""
    from k4.cli.app import main as k4_main

    cupy_stub.reset()
    sys.argv = ["k4", *args]
    try:
        k4_main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    result = summary("k4 " + " ".join(args))
    print(json.dumps(result), flush=True)
    return code or (1 if result["problems"] else 0)


def main(argv: list[str]) -> int:
    cupy_stub.install()
    cupy_stub.patch_launch()
    if argv[0] == "--cli":
        return run_cli(argv[1:])
    if argv[0] == "--pytest":  # the `cuda` tests' Python over the stub: what fails other than by its numbers
        import pytest

        return int(pytest.main(argv[1:]))
    folder, specs = Path(argv[0]), argv[1:]
    bad = 0
    for spec in specs:
        result = run_case(spec, folder)
        bad += bool(result["problems"])
        print(json.dumps(result), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
