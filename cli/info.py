"""`k4 info`: what a GGUF file is, for any GGUF: a model k4 runs (architecture, sizes, types,
template), a model k4 cannot run (what the file says, then why not: one error line, exit 2),
or a vocabulary-only file (its tokenizer)."""

from __future__ import annotations

from collections import Counter

import typer

from . import common as c
from .render import errors_to_exit, out, table

# metadata shown by the tokenizer rows, not again among the other keys
SHOWN_KEYS = ("general.architecture", "general.name", "tokenizer.")
MAX_VALUE_CHARS = 80


@errors_to_exit
def info(model: c.ModelOpt = None) -> None:
    """Describe a GGUF file: architecture, sizes, context, vocabulary, tensor types.

    For a file k4 cannot run, the description is followed by the reason on stderr and exit status 2."""
    from k4.runtime.model import inspect_model

    mf, problem = inspect_model(c.model_path(model))
    rows = [("file", str(mf.path)), ("file size", f"{mf.file_size:,} bytes ({mf.file_size / 2**20:,.2f} MiB)")]
    if mf.config is not None:
        rows += _model_rows(mf)
    elif not mf.tensors:
        rows += [("kind", "vocabulary only (no tensors)")] + _file_rows(mf)
    else:
        rows += _file_rows(mf) + _tensor_rows(mf)
    rows += _tokenizer_rows(mf)
    out.print(table(None, ("key", "value"), rows))
    if not mf.tensors:
        out.print("a vocabulary-only file: k4 tokenize and k4 prompt can use it; there are no weights to run", markup=False)
    elif problem is not None:
        raise type(problem)(f"k4 cannot run {mf.path}: {str(problem).removeprefix(f'{mf.path}: ')}")


def _model_rows(mf) -> list[tuple[str, object]]:
    """A model k4 runs, from its ModelConfig."""
    cfg = mf.config
    return [
        ("name", cfg.name),
        ("architecture", cfg.arch),
        ("parameters", f"{mf.n_params:,}"),
        ("n_vocab", cfg.n_vocab),
        ("n_ctx (trained)", cfg.n_ctx_train),
        ("n_embd", cfg.n_embd),
        ("n_layer", cfg.n_layer),
        ("n_head / n_head_kv", f"{cfg.n_head} / {cfg.n_head_kv}"),
        ("head_dim", cfg.head_dim),
        ("n_ff", cfg.n_ff),
        ("rope", f"{'neox' if cfg.rope_neox else 'normal'}, dim {cfg.rope_dim}, freq_base {cfg.rope_freq_base:g}"
         + (", rope_freqs" if cfg.has_rope_freqs else "") + _rope_scaling(cfg)),
        ("rms eps", f"{cfg.rms_eps:g}"),
        ("tied embeddings", "yes" if cfg.tied_embeddings else "no"),
    ] + _tensor_rows(mf)


def _rope_scaling(cfg) -> str:
    """The RoPE scaling the file declares (runtime/rope.py), as ', yarn x4 from 32,768', or ''."""
    if cfg.rope_scaling == "none":
        return ""
    orig = f" from {cfg.rope_orig_ctx:,}" if cfg.rope_orig_ctx else ""
    factor = f" x{cfg.rope_scale:g}" if cfg.rope_scaling in ("linear", "yarn") else ""
    return f", {cfg.rope_scaling}{factor}{orig}"


def _tensor_rows(mf) -> list[tuple[str, object]]:
    types = Counter(t.type_name for t in mf.tensors.values())
    return [
        ("tensors", f"{len(mf.tensors):,} ({mf.n_params:,} weights)"),
        ("tensor types", ", ".join(f"{n} {k}" for k, n in sorted(types.items()))),
    ]


def _file_rows(mf) -> list[tuple[str, object]]:
    """A file k4 does not run: its name, architecture, GGUF version and every metadata key
    outside the tokenizer's, as written."""
    rows = [
        ("name", mf.meta("general.name", "-")),
        ("architecture", mf.meta("general.architecture", "-")),
        ("GGUF version", mf.meta("GGUF.version")),
    ]
    for key, field in mf.reader.fields.items():
        if not key.startswith("GGUF.") and not key.startswith(SHOWN_KEYS):
            rows.append((key, _value_text(mf, key, field)))
    return rows


def _value_text(mf, key: str, field) -> str:
    """A metadata value on one line: numbers and strings as they are (long strings cut), arrays
    as their length and element type (GGUF value type names)."""
    if len(field.types) > 1:  # an array: types are [ARRAY, element type]
        return f"array of {len(field.data):,} {field.types[-1].name}"
    value = mf.meta(key)
    text = f"{value:g}" if isinstance(value, float) else str(value).replace("\n", "\\n")
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def _tokenizer_rows(mf) -> list[tuple[str, object]]:
    fields = mf.reader.fields

    def count(key: str) -> str:
        return f"{len(fields[key].data):,}" if key in fields else "-"

    special = [f"{name} {mf.meta(f'tokenizer.ggml.{name}_token_id')}" for name in ("bos", "eos", "eot", "pad", "unknown")
               if mf.has_meta(f"tokenizer.ggml.{name}_token_id")]
    return [
        ("tokenizer", f"{mf.meta('tokenizer.ggml.model', '-')} (pre: {mf.meta('tokenizer.ggml.pre', 'default')})"),
        ("tokens / merges", f"{count('tokenizer.ggml.tokens')} / {count('tokenizer.ggml.merges')}"),
        ("special tokens", ", ".join(special) or "-"),
        ("chat template", "present" if mf.has_meta("tokenizer.chat_template") else "absent"),
    ]


def register(app: typer.Typer) -> None:
    app.command("info")(info)
