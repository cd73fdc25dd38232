"""k4 bench end to end on the GPU: records, per-step copy traffic, kernel microbenchmarks.

No timing bounds here (how fast a kernel runs is what `k4 bench --kernels` reports and
docs/PERF.md records): the checks are the records' fields and how they relate (rates from the
same timings, the bytes and FLOPs counted)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from k4.cli.app import app

runner = CliRunner()
pytestmark = pytest.mark.cuda


def test_bench_synthetic_on_cuda():
    r = runner.invoke(app, ["bench", "--backend", "cuda", "--synthetic", "test-tiny", "-p", "32", "-n", "16", "-d", "0,64",
                            "-r", "2", "-o", "json", "--flags", "K4_CUDA_GRAPH=1", "--flags", "K4_CUDA_GRAPH=0"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    assert [x["test"] for x in recs] == ["pp32", "tg16", "pp32@d64", "tg16@d64"] * 2
    for x in recs:
        assert x["backend"] == "cuda" and x["gpu"] and x["cupy"] and x["avg_ts"] > 0
        if x["n_gen"]:
            decode = x["phases"]["decode"]
            assert decode["h2d_bytes"] == 0 and decode["syncs"] == 0
            assert decode["d2h_bytes"] == 4 * decode["steps"]
    assert recs[1]["phases"]["decode"]["graph_replays"] > 0 and recs[5]["phases"]["decode"]["graph_replays"] == 0
    assert recs[0]["memory"]["kv_cache"] > 0
    assert {"read+upload", "compile", "warm-up", "graph capture"} <= set(recs[0]["load_ms"])
    assert "graph capture" not in recs[4]["load_ms"]


def test_bench_kernels_reports_bandwidth():
    r = runner.invoke(app, ["bench", "--kernels", "-o", "json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    gemv = [x for x in recs if x["kernel"] == "gemv"]
    assert {x["type"] for x in gemv} >= {"Q4_K", "Q6_K", "Q5_1"}
    assert {(x["type"], x["n_in"]) for x in gemv if x["x"] == "q8"} == {("Q4_K", 11008), ("Q6_K", 11008)}
    for x in gemv:
        assert x["us"] > 0 and x["read_us"] > 0 and x["dependent_read_us"] > 0
        assert x["fraction_of_read"] == pytest.approx(x["read_us"] / x["us"])
        assert x["fraction_of_dependent_read"] == pytest.approx(x["dependent_read_us"] / x["us"])
        assert x["fraction_of_4.2TB/s"] == pytest.approx(x["gb_s"] / 4200)
    attn = [x for x in recs if x["kernel"].startswith("attention")]
    assert len(attn) == 8 and all(x["tflop_s"] > 0 and x["us"] > 0 for x in attn)
    assert {(x["kv_type"], x["n_head_kv"]) for x in attn if x["n_ctx"] == 131072} == {("f16", 8), ("q8_0", 8)}


def test_bench_read_streams_the_bytes():
    """The read ceiling's rate is the bytes it reads over its time (GB/s = bytes / us / 1e3)."""
    from k4.runtime.cuda.microbench import bench_read

    for dependent in (False, True):
        r = bench_read(64 << 20, iters=20, dependent=dependent)
        assert r["us"] > 0 and r["gb_s"] == pytest.approx((64 << 20) / r["us"] / 1e3, rel=1e-3)


def test_bench_attention_flop_count():
    from k4.runtime.cuda.microbench import bench_attention

    prefill = bench_attention(256, 256, n_head=4, n_head_kv=2, head_dim=64, iters=5)
    decode = bench_attention(1, 256, n_head=4, n_head_kv=2, head_dim=64, iters=5)
    # 256 queries see 256*257/2 (query, key) pairs; one decode query sees 256
    assert prefill["tflop_s"] * prefill["us"] * 1e6 == pytest.approx(4 * 64 * 4 * 256 * 257 / 2)
    assert decode["tflop_s"] * decode["us"] * 1e6 == pytest.approx(4 * 64 * 4 * 256)


def test_bench_attention_counts_q8_0_bytes():
    """A q8_0 cache is read as 34 bytes per 32 values (quants and scales), an f16 one as 64."""
    from k4.runtime.cuda.microbench import bench_attention
    from k4.runtime.kv_types import KVTypes

    for kv, per_32 in ((KVTypes(), 64), (KVTypes("q8_0", "q8_0"), 34), (KVTypes("q8_0", "f16"), 49)):
        r = bench_attention(1, 4096, n_head=8, n_head_kv=2, head_dim=128, iters=5, kv=kv)
        assert r["gb_s"] * r["us"] * 1e3 == pytest.approx(2 * 4096 * 2 * 128 // 32 * per_32, rel=1e-6)
