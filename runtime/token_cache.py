"""The cached-token bookkeeping every backend shares (runtime/backend.py's protocol)."""

from __future__ import annotations

from .errors import ContextFullError


class TokenCache:
    """The bookkeeping every backend shares: `tokens`, the ids whose keys/values are cached,
    in order, within a context of `n_ctx` positions."""

    n_ctx: int
    tokens: list[int]

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.n_past:
            raise ValueError(f"truncate({n}) outside 0..{self.n_past}")
        del self.tokens[n:]

    def close(self) -> None:
        """Nothing in flight to finish (the numpy backend); CudaBackend overrides it."""

    def _check_room(self, n: int) -> None:
        """Raise ContextFullError when n more tokens do not fit."""
        if self.n_past + n > self.n_ctx:
            raise ContextFullError(
                f"{self.n_past + n} tokens do not fit in the context of {self.n_ctx}; raise --ctx-size or shorten the input"
            )
