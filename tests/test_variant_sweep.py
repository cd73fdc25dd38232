"""scripts/variant_sweep.py (no GPU): its arguments' one-line errors, and its patch, which gives
the products of one shape (and glu) the chosen variant, sets the output product's own choice
aside, leaves every other product's choice alone, and is undone."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from variant_sweep import parse_shape, parse_variant, use_variant  # noqa: E402


def test_arguments_parse_or_stop_with_one_line():
    assert parse_variant("32,2,0") == (32, 2, 0) and parse_shape("3584x18944") == (3584, 18944)
    for bad in ("32,2", "a,b,c", "64,2,0", "16,0,1", "16,2,2"):
        with pytest.raises(SystemExit, match="^error: variant"):
            parse_variant(bad)
    with pytest.raises(SystemExit, match="^error: shape"):
        parse_shape("3584*3584")


def test_the_patch_reaches_one_shape_and_is_undone():
    def chosen(t, n_out, n_in, glu=False):
        return (16, 2, 1)

    def wide(t, n_in):
        return (32, 2, 0)

    matmul, forward = SimpleNamespace(gemv_variant=chosen), SimpleNamespace(after_attention_variant=wide)
    undo = use_variant((3584, 3584), False, (32, 1, 0), (matmul, forward))
    assert matmul.gemv_variant("Q4_K", 3584, 3584) == (32, 1, 0)
    assert matmul.gemv_variant("Q4_K", 3584, 3584, True) == (16, 2, 1)  # a SwiGLU pair of that shape: not it
    assert matmul.gemv_variant("Q4_K", 3584, 18944) == (16, 2, 1)
    assert forward.after_attention_variant("Q4_K", 3584) is None
    undo()
    assert matmul.gemv_variant is chosen and forward.after_attention_variant is wide
    use_variant((3584, 3584), False, None, (matmul, forward))()  # "main": nothing patched
    assert matmul.gemv_variant is chosen and forward.after_attention_variant is wide


def test_main_runs_every_variant_each_round_and_reports_against_the_first(monkeypatch, capsys):
    import variant_sweep as vs

    patched, rates = [], iter([100.0, 110.0, 100.0, 90.0])
    monkeypatch.setattr(vs, "use_variant", lambda shape, glu, v: patched.append((shape, glu, v)) or (lambda: patched.append("undo")))
    monkeypatch.setattr(vs, "bench_ts", lambda args, test: next(rates))
    vs.main(["-m", "m.gguf", "--shape", "2048x4096", "--variants", "main", "32,2,0", "--rounds", "2"])
    assert patched == [((2048, 4096), False, None), "undo", ((2048, 4096), False, (32, 2, 0)), "undo"] * 2
    out = capsys.readouterr().out
    assert "main       mean     100.00 t/s (+0.0% against main)" in out and "32,2,0     mean     100.00 t/s" in out
