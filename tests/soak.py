"""Long runs: decode many tokens, or hold many chat turns, on one loaded backend, and measure
memory and tokens/s at the start and at the end (issue 8: nothing grows, the speed holds).

The tests call these functions and the "Long runs" figures of docs/PERF.md come from them.

Memory figures, in bytes: `host_rss`, the resident set of this process (/proc/self/statm, so
Linux only; pinned host buffers count in it); on the cuda backend also `pool_used` and
`pool_held`, what CuPy's default device memory pool hands out and holds, and `device_free`, the
driver's free bytes (cudaMemGetInfo). A snapshot runs the garbage collector first. "start" is
taken after the first window (decode) or turn (chat), so one-time warm-up (first-use imports,
caches filled on the first call) is not counted as growth; "growth" is end minus start.

Speed: tokens/s of each window of `window` tokens, timed on the host clock from the arrival of
the token before the window to the arrival of its last token (prefill excluded).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from itertools import islice

from k4.runtime.backend import Backend
from k4.runtime.sampling import SamplingParams

MEMORY_KEYS = ("host_rss", "pool_used", "pool_held", "device_free")


def memory(backend: Backend) -> dict[str, int | None]:
    """A memory snapshot (module docstring): host_rss, and for the cuda backend pool_used,
    pool_held and device_free (None on other backends). Bytes."""
    gc.collect()
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    snap: dict[str, int | None] = dict.fromkeys(MEMORY_KEYS)
    snap["host_rss"] = resident_pages * os.sysconf("SC_PAGE_SIZE")
    if backend.name == "cuda":
        import cupy as cp

        pool = cp.get_default_memory_pool()
        snap["pool_used"], snap["pool_held"] = int(pool.used_bytes()), int(pool.total_bytes())
        snap["device_free"] = int(cp.cuda.runtime.memGetInfo()[0])
    return snap


def growth(start: dict, end: dict) -> dict[str, int | None]:
    """end - start per memory key (None where a snapshot has no value)."""
    return {k: None if start[k] is None or end[k] is None else end[k] - start[k] for k in MEMORY_KEYS}


def soak_decode(backend: Backend, prompt_ids: Sequence[int], params: SamplingParams, n_windows: int,
                window: int = 2000, fixed_depth: bool = False) -> dict:
    """Decode n_windows windows of `window` tokens through backend.generate and measure memory
    and speed.

    Continuous (fixed_depth False): one generation from an empty cache of 1 + n_windows * window
    tokens; the cache ends at len(prompt_ids) + n_windows * window positions (n_ctx must hold
    one more, as runtime.generate budgets), and the windows' tokens/s fall as attention reads a longer cache. fixed_depth: each window is its own
    generation of 1 + window tokens from an empty cache with the same prompt and params, so every
    window runs at the same depths and their tokens/s should agree; `same_tokens` says whether
    every window drew the same ids (the backend's determinism).

    Returns {"backend", "n_windows", "window", "fixed_depth", "tokens" (decoded in all),
    "depth" (n_past at the end), "window_tps" (list, tokens/s), "first_tps", "last_tps",
    "tps_change" (last / first - 1), "same_tokens" (fixed_depth only, else None), "start", "end"
    (memory snapshots), "growth"}. Raises ValueError when the tokens do not fit in n_ctx.
    """
    need = len(prompt_ids) + 1 + window * (1 if fixed_depth else n_windows)  # the Generator's budget rule
    if need > backend.n_ctx:
        raise ValueError(f"soak_decode needs {need} positions but the backend's n_ctx is {backend.n_ctx}")
    tps: list[float] = []
    drawn: list[list[int]] = []
    start = gen = None
    try:
        for _ in range(n_windows):
            if gen is None or fixed_depth:
                if gen is not None:
                    gen.close()
                backend.reset()
                gen = backend.generate(prompt_ids, params)
                next(gen)  # prefill and the first token
            t0 = time.perf_counter()
            drawn.append(list(islice(gen, window)))
            tps.append(window / (time.perf_counter() - t0))
            if start is None:
                start = memory(backend)
    finally:
        if gen is not None:
            gen.close()
    end = memory(backend)
    return {
        "backend": backend.name, "n_windows": n_windows, "window": window, "fixed_depth": fixed_depth,
        "tokens": n_windows * window + (n_windows if fixed_depth else 1), "depth": backend.n_past,
        "window_tps": tps, "first_tps": tps[0], "last_tps": tps[-1], "tps_change": tps[-1] / tps[0] - 1,
        "same_tokens": all(d == drawn[0] for d in drawn) if fixed_depth else None,
        "start": start, "end": end, "growth": growth(start, end),
    }


def default_message(i: int) -> str:
    """The i-th user message of soak_chat: short, different every turn."""
    return f"Turn {i}: tell me one new thing about the number {i * 7 + 3}, in a few words."


def _rate(results: list) -> float:
    """Generated tokens/s over several GenerationResults (the first token of each is timed with
    its prompt, as in GenerationResult.gen_tps)."""
    tokens = sum(max(len(r.token_ids) - 1, 0) for r in results)
    seconds = sum(r.gen_ms for r in results) / 1e3
    return tokens / seconds if seconds > 0 else 0.0


def soak_chat(session, turns: int, message: Callable[[int], str] = default_message, edge: int = 5) -> dict:
    """Hold `turns` chat turns in `session` (a runtime.chat.ChatSession) and measure memory and
    speed. Each turn sends message(i) and streams the whole reply; the session reuses the KV
    cache between turns and drops the oldest turns when the context is full.

    Returns {"turns", "dropped_turns" (turns that left the window), "prompt_tokens" and
    "prefill_tokens" (lists per turn: the rendered window and what was evaluated of it),
    "reply_tokens" (list), "first_tps" and "last_tps" (generated tokens/s over the first and
    the last `edge` turns), "tps_change", "start" (after the first turn), "end", "growth"}.
    """
    results, dropped, start = [], 0, None
    for i in range(turns):
        plan = session.plan(message(i))
        dropped += plan.dropped_turns
        for _ in session.run(plan):
            pass
        results.append(session.last.result)
        if start is None:
            start = memory(session.backend)
    end = memory(session.backend)
    first, last = _rate(results[:edge]), _rate(results[-edge:])
    return {
        "turns": turns, "dropped_turns": dropped,
        "prompt_tokens": [r.prompt_tokens for r in results], "prefill_tokens": [r.prefill_tokens for r in results],
        "reply_tokens": [len(r.token_ids) for r in results],
        "first_tps": first, "last_tps": last, "tps_change": last / first - 1 if first > 0 else 0.0,
        "start": start, "end": end, "growth": growth(start, end),
    }
