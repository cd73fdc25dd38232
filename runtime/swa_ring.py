"""The KV cache of sliding-window layers as a ring (Gemma 2/3, issue 19): how many rows each
layer keeps, the cache's bytes, the longest context that fits, and how far back the cache can be
rewound.

A sliding layer's query at position p sees keys p - n_swa + 1 .. p only (runtime/reference.py),
so its cache needs no more than the last n_swa positions plus the ones a forward pass writes
before it reads them. Its ring holds R rows, R a power of two, and position p lives at row
p & (R - 1) (the kernels' `ring` argument, kernels_cu/attention.cu). A forward pass of n tokens
at positions s .. s + n - 1 first writes all their keys, then attends: the rows it overwrites
held positions s - R .. s + n - 1 - R, which no query of the pass sees when R >= n_swa + n - 1.
So R = the smallest power of two >= max(RING_MIN_ROWS, n_swa + chunk - 1), with `chunk` the
most tokens a pass takes (the prefill chunk, which bounds speculative verify too); a layer whose
R would not be below n_ctx keeps n_ctx rows, as every full-attention layer does. llama.cpp keeps
n_swa + n_ubatch cells for such layers (its `--swa-full` turns that off; here K4_SWA_RING=0).

Rewinding: once positions up to `written` - 1 have been stored, a ring row of position j < s
still holds j while written <= j + R. A pass that restarts at s reads keys s - n_swa + 1 .. on
each sliding layer, so the cache can be cut back to s when s >= written - (R - n_swa + 1)
(rewind_slack); else only to 0, the whole text evaluated again (what llama.cpp's SWA cache does
when a prompt's prefix no longer matches within the window).
"""

from __future__ import annotations

from .kv_types import KVTypes
from .model import ModelConfig

RING_MIN_ROWS = 256  # the fewest rows of a ring: a multiple of every attention kernel's key tile (64 at most)


def ring_rows(window: int, chunk: int, n_ctx: int) -> int:
    """Rows of a sliding layer's ring for a window of `window` positions, passes of at most
    `chunk` tokens and a context of n_ctx; 0 when the layer keeps all n_ctx rows (the ring would
    not be smaller)."""
    need = max(RING_MIN_ROWS, window + chunk - 1)
    rows = 1 << (need - 1).bit_length()
    return rows if rows < n_ctx else 0


def layer_rings(cfg: ModelConfig, n_ctx: int, chunk: int, ring: bool = True) -> list[int]:
    """Per layer, the rows of its ring (0: a plain cache of n_ctx rows). ring=False (K4_SWA_RING=0):
    no layer has one."""
    return [ring_rows(cfg.n_swa, chunk, n_ctx) if ring and cfg.sliding(li) and cfg.n_swa else 0
            for li in range(cfg.n_layer)]


def cache_bytes(cfg: ModelConfig, n_ctx: int, types: KVTypes, rings: list[int]) -> int:
    """Device bytes of the keys and values (quants and scales) of every layer: n_ctx rows, or
    its ring's."""
    per_row = types.bytes_per_token(1, cfg.n_head_kv * cfg.head_dim)
    return sum((r or n_ctx) * per_row for r in rings)


def rewind_slack(cfg: ModelConfig, rings: list[int]) -> int | None:
    """How many positions below the highest one ever stored the cache can be cut back to (the
    module docstring), or None when no layer is a ring (any cut is fine)."""
    slack = [r - cfg.n_swa + 1 for r in rings if r]
    return min(slack) if slack else None


def max_context(cfg: ModelConfig, budget: int, types: KVTypes, chunk: int, ring: bool = True) -> int:
    """The largest n_ctx (tokens) whose cache fits in `budget` bytes, rings included (passes of at
    most `chunk` tokens); 0 when none. UNBOUNDED when every layer is a ring that fits."""
    per_row = types.bytes_per_token(1, cfg.n_head_kv * cfg.head_dim)
    plain = max(0, budget) // (cfg.n_layer * per_row)  # every layer n_ctx rows: always fits
    rings = layer_rings(cfg, UNBOUNDED, chunk, ring)  # the rings' rows at any long context
    n_plain = sum(1 for r in rings if not r)
    rest = budget - sum(rings) * per_row  # past the rings' rows, the cache grows with the plain layers only
    if n_plain == cfg.n_layer or rest < 0:
        return plain
    longer = rest // (n_plain * per_row) if n_plain else UNBOUNDED
    return max(plain, longer) if longer > max(rings) else plain


UNBOUNDED = 1 << 62  # a context longer than any a model is trained for
