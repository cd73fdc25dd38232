"""KV cache types (-ctk/--cache-type-k, -ctv/--cache-type-v; runtime/kv_types.py) on the CPU:
the options of run, chat, perplexity and bench, llama.cpp's q8_0 rule on the numpy backend
(bit-exact against a float64 implementation), the bytes per token -c 0 sizes with, and the
perplexity q8_0 costs on the story text (stories260K with heads widened to 128, tests/wide_heads.py:
its heads of 8 are shorter than a q8_0 block)."""

from __future__ import annotations

import json
import math
from itertools import islice

import numpy as np
import pytest
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime.errors import UsageError
from k4.runtime.kv_types import KVTypes, dequantize_q8_0, quantize_q8_0, round_trip
from k4.runtime.model import open_model
from k4.runtime.perplexity import perplexity
from k4.runtime.reference import NumpyBackend
from k4.runtime.sampling import SamplingParams
from k4.runtime.tokenizer import Tokenizer
from tests.wide_heads import write_wide_heads

runner = CliRunner()
Q8 = KVTypes("q8_0", "q8_0")
PPL_LIMIT = 0.005  # q8_0's perplexity over f16's, relative (the issue: within 0.5%)


@pytest.fixture(scope="module")
def wide(data, tmp_path_factory):
    """stories260K with heads of 128 (the same function; tests/wide_heads.py) and its tokenizer."""
    path = write_wide_heads(data / "models" / "stories260K.gguf", tmp_path_factory.mktemp("wide") / "wide.gguf")
    mf = open_model(path)
    return path, mf, Tokenizer.from_model(mf)


def q8_0_float64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_0_ref of x (n,) float32, each of its float32 operations done in
    float64 and rounded to float32 (exact for one division, reciprocal or product), roundf as
    floor(|y| + 1/2) with the sign: (quants int8, scales float16)."""
    f32 = lambda a: np.asarray(a, np.float64).astype(np.float32).astype(np.float64)  # noqa: E731
    b = np.asarray(x, np.float64).reshape(-1, 32)
    d = f32(np.abs(b).max(axis=1) / 127.0)
    inv = np.where(d > 0, f32(1.0 / np.where(d > 0, d, 1.0)), 0.0)
    y = f32(b * inv[:, None])
    q = np.sign(y) * np.floor(np.abs(y) + 0.5)
    return q.astype(np.int8).reshape(-1), d.astype(np.float16)


def test_q8_0_rounds_half_away_from_zero_as_llama_cpp():
    x = np.zeros(32, np.float32)
    x[:6] = [127.0, 2.5, -2.5, 0.5, -0.5, -126.5]  # amax 127: d = 1, id = 1, so x * id = x exactly
    q, d = quantize_q8_0(x)
    assert q[:6].tolist() == [127, 3, -3, 1, -1, -127] and not q[6:].any()
    assert d.tolist() == [1.0]
    q, d = quantize_q8_0(np.zeros(64, np.float32))  # an all-zero block: d = 0, id = 0, no NaN
    assert not q.any() and d.tolist() == [0.0, 0.0]


def test_numpy_q8_0_is_bit_exact_against_float64_llama_cpp(rng):
    scales = 10.0 ** rng.uniform(-9, 4, size=(400, 1))  # down to d below fp16's smallest subnormal
    x = (rng.standard_normal((400, 128)) * scales).astype(np.float32)
    x[7] = 0.0
    x[8, :32] = np.float32(3.0)  # a constant block: every value is amax
    q, d = quantize_q8_0(x)
    assert q.shape == (400, 128) and q.dtype == np.int8 and d.shape == (400, 4) and d.dtype == np.float16
    for row in range(400):
        wq, wd = q8_0_float64(x[row])
        assert np.array_equal(q[row], wq) and np.array_equal(d[row].view(np.uint16), wd.view(np.uint16)), row
    back = dequantize_q8_0(q, d)
    assert np.array_equal(back, (q.reshape(400, 4, 32) * d.astype(np.float32)[..., None]).reshape(400, 128))
    assert np.array_equal(round_trip(x, "q8_0"), back) and round_trip(x, "f16") is x


def test_kv_types_validate_and_size():
    with pytest.raises(UsageError, match=r"^--cache-type-k 'q4_0' is unknown; use one of f16, q8_0$"):
        KVTypes("q4_0")
    with pytest.raises(UsageError, match=r"^--cache-type-v 'F16' is unknown; use one of f16, q8_0$"):
        KVTypes("f16", "F16")
    with pytest.raises(UsageError, match="multiple of 32; this model's is 8"):
        Q8.check(8)
    KVTypes("q8_0", "f16").check(128)
    KVTypes().check(8)  # f16 takes any head size
    # Llama 3 8B: 32 layers, 8 kv heads of 128: 128 KiB a token in f16, 34/32 bytes a value in q8_0
    assert KVTypes().bytes_per_token(32, 1024) == 131072
    assert Q8.bytes_per_token(32, 1024) == 69632 and KVTypes("q8_0", "f16").bytes_per_token(32, 1024) == 100352
    assert 131072 / 69632 == pytest.approx(1.882, abs=1e-3)  # what -c 0 fits more with q8_0


def test_numpy_backend_stores_llama_cpp_q8_0_of_its_keys_and_values(wide):
    _, mf, tok = wide
    ids = tok.encode("Once upon a time, there was a little dog")
    f16, q8 = NumpyBackend(mf, 64), NumpyBackend(mf, 64, kv_types=Q8)
    f16.eval(ids)
    q8.eval(ids)
    n = len(ids)
    # layer 0's keys and values do not depend on the cache: the q8_0 cache holds their round trip
    assert np.array_equal(q8.k_cache[0, :n], round_trip(f16.k_cache[0, :n], "q8_0"))
    assert np.array_equal(q8.v_cache[0, :n], round_trip(f16.v_cache[0, :n], "q8_0"))
    assert not np.array_equal(q8.k_cache[0, :n], f16.k_cache[0, :n])
    k_only = NumpyBackend(mf, 64, kv_types=KVTypes("q8_0", "f16"))
    k_only.eval(ids)
    assert np.array_equal(k_only.k_cache[0, :n], q8.k_cache[0, :n]) and np.array_equal(k_only.v_cache[0, :n], f16.v_cache[0, :n])


def story_ppl(mf, tok, text: str, kv: KVTypes) -> float:
    return list(perplexity(NumpyBackend(mf, 128, kv_types=kv), tok.encode(text), 128, tok.bos_id))[-1].ppl


def test_q8_0_perplexity_on_the_story_within_half_a_percent_of_f16(data, wide, capsys):
    _, mf, tok = wide
    text = (data / "golden" / "story.txt").read_text()
    base = open_model(data / "models" / "stories260K.gguf")
    f16 = story_ppl(mf, tok, text, KVTypes())
    assert f16 == pytest.approx(story_ppl(base, tok, text, KVTypes()), rel=1e-5)  # widening kept the function
    q8 = story_ppl(mf, tok, text, Q8)
    with capsys.disabled():
        print(f"\nstory.txt -c 128, numpy: PPL f16 {f16:.4f}, q8_0 {q8:.4f} ({q8 / f16 - 1:+.3%})")
    assert abs(q8 / f16 - 1) < PPL_LIMIT


def test_q8_0_greedy_reproduces_llama_cpp_golden_on_numpy(data, wide):
    """q8_0 keys and values keep all 48 greedy tokens of every golden prompt (as f16 does)."""
    _, mf, tok = wide
    cases = [c for c in json.loads((data / "golden" / "greedy.json").read_text())["cases"] if c["model"] == "stories260K.gguf"]
    be = NumpyBackend(mf, 256, kv_types=Q8)
    for case in cases:
        be.reset()
        ids = tok.encode(case["prompt"])
        gen = be.generate(ids, SamplingParams(temperature=0.0))
        out = list(islice(gen, case["n_predict"]))
        gen.close()
        assert tok.decode(ids + out)[len(tok.decode(ids)) :] == case["completion"], case["prompt"]


@pytest.mark.parametrize("command", [["run", "hello"], ["chat"], ["perplexity", "-f", "story.txt"], ["bench", "-n", "4"]])
@pytest.mark.parametrize("option,value,long", [("-ctk", "q4_0", "--cache-type-k"), ("--cache-type-v", "f32", "--cache-type-v")])
def test_unknown_cache_type_is_one_line_usage_error(data, command, option, value, long):
    args = [a.replace("story.txt", str(data / "golden" / "story.txt")) for a in command]
    r = runner.invoke(app, [*args, "--backend", "numpy", option, value], input="")
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == f"error: {long} {value!r} is unknown; use one of f16, q8_0"


def test_q8_0_for_heads_of_8_is_refused_in_one_line(data):
    r = runner.invoke(app, ["run", "--backend", "numpy", "-m", str(data / "models" / "stories260K.gguf"), "-ctk", "q8_0", "hi"])
    assert r.exit_code == 2
    assert r.stderr.strip() == ("error: a q8_0 KV cache needs a head size that is a multiple of 32; this model's is 8: "
                                "use -ctk f16 -ctv f16")


def test_run_and_perplexity_take_q8_0(data, wide):
    path, _, _ = wide
    r = runner.invoke(app, ["run", "--backend", "numpy", "-m", str(path), "-ctk", "q8_0", "-ctv", "q8_0", "--temp", "0",
                            "-n", "8", "--json", "Once upon a time"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["generated_tokens"] == 8
    r = runner.invoke(app, ["perplexity", "--backend", "numpy", "-m", str(path), "-f", str(data / "golden" / "story.txt"),
                            "-c", "128", "--cache-type-k", "q8_0", "--cache-type-v", "f16", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert (rec["type_k"], rec["type_v"]) == ("q8_0", "f16") and math.isfinite(rec["ppl"])
