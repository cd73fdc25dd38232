"""Benchmarks with llama-bench's structure: comma lists expand into a cartesian product of
test instances, one warm-up run each, raw per-run samples kept, tokens/s as mean +- sample sd.
Nothing here prints; cli/bench.py renders.

Test names as llama-bench: pp512 (prompt processing of 512 tokens), tg128 (128 decoded
tokens), pp512+tg128 (both, one figure over all tokens), and tg128@d4096 (decode after a KV
cache filled with 4096 tokens). Prompt tokens are random ids from the vocabulary (seeded).
"""

from __future__ import annotations

import itertools
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from .bound import DecodeBound
from .errors import UsageError
from .flags import FLAGS, Flags
from .kv_types import F16, KVTypes, parse_cache_type
from .bench_spec import VERIFY_STEPS, run_lookup, run_verify
from .sampling import SamplingParams


@dataclass(frozen=True)
class BenchTest:
    """One test instance: prompt tokens, generated tokens, KV depth, a flag configuration and
    the KV cache types (-ctk, -ctv)."""

    n_prompt: int
    n_gen: int
    depth: int = 0
    flags: tuple[tuple[str, str], ...] = ()
    kv: KVTypes = F16
    n_verify: int = 0  # tvN: a speculative verify step of N tokens (runtime/bench_spec.py)
    lookup: int = 0  # tgN with prompt lookup of n-grams up to this size, every draft right (bench_spec.py)
    draft_max: int = 7  # drafts per verify step with lookup

    @property
    def name(self) -> str:
        if self.n_verify:
            return f"tv{self.n_verify}" + (f"@d{self.depth}" if self.depth else "")
        parts = ([f"pp{self.n_prompt}"] if self.n_prompt else []) + ([f"tg{self.n_gen}"] if self.n_gen else [])
        spec = f"/lookup{self.lookup}" if self.lookup else ""
        return "+".join(parts) + spec + (f"@d{self.depth}" if self.depth else "")

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen

    @property
    def ctx_tokens(self) -> int:
        """Context the test needs: depth, its tokens, and for tvN every verify step's worst case."""
        if self.n_verify:
            return self.depth + 1 + VERIFY_STEPS * (self.n_verify + 1)
        return self.depth + self.n_tokens + (1 if self.lookup else 0)

    @property
    def flags_text(self) -> str:
        return ";".join(f"{k}={v}" for k, v in self.flags)


@dataclass
class BenchResult:
    """Raw samples (tokens/s per repetition) and what a run of the test recorded."""

    test: BenchTest
    samples: list[float] = field(default_factory=list)
    token_ms: list[float] = field(default_factory=list)  # per decoded token latencies of every repetition (host clock)
    token_gpu_ms: list[float] = field(default_factory=list)  # device time of each decode step (CUDA events), every repetition
    phases: dict[str, dict] = field(default_factory=dict)  # trace counters of the last repetition
    memory: dict[str, int] = field(default_factory=dict)
    load: dict[str, dict] = field(default_factory=dict)  # the backend's load-phase counters (ms, bytes) when it was built
    flag_values: dict[str, int] = field(default_factory=dict)  # every K4_* flag as the backend saw it
    backend: str = ""  # the backend's name ("numpy", "cuda"): what "auto" picked
    n_ctx: int = 0  # the backend's context, tokens
    load_ms: dict[str, float] = field(default_factory=dict)  # the backend's load steps (ms) when it was built
    load_detail_ms: dict[str, float] = field(default_factory=dict)  # inside read+upload (CUDA backend): read and copy times
    extra: dict = field(default_factory=dict)  # what a speculative test measured besides t/s (bench_spec.py), last repetition

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else float("nan")

    @property
    def sd(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    def latency(self, q: float, gpu: bool = False) -> float:
        """Per-token decode latency quantile q in [0, 1], ms: host clock between tokens, or with
        gpu the device time of each decode step from CUDA events. nan without samples."""
        samples = self.token_gpu_ms if gpu else self.token_ms
        return float(np.quantile(samples, q)) if samples else float("nan")


def parse_list(text: str, what: str) -> list[int]:
    """"128,512" -> [128, 512]. Raises UsageError on anything but non-negative integers."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip() != ""]
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a comma list of integers, e.g. 128,512") from None
    if not values or any(v < 0 for v in values):
        raise UsageError(f"{what} {text!r} must list non-negative integers, e.g. 128,512")
    return values


def parse_flags(text: str) -> tuple[tuple[str, str], ...]:
    """"K4_X=1;K4_Y=0" -> (("K4_X", "1"), ("K4_Y", "0")). Raises UsageError on unknown flags."""
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in FLAGS:
            raise UsageError(f"--flags item {item!r} is not NAME=VALUE with a known flag ({', '.join(FLAGS)})")
        pairs.append((name, value.strip()))
    return tuple(pairs)


def parse_cache_types(text: str, option: str) -> list[str]:
    """"f16,q8_0" -> ["f16", "q8_0"] for -ctk / -ctv (option). Raises UsageError for a type
    outside kv_types.CACHE_TYPES or an empty list."""
    values = [parse_cache_type(x.strip(), option) for x in str(text).split(",") if x.strip()]
    if not values:
        raise UsageError(f"{option} {text!r} lists no cache type; use e.g. f16,q8_0")
    return values


def expand(n_prompt: Sequence[int], n_gen: Sequence[int], pg: Sequence[tuple[int, int]],
           depths: Sequence[int], flag_sets: Sequence[tuple[tuple[str, str], ...]], verify: Sequence[int] = (),
           lookup: int = 0, draft_max: int = 7, kv_sets: Sequence[KVTypes] = (F16,)) -> list[BenchTest]:
    """Every combination, in llama-bench's order: per flag set, KV cache types and depth, the pp
    tests, the tg tests (and with lookup each again with prompt lookup), the pp+tg pairs, then
    the tvN verify steps of `verify`. Zero-sized tests are skipped."""
    tests = []
    for flags, kv, depth in itertools.product(flag_sets or [()], kv_sets or [F16], depths or [0]):
        tests += [BenchTest(p, 0, depth, flags, kv) for p in n_prompt if p > 0]
        tests += [BenchTest(0, n, depth, flags, kv) for n in n_gen if n > 0]
        if lookup:
            tests += [BenchTest(0, n, depth, flags, kv, lookup=lookup, draft_max=draft_max) for n in n_gen if n > 0]
        tests += [BenchTest(p, n, depth, flags, kv) for p, n in pg if p > 0 or n > 0]
        tests += [BenchTest(0, 0, depth, flags, kv, n_verify=v) for v in verify if v > 0]
    return tests


def _prompt(n: int, n_vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, n_vocab, size=n).tolist()


def run_once(backend, test: BenchTest, n_vocab: int, seed: int,
             clock: Callable[[], float] = time.perf_counter, extra: dict | None = None) -> tuple[float, list[float]]:
    """One repetition: returns (tokens/s over the test's tokens, per-token decode ms). `clock`
    reads seconds (time.perf_counter; tests pass a fake one). extra: receives what a
    speculative test measures besides (bench_spec.py)."""
    backend.reset()
    if test.ctx_tokens > backend.n_ctx:
        raise UsageError(f"{test.name} needs {test.ctx_tokens} tokens of context; raise --ctx-size")
    if test.depth:
        backend.eval(_prompt(test.depth, n_vocab, seed + 1))
    prompt = _prompt(test.n_prompt, n_vocab, seed)
    extra = {} if extra is None else extra
    if test.n_verify:
        tps, measured = run_verify(backend, test.n_verify, prompt or [1], n_vocab, seed, clock)
        extra.update(measured)
        return tps, []
    if test.lookup:
        tps, token_ms, measured = run_lookup(backend, prompt or [1], test.n_gen, test.lookup, test.draft_max, clock)
        extra.update(measured)
        return tps, token_ms
    t0 = clock()
    token_ms: list[float] = []
    if not test.n_gen:
        backend.eval(prompt)
        elapsed = clock() - t0
    else:
        feed = prompt
        if not prompt:  # decode only: the first step re-evaluates the last cached token (or BOS)
            feed = [backend.tokens[-1]] if backend.tokens else [1]
            backend.truncate(max(backend.n_past - 1, 0))
        gen = backend.generate(feed, SamplingParams(temperature=0.0))
        try:
            t_prev = clock()
            for i in range(test.n_gen):
                next(gen)
                t = clock()
                if i or not prompt:  # the first token of pp+tg also carries the prefill
                    token_ms.append((t - t_prev) * 1e3)
                t_prev = t
            # the clock stops when the n-th token reaches the host: a backend computing one
            # step ahead (ping-pong) has then evaluated n_gen tokens, as llama-bench's tgN
            # does; the step in flight that close() finishes and discards is not counted
            elapsed = clock() - t0
        finally:
            gen.close()
    return test.n_tokens / elapsed, token_ms


def run_test(backend, test: BenchTest, reps: int, n_vocab: int, seed: int = 0,
             on_rep: Callable[[], None] | None = None, load: dict | None = None,
             clock: Callable[[], float] = time.perf_counter) -> BenchResult:
    """One warm-up run, then `reps` measured runs of `test` on `backend` (clock: see run_once)."""
    res = BenchResult(test, load=load or {})
    run_once(backend, test, n_vocab, seed, clock)
    for r in range(reps):
        backend.trace.reset()
        tps, token_ms = run_once(backend, test, n_vocab, seed, clock, res.extra)
        res.samples.append(tps)
        res.token_ms += token_ms
        res.token_gpu_ms += backend.trace.gpu_steps.get("decode", [])
        if on_rep:
            on_rep()
    res.phases = {name: c.as_dict() for name, c in backend.trace.phases.items()}
    res.memory = backend.memory_report()
    return res


def environment(model: Path | None = None, backend_name: str = "") -> dict:
    """What a result was measured on: k4 version and commit, Python, numpy, CuPy, GPU, driver, CUDA."""
    from . import __version__

    env = {"k4_version": __version__, "git_commit": _git_commit(), "python": platform.python_version(),
           "numpy": np.__version__, "backend": backend_name, "cpu": platform.processor() or platform.machine()}
    if model is not None:
        env.update({"model": str(model), "model_bytes": Path(model).stat().st_size})
    try:
        import cupy as cp

        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        env.update({"cupy": cp.__version__, "gpu": props["name"].decode(),
                    "driver": cp.cuda.runtime.driverGetVersion(), "cuda_runtime": cp.cuda.runtime.runtimeGetVersion()})
    except Exception:
        env.update({"cupy": None, "gpu": None})
    return env


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _measured(value: float) -> float | None:
    """None for NaN (nothing measured), so records hold no NaN: csv writes an empty cell, JSON null."""
    return None if value != value else value


def result_record(res: BenchResult, env: dict, model_info: dict, bound: DecodeBound | None = None) -> dict:
    """A flat dict for the machine-readable printers (csv/json/jsonl); a figure with no samples
    behind it (the decode latencies of a ppN test) is None. With `bound` (runtime/bound.py, for a
    tgN test) the bytes read per token, the bandwidth bound in tokens/s and avg_ts as a fraction
    of it; None for the other tests."""
    t = res.test
    bound_ts = bound.tokens_per_s if bound else None
    return {
        **env, **model_info,
        "test": t.name, "n_prompt": t.n_prompt, "n_gen": t.n_gen, "n_depth": t.depth, "n_ctx": res.n_ctx, "flags": t.flags_text,
        "type_k": t.kv.k, "type_v": t.kv.v,
        "reps": len(res.samples), "avg_ts": _measured(res.mean), "stddev_ts": res.sd, "samples_ts": list(res.samples),
        "token_ms_p50": _measured(res.latency(0.5)), "token_ms_p99": _measured(res.latency(0.99)),
        "token_gpu_ms_p50": _measured(res.latency(0.5, gpu=True)), "token_gpu_ms_p99": _measured(res.latency(0.99, gpu=True)),
        "phases": res.phases, "memory": res.memory, "flag_values": res.flag_values, "load_ms": res.load_ms,
        "load_detail_ms": res.load_detail_ms,
        "bound_bytes_per_token": bound.bytes_per_token if bound else None, "bound_ts": bound_ts,
        "bound_fraction": _measured(res.mean / bound_ts) if bound_ts else None, **res.extra,
    }


def iter_results(tests: Sequence[BenchTest], make_backend: Callable[[Flags, KVTypes], object], reps: int, n_vocab: int,
                 on_rep: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                 base: Flags | None = None) -> Iterator[BenchResult]:
    """Run every test, building one backend per flag set and KV cache types: make_backend(flags,
    kv) gets `base` (default: the environment's Flags) with the test's --flags applied and the
    test's cache types. clock: see run_once."""
    base = base if base is not None else Flags()
    for (overrides, kv), group in itertools.groupby(tests, key=lambda t: (t.flags, t.kv)):
        flags = base.with_(overrides)
        backend = make_backend(flags, kv)
        load = {name: c.as_dict() for name, c in backend.trace.phases.items()}
        for test in group:
            res = run_test(backend, test, reps, n_vocab, on_rep=on_rep, load=load, clock=clock)
            res.flag_values, res.load_ms, res.backend = dict(flags.values), dict(backend.load_ms), backend.name
            res.n_ctx = backend.n_ctx
            res.load_detail_ms = dict(backend.load_detail_ms)
            yield res
        backend.close()
        del backend
