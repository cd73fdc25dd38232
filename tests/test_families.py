"""Model families against llama.cpp, through the real CLI: stories260K rewritten as `qwen2`
(NeoX-ordered q/k, random q/k/v biases) and as `llama` with a `rope_freqs` tensor
(tests/data/golden/families.json, llama.cpp c392e50 on the CPU). Greedy completions
(llama-simple -n 48, BOS added) must match token for token, and perplexity (-c 128 -b 128 on
story.txt) per chunk and final within a relative limit: 5e-4 on the numpy backend, and on the
CUDA backend (tests marked `cuda`) for the reason given at CUDA_PPL_REL.

These are the only outside oracle for the q/k/v biases, the NeoX rotation of a converted model
and the rope_freqs divisors. Measured with each mistake planted in the numpy backend: a dropped
V bias changes the first prompt's greedy text at its 24th token and the final perplexity by
0.4%; ignored rope_freqs, at the 9th token and by a factor 4."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k4.cli.app import app

runner = CliRunner()

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
CASES = json.loads((GOLDEN / "families.json").read_text())["cases"]
MODELS = [c["model"] for c in CASES]
N_PREDICT = 48  # llama-simple -n 48
N_CTX = 128  # llama-perplexity -c 128 -b 128

# numpy: float32 throughout; llama.cpp's CPU build keeps its KV cache in fp16 and prints 4
# decimals, and the stories260K golden (test_golden.py) already agrees within 5e-5.
NUMPY_PPL_REL = 5e-4
# cuda: these models are all F32, so no product quantizes its activations to 8 bits (q8 applies
# to quantized weights only) and F32 products run in float32; what remains is the fp16 KV cache,
# which llama.cpp's CPU run has too. That is the case of test_cuda_backend's
# test_f32_perplexity_matches_llama_cpp (F32 stories260K on CUDA against llama.cpp), which holds
# at 5e-4, so the same limit applies. A dropped V bias moves the qwen2 perplexity by 0.4%
# (4.3295 against 4.3469), 8 times the limit.
CUDA_PPL_REL = 5e-4


def case(model: str) -> dict:
    return next(c for c in CASES if c["model"] == model)


def run_greedy(backend: str, model: str, prompt: str) -> dict:
    result = runner.invoke(app, ["run", "--backend", backend, "--temp", "0", "--json", "-m", str(GOLDEN / "families" / model),
                                 "-n", str(N_PREDICT), prompt])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def run_perplexity(backend: str, model: str) -> tuple[list[float], float]:
    """(running PPL after each chunk, final PPL) as `k4 perplexity` prints them."""
    result = runner.invoke(app, ["perplexity", "--backend", backend, "-m", str(GOLDEN / "families" / model),
                                 "-f", str(GOLDEN / "story.txt"), "-c", str(N_CTX)])
    assert result.exit_code == 0, result.output
    running = [float(x) for x in re.findall(r"\[\d+\](\d+\.\d+)", result.stdout)]  # [1]x then [2]y, one a line or comma-separated
    final = float(re.search(r"PPL = ([\d.]+)", result.stdout).group(1))
    return running, final


def check_greedy(backend: str, model: str) -> None:
    golden = case(model)["greedy"]
    assert len(golden) == 2
    for g in golden:
        out = run_greedy(backend, model, g["prompt"])
        assert out["backend"] == backend
        assert out["prompt_ids"][0] == 1  # BOS added, as llama-simple does
        assert out["generated_tokens"] == N_PREDICT
        assert out["text"] == g["completion"], (model, g["prompt"])


def check_perplexity(backend: str, model: str, rel: float) -> None:
    golden = case(model)
    running, final = run_perplexity(backend, model)
    assert len(running) == len(golden["chunks"]) == 8
    for i, (ours, theirs) in enumerate(zip(running, golden["chunks"])):
        assert ours == pytest.approx(theirs, rel=rel), f"{model} chunk {i + 1}"
    assert final == pytest.approx(golden["ppl"], rel=rel), model


def test_the_golden_holds_both_families():
    assert MODELS == ["stories260K-qwen2.gguf", "stories260K-ropefreqs.gguf"]


@pytest.mark.parametrize("model", MODELS)
def test_greedy_matches_llama_cpp(model):
    check_greedy("numpy", model)


@pytest.mark.parametrize("model", MODELS)
def test_perplexity_matches_llama_cpp(model):
    check_perplexity("numpy", model, NUMPY_PPL_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("model", MODELS)
def test_cuda_greedy_matches_llama_cpp(model):
    check_greedy("cuda", model)


@pytest.mark.cuda
@pytest.mark.parametrize("model", MODELS)
def test_cuda_perplexity_matches_llama_cpp(model):
    check_perplexity("cuda", model, CUDA_PPL_REL)
