"""The host sampler: greedy, the filter chain, the repeat penalty rule, the seeded RNG."""

from __future__ import annotations

import numpy as np
import pytest

from k4.runtime.errors import UsageError
from k4.runtime.sampling import SamplingParams, apply_repeat_penalty, candidates, sample, splitmix64, uniform


def test_splitmix64_known_values():
    # splitmix64 outputs for state 0 (first output of the reference generator seeded with 0)
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert 0.0 <= uniform(1, 2) < 1.0 and uniform(1, 2) == uniform(1, 2) and uniform(1, 2) != uniform(1, 3)


def test_greedy_is_argmax_first_on_ties():
    logits = np.array([0.0, 3.0, 3.0, 1.0], np.float32)
    assert sample(logits, SamplingParams(temperature=0), [], 0) == 1


def test_repeat_penalty_divides_positive_multiplies_negative():
    logits = np.array([2.0, -2.0, 1.0], np.float32)
    out = apply_repeat_penalty(logits, [0, 1, 0], 2.0, 64)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1], 2.0, 1), [2.0, -4.0, 1.0])


def test_top_k_one_is_greedy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(100).astype(np.float32)
    for step in range(20):
        assert sample(logits, SamplingParams(temperature=1.5, top_k=1, seed=step), [], step) == int(np.argmax(logits))


def test_filters_limit_the_candidates():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    seen = {sample(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=s), [], 0) for s in range(300)}
    assert seen == {0, 1}
    seen = {sample(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25, seed=s), [], 0) for s in range(300)}
    assert seen == {0, 1, 2}
    seen = {sample(logits, SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=s), [], 0) for s in range(300)}
    assert seen == {0, 1, 2}


def test_min_p_keeps_the_tokens_at_its_threshold():
    """min-p keeps p >= min_p * p_max, the threshold included (llama.cpp's min_p sampler keeps
    logits >= max + log(min_p)): at min_p 1 both tokens tied for the top stay."""
    logits = np.array([1.0, 3.0, 3.0, 0.0], np.float32)
    order, _ = candidates(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=1.0))
    assert order.tolist() == [1, 2]
    seen = {sample(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=1.0, seed=s), [], 0) for s in range(64)}
    assert seen == {1, 2}


def test_distribution_follows_temperature():
    logits = np.log(np.array([0.6, 0.4], np.float32))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    draws = [sample(logits, p.with_(seed=s), [], 0) for s in range(4000)]
    assert abs(draws.count(0) / 4000 - 0.6) < 0.03


def test_same_seed_same_tokens():
    logits = np.random.default_rng(1).standard_normal(50).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=7)
    assert [sample(logits, p, [], i) for i in range(10)] == [sample(logits, p, [], i) for i in range(10)]


@pytest.mark.parametrize("change, needle", [
    (dict(temperature=-1), "--temp"), (dict(top_p=0), "(0, 1]"), (dict(top_p=1.5), "(0, 1]"),
    (dict(min_p=2), "--min-p"), (dict(repeat_penalty=0), "--repeat-penalty"), (dict(repeat_last_n=-1), "--repeat-last-n"),
])
def test_invalid_values_name_the_range(change, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams().with_(**change)


def test_defaults_are_llama_cpps():
    """llama.cpp's common_params_sampling defaults (temp 0.80, top-k 40, top-p 0.95, min-p 0.05,
    repeat penalty 1.00 over the last 64 tokens); k4's seed defaults to 0 so that runs repeat."""
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n, p.seed) == (0.8, 40, 0.95, 0.05, 1.0, 64, 0)


def test_the_ranges_ends_are_valid():
    """--temp 0 (greedy), --min-p 0 and 1, --top-p 1 and --repeat-last-n 0 are accepted."""
    SamplingParams(temperature=0.0, top_p=1.0, min_p=0.0, repeat_last_n=0).validate()
    assert SamplingParams(temperature=0.0).validate().greedy and not SamplingParams(temperature=1e-6).greedy
    SamplingParams(min_p=1.0).validate()


def test_uniform_is_the_same_stream_in_every_version():
    """A seed names the same text across versions and on the GPU (sampling.cu draws the same u):
    these values are splitmix64((seed * 0x100000001B3 + step) mod 2^64) >> 11, over 2^53."""
    assert uniform(1, 2) == 0.2491670799166551
    assert uniform(0, 0) == 0.8833108082136426
    assert uniform(7, 3) == 0.12945116780430932


def test_repeat_last_n_zero_is_off_and_small_positive_logits_are_divided():
    logits = np.array([0.5, -0.5, 4.0], np.float32)
    assert apply_repeat_penalty(logits, [0, 1, 2], 2.0, 0) is logits  # llama.cpp: last_n 0 disables
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1], 2.0, 8), [0.25, -1.0, 4.0])
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1], 1.0, 8), logits)


def test_candidates_weights_are_relative_to_the_top_and_stay_finite():
    """weights = exp((logit - max) / T): the top one is exactly 1 however large the logits are."""
    logits = np.array([1000.0, 999.0, 990.0, -5.0], np.float32)
    order, w = candidates(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    assert order.tolist() == [0, 1, 2, 3] and w[0] == 1.0 and np.all(np.isfinite(w))
    np.testing.assert_allclose(w[1], np.exp(-2.0), rtol=1e-12)
    order, w = candidates(logits, SamplingParams(temperature=0.5))  # top-p 0.95 keeps 0.731 + 0.269
    assert order.tolist() == [0, 1] and np.all(np.isfinite(w))


def test_min_p_can_leave_a_single_candidate():
    logits = np.array([10.0, 0.0, 0.0], np.float32)
    order, w = candidates(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5))
    assert order.tolist() == [0] and w.tolist() == [1.0]
