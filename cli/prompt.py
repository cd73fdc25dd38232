"""`k4 prompt`: the exact text a chat template makes of a list of messages."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import common as c
from .render import err, errors_to_exit


@errors_to_exit
def prompt(
    messages: Annotated[Path, typer.Option("--messages", help="JSON file: a list of {\"role\", \"content\"} objects.")],
    model: c.ModelOpt = None,
    chat_template: Annotated[Optional[Path], typer.Option("--chat-template", help="Jinja chat template file to use instead of the model's.",
                                                          show_default=False)] = None,
    template: Annotated[Optional[Path], typer.Option("--template", hidden=True, help="Old spelling of --chat-template.")] = None,
    no_generation_prompt: Annotated[bool, typer.Option("--no-generation-prompt", help="Do not open an assistant turn at the end.")] = False,
) -> None:
    """Print the text the chat template produces for MESSAGES, so template problems can be seen."""
    import sys

    from k4.runtime.chat_template import ChatTemplate, load_messages
    from k4.runtime.errors import UsageError
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer

    if chat_template is not None and template is not None:
        raise UsageError("give the chat template once, with --chat-template")
    template = chat_template if chat_template is not None else template
    msgs = load_messages(messages)
    mf = open_model(c.model_path(model), require_weights=False)
    tok = Tokenizer.from_model(mf)
    tmpl = ChatTemplate.from_file(template, tok) if template is not None else ChatTemplate.from_model(mf, tok)
    if tmpl.is_fallback:
        err.print("warning: the model has no chat template; using k4's fallback (see README)", style="yellow")
    sys.stdout.write(tmpl.render(msgs, add_generation_prompt=not no_generation_prompt))


def register(app: typer.Typer) -> None:
    app.command("prompt")(prompt)
