"""Errors a user can cause. Each carries one sentence that says what is wrong and what to do.

The CLI catches `K4Error` in one place (cli/render.py), prints the message on one line and
exits with `exit_code` (2 for errors in the user's input, 3 for a failure of the GPU; Ctrl-C,
a KeyboardInterrupt, exits with 130 there too). Everything else is a bug and keeps its traceback.
"""


class K4Error(Exception):
    """Base of every user-facing error. `str(err)` is the one-line message."""

    exit_code = 2


class ModelFileError(K4Error):
    """The model file is missing, not a GGUF, truncated or inconsistent."""


class UnsupportedModelError(K4Error):
    """The file is a valid GGUF, but its architecture or tensor types are not supported."""


class TokenizerError(K4Error):
    """The GGUF's vocabulary metadata cannot be turned into a tokenizer."""


class TemplateError(K4Error):
    """The chat template is invalid or raised an error while rendering."""


class BackendUnavailableError(K4Error):
    """The requested backend cannot run here (no GPU, no CuPy, out of GPU memory)."""


class ContextFullError(K4Error):
    """The prompt or conversation does not fit in the context window (--ctx-size)."""


class GpuError(K4Error):
    """A CUDA call failed: a kernel launch was refused, or an error surfaced at a later
    synchronization. The message names the kernel (or the last one launched) and the phase
    (runtime.trace phases: load, prefill, decode); the CLI exits with 3."""

    exit_code = 3


class UsageError(K4Error):
    """An option or input value is invalid."""


class OutOfMemoryError(K4Error):
    """The model does not fit in RAM (refused before loading), or RAM ran out while it ran."""
