"""scripts/row_claims.py without a GPU: its edits find their anchors in today's gemv.cu (once
each, the other sources untouched), and the edited gemv_q8 compiles for sm_90 where nvcc is on
PATH: the round-robin instances (plain, SwiGLU, reading an NQ handoff, in clusters) with the
claims, the NQ and argmax ones without."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k4.kernels_cu import SOURCE_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the script imports its siblings
from row_claims import EDITS  # noqa: E402
from take_away import apply_cut  # noqa: E402


def test_the_claims_apply_to_todays_gemv(tmp_path):
    apply_cut(SOURCE_DIR, tmp_path, EDITS)
    text = (tmp_path / "gemv.cu").read_text()
    assert text.count("q8_rows_or_claims<T, U, PF, GLU, !NQ && !AM>(HANDOFF && y_q8,") == 1
    assert text.count("__device__ unsigned long long k4_claims[") == 1
    others = {p.name for p in SOURCE_DIR.glob("*.cu*")} - {"gemv.cu", "gemv_common.cuh"}
    assert all((tmp_path / n).read_text() == (SOURCE_DIR / n).read_text() for n in others)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_claiming_gemv_compiles(tmp_path):
    from gguf import GGMLQuantizationType as T

    from k4.runtime.cuda import quant_types as qt

    from k4.runtime.cuda import quant_kernels as qk
    from k4.runtime.cuda.compile import OPTIONS

    apply_cut(SOURCE_DIR, tmp_path, EDITS)
    v = qt.QUANT[T.Q4_K].gemv
    names = [qk._gemv_q8_name(T.Q4_K, True, v), qk._gemv_q8_name(T.Q4_K, True, v, glu=True),
             qk._gemv_q8_name(T.Q4_K, True, v, nx=True), qk._gemv_q8_name(T.Q4_K, True, v, cluster=True),
             qk._gemv_q8_name(T.Q4_K, True, v, nq=True), qk._gemv_q8_name(T.Q6_K, True, qt.QUANT[T.Q6_K].gemv, am=True)]
    refs = ", ".join(f"(void*)&{n}" for n in names)
    (tmp_path / "some.cu").write_text(f'#include "gemv.cu"\nvoid* const k4_some[] = {{{refs}}};\n')
    options = [o for o in OPTIONS if not o.startswith(("-I", "--gpu-architecture", "-arch"))]
    cmd = ["nvcc", "-arch=sm_90", f"-I{tmp_path}", *options, "-c", str(tmp_path / "some.cu"), "-o", str(tmp_path / "k.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
