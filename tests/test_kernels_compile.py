"""Every kernels_cu/*.cu compiles with nvcc for sm_90, with the options NVRTC gets at run time
(runtime.cuda.compile.OPTIONS), so kernel errors show up on machines without a GPU. The
matrix kernels must also not spill registers to local memory.

The .cu files hold no list of template instances: the kernel names the launchers use
(runtime/cuda/matmul.py GROUPS, runtime/cuda/ops.py KERNELS) are the one list. NVRTC gets them
as name expressions; here a wrapper file includes the source and takes each one's address,
which instantiates exactly those kernels (and fails to compile for a name the source lacks)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from k4.kernels_cu import SOURCE_DIR
from k4.runtime.cuda import kernel_names as ops
from k4.runtime.cuda import matmul
from k4.runtime.cuda.compile import OPTIONS

SOURCES = sorted(SOURCE_DIR.glob("*.cu"))
NO_SPILL = {"gemv.cu", "matmul.cu"}

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


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


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_compiles_for_sm90(src, tmp_path):
    cmd = ["nvcc", "-arch=sm_90", *OPTIONS, "-Xptxas", "-v", "-c", str(wrapper(src, tmp_path)), "-o", str(tmp_path / "k.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"{src.name} does not compile:\n{r.stderr}"
    if src.name in NO_SPILL:
        spills = [line for line in r.stderr.splitlines() if re.search(r"[1-9]\d* bytes spill (stores|loads)", line)]
        assert not spills, f"{src.name} spills registers:\n" + "\n".join(spills)


def test_every_kernel_file_is_checked():
    assert {"gemv.cu", "matmul.cu"} <= {p.name for p in SOURCES}


@pytest.mark.parametrize("src", ["gemv.cu", "attention.cu"])
@pytest.mark.parametrize("evict_first", [True, False])
def test_once_read_loads_carry_the_evict_first_hint_unless_switched_off(src, evict_first, tmp_path):
    """K4_EVICT_FIRST: the weight loads of gemv.cu and the KV loads of attention.cu are
    ld.global.nc.L1::evict_first, and none is when compiled with K4_EVICT_FIRST=0 (as
    runtime/cuda/matmul.py and ops.py compile them with the flag off)."""
    define = [] if evict_first else ["-DK4_EVICT_FIRST=0"]
    ptx = tmp_path / "k.ptx"
    cmd = ["nvcc", "-arch=sm_90", *OPTIONS, *define, "-ptx", str(wrapper(SOURCE_DIR / src, tmp_path)), "-o", str(ptx)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    hinted = len(re.findall(r"ld\.global\.nc\.L1::evict_first\.v4\.u32", ptx.read_text()))
    assert (hinted > 0) == evict_first, f"{src}: {hinted} hinted loads"
