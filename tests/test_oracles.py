"""Families llama.cpp's goldens do not cover, against transformers: tiny models built from
transformers' own classes and written to GGUF as llama.cpp's converter writes them, with the
float32 logits transformers computed (tests/make_oracles.py made both; tests/data/oracles).

Limits (relative L2 over all positions' logits):
- numpy backend 1e-5: float32 on both sides, only the order of summation differs (measured
  4.4e-7 for qwen3, 4.6e-7 phi3, 3.8e-7 llama-yarn). A wrong op order (q/k norm after RoPE), a
  dropped norm weight or a wrong eps moves the logits by far more; so does RoPE scaling done
  wrong: phi3 without LongRoPE's magnitude factor 0.14, without its factors 0.35; llama-yarn
  without YaRN's magnitude 0.12, without its frequencies 0.27. Gemma (sliding window 8 under
  the 40-token prompt; measured 2.5e-7 for gemma3 and gemma2): gemma3 without its sliding window
  0.23, with the global RoPE base on sliding layers 0.047, without the embedding scale 1.06;
  gemma2 without its window 0.15, without the attention soft-cap 0.014, without the final
  soft-cap 0.64. Mixture of experts (8 experts, 2 used; measured 3.5e-7 for qwen3moe, 3.4e-7
  qwen2moe, prompt and one token at a time): qwen3moe without its top-k renormalization 0.24,
  3 experts used instead of 2 0.21; qwen2moe with renormalization 0.26, its shared expert's
  gate forced open 0.40.
- CUDA backend 1e-3: the weights are F32 (float matrix-vector products, no 8-bit activations);
  prefill rounds to fp16 on tensor cores and the KV cache is fp16 (measured about 2e-4 on F32
  models of this size).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend

# every family tests/make_oracles.py wrote: qwen3, gemma3, gemma2, phi3 (partial rotary, LongRoPE,
# fused qkv and gate|up), llama-yarn (YaRN over an original context of 32, the prompt past it),
# qwen3moe and qwen2moe (routed experts; qwen2moe's shared expert)
ORACLES = tuple(json.loads((Path(__file__).parent / "data" / "oracles" / "oracles.json").read_text()))
LIMIT_NUMPY = 1e-5
LIMIT_CUDA = 1e-3


def oracle(data, family: str):
    folder = data / "oracles"
    entry = json.loads((folder / "oracles.json").read_text())[family]
    return open_model(folder / entry["model"]), entry["prompt_ids"], np.load(folder / entry["logits"])


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("family", ORACLES)
def test_numpy_backend_matches_transformers(data, family):
    mf, ids, want = oracle(data, family)
    assert mf.config.arch == family.split("-")[0]
    be = NumpyBackend(mf, 256)
    assert rel_l2(be.eval(ids, all_logits=True), want) < LIMIT_NUMPY
    be.reset()  # one token at a time: the decode path of the reference
    assert rel_l2(np.stack([be.eval([t]) for t in ids]), want) < LIMIT_NUMPY


@pytest.mark.cuda
@pytest.mark.parametrize("family", ORACLES)
def test_cuda_backend_matches_transformers(data, family):
    from k4.runtime.cuda.backend import CudaBackend

    mf, ids, want = oracle(data, family)
    be = CudaBackend(mf, 256)
    try:
        assert rel_l2(be.eval(ids[:-8], all_logits=True), want[:-8]) < LIMIT_CUDA  # prefill
        assert rel_l2(np.stack([be.eval([t]) for t in ids[-8:]]), want[-8:]) < LIMIT_CUDA  # decode steps
    finally:
        be.close()
