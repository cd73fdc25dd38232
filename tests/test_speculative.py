"""Speculative decoding (runtime/speculative.py, runtime/spec_accept.py): greedy output equal to
llama.cpp's goldens with prompt lookup and with a draft model, the sampled rule's distribution
(statistically, against exact probabilities), the drafters, the cache contract, the options."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime.backend import make_backend
from k4.runtime.errors import UsageError
from k4.runtime.model import open_model
from k4.runtime.sampling import SamplingParams, apply_repeat_penalty, candidates
from k4.runtime.spec_accept import accept_greedy, accept_sampled
from k4.runtime.speculative import LookupDrafter, ModelDrafter, Speculator, check_draft_vocab

runner = CliRunner()


def run_json(*args: str) -> dict:
    result = runner.invoke(app, ["run", "--backend", "numpy", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def golden(data):
    cases = json.loads((data / "golden" / "greedy.json").read_text())["cases"]
    return [c for c in cases if c["model"] == "stories260K.gguf"]


@pytest.mark.parametrize("how", [["--lookup", "2"], ["--lookup", "4", "--draft-max", "3"], ["-md", "stories260K-pad-q4_k_m.gguf"],
                                 ["-md", "stories260K.gguf", "--draft-max", "12"]])
def test_greedy_output_is_the_golden_output(data, golden, how):
    how = [str(data / "models" / a) if a.endswith(".gguf") else a for a in how]
    accepted = 0
    for case in golden:
        out = run_json("-m", str(data / "models" / case["model"]), "--temp", "0", "-n", str(case["n_predict"]), *how, case["prompt"])
        assert out["text"] == case["completion"], case["prompt"]
        assert out["draft_steps"] > 0
        accepted += out["draft_accepted"]
    assert accepted > 0  # the verify steps did take drafts


def test_a_perfect_draft_is_accepted_whole(data):
    """The model drafting for itself: every draft accepted, draft-max + 1 tokens per step."""
    m = str(data / "models" / "stories260K.gguf")
    out = run_json("-m", m, "--temp", "0", "-n", "40", "-md", m, "--draft-max", "5", "Once upon a time")
    assert out["draft_accepted"] == out["draft_tokens"] > 0
    assert out["tokens_per_step"] == pytest.approx(6.0, abs=0.5)  # the last step may be cut by -n


def test_lookup_drafts_repeated_text_and_context_change():
    d = LookupDrafter(3)
    text = [5, 6, 7, 8, 9, 10, 5, 6, 7]
    assert d.draft(text, 4) == [8, 9, 10, 5]  # after the earlier 5 6 7
    assert d.draft(text + [8], 2) == [9, 10]  # grows incrementally
    assert d.draft(text + [8], 9) == [9, 10, 5, 6, 7, 8, 9, 10, 5]  # past the end: the repeat goes on
    assert d.draft([1, 2, 3], 4) == []  # not an extension: index rebuilt, nothing repeats
    assert d.draft([1, 2, 1, 3, 2, 1], 3) == [3, 2, 1]  # longest n-gram wins: "2 1" is followed by 3 (latest)
    assert d.draft([1, 2, 3, 9, 5, 3, 7, 1, 2, 3], 3) == [9, 5, 3]  # "1 2 3" before 9, though "3" came later before 7
    assert d.draft([4, 4, 4], 0) == []
    with pytest.raises(UsageError):
        LookupDrafter(0)


def test_accept_greedy_rule():
    assert accept_greedy([1, 2, 3, 4], [2, 3, 9, 7]) == [2, 3, 9]
    assert accept_greedy([1, 2, 3], [5, 3, 4]) == [5]
    assert accept_greedy([1, 2, 3], [2, 3, 4]) == [2, 3, 4]
    assert accept_greedy([1], [6]) == [6]


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile for one-sided z (3.09: p = 0.001), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Chi-square of counts against probs (n draws); cells expecting under 5 are pooled."""
    big = [c for c in probs if probs[c] * n >= 5]
    stat = sum((counts.get(c, 0) - probs[c] * n) ** 2 / (probs[c] * n) for c in big)
    rest_p = 1.0 - sum(probs[c] for c in big)
    rest_n = n - sum(counts.get(c, 0) for c in big)
    if rest_p * n >= 5:
        stat += (rest_n - rest_p * n) ** 2 / (rest_p * n)
        return stat, len(big)
    assert rest_n <= max(5, 3 * rest_p * n + 3)  # nothing outside the support
    return stat, len(big) - 1


def _dist(logits: np.ndarray, params: SamplingParams, history) -> dict[int, float]:
    order, w = candidates(apply_repeat_penalty(logits, history, params.repeat_penalty, params.repeat_last_n), params)
    return {int(i): float(x) for i, x in zip(order, w / w.sum())}


def test_accept_sampled_keeps_the_distribution_synthetic():
    """Two rows over a vocabulary of 6, a fixed draft pair: the first emitted token follows row
    0's distribution and, after an accepted draft, the second follows row 1's."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.2, (3, 6)).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0)
    p0, p1 = _dist(logits[0], params, [0]), _dist(logits[1], params, [0, 2])
    ids = [0, 2, 4]  # t, d_1, d_2
    n = 6000
    first, second, n_second = {}, {}, 0
    for seed in range(n):
        out, _ = accept_sampled(logits, ids, params.with_(seed=seed), [], 0)
        first[out[0]] = first.get(out[0], 0) + 1
        if out[0] == 2:
            second[out[1]] = second.get(out[1], 0) + 1
            n_second += 1
    stat, dof = _chi2(first, p0, n)
    assert stat < _chi2_critical(dof), (first, p0)
    stat, dof = _chi2(second, p1, n_second)
    assert stat < _chi2_critical(dof), (second, p1)


def test_sampled_speculation_keeps_the_models_distribution(data):
    """End to end on the numpy backend: with top-k 3 the joint distribution of the first two
    generated tokens is computed exactly from the model; 1,500 seeded runs with a fixed draft
    (accepted about half the time) must match it (chi-square, p = 0.001)."""
    mf = open_model(data / "models" / "stories260K.gguf")
    be = make_backend(mf, "numpy", 64)
    prompt = [1, 403, 407, 261, 378]  # "Once upon a time" in stories260K's vocabulary
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    be.reset()
    p1 = _dist(be.eval(prompt), params, prompt)
    exact = {}
    for t1, q1 in p1.items():
        be.truncate(len(prompt))
        for t2, q2 in _dist(be.eval([t1]), params, prompt + [t1]).items():
            exact[(t1, t2)] = q1 * q2
    t1_top = max(p1, key=p1.get)
    draft = max((k for k in exact if k[0] == t1_top), key=exact.get)[1]

    class Fixed:
        def draft(self, context, k):
            return [draft, draft][:k]

    spec = Speculator(Fixed(), 2)
    counts, n = {}, 1500
    for seed in range(n):
        be.reset()
        gen = spec.generate(be, prompt, params.with_(seed=seed))
        pair = (next(gen), next(gen))
        gen.close()
        counts[pair] = counts.get(pair, 0) + 1
    assert 0.2 < spec.stats.accepted / spec.stats.drafted < 0.9  # both branches of the rule ran
    stat, dof = _chi2(counts, exact, n)
    assert stat < _chi2_critical(dof), (counts, exact)


def test_closing_keeps_the_consumed_tokens(data):
    mf = open_model(data / "models" / "stories260K.gguf")
    be = make_backend(mf, "numpy", 128)
    prompt = [1, 403, 407, 261, 378]
    spec = Speculator(ModelDrafter(make_backend(mf, "numpy", 128)), 6)
    gen = spec.generate(be, prompt, SamplingParams(temperature=0.0))
    got = [next(gen) for _ in range(4)]  # the second step emits 7 tokens: close in its middle
    gen.close()
    assert be.tokens == prompt + got[:-1]
    plain = make_backend(mf, "numpy", 128)
    g = plain.generate(prompt, SamplingParams(temperature=0.0))
    assert got == [next(g) for _ in range(4)]


def test_speculation_fills_the_context_like_plain_decoding(data):
    m = str(data / "models" / "stories260K.gguf")
    plain = run_json("-m", m, "--temp", "0", "-c", "40", "Once upon a time")
    spec = run_json("-m", m, "--temp", "0", "-c", "40", "--lookup", "2", "Once upon a time")
    assert spec["stop_reason"] == plain["stop_reason"] == "context"
    assert spec["token_ids"] == plain["token_ids"]


def test_draft_vocabulary_must_match():
    check_draft_vocab(["a", "b", "c"], ["a", "b", "c", "pad"])
    with pytest.raises(UsageError, match="token 1"):
        check_draft_vocab(["a", "b", "c"], ["a", "x", "c"])
    with pytest.raises(UsageError, match="same vocabulary"):
        check_draft_vocab(["a"] * 10, ["a"] * 200)


@pytest.mark.parametrize("args, message", [(["--lookup", "-1"], "--lookup -1"), (["--draft-max", "-2", "--lookup", "2"], "--draft-max -2"),
                                           (["--lookup", "2", "-md", "X"], "give one of them"),
                                           (["--lookup", "2", "--draft-max", "64"], "use 0 to 63")])
def test_bad_options_get_one_line(data, args, message):
    args = [str(data / "models" / "stories260K.gguf") if a == "X" else a for a in args]
    result = runner.invoke(app, ["run", "--backend", "numpy", "-m", str(data / "models" / "stories260K.gguf"), "-n", "4", *args, "hi"])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_chat_with_lookup_replies_as_without(data):
    m = str(data / "models" / "stories260K.gguf")
    args = ["chat", "--backend", "numpy", "-m", m, "--temp", "0", "-n", "24"]
    plain = runner.invoke(app, args, input="Tell me a story.\nAnother one.\n")
    spec = runner.invoke(app, [*args, "--lookup", "2"], input="Tell me a story.\nAnother one.\n")
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and spec.stdout.strip()
    assert "accepted" in spec.stderr


def test_common_prefix_agrees_with_the_plain_loop():
    """generate.common_prefix (slice comparisons and a bisection) against an element loop, on
    random pairs that share 0..n ids, either order, and the empty cases."""
    import random

    from k4.runtime.generate import common_prefix

    def plain(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(7)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 50))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 8))]
        assert common_prefix(a, b) == common_prefix(b, a) == plain(a, b)
    assert common_prefix([], [1]) == 0 and common_prefix([5] * 1000, [5] * 999 + [4]) == 999


def test_accept_sampled_penalizes_over_the_whole_history():
    """Greedy with a repeat penalty (the host path): each row's token is the plain sampler's
    choice with history + the batch so far behind it, also when history is longer than the
    penalty's window."""
    from k4.runtime.sampling import sample

    rng = np.random.default_rng(11)
    logits = rng.normal(0, 1, (4, 12)).astype(np.float32)
    params = SamplingParams(temperature=0.0, repeat_penalty=1.8, repeat_last_n=5)
    history = [int(t) for t in rng.integers(0, 12, 40)]
    want = [sample(logits[0], params, history + [3], 0)]
    ids = [3, want[0], 7, 2]
    while len(want) < len(ids) and want[-1] == ids[len(want)]:
        want.append(sample(logits[len(want)], params, history + ids[: len(want) + 1], 0))
    got, _ = accept_sampled(logits, ids, params, history, 0)
    assert got == want


def test_accept_sampled_penalizes_each_rows_own_token():
    """Row i's logits follow ids[i], so its penalty covers ids[i] itself: each row's largest logit
    is the token it follows, which the penalty (2.0) puts below the next draft's; a row that
    missed its own token would pick it again and stop at the first row."""
    params = SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=64)
    ids = [4, 6, 8]  # [t, d_1, d_2]
    logits = np.zeros((3, 10), np.float32)
    for i, (own, nxt) in enumerate([(4, 6), (6, 8), (8, 1)]):
        logits[i, own], logits[i, nxt] = 2.0, 1.5  # penalized: 1.0 < 1.5
    got, _ = accept_sampled(logits, ids, params, [0, 2], 0)
    assert got == [6, 8, 1]


def test_accept_sampled_numbers_its_draws_one_random_number_each():
    """The draw number returned is the first one no draw used: a draft's test and the final draw
    take one number each, so the next verify step never reuses a number (which would tie its draws
    to these)."""
    params = SamplingParams(temperature=1.0, top_k=1)  # top-k 1: p(argmax) = 1, every other id 0
    logits = np.zeros((4, 10), np.float32)
    logits[:, 5] = 3.0
    assert accept_sampled(logits, [1, 5, 5, 5], params, [], 10) == ([5, 5, 5, 5], 14)  # 3 tests + the last row
    assert accept_sampled(logits, [1, 5, 2, 5], params, [], 10) == ([5, 5], 13)  # 2 tests, the redraw
    assert accept_sampled(logits, [1, 2], params, [], 0) == ([5], 2)


def test_accept_sampled_sees_the_history_inside_the_penalty_window():
    """The penalty window reaches back into history (also a history shorter than the window) and
    no further: token 7 leads row 0 and is penalized exactly while it is among the last 5 ids."""
    params = SamplingParams(temperature=0.0, repeat_penalty=100.0, repeat_last_n=5)
    logits = np.zeros((1, 10), np.float32)
    logits[0, 7], logits[0, 2] = 5.0, 1.0
    assert accept_sampled(logits, [3], params, [7], 0)[0] == [2]
    assert accept_sampled(logits, [3], params, [7, 1, 1, 1], 0)[0] == [2]
    assert accept_sampled(logits, [3], params, [7, 1, 1, 1, 1], 0)[0] == [7]  # [1, 1, 1, 1, 3]: 7 has left


def test_draft_vocab_sizes_may_differ_by_llama_cpps_128():
    words = [f"t{i}" for i in range(300)]
    check_draft_vocab(words, words[:172])
    with pytest.raises(UsageError, match="same vocabulary"):
        check_draft_vocab(words, words[:171])
    with pytest.raises(UsageError, match="token 3"):
        check_draft_vocab(words, words[:3] + ["x"] + words[4:])


def test_lookup_takes_one_grams_and_every_shorter_n_gram_in_turn():
    """n = ngram .. 1, each size in turn: a 1-gram may be the context's first token, and a 2-gram
    match under ngram 3 wins over a later 1-gram match."""
    assert LookupDrafter(1).draft([5, 9, 5], 1) == [9]
    assert LookupDrafter(3).draft([1, 2, 7, 8, 3, 7, 9, 2, 7], 2) == [8, 3]  # "2 7", not the later "7"


def test_model_drafter_keeps_within_its_context_and_repeats_itself(data):
    """The draft model's cache never overflows: at 15 of 16 positions it drafts one token; the
    same context twice gives the same drafts (the cache holds it all but the last token)."""
    mf = open_model(data / "models" / "stories260K.gguf")
    drafter = ModelDrafter(make_backend(mf, "numpy", 16))
    ctx = [1, 403, 407, 261, 378, 260, 431, 306, 260, 464, 321, 260, 363, 266, 290]
    one = drafter.draft(ctx, 5)
    assert len(one) == 1 and drafter.draft(ctx, 5) == one
    assert drafter.draft(ctx[:8], 3) == drafter.draft(ctx[:8], 3) and len(drafter.draft(ctx[:8], 3)) == 3


def test_draft_max_ends_are_valid():
    Speculator(LookupDrafter(2), 0)
    Speculator(LookupDrafter(2), 63)
    with pytest.raises(UsageError, match="0 to 63"):
        Speculator(LookupDrafter(2), 64)


def test_greedy_with_a_repeat_penalty_is_the_plain_output(data):
    """The device's greedy verify knows no penalty, so a penalized greedy run takes the host rule;
    its tokens are plain decoding's."""
    mf = open_model(data / "models" / "stories260K.gguf")
    prompt = [1, 403, 407, 261, 378]
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=16)
    plain = make_backend(mf, "numpy", 128).generate(prompt, params)
    want = [next(plain) for _ in range(30)]
    gen = Speculator(LookupDrafter(2), 4).generate(make_backend(mf, "numpy", 128), prompt, params)
    assert [next(gen) for _ in range(30)] == want
    assert want != [next(g) for g in [make_backend(mf, "numpy", 128).generate(prompt, SamplingParams(temperature=0.0))] for _ in range(30)]


def test_sampled_speculation_draws_each_number_once_and_keeps_the_cache(data, monkeypatch):
    """The sampled path: the first token is the plain sampler's (draw number 0), every later
    draw takes the next number (none reused, none skipped), and when closed the cache holds the
    prompt and the tokens consumed but the last."""
    from k4.runtime import sampling, spec_accept

    used = []

    def spy(seed, step):
        used.append(step)
        return sampling.uniform.__wrapped__(seed, step)

    spy.__wrapped__ = sampling.uniform
    mf = open_model(data / "models" / "stories260K.gguf")
    prompt = [1, 403, 407, 261, 378]
    params = SamplingParams(temperature=1.0, seed=5)
    plain = make_backend(mf, "numpy", 128).generate(prompt, params)
    first = next(plain)
    monkeypatch.setattr(sampling, "uniform", spy)
    monkeypatch.setattr(spec_accept, "uniform", spy)
    be = make_backend(mf, "numpy", 128)
    gen = Speculator(LookupDrafter(1), 3).generate(be, prompt, params)
    got = [next(gen) for _ in range(25)]
    gen.close()
    assert got[0] == first
    assert used == list(range(len(used))) and len(used) >= 25
    assert be.tokens == prompt + got[:-1]
