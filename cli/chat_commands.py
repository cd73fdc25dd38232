"""The slash commands of `k4 chat` (/help, /system, /set, /show, /clear, /regen, /save, /load,
/stats). Each is a function of the chat loop (cli/chat.py's Repl: its ChatSession `session`, the
loaded model `loaded`, the model path `model`, and `turn`) and of the text after the command's
name; it reads or changes the runtime.chat.ChatSession and prints through cli/render.py. A user
error raises UsageError (or the session's K4Error), which the loop prints (interactive) or lets
end the run (piped)."""

from __future__ import annotations

import shlex
from pathlib import Path

from k4.runtime.errors import UsageError

from . import common as c
from .chat_input import BLOCK
from .render import clean, err, out, rate_text, table, trace_table

COMMANDS = (
    ("/help", "this list"),
    ("/system [TEXT]", "set the system prompt (no TEXT: show it); applies from the next message"),
    ("/set [PARAM VALUE]", "set temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed (-1 = random), max_tokens (-1 = no limit) or think (on: thinking shown dimmed, hidden, off: ask the model not to think); no PARAM: show them"),
    ("/show [template]", "model, backend, context use, parameters and chat template (template: its source)"),
    ("/clear", "start a new conversation (the system prompt stays)"),
    ("/regen", "answer the last message again, replacing the last reply"),
    ("/save FILE [--force]", "write the conversation as JSON messages (--force overwrites FILE)"),
    ("/load FILE", "continue the conversation saved in FILE"),
    ("/stats", "the last reply's timing and per-phase copy-traffic table"),
    ("/bye, /exit, /quit", "leave (or press Ctrl-D)"),
)


def split_args(args: str, usage: str) -> list[str]:
    """A slash command's arguments split as a shell would (quotes group words). Raises
    UsageError for an unclosed quote or a trailing backslash."""
    try:
        return shlex.split(args)
    except ValueError as exc:
        raise UsageError(f"cannot read the arguments ({exc}); use {usage}, quoting a name with spaces") from None


def show_help(repl, _: str) -> None:
    out.print(table("k4 chat commands", ["command", "what it does"], COMMANDS))
    out.print(f"Messages: one line, or a block between {BLOCK} lines, or a paste. Ctrl-C stops a reply (the part "
              "written is kept). Ctrl-D leaves.", markup=False)


def system(repl, text: str) -> None:
    if not text:
        out.print(clean(f"system prompt: {repl.session.system!r}") if repl.session.system is not None else "no system prompt",
                  markup=False)
        return
    repl.session.system = text
    out.print("system prompt set; it applies from the next message", markup=False)


def set_param(repl, args: str) -> None:
    parts = args.split()
    if not parts:
        out.print(table("parameters", ["name", "value"], repl.session.settings().items()))
        return
    if len(parts) != 2:
        raise UsageError("use /set PARAM VALUE, e.g. /set temperature 0.7 (/set alone lists them)")
    name, value = parts
    if name == "seed" and value.lstrip("-").isdigit() and int(value) < 0:
        value = str(c.resolve_seed(int(value)))
    repl.session.set_param(name, value)
    out.print(f"{name} = {repl.session.settings()[name]}", markup=False)
    if name == "think":
        think_notice(repl.session)


def think_notice(session) -> None:
    """Say so when thinking is off but the session's template has no switch to turn it off."""
    if session.reasoning == "off" and not session.template.has_thinking_switch:
        err.print("this chat template has no switch to turn thinking off; any thinking the model writes is hidden",
                  style="dim", markup=False)


def show(repl, what: str) -> None:
    s, cfg = repl.session, repl.loaded.mf.config
    if what == "template":
        out.print(clean(f"chat template ({s.template.origin}):"), markup=False)
        out.print(clean(s.template.source), markup=False)
        return
    if what:
        raise UsageError(f"/show {what} is unknown; use /show or /show template")
    in_window = len(s.messages) - s.start
    rows = [
        ("model", f"{repl.model} ({cfg.name}, {cfg.arch})"),
        ("backend", repl.loaded.backend.name),
        ("context", f"{s.backend.n_past:,} of {s.n_ctx:,} tokens cached; reply reserve {s.reply_reserve:,}"),
        ("conversation", f"{len(s.messages)} messages, {in_window} in the context window"),
        ("system prompt", repr(s.system) if s.system is not None else "none"),
        ("chat template", s.template.origin + (" (k4's fallback: the model has none)" if s.template.is_fallback else "")),
    ]
    rows += [(name, str(value)) for name, value in s.settings().items()]
    shown = table(None, ["", ""], rows)
    shown.show_header = False
    out.print(shown)


def clear(repl, _: str) -> None:
    repl.session.clear()
    out.print("new conversation (the system prompt stays)", markup=False)


def regen(repl, _: str) -> None:
    repl.turn(None)


def save(repl, args: str) -> None:
    words = split_args(args, "/save FILE [--force]")
    force = "--force" in words
    paths = [w for w in words if w != "--force"]
    if len(paths) != 1:
        raise UsageError("use /save FILE (add --force to overwrite an existing FILE)")
    repl.session.save(Path(paths[0]), overwrite=force)
    out.print(f"saved {len(repl.session.conversation())} messages to {paths[0]}", markup=False)


def load(repl, args: str) -> None:
    words = split_args(args, "/load FILE")
    if len(words) != 1:
        raise UsageError("use /load FILE")
    repl.session.load(Path(words[0]))
    n = len(repl.session.messages)
    out.print(f"loaded {n} messages from {words[0]}; your next message continues the conversation", markup=False)


def last_stats(repl, _: str) -> None:
    last = repl.session.last
    if last is None:
        out.print("no reply yet", markup=False)
        return
    r = last.result
    rows = [
        ("prompt", f"{r.prompt_tokens:,} tok", f"{r.prompt_tokens - r.prefill_tokens:,} from the cache, {r.prefill_tokens:,} evaluated",
         f"{r.prompt_ms:,.1f} ms", f"{rate_text(r.prompt_tps)} t/s"),
        ("reply", f"{len(r.token_ids):,} tok", f"stop: {r.stop_reason}", f"{r.gen_ms:,.1f} ms", f"{rate_text(r.gen_tps)} t/s"),
    ]
    out.print(table("last reply", ["phase", "tokens", "", "time", "rate"], rows, right=(1, 3, 4)))
    out.print(trace_table(last.trace, "per-phase counters (last reply)"))


# name -> the function that runs it (/bye, /exit and /quit end the loop instead)
ACTIONS = {
    "/help": show_help, "/system": system, "/set": set_param, "/show": show, "/clear": clear, "/regen": regen,
    "/save": save, "/load": load, "/stats": last_stats,
}
