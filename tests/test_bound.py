"""The memory-bandwidth bound of decoding (runtime/bound.py) and its columns in `k4 bench`."""

from __future__ import annotations

import csv
import io
import json

import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from k4.cli import render
from k4.cli.app import app
from k4.runtime.bound import decode_bound, decode_keys, kv_bytes, weight_bytes_per_token
from k4.runtime.kv_types import KVTypes
from k4.runtime.model import open_model

runner = CliRunner()


def _file_bytes(path) -> dict[str, int]:
    """Tensor name -> bytes as the gguf package's own reader counts them (independent of k4's Tensor)."""
    return {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("name", ["models/stories260K.gguf", "models/stories260K-pad-q4_k_m.gguf"])
def test_separate_output_counts_one_embedding_row(data, name):
    path = data / name
    sizes = _file_bytes(path)
    n_vocab = open_model(path).config.n_vocab
    assert "output.weight" in sizes
    expected = sum(sizes.values()) - sizes["token_embd.weight"] + sizes["token_embd.weight"] // n_vocab
    assert weight_bytes_per_token(open_model(path)) == expected


def test_stories_figures_by_hand(data):
    # stories260K: F32, 512 x 64 embedding (131,072 bytes), one row 256 bytes
    path = data / "models/stories260K.gguf"
    assert weight_bytes_per_token(open_model(path)) == sum(_file_bytes(path).values()) - 131072 + 256
    b = decode_bound(open_model(path), 0, 1)  # the default bandwidth: the H200's 4.2 TB/s (issues 18, 20)
    assert b.tokens_per_s == pytest.approx(4.2e12 / b.bytes_per_token, rel=1e-12)


def test_tied_output_counts_the_whole_embedding(data):
    path = data / "oracles/tiny-gemma2.gguf"
    sizes = _file_bytes(path)
    assert "output.weight" not in sizes
    assert weight_bytes_per_token(open_model(path)) == sum(sizes.values())


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-qwen2moe"])
def test_moe_counts_the_used_experts(data, name):
    # both: 2 layers, 8 experts of which 2 used, F32 stacks (8, 64, 64) = 131,072 bytes each;
    # the router and (qwen2moe) the shared expert and its gate count whole
    path = data / f"oracles/{name}.gguf"
    sizes = _file_bytes(path)
    exps = [n for n in sizes if n.endswith("_exps.weight")]
    assert len(exps) == 6 and all(sizes[n] == 131072 for n in exps)
    dense = sum(v for n, v in sizes.items() if n not in exps) - sizes["token_embd.weight"] + 64 * 4
    assert weight_bytes_per_token(open_model(path)) == dense + 6 * 131072 * 2 // 8
    if name == "tiny-qwen2moe":
        assert sizes["blk.0.ffn_gate_shexp.weight"] > 0 and "blk.0.ffn_gate_inp_shexp.weight" in sizes


def test_kv_term_by_hand(data):
    cfg = open_model(data / "oracles/tiny-gemma2.gguf").config
    # 4 layers, 2 KV heads of 128, layers 0 and 2 slide over 8 positions; fp16 k and v:
    # 2 * 128 * 2 * 2 = 1,024 bytes per key per layer
    assert (cfg.n_layer, cfg.n_head_kv, cfg.head_dim, cfg.n_swa, cfg.swa_layers) == (4, 2, 128, 8, (True, False, True, False))
    assert kv_bytes(cfg, 5) == 4 * 1024 * 5
    assert kv_bytes(cfg, 20) == 2 * 1024 * 20 + 2 * 1024 * 8
    assert list(decode_keys(16, 4)) == [16, 17, 18, 19] and list(decode_keys(0, 3)) == [1, 2, 3]
    b = decode_bound(open_model(data / "oracles/tiny-gemma2.gguf"), 16, 4, bandwidth_gbs=1.0)
    assert b.kv_bytes == 2 * 1024 * 17.5 + 2 * 1024 * 8
    # q8_0 keys and values: 34 bytes per 32 values instead of 64 (runtime/kv_types.py)
    assert kv_bytes(cfg, 5, KVTypes("q8_0", "q8_0")) == 4 * 1024 * 5 * 34 // 64
    assert kv_bytes(cfg, 5, KVTypes("q8_0", "f16")) == (2 * 1024 + 2 * 1024 * 34 // 64) * 5
    q8 = decode_bound(open_model(data / "oracles/tiny-gemma2.gguf"), 16, 4, bandwidth_gbs=1.0, kv_types=KVTypes("q8_0", "q8_0"))
    assert q8.kv_bytes == b.kv_bytes * 34 / 64 and q8.weight_bytes == b.weight_bytes
    assert b.tokens_per_s == pytest.approx(1e9 / (b.weight_bytes + 52224))


def _bench(*args):
    r = runner.invoke(app, ["bench", "--backend", "numpy", "-r", "1", "-m", "tests/data/models/stories260K.gguf", *args])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_bench_records_carry_the_bound(data):
    weights = weight_bytes_per_token(open_model(data / "models/stories260K.gguf"))
    recs = json.loads(_bench("-p", "8", "-n", "4", "--pg", "4,2", "-d", "0,8", "--bandwidth", "100", "-o", "json"))
    by = {r["test"]: r for r in recs}
    # 5 layers, 4 KV heads of 8: 4 * 8 * 2 * 2 = 128 bytes per key per layer, 640 per key
    assert by["tg4"]["bound_bytes_per_token"] == weights + 640 * 2.5  # keys 1..4
    assert by["tg4@d8"]["bound_bytes_per_token"] == weights + 640 * 9.5  # keys 8..11
    for t in ("tg4", "tg4@d8"):
        r = by[t]
        assert r["bound_ts"] == pytest.approx(100e9 / r["bound_bytes_per_token"])
        assert r["bound_fraction"] == pytest.approx(r["avg_ts"] / r["bound_ts"])
        assert r["bandwidth_gbs"] == 100
    for t in ("pp8", "pp4+tg2", "pp8@d8"):
        assert by[t]["bound_ts"] is None and by[t]["bound_fraction"] is None


def test_bench_bound_columns_in_every_printer(monkeypatch):
    rows = list(csv.DictReader(io.StringIO(_bench("-p", "8", "-n", "4", "-o", "csv"))))
    assert rows[0]["bound_ts"] == "" and float(rows[1]["bound_ts"]) > 0 and float(rows[1]["bound_fraction"]) > 0
    jsonl = [json.loads(x) for x in _bench("-p", "0", "-n", "2", "-o", "jsonl").splitlines()]
    assert jsonl[0]["bound_ts"] > 0
    md = _bench("-p", "8", "-n", "4", "-o", "md").splitlines()
    assert md[0].endswith("| t/s | bound t/s | % bound |")
    assert md[2].endswith("| - | - |") and md[3].endswith("% |")
    rec = json.loads(_bench("-p", "0", "-n", "4", "-o", "json"))[0]
    assert md[3].split("|")[-3].strip() == f"{rec['bound_ts']:,.2f}"
    monkeypatch.setattr(render.out, "width", 250)  # the rich table whole, not wrapped to 80 columns
    table = _bench("-p", "0", "-n", "4")
    assert "bound t/s" in table and "% bound" in table and f"{rec['bound_ts']:,.2f}" in table


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_bench_rejects_a_bad_bandwidth(value):
    r = runner.invoke(app, ["bench", "--backend", "numpy", "--bandwidth", value])
    assert r.exit_code == 2 and "--bandwidth" in r.stderr
