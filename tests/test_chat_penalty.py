"""The repeat penalty across chat turns: it must see the whole history, the cached prefix included.

In turn 2 only the tokens after the cached prefix are evaluated (runtime.generate keeps the KV
cache), but llama.cpp's penalty sampler looks at the last `repeat_last_n` tokens of the sequence,
wherever they came from. So a session's second reply must equal the first reply of a new session
(empty cache) given the same conversation. With repeat_last_n = 256 the window covers the whole
second prompt (157 tokens, of which 102 come from the cache) and the reply.
"""

from __future__ import annotations

import pytest

from k4.cli.common import SAMPLE_MODEL
from k4.runtime.sampling import SamplingParams
from tests.test_chat import make_session, turn

SYSTEM = "You tell stories."
N_PREDICT = 24


def second_reply(params: SamplingParams, backend: str):
    """(session after two turns, its second reply's GenerationResult); checks that most of the
    second prompt came from the cache."""
    s = make_session(SAMPLE_MODEL, backend=backend, params=params, n_predict=N_PREDICT, system=SYSTEM)
    turn(s, "Once upon a time")
    cached = len(s.backend.tokens)
    turn(s, "Tell me more")
    r = s.last.result
    assert r.prefill_tokens < r.prompt_tokens - 64 and cached > 64  # most of the window comes from the cache
    return s, r


def fresh_reply(conversation: list[dict], params: SamplingParams, backend: str):
    """The first reply of a new session to `conversation` (ending with a user message)."""
    f = make_session(SAMPLE_MODEL, backend=backend, params=params, n_predict=N_PREDICT, system=SYSTEM)
    f.messages = [dict(m) for m in conversation]
    turn(f, None)
    assert f.last.result.prefill_tokens == f.last.result.prompt_tokens
    return f.last.result


# On cuda only greedy: there the cached turn-1 reply's keys/values were written by decode steps
# (8-bit activations) and the fresh session's by prefill (fp16 tensor cores), so logits differ by
# about 1e-3, which moves a T=0.8 draw that falls near a boundary of the distribution.
@pytest.mark.parametrize(("backend", "temperature"), [("numpy", 0.0), ("numpy", 0.8),
                                                      pytest.param("cuda", 0.0, marks=pytest.mark.cuda)])
def test_second_turn_penalizes_the_cached_prefix(backend, temperature):
    params = SamplingParams(temperature=temperature, repeat_penalty=1.3, repeat_last_n=256, seed=3)
    s, r2 = second_reply(params, backend)
    # reply k of a session draws with seed + k: the fresh session's first reply gets seed + 1
    conversation = s.messages[:-1]
    expected = fresh_reply(conversation, params.with_(seed=params.seed + 1), backend)
    assert r2.token_ids == expected.token_ids and r2.text == expected.text
    # the penalty changes this reply, so the comparison above is about the penalty
    plain = fresh_reply(conversation, params.with_(seed=params.seed + 1, repeat_penalty=1.0), backend)
    assert plain.token_ids != r2.token_ids
