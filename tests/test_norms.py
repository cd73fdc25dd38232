"""RMSNorm where eps matters, on the numpy reference (the oracle every CUDA kernel is tested
against): runtime/reference.py rms_norm on rows with mean(x^2) from 0 to 100 eps
(tests/norm_inputs.py), and qwen3's per-head q/k RMSNorm on q and k of eps size, whose order
against RoPE (norm first, as llama.cpp's qwen3 graph does) is checked through the whole forward
pass against a float64 forward written here.

Limits: the reference computes in float32 and the formulas here in float64, so a correct norm
errs by a few float32 roundings (measured: at most 9e-8 relative for a norm row, 2.1e-7 for
the logits); each limit is about 10 times that: 1e-6 for a norm, 2e-6 for logits. The mistakes
these tests exist for (eps outside the sqrt, eps dropped, q/k norm after RoPE) move the same
outputs by 5e-3 or more (2.8e-2 for the q/k norm after RoPE); each test also checks that on its
own inputs, so it cannot pass a wrong norm by having inputs where eps does not matter."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend, rms_norm
from tests.norm_inputs import RATIOS, eps_outside_sqrt64, eps_rows, norm_weight, rms_norm64, row_errors
from tests.tiny import tiny_config, write_tiny

NORM_LIMIT = 1e-6  # float32 against float64, per row (relative L2); measured at most 9e-8
LOGITS_LIMIT = 2e-6  # float32 forward against float64 (relative L2); measured 2.1e-7


@pytest.mark.parametrize("n", [64, 896, 4096])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_where_eps_matters(n, eps):
    rng = np.random.default_rng(n + int(1 / eps))
    x, w = eps_rows(rng, n, eps), norm_weight(rng, n)  # (8, n), (n,)
    want = rms_norm64(x, w, eps)
    errs = row_errors(rms_norm(x, w, eps), want)
    assert (errs < NORM_LIMIT).all(), dict(zip(RATIOS, errs))
    # every non-zero row (mean(x^2) up to 100 eps): either mistake errs by 5e-3 or more (0.4
    # at 1 eps); the zero row's norm without eps is 0/0
    assert (row_errors(eps_outside_sqrt64(x, w, eps), want)[1:] > 1000 * NORM_LIMIT).all()
    with np.errstate(invalid="ignore"):
        assert (row_errors(rms_norm64(x, w, 0.0), want)[1:] > 1000 * NORM_LIMIT).all()


def test_rms_norm_batched_rows_are_independent():
    """(T, n_head, head_dim) as the q/k norm calls it: each head row normalized on its own."""
    rng = np.random.default_rng(11)
    x = eps_rows(rng, 16, 1e-5).reshape(2, 4, 16)  # (T, n_head, head_dim), heads of different size
    w = norm_weight(rng, 16)
    assert (row_errors(rms_norm(x, w, 1e-5), rms_norm64(x, w, 1e-5)) < NORM_LIMIT).all()


# ---- qwen3: per-head q/k RMSNorm, then RoPE ----------------------------------------------------

Q_SCALE, K_SCALE = 3e-3, 2e-3  # attn_q / attn_k weights scaled so mean(q^2), mean(k^2) ~ 1e-5 = eps


def write_qwen3(path, data):
    """A 2-layer qwen3 model, F32, whose q and k heads come out with mean square near eps (the
    normalized input has mean square about 1, so a weight of rms s/sqrt(n_in) gives about s^2),
    and whose q/k norm weights are unequal within each rotated pair (1 +- 0.3)."""
    cfg = tiny_config("qwen3")
    rng = np.random.default_rng(16)
    extra = {}
    for i in range(cfg.n_layer):
        for p, s, n_out in (("q", Q_SCALE, cfg.n_head), ("k", K_SCALE, cfg.n_head_kv)):
            m = rng.standard_normal((n_out * cfg.head_dim, cfg.n_embd)) * s / np.sqrt(cfg.n_embd)
            extra[f"blk.{i}.attn_{p}.weight"] = (m.astype(np.float32), T.F32)
            extra[f"blk.{i}.attn_{p}_norm.weight"] = (norm_weight(rng, cfg.head_dim), T.F32)
    write_tiny(path, data / "models" / "stories260K.gguf", cfg, T.F32, seed=16, skip=tuple(extra), extra=extra)
    return open_model(path)


def forward64(mf, ids, qk_norm_first: bool = True, qk_eps: float | None = None) -> np.ndarray:
    """Logits (T, n_vocab) of a qwen3 model on tokens ids (from position 0), float64: llama.cpp's
    qwen3 graph (RMSNorm, q/k/v, per-head q/k RMSNorm, NeoX RoPE, causal grouped-query
    attention, SwiGLU). qk_norm_first=False and qk_eps are the mistakes the tests must reject."""
    cfg = mf.config
    eps, T_, hd, nh, nkv = cfg.rms_eps, len(ids), cfg.head_dim, cfg.n_head, cfg.n_head_kv
    qk_eps = eps if qk_eps is None else qk_eps

    def w(name):
        t = mf.tensor(name)
        return dequantize(t.raw, t.ggml_type).astype(np.float64).reshape(t.shape)

    half = cfg.rope_dim // 2
    theta = np.arange(T_)[:, None] * cfg.rope_freq_base ** (-2.0 * np.arange(half) / cfg.rope_dim)  # (T, half)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # (T, 1, half)

    def rope(x):  # (T, heads, hd), NeoX: dims i and i + rope_dim/2 form a pair
        a, b = x[..., :half], x[..., half : cfg.rope_dim]
        return np.concatenate([a * c - b * s, a * s + b * c, x[..., cfg.rope_dim :]], axis=-1)

    def norm_rope(x, nw):
        return rope(rms_norm64(x, nw, qk_eps)) if qk_norm_first else rms_norm64(rope(x), nw, qk_eps)

    causal = np.triu(np.ones((T_, T_), bool), 1)  # (T, T): key s > query t is hidden
    x = w("token_embd.weight")[ids]  # (T, n_embd)
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        h = rms_norm64(x, w(b + "attn_norm.weight"), eps)
        q = norm_rope((h @ w(b + "attn_q.weight").T).reshape(T_, nh, hd), w(b + "attn_q_norm.weight"))
        k = norm_rope((h @ w(b + "attn_k.weight").T).reshape(T_, nkv, hd), w(b + "attn_k_norm.weight"))
        v = (h @ w(b + "attn_v.weight").T).reshape(T_, nkv, hd)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # query head j reads kv head j // n_gqa
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)  # (nh, T, T)
        scores[:, causal] = -np.inf
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(T_, nh * hd) @ w(b + "attn_output.weight").T
        h = rms_norm64(x, w(b + "ffn_norm.weight"), eps)
        g = h @ w(b + "ffn_gate.weight").T
        x = x + (g / (1 + np.exp(-g)) * (h @ w(b + "ffn_up.weight").T)) @ w(b + "ffn_down.weight").T
    return rms_norm64(x, w("output_norm.weight"), eps) @ w("output.weight").T


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, data):
    return write_qwen3(tmp_path_factory.mktemp("qwen3") / "qk-eps.gguf", data)


IDS = [1, 403, 407, 261, 378, 12, 88, 301, 45]


def test_qwen3_inputs_put_the_qk_norm_near_eps(qwen3):
    """The test model does what it is for: the first layer's q and k heads have mean square
    within 0.1..10 eps, and the two mistakes move the logits far past LOGITS_LIMIT."""
    cfg = qwen3.config
    t = qwen3.tensor("token_embd.weight")
    x = dequantize(t.raw, t.ggml_type).reshape(t.shape)[IDS].astype(np.float64)
    t = qwen3.tensor("blk.0.attn_norm.weight")
    h = rms_norm64(x, dequantize(t.raw, t.ggml_type), cfg.rms_eps)
    for p, heads in (("q", cfg.n_head), ("k", cfg.n_head_kv)):
        t = qwen3.tensor(f"blk.0.attn_{p}.weight")
        y = (h @ dequantize(t.raw, t.ggml_type).reshape(t.shape).T).reshape(len(IDS), heads, cfg.head_dim)
        ratio = np.mean(y * y, axis=-1) / cfg.rms_eps
        assert 0.1 < ratio.min() and ratio.max() < 10, (p, ratio.min(), ratio.max())
    want = forward64(qwen3, IDS)
    assert rel_l2(forward64(qwen3, IDS, qk_norm_first=False), want) > 1000 * LOGITS_LIMIT  # 2.8e-2
    assert rel_l2(forward64(qwen3, IDS, qk_eps=0.0), want) > 1000 * LOGITS_LIMIT  # 0.29


def test_qwen3_reference_norms_q_and_k_before_rope(qwen3):
    """Prefill of all tokens, then the same tokens as a prefill and two decode steps: every
    position's logits equal the float64 forward's."""
    want = forward64(qwen3, IDS)  # (T, n_vocab)
    be = NumpyBackend(qwen3, 32)
    assert rel_l2(be.eval(IDS, all_logits=True), want) < LOGITS_LIMIT
    be.reset()
    assert rel_l2(be.eval(IDS[:-2]), want[-3]) < LOGITS_LIMIT
    assert rel_l2(be.eval(IDS[-2:-1]), want[-2]) < LOGITS_LIMIT
    assert rel_l2(be.eval(IDS[-1:]), want[-1]) < LOGITS_LIMIT
