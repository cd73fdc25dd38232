"""The numpy reference forward pass: cache consistency, RoPE, padded model equivalence."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.errors import ContextFullError
from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend, apply_rope, rope_tables
from k4.runtime.rope import rope_table
from tiny import tiny_config, write_tiny


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mtype", [T.Q8_0, T.F16, T.BF16, T.Q5_0, T.Q5_1, T.F32])
def test_prefill_equals_token_by_token(tmp_path, data, arch, mtype):
    p = write_tiny(tmp_path / "m.gguf", data / "models" / "stories260K.gguf",
                   tiny_config(arch, tied_embeddings=arch == "qwen2"), matrix_type=mtype)
    be = NumpyBackend(open_model(p), 32)
    ids = [1, 400, 37, 90, 5, 300]
    full = be.eval(ids, all_logits=True)  # (6, n_vocab)
    assert full.shape == (6, 512) and np.isfinite(full).all()
    be.reset()
    steps = np.stack([be.eval([t]) for t in ids])
    np.testing.assert_allclose(steps, full, rtol=0, atol=1e-4)
    be.truncate(3)
    np.testing.assert_allclose(be.eval(ids[3:]), full[-1], rtol=0, atol=1e-4)


def test_context_full_is_clear(data):
    be = NumpyBackend(open_model(data / "models" / "stories260K.gguf"), 4)
    be.eval([1, 2, 3])
    with pytest.raises(ContextFullError, match="do not fit in the context of 4"):
        be.eval([4, 5])


@pytest.mark.parametrize("neox", [False, True])
def test_rope_is_a_relative_rotation(neox):
    cfg = tiny_config("qwen2" if neox else "llama", rope_dim=8, head_dim=12)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 12)).astype(np.float32)
    def at(x, pos):
        cos, sin = rope_tables(rope_table(cfg, 64, None), np.array([pos]))
        return apply_rope(x, cos, sin, cfg.rope_dim, neox)
    # norms kept, dims past rope_dim untouched, dot product depends on the distance only
    np.testing.assert_allclose(np.linalg.norm(at(q, 17)), np.linalg.norm(q), rtol=1e-5)
    np.testing.assert_array_equal(at(q, 17)[..., 8:], q[..., 8:])
    d1 = float((at(q, 10) * at(k, 3)).sum())
    d2 = float((at(q, 107) * at(k, 100)).sum())
    assert abs(d1 - d2) < 1e-4
    # the pairs: llama turns (0, 1), neox turns (0, 4)
    e0 = np.zeros((1, 1, 12), np.float32)
    e0[..., 0] = 1
    moved = np.nonzero(np.abs(at(e0, 1)[0, 0]) > 1e-6)[0].tolist()
    assert moved == ([0, 4] if neox else [0, 1])


def test_rope_freqs_divide_theta():
    cfg = tiny_config(rope_dim=8)
    factors = np.array([1.0, 2.0, 4.0, 8.0], np.float32)
    c1, s1 = rope_tables(rope_table(cfg, 64, factors), np.array([5]))
    inv = 10000.0 ** (-np.arange(4) * 2 / 8) / factors
    np.testing.assert_allclose(c1[0], np.cos(5 * inv), rtol=1e-6)
    np.testing.assert_allclose(s1[0], np.sin(5 * inv), rtol=1e-6)


def test_padded_f32_model_computes_the_same_function(data):
    small = NumpyBackend(open_model(data / "models" / "stories260K.gguf"), 64)
    padded = NumpyBackend(open_model(data / "models" / "stories260K-pad-f32.gguf"), 64)
    ids = [1, 403, 407, 261, 378, 12, 88]
    np.testing.assert_allclose(padded.eval(ids, all_logits=True), small.eval(ids, all_logits=True), rtol=0, atol=2e-3)
