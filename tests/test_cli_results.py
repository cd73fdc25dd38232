"""What `k4 bench`, `k4 info` and `k4 synth` report, checked against figures known from outside
the code under test: a fake backend that counts the tokens it evaluates and a fake clock for
bench, the GGUF metadata read with the gguf package (and the files' documented shapes) for info,
the models' published configs and parameter counts for synth."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Iterator, Sequence

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from k4.cli.app import app
from k4.cli.common import SAMPLE_MODEL
from k4.runtime import bench as rb
from k4.runtime.errors import ContextFullError
from k4.runtime.model import expected_shapes
from k4.runtime.synthetic import PRESETS
from k4.runtime.trace import Trace

runner = CliRunner()

TOKEN_S = 2.0**-10  # fake seconds per evaluated token: a power of two keeps every figure exact
N_VOCAB = 512


class FakeBackend:
    """The backend protocol (runtime/backend.py) without a model: every evaluated token advances
    `now` by TOKEN_S and every repetition's evaluations are recorded as (n_past before, count).
    generate() follows the numpy backend: evaluate the input, then yield, then evaluate the
    yielded token."""

    name = "fake"

    def __init__(self, n_ctx: int):
        self.n_ctx, self.trace, self.tokens = n_ctx, Trace(), []
        self.now = 0.0  # fake seconds
        self.runs: list[list[tuple[int, int]]] = []  # per reset: the eval calls (n_past, n_tokens)
        self.load_ms: dict[str, float] = {}
        self.load_detail_ms: dict[str, float] = {}

    def memory_report(self) -> dict[str, int]:
        return {}

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def clock(self) -> float:
        return self.now

    def reset(self) -> None:
        self.tokens = []
        self.runs.append([])

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def close(self) -> None:
        pass

    def eval(self, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        if self.n_past + len(token_ids) > self.n_ctx:
            raise ContextFullError("full")
        self.runs[-1].append((self.n_past, len(token_ids)))
        self.now += len(token_ids) * TOKEN_S
        self.tokens += list(token_ids)
        return np.zeros(N_VOCAB, np.float32)

    def generate(self, token_ids: Sequence[int], params, history: Sequence[int] = ()) -> Iterator[int]:
        self.eval(token_ids)
        while True:
            yield 7
            self.eval([7])


def timed_evals(run: list[tuple[int, int]], depth: int) -> list[tuple[int, int]]:
    """The evaluations of one repetition after the depth fill, which must come first and fill
    exactly `depth` tokens from an empty cache."""
    if depth:
        assert run[0] == (0, depth)
        return run[1:]
    return run


@pytest.mark.parametrize("n_prompt, n_gen, depth", [(512, 0, 0), (0, 128, 0), (512, 0, 64), (0, 128, 64), (16, 8, 32)])
def test_bench_counts_tokens_and_fills_the_depth(n_prompt, n_gen, depth):
    fake = FakeBackend(n_ctx=1024)
    res = rb.run_test(fake, rb.BenchTest(n_prompt, n_gen, depth), reps=3, n_vocab=N_VOCAB, clock=fake.clock)
    assert len(fake.runs) == 4  # one warm-up, three measured
    for run in fake.runs:
        evals = timed_evals(run, depth)
        if n_prompt:
            assert evals[0] == (depth, n_prompt)  # ppN: N prompt tokens after the depth
            decode = evals[1:]
            # the first token comes from the prompt's logits, so ppN+tgM evaluates N + M - 1 tokens
            # (llama-bench's pp+tg decodes M tokens after the prompt, one more) and counts N + M
            assert decode == [(depth + n_prompt + i, 1) for i in range(n_gen - 1)]
        else:
            # tgN: N decode steps, the first re-evaluating the last cached token (or BOS at depth 0)
            assert evals == [(max(depth - 1, 0) + i, 1) for i in range(n_gen)]
    evaluated = sum(n for _, n in timed_evals(fake.runs[-1], depth))
    # tokens/s = the test's tokens / the seconds the timed evaluations took, exactly
    assert res.samples == [(n_prompt + n_gen) / (evaluated * TOKEN_S)] * 3
    if not n_prompt:
        assert res.samples == [1 / TOKEN_S] * 3
    # per-token decode latency: one fake step each (pp+tg: the first token is timed with the prompt)
    assert res.token_ms == [TOKEN_S * 1e3] * (3 * (n_gen - (1 if n_prompt else 0)) if n_gen else 0)


@pytest.fixture
def fake_bench(monkeypatch):
    """`k4 bench` with the fake backend and clock in place of the real ones; yields the list of
    backends the command built."""
    built: list[FakeBackend] = []

    def make_fake(mf, kind="auto", n_ctx=0, progress=None, status=None, flags=None, kv_types=None):
        built.append(FakeBackend(n_ctx))
        built[-1].kv_types = kv_types
        return built[-1]

    def fake_clock() -> float:
        return built[-1].clock()

    monkeypatch.setattr("k4.runtime.backend.make_backend", make_fake)
    monkeypatch.setattr(rb, "iter_results", functools.partial(rb.iter_results, clock=fake_clock))
    return built


def test_bench_cli_depth_and_tokens_per_second(fake_bench):
    r = runner.invoke(app, ["bench", "-m", str(SAMPLE_MODEL), "-p", "64", "-n", "16", "-d", "0,48", "-r", "2", "-o", "json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    assert [(x["test"], x["n_prompt"], x["n_gen"], x["n_depth"]) for x in recs] == [
        ("pp64", 64, 0, 0), ("tg16", 0, 16, 0), ("pp64@d48", 64, 0, 48), ("tg16@d48", 0, 16, 48)]
    for x in recs:
        assert x["samples_ts"] == [1 / TOKEN_S] * 2 and x["avg_ts"] == 1 / TOKEN_S and x["stddev_ts"] == 0
    (fake,) = fake_bench
    assert fake.n_ctx == 64 + 48  # the deepest test's need
    # per test: one warm-up and two measured runs, in the order of the records
    depths = [0, 0, 48, 48]
    for i, (x, depth) in enumerate(zip(recs, depths)):
        for run in fake.runs[3 * i: 3 * i + 3]:
            evals = timed_evals(run, depth)
            assert sum(n for _, n in evals) == x["n_prompt"] + x["n_gen"]
            assert evals[0][0] == (depth if x["n_prompt"] else max(depth - 1, 0))


def test_bench_cli_cache_types_are_a_product_like_llama_bench(fake_bench):
    r = runner.invoke(app, ["bench", "-m", str(SAMPLE_MODEL), "-p", "0", "-n", "4", "-r", "1", "-ctk", "f16,q8_0",
                            "--cache-type-v", "q8_0", "-o", "json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    assert [(x["test"], x["type_k"], x["type_v"]) for x in recs] == [("tg4", "f16", "q8_0"), ("tg4", "q8_0", "q8_0")]
    assert [(b.kv_types.k, b.kv_types.v) for b in fake_bench] == [("f16", "q8_0"), ("q8_0", "q8_0")]  # a backend each
    r = runner.invoke(app, ["bench", "-m", str(SAMPLE_MODEL), "-p", "0", "-n", "4", "-r", "1", "-ctk", "f16,q8_0", "-o", "md"])
    assert r.exit_code == 0, r.output
    assert "| type_k | type_v |" in r.stdout and "| f16 | f16 | tg4 |" in r.stdout and "| q8_0 | f16 | tg4 |" in r.stdout


def info_rows(output: str) -> dict[str, str]:
    """The `key | value` rows of `k4 info`'s table, by label (values wrapped over several lines
    joined with a space; any row order, rows this test does not know are kept too)."""
    rows: dict[str, str] = {}
    key = None
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) != 4:
            continue
        if cells[1]:
            key = cells[1]
            rows[key] = cells[2]
        elif key is not None:
            rows[key] += " " + cells[2]
    return rows


def gguf_shape(path: Path) -> dict[str, int]:
    """The model's sizes from its GGUF metadata (llama.cpp's keys), read with the gguf package."""
    reader = gguf.GGUFReader(str(path))

    def meta(key: str):
        field = reader.fields[key]
        return field.contents() if hasattr(field, "contents") else field.parts[field.data[0]][0]

    arch = meta("general.architecture")
    return {
        "n_vocab": len(reader.fields["tokenizer.ggml.tokens"].data),
        "n_ctx_train": int(meta(f"{arch}.context_length")),
        "n_embd": int(meta(f"{arch}.embedding_length")),
        "n_layer": int(meta(f"{arch}.block_count")),
        "n_head": int(meta(f"{arch}.attention.head_count")),
        "n_head_kv": int(meta(f"{arch}.attention.head_count_kv")),
        "n_ff": int(meta(f"{arch}.feed_forward_length")),
    }


def parsed_shape(rows: dict[str, str]) -> dict[str, int]:
    n_head, n_head_kv = rows["n_head / n_head_kv"].split(" / ")
    return {"n_vocab": int(rows["n_vocab"]), "n_ctx_train": int(rows["n_ctx (trained)"]), "n_embd": int(rows["n_embd"]),
            "n_layer": int(rows["n_layer"]), "n_head": int(n_head), "n_head_kv": int(n_head_kv), "n_ff": int(rows["n_ff"]),
            "head_dim": int(rows["head_dim"])}


# documented shapes (tests/data/README.md, samples/): stories260K is dim 64, 5 layers, 8 heads / 4 kv
# heads, ffn 172, 512 tokens; the sample is it zero-padded to dim 256, 32 heads of 8, 16 kv heads, ffn 256
KNOWN = {
    "stories260K.gguf": dict(n_vocab=512, n_ctx_train=2048, n_embd=64, n_layer=5, n_head=8, n_head_kv=4, n_ff=172, head_dim=8),
    "sample": dict(n_vocab=512, n_ctx_train=512, n_embd=256, n_layer=5, n_head=32, n_head_kv=16, n_ff=256, head_dim=8),
}


@pytest.mark.parametrize("which", ["stories260K.gguf", "sample"])
def test_info_rows_match_the_model(which, data):
    path = SAMPLE_MODEL if which == "sample" else data / "models" / which
    r = runner.invoke(app, ["info", "-m", str(path)])
    assert r.exit_code == 0, r.output
    rows = info_rows(r.stdout)
    shape = parsed_shape(rows)
    assert shape == KNOWN[which]
    assert {k: v for k, v in shape.items() if k != "head_dim"} == gguf_shape(path)
    assert rows["architecture"] == "llama"


# The published configs (Hugging Face config.json of each model: hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings,
# rope_theta, rms_norm_eps, head_dim, tie_word_embeddings) and parameter counts (the safetensors
# totals on the model pages). llama3-8b is Meta-Llama-3-8B (8192 context; Llama 3.1 8B has the
# same shape with 131072 and rope scaling, which k4 would read from rope_freqs).
PUBLISHED = {
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 128 experts of 768, 8 used
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, n_ff=6144, n_vocab=151936,
                          n_ctx=40960, rope_freq_base=1000000.0, rms_eps=1e-6, head_dim=128, tied=False,
                          n_params=30_532_122_624),
    "tinyllama-1.1b": dict(arch="llama", n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632, n_vocab=32000,
                           n_ctx=2048, rope_freq_base=10000.0, rms_eps=1e-5, head_dim=64, tied=False, n_params=1_100_048_384),
    "llama2-7b": dict(arch="llama", n_embd=4096, n_layer=32, n_head=32, n_head_kv=32, n_ff=11008, n_vocab=32000,
                      n_ctx=4096, rope_freq_base=10000.0, rms_eps=1e-5, head_dim=128, tied=False, n_params=6_738_415_616),
    "llama3-8b": dict(arch="llama", n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256,
                      n_ctx=8192, rope_freq_base=500000.0, rms_eps=1e-5, head_dim=128, tied=False, n_params=8_030_261_248),
    "qwen2.5-0.5b": dict(arch="qwen2", n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864, n_vocab=151936,
                         n_ctx=32768, rope_freq_base=1000000.0, rms_eps=1e-6, head_dim=64, tied=True, n_params=494_032_768),
    "qwen2.5-7b": dict(arch="qwen2", n_embd=3584, n_layer=28, n_head=28, n_head_kv=4, n_ff=18944, n_vocab=152064,
                       n_ctx=32768, rope_freq_base=1000000.0, rms_eps=1e-6, head_dim=128, tied=False, n_params=7_615_616_512),
    "qwen3-8b": dict(arch="qwen3", n_embd=4096, n_layer=36, n_head=32, n_head_kv=8, n_ff=12288, n_vocab=151936,
                     n_ctx=40960, rope_freq_base=1000000.0, rms_eps=1e-6, head_dim=128, tied=False, n_params=8_190_735_360),
    # google/gemma-3-{12b,27b}-it text_config; the vocabulary as the GGUF has it (262,144 tokens, the
    # 64 padding rows of vocab_size 262,208 dropped). Parameters: the model pages' totals
    # (12,187,325,040 and 27,432,406,640) less those 64 rows, the vision tower (416,867,184 in both)
    # and the projector (1152 x n_embd)
    "gemma3-12b": dict(arch="gemma3", n_embd=3840, n_layer=48, n_head=16, n_head_kv=8, n_ff=15360, n_vocab=262144,
                       n_ctx=131072, rope_freq_base=1000000.0, rms_eps=1e-6, head_dim=256, tied=True,
                       n_params=12_187_325_040 - 64 * 3840 - 416_867_184 - 1152 * 3840),
    "gemma3-27b": dict(arch="gemma3", n_embd=5376, n_layer=62, n_head=32, n_head_kv=16, n_ff=21504, n_vocab=262144,
                       n_ctx=131072, rope_freq_base=1000000.0, rms_eps=1e-6, head_dim=128, tied=True,
                       n_params=27_432_406_640 - 64 * 5376 - 416_867_184 - 1152 * 5376),
    # microsoft/phi-4 config.json (14.66B parameters, attn_qkv and ffn_up fused as llama.cpp writes them)
    "phi4-14b": dict(arch="phi3", n_embd=5120, n_layer=40, n_head=40, n_head_kv=10, n_ff=17920, n_vocab=100352,
                     n_ctx=16384, rope_freq_base=250000.0, rms_eps=1e-5, head_dim=128, tied=False, n_params=14_659_507_200),
}


def test_synth_presets_are_the_published_configs():
    assert set(PRESETS) == set(PUBLISHED) | {"test-tiny"}  # a new preset needs its published config here
    for name, want in PUBLISHED.items():
        cfg = PRESETS[name].config(name)
        got = dict(arch=cfg.arch, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
                   n_ff=cfg.n_ff, n_vocab=cfg.n_vocab, n_ctx=cfg.n_ctx_train, rope_freq_base=cfg.rope_freq_base,
                   rms_eps=cfg.rms_eps, head_dim=cfg.head_dim, tied=cfg.tied_embeddings,
                   n_params=sum(int(np.prod(s)) for s in expected_shapes(cfg).values()))
        assert got == want, name
        assert cfg.rope_neox == (cfg.arch != "llama") and cfg.has_qkv_bias == (cfg.arch == "qwen2")
        assert cfg.has_qk_norm == (cfg.arch in ("qwen3", "gemma3", "qwen3moe"))


def test_synth_help_names_every_preset():
    from k4.cli.synth import PRESET_HELP

    listed = PRESET_HELP.removeprefix("Model shape: ").split(" (")[0]
    assert re.split(r", or |, ", listed) == list(PRESETS)


def test_synth_writes_the_preset_shape(tmp_path):
    out = tmp_path / "tiny.gguf"
    r = runner.invoke(app, ["synth", "test-tiny", str(out)])
    assert r.exit_code == 0, r.output
    p = PRESETS["test-tiny"]
    want = dict(n_vocab=p.n_vocab, n_ctx_train=p.n_ctx, n_embd=p.n_embd, n_layer=p.n_layer, n_head=p.n_head,
                n_head_kv=p.n_head_kv, n_ff=p.n_ff)
    assert gguf_shape(out) == want
    rows = info_rows(runner.invoke(app, ["info", "-m", str(out)]).stdout)
    assert parsed_shape(rows) == {**want, "head_dim": p.n_embd // p.n_head}
