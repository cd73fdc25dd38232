"""Chat templates: a conversation -> the prompt text a chat model was trained on.

A GGUF carries its model's Jinja template under `tokenizer.chat_template`. It is rendered the way
Hugging Face transformers renders it (`apply_chat_template`, chat_template_utils.py): a Jinja2
`ImmutableSandboxedEnvironment` with trim_blocks, lstrip_blocks and the loopcontrols extension;
`raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter that keeps non-ASCII text and
takes json.dumps's indent/separators/sort_keys; variables `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `tools` and `documents` (both None). The sandbox refuses access to
Python internals (`__class__`, `__globals__`, ...) and mutation of the arguments.

Templates are bounded as well as sandboxed (runtime/template_limits.py): the output, every string
or list an operator or a call makes, and integer arguments are limited to MAX_OUTPUT characters,
powers to MAX_INT_BITS, the render to RENDER_SECONDS of wall time; a template that breaks a limit,
recurses too deep or fails to compile raises TemplateError.

A model without a template gets FALLBACK_TEMPLATE, ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`
per message, then `<|im_start|>assistant\\n`), the format llama.cpp also falls back to; such a
ChatTemplate has `is_fallback = True` so the CLI can say so.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext

from .errors import TemplateError, UsageError
from .template_limits import BoundedEnvironment, LimitExceeded, compile_limited, render_limited

if TYPE_CHECKING:
    from .model import ModelFile
    from .tokenizer import Tokenizer

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

FALLBACK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> BoundedEnvironment:
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.bound_filters()
    return env


class ChatTemplate:
    """A compiled chat template.

    source: the Jinja text; origin: where it came from (for messages); is_fallback: True when the
    model had no template and FALLBACK_TEMPLATE stands in. Construction raises TemplateError when
    the template does not parse.
    """

    def __init__(self, source: str, origin: str, bos_token: str = "", eos_token: str = "", is_fallback: bool = False):
        self.source = source
        self.origin = origin
        self.is_fallback = is_fallback
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = compile_limited(_environment(), source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{origin}: chat template syntax error at line {exc.lineno}: {_one_line(exc.message or '')}") from None
        except LimitExceeded as exc:
            raise TemplateError(f"{origin}: chat template stopped while compiling: {exc}") from None
        except Exception as exc:  # e.g. RecursionError or SyntaxError: nesting deeper than Python compiles
            raise TemplateError(f"{origin}: chat template cannot be compiled ({type(exc).__name__}: {_one_line(exc)[:80]})") from None

    @classmethod
    def from_model(cls, mf: "ModelFile", tokenizer: "Tokenizer") -> "ChatTemplate":
        """The template in the GGUF's `tokenizer.chat_template`, or FALLBACK_TEMPLATE
        (is_fallback True) when the key is absent or empty. bos_token/eos_token are the
        tokenizer's bos_text/eos_text. Raises TemplateError if the template does not parse."""
        source = mf.meta(CHAT_TEMPLATE_KEY)
        if not source:
            return cls.fallback(tokenizer)
        return cls(str(source), f"{mf.path}", tokenizer.bos_text, tokenizer.eos_text)

    @classmethod
    def fallback(cls, tokenizer: "Tokenizer") -> "ChatTemplate":
        """FALLBACK_TEMPLATE (is_fallback True), with the tokenizer's bos/eos texts."""
        return cls(FALLBACK_TEMPLATE, "built-in ChatML", tokenizer.bos_text, tokenizer.eos_text, is_fallback=True)

    @classmethod
    def from_file(cls, path: str | os.PathLike, tokenizer: "Tokenizer") -> "ChatTemplate":
        """A template read from a text file (UTF-8), e.g. a .jinja from a model's repository.
        Raises TemplateError if the file cannot be read or the template does not parse."""
        try:
            with open(path, "rb") as fh:
                source = fh.read(MAX_MESSAGES_BYTES + 1).decode("utf-8")
            if len(source) > MAX_MESSAGES_BYTES:
                raise TemplateError(f"{path}: the chat template is over {MAX_MESSAGES_BYTES // 2**20} MiB; pass the model's .jinja file")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise TemplateError(f"{path}: cannot read the chat template ({reason}); pass a readable .jinja file") from None
        return cls(source, str(path), tokenizer.bos_text, tokenizer.eos_text)

    @property
    def has_thinking_switch(self) -> bool:
        """True when the template reads `enable_thinking` (Qwen3's switch: false makes the
        generation prompt an empty `<think>\\n\\n</think>\\n\\n`, so the model answers at once)."""
        return "enable_thinking" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, now: datetime | None = None,
               variables: dict[str, Any] | None = None) -> str:
        """The prompt text for `messages` (dicts with "role" and "content"; what else a template
        reads, such as "tool_calls", is passed through). add_generation_prompt appends the
        header that opens the assistant's turn, where the template has one. now: the time
        `strftime_now` reports (default: the local time at the call), for reproducible output.
        variables: extra template variables, as transformers' apply_chat_template passes its
        **kwargs (e.g. {"enable_thinking": False}); they cannot replace the ones above.

        Raises TemplateError with the template's own message when it calls raise_exception,
        breaks a sandbox rule or fails on the messages.
        """
        clock = now or datetime.now()
        extra = {k: v for k, v in (variables or {}).items() if k not in _RESERVED}
        try:
            return render_limited(
                self._template,
                **extra,
                input_chars=sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=None,
                documents=None,
                strftime_now=clock.strftime,
            )
        except LimitExceeded as exc:
            raise TemplateError(f"{self.origin}: chat template stopped: {exc}") from None
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"{self.origin}: chat template error: {_one_line(exc.message or type(exc).__name__)}") from None
        except Exception as exc:  # the template's own code failed (e.g. `None + str` on a message)
            raise TemplateError(f"{self.origin}: chat template failed ({type(exc).__name__}: {_one_line(exc)[:200]})") from None


MAX_MESSAGES_BYTES = 64 * 2**20  # the largest messages file read
_RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents", "strftime_now", "input_chars"})


def load_messages(path: str | os.PathLike) -> list[dict]:
    """Read a conversation from a JSON file of at most MAX_MESSAGES_BYTES: a non-empty list of
    objects, each with string "role" and "content" (other keys are kept for templates that read
    them).

    Raises UsageError naming the file and the first problem (unreadable, not JSON, wrong shape).
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_MESSAGES_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the messages file ({exc.strerror}); pass an existing JSON file") from None
    if len(raw) > MAX_MESSAGES_BYTES:
        raise UsageError(f"{path}: the messages file is over {MAX_MESSAGES_BYTES // 2**20} MiB; k4 reads at most that much")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, or a number over int's 4,300 digits
        raise UsageError(f"{path}: not valid JSON ({_one_line(exc)[:120]}); write a JSON list of {{\"role\", \"content\"}} objects") from None
    except RecursionError:
        raise UsageError(f"{path}: JSON nested too deep; write a flat JSON list of {{\"role\", \"content\"}} objects") from None
    if not isinstance(data, list) or not data:
        raise UsageError(f"{path}: expected a non-empty JSON list of {{\"role\", \"content\"}} objects")
    for i, message in enumerate(data):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise UsageError(f"{path}: message {i} is not an object with string \"role\" and \"content\"; fix the file")
    return data
