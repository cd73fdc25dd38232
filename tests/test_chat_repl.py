"""`k4 chat` end to end: the real REPL in a pseudo-terminal (pexpect), and piped input.

Replies are checked for structure (turns, counts, files, messages) and, where greedy decoding
makes them deterministic, against what runtime.chat computes in-process."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pexpect
from typer.testing import CliRunner

from k4.cli.app import app
from k4.cli.chat import InterruptGuard
from k4.cli.common import SAMPLE_MODEL
from tests.test_chat import fresh_reply, make_session, turn, write_templated_tiny

REPO = Path(__file__).resolve().parents[1]
STATS = re.compile(r"\[ prompt ([\d,]+) tok [\d,]+ t/s \| reply ([\d,]+) tok [\d,]+ t/s \| context ([\d,]+) / ([\d,]+) \]")


class Chat:
    """`k4 chat` running in a pseudo-terminal; each method waits for the next prompt."""

    def __init__(self, tmp_path: Path, *args: str):
        env = dict(os.environ, NO_COLOR="1", PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
        self.history = tmp_path / "history"
        argv = ["-c", "from cli.app import main; main()", "chat", "--backend", "numpy", "--history", str(self.history), *args]
        self.p = pexpect.spawn(sys.executable, argv, cwd=str(REPO), env=env, encoding="utf-8", timeout=60, dimensions=(50, 220))
        self.prompt()
        self.banner = self.p.before

    def prompt(self) -> None:
        self.p.expect_exact(">>>")

    def say(self, text: str) -> tuple[int, int]:
        """Send a message; returns the stats line's (prompt tokens evaluated, reply tokens)."""
        self.p.sendline(text)
        return self.reply()

    def reply(self) -> tuple[int, int]:
        self.p.expect(STATS)
        counts = tuple(int(g.replace(",", "")) for g in self.p.match.groups())
        self.prompt()
        return counts[:2]  # counts[2:]: the context meter (used, n_ctx)

    def command(self, line: str, expected: str) -> str:
        """Send a line; wait for the regex `expected`, then the prompt; returns the text between."""
        self.p.sendline(line)
        self.p.expect(expected)
        seen = self.p.before + self.p.after
        self.prompt()
        return seen

    def leave_with_ctrl_d(self) -> int:
        self.p.sendcontrol("d")
        self.p.expect(pexpect.EOF)
        self.p.close()
        return self.p.exitstatus


def reply_start(n_ctx: int) -> str:
    """The first line of the greedy reply to "Once upon a time" on the sample (no system prompt)."""
    start = turn(make_session(SAMPLE_MODEL, n_ctx=n_ctx, n_predict=4), "Once upon a time").split("\n")[0]
    assert start
    return start


def test_conversation_and_every_slash_command(tmp_path):
    chat = Chat(tmp_path, "--temp", "0", "-n", "10", "--system", "You tell stories.")
    assert "no chat template" in chat.banner and "fallback" in chat.banner
    _, n = chat.say("Once upon a time")
    assert n == 10
    chat.say("Tell me more")
    chat.command("/help", r"/regen")
    chat.command("/system", r"You tell stories\.")
    chat.command("/set temperature 0.5", r"temperature = 0\.5")
    chat.command("/set", r"max_tokens")
    chat.command("/set colour red", r"error: cannot set 'colour'")
    chat.command("/set temperature 0", r"temperature = 0\.0")
    chat.command("/show", r"4 messages, 4 in the context window")
    chat.command("/show template", r"<\|im_start\|>")
    assert chat.say("/regen")[1] == 10
    chat.command("/stats", r"1 evaluated[\s\S]*per-phase counters \(last reply\)[\s\S]*decode")
    chat.command("/frobnicate", r"unknown command /frobnicate; /help lists the commands")
    saved = tmp_path / "conv.json"
    chat.command(f"/save {saved}", r"saved 5 messages")
    chat.command(f"/save {saved}", r"already exists; add --force")
    chat.command(f"/save {saved} --force", r"saved 5 messages")
    chat.command("/system You are terse.", r"system prompt set")
    chat.command("/clear", r"new conversation")
    chat.command("/show", r"0 messages, 0 in the context window")
    chat.command(f"/load {saved}", r"loaded 4 messages")
    chat.command("/show", r"4 messages[\s\S]*'You tell stories\.'")
    chat.p.sendcontrol("c")
    chat.p.expect("to leave, type /bye or press Ctrl-D")
    chat.prompt()
    chat.p.sendline("/bye")
    chat.p.expect(pexpect.EOF)
    chat.p.close()
    assert chat.p.exitstatus == 0
    conv = json.loads(saved.read_text())
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user", "assistant"]
    assert conv[0]["content"] == "You tell stories." and conv[3]["content"] == "Tell me more"
    assert "+Once upon a time" in chat.history.read_text()


def test_ctrl_c_mid_reply_keeps_the_partial_reply_and_the_next_turn_is_correct(tmp_path):
    start = reply_start(2048)
    chat = Chat(tmp_path, "-c", "2048", "-n", "2000", "--temp", "0")
    chat.p.sendline("Once upon a time")
    chat.p.expect_exact(start)
    chat.p.sendintr()
    chat.p.expect_exact("[interrupted: the partial reply is kept in the conversation; /regen answers again]")
    _, n_partial = chat.reply()
    assert 0 < n_partial < 2000
    chat.command("/set max_tokens 8", r"max_tokens = 8")
    assert chat.say("Tell me more")[1] == 8
    saved = tmp_path / "conv.json"
    chat.command(f"/save {saved}", r"saved 4 messages")
    assert chat.leave_with_ctrl_d() == 0
    conv = json.loads(saved.read_text())
    assert conv[1]["role"] == "assistant" and conv[1]["content"].startswith(start)
    assert conv[3]["content"] == fresh_reply(SAMPLE_MODEL, conv[:3], 8, 2048).text


def test_repeated_ctrl_c_during_a_reply_never_ends_the_session(tmp_path):
    start = reply_start(2048)
    chat = Chat(tmp_path, "-c", "2048", "-n", "2000", "--temp", "0")
    for _ in range(3):
        chat.p.sendline("Once upon a time")
        chat.p.expect_exact(start)
        for _ in range(3):
            chat.p.sendintr()
        chat.p.expect_exact("[interrupted: the partial reply is kept in the conversation;")
        chat.reply()
        chat.command("/clear", "new conversation")
    chat.command("/set max_tokens 4", r"max_tokens = 4")
    chat.say("Once upon a time")
    assert chat.say("The end")[1] == 4
    chat.command("/show", r"4 messages")
    assert chat.leave_with_ctrl_d() == 0


def ctrl_c() -> bool:
    """Deliver SIGINT to this process (its handler runs before raise_signal returns); True when
    that raised KeyboardInterrupt."""
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        return True
    return False


def test_interrupt_guard_raises_once_and_never_after_disarm():
    with InterruptGuard() as guard:
        assert [ctrl_c(), guard.hit] == [False, True]
        assert [ctrl_c(), ctrl_c(), ctrl_c()] == [True, False, False]
    with InterruptGuard() as guard:
        guard.disarm()
        assert [ctrl_c(), ctrl_c(), guard.hit] == [False, False, True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert ctrl_c()


def test_real_template_on_a_synthetic_model(tmp_path, data):
    model = write_templated_tiny(tmp_path / "tiny-qwen.gguf", data, "Qwen-Qwen2.5-7B-Instruct.jinja")
    chat = Chat(tmp_path, "-m", str(model), "--temp", "0", "-n", "6")
    assert "no chat template" not in chat.banner
    chat.say("Hi there")
    chat.say("How are you?")
    chat.command("/show", rf"{re.escape(str(model))}[\s\S]*4 messages")
    chat.command("/show template", r"tools")
    saved = tmp_path / "conv.json"
    chat.command(f"/save {saved}", r"saved 4 messages")
    chat.p.sendline("/exit")
    chat.p.expect(pexpect.EOF)
    conv = json.loads(saved.read_text())
    assert [m["content"] for m in conv[::2]] == ["Hi there", "How are you?"]


def test_chat_template_option_overrides_the_fallback(tmp_path, data):
    template = data / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    chat = Chat(tmp_path, "--chat-template", str(template), "--temp", "0", "-n", "4")
    assert "no chat template" not in chat.banner
    chat.command("/show template", r"\[INST\]")
    chat.say("Hello")
    chat.command("/show", re.escape(str(template)))
    assert chat.leave_with_ctrl_d() == 0


def test_overflow_drops_the_oldest_turns_and_says_so(tmp_path):
    chat = Chat(tmp_path, "-c", "96", "-n", "8", "--temp", "0", "--system", "Stories.")
    notices = 0
    for i in range(6):
        chat.p.sendline(f"Tell me story number {i}")
        if chat.p.expect([re.compile(r"context full: dropped the (\d+) oldest turn"), STATS]) == 0:
            notices += 1
            chat.p.expect(STATS)
        chat.prompt()
    assert notices > 0
    chat.command("/show", r"12 messages, [2-8] in the context window")
    too_long = "once upon a time " * 40
    chat.command(too_long, r"error: the message needs \d+ tokens[\s\S]*raise --ctx-size")
    chat.command("/show", r"12 messages")
    assert chat.leave_with_ctrl_d() == 0


def test_multi_line_block_and_paste(tmp_path):
    chat = Chat(tmp_path, "--temp", "0", "-n", "4", "--no-stats")
    chat.p.sendline('"""')
    chat.p.sendline("first line")
    chat.p.sendline("second line")
    chat.p.sendline('"""')
    chat.prompt()
    chat.p.send("\x1b[200~pasted one\npasted two\x1b[201~")
    chat.p.send("\r")
    chat.prompt()
    saved = tmp_path / "conv.json"
    chat.command(f"/save {saved}", r"saved 4 messages")
    assert chat.leave_with_ctrl_d() == 0
    conv = json.loads(saved.read_text())
    assert conv[0]["content"] == "first line\nsecond line"
    assert conv[2]["content"] == "pasted one\npasted two"
    assert "[ prompt" not in chat.p.before


runner = CliRunner()


def test_piped_input_one_message_per_line():
    args = ["chat", "--backend", "numpy", "--temp", "0", "-n", "10", "--system", "You tell stories."]
    r = runner.invoke(app, args, input="Once upon a time\n\nTell me more\n")
    assert r.exit_code == 0, r.output
    s = make_session(SAMPLE_MODEL, n_predict=10, system="You tell stories.")
    expected = [turn(s, "Once upon a time"), turn(s, "Tell me more")]
    assert r.stdout == "".join(text + "\n" for text in expected)
    assert len(STATS.findall(r.stderr)) == 2 and "no chat template" in r.stderr


def test_piped_commands_and_errors(tmp_path):
    saved = tmp_path / "conv.json"
    r = runner.invoke(app, ["chat", "--backend", "numpy", "-n", "3", "--no-stats"], input=f"Hi\n/save {saved}\n/bye\nNever sent\n")
    assert r.exit_code == 0, r.output
    assert not STATS.search(r.stderr)
    assert [m["content"] for m in json.loads(saved.read_text())][0] == "Hi"
    r = runner.invoke(app, ["chat", "--backend", "numpy", "-n", "3"], input="/set temperature -1\nHi\n")
    assert r.exit_code == 2 and "invalid" in r.stderr and r.stdout == ""


def test_system_prompt_options(tmp_path):
    f = tmp_path / "system.txt"
    f.write_text("From a file.", encoding="utf-8")
    r = runner.invoke(app, ["chat", "--system", "a", "--system-file", str(f)], input="Hi\n")
    assert r.exit_code == 2 and "not both" in r.stderr
    r = runner.invoke(app, ["chat", "--system-file", str(tmp_path / "missing.txt")], input="Hi\n")
    assert r.exit_code == 2 and "cannot read" in r.stderr
    saved = tmp_path / "conv.json"
    r = runner.invoke(app, ["chat", "--backend", "numpy", "-n", "2", "--system-file", str(f)], input=f"Hi\n/save {saved}\n")
    assert r.exit_code == 0, r.output
    assert json.loads(saved.read_text())[0] == {"role": "system", "content": "From a file."}
