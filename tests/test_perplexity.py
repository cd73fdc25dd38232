"""`k4 perplexity`: llama-perplexity's output format and its standard error, checked against an
estimate computed here from the per-token log-likelihoods."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime.model import open_model
from k4.runtime.perplexity import ppl_estimate
from k4.runtime.reference import NumpyBackend
from k4.runtime.tokenizer import Tokenizer

runner = CliRunner()
N_CTX = 128


@pytest.fixture(scope="module")
def nll(data) -> np.ndarray:
    """-log p of every token llama-perplexity scores in story.txt with -c 128 (second half of each
    chunk, BOS first), float64, from the numpy backend's logits and a log-sum-exp written here."""
    mf = open_model(data / "models" / "stories260K.gguf")
    tok = Tokenizer.from_model(mf)
    ids = tok.encode((data / "golden" / "story.txt").read_text())
    be = NumpyBackend(mf, N_CTX)
    out = []
    for start in range(0, len(ids) - N_CTX + 1, N_CTX):
        chunk = [tok.bos_id] + ids[start + 1 : start + N_CTX]
        be.reset()
        logits = be.eval(chunk, all_logits=True).astype(np.float64)  # (N_CTX, n_vocab)
        for pos in range(N_CTX // 2, N_CTX - 1):
            row = logits[pos]
            out.append(np.logaddexp.reduce(row) - row[ids[start + pos + 1]])
    return np.array(out)


def invoke(data, *extra):
    return runner.invoke(app, ["perplexity", "--backend", "numpy", "-m", str(data / "models" / "stories260K.gguf"),
                               "-f", str(data / "golden" / "story.txt"), "-c", str(N_CTX), *extra])


def test_prints_llama_perplexity_lines_and_the_standard_error(data, nll):
    r = invoke(data)
    assert r.exit_code == 0, r.output
    m = re.fullmatch(r"((?:\[\d+\]\d+\.\d{4},)+)\nFinal estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})\n", r.stdout)
    assert m, r.stdout
    chunks = re.findall(r"\[(\d+)\]", m.group(1))
    assert chunks == [str(i) for i in range(1, len(chunks) + 1)] and len(chunks) == 8
    assert len(nll) == 8 * (N_CTX - N_CTX // 2 - 1)
    ppl = math.exp(nll.mean())
    err = ppl * nll.std() / math.sqrt(len(nll) - 1)  # standard error of the mean nll, through exp
    assert m.group(2) == f"{ppl:.4f}" and m.group(3) == f"{err:.5f}"
    assert m.group(1).endswith(f"[8]{ppl:.4f},")


def test_json_carries_the_chunks_ppl_and_error(data, nll):
    r = invoke(data, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    golden = json.loads((data / "golden" / "perplexity.json").read_text())["cases"][0]
    assert out["n_chunks"] == 8 and out["n_scored"] == 8 * 63 and out["n_ctx"] == N_CTX
    assert out["chunks"] == pytest.approx(golden["chunks"], rel=5e-4)
    ppl = math.exp(nll.mean())
    assert out["ppl"] == pytest.approx(ppl, rel=1e-9)
    assert out["ppl_error"] == pytest.approx(ppl * nll.std() / math.sqrt(len(nll) - 1), rel=1e-6)


def test_ppl_estimate():
    x = np.array([1.0, 2.0, 3.0])
    ppl, err = ppl_estimate(float(x.sum()), float((x * x).sum()), 3)
    assert ppl == pytest.approx(math.e**2) and err == pytest.approx(math.e**2 * math.sqrt((2 / 3) / 2))
    assert ppl_estimate(2.0, 4.0, 1) == (pytest.approx(math.e**2), None)  # one token: no spread to measure
    assert ppl_estimate(3.0, 3.0, 3)[1] is None  # every token equally likely: zero variance
    # two tokens (nll 1 and 2) have a spread: variance 0.25 over n - 1 = 1
    assert ppl_estimate(3.0, 5.0, 2)[1] == pytest.approx(math.exp(1.5) * math.sqrt(0.25 / 1))


def test_the_smallest_context_and_text_perplexity_takes(data):
    """-c 4 and a text of exactly two chunks run (llama.cpp's limits: 2 * n_ctx tokens); -c 3
    and one token fewer are refused with the size to use."""
    from k4.runtime.errors import UsageError
    from k4.runtime.perplexity import perplexity

    be = NumpyBackend(open_model(data / "models" / "stories260K.gguf"), 8)
    text = [1, 403, 407, 261, 378, 260, 431, 306]
    got = list(perplexity(be, text, 4, 1))
    assert [c.n_scored for c in got] == [1, 1] and all(c.ppl > 1 for c in got)
    with pytest.raises(UsageError, match="at least 4"):
        next(perplexity(be, text, 3, 1))
    with pytest.raises(UsageError, match="needs at least 8"):
        next(perplexity(be, text[:7], 4, 1))
