"""The protocol every backend implements (numpy reference, CUDA), and backend selection.

A backend owns the model's weights and one KV cache of `n_ctx` positions. `tokens` lists the
ids whose keys/values are in the cache, in order; `n_past == len(tokens)`.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

import numpy as np

from .kv_types import F16, KVTypes
from .model import ModelConfig, ModelFile
from .sampling import SamplingParams
from .trace import Trace

CTX_STEP = 256  # a context cut to fit memory is a multiple of this many tokens (llama.cpp pads n_ctx to 256)


class Backend(Protocol):
    name: str
    config: ModelConfig
    n_ctx: int
    kv_types: KVTypes  # the KV cache's key and value types (-ctk, -ctv)
    trace: Trace
    tokens: list[int]
    load_ms: dict[str, float]  # wall time (ms) of each load step, in order
    load_detail_ms: dict[str, float]  # what overlapped inside those steps (ms); may be empty

    def memory_report(self) -> dict[str, int]:
        """Bytes the backend holds, by kind (e.g. weights, kv_cache, scratch)."""

    @property
    def n_past(self) -> int: ...

    def reset(self) -> None:
        """Empty the KV cache."""

    def reusable(self, n: int) -> int:
        """The longest prefix of at most n cached positions truncate() can keep: n, or 0 where a
        sliding layer's ring cache (runtime/swa_ring.py) no longer holds what a pass from n reads."""

    def truncate(self, n: int) -> None:
        """Keep the first n cached positions (0 <= n <= n_past, reusable(n) == n), drop the rest."""

    def eval(self, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Run the model over token_ids after the cached ones and cache them.

        Returns logits, float32: (len(token_ids), n_vocab) if all_logits else (n_vocab,) for the
        last position. Raises ContextFullError if n_past + len(token_ids) > n_ctx.
        """

    def verify(self, token_ids: Sequence[int]) -> list[int]:
        """Speculative decoding's greedy verify step (runtime/speculative.py): evaluate token_ids
        = [t, d_1 .. d_k] (the last sampled token, then k drafts) after the cached ones, as one
        forward pass; accept the longest run of drafts d_i equal to the argmax after the token
        before it; keep t and the accepted drafts d_1 .. d_m in the cache (the rest is rolled
        back). Returns d_1 .. d_m and then the argmax after d_m (m + 1 ids). Raises
        ContextFullError if n_past + len(token_ids) > n_ctx."""

    def generate(self, token_ids: Sequence[int], params: SamplingParams, history: Sequence[int] = ()) -> Iterator[int]:
        """Evaluate token_ids, then yield sampled ids forever, feeding each back in.

        `history` is the token list the repeat penalty looks at before token_ids. The draw
        number for the RNG is the count of tokens yielded so far. A backend may compute one
        token ahead of the consumer; when the generator is closed, the cache holds exactly
        token_ids plus the tokens consumed except the last (which was never evaluated).
        Raises ContextFullError when the cache is full.
        """

    def close(self) -> None:
        """Finish the work in flight and stop using the device; call before dropping the
        backend when another is built in the same process. Idempotent."""


def resolve_kind(kind: str) -> str:
    """"cuda" or "numpy" for --backend `kind`: "auto" picks cuda when a GPU and CuPy are present.
    Raises UsageError (unknown kind) or BackendUnavailableError (CuPy present, GPU unusable)."""
    from .errors import UsageError

    if kind not in ("auto", "numpy", "cuda"):
        raise UsageError(f"--backend {kind!r} is unknown; use auto, numpy or cuda")
    if kind != "auto":
        return kind
    try:
        return "cuda" if cuda_available() else "numpy"
    except Exception as exc:
        from .errors import BackendUnavailableError

        raise BackendUnavailableError(f"CuPy is installed but the GPU cannot be used ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}); fix the CUDA setup "
                                      "or use --backend numpy") from None


def max_context(mf: ModelFile, kind: str, flags=None, kv_types: KVTypes = F16) -> tuple[int, int, int, int]:
    """(largest n_ctx in tokens whose KV cache fits in free memory beside the weights and
    buffers, bytes free for the cache, KV bytes per token (past the rings of sliding layers),
    the cache's bytes at the training context) on backend `kind` ("cuda": free GPU memory and
    the cache's kv_types, runtime/cuda/sizing.py; "numpy": available RAM for its float32 cache,
    whatever kv_types, reference.max_context)."""
    if kind == "cuda":
        from .cuda.sizing import max_context as gpu_max

        return gpu_max(mf, flags, kv_types=kv_types)
    from .reference import max_context as ram_max

    fits, free, per_token = ram_max(mf)
    return fits, free, per_token, per_token * mf.config.n_ctx_train


def fit_context(mf: ModelFile, kind: str, flags=None, kv_types: KVTypes = F16) -> tuple[int, str | None]:
    """The context for -c 0 on backend `kind` ("cuda" or "numpy"): the training context when
    its KV cache fits beside the weights and buffers, else the largest multiple of CTX_STEP
    tokens that does, with a one-line note giving the numbers (None when nothing was cut). When
    not even CTX_STEP tokens fit, CTX_STEP (or the shorter training context) and no note: the
    backend then refuses with its sizes, in one line."""
    from .hostmem import mib

    train = mf.config.n_ctx_train
    fits, free, per_token, need = max_context(mf, kind, flags, kv_types)
    if fits >= train:
        return train, None
    if fits < CTX_STEP:
        return min(train, CTX_STEP), None
    n_ctx = fits // CTX_STEP * CTX_STEP
    where = "GPU memory" if kind == "cuda" else "RAM"
    return n_ctx, (f"context {n_ctx:,} tokens instead of the model's {train:,}: its KV cache would need "
                   f"{mib(need)} but {mib(free)} of {where} is free beside the weights and buffers "
                   f"({mib(per_token * CTX_STEP)} per {CTX_STEP} tokens); -c sets it")


def make_backend(mf: ModelFile, kind: str = "auto", n_ctx: int = 0, progress=None, status=None, flags=None,
                 kv_types: KVTypes = F16) -> Backend:
    """Build the backend `kind` ("auto", "numpy", "cuda") for a loaded model.

    n_ctx = 0 means fit_context's: the model's training context when its KV cache fits in free
    memory, else the largest multiple of CTX_STEP that does (its note goes to status). "auto"
    picks cuda when a GPU and CuPy are present, else numpy. progress(done_bytes, total_bytes) is
    called while weights upload (cuda) or are read (numpy); status(text) says what a slow step
    is doing (cuda: kernels still compiling after the upload); flags: the K4_* switches, a
    runtime.flags.Flags (default: the environment's); kv_types: the KV cache's key and value
    types (-ctk, -ctv; runtime/kv_types.py). Raises BackendUnavailableError (cuda asked
    for but not usable), OutOfMemoryError (numpy: the model does not fit in RAM) or UsageError
    (unknown kind; a q8_0 cache for a head size that is not a multiple of 32).
    """
    from .errors import UsageError

    kind = resolve_kind(kind)
    assert mf.config is not None
    kv_types.check(mf.config.head_dim)
    if n_ctx == 0:
        n_ctx, note = fit_context(mf, kind, flags, kv_types)
        if note and status is not None:
            status(note)
    if n_ctx < 1:
        raise UsageError(f"--ctx-size {n_ctx} is invalid; use a positive number of tokens")
    if kind == "cuda":
        from .cuda.backend import CudaBackend  # raises BackendUnavailableError without CuPy or a GPU

        return CudaBackend(mf, n_ctx, progress=progress, status=status, flags=flags, kv_types=kv_types)
    from .reference import NumpyBackend

    return NumpyBackend(mf, n_ctx, progress=progress, kv_types=kv_types)


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device.

    False only for the two ordinary reasons a machine has no GPU backend: CuPy is not installed,
    or the CUDA runtime reports no device (or no driver). Anything else (a broken CuPy, a
    failing driver call) propagates, so it is seen rather than silently turned into "no GPU".
    """
    try:
        import cupy as cp
    except ImportError:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError as exc:
        if _NO_DEVICE.intersection(str(exc).split()):
            return False
        raise


# CUDA runtime errors that mean "no GPU here" rather than "something is broken"
_NO_DEVICE = {"cudaErrorNoDevice:", "cudaErrorInsufficientDriver:", "cudaErrorNoDevice", "cudaErrorInsufficientDriver"}
