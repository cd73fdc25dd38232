"""Conversation state for `k4 chat`: the messages, their rendering to token ids through the chat
template, fitting them into the context, streaming replies that reuse the KV cache, and saving
and loading conversations.

Turns and the cache: every turn renders the whole conversation in the context window with the
chat template and tokenizes it; `runtime.generate.Generator` keeps the cached prefix those ids
share with `backend.tokens`, so only what changed since the last reply (the end-of-turn markers
and the new message) is evaluated. This is the rendered-prompt diff llama.cpp's llama-cli does in
conversation mode (common_chat_format_single), done on token ids.

The context window: the prompt must leave room for the reply (`reply_reserve`: -n tokens, or a
quarter of the context when -n is -1, at most half the context). When it does not, the oldest
turns leave the window, one user message and its replies at a time; the system prompt always
stays. The dropped turns stay in `messages` (and in saved files); `start` indexes the first
message in the window. A message that does not fit even alone is refused (ContextFullError).

Replies and randomness: reply number k since the seed was set draws with seed + k, so /regen gives
a new reply and a session with the same --seed and inputs replays exactly.

Thinking (Qwen3, DeepSeek-R1 and their distills): a reply that opens with `<think>` (or whose
generation prompt ends with `<think>`, as DeepSeek-R1's template writes it) is split by ThinkSplitter
into the thinking, yielded as `Thought` pieces, and the answer, yielded as plain str. `reasoning`
picks what happens: "on" yields both; "hidden" yields the answer only (the model still thinks);
"off" renders the template with enable_thinking=False where the template has that switch (Qwen3's:
the generation prompt then holds an empty think block) and yields the answer only. In every mode
the assistant message kept in the conversation (and sent back on later turns, and saved) is the
answer alone: Qwen3's and DeepSeek-R1's templates drop the thinking of earlier turns themselves,
but other templates do not, so k4 never sends it back.

Saved conversations are a JSON list of {"role", "content"} objects (what `k4 prompt --messages`
reads): the system prompt first when there is one, then user and assistant messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Iterator, Sequence

from .backend import Backend
from .errors import ContextFullError, UsageError
from .generate import GenerationResult, Generator
from .sampling import MASK64, SamplingParams
from .trace import Counters, Trace

REASONING_MODES = ("on", "hidden", "off")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Thought(str):
    """A piece of the model's thinking (text between <think> and </think>), as ChatSession.run yields it."""


class ThinkSplitter:
    """Split streamed reply text into thinking and answer, as Qwen3 and DeepSeek-R1 write it:
    optional whitespace, `<think>`, the thinking, `</think>`, whitespace, the answer. A `<think>`
    counts only before any answer text; tags split across pieces are held back until complete.

    opened: the generation prompt already ended with `<think>` (DeepSeek-R1's template), so the
    reply starts inside the thinking. feed(text) and flush() return a list of pieces: Thought for
    thinking, str for the answer; the tags themselves and the whitespace after `<think>` and
    after `</think>` are dropped. `thinking` and `answer` accumulate everything returned.
    """

    def __init__(self, opened: bool = False):
        self.state = "opening" if opened else "start"
        self.buf = ""
        self.thinking = ""
        self.answer = ""

    def _emit(self, out: list[str], text: str, think: bool) -> None:
        if not text:
            return
        if think:
            self.thinking += text
            out.append(Thought(text))
        else:
            self.answer += text
            out.append(text)

    def feed(self, text: str) -> list[str]:
        out: list[str] = []
        self.buf += text
        while self.buf:
            if self.state == "start":
                body = self.buf.lstrip()
                if body.startswith(THINK_OPEN):
                    self.buf, self.state = body[len(THINK_OPEN):], "opening"
                elif THINK_OPEN.startswith(body):
                    break  # only whitespace or a partial "<think>" so far
                else:
                    self.state = "answer"
            elif self.state in ("opening", "after"):  # whitespace after <think> and after </think> is dropped
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = "think" if self.state == "opening" else "answer"
            elif self.state == "think":
                at = self.buf.find(THINK_CLOSE)
                if at >= 0:
                    self._emit(out, self.buf[:at], True)
                    self.buf, self.state = self.buf[at + len(THINK_CLOSE):], "after"
                    continue
                keep = next((k for k in range(min(len(THINK_CLOSE) - 1, len(self.buf)), 0, -1)
                             if THINK_CLOSE.startswith(self.buf[-k:])), 0)
                self._emit(out, self.buf[:len(self.buf) - keep], True)
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                self._emit(out, self.buf, False)
                self.buf = ""
        return out

    def flush(self) -> list[str]:
        """The text held back at the end of the reply (a partial tag is text after all)."""
        out: list[str] = []
        text, self.buf = self.buf, ""
        if self.state == "think":
            self._emit(out, text, True)
        elif self.state in ("start", "answer"):
            self._emit(out, text, False)
        return out


def split_thinking(text: str, opened: bool = False) -> tuple[str, str]:
    """(thinking, answer) of a whole reply; see ThinkSplitter."""
    splitter = ThinkSplitter(opened)
    splitter.feed(text)
    splitter.flush()
    return splitter.thinking, splitter.answer


# /set names -> (SamplingParams field, or "n_predict" for the reply length; value type)
SETTABLE: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "repeat_penalty": ("repeat_penalty", float),
    "repeat_last_n": ("repeat_last_n", int),
    "seed": ("seed", int),
    "max_tokens": ("n_predict", int),
}


@dataclass
class TurnPlan:
    """What one turn will send: made by ChatSession.plan, carried out by ChatSession.run.

    prompt_ids: the token ids of the rendered window (BOS included when the model adds one).
    messages: every message after the turn's user message is added (system excluded).
    start: index in `messages` of the first message in the window.
    dropped_turns: user messages that leave the window in this turn (0 when all fit).
    think_opened: the rendered prompt ends inside a `<think>` (the reply starts with thinking).
    """

    prompt_ids: list[int]
    messages: list[dict]
    start: int
    dropped_turns: int
    think_opened: bool = False


@dataclass
class TurnReport:
    """The last reply: its GenerationResult (stop_reason "interrupted" when the stream stopped
    early), the trace counters of this turn alone (ms, bytes, counts per phase), and whether the
    KV cache was emptied because an exception left it in an unknown state; thinking: the reply's
    thinking (kept out of the conversation)."""

    result: GenerationResult
    trace: Trace
    cache_reset: bool = False
    thinking: str = ""


def trace_since(before: dict[str, Counters], trace: Trace) -> Trace:
    """The counters `trace` gained since the snapshot `before` (phase -> Counters copy), as a Trace
    holding only the phases that changed."""
    out = Trace()
    for name, now in trace.phases.items():
        then = before.get(name, Counters())
        delta = Counters(**{f.name: getattr(now, f.name) - getattr(then, f.name) for f in fields(Counters)})
        if any(delta.as_dict().values()):
            out.phases[name] = delta
    return out


class ChatSession:
    """One conversation with one loaded model.

    backend: a runtime.backend.Backend (its KV cache is reused between turns); tokenizer:
    runtime.tokenizer.Tokenizer; template: runtime.chat_template.ChatTemplate; params: sampling
    parameters (validated); n_predict: reply length limit in tokens (-1 = until end of generation
    or a full context); system: the system prompt or None; no_bos: never add BOS; stop: strings
    that end a reply; reasoning: "on", "hidden" or "off" (see the module notes). Raises UsageError
    for another reasoning mode.
    """

    def __init__(self, backend: Backend, tokenizer, template, params: SamplingParams, n_predict: int = -1,
                 system: str | None = None, no_bos: bool = False, stop: Sequence[str] = (), reasoning: str = "on",
                 speculator=None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.template = template
        self.params = params.validate()
        self.n_predict = n_predict
        self.system = system
        self.no_bos = no_bos
        self.stop = tuple(stop)
        self.reasoning = check_reasoning(reasoning)
        self.messages: list[dict] = []  # user and assistant messages, oldest first
        self.start = 0  # index of the first message in the context window
        self.replies = 0  # replies drawn since the seed was set
        self.generator = Generator(backend, tokenizer, speculator)  # speculator: runtime.speculative, or None
        self.last: TurnReport | None = None

    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def n_used(self) -> int:
        """Tokens of the context the conversation holds now: those in the KV cache (the system
        prompt and the turns in the window, the last reply but its final token)."""
        return self.backend.n_past

    @property
    def reply_reserve(self) -> int:
        """Tokens kept free for the reply when fitting the window: -n, or n_ctx / 4 when -n is -1;
        at most n_ctx / 2."""
        want = self.n_predict if self.n_predict >= 0 else self.n_ctx // 4
        return min(want, self.n_ctx // 2)

    def conversation(self) -> list[dict]:
        """Every message, the system prompt first when set: what /save writes."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [dict(m) for m in self.messages]

    def window(self) -> list[dict]:
        """The messages the model sees: the system prompt and the messages from `start` on."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + self.messages[self.start:]

    def encode(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered with the template and an open assistant turn.

        Special-token text the template writes (e.g. "<|im_start|>") becomes those tokens. BOS is
        added when the model asks for it, unless the rendered text already starts with the BOS
        text (templates that write {{ bos_token }}) or no_bos. Raises TemplateError.
        """
        return self._encode(messages)[0]

    def _encode(self, messages: list[dict]) -> tuple[list[int], bool]:
        """encode's ids, and whether the rendered text ends inside an open `<think>`."""
        variables = {"enable_thinking": False} if self.reasoning == "off" else None
        text = self.template.render(messages, add_generation_prompt=True, variables=variables)
        tail = text.rstrip()
        opened = tail.endswith(THINK_OPEN)
        bos = self.tokenizer.bos_text
        add_bos = self.tokenizer.add_bos and not self.no_bos and not (bos and text.startswith(bos))
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=True), opened

    def plan(self, user_text: str | None) -> TurnPlan:
        """The next turn: `user_text` as a new user message, or None to answer the last user
        message again (/regen: the last reply, if any, is replaced). Nothing changes until run().

        Raises UsageError (empty message, nothing to regenerate), ContextFullError (the message
        does not fit in the context even alone), TemplateError (the template rejects the
        conversation).
        """
        messages = list(self.messages)
        if user_text is None:
            if messages and messages[-1]["role"] == "assistant":
                messages.pop()
            if not messages or messages[-1]["role"] != "user":
                raise UsageError("there is no message to answer again; send a message first")
        else:
            if not user_text.strip():
                raise UsageError("the message is empty; type some text")
            messages.append({"role": "user", "content": user_text})
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        start = min(self.start, last_user)
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        dropped = 0
        while True:
            ids, opened = self._encode(head + messages[start:])
            if len(ids) + self.reply_reserve <= self.n_ctx:
                break
            if start == last_user:
                if len(ids) < self.n_ctx:
                    break
                raise ContextFullError(
                    f"the message needs {len(ids)} tokens with the system prompt and the chat template, "
                    f"but the context holds {self.n_ctx}; shorten it or raise --ctx-size"
                )
            start += 1
            dropped += 1
            while start < last_user and messages[start]["role"] != "user":
                start += 1
        return TurnPlan(ids, messages, start, dropped, opened)

    def run(self, plan: TurnPlan) -> Iterator[str]:
        """Carry out `plan`: stream the reply's text pieces and add the reply to the conversation.

        Closing the iterator early (Ctrl-C) keeps the partial reply, marked "interrupted" in
        `last.result.stop_reason`; the backend cache then holds the prompt and the reply's
        evaluated tokens, so the next turn reuses it. Any other exception out of the backend (a
        second Ctrl-C inside a step) empties the cache, whose state is then unknown, so the next
        turn evaluates the whole window again.
        """
        self.messages, self.start = plan.messages, plan.start
        params = self.params.with_(seed=(self.params.seed + self.replies) & MASK64)
        self.replies += 1
        trace = self.backend.trace
        before = {name: replace(c) for name, c in trace.phases.items()}
        stream = self.generator.stream(plan.prompt_ids, params, self.n_predict, self.stop)
        splitter = ThinkSplitter(plan.think_opened)
        show_thoughts = self.reasoning == "on"
        finished = cache_reset = False
        try:
            for piece in stream:
                for part in splitter.feed(piece):
                    if show_thoughts or not isinstance(part, Thought):
                        yield part
            for part in splitter.flush():
                if show_thoughts or not isinstance(part, Thought):
                    yield part
            finished = True
        except GeneratorExit:
            raise
        except BaseException:
            self.backend.reset()
            cache_reset = True
            raise
        finally:
            result = self.generator.result
            if not finished:
                result.stop_reason = "interrupted"
                splitter.flush()
            self.messages.append({"role": "assistant", "content": splitter.answer})
            self.last = TurnReport(result, trace_since(before, trace), cache_reset, splitter.thinking)

    def set_param(self, name: str, value: str) -> None:
        """/set NAME VALUE for a name in SETTABLE. Raises UsageError for an unknown name, a value
        that does not parse, or one out of range (a seed must be >= 0)."""
        if name == "think":
            self.reasoning = check_reasoning(value)
            return
        if name not in SETTABLE:
            raise UsageError(f"cannot set {name!r}; settable: {', '.join(SETTABLE)}, think")
        field, kind = SETTABLE[name]
        try:
            number = kind(value)
        except ValueError:
            raise UsageError(f"{name} takes {'an integer' if kind is int else 'a number'}, not {value!r}") from None
        if field == "n_predict":
            if number < -1:
                raise UsageError(f"max_tokens {number} is invalid; use a count >= 0, or -1 for no limit")
            self.n_predict = number
            return
        if field == "seed":
            if number < 0:
                raise UsageError(f"seed {number} is invalid; use an integer >= 0")
            self.replies = 0
        self.params = self.params.with_(**{field: number})

    def settings(self) -> dict[str, object]:
        """The /set names and their current values."""
        values: dict[str, object] = {name: self.n_predict if field == "n_predict" else getattr(self.params, field)
                                     for name, (field, _) in SETTABLE.items()}
        values["think"] = self.reasoning
        return values

    def clear(self) -> None:
        """Start a new conversation; the system prompt stays (and so does its cached prefix)."""
        self.messages, self.start = [], 0

    def load(self, path: Path) -> None:
        """Replace the conversation with the messages in `path` (see load_conversation); the
        file's system message, if any, replaces the system prompt."""
        system, messages = load_conversation(path)
        if system is not None:
            self.system = system
        self.messages, self.start = messages, 0

    def save(self, path: Path, overwrite: bool = False) -> None:
        """Write the whole conversation to `path` (see save_conversation). Raises UsageError when
        the conversation is empty."""
        messages = self.conversation()
        if not messages:
            raise UsageError("the conversation is empty; there is nothing to save yet")
        save_conversation(path, messages, overwrite)


def check_reasoning(mode: str) -> str:
    """`mode` if it is one of REASONING_MODES; else UsageError."""
    if mode not in REASONING_MODES:
        raise UsageError(f"reasoning {mode!r} is unknown; use on (thinking shown dimmed), hidden (not shown) or off (ask the model not to think)")
    return mode


def save_conversation(path: Path, messages: list[dict], overwrite: bool = False) -> None:
    """Write `messages` as a JSON list of {"role", "content"}, UTF-8, indented.

    Raises UsageError when `path` exists and not overwrite, or when it cannot be written.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise UsageError(f"{path} already exists; add --force to overwrite it")
    try:
        path.write_text(json.dumps(messages, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def load_conversation(path: Path) -> tuple[str | None, list[dict]]:
    """Read a conversation: (system prompt or None, user/assistant messages).

    The file format is runtime.chat_template.load_messages's (a JSON list of {"role",
    "content"}); k4 chat also needs a system message to come first if at all, and every other
    message to be "user" or "assistant". Raises UsageError or TemplateError naming the problem.
    """
    from .chat_template import load_messages

    messages = load_messages(path)
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    for i, m in enumerate(messages, start=1 if system is not None else 0):
        if m["role"] not in ("user", "assistant"):
            raise UsageError(
                f"{path}: message {i} has role {m['role']!r}; k4 chat takes a first system message, then user and assistant messages"
            )
    return system, [{"role": m["role"], "content": m["content"]} for m in messages]
