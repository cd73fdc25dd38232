"""scripts/block_stamps.py without a GPU: its edits still find their anchors in today's gemv.cu
(once each, the other sources untouched), the stamped gemv_q8 compiles for sm_90 where nvcc is
on PATH, its shapes parse or stop with a one-line error, and its summary of a launch's stamps."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k4.kernels_cu import SOURCE_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the script imports its sibling as run
from block_stamps import EDITS, ROWS, SLOTS, parse_shape, summary  # noqa: E402
from take_away import apply_cut  # noqa: E402


def test_the_stamps_apply_to_todays_gemv(tmp_path):
    apply_cut(SOURCE_DIR, tmp_path, EDITS)
    text = (tmp_path / "gemv.cu").read_text()
    assert text.count("k4_gt();") == 4 and text.count("k4_st[") == 5
    others = {p.name for p in SOURCE_DIR.glob("*.cu*")} - {"gemv.cu"}
    assert all((tmp_path / n).read_text() == (SOURCE_DIR / n).read_text() for n in others)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_stamped_gemv_compiles(tmp_path):
    from k4.runtime.cuda.compile import OPTIONS

    apply_cut(SOURCE_DIR, tmp_path, EDITS)
    name = "gemv_q8<type_q4_K, true, 16, 2, true, false>"
    (tmp_path / "one.cu").write_text(f'#include "gemv.cu"\nvoid* const k4_one = (void*)&{name};\n')
    options = [o for o in OPTIONS if not o.startswith(("-I", "--gpu-architecture", "-arch"))]
    cmd = ["nvcc", "-arch=sm_90", f"-I{tmp_path}", *options, "-c", str(tmp_path / "one.cu"), "-o", str(tmp_path / "k.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_shapes_parse_or_stop_with_one_line():
    assert parse_shape("Q4_K:4096x11008:q8") == ("Q4_K", 4096, 11008, True)
    assert parse_shape("Q6_K:32000x4096") == ("Q6_K", 32000, 4096, False)
    for bad in ("Q4_K", "Q4_K:4096", "Q4_K:0x4096", "Q4_K:4096x4096:f16", "Q4_K:ax4096"):
        with pytest.raises(SystemExit, match="is not TYPE:N_OUTxN_IN"):
            parse_shape(bad)


def test_summary_of_a_launch():
    st = np.zeros((ROWS, SLOTS), np.int64)
    t0 = 10_000_000
    st[0, :3] = t0 - 1000  # three blocks started 1 µs before the first release
    st[1, :3] = [t0, t0 + 100, t0]
    st[2, :3] = t0 + 500
    st[3, 0:2] = [t0 + 2000, t0 + 3000]  # block 0: two warps
    st[3, 32:34] = [t0 + 4000, t0 + 4000]  # block 1
    st[3, 64] = t0 + 1000  # block 2: one warp
    s = summary(st)
    assert s["start"][0] == -1.0 and s["release"][-1] == pytest.approx(0.1) and s["prologue"][2] == 0.5
    assert s["warp end"][0] == 1.0 and s["warp end"][-1] == 4.0
    assert s["block end"] == pytest.approx([1.0, 1.4, 3.0, 3.8, 4.0])
    assert s["idle"] == [pytest.approx(((4 - 3) + 0 + (4 - 1)) / 3)]
