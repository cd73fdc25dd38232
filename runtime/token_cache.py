"""The cached-token bookkeeping every backend shares (runtime/backend.py's protocol)."""

from __future__ import annotations

from .errors import ContextFullError


class TokenCache:
    """The bookkeeping every backend shares: `tokens`, the ids whose keys/values are cached,
    in order, within a context of `n_ctx` positions."""

    n_ctx: int
    tokens: list[int]
    # How far below the highest position ever stored the cache can be cut back (runtime/swa_ring.py:
    # a sliding layer's ring overwrites older rows); None: anywhere. `written` is that highest
    # position + 1 (at least n_past; a backend that stores past n_past, as a speculative verify
    # step does for its rejected drafts, raises it itself).
    rewind_slack: int | None = None
    written: int = 0

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []
        self.written = 0

    def reusable(self, n: int) -> int:
        """The longest prefix of at most n cached tokens that truncate() can keep: n, or 0 when a
        sliding layer's ring no longer holds the keys a pass restarting at n would read."""
        n = max(0, min(n, self.n_past))
        if self.rewind_slack is None or n >= max(self.written, self.n_past) - self.rewind_slack:
            return n
        return 0

    def truncate(self, n: int) -> None:
        """Keep the first n cached tokens. Raises ValueError outside 0 .. n_past, or when the
        cache cannot be cut back that far (reusable(n) < n: call it first)."""
        if not 0 <= n <= self.n_past:
            raise ValueError(f"truncate({n}) outside 0..{self.n_past}")
        if self.reusable(n) != n:
            raise ValueError(f"truncate({n}): the sliding layers' rings have overwritten the keys a pass from position {n} "
                             f"reads ({self.written} positions stored); only truncate(0) is possible")
        self.written = max(self.written, self.n_past) if n else 0
        del self.tokens[n:]

    def close(self) -> None:
        """Nothing in flight to finish (the numpy backend); CudaBackend overrides it."""

    def _check_room(self, n: int) -> None:
        """Raise ContextFullError when n more tokens do not fit."""
        if self.n_past + n > self.n_ctx:
            raise ContextFullError(
                f"{self.n_past + n} tokens do not fit in the context of {self.n_ctx}; raise --ctx-size or shorten the input"
            )
