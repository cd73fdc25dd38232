"""Odd inputs at the CLI (issue 21): text from files and users printed as data, invalid UTF-8,
slash-command argument errors, hostile messages files, capped inputs, non-regular paths, closed
stdin / full disk / closed pipe, one-line usage errors, huge sizes, flag validation, and output
files that are never clobbered."""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gguf import GGUFValueType as V
from k4.cli.app import app
from k4.runtime.errors import UsageError
from k4.runtime.model import ARCHITECTURES
from k4.runtime.outfile import partial_output
from tests.hostile.gguf_bytes import Model, TensorBytes
from tests.test_chat_repl import Chat

REPO = Path(__file__).resolve().parents[1]
F32 = REPO / "tests" / "data" / "models" / "stories260K-pad-f32.gguf"
runner = CliRunner()
HOSTILE_NAME = "[/x][bold red]x\x1b[2J\x1b]0;pwned\x07"


def k4(*args: str | bytes, stdin=None, input: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real console entry (app.main) in a subprocess; output as bytes."""
    argv = [sys.executable, "-c", "from k4.cli.app import main; main()", *args]
    return subprocess.run(argv, stdin=stdin, input=input, capture_output=True, timeout=timeout, cwd=REPO)


def one_error_line(r) -> str:
    """The one `error:` line of a run that exited 2 (notices such as warnings may come before it)."""
    lines = r.stderr.decode().strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1 and lines[-1] == errors[0], (r.returncode, lines)
    assert b"Traceback" not in r.stderr
    return errors[0]


@pytest.fixture(scope="module")
def hostile_names(tmp_path_factory) -> Path:
    """The sample with markup and terminal escapes in general.name, the pre-tokenizer name, a
    tensor name and a key name."""
    m = Model.sample().set("general.name", V.STRING, HOSTILE_NAME).set("tokenizer.ggml.pre", V.STRING, "[/y]\x1b[5m")
    m.set("x.[/z]\x1b[31m", V.STRING, "[/w]")
    m.tensors.append(TensorBytes("extra.[/t]\x1b[2J", 0, [4], b"\0" * 16))
    path = tmp_path_factory.mktemp("names") / "names.gguf"
    path.write_bytes(m.to_bytes())
    return path


def test_info_prints_file_text_as_plain_text(hostile_names):
    r = k4("info", "-m", str(hostile_names))
    assert r.returncode == 0 and b"\x1b" not in r.stdout and b"Traceback" not in r.stderr
    assert "[/x][bold red]x[2J]0;pwned" in r.stdout.decode()  # the markup as written, the control bytes gone


def test_info_of_a_file_k4_cannot_run_names_it_in_one_line(tmp_path):
    path = tmp_path / "[red]odd[x].gguf"
    path.write_bytes(Model.sample().set("general.architecture", V.STRING, "[/x]\x1b[31m").to_bytes())
    line = one_error_line(k4("info", "-m", str(path)))
    assert line == f"error: k4 cannot run {path}: architecture '[/x]\\x1b[31m' is not supported; k4 runs {', '.join(ARCHITECTURES)}"


def test_quantize_dry_run_shows_tensor_names_as_text(tmp_path):
    src = Model.read(F32)
    src.tensors.append(TensorBytes("[/q]\x1b[2J", 0, [32], b"\0" * 128))
    path = tmp_path / "f32.gguf"
    path.write_bytes(src.to_bytes())
    r = k4("quantize", "--dry-run", str(path), "Q8_0")
    assert r.returncode == 0, r.stderr[-500:]
    assert "[/q][2J" in r.stdout.decode() and b"\x1b" not in r.stdout


def test_chat_show_and_bad_slash_arguments_keep_the_session(tmp_path, hostile_names):
    """/save "x (an unclosed quote) is a message; /show prints the markup of the model's name as
    text; the conversation is still there and /save writes it."""
    chat = Chat(tmp_path, "-m", str(hostile_names), "-n", "3", "--temp", "0")
    chat.say("Once upon a time")
    chat.command('/save "x', "cannot read the arguments")
    shown = chat.command("/show", "chat template")
    assert "[/x][bold red]x" in shown and "\x1b[2J" not in shown
    saved = tmp_path / "conv.json"
    chat.command(f"/save {saved}", "saved 2 messages")
    assert chat.leave_with_ctrl_d() == 0
    assert [m["content"] for m in json.loads(saved.read_text())][0] == "Once upon a time"


def test_invalid_utf8_in_argv_stdin_and_chat_lines():
    r = k4("tokenize", b"caf\xe9", "--ids")
    assert r.returncode == 0 and r.stdout.decode().strip() == "[1, 280, 412, 431, 242, 194, 192]"  # U+FFFD as its 3 bytes
    line = one_error_line(k4("tokenize", "--ids", input=b"caf\xe9\n"))
    assert line == "error: cannot read stdin: not UTF-8 text (byte 3 is 0xe9); convert it to UTF-8"
    r = k4("chat", "--backend", "numpy", "-n", "2", "--no-stats", "-s", "1", input=b"caf\xe9\n")
    assert r.returncode == 0 and len(r.stdout.decode().splitlines()) == 1


def test_hostile_messages_files_are_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 10_000 + "]" * 10_000)
    assert "JSON nested too deep" in one_error_line(k4("prompt", "--messages", str(deep)))
    digits = tmp_path / "digits.json"
    digits.write_text('[{"role": "user", "content": "x", "n": ' + "9" * 10_000 + "}]")
    assert "Exceeds the limit (4300 digits)" in one_error_line(k4("prompt", "--messages", str(digits)))


def test_text_inputs_are_capped_and_model_paths_must_be_regular_files(tmp_path):
    assert one_error_line(k4("run", "-f", "/dev/zero", "-n", "1")) == \
        "error: /dev/zero holds more than 64 MiB of text; k4 reads text inputs of at most that size"
    assert "more than 64 MiB" in one_error_line(k4("chat", "--system-file", "/dev/zero"))
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    t0 = time.perf_counter()
    assert one_error_line(k4("info", "-m", str(fifo), timeout=30)) == \
        f"error: {fifo}: not a regular file (a pipe or a device); pass a .gguf file with -m"
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("args", [("run", "-p", "Once", "-n", "4", "--backend", "numpy"), ("tokenize", "Once upon a time"),
                                  ("info",), ("chat", "--backend", "numpy", "-n", "2"), ("perplexity", "-f", "{text}", "-c", "32", "--backend", "numpy")])
def test_closed_stdin_full_disk_and_closed_pipe_exit_0_or_2(tmp_path, args):
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a girl who liked to play in the park with her dog. " * 4)
    (tmp_path / "in.txt").write_text("Hi\n")
    k4_cmd = shlex.join([sys.executable, "-c", "from k4.cli.app import main; main()", *(a.replace("{text}", str(text)) for a in args)])

    def sh(line: str) -> subprocess.CompletedProcess:
        return subprocess.run(line, shell=True, executable="/bin/bash", capture_output=True, cwd=tmp_path, timeout=120)

    assert one_error_line(sh(f"{k4_cmd} > /dev/full < in.txt")) == "error: cannot write the output: No space left on device"
    closed = sh(f"{k4_cmd} <&-")
    assert closed.returncode == 0 and b"Traceback" not in closed.stderr
    head = sh(f"{k4_cmd} < in.txt | head -c 1; exit ${{PIPESTATUS[0]}}")
    assert head.returncode == 0 and b"Traceback" not in head.stderr and b"Exception ignored" not in head.stderr


@pytest.mark.parametrize("args, message", [
    (("run", "-c", "abc", "-p", "x"), "error: Invalid value for '-c' / '--ctx-size': Input should be a valid integer, "
                                      "unable to parse string as an integer (see k4 run --help)"),
    (("info", "--bogus"), "error: No such option: --bogus (see k4 info --help)"),
    (("run", "-p", "x", "-c", str(2**63 - 1)), f"error: --ctx-size {2**63 - 1} is too large; use at most 2,147,483,647 tokens"),
])
def test_usage_errors_are_one_line(args, message):
    assert one_error_line(k4(*args)) == message


@pytest.mark.parametrize("args", [("bench", "-p", str(2**63 - 1), "-n", "1", "-r", "1"), ("bench", "-p", "8", "-n", "1", "-d", str(2**63 - 1)),
                                  ("run", "-p", "x", "-c", "100000000")])
def test_huge_sizes_are_checked_against_memory_first(args):
    line = one_error_line(k4(*args, "--backend", "numpy"))
    assert "on the numpy backend needs" in line and "MiB of RAM" in line


def test_perplexity_validates_k4_flags(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time. " * 20)
    r = subprocess.run([sys.executable, "-c", "from k4.cli.app import main; main()", "perplexity", "-f", str(text), "--backend", "numpy"],
                       capture_output=True, cwd=REPO, timeout=120, env=dict(os.environ, K4_CUDA_GRAPH="banana"))
    assert "K4_CUDA_GRAPH" in one_error_line(r)


def test_two_quantize_runs_to_one_output_the_second_is_refused(tmp_path):
    out = tmp_path / "q.gguf"
    first = runner.invoke(app, ["quantize", str(F32), str(out), "Q8_0", "-t", "1"])
    assert first.exit_code == 0 and out.stat().st_size > 0
    before = out.read_bytes()
    second = runner.invoke(app, ["quantize", str(F32), str(out), "Q8_0", "-t", "1"])
    assert second.exit_code == 2 and "already exists; pass --force" in second.stderr and out.read_bytes() == before


def test_an_output_created_meanwhile_is_not_clobbered(tmp_path):
    """The race: `out` appears while the temporary file is written; the publish refuses."""
    out = tmp_path / "m.gguf"
    with pytest.raises(UsageError, match="appeared while it was being written"):
        with partial_output(out, force=False) as tmp:
            tmp.write_bytes(b"ours")
            out.write_bytes(b"theirs")
    assert out.read_bytes() == b"theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_force_never_replaces_a_device_and_outputs_need_a_folder(tmp_path):
    r = runner.invoke(app, ["quantize", str(F32), "/dev/null", "Q8_0", "--force"])
    assert r.exit_code == 2 and "is not a regular file" in r.stderr and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    r = runner.invoke(app, ["synth", "tinyllama-1.1b", str(tmp_path / "missing" / "m.gguf")])
    assert r.exit_code == 2 and "is not a folder" in r.stderr
    r = runner.invoke(app, ["synth", "tinyllama-1.1b", str(tmp_path)])
    assert r.exit_code == 2 and "is a folder" in r.stderr


def test_synth_leaves_a_users_part_file_alone(tmp_path, monkeypatch):
    """synth writes through a unique temporary name, never OUT.part; a failure removes only its own file."""
    from k4.runtime import synthetic

    part = tmp_path / "m.gguf.part"
    part.write_bytes(b"mine")

    def boom(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(synthetic, "_tensor_data", boom)
    with pytest.raises(OSError):
        synthetic.write_synthetic("tinyllama-1.1b", tmp_path / "m.gguf")
    assert part.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf.part"]


def test_sigterm_removes_the_partial_output(tmp_path):
    code = ("import time; from pathlib import Path; from k4.runtime.outfile import partial_output\n"
            f"with partial_output(Path({str(tmp_path / 'out.gguf')!r}), False) as tmp:\n"
            "    tmp.write_bytes(b'x'); print(tmp, flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tmp = Path(p.stdout.readline().strip())
    assert tmp.exists() and tmp.parent == tmp_path and tmp.name.startswith(".out.gguf.")
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    assert p.returncode != 0 and list(tmp_path.iterdir()) == []


def test_zero_size_tensor_in_quantize_input(tmp_path):
    src = tmp_path / "zero.gguf"
    m = Model.read(F32)
    m.tensors.append(TensorBytes("extra.weight", 0, [64, 0], b""))
    src.write_bytes(m.to_bytes())
    r = runner.invoke(app, ["quantize", str(src), str(tmp_path / "out.gguf"), "Q4_K_M", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert runner.invoke(app, ["info", "-m", str(tmp_path / "out.gguf")]).exit_code == 0


@pytest.mark.parametrize("source, when", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "from now on"),  # fails at the first turn
    ("{% for %}", "instead"),  # fails to compile at start
])
def test_chat_falls_back_to_the_built_in_template(tmp_path, source, when):
    path = tmp_path / "m.gguf"
    path.write_bytes(Model.sample().set("tokenizer.chat_template", V.STRING, source).to_bytes())
    r = runner.invoke(app, ["chat", "-m", str(path), "--backend", "numpy", "-n", "2", "--temp", "0", "--no-stats"], input="Hi\nHello\n")
    assert r.exit_code == 0, r.output
    notices = [line for line in r.stderr.splitlines() if "built-in template" in line]
    assert len(notices) == 1 and when in notices[0] and notices[0].startswith("warning: ")
    assert len(r.stdout.splitlines()) == 2  # both messages answered
