"""What `k4 chat` reads at the terminal: the prompt_toolkit prompt (a file history, several
lines inside a \"\"\" block) and the message a typed line holds. cli/chat.py runs the loop."""

from __future__ import annotations

import os
from pathlib import Path

from .render import err

PROMPT, CONTINUATION = ">>> ", "... "
BLOCK = '"""'


def default_history() -> Path:
    """$XDG_STATE_HOME/k4/history, ~/.local/state/k4/history when XDG_STATE_HOME is unset or relative."""
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "k4" / "history"


def message_text(line: str) -> str:
    """The message typed at the prompt: a \"\"\" block loses its delimiters; outer blank space goes."""
    text = line.strip()
    if text.startswith(BLOCK):
        text = text[len(BLOCK):]
        if text.endswith(BLOCK):
            text = text[: -len(BLOCK)]
    return text.strip()


def in_open_block(text: str) -> bool:
    """Whether the prompt holds a \"\"\" block still waiting for its closing \"\"\"."""
    text = text.strip()
    return text.startswith(BLOCK) and not (len(text) >= 2 * len(BLOCK) and text.endswith(BLOCK))


def make_prompt(history: Path):
    """A prompt_toolkit PromptSession with a file history at `history` (in memory, with a warning,
    when the file cannot be created) that takes several lines inside a \"\"\" block."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.application import get_app
    from prompt_toolkit.filters import Condition
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        history.touch()
        store = FileHistory(str(history))
    except OSError as exc:
        err.print(f"warning: cannot use the history file {history} ({exc.strerror or exc}); pass --history FILE to keep one",
                  style="yellow", markup=False)
        store = InMemoryHistory()
    multiline = Condition(lambda: in_open_block(get_app().current_buffer.text))
    return PromptSession(history=store, multiline=multiline, prompt_continuation=CONTINUATION)

