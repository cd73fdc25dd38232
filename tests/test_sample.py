"""samples/make_sample.py: the padding computes the same function, and the script reproduces the
committed sample (which is also, byte for byte, llama-quantize's file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "samples" / "stories260k-q4_k_m.gguf"


@pytest.fixture(scope="module")
def make_sample():
    spec = importlib.util.spec_from_file_location("make_sample", REPO / "samples" / "make_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def padded(make_sample, data, tmp_path_factory):
    path = tmp_path_factory.mktemp("pad") / "pad.gguf"
    make_sample.pad_model(data / "models" / "stories260K.gguf", path)
    return path


def tensors(path: Path) -> dict[str, tuple[int, bytes]]:
    return {t.name: (int(t.tensor_type), t.data.tobytes()) for t in GGUFReader(path).tensors}


def test_padded_model_shape_and_metadata(padded):
    cfg = open_model(padded).config
    assert (cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.n_ctx_train) == (256, 32, 16, 8, 256, 512)
    assert cfg.rms_eps == pytest.approx(1e-5 / 4, rel=1e-6)
    assert all(t.shape[-1] % 256 == 0 for t in open_model(padded).tensors.values())


def test_padded_model_computes_the_same_function(padded, data):
    ids = [1, 403, 29, 260, 19, 5, 330, 97, 14, 421, 2]
    small = NumpyBackend(open_model(data / "models" / "stories260K.gguf"), 32).eval(ids, all_logits=True)
    big = NumpyBackend(open_model(padded), 32).eval(ids, all_logits=True)
    assert big.shape == small.shape == (len(ids), 512)
    np.testing.assert_allclose(big, small, rtol=0, atol=2e-3)
    assert (big.argmax(axis=1) == small.argmax(axis=1)).all()


def test_padding_matches_the_shared_padded_model(padded, data):
    assert tensors(padded) == tensors(data / "models" / "stories260K-pad-f32.gguf")


def test_script_reproduces_the_committed_sample(make_sample, data, tmp_path):
    out = tmp_path / "sample.gguf"
    make_sample.make_sample(data / "models" / "stories260K.gguf", out)
    assert tensors(out) == tensors(SAMPLE)
    assert out.read_bytes() == SAMPLE.read_bytes()
    assert out.read_bytes() == (data / "models" / "stories260K-pad-q4_k_m.gguf").read_bytes()
