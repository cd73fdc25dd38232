"""Every kernels_cu/*.cu compiles with nvcc for sm_90, with the options NVRTC gets at run time
(runtime.cuda.compile.OPTIONS, which carry runtime/cuda/constants.py as -D defines), so kernel
errors show up on machines without a GPU. The matrix kernels must also not spill registers to
local memory. A Python value that disagrees with the kernels' structs or size formulas, or a
missing define, fails the compile (kernels_cu/constants.cuh and the static_asserts next to
each formula).

The .cu files hold no list of template instances: the kernel names the launchers use
(runtime/cuda/quant_kernels.py GROUPS, runtime/cuda/ops.py KERNELS) are the one list. NVRTC gets them
as name expressions; here a wrapper file includes the source and takes each one's address,
which instantiates exactly those kernels (and fails to compile for a name the source lacks)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess

import pytest
from gguf import GGMLQuantizationType as T

from k4.kernels_cu import SOURCE_DIR
from k4.runtime.cuda import constants
from k4.runtime.cuda import quant_kernels as matmul
from k4.runtime.cuda import kernel_names as ops
from k4.runtime.cuda.compile import OPTIONS

SOURCES = sorted(SOURCE_DIR.glob("*.cu"))
NO_SPILL = {"gemv.cu", "gemv_batch.cu", "gemv_mma.cu", "matmul.cu", "moe_gemv.cu", "moe_grouped.cu", "moe_down.cu"}

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def instances(filename: str) -> list[str]:
    """Every kernel name the launchers use from kernels_cu/filename."""
    if filename in matmul.GROUPS:
        return [name for group in matmul.GROUPS[filename].values() for name in group]
    return list(ops.KERNELS.get(filename, ()))


def wrapper(src, tmp_path):
    """A .cu file that includes `src` and instantiates every kernel the launchers use from it."""
    path = tmp_path / f"all_{src.name}"
    refs = ",\n".join(f"    (void*)&{name}" for name in instances(src.name))
    path.write_text(f'#include "{src.name}"\nextern void* const k4_instances[];\n'
                    f"void* const k4_instances[] = {{\n{refs}\n}};\n")
    return path


def test_every_launched_kernel_file_has_names():
    assert {f for f in (*matmul.GROUPS, *ops.KERNELS)} <= {p.name for p in SOURCES}
    assert all(instances(f) for f in (*matmul.GROUPS, *ops.KERNELS))


EVICT_SOURCES = ("gemv.cu", "attention.cu")


def _build_key(item) -> tuple | None:
    """The builds key a collected test item reads (None: it reads none)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.originalname == "test_compiles_for_sm90":
        return ("obj", params["src"].name)
    if item.originalname == "test_once_read_loads_carry_the_evict_first_hint_unless_switched_off":
        return ("ptx", params["src"], params["evict_first"])
    return None


@pytest.fixture(scope="module")
def builds(request, tmp_path_factory) -> dict:
    """The nvcc builds the selected tests below check, run at once on as many threads as this
    process may use cores (the builds are minutes of one core each, and the test suite runs in
    one process): ("obj", name) -> the CompletedProcess of the wrapper of SOURCES' `name`
    compiled to an object with ptxas' register report; ("ptx", name, evict_first) -> (the
    CompletedProcess, the PTX path) of EVICT_SOURCES' `name` compiled to PTX, with
    K4_EVICT_FIRST=0 unless evict_first."""
    def obj(src):
        d = tmp_path_factory.mktemp(f"obj_{src.stem}")
        cmd = ["nvcc", "-arch=sm_90", *OPTIONS, "-Xptxas", "-v", "-c", str(wrapper(src, d)), "-o", str(d / "k.o")]
        return subprocess.run(cmd, capture_output=True, text=True, check=False)

    def ptx(name, evict_first):
        d = tmp_path_factory.mktemp(f"ptx_{name.split('.')[0]}")
        define = [] if evict_first else ["-DK4_EVICT_FIRST=0"]
        cmd = ["nvcc", "-arch=sm_90", *OPTIONS, *define, "-ptx", str(wrapper(SOURCE_DIR / name, d)), "-o", str(d / "k.ptx")]
        return subprocess.run(cmd, capture_output=True, text=True, check=False), d / "k.ptx"

    wanted = {_build_key(item) for item in request.session.items} - {None}
    jobs = {("obj", src.name): (obj, (src,)) for src in SOURCES}
    jobs.update({("ptx", name, e): (ptx, (name, e)) for name in EVICT_SOURCES for e in (True, False)})
    jobs = {key: job for key, job in jobs.items() if key in wanted}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        futures = {key: pool.submit(fn, *args) for key, (fn, args) in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


@needs_nvcc
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_compiles_for_sm90(src, builds):
    r = builds[("obj", src.name)]
    assert r.returncode == 0, f"{src.name} does not compile:\n{r.stderr}"
    if src.name in NO_SPILL:
        spills = [line for line in r.stderr.splitlines() if re.search(r"[1-9]\d* bytes spill (stores|loads)", line)]
        assert not spills, f"{src.name} spills registers:\n" + "\n".join(spills)


def test_every_kernel_file_is_checked():
    assert {"gemv.cu", "matmul.cu"} <= {p.name for p in SOURCES}


@needs_nvcc
@pytest.mark.parametrize("src", EVICT_SOURCES)
@pytest.mark.parametrize("evict_first", [True, False])
def test_once_read_loads_carry_the_evict_first_hint_unless_switched_off(src, evict_first, builds):
    """K4_EVICT_FIRST: the weight loads of gemv.cu and the KV loads of attention.cu are
    ld.global.nc.L1::evict_first, and none is when compiled with K4_EVICT_FIRST=0 (as
    runtime/cuda/matmul.py and ops.py compile them with the flag off)."""
    r, ptx = builds[("ptx", src, evict_first)]
    assert r.returncode == 0, r.stderr
    hinted = len(re.findall(r"ld\.global\.nc\.L1::evict_first\.v4\.u32", ptx.read_text()))
    assert (hinted > 0) == evict_first, f"{src}: {hinted} hinted loads"


def test_every_shared_constant_is_required_by_the_kernels():
    """Each define runtime/cuda/constants.py passes stops the compile when missing
    (kernels_cu/constants.cuh), and constants.cuh requires no name Python does not pass."""
    passed = {d.split("=", 1)[0] for d in constants.defines()}
    header = (SOURCE_DIR / "constants.cuh").read_text()
    required = set(re.findall(r"#ifndef (\w+)", header)) | set(re.findall(r"!defined\((\w+)\)", header))
    assert required == passed


def _bad_q8x(n, q8x_offsets=constants.q8x_offsets):
    d_off, s_off, total = q8x_offsets(n)
    return d_off, s_off + 16, total + 16  # d padded to 32 bytes instead of 16


# (change to the Python side, file that must then fail, text of the error)
DISAGREEMENTS = {
    "block_bytes": (lambda m: m.setattr(constants, "GGML_QUANT_SIZES", {**constants.GGML_QUANT_SIZES, T.Q6_K: (256, 212)}),
                    "norm.cu", "block_q6_K: gguf GGML_QUANT_SIZES has another size"),
    "groups": (lambda m: m.setitem(constants.QUANT_LAYOUTS, T.Q4_K, constants.QuantLayout((0, 4, 16, 144))),
               "norm.cu", "type_q4_K::cut: runtime/cuda/constants.py has other planar groups"),
    "q8x": (lambda m: m.setattr(constants, "q8x_offsets", _bad_q8x),
            "gemv.cu", "the q8 x layout differs from runtime/cuda/constants.py q8x_offsets"),
    "att_smem": (lambda m: m.setattr(constants, "att_smem", lambda D: 4 * (2 * D + constants.ATT_CHUNK)),
                 "attention.cu", "a shared-memory size differs from runtime/cuda/constants.py"),
    "mma_smem": (lambda m: m.setattr(constants, "mma_smem", lambda D, BK: 2 * (D + 8) * (constants.MMA_BQ + 4 * BK)),
                 "attention.cu", "a shared-memory size differs from runtime/cuda/constants.py"),
    "sampler_params": (lambda m: m.setattr(constants, "SAMPLER_PARAM_WORDS", 7),
                       "sampling.cu", "SamplerParams: runtime/cuda/constants.py has another size"),
}


def _compile_source(src: str, options, tmp_path) -> subprocess.CompletedProcess:
    cmd = ["nvcc", "-arch=sm_90", *options, "-c", str(SOURCE_DIR / src), "-o", str(tmp_path / "k.o")]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@needs_nvcc
@pytest.mark.parametrize("case", DISAGREEMENTS)
def test_python_and_cuda_disagreeing_fails_the_compile(case, monkeypatch, tmp_path):
    change, src, message = DISAGREEMENTS[case]
    assert _compile_source(src, OPTIONS, tmp_path).returncode == 0
    change(monkeypatch)
    r = _compile_source(src, [o for o in OPTIONS if not o.startswith("-D")] + [f"-D{d}" for d in constants.defines()], tmp_path)
    assert r.returncode != 0 and message in r.stderr, r.stderr


@needs_nvcc
def test_a_missing_define_names_its_source(tmp_path):
    r = _compile_source("norm.cu", [o for o in OPTIONS if not o.startswith("-DTILE_PS=")], tmp_path)
    assert r.returncode != 0 and '"TILE_PS comes from runtime/cuda/constants.py"' in r.stderr, r.stderr

