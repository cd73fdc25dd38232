"""The numpy reference forward pass: cache consistency, RoPE, padded model equivalence, and its
building blocks (RMSNorm, RoPE tables, causal attention) against float64 formulas at the edges
where a wrong sign or factor would show: small inputs, large scores, scaled tables."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.errors import ContextFullError
from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend, apply_rope, causal_attention, rms_norm, rope_tables, swa_rope_tables
from k4.runtime.rope import RopeTable, rope_table
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


def test_rms_norm_adds_eps_to_the_mean_square():
    """x / sqrt(mean(x^2) + eps) * w where eps dominates (x of 1e-3, eps 1e-5: mean square 1e-6),
    and zeros stay zeros (a subtracted eps would give NaN)."""
    rng = np.random.default_rng(1)
    x = (1e-3 * rng.standard_normal((3, 64))).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), want, rtol=2e-6)
    np.testing.assert_array_equal(rms_norm(np.zeros((1, 64), np.float32), w, 1e-6), np.zeros((1, 64), np.float32))


def test_rope_tables_scale_cos_and_sin_by_mscale():
    """YaRN's mscale multiplies both tables (1.5 here): cos(p w) * 1.5 and sin(p w) * 1.5."""
    inv = 10000.0 ** (-np.arange(4) * 2 / 8)
    cos, sin = rope_tables(RopeTable(inv, 1.5), np.array([0, 3, 250]))
    theta = np.array([0, 3, 250])[:, None] * inv[None, :]
    np.testing.assert_allclose(cos, 1.5 * np.cos(theta), rtol=1e-6)
    np.testing.assert_allclose(sin, 1.5 * np.sin(theta), rtol=1e-6, atol=1e-7)


def test_sliding_layers_turn_by_their_own_base():
    """Gemma's sliding layers: theta_i = p * base_swa^(-2i / rope_dim), whatever the global base
    and scaling (base_swa 10,000 against a global 1,000,000 here)."""
    cfg = tiny_config("llama", rope_dim=8, head_dim=8)
    cfg = type(cfg)(**{**cfg.__dict__, "rope_freq_base": 1e6, "rope_freq_base_swa": 1e4})
    pos = np.array([0, 1, 7, 100])
    cos, sin = swa_rope_tables(cfg, pos)
    theta = pos[:, None] * (1e4 ** (-np.arange(4) * 2.0 / 8))[None, :]
    np.testing.assert_allclose(cos, np.cos(theta), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(theta), rtol=1e-6, atol=1e-7)


def _attention64(q, k, v, p0, scale):
    """float64 grouped-query causal attention: q (T, nkv, g, d), k, v (S, nkv, d) -> (T, nkv g d)."""
    T, nkv, g, d = q.shape
    out = np.zeros((T, nkv, g, d))
    for t in range(T):
        for h in range(nkv):
            s = k[: p0 + t + 1, h].astype(np.float64) @ q[t, h].astype(np.float64).T * scale  # (keys, g)
            p = np.exp(s - s.max(0))
            out[t, h] = (p / p.sum(0)).T @ v[: p0 + t + 1, h]
    return out.reshape(T, -1)


def test_causal_attention_default_scale_and_large_scores():
    """The default scale is 1/sqrt(head_dim); scores near 80 (where exp of a score, or of a score
    plus the row's largest, overflows float32) still give float64's softmax."""
    rng = np.random.default_rng(3)
    T, nkv, g, d, p0 = 3, 2, 2, 16, 4
    q = rng.standard_normal((T, nkv, g, d)).astype(np.float32)
    k = rng.standard_normal((p0 + T, nkv, d)).astype(np.float32)
    v = rng.standard_normal((p0 + T, nkv, d)).astype(np.float32)
    np.testing.assert_array_equal(causal_attention(q, k, v, p0), causal_attention(q, k, v, p0, 1 / np.sqrt(d)))
    np.testing.assert_allclose(causal_attention(q, k, v, p0), _attention64(q, k, v, p0, 1 / np.sqrt(d)), rtol=1e-4, atol=1e-5)
    big = 9 * q
    got = causal_attention(big, k, v, p0, 2.0)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _attention64(big, k, v, p0, 2.0), rtol=1e-3, atol=1e-4)


def test_verify_keeps_the_evaluated_token_and_the_accepted_drafts(data):
    """verify([t, d1 .. dk]) returns the accepted drafts and the next token (accept_greedy) and
    leaves the cache holding t and the accepted drafts only (n_past grows by one more than the
    accepted drafts); the next logits are those of a plain run fed the same tokens."""
    mf = open_model(data / "models" / "stories260K.gguf")
    plain, spec = NumpyBackend(mf, 64), NumpyBackend(mf, 64)
    prompt = [1, 403, 407, 261]
    greedy = [int(np.argmax(plain.eval(prompt)))]
    for _ in range(3):
        greedy.append(int(np.argmax(plain.eval([greedy[-1]]))))
    spec.eval(prompt)
    # t = greedy[0], drafts: two right ones, then a wrong one
    out = spec.verify([greedy[0], greedy[1], greedy[2], (greedy[3] + 1) % mf.config.n_vocab])
    assert out == [greedy[1], greedy[2], greedy[3]]
    assert spec.n_past == len(prompt) + 3  # t and the two accepted drafts
    np.testing.assert_allclose(spec.eval([greedy[3]]), plain.eval([greedy[3]]), rtol=0, atol=1e-5)


def test_phases_steps_and_memory_report(data):
    """A prompt is one prefill step, each single token a decode step (the trace `k4 bench` and the
    stats line print); the KV cache's report is its keys' and values' float32 bytes."""
    mf = open_model(data / "models" / "stories260K.gguf")
    be = NumpyBackend(mf, 32)
    be.eval([1, 403, 407])
    be.eval([5])
    be.eval([6])
    assert be.trace.get("prefill").steps == 1 and be.trace.get("decode").steps == 2
    c = mf.config
    assert be.memory_report()["kv_cache"] == 2 * 4 * c.n_layer * 32 * c.n_head_kv * c.head_dim


def test_generate_numbers_its_draws_from_zero(data, monkeypatch):
    """generate samples token i with draw number i (0, 1, 2 ...), the numbering the seeded sampler
    and the GPU's share (runtime/sampling.py): the same seed gives the same text on both."""
    from k4.runtime import reference

    seen, sample = [], reference.sample
    monkeypatch.setattr(reference, "sample", lambda logits, params, recent, step: seen.append(step) or sample(logits, params, recent, step))
    be = NumpyBackend(open_model(data / "models" / "stories260K.gguf"), 32)
    gen = be.generate([1, 403], reference.SamplingParams(seed=7))
    [next(gen) for _ in range(4)]
    assert seen == [0, 1, 2, 3]
