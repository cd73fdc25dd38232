"""The Gemma families (gemma3, gemma2) on the numpy backend, beyond the transformers oracle
(tests/test_oracles.py): the sliding-window, query-scale and soft-cap attention against a direct
float64 formula; prefill against token-by-token decode on models whose sliding and global layers
both matter; the config as llama.cpp derives it from the keys (pattern, window, RoPE base,
27B query scale, soft-cap defaults) and its round trip through a written file; the schema's
message for a bad pattern; the synth presets' real shapes; `k4 run`, `k4 perplexity` and
`k4 bench` end to end on a tiny gemma3."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime import reference
from k4.runtime.arch import ARCHITECTURES
from k4.runtime.errors import ModelFileError
from k4.runtime.family_keys import family_fields
from k4.runtime.model import expected_shapes, open_model
from k4.runtime.reference import NumpyBackend, causal_attention
from k4.runtime.synthetic import PRESETS, q4_k_m_types
from tests.tiny import tiny_config, write_tiny

runner = CliRunner()


def attention_f64(q, kc, vc, pos0: int, scale: float, window: int = 0, cap: float = 0.0):
    """q (T, H, D); kc, vc (>= pos0 + T, Hkv, D) -> (T, H, D) float64: query t at pos0 + t sees
    keys max(0, pos0 + t - window + 1) .. pos0 + t (all from 0 when window is 0), scores
    cap * tanh(scale q.k / cap) (scale q.k when cap is 0)."""
    T, H, D = q.shape
    g = H // kc.shape[1]
    out = np.empty((T, H, D))
    for t in range(T):
        p = pos0 + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            keys, vals = kc[lo : p + 1, h // g].astype(np.float64), vc[lo : p + 1, h // g].astype(np.float64)
            s = keys @ q[t, h].astype(np.float64) * scale
            if cap:
                s = cap * np.tanh(s / cap)
            e = np.exp(s - s.max())
            out[t, h] = e @ vals / e.sum()
    return out


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("window,cap", [(0, 0.0), (1, 0.0), (5, 0.0), (5, 3.0), (0, 3.0), (64, 0.0)])
def test_attention_window_and_softcap_match_float64(window, cap):
    rng = np.random.default_rng(window * 10 + int(cap))
    T, p0, nkv, gqa, D = 12, 9, 2, 3, 16
    q = rng.standard_normal((T, nkv * gqa, D)).astype(np.float32)
    keys = (2 * rng.standard_normal((p0 + T, nkv, D))).astype(np.float32)
    vals = rng.standard_normal((p0 + T, nkv, D)).astype(np.float32)
    got = causal_attention(q.reshape(T, nkv, gqa, D), keys, vals, p0, 0.3, window, cap).reshape(T, -1, D)
    assert rel_l2(got, attention_f64(q, keys, vals, p0, 0.3, window, cap)) < 1e-6
    if window == 1:  # each query sees only its own key: the output is its own value
        np.testing.assert_allclose(got, np.repeat(vals[p0:], gqa, axis=1), rtol=1e-6)
    if window >= p0 + T:  # a window over the whole cache changes nothing, bit for bit
        assert np.array_equal(got, causal_attention(q.reshape(T, nkv, gqa, D), keys, vals, p0, 0.3, 0, cap).reshape(T, -1, D))


def test_gelu_tanh_is_within_its_approximation_error_of_gelu():
    """GeGLU's activation against the exact GELU, x Phi(x) by math.erf (Hendrycks & Gimpel 2016):
    the tanh form errs by at most 4.7e-4 on [-6, 6] (measured); a wrong constant (0.04 for
    0.044715: 2.9e-3) or a scaled output (Gemma's post-FFN norm hides a scale from the oracles)
    does not fit in 1e-3, and the tanh form is not the erf form (it differs by over 1e-4)."""
    x = np.linspace(-6, 6, 2001).astype(np.float32)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    y = reference.gelu_tanh(x)
    err = np.abs(y.astype(np.float64) - exact)
    assert y.dtype == np.float32 and 1e-4 < err.max() < 1e-3


def test_windowed_attention_in_blocks_of_rows(monkeypatch):
    """The blocked form reads only the keys each block of rows sees; results agree with one block."""
    rng = np.random.default_rng(3)
    T, nkv, gqa, D = 40, 1, 2, 8
    q = rng.standard_normal((T, nkv, gqa, D)).astype(np.float32)
    keys, vals = (rng.standard_normal((T, nkv, D)).astype(np.float32) for _ in range(2))
    whole = causal_attention(q, keys, vals, 0, None, 6, 0.0)
    monkeypatch.setattr(reference, "ATTN_SCORES_MAX", 3 * nkv * gqa * T)  # 3 rows per block
    assert rel_l2(causal_attention(q, keys, vals, 0, None, 6, 0.0), whole) < 1e-6


def gemma_tiny(arch: str, keys: dict, n_layer: int = 4, head_dim: int = 16, **over):
    """A tiny config of a Gemma family whose file carries `keys` ({arch}.* suffix -> value)."""
    fields = family_fields(ARCHITECTURES[arch], keys, n_layer, 64, 4, head_dim, 10000.0)
    return tiny_config(arch, n_layer=n_layer, head_dim=head_dim, rope_dim=head_dim, has_qk_norm=arch == "gemma3",
                       tied_embeddings=True, **fields, **over)


GEMMA_CASES = {
    # gemma3: an explicit pattern (sliding, global, sliding, sliding), window 5, RoPE 1e6 with linear
    # scaling 8 on the global layer / 10,000 on the sliding ones
    "gemma3": ("gemma3", {"attention.sliding_window": 5, "attention.sliding_window_pattern": (True, False, True, True)},
               dict(rope_freq_base=1e6, rope_scaling="linear", rope_scale=8.0)),
    # gemma2: the default alternation, window 4, soft-caps that bend this model's scores and logits
    "gemma2": ("gemma2", {"attention.sliding_window": 4, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 8.0}, {}),
}


@pytest.fixture(params=list(GEMMA_CASES))
def gemma_file(request, tmp_path, data):
    arch, keys, over = GEMMA_CASES[request.param]
    cfg = gemma_tiny(arch, keys, **over)
    return write_tiny(tmp_path / f"{arch}.gguf", data / "models" / "stories260K.gguf", cfg), cfg


def test_config_round_trips_through_the_file(gemma_file):
    path, cfg = gemma_file
    got = open_model(path).config
    assert replace(got, name=cfg.name, rms_eps=cfg.rms_eps) == cfg  # the file holds eps as float32
    assert any(got.swa_layers) and not all(got.swa_layers)
    assert {"blk.0.post_attention_norm.weight", "blk.3.post_ffw_norm.weight"} <= set(expected_shapes(got))


def test_prefill_equals_token_by_token(gemma_file):
    """22 tokens past windows of 4-5: every sliding layer drops keys, in prefill (one call, two
    calls) and in decode alike."""
    path, _ = gemma_file
    ids = [1] + np.random.default_rng(0).integers(3, 512, size=21).tolist()
    be = NumpyBackend(open_model(path), 64)
    whole = be.eval(ids, all_logits=True)
    be.reset()
    steps = np.stack([be.eval([t]) for t in ids])
    be.reset()
    two = np.concatenate([be.eval(ids[:7], all_logits=True), be.eval(ids[7:], all_logits=True)])
    assert rel_l2(steps, whole) < 1e-5 and rel_l2(two, whole) < 1e-5
    be.reset()  # the window matters: without it the logits move (self-consistency alone would not see it)
    be.config = replace(be.config, swa_layers=())
    assert rel_l2(be.eval(ids, all_logits=True), whole) > 1e-2


def test_family_fields_follow_llama_cpp():
    g3, g2 = ARCHITECTURES["gemma3"], ARCHITECTURES["gemma2"]
    f = family_fields(g3, {"attention.sliding_window": 1024}, 48, 3840, 16, 256, 1e6)  # Gemma 3 12B
    assert f["swa_layers"] == tuple(i % 6 < 5 for i in range(48)) and f["n_swa"] == 1024
    assert f["rope_freq_base_swa"] == 10000.0 and f["attn_scale"] == 0.0 and f["final_softcap"] == 0.0
    assert f["embed_scale"] == pytest.approx(math.sqrt(3840)) and f["activation"] == "gelu_tanh"
    f27 = family_fields(g3, {"attention.sliding_window": 1024}, 62, 5376, 32, 128, 1e6)  # 27B: query_pre_attn_scalar 168
    assert f27["attn_scale"] == pytest.approx(1 / math.sqrt(168))
    assert family_fields(g3, {}, 26, 1152, 4, 256, 1e6)["swa_layers"] == ()  # no window key: every layer global
    assert family_fields(g3, {"attention.sliding_window": 512, "attention.sliding_window_pattern": 2}, 4, 64, 4, 16,
                         1e6)["swa_layers"] == (True, False, True, False)
    f2 = family_fields(g2, {}, 42, 3584, 16, 256, 1e4)  # Gemma 2 9B, no keys: llama.cpp's defaults
    assert (f2["n_swa"], f2["attn_softcap"], f2["final_softcap"], f2["rope_freq_base_swa"]) == (4096, 50.0, 30.0, 1e4)
    assert f2["swa_layers"][:4] == (True, False, True, False)
    assert family_fields(g2, {}, 42, 3584, 16, 256, 5e5)["rope_freq_base_swa"] == 5e5  # gemma2: the global base, not 10,000
    assert family_fields(g2, {}, 46, 4608, 32, 128, 1e4)["attn_scale"] == pytest.approx(1 / math.sqrt(144))
    llama = family_fields(ARCHITECTURES["llama"], {"attention.sliding_window": 4096}, 32, 4096, 32, 128, 1e4)
    assert llama == family_fields(ARCHITECTURES["llama"], {}, 32, 4096, 32, 128, 1e4)  # Mistral's key is ignored
    assert (llama["n_swa"], llama["swa_layers"], llama["activation"], llama["embed_scale"]) == (0, (), "silu", 1.0)


@pytest.mark.parametrize("arch, keys", [
    ("gemma3", {"attention.sliding_window": 5}),  # the family's 5:1 pattern and local base: the window alone
    ("gemma3", {"attention.sliding_window": 5, "attention.sliding_window_pattern": (True, False, True, True)}),
    ("gemma3", {"attention.sliding_window": 5, "rope.freq_base_swa": 20000.0}),
    ("gemma2", {"attention.sliding_window": 4}),  # gemma2: the global base and llama.cpp's caps
    ("gemma2", {"attention.sliding_window": 4, "rope.freq_base_swa": 5e5, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 8.0}),
    ("llama", {}),  # a family without these options: no key
])
def test_family_keys_are_the_fewest_that_give_the_config_back(arch, keys):
    """family_keys (what synth and the tests write) is family_fields' inverse: the keys a config
    needs and no others (a value equal to the family's default is left out), and reading them
    gives back the config's fields."""
    from k4.runtime.family_keys import family_keys

    a = ARCHITECTURES[arch]
    cfg = gemma_tiny(arch, keys)
    read = {k: tuple(v) if isinstance(v, list) else v for k, v in family_keys(cfg).items()}  # lists read back as tuples
    assert read == keys
    fields = family_fields(a, read, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.rope_freq_base)
    assert all(getattr(cfg, k) == v for k, v in fields.items())

def test_a_pattern_of_the_wrong_length_is_refused(tmp_path, data):
    cfg = gemma_tiny("gemma3", {"attention.sliding_window": 5, "attention.sliding_window_pattern": (True, False, True, True)})
    path = write_tiny(tmp_path / "bad.gguf", data / "models" / "stories260K.gguf", replace(cfg, swa_layers=(True, False, True)))
    with pytest.raises(ModelFileError, match=r"'gemma3.attention.sliding_window_pattern' = an array of 3 BOOL; "
                                             r"expected a period in 1..4 or an array of 4 booleans"):
        open_model(path)


@pytest.mark.parametrize("name,n_embd,n_layer,n_head,n_head_kv,head_dim,n_ff,sliding", [
    ("gemma3-12b", 3840, 48, 16, 8, 256, 15360, 40), ("gemma3-27b", 5376, 62, 32, 16, 128, 21504, 52)])
def test_synth_presets_have_the_real_shapes(name, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, sliding):
    cfg = PRESETS[name].config(name)
    assert (cfg.arch, cfg.n_vocab, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff) == (
        "gemma3", 262144, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff)
    assert cfg.tied_embeddings and cfg.has_qk_norm and cfg.has_post_norms and cfg.n_swa == 1024
    assert sum(cfg.swa_layers) == sliding and cfg.rope_freq_base == 1e6 and cfg.rope_freq_base_swa == 1e4
    assert (cfg.rope_scaling, cfg.rope_scale) == ("linear", 8.0)  # the global layers' (config.json rope_scaling)
    types = q4_k_m_types(cfg)
    assert types["token_embd.weight"] == T.Q6_K  # the tied output's type, as llama.cpp's Q4_K_M
    assert types["blk.0.post_ffw_norm.weight"] == T.F32 and types["blk.10.ffn_gate.weight"] == T.Q4_K


def test_cli_run_perplexity_and_bench_on_gemma3(tmp_path, data):
    cfg = gemma_tiny("gemma3", {"attention.sliding_window": 5, "attention.sliding_window_pattern": (True, False, True, True)})
    model = str(write_tiny(tmp_path / "g3.gguf", data / "models" / "stories260K.gguf", cfg))
    r = runner.invoke(app, ["run", "--backend", "numpy", "--temp", "0", "--json", "-m", model, "-n", "12", "Once upon a time"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["generated_tokens"] == 12
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a little girl who liked to play in the park with her dog. " * 4)
    r = runner.invoke(app, ["perplexity", "--backend", "numpy", "-m", model, "-f", str(text), "-c", "32"])
    assert r.exit_code == 0, r.output
    assert "PPL = " in r.stdout
    r = runner.invoke(app, ["bench", "--backend", "numpy", "-m", model, "-p", "16", "-n", "4", "-r", "1", "-o", "json"])
    assert r.exit_code == 0, r.output
