"""The generation loop's host pieces (runtime/generate.py): stop strings held back across the
pieces a stream arrives in, and the rates of a GenerationResult."""

from __future__ import annotations

import pytest

from k4.runtime.generate import GenerationResult, StopMatcher

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
