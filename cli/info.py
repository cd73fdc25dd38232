"""`k4 info`: what a GGUF model file is (architecture, sizes, types, template)."""

from __future__ import annotations

from collections import Counter

import typer

from . import common as c
from .render import errors_to_exit, out, table


@errors_to_exit
def info(model: c.ModelOpt = None) -> None:
    """Describe a GGUF model: architecture, sizes, context, vocabulary, tensor types."""
    from k4.runtime.model import open_model

    mf = open_model(c.model_path(model))
    cfg = mf.config
    types = Counter(t.type_name for t in mf.tensors.values())
    rows = [
        ("file", str(mf.path)),
        ("name", cfg.name),
        ("architecture", cfg.arch),
        ("file size", f"{mf.file_size:,} bytes ({mf.file_size / 2**20:,.2f} MiB)"),
        ("parameters", f"{mf.n_params:,}"),
        ("n_vocab", cfg.n_vocab),
        ("n_ctx (trained)", cfg.n_ctx_train),
        ("n_embd", cfg.n_embd),
        ("n_layer", cfg.n_layer),
        ("n_head / n_head_kv", f"{cfg.n_head} / {cfg.n_head_kv}"),
        ("head_dim", cfg.head_dim),
        ("n_ff", cfg.n_ff),
        ("rope", f"{'neox' if cfg.rope_neox else 'normal'}, dim {cfg.rope_dim}, freq_base {cfg.rope_freq_base:g}"
         + (", rope_freqs" if cfg.has_rope_freqs else "")),
        ("rms eps", f"{cfg.rms_eps:g}"),
        ("tied embeddings", "yes" if cfg.tied_embeddings else "no"),
        ("tensor types", ", ".join(f"{n} {k}" for k, n in sorted(types.items()))),
        ("tokenizer", f"{mf.meta('tokenizer.ggml.model', '-')} (pre: {mf.meta('tokenizer.ggml.pre', 'default')})"),
        ("chat template", "present" if mf.has_meta("tokenizer.chat_template") else "absent"),
    ]
    out.print(table(None, ("key", "value"), rows))


def register(app: typer.Typer) -> None:
    app.command("info")(info)
