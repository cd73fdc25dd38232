"""llama.cpp's CLI habits in k4, through the real CLI on the numpy backend: -p/-f/PROMPT, -s and
the printed seed, --no-display-prompt, --chat-template, -c 0 and the training-context warning,
`k4 info` on files k4 cannot run, and strict JSON / "-" for rates of empty phases."""

from __future__ import annotations

import csv
import io
import json
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from typer.testing import CliRunner

from k4.cli.app import app
from k4.cli.render import json_text, rate_text
from k4.runtime.model import ARCHITECTURES
from tiny import tiny_config, write_tiny

runner = CliRunner()
RUN = ("run", "--backend", "numpy")


def invoke(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def strict_json(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity (RFC 8259 has none of them)."""
    def refuse(name):
        raise ValueError(f"{name} in JSON output")
    return json.loads(text, parse_constant=refuse)


def flat_help(*command) -> str:
    """A command's --help with the rich box drawing and line wrapping taken out."""
    r = invoke(*command, "--help")
    assert r.exit_code == 0, r.output
    return re.sub(r"[\s│]+", " ", r.stdout)


def table_text(text: str) -> str:
    """A rich table's text as `key value` pairs separated by single spaces."""
    return re.sub(r"[\s│┃]+", " ", text)


# -p / -f / PROMPT

def test_prompt_argument_option_and_file_are_the_same_prompt(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("The little dog", encoding="utf-8")
    greedy = (*RUN, "--temp", "0", "-n", "10")
    outputs = [invoke(*greedy, "The little dog"), invoke(*greedy, "-p", "The little dog"),
               invoke(*greedy, "--prompt", "The little dog"), invoke(*greedy, "-f", str(f)), invoke(*greedy, "--file", str(f))]
    assert all(r.exit_code == 0 for r in outputs), [r.output for r in outputs]
    assert outputs[0].stdout.startswith("The little dog") and len(outputs[0].stdout) > len("The little dog\n")
    assert {r.stdout for r in outputs} == {outputs[0].stdout}


@pytest.mark.parametrize("sources, named", [
    (("-p", "a", "b"), "as an argument and with -p"),
    (("-p", "a", "-f", "PROMPT_FILE"), "with -p and with -f"),
    (("-f", "PROMPT_FILE", "b"), "as an argument and with -f"),
    (("-p", "a", "-f", "PROMPT_FILE", "b"), "as an argument and with -p and with -f"),
])
def test_two_prompt_sources_are_a_one_line_usage_error(tmp_path, sources, named):
    f = tmp_path / "p.txt"
    f.write_text("x", encoding="utf-8")
    r = invoke(*RUN, *(str(f) if s == "PROMPT_FILE" else s for s in sources))
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"error: the prompt was given {named}; give it once: PROMPT, -p TEXT or -f FILE"]


def test_missing_or_unreadable_prompt_file_is_one_line(tmp_path):
    r = invoke(*RUN, "-f", str(tmp_path / "missing.txt"))
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [f"error: cannot read {tmp_path / 'missing.txt'}: No such file or directory"]
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    r = invoke(*RUN, "-f", str(tmp_path / "bad.txt"))
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot read" in r.stderr


# -s / --seed

def test_seed_is_printed_in_the_stats_line_and_json():
    r = invoke(*RUN, "-s", "42", "-n", "4", "Lily")
    assert r.exit_code == 0 and re.search(r"\| stop: length \| seed 42$", r.stderr.strip())
    assert strict_json(invoke(*RUN, "--json", "-s", "42", "-n", "4", "Lily").stdout)["seed"] == 42


def test_a_random_seed_is_printed_and_replays_the_output():
    sampled = (*RUN, "--json", "--temp", "1.0", "-n", "24", "Lily")
    first = strict_json(invoke(*sampled).stdout)
    again = strict_json(invoke(*sampled, "--seed", str(first["seed"])).stdout)
    assert again["token_ids"] == first["token_ids"] and again["seed"] == first["seed"]
    r = invoke(*RUN, "--temp", "1.0", "-n", "24", "Lily")
    seed = int(re.search(r"\| seed (\d+)$", r.stderr.strip()).group(1))
    replay = strict_json(invoke(*sampled, "-s", str(seed)).stdout)
    assert r.stdout == "Lily" + replay["text"] + "\n"


def test_chat_takes_s_and_prints_the_seed():
    args = ("chat", "--backend", "numpy", "--temp", "1.0", "-n", "12")
    a = runner.invoke(app, [*args, "-s", "7"], input="Once upon a time\n")
    b = runner.invoke(app, [*args, "--seed", "7"], input="Once upon a time\n")
    assert a.exit_code == 0 and a.stdout == b.stdout and a.stdout.strip()
    assert "seed 7" in a.stderr.splitlines()
    r = runner.invoke(app, list(args), input="Hi\n")
    assert [line for line in r.stderr.splitlines() if re.fullmatch(r"seed \d+", line)]


# --no-display-prompt

def test_no_display_prompt_prints_only_the_generated_text():
    greedy = (*RUN, "--temp", "0", "-n", "12", "Once upon a time")
    text = strict_json(invoke(*greedy, "--json").stdout)["text"]
    assert text
    assert invoke(*greedy).stdout == "Once upon a time" + text + "\n"
    assert invoke(*greedy, "--no-display-prompt").stdout == text + "\n"


# --chat-template in prompt (and chat)

def test_prompt_takes_chat_template_and_the_old_spelling(tmp_path, data):
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Hi"}]))
    tmpl = data / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    base = ("prompt", "-m", str(data / "vocab" / "ggml-vocab-gpt-2.gguf"), "--messages", str(msgs))
    new, old = invoke(*base, "--chat-template", str(tmpl)), invoke(*base, "--template", str(tmpl))
    assert new.exit_code == 0 and new.stdout.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert old.stdout == new.stdout
    both = invoke(*base, "--chat-template", str(tmpl), "--template", str(tmpl))
    assert both.exit_code == 2 and "give the chat template once" in both.stderr
    assert "--chat-template" in flat_help("prompt") and "--template " not in flat_help("prompt")
    assert "--chat-template" in flat_help("chat")


# -c 0 and the training context

@pytest.fixture(scope="module")
def long_ctx_model(tmp_path_factory, data):
    """A tiny llama whose training context (8192) is above llama.cpp's default --ctx-size of 4096."""
    path = tmp_path_factory.mktemp("ctx") / "long-ctx.gguf"
    return write_tiny(path, data / "models" / "stories260K.gguf", tiny_config(n_ctx_train=8192))


@pytest.mark.parametrize("ctx_args, n_ctx", [((), 8192), (("-c", "0"), 8192), (("--ctx-size", "0"), 8192), (("-c", "300"), 300)])
def test_ctx_size_zero_is_the_training_context(long_ctx_model, ctx_args, n_ctx):
    r = invoke(*RUN, "-m", str(long_ctx_model), "--json", "-n", "1", *ctx_args, "Hi")
    assert r.exit_code == 0, r.output
    assert strict_json(r.stdout)["n_ctx"] == n_ctx and "warning" not in r.stderr


def test_default_context_is_cut_to_what_fits_in_ram_in_one_line(long_ctx_model, monkeypatch):
    """-c 0 (and no -c) on the numpy backend: the largest multiple of 256 tokens whose KV cache
    fits in the available RAM beside the weights, said once with the numbers."""
    from k4.runtime import hostmem
    from k4.runtime.model import open_model
    from k4.runtime.reference import max_context

    _, left, per_token = max_context(open_model(long_ctx_model), mem_available=2**30)
    monkeypatch.setattr(hostmem, "available_ram", lambda *a, **k: 2**30 - left + 1000 * per_token)  # room for 1,000 tokens
    for ctx_args in ((), ("-c", "0")):
        r = invoke(*RUN, "-m", str(long_ctx_model), "--json", "-n", "1", *ctx_args, "Hi")
        assert r.exit_code == 0, r.output
        assert strict_json(r.stdout)["n_ctx"] == 768
        lines = [line for line in r.stderr.splitlines() if "context" in line]
        assert len(lines) == 1 and lines[0].startswith("context 768 tokens instead of the model's 8,192: its KV cache would need 4 MiB")
    r = invoke(*RUN, "-m", str(long_ctx_model), "--json", "-n", "1", "-c", "300", "Hi")  # an explicit -c is kept
    assert strict_json(r.stdout)["n_ctx"] == 300 and "instead of" not in r.stderr


def test_ctx_size_zero_on_the_sample_and_in_chat_and_perplexity(tmp_path):
    assert strict_json(invoke(*RUN, "--json", "-n", "1", "-c", "0", "Hi").stdout)["n_ctx"] == 512
    r = runner.invoke(app, ["chat", "--backend", "numpy", "-c", "0", "-n", "2"], input="/show\n")
    assert r.exit_code == 0 and re.search(r"0 of 512 tokens cached", r.stdout)
    f = tmp_path / "t.txt"
    f.write_text("A short text.")
    r = invoke("perplexity", "--backend", "numpy", "-f", str(f), "-c", "0")
    assert r.exit_code == 2 and "invalid" not in r.stderr and "1024" in r.stderr  # two chunks of n_ctx_train = 512


def test_help_says_what_ctx_size_zero_does():
    for command in ("run", "chat"):
        assert ("(default 0: the model's training context, or the largest multiple of 256 tokens whose KV cache fits "
                "in free memory beside the weights)" in flat_help(command)), command
    assert ("Chunk length in tokens: the context each chunk is scored in (0 = the model's training context, or the largest "
            "multiple of 256 tokens whose KV cache fits in free memory beside the weights). [default: 512]") in flat_help("perplexity")
    assert ("(0 = what the longest test needs, as llama-bench sizes it: depth + prompt + generated). [default: 0]"
            in flat_help("bench"))


def test_ctx_size_above_the_training_context_warns_once():
    r = invoke(*RUN, "-n", "2", "-c", "1000", "Hi")
    assert r.exit_code == 0
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: --ctx-size 1000 exceeds the model's training context of 512 tokens; output past it may degrade"]
    for args in ((), ("-c", "512"), ("-c", "0")):
        assert "warning" not in invoke(*RUN, "-n", "2", *args, "Hi").stderr
    r = invoke("bench", "--backend", "numpy", "-p", "8", "-n", "0", "-r", "1", "-c", "600", "-o", "jsonl")
    assert r.exit_code == 0 and "exceeds the model's training context of 512" in r.stderr


def test_negative_ctx_size_is_refused_before_loading():
    for command in (RUN, ("bench", "--backend", "numpy")):
        r = invoke(*command, "-m", "/nonexistent.gguf", "-c", "-3", *(("Hi",) if command == RUN else ()))
        assert r.exit_code == 2 and "--ctx-size -3 is invalid" in r.stderr and "no such file" not in r.stderr


# k4 info on any GGUF

def test_info_of_a_vocabulary_only_file(data):
    r = invoke("info", "-m", str(data / "vocab" / "ggml-vocab-gpt-2.gguf"))
    assert r.exit_code == 0 and r.stderr == "", r.output
    text = table_text(r.stdout)
    for needle in ("kind vocabulary only (no tensors)", "architecture gpt2", "gpt2.context_length 1024",
                   "tokenizer gpt2 (pre: gpt-2)", "tokens / merges 50,257 / 50,000", "special tokens bos 50256, eos 50256",
                   "chat template absent"):
        assert needle in text, needle
    assert r.stdout.strip().splitlines()[-1] == \
        "a vocabulary-only file: k4 tokenize and k4 prompt can use it; there are no weights to run"


def test_info_of_an_architecture_k4_cannot_run(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = GGUFWriter(str(path), "falcon")
    w.add_name("tiny-falcon")
    w.add_context_length(2048)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.add_tensor("blk.0.attn_qkv.weight", np.zeros((48, 32), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = invoke("info", "-m", str(path))
    assert r.exit_code == 2, r.output
    text = table_text(r.stdout)
    for needle in ("name tiny-falcon", "architecture falcon", "GGUF version 3", "falcon.context_length 2048",
                   "falcon.block_count 1", "tensors 2 (2,048 weights)", "tensor types 1 F16, 1 F32"):
        assert needle in text, needle
    assert r.stderr.strip().splitlines() == \
        [f"error: k4 cannot run {path}: architecture 'falcon' is not supported; k4 runs {', '.join(ARCHITECTURES)}"]
    r = invoke(*RUN, "-m", str(path), "Hi")
    assert r.exit_code == 2 and "architecture 'falcon' is not supported" in r.stderr


def test_info_of_an_incomplete_llama_says_what_is_missing(tmp_path, data):
    path = write_tiny(tmp_path / "holed.gguf", data / "models" / "stories260K.gguf", tiny_config(),
                      skip=("blk.1.ffn_down.weight",), matrix_type=T.F32)
    r = invoke("info", "-m", str(path))
    assert r.exit_code == 2 and "llama.context_length 128" in table_text(r.stdout)
    assert r.stderr.strip().splitlines() == \
        [f"error: k4 cannot run {path}: tensor 'blk.1.ffn_down.weight' is missing; the file is incomplete or not a llama model"]


# machine output: strict JSON, "-" for empty phases

def test_json_text_writes_null_for_nan_and_infinity():
    value = {"a": float("nan"), "b": [1.5, float("inf"), {"c": -float("inf")}], "d": (2, "x")}
    assert json_text(value) == '{"a": null, "b": [1.5, null, {"c": null}], "d": [2, "x"]}'
    assert rate_text(None) == "-" and rate_text(float("nan")) == "-" and rate_text(1234.56) == "1,234.6"


def test_run_json_has_null_rates_for_empty_phases():
    out = strict_json(invoke(*RUN, "--json", "-n", "0", "Hi").stdout)
    assert out["generated_tokens"] == 0 and out["prompt_tps"] is None and out["gen_tps"] is None
    out = strict_json(invoke(*RUN, "--json", "--temp", "0", "-n", "1", "Hi").stdout)
    assert out["generated_tokens"] == 1 and out["prompt_tps"] > 0 and out["gen_tps"] is None
    out = strict_json(invoke(*RUN, "--json", "--temp", "0", "-n", "3", "Hi").stdout)
    assert out["prompt_tps"] > 0 and out["gen_tps"] > 0


def test_stats_lines_print_a_dash_for_empty_phases():
    r = invoke(*RUN, "-n", "0", "-s", "5", "Hi")
    assert r.exit_code == 0
    assert r.stderr.strip().endswith("- t/s | generated 0 tok, - t/s | stop: length | seed 5")
    r = invoke(*RUN, "-n", "1", "Hi")
    assert re.search(r"prompt 3 tok \(3 evaluated\), [\d,.]+ t/s \| generated 1 tok, - t/s \|", r.stderr)
    r = runner.invoke(app, ["chat", "--backend", "numpy", "--temp", "0", "-n", "1"], input="Hi\n")
    assert re.search(r"\[ prompt [\d,]+ tok [\d,]+ t/s \| reply 1 tok - t/s \| context [\d,]+ / 512 \]", r.stderr)


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_bench_json_is_strict_with_null_latencies_for_prompt_tests(fmt):
    r = invoke("bench", "--backend", "numpy", "-p", "8", "-n", "2", "-r", "1", "-o", fmt)
    assert r.exit_code == 0, r.output
    records = strict_json(r.stdout) if fmt == "json" else [strict_json(line) for line in r.stdout.splitlines()]
    by_test = {rec["test"]: rec for rec in records}
    assert set(by_test) == {"pp8", "tg2"}
    assert by_test["pp8"]["token_ms_p50"] is None and by_test["pp8"]["token_gpu_ms_p99"] is None
    assert by_test["tg2"]["token_ms_p50"] > 0 and by_test["pp8"]["avg_ts"] > 0


def test_bench_csv_leaves_unmeasured_cells_empty():
    r = invoke("bench", "--backend", "numpy", "-p", "8", "-n", "0", "-r", "1", "-o", "csv")
    (cells,) = list(csv.DictReader(io.StringIO(r.stdout)))
    assert cells["test"] == "pp8" and cells["token_ms_p50"] == "" and "nan" not in r.stdout.lower()
