"""The CUDA backend's decode and prefill loop (runtime/cuda/runner.py) through the backend protocol:
the traffic of a decode step (4 bytes back, no sync), CUDA-event timing, the cache semantics
(reset, truncate, closing generate(), context full), sampling equal to the numpy backend's,
prefill graphs and one-token starts, and the decode graphs per context range. Limits and
helpers: tests/cuda_backend_cases.py."""

from __future__ import annotations

import numpy as np
import pytest

from k4.runtime.errors import ContextFullError
from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend
from k4.runtime.sampling import SamplingParams
from tests.cuda_backend_cases import GREEDY, LIMIT_PREFILL, cuda, rel_l2, take
from tests.gpu import cupy_or_skip

cp = cupy_or_skip()
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("unset_backend_flags")]


def test_decode_step_moves_4_bytes_and_never_syncs(stories):
    _, tok, be = stories
    be.reset()
    be.trace.reset()
    gen = be.generate(tok.encode("Once upon a time"), GREEDY)
    for _ in range(10):
        next(gen)
    d = be.trace.get("decode")
    assert d.steps == 10 and d.graph_replays == 10
    assert (d.d2h_bytes, d.d2h_count, d.h2d_bytes, d.h2d_count, d.syncs, d.allocs) == (40, 10, 0, 0, 0, 0)
    assert d.launches == 10 * be.graph_launches
    gen.close()


def test_cuda_events_time_prefill_and_every_decode_step(stories):
    """Device time per phase from CUDA events: one prefill span and one sample per decode step
    (with ping-pong, the step in flight at close is finished and counted), summing to gpu_ms."""
    _, tok, be = stories
    be.reset()
    be.trace.reset()
    take(be.generate(tok.encode("Once upon a time"), GREEDY), 12)
    steps = be.trace.gpu_steps["decode"]
    assert len(steps) == 12 and all(ms > 0 for ms in steps)
    assert be.trace.get("decode").gpu_ms == pytest.approx(sum(steps))
    assert len(be.trace.gpu_steps["prefill"]) == 1 and be.trace.get("prefill").gpu_ms > 0
    assert not be.timer.pending
    be.eval(tok.encode(" and then"))
    assert len(be.trace.gpu_steps["prefill"]) == 2


def test_reset_and_truncate_then_regenerate(stories):
    _, tok, be = stories
    prompt = tok.encode("Lily and Ben went to the park")
    be.reset()
    a = take(be.generate(prompt, GREEDY), 20)
    assert be.tokens == prompt + a[:19]
    be.reset()
    assert take(be.generate(prompt, GREEDY), 20) == a
    be.truncate(len(prompt) + 10)  # keep the first 10 generated tokens, re-feed the 11th
    assert take(be.generate([a[10]], GREEDY), 9) == a[11:20]
    sampled = SamplingParams(temperature=0.9, seed=3, repeat_penalty=1.1)
    be.reset()
    s1 = take(be.generate(prompt, sampled), 20)
    be.reset()
    assert take(be.generate(prompt, sampled), 20) == s1


def test_sampled_tokens_equal_numpy_backend(stories):
    mf, tok, be = stories
    prompt = tok.encode("The little dog")
    params = SamplingParams(temperature=0.8, seed=11, repeat_penalty=1.1, repeat_last_n=16)
    be.reset()
    history = [1, 2, 3]
    assert take(be.generate(prompt, params, history), 24) == take(NumpyBackend(mf, 256).generate(prompt, params, history), 24)


def test_prefill_graphs_give_the_logits_and_cache_of_launched_chunks(data, monkeypatch):
    """Full 512-token chunks replay captured graphs (one ending in the logits, one not): the
    last logits, and the tokens generated from the cache they filled, equal the launched path."""
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    prompt = np.random.default_rng(8).integers(3, mf.config.n_vocab, size=1024 + 77).tolist()
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("K4_PREFILL_GRAPH", flag)
        be = cuda(mf, 1200)
        assert be.chunk == 512
        be.trace.reset()
        last = [be.eval(prompt[:1024]), be.eval(prompt[1024:])]  # chunks 512 + 512 (last), then 77 launched
        replays = be.trace.get("prefill").graph_replays
        runs[flag] = (last, take(be.generate([5], GREEDY), 8), replays)
        be.close()
    (got, toks, replays), (want, want_toks, none) = runs["1"], runs["0"]
    assert (replays, none) == (2, 0)
    for g, w in zip(got, want):
        assert rel_l2(g, w) < 1e-5
    assert toks == want_toks


def test_one_token_start_replays_the_decode_graph(stories):
    """A one-id prompt starts with a graph replay instead of the eager prefill: same tokens as
    the numpy backend, sampled and with a history, and the cache continues correctly after."""
    mf, tok, be = stories
    params = SamplingParams(temperature=0.8, seed=5, repeat_penalty=1.1, repeat_last_n=16)
    ref = NumpyBackend(mf, 256)
    be.reset()
    be.trace.reset()
    assert take(be.generate([1], params, [4, 5]), 12) == take(ref.generate([1], params, [4, 5]), 12)
    assert be.trace.get("prefill").graph_replays == 1
    # continue the cached text by one id, as a chat turn can
    assert take(be.generate([7], GREEDY), 8) == take(ref.generate([7], GREEDY), 8)
    assert be.tokens == ref.tokens


def test_closing_generate_keeps_consumed_tokens_but_the_last(stories):
    _, tok, be = stories
    prompt = tok.encode("One day, a big bird")
    be.reset()
    gen = be.generate(prompt, GREEDY)
    got = [next(gen) for _ in range(5)]
    gen.close()
    assert be.tokens == prompt + got[:4]
    after_close = be.eval([got[4]])
    be.reset()
    be.eval(prompt + got[:4])
    assert rel_l2(after_close, be.eval([got[4]])) < 1e-3  # the same cache; only prefill vs decode rounding differs


def test_context_full_after_the_same_tokens_as_numpy(stories):
    mf, tok, _ = stories
    prompt = tok.encode("Once upon a time, there was")

    def count(be) -> int:
        n = 0
        with pytest.raises(ContextFullError):
            for _ in be.generate(prompt, GREEDY):
                n += 1
        return n

    n = count(cuda(mf, len(prompt) + 6))
    assert n == 7 and n == count(NumpyBackend(mf, len(prompt) + 6))


def test_decode_attention_per_context_range_matches_eager_steps_and_numpy(data, monkeypatch):
    """A step attending n keys uses the first range of Ops.decode_splits that holds n (512, 768,
    1024, then n_ctx 1100), graph replays (a graph per range, captured on first use) and eager
    steps alike: decoding across the range boundaries gives the same sampled tokens both ways,
    and one-token evals in two ranges give numpy's logits."""
    mf = open_model(data / "models" / "stories260K.gguf")
    ids = np.random.default_rng(5).integers(3, mf.config.n_vocab, size=500).tolist()
    be = cuda(mf, 1100)
    assert [sp[0] for sp in be.splits] == [512, 768, 1024, 1100] and be.n_split == max(sp[1] for sp in be.splits)
    assert sorted(be.decode_graphs) == [512]  # captured at load
    params = SamplingParams(temperature=0.8, seed=11)

    def draws(b) -> list[int]:
        b.reset()
        out = take(b.generate(ids, params), 40)  # positions 500-540: crosses 512
        b.reset()
        out += take(b.generate(ids + ids[:250], params), 40)  # 750-790: crosses 768
        b.reset()
        return out + take(b.generate(ids * 2, params), 70)  # 1000-1070: crosses 1024

    got = draws(be)
    assert sorted(be.decode_graphs) == [512, 768, 1024, 1100]
    monkeypatch.setenv("K4_CUDA_GRAPH", "0")
    eager = cuda(mf, 1100)
    assert eager.graph is None and draws(eager) == got
    ref = NumpyBackend(mf, 1100)
    for b in (be, ref):
        b.reset()
    for chunk in (ids, ids[:20], [7], ids, ids[:10], [8]):  # one-token evals at positions 520 (range 768) and 1031 (1100)
        want = ref.eval(chunk)
        assert rel_l2(be.eval(chunk), want) < LIMIT_PREFILL, len(be.tokens)
