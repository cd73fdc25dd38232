"""The k4 CLI end to end on the numpy backend: run, info, tokenize, options, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import gguf
import pytest
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime.flags import FLAGS

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def test_run_default_sample_streams_prompt_and_completion():
    r = invoke("run", "--backend", "numpy", "--temp", "0", "-n", "12", "Once upon a time")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Once upon a time, there was")
    assert re.search(r"generated 12 tok, [\d,.]+ t/s", r.stderr)


def test_run_json_fields_and_seed_determinism():
    args = ("run", "--backend", "numpy", "--json", "--temp", "1.0", "--seed", "42", "-n", "20", "Lily")
    a, b = json.loads(invoke(*args).stdout), json.loads(invoke(*args).stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 20
    assert a["prompt_ids"][0] == 1 and a["seed"] == 42 and a["stop_reason"] == "length"
    for key in ("text", "prompt_tokens", "generated_tokens", "load_ms", "prompt_ms", "gen_ms", "prompt_tps", "gen_tps"):
        assert key in a
    other = json.loads(invoke(*args[:6], "--seed", "43", "-n", "20", "Lily").stdout)
    assert other["token_ids"] != a["token_ids"]


def test_run_prompt_from_file_and_stdin(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("The little dog")
    a = invoke("run", "--backend", "numpy", "--temp", "0", "-n", "8", "--json", "-f", str(f))
    b = invoke("run", "--backend", "numpy", "--temp", "0", "-n", "8", "--json", input="The little dog")
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def test_run_stop_string_cuts_before_it():
    r = invoke("run", "--backend", "numpy", "--temp", "0", "-n", "48", "--json", "--stop", "Lily", "Once upon a time")
    out = json.loads(r.stdout)
    assert out["stop_reason"] == "stop"
    assert out["text"] == ", there was a little girl named "


def test_run_no_bos():
    out = json.loads(invoke("run", "--backend", "numpy", "--temp", "0", "-n", "1", "--json", "--no-bos", "Hi").stdout)
    assert out["prompt_ids"][0] != 1


def test_context_limits():
    r = invoke("run", "--backend", "numpy", "-c", "8", "--temp", "0", "--json", "Once upon a time there was")
    out = json.loads(r.stdout)
    assert out["stop_reason"] == "context" and out["prompt_tokens"] + out["generated_tokens"] == 8
    r = invoke("run", "--backend", "numpy", "-c", "4", "Once upon a time there was a dog")
    assert r.exit_code == 2 and "raise --ctx-size" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (("--temp", "-1"), "--temp"), (("--top-p", "0"), "(0, 1]"), (("--min-p", "3"), "--min-p"),
    (("--backend", "tpu"), "--backend 'tpu' is unknown"), (("-m", "/nonexistent.gguf"), "no such file"),
    (("-f", "/nonexistent.txt"), "cannot read"), (("-n", "-2"), "-n -2 is invalid"), (("-c", "-5"), "--ctx-size -5"),
])
def test_run_invalid_options_one_line(args, needle):
    r = invoke("run", *args, "hello") if "-f" not in args else invoke("run", *args)
    assert r.exit_code == 2, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_info_of_sample():
    r = invoke("info")
    assert r.exit_code == 0
    for needle in ("llama", "Q4_K", "Q6_K", "n_embd", "256", "absent"):
        assert needle in r.stdout


def vocab_case(data, name: str, index: int) -> tuple[str, list[int]]:
    """Test string number `index` of tests/data/vocab/<name>.inp and its expected ids (.out,
    from the Hugging Face tokenizer, no BOS); format in tests/data/README.md."""
    texts = (data / "vocab" / f"{name}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (data / "vocab" / f"{name}.out").read_text(encoding="utf-8").split("\n")
    return texts[index], [int(x) for x in ids[index].split()]


def vocab_tokens(path) -> list[str]:
    """tokenizer.ggml.tokens of a GGUF, read with the gguf package alone."""
    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def test_tokenize_ids_and_pieces(data):
    model = data / "vocab" / "ggml-vocab-llama-spm.gguf"
    tokens = vocab_tokens(model)
    text, expected = vocab_case(data, "ggml-vocab-llama-spm.gguf", 18)
    assert text == " this is 🦙.cpp"  # a byte-fallback case: the llama emoji is 4 <0x..> tokens
    r = invoke("tokenize", "-m", str(model), text)
    assert r.exit_code == 0, r.output
    bos = 1  # tokenizer.ggml.bos_token_id; llama-spm adds BOS
    assert r.stdout.splitlines() == [f"{t:6d} -> {tokens[t]!r}" for t in [bos, *expected]]
    assert r.stdout.splitlines()[:3] == ["     1 -> '<s>'", " 29871 -> '▁'", "   445 -> '▁this'"]
    text, expected = vocab_case(data, "ggml-vocab-llama-spm.gguf", 16)
    r = invoke("tokenize", "-m", str(model), "--ids", "--no-bos", text)
    assert text == "Hello, world!" and r.stdout == "[15043, 29892, 3186, 29991]\n" and expected == [15043, 29892, 3186, 29991]
    # stories260K: each word of the prompt is one token of its 512-token vocabulary
    story = data / "models" / "stories260K.gguf"
    words = [vocab_tokens(story).index(w) for w in ("▁Once", "▁upon", "▁a", "▁time")]
    r = invoke("tokenize", "-m", str(story), "--ids", "Once upon a time")
    assert r.stdout == f"{[1, *words]}\n" and words == [403, 407, 261, 378]


def test_tokenize_vocab_only_gguf(data):
    r = invoke("tokenize", "-m", str(data / "vocab" / "ggml-vocab-gpt-2.gguf"), "--ids", "--no-bos", "Hello world")
    assert r.exit_code == 0 and json.loads(r.stdout) == [15496, 995]


def test_prompt_renders_template(tmp_path, data):
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Hi"}]))
    tmpl = data / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    r = invoke("prompt", "-m", str(data / "vocab" / "ggml-vocab-gpt-2.gguf"), "--messages", str(msgs), "--template", str(tmpl))
    assert r.exit_code == 0, r.output
    assert r.stdout.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    r = invoke("prompt", "-m", str(data / "vocab" / "ggml-vocab-gpt-2.gguf"), "--messages", str(msgs), "--template", str(tmpl),
               "--no-generation-prompt")
    assert r.stdout.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_perplexity_needs_enough_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("A short text.")
    r = invoke("perplexity", "--backend", "numpy", "-f", str(f), "-c", "64")
    assert r.exit_code == 2 and "needs at least 128" in r.stderr


def test_unknown_flag_warns():
    r = runner.invoke(app, ["run", "--backend", "numpy", "-n", "1", "hi"], env={"K4_NOPE": "1"})
    assert r.exit_code == 0 and "unknown flag K4_NOPE" in r.stderr


def test_readme_lists_every_flag_and_its_commands_work():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name, flag in FLAGS.items():
        assert f"| `{name}` | {flag.default} |" in readme
    assert 'pip install -e ".[test]" && pytest -q' in readme
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && pytest -q' in ci


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "k4.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "run" in r.stdout
    r = subprocess.run([sys.executable, "-m", "k4.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("k4 0.")


def test_ctrl_c_during_generation_exits_130(data):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "k4.cli", "run", "-m", str(data / "models" / "stories260K.gguf"),
                             "--backend", "numpy", "-c", "2048", "-n", "-1", "--temp", "0", "Once upon a time"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.read(20)  # generation has started streaming
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_every_command_has_a_one_line_summary():
    """`k4 --help` lists each command by the first paragraph of its docstring; a paragraph that
    wraps in the source shows its line break in the list (the details go after a blank line)."""
    for command in app.registered_commands:
        doc = command.callback.__doc__ or ""
        summary = doc.strip().split("\n\n")[0]
        assert summary and "\n" not in summary, f"{command.callback.__name__}: {summary!r}"
