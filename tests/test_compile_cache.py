"""The source k4 hands CuPy for a module carries a digest of the headers (runtime/cuda/compile.py)."""

from __future__ import annotations

import shutil

from k4.kernels_cu import SOURCE_DIR


def test_a_changed_header_changes_the_source_cupy_hashes(tmp_path, monkeypatch):
    """CuPy keys its binary cache on the source text, not on the headers it includes, so the
    source k4 hands it carries a digest of every .cuh: editing a header must change it."""
    from k4.runtime.cuda import compile as comp

    copy = tmp_path / "kernels"
    shutil.copytree(SOURCE_DIR, copy)
    monkeypatch.setattr(comp, "SOURCE_DIR", copy)
    comp.headers_digest.cache_clear()
    try:
        before = comp.headers_digest()
        (copy / "common.cuh").write_text((copy / "common.cuh").read_text() + "\n// edited\n")
        comp.headers_digest.cache_clear()
        assert comp.headers_digest() != before
    finally:
        comp.headers_digest.cache_clear()
