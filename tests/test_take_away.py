"""scripts/take_away.py's temporary builds (no GPU): every cut's edits still find their anchors in
today's kernels_cu, a stale anchor stops the script with a one-line error, and its source switch
points runtime/cuda/compile.py at the copy and back."""

from __future__ import annotations

from pathlib import Path

import pytest

from k4.kernels_cu import SOURCE_DIR
from k4.runtime.cuda import compile as comp
from k4.runtime.cuda import quant_kernels
from scripts.take_away import CUTS, apply_cut, use_sources


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_every_cut_applies_to_todays_kernels(tmp_path, cut):
    apply_cut(SOURCE_DIR, tmp_path, CUTS[cut][1])
    files = {name for name, _, _ in CUTS[cut][1]}
    for name in files:
        assert (tmp_path / name).read_text() != (SOURCE_DIR / name).read_text()
    untouched = {p.name for p in SOURCE_DIR.glob("*.cu*")} - files
    assert all((tmp_path / n).read_text() == (SOURCE_DIR / n).read_text() for n in untouched)


def test_a_stale_anchor_stops_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="occurs 0 times in kernels_cu/attention_short.cu"):
        apply_cut(SOURCE_DIR, tmp_path, [("attention_short.cu", "no such line\n", "")])


def test_use_sources_switches_the_compiler_and_back(tmp_path, monkeypatch):
    monkeypatch.setattr(comp, "OPTIONS", comp.OPTIONS)
    monkeypatch.setattr(comp, "SOURCE_DIR", comp.SOURCE_DIR)
    digest = comp.headers_digest()
    apply_cut(SOURCE_DIR, tmp_path, CUTS["down-x"][1])  # a header edit: the digest must change
    try:
        use_sources(tmp_path)
        assert comp.SOURCE_DIR == tmp_path and f"-I{tmp_path}" in comp.OPTIONS and f"-I{SOURCE_DIR}" not in comp.OPTIONS
        assert comp.headers_digest() != digest
        assert quant_kernels._kernel.cache_info().currsize == 0
    finally:
        use_sources(Path(SOURCE_DIR))
    assert comp.SOURCE_DIR == SOURCE_DIR and f"-I{SOURCE_DIR}" in comp.OPTIONS and comp.headers_digest() == digest
