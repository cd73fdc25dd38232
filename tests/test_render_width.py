"""k4's console lays tables out wide when no terminal tells it a width (CI logs, `nohup k4 bench >
file`), so the figures of a wide table are never cut to "2,0…"; a terminal's width, and COLUMNS,
still rule where they exist."""

from __future__ import annotations

import io
import os

import pytest

from k4.cli import render


def wide_table():
    cols = ["model", "size", "params", "backend", "flags", "type_k", "type_v", "test", "t/s", "bound t/s", "% bound"]
    row = ["stories260k-q4_k_m.gguf", "1.30 MiB", "2.23 M", "numpy", "-", "f16", "f16", "tg128", "2,100.78 ± 24.27", "3,237,503.24", "0.1%"]
    return render.table("throughput", cols, [row], right=(1, 2, 8, 9, 10))


def printed(monkeypatch, terminal: bool, columns: str | None) -> str:
    monkeypatch.setattr(render, "_any_terminal", lambda: terminal)

    def no_size(fd=None):
        raise OSError("not a terminal")
    monkeypatch.setattr(os, "get_terminal_size", no_size)  # rich's own probe: its fallback, 80 columns
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    buf = io.StringIO()
    console = render._Console(file=buf, highlight=False, soft_wrap=True)
    console.print(wide_table())
    return buf.getvalue()


def test_no_terminal_keeps_every_figure(monkeypatch):
    text = printed(monkeypatch, terminal=False, columns=None)
    assert "…" not in text
    for figure in ("2,100.78 ± 24.27", "3,237,503.24", "stories260k-q4_k_m.gguf"):
        assert figure in text
    assert max(len(line) for line in text.splitlines()) <= render.LOG_WIDTH


@pytest.mark.parametrize("terminal, columns", [(False, "80"), (True, None)])
def test_columns_and_terminals_still_rule(monkeypatch, terminal, columns):
    # COLUMNS=80, or a terminal (of rich's fallback width here, 80), cut the table
    text = printed(monkeypatch, terminal=terminal, columns=columns)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" in text
