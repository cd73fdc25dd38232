"""The generation loop's host pieces (runtime/generate.py): stop strings held back across the
pieces a stream arrives in, the rates of a GenerationResult, and Generator's budget, flush,
timing and cache reuse (on a scripted backend, and on the numpy backend)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from k4.runtime.errors import ContextFullError
from k4.runtime.generate import GenerationResult, Generator, StopMatcher
from k4.runtime.sampling import SamplingParams

TEXT = "Once upon a time there was a cat"


def stream(pieces, stops):
    """Feed pieces to a StopMatcher: (all text it let out, whether it stopped)."""
    m, out = StopMatcher(stops), ""
    for p in pieces:
        text, stopped = m.feed(p)
        out += text
        if stopped:
            return out, True
    return out + m.flush(), False


@pytest.mark.parametrize("stop", ["time", "a cat", "t"])
def test_a_stop_string_split_anywhere_is_found_and_never_let_out(stop):
    want = TEXT[: TEXT.index(stop)]
    for cut in range(1, len(TEXT)):  # two pieces, the cut at every place
        assert stream([TEXT[:cut], TEXT[cut:]], [stop]) == (want, True), cut
    assert stream(list(TEXT), [stop]) == (want, True)  # a character at a time


def test_text_that_only_begins_a_stop_string_comes_out_whole():
    m = StopMatcher(["there is"])
    assert m.feed("Once upon a time the") == ("Once upon a time ", False)  # "the" may begin the stop string
    assert m.feed("re was") == ("there was", False)
    assert stream(list(TEXT), ["dog", ""]) == (TEXT, False)  # an empty stop string stops nothing


def test_rates_leave_out_empty_phases():
    """prompt t/s: evaluated prompt tokens over the prompt time, None when nothing was evaluated
    (-n 0); generation t/s counts the tokens after the first, which is timed with the prompt."""
    r = GenerationResult(token_ids=[7, 8, 9], prefill_tokens=50, prompt_ms=100.0, gen_ms=500.0, stop_reason="length")
    assert r.prompt_tps == pytest.approx(500.0) and r.gen_tps == pytest.approx(4.0)
    one = GenerationResult(token_ids=[7], prefill_tokens=5, prompt_ms=10.0, gen_ms=3.0)
    assert one.gen_tps is None and one.prompt_tps == pytest.approx(500.0)
    assert GenerationResult(prefill_tokens=5, prompt_ms=10.0, stop_reason="length").prompt_tps is None  # -n 0
    assert GenerationResult(prefill_tokens=5, prompt_ms=10.0, stop_reason="eog").prompt_tps == pytest.approx(500.0)


class _Trace:
    @contextlib.contextmanager
    def in_phase(self, name):
        yield


class _Script:
    """A backend that answers any prompt with the character codes of `text` (then EOS, id 0),
    keeping the cache contract: tokens holds the prompt and the tokens consumed but the last."""

    def __init__(self, text: str, n_ctx: int = 64):
        self.text, self.n_ctx, self.tokens, self.trace = text, n_ctx, [], _Trace()

    def reusable(self, n):
        return n

    def truncate(self, n):
        del self.tokens[n:]

    def generate(self, ids, params, history=()):
        self.tokens = list(history) + list(ids)
        for i, c in enumerate([ord(c) for c in self.text] + [0] * self.n_ctx):
            if i:
                self.tokens.append(ord(self.text[i - 1]) if i <= len(self.text) else 0)
            yield c


class _Chars:
    """A tokenizer whose token id is a character code; 0 ends generation."""

    def is_eog(self, t):
        return t == 0

    def stream_decoder(self):
        return SimpleNamespace(add=chr, flush=lambda: "")


def _run(text, n_ctx=64, prompt=(1, 2, 3), n_predict=-1, stop=()):
    g = Generator(_Script(text, n_ctx), _Chars())
    out = "".join(g.stream(list(prompt), SamplingParams(temperature=0.0), n_predict, stop))
    return out, g.result


def test_text_held_back_for_a_stop_string_comes_out_at_the_end():
    """At the length limit or EOS, text held back because it could begin a stop string is
    flushed into the output; a full stop string is not."""
    assert _run("a ca", n_predict=4, stop=["cat"])[0] == "a ca"
    out, res = _run("a ca", stop=["cat"])
    assert out == res.text == "a ca" and res.stop_reason == "eog"
    out, res = _run("a cat sat", stop=["cat"])
    assert out == res.text == "a " and res.stop_reason == "stop"


def test_the_budget_is_the_room_left_in_the_context():
    """A prompt that fills the context is refused; -n equal to the room stops for length, -n
    past it (or -1) for the full context."""
    with pytest.raises(ContextFullError, match="holds 8"):
        _run("abcdefgh", n_ctx=8, prompt=range(1, 9))
    out, res = _run("abcdefgh", n_ctx=8, prompt=range(1, 8))
    assert out == "a" and res.stop_reason == "context"
    assert _run("abcdefghijkl", n_ctx=16, prompt=range(1, 7), n_predict=10)[1].stop_reason == "length"
    out, res = _run("abcdefghijkl", n_ctx=16, prompt=range(1, 7), n_predict=11)
    assert out == "abcdefghij" and res.stop_reason == "context"
    out, res = _run("abc", n_predict=0)
    assert out == "" and res.token_ids == [] and res.stop_reason == "length"


def test_prompt_and_generation_times(monkeypatch):
    """prompt_ms runs from the start to the first token, gen_ms from there to the end (a clock
    that advances 10 ms a reading: start, first token, end)."""
    from k4.runtime import generate

    ticks = iter(range(1, 100))
    monkeypatch.setattr(generate, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * 0.010))
    res = _run("abc", n_predict=3)[1]
    assert res.prompt_ms == pytest.approx(10.0) and res.gen_ms == pytest.approx(10.0)


def test_a_repeated_prompt_evaluates_only_its_last_token(data):
    from k4.runtime.backend import make_backend
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer

    mf = open_model(data / "models" / "stories260K.gguf")
    g = Generator(make_backend(mf, "numpy", 64), Tokenizer.from_model(mf))
    prompt = [1, 403, 407, 261, 378]
    first = "".join(g.stream(prompt, SamplingParams(temperature=0.0), 8))
    assert g.result.prefill_tokens == 5
    again = "".join(g.stream(prompt, SamplingParams(temperature=0.0), 8))
    assert again == first and g.result.prefill_tokens == 1 and g.result.prompt_tokens == 5
