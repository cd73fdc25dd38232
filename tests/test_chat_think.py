"""Thinking replies (`<think>...</think>`, Qwen3 / DeepSeek-R1): split from the answer while
streaming, shown, hidden or switched off (--reasoning, /set think), and kept out of the history.

The model is tiny and random, so its replies are scripted: Generator.stream is replaced by one
that yields fixed pieces (with the tags split across pieces) and records the prompt ids it got."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k4.cli import render
from k4.cli.app import app
from k4.cli.chat import Repl
from k4.runtime.chat import ThinkSplitter, Thought, split_thinking
from k4.runtime.chat_template import ChatTemplate
from k4.runtime.errors import UsageError
from k4.runtime.generate import GenerationResult, Generator
from tests.test_chat import make_session, write_templated_tiny

THOUGHT = "Add them.\n"
REPLY = ["<th", "ink>\nAdd", " them.\n</thi", "nk>\n", "\n4"]  # Qwen3's layout, cut mid-tag
R1_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|assistant|><think>\\n' }}{% endif %}")


@pytest.fixture
def scripted(monkeypatch):
    """Make every Generator.stream yield `pieces` (set .pieces); .prompts collects the prompt ids."""

    class Script:
        pieces: list[str] = REPLY
        prompts: list[list[int]] = []

    def stream(self, prompt_ids, params, n_predict=-1, stop=()):
        Script.prompts.append(list(prompt_ids))
        self.result = GenerationResult(text="".join(Script.pieces), prompt_tokens=len(prompt_ids),
                                       prefill_tokens=len(prompt_ids), stop_reason="eog")
        yield from Script.pieces

    Script.prompts = []
    monkeypatch.setattr(Generator, "stream", stream)
    return Script


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory, data) -> Path:
    return write_templated_tiny(tmp_path_factory.mktemp("think") / "tiny-qwen3.gguf", data, "Qwen-Qwen3-0.6B.jinja")


@pytest.fixture(scope="module")
def qwen25_model(tmp_path_factory, data) -> Path:
    return write_templated_tiny(tmp_path_factory.mktemp("think") / "tiny-qwen25.gguf", data, "Qwen-Qwen2.5-7B-Instruct.jinja")


def test_splitter_at_every_cut():
    text = "  <think>\nAdd them.\n</think>\n\n4 is <think> not a tag here"
    for a, b in itertools.combinations(range(len(text) + 1), 2):
        splitter = ThinkSplitter()
        parts = splitter.feed(text[:a]) + splitter.feed(text[a:b]) + splitter.feed(text[b:]) + splitter.flush()
        assert "".join(p for p in parts if isinstance(p, Thought)) == THOUGHT
        assert "".join(p for p in parts if not isinstance(p, Thought)) == "4 is <think> not a tag here"
        assert (splitter.thinking, splitter.answer) == (THOUGHT, "4 is <think> not a tag here")


@pytest.mark.parametrize(
    ("text", "opened", "thinking", "answer"),
    [
        ("Just text, no tags.", False, "", "Just text, no tags."),
        ("  \n leading space kept", False, "", "  \n leading space kept"),
        ("<thi", False, "", "<thi"),  # a partial tag at the end is text
        ("<think>cut off mid-thought </thi", False, "cut off mid-thought </thi", ""),
        ("Hmm.\n</think>\n\nHi", True, "Hmm.\n", "Hi"),  # DeepSeek-R1: the prompt opened the thinking
        ("<think>\n\n</think>\n\nDirect.", False, "", "Direct."),  # Qwen3 with thinking off
    ],
)
def test_split_thinking(text, opened, thinking, answer):
    assert split_thinking(text, opened) == (thinking, answer)


def test_reasoning_on_yields_thoughts_and_keeps_them_out_of_history(qwen25_model, scripted):
    s = make_session(qwen25_model, n_predict=8)
    pieces = list(s.run(s.plan("What is 2+2?")))
    assert "".join(p for p in pieces if isinstance(p, Thought)) == THOUGHT
    assert "".join(p for p in pieces if not isinstance(p, Thought)) == "4"
    assert s.messages[-1] == {"role": "assistant", "content": "4"} and s.last.thinking == THOUGHT
    assert s.last.result.text == "".join(REPLY)  # the raw reply stays in the result
    # Qwen2.5's template does not strip thinking itself: the next prompt must not hold it.
    plan = s.plan("And 3+3?")
    rendered = s.template.render(s.window() + [{"role": "user", "content": "And 3+3?"}])
    assert "Add them" not in rendered and "<think>" not in rendered
    assert plan.prompt_ids == s.encode(plan.messages)


def test_reasoning_hidden_generates_but_yields_only_the_answer(qwen3_model, scripted):
    s = make_session(qwen3_model, n_predict=8, reasoning="hidden")
    pieces = list(s.run(s.plan("What is 2+2?")))
    assert pieces == ["4"] and s.last.thinking == THOUGHT
    assert s.messages[-1]["content"] == "4"


def test_reasoning_off_sets_enable_thinking(qwen3_model, scripted):
    on = make_session(qwen3_model, n_predict=8)
    off = make_session(qwen3_model, n_predict=8, reasoning="off")
    window = [{"role": "user", "content": "Hi"}]
    text_off = off.template.render(window, variables={"enable_thinking": False})
    assert text_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plan_off, plan_on = off.plan("Hi"), on.plan("Hi")
    assert plan_off.prompt_ids == off.tokenizer.encode(text_off, add_bos=off.tokenizer.add_bos, parse_special=True)
    assert plan_on.prompt_ids != plan_off.prompt_ids and not plan_off.think_opened
    scripted.pieces = ["4"]
    assert list(off.run(plan_off)) == ["4"]
    on.set_param("think", "off")
    assert on.settings()["think"] == "off" and on.plan("Hi").prompt_ids == plan_off.prompt_ids
    with pytest.raises(UsageError, match="reasoning 'maybe' is unknown"):
        on.set_param("think", "maybe")


def test_generation_prompt_that_opens_thinking(qwen25_model, scripted):
    s = make_session(qwen25_model, n_predict=8)
    s.template = ChatTemplate(R1_TEMPLATE, "r1.jinja")
    scripted.pieces = ["Hmm.\n</th", "ink>\n\nHi"]
    plan = s.plan("Hello")
    assert plan.think_opened
    pieces = list(s.run(plan))
    assert [str(p) for p in pieces if isinstance(p, Thought)] == ["Hmm.\n"]
    assert s.messages[-1]["content"] == "Hi"


def test_interrupted_thinking_keeps_an_empty_answer(qwen25_model, scripted):
    s = make_session(qwen25_model, n_predict=8)
    stream = s.run(s.plan("What is 2+2?"))
    next(stream)
    stream.close()
    assert s.last.result.stop_reason == "interrupted"
    assert s.messages[-1] == {"role": "assistant", "content": ""}


runner = CliRunner()


def test_cli_piped_thinking_goes_to_stderr(qwen3_model, scripted):
    args = ["chat", "-m", str(qwen3_model), "--backend", "numpy", "-n", "8", "--no-stats"]
    r = runner.invoke(app, args, input="What is 2+2?\n")
    assert r.exit_code == 0, r.output
    assert r.stdout == "4\n" and "Add them." in r.stderr
    r = runner.invoke(app, [*args, "--reasoning", "hidden"], input="What is 2+2?\n")
    assert r.exit_code == 0 and r.stdout == "4\n" and "Add them" not in r.stderr
    r = runner.invoke(app, [*args], input="/set think hidden\nWhat is 2+2?\n")
    assert r.exit_code == 0 and r.stdout.endswith("4\n") and "think = hidden" in r.stdout and "Add them" not in r.stderr
    r = runner.invoke(app, [*args, "--reasoning", "sometimes"], input="Hi\n")
    assert r.exit_code == 2 and "reasoning 'sometimes' is unknown" in r.stderr


def test_cli_reasoning_off(qwen3_model, qwen25_model, scripted):
    r = runner.invoke(app, ["chat", "-m", str(qwen3_model), "--backend", "numpy", "-n", "8", "--reasoning", "off"], input="Hi\n")
    assert r.exit_code == 0 and "no switch" not in r.stderr
    # Qwen2.5's template cannot turn thinking off: k4 says so, and hides what the model writes.
    r = runner.invoke(app, ["chat", "-m", str(qwen25_model), "--backend", "numpy", "-n", "8", "--reasoning", "off"], input="Hi\n")
    assert r.exit_code == 0 and "no switch to turn thinking off" in r.stderr
    assert r.stdout == "4\n" and "Add them" not in r.stderr


def test_interactive_thinking_is_dimmed(qwen25_model, scripted, monkeypatch, capsys):
    monkeypatch.setattr(render.out, "_force_terminal", True)
    monkeypatch.setenv("TERM", "xterm")
    repl = Repl(make_session(qwen25_model, n_predict=8), None, qwen25_model, interactive=True, stats=False)
    repl.handle("What is 2+2?")
    shown = capsys.readouterr().out
    assert f"{render.DIM_ON}\nAdd{render.DIM_OFF}" not in shown  # the newline after <think> is dropped
    assert shown == f"{render.DIM_ON}Add{render.DIM_OFF}{render.DIM_ON} them.\n{render.DIM_OFF}\n4\n"
    repl.handle("/set think hidden")
    capsys.readouterr()
    repl.handle("And 3+3?")
    assert capsys.readouterr().out == "4\n"
