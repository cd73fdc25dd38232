"""runtime/chat.py: conversation state, KV-cache reuse between turns, interrupts, context
overflow, /set, save/load. On the bundled sample (no template: ChatML fallback) and on a tiny
random model carrying a real template from tests/data/templates."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from k4.cli.common import SAMPLE_MODEL
from k4.runtime.backend import make_backend
from k4.runtime.chat import ChatSession, load_conversation, save_conversation
from k4.runtime.chat_template import ChatTemplate
from k4.runtime.errors import ContextFullError, UsageError
from k4.runtime.generate import common_prefix
from k4.runtime.model import open_model
from k4.runtime.sampling import SamplingParams
from k4.runtime.tokenizer import Tokenizer
from tests.tiny import tiny_config, write_tiny

GREEDY = SamplingParams(temperature=0.0)


def write_templated_tiny(path: Path, data: Path, template_name: str) -> Path:
    """A tiny random llama model (stories260K vocabulary) whose GGUF carries
    `tokenizer.chat_template` = tests/data/templates/<template_name>."""
    plain = write_tiny(path.with_suffix(".plain.gguf"), data / "models" / "stories260K.gguf", tiny_config(n_ctx_train=512))
    source = (data / "templates" / template_name).read_text(encoding="utf-8")
    writer = gguf.GGUFWriter(str(path), "llama")
    copy_with_new_metadata(gguf.GGUFReader(str(plain)), writer,
                           {"tokenizer.chat_template": MetadataDetails(gguf.GGUFValueType.STRING, source)}, [])
    return path


def make_session(model: Path, n_ctx: int = 512, backend: str = "numpy", params: SamplingParams = GREEDY, **kw) -> ChatSession:
    mf = open_model(model)
    tok = Tokenizer.from_model(mf)
    return ChatSession(make_backend(mf, backend, n_ctx), tok, ChatTemplate.from_model(mf, tok), params, **kw)


def turn(session: ChatSession, text: str | None) -> str:
    return "".join(session.run(session.plan(text)))


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory, data) -> Path:
    return write_templated_tiny(tmp_path_factory.mktemp("chat") / "tiny-qwen.gguf", data, "Qwen-Qwen2.5-7B-Instruct.jinja")


def test_second_turn_prefills_only_the_new_tokens():
    s = make_session(SAMPLE_MODEL, n_predict=24, system="You tell stories.")
    plan1 = s.plan("Once upon a time")
    "".join(s.run(plan1))
    r1 = s.last.result
    assert r1.prefill_tokens == r1.prompt_tokens == len(plan1.prompt_ids)
    assert r1.stop_reason == "length" and len(r1.token_ids) == 24
    # the cache holds the prompt and the reply but its last token, which was sampled, never evaluated
    cached = plan1.prompt_ids + r1.token_ids[:-1]
    assert s.backend.tokens == cached
    plan2 = s.plan("Tell me more")
    assert plan2.prompt_ids[: len(cached)] == cached
    "".join(s.run(plan2))
    r2 = s.last.result
    new_tokens = len(plan2.prompt_ids) - len(cached)
    assert r2.prefill_tokens == new_tokens
    assert 0 < new_tokens < len(cached)
    assert [m["role"] for m in s.conversation()] == ["system", "user", "assistant", "user", "assistant"]
    assert s.messages[1]["content"] == r1.text and s.messages[3]["content"] == r2.text


def test_real_template_multi_turn_on_a_synthetic_model(qwen_model):
    s = make_session(qwen_model, n_predict=6, system="Be brief.")
    assert not s.template.is_fallback
    texts = [turn(s, "Hi there")]
    plan2 = s.plan("And you?")
    texts.append("".join(s.run(plan2)))
    cached = list(s.backend.tokens)
    plan = s.plan("Bye")
    texts.append("".join(s.run(plan)))
    assert [m["content"] for m in s.messages[1::2]] == texts
    rendered = s.template.render(s.window()[:-1])
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n")
    assert rendered.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    r = s.last.result
    # the cache is reused up to where the re-tokenized random reply differs from the sampled ids
    reused = common_prefix(plan.prompt_ids, cached)
    assert r.prefill_tokens == len(plan.prompt_ids) - reused and reused >= len(plan2.prompt_ids)
    assert "load" not in s.last.trace.phases and s.last.trace.get("prefill").steps == 1


def test_bos_not_doubled_when_the_template_writes_it(tmp_path, data):
    model = write_templated_tiny(tmp_path / "tiny-llama3.gguf", data, "meta-llama-Llama-3.1-8B-Instruct.jinja")
    s = make_session(model, n_predict=2)
    ids = s.plan("Hello").prompt_ids
    assert s.template.render([{"role": "user", "content": "Hello"}]).startswith(s.tokenizer.bos_text)
    assert ids[0] == s.tokenizer.bos_id and ids[1] != s.tokenizer.bos_id
    fallback = make_session(SAMPLE_MODEL, n_predict=2)
    assert fallback.plan("Hello").prompt_ids[0] == fallback.tokenizer.bos_id
    assert make_session(SAMPLE_MODEL, no_bos=True).plan("Hello").prompt_ids[0] != fallback.tokenizer.bos_id


def fresh_reply(model: Path, conversation: list[dict], n_predict: int, n_ctx: int, backend: str = "numpy"):
    """The greedy reply a new session gives to `conversation` (ending with a user message)."""
    s = make_session(model, n_ctx=n_ctx, backend=backend, n_predict=n_predict)
    if conversation[0]["role"] == "system":
        s.system, conversation = conversation[0]["content"], conversation[1:]
    s.messages = [dict(m) for m in conversation]
    turn(s, None)
    return s.last.result


@pytest.mark.parametrize("backend", ["numpy", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_interrupted_reply_is_kept_and_the_next_turn_is_correct(backend):
    s = make_session(SAMPLE_MODEL, n_ctx=512, backend=backend, n_predict=-1, system="You tell stories.")
    plan = s.plan("Once upon a time")
    stream = s.run(plan)
    partial = "".join(next(stream) for _ in range(5))
    stream.close()
    r1 = s.last.result
    assert r1.stop_reason == "interrupted" and r1.text == partial
    assert s.messages[-1] == {"role": "assistant", "content": partial}
    assert not s.last.cache_reset and s.backend.tokens == plan.prompt_ids + r1.token_ids[:-1]
    s.n_predict = 12
    turn(s, "Tell me more")
    r2 = s.last.result
    assert r2.prefill_tokens < len(plan.prompt_ids)
    expected = fresh_reply(SAMPLE_MODEL, s.conversation()[:-1], 12, 512, backend)
    assert r2.token_ids == expected.token_ids and r2.text == expected.text


def test_exception_inside_a_step_empties_the_cache(monkeypatch):
    s = make_session(SAMPLE_MODEL, n_predict=-1)
    real_eval = type(s.backend).eval
    calls = {"n": 0}

    def eval_then_interrupt(self, token_ids, all_logits=False):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real_eval(self, token_ids, all_logits)

    monkeypatch.setattr(type(s.backend), "eval", eval_then_interrupt)
    pieces = []
    with pytest.raises(KeyboardInterrupt):
        for piece in s.run(s.plan("Once upon a time")):
            pieces.append(piece)
    monkeypatch.undo()
    assert s.last.cache_reset and s.backend.n_past == 0
    assert s.last.result.stop_reason == "interrupted" and s.messages[-1]["content"] == "".join(pieces)
    s.n_predict = 8
    turn(s, "Tell me more")
    r = s.last.result
    assert r.prefill_tokens == r.prompt_tokens
    assert r.token_ids == fresh_reply(SAMPLE_MODEL, s.conversation()[:-1], 8, 512).token_ids


def test_overflow_drops_oldest_turns_and_keeps_the_system_prompt():
    s = make_session(SAMPLE_MODEL, n_ctx=96, n_predict=8, system="Stories.")
    dropped = 0
    for i in range(6):
        plan = s.plan(f"Tell me story number {i}")
        assert len(plan.prompt_ids) + s.reply_reserve <= s.n_ctx
        dropped += plan.dropped_turns
        "".join(s.run(plan))
        window = s.window()
        assert window[0] == {"role": "system", "content": "Stories."} and window[1]["role"] == "user"
    assert dropped > 0 and s.start > 0
    assert len(s.conversation()) == 1 + 2 * 6  # /save keeps every message
    assert s.window()[-2]["content"] == "Tell me story number 5"


def test_reply_reserve_is_n_predict_or_a_quarter_and_at_most_half():
    assert make_session(SAMPLE_MODEL, n_ctx=96, n_predict=8).reply_reserve == 8
    assert make_session(SAMPLE_MODEL, n_ctx=96).reply_reserve == 24  # -n -1: a quarter of the context
    assert make_session(SAMPLE_MODEL, n_ctx=96, n_predict=500).reply_reserve == 48


def test_the_window_keeps_every_turn_that_fits_and_starts_at_a_user_message():
    """The fit is exact: a window that leaves exactly the reply's reserve keeps every turn; one
    token less drops the oldest turn whole, its user message and its reply (dropping the long
    user message alone would fit, but a window must not open with a reply)."""
    history = [{"role": "user", "content": "Tell me a long story about a girl, a dog, a cat and a big red ball in the park."},
               {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Ok."}]
    probe = make_session(SAMPLE_MODEL, n_predict=8, system="Stories.")
    need = len(probe.encode(probe.window() + history + [{"role": "user", "content": "More"}])) + 8
    for n_ctx, dropped, first in ((need, 0, "Tell me"), (need - 1, 1, "Go on.")):
        s = make_session(SAMPLE_MODEL, n_ctx=n_ctx, n_predict=8, system="Stories.")
        s.messages = [dict(m) for m in history]
        plan = s.plan("More")
        assert plan.dropped_turns == dropped and plan.messages[plan.start]["content"].startswith(first)
        assert len(plan.prompt_ids) + 8 <= n_ctx


def test_a_message_larger_than_the_context_is_refused():
    s = make_session(SAMPLE_MODEL, n_ctx=64, n_predict=8)
    turn(s, "Hi")
    before = s.conversation()
    with pytest.raises(ContextFullError, match="shorten it or raise --ctx-size"):
        s.plan("once upon a time " * 40)
    assert s.conversation() == before


def test_regen_replaces_the_last_reply_with_a_new_draw():
    s = make_session(SAMPLE_MODEL, params=SamplingParams(temperature=1.0, seed=7), n_predict=16)
    with pytest.raises(UsageError, match="send a message first"):
        s.plan(None)
    first = turn(s, "Once upon a time")
    second = turn(s, None)
    assert len(s.messages) == 2 and s.messages[1]["content"] == second
    assert second != first  # reply k draws with seed + k
    replay = make_session(SAMPLE_MODEL, params=SamplingParams(temperature=1.0, seed=7), n_predict=16)
    assert turn(replay, "Once upon a time") == first


def test_empty_message_is_refused():
    s = make_session(SAMPLE_MODEL)
    with pytest.raises(UsageError, match="empty"):
        s.plan("   ")


def test_set_param():
    s = make_session(SAMPLE_MODEL)
    s.set_param("temperature", "0.5")
    s.set_param("top_k", "7")
    s.set_param("max_tokens", "33")
    s.set_param("seed", "9")
    settings = s.settings()
    assert settings["temperature"] == 0.5 and settings["top_k"] == 7 and settings["max_tokens"] == 33 and settings["seed"] == 9
    for name, value, message in [
        ("temperature", "-1", "invalid"),
        ("top_k", "1.5", "integer"),
        ("top_p", "abc", "number"),
        ("max_tokens", "-2", "invalid"),
        ("seed", "-5", "invalid"),
        ("colour", "red", "settable"),
    ]:
        with pytest.raises(UsageError, match=message):
            s.set_param(name, value)
    assert s.settings() == settings
    s.set_param("max_tokens", "-1")  # no limit
    s.set_param("seed", "0")
    assert s.settings()["max_tokens"] == -1 and s.settings()["seed"] == 0
    s.set_param("max_tokens", "0")
    assert s.settings()["max_tokens"] == 0


def test_set_seed_starts_the_draws_over():
    """/set seed S after some replies: the next reply is drawn as a new session's first with S."""
    fresh = make_session(SAMPLE_MODEL, params=SamplingParams(temperature=1.0, seed=7), n_predict=16)
    want = turn(fresh, "Once upon a time")
    s = make_session(SAMPLE_MODEL, params=SamplingParams(temperature=1.0, seed=3), n_predict=16)
    turn(s, "Once upon a time")
    s.set_param("seed", "7")
    assert turn(s, None) == want  # the regenerated reply: the same window as fresh's first


def test_save_and_load_round_trip(tmp_path):
    s = make_session(SAMPLE_MODEL, n_predict=8, system="Be kind.")
    turn(s, "Hello")
    turn(s, "Ünïcode ✓ and \"quotes\"")
    path = tmp_path / "conv.json"
    s.save(path)
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert saved == s.conversation() and [m["role"] for m in saved] == ["system", "user", "assistant", "user", "assistant"]
    with pytest.raises(UsageError, match="already exists; add --force"):
        s.save(path)
    other = make_session(SAMPLE_MODEL, system="Something else.")
    other.load(path)
    assert other.conversation() == saved and other.start == 0
    s.clear()
    turn(s, "New")
    s.save(path, overwrite=True)
    assert json.loads(path.read_text())[1]["content"] == "New"


def test_clear_keeps_the_system_prompt():
    s = make_session(SAMPLE_MODEL, n_predict=4, system="Sys.")
    turn(s, "Hello")
    s.clear()
    assert s.conversation() == [{"role": "system", "content": "Sys."}]
    with pytest.raises(UsageError, match="nothing to save"):
        make_session(SAMPLE_MODEL).save(Path("unused.json"))


def test_load_without_system_keeps_the_current_one(tmp_path):
    path = tmp_path / "c.json"
    save_conversation(path, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    s = make_session(SAMPLE_MODEL, system="Mine.")
    s.load(path)
    assert s.conversation()[0] == {"role": "system", "content": "Mine."} and len(s.messages) == 2


@pytest.mark.parametrize("content, message", [
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "message 1 has role 'system'"),
    ([{"role": "tool", "content": "x"}], "message 0 has role 'tool'"),
    ([{"role": "system", "content": "s"}, {"role": "function", "content": "x"}], "message 1 has role 'function'"),
    ({"role": "user"}, "non-empty JSON list"),
    ([{"role": "user", "content": 3}], "string"),
])
def test_load_refuses_malformed_conversations(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(UsageError, match=message):
        load_conversation(path)


def test_load_refuses_a_missing_or_non_json_file(tmp_path):
    with pytest.raises(UsageError, match="cannot read"):
        load_conversation(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("[{")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_conversation(tmp_path / "x.json")


def test_save_into_a_missing_directory_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot write"):
        save_conversation(tmp_path / "no" / "such" / "dir.json", [{"role": "user", "content": "a"}])

