"""k4 bench and k4 synth on the numpy backend: expansion, flags, printers, synthetic layouts."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime.bench import BenchTest, expand, parse_cache_types, parse_flags, parse_list
from k4.runtime.kv_types import KVTypes
from k4.runtime.errors import UsageError
from k4.runtime.model import expected_shapes, open_model
from k4.runtime.reference import NumpyBackend
from k4.runtime.synthetic import PRESETS, q4_k_m_types, random_blocks

runner = CliRunner()


def test_test_names_follow_llama_bench():
    assert BenchTest(512, 0).name == "pp512"
    assert BenchTest(0, 128).name == "tg128"
    assert BenchTest(512, 128).name == "pp512+tg128"
    assert BenchTest(0, 128, 4096).name == "tg128@d4096"
    assert BenchTest(0, 0, 8, n_verify=4).name == "tv4@d8" and BenchTest(0, 16, lookup=2).name == "tg16/lookup2"


def test_each_test_asks_for_the_context_it_fills():
    """tvN: depth, the first token, then VERIFY_STEPS steps of N + 1 at worst; ppN+tgM the depth
    and its tokens, and with lookup one position more."""
    from k4.runtime.bench_spec import VERIFY_STEPS

    assert BenchTest(0, 0, 8, n_verify=4).ctx_tokens == 8 + 1 + VERIFY_STEPS * 5
    assert BenchTest(16, 32, 64).ctx_tokens == 112 and BenchTest(0, 32, 64, lookup=2).ctx_tokens == 97


def test_latency_percentiles_in_the_records():
    from k4.runtime.bench import BenchResult, result_record

    res = BenchResult(BenchTest(0, 4), samples=[10.0, 12.0], token_ms=[float(x) for x in range(1, 102)])
    rec = result_record(res, {}, {})
    assert rec["token_ms_p50"] == 51.0 and rec["token_ms_p99"] == 100.0 and rec["token_gpu_ms_p50"] is None
    assert rec["avg_ts"] == 11.0 and rec["stddev_ts"] == pytest.approx(2 ** 0.5)
    assert result_record(BenchResult(BenchTest(0, 4), samples=[9.0]), {}, {})["stddev_ts"] == 0.0


def test_expand_is_the_cartesian_product():
    flags = [parse_flags("K4_CUDA_GRAPH=0"), parse_flags("K4_CUDA_GRAPH=1;K4_PINGPONG=0")]
    tests = expand([128, 512], [128], [(512, 128)], [0, 4096], flags)
    assert len(tests) == 2 * 2 * (2 + 1 + 1)
    assert [t.name for t in tests[:4]] == ["pp128", "pp512", "tg128", "pp512+tg128"]
    assert tests[4].name == "pp128@d4096"
    assert tests[-1].flags == (("K4_CUDA_GRAPH", "1"), ("K4_PINGPONG", "0"))
    assert expand([0], [0], [], [0], []) == []
    assert [t.name for t in expand([], [], [(8, 0), (0, 4), (0, 0)], [0], [])] == ["pp8", "tg4"]  # a pair of one zero: one test


def test_expand_crosses_cache_types_between_flags_and_depths():
    kv = [KVTypes(), KVTypes("q8_0", "q8_0")]
    tests = expand([0], [64], [], [0, 16384], [parse_flags("K4_PDL=0")], kv_sets=kv)
    assert [(t.name, t.kv) for t in tests] == [("tg64", kv[0]), ("tg64@d16384", kv[0]), ("tg64", kv[1]), ("tg64@d16384", kv[1])]
    assert expand([8], [0], [], [0], [])[0].kv == KVTypes()
    assert parse_cache_types(" f16, q8_0 ", "--cache-type-k") == ["f16", "q8_0"]
    for bad in ("q8_0,q4_0", ","):
        with pytest.raises(UsageError, match="^--cache-type-k "):
            parse_cache_types(bad, "--cache-type-k")


@pytest.mark.parametrize("text", ["12,x", "-1", ""])
def test_parse_list_rejects(text):
    with pytest.raises(UsageError):
        parse_list(text, "-p")


def test_parse_flags_rejects_unknown():
    with pytest.raises(UsageError, match="K4_NOPE"):
        parse_flags("K4_NOPE=1")


def _bench(*args):
    r = runner.invoke(app, ["bench", "--backend", "numpy", "-r", "2", *args])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_bench_json_records():
    recs = json.loads(_bench("-p", "16", "-n", "4", "--pg", "8,4", "-o", "json", "--flags", "K4_CUDA_GRAPH=0"))
    assert [r["test"] for r in recs] == ["pp16", "tg4", "pp8+tg4"]
    for r in recs:
        assert len(r["samples_ts"]) == 2 and r["avg_ts"] == pytest.approx(np.mean(r["samples_ts"]))
        assert r["stddev_ts"] == pytest.approx(np.std(r["samples_ts"], ddof=1))
        assert r["flags"] == "K4_CUDA_GRAPH=0" and r["backend"] == "numpy" and r["k4_version"]
        assert r["model_n_params"] > 0 and "gpu" in r and "cupy" in r
        assert r["flag_values"]["K4_CUDA_GRAPH"] == 0 and r["flag_values"]["K4_PINGPONG"] == 1
        assert r["load_ms"]["read+dequantize"] > 0


def test_bench_csv_and_jsonl_parse_back():
    rows = list(csv.DictReader(io.StringIO(_bench("-p", "16", "-n", "4", "-o", "csv"))))
    assert [r["test"] for r in rows] == ["pp16", "tg4"] and float(rows[1]["avg_ts"]) > 0
    lines = _bench("-p", "16", "-n", "0", "-d", "0,8", "-o", "jsonl").splitlines()
    assert [json.loads(x)["test"] for x in lines] == ["pp16", "pp16@d8"]
    md = _bench("-p", "8", "-n", "0", "-o", "md")
    assert md.startswith("| model |") and "| pp8 |" in md


def test_bench_tables_show_phases_and_traffic():
    out = _bench("-p", "8", "-n", "4")
    for title in ("throughput", "time per phase", "copy traffic"):
        assert title in out


@pytest.mark.parametrize("args, needle", [(("-o", "xml"), "-o 'xml'"), (("-r", "0"), "-r 0"), (("--pg", "1,2,3"), "--pg"),
                                          (("--flags", "K4_X=1"), "K4_X"), (("--kernels", "-o", "csv"), "-o csv does not apply to --kernels")])
def test_bench_bad_options(args, needle):
    r = runner.invoke(app, ["bench", "--backend", "numpy", *args])
    assert r.exit_code == 2 and needle in r.stderr


def test_bench_synthetic():
    recs = json.loads(_bench("--synthetic", "test-tiny", "-p", "8", "-n", "2", "-o", "json"))
    assert recs[0]["model_type"] == "llama synthetic test-tiny"


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q5_1])
def test_random_blocks_are_sane(qtype):
    w = dequantize(random_blocks(qtype, 32, 512, np.random.default_rng(0), 0.05), qtype)
    assert w.shape == (32, 512) and np.isfinite(w).all()
    assert 0.02 < w.std() < 0.1 and abs(w.mean()) < 0.01


def test_q4_k_m_plan_matches_llama_cpp_file(data):
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    plan = q4_k_m_types(mf.config)
    assert plan == {name: t.ggml_type for name, t in mf.tensors.items()}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_layouts(preset):
    cfg = PRESETS[preset].config(preset)
    shapes = expected_shapes(cfg)
    types = q4_k_m_types(cfg)
    assert types["token_embd.weight"] in (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0)
    assert (types.get("output.weight") or types["token_embd.weight"]) in (T.Q6_K, T.Q8_0)
    assert all(types[n] == T.F32 for n, s in shapes.items() if len(s) == 1)


def test_synth_writes_a_model_with_finite_forward(tmp_path):
    out = tmp_path / "tiny.gguf"
    r = runner.invoke(app, ["synth", "test-tiny", str(out)])
    assert r.exit_code == 0, r.output
    mf = open_model(out)
    assert mf.config.n_embd == 256 and mf.config.n_layer == 2
    logits = NumpyBackend(mf, 32).eval(list(range(1, 20)), all_logits=True)
    assert np.isfinite(logits).all() and logits.std() > 0
    r = runner.invoke(app, ["synth", "test-tiny", str(out)])
    assert r.exit_code == 2 and "--force" in r.stderr


def test_run_verify_times_both_step_sizes_alternately():
    """tvN: VERIFY_STEPS steps of N random ids (never BOS/EOS/UNK: ids >= 3) alternating with
    one-token steps after one prompt eval; t/s = N / the median N-token step, the ratio of the
    medians. A fake clock where a step of n ids takes n ms (plus 5 ms once, an outlier the
    median drops)."""
    from k4.runtime.bench_spec import VERIFY_STEPS, run_verify

    class Fake:
        def __init__(self):
            self.now, self.calls, self.evals = 0.0, [], []

        def eval(self, ids):
            self.evals.append(list(ids))

        def verify(self, batch):
            self.calls.append(list(batch))
            self.now += len(batch) * 1e-3 + (5e-3 if len(self.calls) == 3 else 0.0)

    be = Fake()
    tps, extra = run_verify(be, 4, [1, 5], 10, 0, lambda: be.now)
    assert be.evals == [[1, 5]] and [len(c) for c in be.calls] == [4, 1] * VERIFY_STEPS
    assert all(3 <= t < 10 for c in be.calls for t in c)
    assert tps == pytest.approx(1000.0) and extra["verify_ratio"] == pytest.approx(4.0)
    assert extra["verify_ms"] == pytest.approx(4.0) and extra["verify1_ms"] == pytest.approx(1.0)
    assert "verify_gpu_ratio" not in extra  # a backend without device times


def test_run_verify_also_gives_the_device_times_ratio_where_the_backend_records_them():
    """The medians of the device times the backend recorded for the same steps (what
    trace.gpu_steps["verify"] gained after the prompt's eval, N-token and one-token steps
    alternating), here 3 ms and 1 ms a step, one outlier; as the CUDA timer does, a step's time
    lands at the next call (the last step's not at all), and the eval lands an earlier run's last."""
    from k4.runtime.bench_spec import VERIFY_STEPS, run_verify
    from k4.runtime.trace import Trace

    class Fake:
        def __init__(self):
            self.now, self.trace, self.n, self.pending = 0.0, Trace(), 0, [70.0]  # an earlier run's last step
            self.trace.gpu_steps["verify"] = [50.0, 60.0]

        def eval(self, ids):
            self.trace.gpu_steps["verify"] += self.pending
            self.pending = []

        def verify(self, batch):
            self.n += 1
            self.now += len(batch) * 1e-3
            self.trace.gpu_steps["verify"] += self.pending
            self.pending = [(3.0 if len(batch) > 1 else 1.0) * (9 if self.n == 5 else 1)]

    be = Fake()
    _, extra = run_verify(be, 4, [1], 10, 0, lambda: be.now)
    assert extra["verify_gpu_ms"] == pytest.approx(3.0) and extra["verify1_gpu_ms"] == pytest.approx(1.0)
    assert extra["verify_gpu_ratio"] == pytest.approx(3.0) and extra["verify_ratio"] == pytest.approx(4.0)
    be = Fake()
    be.verify = lambda batch: setattr(be, "now", be.now + 1e-3)  # records no device time
    _, extra = run_verify(be, 4, [1], 10, 0, lambda: be.now)
    assert "verify_gpu_ratio" not in extra
    assert VERIFY_STEPS >= 4


def test_the_speculative_lines_name_both_ratios_where_there_are_two():
    from k4.cli.bench_printers import speculative_lines

    host = {"test": "tv8@d64", "verify_ms": 2.808, "verify1_ms": 1.605, "verify_ratio": 1.7495}
    lines = speculative_lines([host, {**host, "verify_gpu_ms": 2.5, "verify1_gpu_ms": 1.25, "verify_gpu_ratio": 2.0},
                               {"test": "tg128/lookup3", "draft_accepted": 90, "draft_tokens": 100, "tokens_per_step": 3.25}])
    assert lines == [
        "tv8@d64: a verify step of 8 tokens takes 2.808 ms, 1.75x a one-token step (1.605 ms): speculation gains at most 4.57x",
        "tv8@d64: a verify step of 8 tokens takes 2.808 ms, 1.75x a one-token step (1.605 ms): speculation gains at most 4.57x",
        "tv8@d64: on the device 2.500 ms against 1.250 ms, 2.00x",
        "tg128/lookup3: 90/100 drafts accepted, 3.25 tokens per verify step"]


def test_bench_verify_and_lookup_tests():
    """--verify 4 --lookup 2: tv4 reports its steps' times and ratio; tg16/lookup2 drafts from
    the model's own continuation, so every draft is accepted, 8 tokens a step (draft-max 7)."""
    recs = {r["test"]: r for r in json.loads(_bench("-p", "0", "-n", "16", "--verify", "4", "--lookup", "2", "-o", "json"))}
    assert set(recs) == {"tg16", "tg16/lookup2", "tv4"}
    tv = recs["tv4"]
    assert tv["verify_ratio"] == pytest.approx(tv["verify_ms"] / tv["verify1_ms"])
    assert tv["samples_ts"][-1] == pytest.approx(4 / (tv["verify_ms"] / 1e3))
    lk = recs["tg16/lookup2"]
    assert lk["draft_accepted"] == lk["draft_tokens"] > 0 and lk["tokens_per_step"] == 8.0


def test_run_lookup_times_every_token_after_the_first(data):
    """tgN/lookupK: the model's own greedy continuation primes the drafter (untimed), then the
    run is timed from the start: t/s = N over the whole run, and a latency per token after the
    first. A fake clock that advances 1 ms a reading."""
    import itertools

    from k4.runtime.bench_spec import run_lookup

    be = NumpyBackend(open_model(data / "models" / "stories260K.gguf"), 64)
    ticks = itertools.count(1)
    tps, token_ms, extra = run_lookup(be, [1, 403, 407], 8, 2, 7, lambda: next(ticks) * 1e-3)
    assert tps == pytest.approx(8 / 9e-3) and token_ms == pytest.approx([1.0] * 7)
    assert extra["draft_accepted"] == extra["draft_tokens"] > 0 and extra["draft_steps"] >= 1
