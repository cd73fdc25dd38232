"""scripts/boundary_wait.py without a GPU: its cases and kernel names, and where nvcc and cuobjdump
are on PATH, that its links compile for sm_90 without spills and that the SASS has the property the
measurement rests on: the relaxed modes' poll loops invalidate no L1 (one CCTL.IVALL after the
loop), the acquire mode's invalidates it on every poll."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from k4.kernels_cu import SOURCE_DIR

from scripts.boundary_wait import MODES, NVS, SMEM_KB, SOURCE, cases, kernel_name
from scripts.sass_loops import functions

TOOLS = shutil.which("nvcc") is not None and shutil.which("cuobjdump") is not None


def test_every_case_once_grid_first_in_each_group():
    got = cases()
    assert len(got) == len(set(got)) == len(NVS) * 2 * len(MODES)
    for i in range(0, len(got), len(MODES)):
        group = got[i: i + len(MODES)]
        assert [m for _, _, m in group] == list(MODES) and len({(nv, kb) for nv, kb, _ in group}) == 1
    assert {kb for _, kb, _ in got} == {SMEM_KB, 0}


def test_kernel_names_follow_the_source_and_refuse_what_it_lacks():
    assert kernel_name(2, "grid") == "link_2_0" and kernel_name(8, "none") == "link_8_4"
    for nv in NVS:
        assert f"K4_LINKS({nv})" in SOURCE
    with pytest.raises(ValueError, match="no link for NV 3"):
        kernel_name(3, "grid")
    with pytest.raises(ValueError, match="mode one of"):
        kernel_name(2, "spin")


def poll_loops(sass: str) -> list[list[str]]:
    """The bodies (instruction lines) of the backward-branch loops that hold a strong global load."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in lines:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in lines if int(m.group(1), 16) <= a <= addr]
            if any("LDG.E.STRONG.GPU" in t for t in body):
                loops.append(body)
    return loops


@pytest.mark.skipif(not TOOLS, reason="nvcc and cuobjdump are not on PATH")
def test_links_compile_and_only_acquire_polls_invalidate_l1(tmp_path):
    (tmp_path / "links.cu").write_text(SOURCE)
    build = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", f"-I{SOURCE_DIR}", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                            str(tmp_path / "links.cu")], capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr[-2000:]
    assert not re.search(r"[1-9]\d* bytes spill", build.stderr)
    sass = functions(subprocess.run(["cuobjdump", "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                                    check=True).stdout)
    for nv in NVS:
        for mode in ("relaxed", "relaxed-sleep"):
            text = sass[kernel_name(nv, mode)]
            loops = poll_loops(text)
            assert loops and not any("CCTL.IVALL" in t for body in loops for t in body), (nv, mode)
            assert text.count("CCTL.IVALL") == 1, (nv, mode)  # the acquire fence after the polls
        loops = poll_loops(sass[kernel_name(nv, "acquire")])
        assert loops and all(any("CCTL.IVALL" in t for t in body) for body in loops), nv
        assert "CCTL.IVALL" not in sass[kernel_name(nv, "grid")]
