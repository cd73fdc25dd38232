"""`k4 chat`: a conversation in the terminal, or one message per line from a pipe.

Interactive (stdin is a terminal): prompt_toolkit line editing with a persistent history, a
`\"\"\"` block or a paste for multi-line messages, streamed replies, slash commands (/help). Ctrl-C
during a reply stops it at the next token and keeps the partial reply; a second Ctrl-C stops it at
once (when that lands inside a model step, the KV cache is emptied and the next turn evaluates the
whole conversation again). Ctrl-C at the prompt says how to leave; Ctrl-D or /bye leaves.

Piped (stdin not a terminal): each line is one user message (lines starting with / are slash
commands), replies go to stdout one per line, notices and stats to stderr; an error ends the run.

Thinking (`<think>...</think>`, split in runtime/chat.py): --reasoning on shows it dimmed (piped: on
stderr), hidden does not show it, off asks the model not to think where the template can (Qwen3's
enable_thinking) and hides what still comes; `/set think` changes it. It is never sent back.

The conversation logic lives in runtime/chat.py; this module runs the loop (a turn: plan, stream,
report) and the command; the slash commands are in cli/chat_commands.py, the terminal prompt in
cli/chat_input.py.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from k4.runtime.chat import Thought
from k4.runtime.errors import K4Error, TemplateError, UsageError
from k4.runtime.flags import Flags
from k4.runtime.sampling import SamplingParams

from . import common as c
from .chat_commands import ACTIONS, think_notice
from .chat_input import PROMPT, default_history, make_prompt, message_text
from .render import clean, dim, err, errors_to_exit, reply_stats
from .speculation import DraftMaxOpt, DraftModelOpt, LookupOpt, make_speculator, spec_text


class InterruptGuard:
    """SIGINT handling during a reply. The first Ctrl-C sets `hit`: the reply loop stops at the
    next token, between backend steps. The second raises KeyboardInterrupt at once, to cut a long
    step short, but only while the guard is armed, and only once; any later Ctrl-C is ignored.
    Repl.turn disarms the guard before it closes the reply stream, so the stream's cleanup, which
    records the partial reply, never takes an exception halfway. With enabled False (piped input)
    Ctrl-C keeps its default effect."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.hit = False
        self.armed = True

    def _handle(self, signum, frame):
        if self.hit and self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self.hit = True

    def disarm(self) -> None:
        """From now on Ctrl-C only sets `hit`."""
        self.armed = False

    def __enter__(self) -> "InterruptGuard":
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)


class Repl:
    """The chat loop over a runtime.chat.ChatSession: input, turns, rendering; slash commands go to
    cli/chat_commands.py ACTIONS."""

    def __init__(self, session, loaded: c.Session, model: Path, interactive: bool, stats: bool):
        self.session = session
        self.loaded = loaded
        self.model = model
        self.interactive = interactive
        self.stats = stats

    def handle(self, line: str) -> bool:
        """Act on one input line; False means leave. K4Errors are printed (interactive) or raised."""
        try:
            if line.startswith("/"):
                return self.command(line)
            text = message_text(line) if self.interactive else line.strip()
            if text:
                self.turn(text)
        except K4Error as exc:
            if not self.interactive:
                raise
            err.print(f"error: {clean(str(exc))}", style="red", markup=False)
        return True

    def command(self, line: str) -> bool:
        name, _, rest = line.strip().partition(" ")
        if name in ("/bye", "/exit", "/quit"):
            return False
        action = ACTIONS.get(name)
        if action is None:
            err.print(f"unknown command {name}; /help lists the commands (start a message with a space to send text beginning with /)",
                      style="yellow", markup=False)
        else:
            action(self, rest.strip())
        return True

    def turn(self, text: str | None) -> None:
        """Send `text` (None: answer the last message again), stream the reply, report."""
        s = self.session
        previous = s.last
        with InterruptGuard(self.interactive) as guard:
            plan = self.plan(text)
            if plan.dropped_turns:
                err.print(f"context full: dropped the {plan.dropped_turns} oldest turn(s) so the conversation fits in "
                          f"{s.n_ctx} tokens (the system prompt stays; /save still writes every message)", style="yellow", markup=False)
            stream = s.run(plan)
            thinking = False  # the last piece written was thinking
            try:
                for piece in stream:
                    self.write_piece(piece, thinking)
                    thinking = isinstance(piece, Thought)
                    if guard.hit:
                        break
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
            finally:
                guard.disarm()
                stream.close()
            sys.stdout.write("\n")
            sys.stdout.flush()
            if s.last is not previous:
                self.report()

    def write_piece(self, piece: str, after_thought: bool) -> None:
        """One streamed piece: the answer to stdout; thinking (a Thought) dimmed on a terminal, or
        to stderr when piped; a line break between the thinking and the answer."""
        text = clean(piece) if self.interactive else piece  # no escape sequences from a vocabulary
        if isinstance(piece, Thought):
            if not self.interactive:
                sys.stderr.write(text)
                sys.stderr.flush()
                return
            text = dim(text)
        elif after_thought and self.interactive:
            text = "\n" + text
        elif after_thought:
            sys.stderr.write("\n")
        sys.stdout.write(text)
        sys.stdout.flush()

    def plan(self, text: str | None):
        """ChatSession.plan; when the chat template fails (an error, a limit), once more with
        k4's built-in template, which stays for the rest of the session (a notice says so)."""
        s = self.session
        try:
            return s.plan(text)
        except TemplateError as exc:
            if s.template.is_fallback:
                raise
            from k4.runtime.chat_template import ChatTemplate

            err.print(f"warning: {clean(str(exc))}; k4's built-in template is used from now on", style="yellow", markup=False)
            s.template = ChatTemplate.fallback(self.loaded.tokenizer)
            return s.plan(text)

    def report(self) -> None:
        s = self.session
        result = s.last.result
        if result.stop_reason == "interrupted":
            after = ("the KV cache was emptied, so the next message evaluates the whole conversation again"
                     if s.last.cache_reset else "/regen answers again")
            err.print(f"[interrupted: the partial reply is kept in the conversation; {after}]", style="yellow", markup=False)
        elif result.stop_reason == "context":
            err.print(f"the reply filled the context of {s.n_ctx} tokens; the next message drops the oldest turns "
                      "(raise --ctx-size for more)", style="yellow", markup=False)
        if self.stats:
            spec = s.generator.speculator
            err.print(reply_stats(result, s.n_used, s.n_ctx) + (f" {spec_text(spec.stats)}" if spec else ""), style="dim",
                      markup=False)

    def run_interactive(self, history: Path) -> None:
        prompt = make_prompt(history)
        cfg = self.loaded.mf.config
        err.print(f"k4 chat: {cfg.name} on {self.loaded.backend.name}, context {self.session.n_ctx:,} tokens, "
                  f"seed {self.session.params.seed}. /help for commands, Ctrl-D or /bye to leave.", style="dim", markup=False)
        while True:
            try:
                line = prompt.prompt(PROMPT)
            except KeyboardInterrupt:
                err.print("(Ctrl-C stops a reply; to leave, type /bye or press Ctrl-D)", style="dim", markup=False)
                continue
            except EOFError:
                return
            try:
                if not self.handle(line):
                    return
            except KeyboardInterrupt:  # a second Ctrl-C that came after the reply had stopped
                err.print("(interrupted)", style="dim", markup=False)

    def run_piped(self) -> None:
        if self.stats:
            err.print(f"seed {self.session.params.seed}", style="dim", markup=False)
        if sys.stdin is None or sys.stdin.closed:
            return
        while True:
            raw = sys.stdin.buffer.readline(c.MAX_TEXT_BYTES + 1)
            if not raw:
                return
            if len(raw) > c.MAX_TEXT_BYTES:
                raise UsageError(f"an input line holds more than {c.MAX_TEXT_BYTES // 2**20} MiB; k4 chat reads messages of at most that size")
            if not self.handle(raw.decode("utf-8", "replace").rstrip("\r\n")):
                return


def system_prompt(text: Optional[str], file: Optional[Path]) -> Optional[str]:
    """--system TEXT or --system-file F (not both). Raises UsageError."""
    if text is not None and file is not None:
        raise UsageError("give the system prompt with --system or --system-file, not both")
    return c.read_text(None, file, "system prompt") if file is not None else c.read_text(text, None) if text is not None else None


@errors_to_exit
def chat(
    model: c.ModelOpt = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt.", show_default=False)] = None,
    system_file: Annotated[Optional[Path], typer.Option("--system-file", help="Read the system prompt from this file.", show_default=False)] = None,
    chat_template: Annotated[Optional[Path], typer.Option("--chat-template", help="Jinja chat template file to use instead of the model's.", show_default=False)] = None,
    history: Annotated[Optional[Path], typer.Option("--history", help="Input history file (default: $XDG_STATE_HOME/k4/history or ~/.local/state/k4/history).", show_default=False)] = None,
    no_stats: Annotated[bool, typer.Option("--no-stats", help="Do not print the token counts and rates after each reply.")] = False,
    n_predict: c.NPredictOpt = -1,
    ctx_size: c.GenCtxOpt = None,
    temp: c.TempOpt = 0.8,
    top_k: c.TopKOpt = 40,
    top_p: c.TopPOpt = 0.95,
    min_p: c.MinPOpt = 0.05,
    repeat_penalty: c.RepeatPenaltyOpt = 1.0,
    repeat_last_n: c.RepeatLastNOpt = 64,
    seed: c.SeedOpt = -1,
    no_bos: c.NoBosOpt = False,
    stop: Annotated[Optional[List[str]], typer.Option("--stop", help="End a reply when this text appears (repeatable).")] = None,
    reasoning: Annotated[str, typer.Option("--reasoning", help="<think> output: on (shown dimmed), hidden (generated, not shown), off (ask the model not to think where its template can).")] = "on",
    backend: c.BackendOpt = "auto",
    cache_type_k: c.CacheTypeKOpt = "f16",
    cache_type_v: c.CacheTypeVOpt = "f16",
    draft_model: DraftModelOpt = None,
    lookup: LookupOpt = 0,
    draft_max: DraftMaxOpt = 7,
) -> None:
    """Chat with a GGUF model: line editing, history, slash commands (/help); or one message per line from a pipe."""
    from k4.runtime.chat import ChatSession, check_reasoning
    from k4.runtime.chat_template import ChatTemplate

    flags = Flags()
    for warning in flags.warnings():
        err.print(f"warning: {warning}", style="yellow", markup=False)
    params = SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, c.resolve_seed(seed)).validate()
    c.check_n_predict(n_predict)
    check_reasoning(reasoning)
    system_text = system_prompt(system, system_file)
    path = c.model_path(model)
    loaded = c.load_session(path, backend, ctx_size, flags, c.kv_types(cache_type_k, cache_type_v))
    if chat_template is not None:
        template = ChatTemplate.from_file(chat_template, loaded.tokenizer)
    else:
        try:
            template = ChatTemplate.from_model(loaded.mf, loaded.tokenizer)
        except TemplateError as exc:
            err.print(f"warning: {clean(str(exc))}; using k4's built-in template instead", style="yellow", markup=False)
            template = ChatTemplate.fallback(loaded.tokenizer)
    if template.is_fallback and chat_template is None and not loaded.mf.meta("tokenizer.chat_template"):
        err.print(f"warning: the model has no chat template; using k4's fallback ({template.origin}); pass "
                  "--chat-template FILE for the model's own", style="yellow", markup=False)
    spec = make_speculator(loaded, draft_model, lookup, draft_max, flags)
    session = ChatSession(loaded.backend, loaded.tokenizer, template, params, n_predict, system_text, no_bos, stop or (), reasoning,
                          spec)
    interactive = sys.stdin is not None and not sys.stdin.closed and sys.stdin.isatty()
    repl = Repl(session, loaded, path, interactive=interactive, stats=not no_stats)
    think_notice(session)
    if repl.interactive:
        repl.run_interactive(history if history is not None else default_history())
    else:
        repl.run_piped()


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
