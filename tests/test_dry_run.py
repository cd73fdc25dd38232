"""The CUDA backend's launches checked on the CPU (tests/dry_run.py over tests/cupy_stub.py): every
kernel launch of load, prefill, decode graphs, sampling and verify steps, for every tiny model
family and tensor type with each K4_* switch flipped, for synthetic models in the real widths
with the switches of their paths, and past 4,096 keys, must pass its kernel's parameter list
(count and kinds) and CUDA's geometry limits, and do nothing a graph capture refuses. A GPU run would read
garbage where these fail, not raise. The checks themselves are tested here on launches built to
fail them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from k4.runtime.flags import FLAGS

from tests import kernel_params as kp
from tests.cuda_backend_cases import ARCH_CASES
from tests.dry_run import DRY_CASES

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels_cu"
TINY = [*ARCH_CASES, *DRY_CASES, "gemma3", "gemma2"]
# each switch flipped from its default (K4_TRACE changes no launch)
FLIPPED = [f"{f.name}={0 if f.default else 1}" for f in FLAGS.values() if f.name != "K4_TRACE"]
# the real widths (tests/dry_run.py SYNTH_LAYERS layers) and the switches whose paths they take
WIDE = {
    "synth-llama2-7b": ["K4_MEGAKERNEL=1", "K4_QKV_PAIR=0", "K4_WO_WIDE=0", "K4_X_CLUSTER=0",
                        "K4_NORM_Q8=0", "K4_MMA8_CLUSTER=0", "K4_MMA8_NQ=0", "K4_MMA8_FFQ8=0", "K4_FUSE_QUANT=1"],
    "synth-tinyllama-1.1b": ["K4_QKV_WIDE=0", "K4_QKV_Q8=0", "K4_HEAD_ARGMAX=0"],
    "synth-qwen2.5-7b": ["K4_QKV_WIDE=0", "K4_QKV_PAIR=0"],
    "synth-qwen3-30b-a3b": ["K4_MOE_ONE=0", "K4_FUSE_MOE=0", "K4_PLANAR_EXPERTS=0", "K4_WO_WIDE=0"],
    "synth-gemma3-12b": ["K4_QKV_Q8=0"],
    "synth-phi4-14b": ["K4_MMA8=0"],
}
DEEP = ["qwen2-q8_0-hd64@deep", "qwen2-q8_0-hd64:K4_GQA_COLS=0@deep", "qwen2-q8_0-hd64:K4_DYN_SPLIT=0@deep",
        "llama-q8_0-gqa@deep", "llama-q4_k-hd64@deep"]
# kernels only `k4 bench --kernels` launches (runtime/cuda/microbench.py's bandwidth probes), checked there
MICROBENCH_ONLY = {"read_stream", "read_stream_dependent"}


def dry_run_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m tests.dry_run ARGS`, in a process of its own (the stub replaces cupy there)."""
    return subprocess.run([sys.executable, "-m", "tests.dry_run", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)


def dry_run(folder: Path, specs: list[str]) -> list[dict]:
    """tests/dry_run.py's result for each spec."""
    proc = dry_run_process(str(folder), *specs)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(specs), proc.stderr[-3000:]
    return results


# the groups of cases: the tiny models with the defaults and with each switch flipped, each synthetic
# model with its switches, the deep cases; a batch of groups runs in one process, which writes each
# model once
BATCHES = {
    "tiny": {flag: [c if flag == "default" else f"{c}:{flag}" for c in TINY] for flag in ["default", *FLIPPED]},
    "wide": {case: [case, *(f"{case}:{f}" for f in flags)] for case, flags in WIDE.items()},
    "deep": {"deep": DEEP},
}
GROUPS = {name: specs for batch in BATCHES.values() for name, specs in batch.items()}
_results: dict[str, list[dict]] = {}


def group_results(name: str, tmp_path_factory) -> list[dict]:
    """The results of group `name`: its batch runs once per session."""
    if name not in _results:
        batch = next(b for b in BATCHES.values() if name in b)
        results = iter(dry_run(tmp_path_factory.mktemp("dry"), [spec for specs in batch.values() for spec in specs]))
        for group, specs in batch.items():
            _results[group] = [next(results) for _ in specs]
    return _results[name]


def assert_clean(results: list[dict]) -> None:
    bad = {r["case"]: r["problems"] for r in results if r["problems"]}
    assert not bad, json.dumps(bad, indent=1)[:4000]


@pytest.mark.parametrize("flag", ["default", *FLIPPED])
def test_tiny_models_launch_what_their_kernels_take(tmp_path_factory, flag):
    results = group_results(flag, tmp_path_factory)
    assert_clean(results)
    assert all(r["launches"] > 50 for r in results)


@pytest.mark.parametrize("case", list(WIDE))
def test_real_widths_launch_what_their_kernels_take(tmp_path_factory, case):
    results = group_results(case, tmp_path_factory)
    assert_clean(results)
    if case == "synth-llama2-7b":
        mega = next(r for r in results if "K4_MEGAKERNEL=1" in r["case"])
        assert "gemv_q8_pair" in results[0]["kernels"] and "megakernel" in mega["kernels"]
    if case == "synth-qwen3-30b-a3b":
        assert "moe_one" in results[0]["kernels"]


def test_past_4096_keys_launch_what_their_kernels_take(tmp_path_factory):
    results = group_results("deep", tmp_path_factory)
    assert_clean(results)
    assert "attn_gqa" in results[0]["kernels"]


def test_every_kernel_is_launched_by_some_case(tmp_path_factory):
    """The dry runs reach every kernel of kernels_cu but the microbenchmarks' (test_bench_kernels_...),
    so none goes unchecked."""
    seen = {k for name in GROUPS for r in group_results(name, tmp_path_factory) for k in r["kernels"]}
    every = {k for f in KERNELS.glob("*.cu") for k in kp.kernels_in(f.read_text())}
    assert every - MICROBENCH_ONLY - seen == set()


# ---- k4 commands on the CUDA backend -------------------------------------------------------------

def k4(*args: str) -> tuple[int, str, dict]:
    """`k4 ARGS` over the stub: (exit status, its stdout before the summary, the launches' summary)."""
    proc = dry_run_process("--cli", *args)
    out, _, last = proc.stdout.rstrip("\n").rpartition("\n")
    assert last.startswith("{"), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.returncode, out, json.loads(last)


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory) -> str:
    """A synthetic Q4_K_M model of the test-tiny preset (`k4 synth`)."""
    path = tmp_path_factory.mktemp("synth") / "test-tiny.gguf"
    code, _, _ = k4("synth", "test-tiny", str(path))
    assert code == 0 and path.exists()
    return str(path)


def test_bench_with_verify_and_lookup_reports_every_test(tiny_q4_k_m):
    """`k4 bench` as the GPU sessions run it (two flag settings, tvN, lookup): every record, the
    verify steps' device-time ratio among them (session 54), no launch problem."""
    code, out, summary = k4("bench", "-m", tiny_q4_k_m, "-p", "16", "-n", "8", "-r", "2", "--verify", "4,8", "--lookup", "4",
                            "--flags", "", "--flags", "K4_QKV_WIDE=0", "--backend", "cuda", "-o", "json")
    assert code == 0 and summary["problems"] == [], summary["problems"]
    records = json.loads(out[out.index("["):])
    tests = {(r["test"], r.get("flags", "")) for r in records}
    assert {t for t, _ in tests} >= {"pp16", "tg8", "tv4", "tv8"} and any(t.startswith("tg8/lookup") for t, _ in tests)
    assert len({f for _, f in tests}) == 2
    tv8 = [r for r in records if r["test"] == "tv8"]
    assert all(r["verify_gpu_ratio"] > 0 and r["verify_ratio"] > 0 for r in tv8), tv8


def test_bench_kernels_launch_what_their_kernels_take(tiny_q4_k_m):
    code, _, summary = k4("bench", "-m", tiny_q4_k_m, "--kernels", "--depth", "4096", "--backend", "cuda")
    assert code == 0 and summary["problems"] == [], summary["problems"]
    assert MICROBENCH_ONLY <= set(summary["kernels"])


@pytest.mark.parametrize("command", [
    ("run", "-n", "6", "-p", "Once upon a time"),
    ("run", "-n", "6", "-p", "Once upon a time", "--lookup", "3", "--temp", "0"),
    ("perplexity", "-f", str(ROOT / "README.md"), "-c", "64"),
])
def test_commands_run_on_the_cuda_backend(tiny_q4_k_m, command):
    code, _, summary = k4(*command, "-m", tiny_q4_k_m, "--backend", "cuda")
    assert code == 0 and summary["problems"] == [] and summary["launches"] > 20, summary


# ---- the checks, on launches built to fail them -------------------------------------------------

SOURCE = """
// a kernel as kernels_cu writes them
template <int N>
__global__ void __launch_bounds__(N * 32, 1) __maxnreg__(64)
k(const float* __restrict__ x,  // (n,) a comment, with a comma
  float* y, int n, float eps, i64 m, int* counts, int slot) {}
extern "C" __global__ void plain(u8* p) {}
"""


class Array(np.ndarray):
    """A device array for the checks (the stub's ndarray, without importing the stub)."""


def launch(name: str, args: tuple, grid=(4,), block=(128,), smem: int = 0, cluster: int = 1, source: str = SOURCE,
           smem_limit: int = 48 << 10):
    module = SimpleNamespace(code=source, options=(), name_expressions=(name,))
    return SimpleNamespace(kernel=SimpleNamespace(name=name, module=module), grid=grid, block=block, args=args, shared_mem=smem,
                           stream=1, pdl=True, cluster=cluster, smem_limit=smem_limit)


def test_every_kernel_parameter_list_is_read():
    every = {f.name: kp.kernels_in(f.read_text()) for f in KERNELS.glob("*.cu")}
    assert sum(map(len, every.values())) >= 40
    assert [p.kind for p in every["sampling.cu"]["sample_finish"]][-2:] == ["ptr", "i32"]
    got = kp.kernels_in(SOURCE)
    assert [(p.name, p.kind) for p in got["k"]] == [("x", "ptr"), ("y", "ptr"), ("n", "i32"), ("eps", "f32"), ("m", "i64"),
                                                    ("counts", "ptr"), ("slot", "i32")]
    assert [p.kind for p in got["plain"]] == ["ptr"]


@pytest.mark.parametrize("bad", ["float3 v", "T v", "struct S s"])
def test_a_parameter_of_unknown_size_is_refused(bad):
    with pytest.raises(ValueError, match="no known size"):
        kp.kernels_in(f"__global__ void f({bad}) {{}}")


def test_a_parameter_list_that_depends_on_defines_is_refused():
    with pytest.raises(ValueError, match="preprocessor"):
        kp.kernels_in("__global__ void f(int a,\n#if X\n int b\n#endif\n) {}")


def good_args():
    x = np.zeros(4, np.float32).view(Array)
    return (x, x, np.int32(4), np.float32(1e-5), np.int64(9), np.uint64(0), np.int32(0))


def test_a_correct_launch_passes():
    assert kp.launch_problems(launch("k<4>", good_args()), Array) == []
    assert kp.launch_problems(launch("k<4>", good_args(), smem=100 << 10, smem_limit=100 << 10), Array) == []


@pytest.mark.parametrize("change, expect", [
    (lambda a: a[:-1], "6 arguments for 7 parameters"),
    (lambda a: a + (np.int32(0),), "8 arguments for 7 parameters"),
    (lambda a: a[:2] + (np.float32(4),) + a[3:], "argument 2 `int n` (i32) given f32"),
    (lambda a: a[:2] + (4,) + a[3:], "argument 2 `int n` (i32) given int"),
    (lambda a: a[:3] + (np.int32(1),) + a[4:], "argument 3 `float eps` (f32) given i32"),
    (lambda a: a[:4] + (np.int32(9),) + a[5:], "argument 4 `i64 m` (i64) given i32"),
    (lambda a: (np.int32(0),) + a[1:], "argument 0 `const float* __restrict__ x` (ptr) given i32"),
])
def test_a_wrong_argument_is_named(change, expect):
    problems = kp.launch_problems(launch("k<4>", change(good_args())), Array)
    assert len(problems) == 1 and expect in problems[0], problems


@pytest.mark.parametrize("geometry, expect", [
    ({"block": (2048,)}, "block"), ({"block": (0,)}, "block"), ({"grid": (0,)}, "grid"), ({"grid": (4, 70000)}, "grid"),
    ({"smem": 300 << 10}, "shared memory"), ({"smem": 64 << 10}, "49152 allowed"), ({"cluster": 3}, "clusters"),
    ({"cluster": 16, "grid": (32,)}, "clusters"),
])
def test_a_launch_cuda_would_refuse_is_named(geometry, expect):
    problems = kp.launch_problems(launch("k<4>", good_args(), **geometry), Array)
    assert len(problems) == 1 and expect in problems[0], problems


def test_a_kernel_missing_from_its_module_is_named():
    assert "no __global__ kernel" in kp.launch_problems(launch("gone", ()), Array)[0]


def test_what_a_graph_capture_refuses_is_named():
    from tests import cupy_stub

    s = cupy_stub.Stream()
    cupy_stub.empty(3)  # outside a capture: fine
    s.begin_capture()
    try:
        cupy_stub.empty(3)
        s.synchronize()
        cupy_stub.Event().synchronize()
    finally:
        s.end_capture()
    s.synchronize()
    got, cupy_stub.CAPTURE_VIOLATIONS[:] = list(cupy_stub.CAPTURE_VIOLATIONS), []
    assert [g.split(" during")[0] for g in got] == ["cupy.empty (a device allocation)", "Stream.synchronize", "Event.synchronize"]


def test_the_scalar_kinds_are_the_scalars_launch_passes():
    from k4.runtime.cuda import launch

    assert set(kp._SCALAR_KINDS) == set(launch._C_SCALARS)
