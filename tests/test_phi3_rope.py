"""phi3's fused tensors and the RoPE scaling files declare (runtime/rope.py), on the numpy backend.

The end-to-end check against transformers is tests/test_oracles.py (phi3 with partial rotary and
LongRoPE, llama with YaRN); these pin the pieces: the row views of a fused tensor, the choice of
LongRoPE factors by context, the YaRN and linear tables, and the metadata that selects them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from k4.runtime.errors import ModelFileError, UnsupportedModelError
from k4.runtime.model import expected_shapes, layer_matrices, open_model
from k4.runtime.reference import NumpyBackend
from k4.runtime.rope import factor_tensor, rope_table, yarn_corr_dims
from k4.runtime.synthetic import vocab_from, write_metadata
from k4.runtime.weights import dequantize_tensor
from tests.tiny import tiny_config, write_tiny


def vocab(data):
    return data / "models" / "stories260K.gguf"


@pytest.mark.parametrize("ttype", [T.F32, T.Q8_0])
def test_fused_tensors_split_into_row_views_of_the_file(data, tmp_path, ttype):
    cfg = tiny_config("phi3")
    mf = open_model(write_tiny(tmp_path / "phi3.gguf", vocab(data), cfg, ttype))
    assert mf.config.fused_qkv and mf.config.fused_gate_up
    assert mf.tensor("blk.1.attn_qkv.weight").shape == (cfg.q_dim + 2 * cfg.kv_dim, cfg.n_embd)
    assert mf.tensor("blk.1.ffn_up.weight").shape == (2 * cfg.n_ff, cfg.n_embd)
    m = layer_matrices(mf, 1)
    qkv = dequantize_tensor(mf.tensor("blk.1.attn_qkv.weight"))
    up = dequantize_tensor(mf.tensor("blk.1.ffn_up.weight"))
    q, k = cfg.q_dim, cfg.kv_dim
    want = {"attn_q": qkv[:q], "attn_k": qkv[q : q + k], "attn_v": qkv[q + k :], "ffn_gate": up[: cfg.n_ff], "ffn_up": up[cfg.n_ff :]}
    raw = mf.path.read_bytes()
    for name, rows in want.items():
        t = m[name]
        assert t.name == f"blk.1.{name}.weight" and t.shape == rows.shape
        np.testing.assert_array_equal(dequantize_tensor(t), rows)
        # the CUDA loader reads a view from the file at its offset: the same bytes
        assert raw[t.file_offset : t.file_offset + t.n_bytes] == t.raw_bytes().tobytes()


def split_copy(mf, path):
    """The phi3 file `mf` rewritten with attn_q/k/v instead of attn_qkv (llama.cpp loads either)."""
    cfg = mf.config
    w = GGUFWriter(str(path), cfg.arch)
    write_metadata(w, cfg, vocab_from(mf.path, cfg.n_vocab))
    for name, t in mf.tensors.items():
        if name.endswith("attn_qkv.weight"):
            i = int(name.split(".")[1])
            for part, view in layer_matrices(mf, i).items():
                if part in ("attn_q", "attn_k", "attn_v"):
                    w.add_tensor(view.name, dequantize_tensor(view))
        else:
            w.add_tensor(name, dequantize_tensor(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_model(path)


def test_phi3_with_fused_or_separate_qkv_computes_the_same(data, tmp_path):
    mf = open_model(write_tiny(tmp_path / "fused.gguf", vocab(data), tiny_config("phi3", rope_dim=8), T.F32))
    sep = split_copy(mf, tmp_path / "separate.gguf")
    assert mf.config.fused_qkv and not sep.config.fused_qkv and sep.config.fused_gate_up
    ids = np.random.default_rng(1).integers(3, 512, size=12).tolist()
    np.testing.assert_array_equal(NumpyBackend(mf, 32).eval(ids, all_logits=True), NumpyBackend(sep, 32).eval(ids, all_logits=True))


def test_phi3_ffn_up_must_hold_gate_and_up_rows(data, tmp_path):
    cfg = tiny_config("phi3")
    path = write_tiny(tmp_path / "bad.gguf", vocab(data), cfg, T.F32, skip=("blk.0.ffn_up.weight",),
                      extra={"blk.0.ffn_up.weight": (np.zeros((cfg.n_ff, cfg.n_embd), np.float32), T.F32)})
    with pytest.raises(ModelFileError, match=r"phi3.feed_forward_length' = 96.*the 96 rows of blk.0.ffn_up"):
        open_model(path)


def longrope_model(data, tmp_path):
    cfg = tiny_config("phi3", rope_dim=8, rope_scaling="longrope", rope_orig_ctx=32, rope_attn_factor=1.25)
    return open_model(write_tiny(tmp_path / "longrope.gguf", vocab(data), cfg, T.F32))


def test_longrope_takes_long_factors_past_the_original_context(data, tmp_path):
    mf = longrope_model(data, tmp_path)
    cfg = mf.config
    assert (cfg.rope_scaling, cfg.rope_orig_ctx, cfg.rope_attn_factor) == ("longrope", 32, 1.25)
    assert factor_tensor(cfg, 32) == "rope_factors_short.weight"  # llama.cpp: n_ctx > n_ctx_orig_yarn for long
    assert factor_tensor(cfg, 33) == "rope_factors_long.weight"
    base = 10000.0 ** (-np.arange(4) * 2 / 8)
    for n_ctx, name in ((32, "rope_factors_short.weight"), (64, "rope_factors_long.weight")):
        be = NumpyBackend(mf, n_ctx)
        np.testing.assert_allclose(be.rope.inv_freq, base / dequantize_tensor(mf.tensor(name)), rtol=1e-12)
        assert be.rope.mscale == 1.25
    ids = [1, 7, 9, 11]
    assert not np.allclose(NumpyBackend(mf, 32).eval(ids), NumpyBackend(mf, 64).eval(ids))


def test_yarn_table_blends_by_pair_and_scales_the_magnitude():
    cfg = tiny_config("llama", rope_dim=64, head_dim=64, rope_scaling="yarn", rope_scale=4.0, rope_orig_ctx=256)
    low, high = yarn_corr_dims(cfg)
    # ggml_rope_yarn_corr_dims: 64 ln(256 / (2 pi beta)) / (2 ln 10000), floored / ceiled
    assert (low, high) == (math.floor(64 * math.log(256 / (64 * math.pi)) / (2 * math.log(1e4))),
                           math.ceil(64 * math.log(256 / (2 * math.pi)) / (2 * math.log(1e4))))
    t = rope_table(cfg, 1024, None)
    base = 10000.0 ** (-np.arange(32) * 2 / 64)
    np.testing.assert_array_equal(t.inv_freq[: int(low) + 1], base[: int(low) + 1])  # fast pairs: original
    np.testing.assert_allclose(t.inv_freq[int(high):], base[int(high):] / 4, rtol=1e-15)  # slow pairs: interpolated
    mid = t.inv_freq[int(low) + 1 : int(high)] / base[int(low) + 1 : int(high)]
    assert np.all((mid < 1) & (mid > 0.25)) and np.all(np.diff(mid) < 0)  # the ramp between
    assert t.mscale == pytest.approx(1 + 0.1 * math.log(4))


def test_yarn_ramp_starts_at_its_low_pair_and_high_stops_at_the_last_pair():
    """llama.cpp's rope_yarn_ramp: pair i blends by y = (i - low) / (high - low), clipped to [0, 1]
    (a model whose low pair is not 0: original context 4,096 gives low 10, high 23); high is
    clamped to rope_dim / 2 - 1 pairs (base 100 at 65,536 positions: ceil(64.3) -> 63); a scale of
    1.5 still scales the magnitude by 1 + 0.1 ln 1.5."""
    cfg = tiny_config("llama", rope_dim=64, head_dim=64, rope_scaling="yarn", rope_scale=4.0, rope_orig_ctx=4096)
    assert yarn_corr_dims(cfg) == (10.0, 23.0)
    base = 10000.0 ** (-np.arange(32) * 2 / 64)
    inv = rope_table(cfg, 8192, None).inv_freq
    for i, y in [(10, 0.0), (11, 1 / 13), (17, 7 / 13), (23, 1.0)]:  # weight y on the interpolated base / 4
        assert inv[i] == pytest.approx(base[i] * (y / 4 + (1 - y)), rel=1e-14), i
    far = tiny_config("llama", rope_dim=64, head_dim=64, rope_freq_base=100.0, rope_scaling="yarn", rope_scale=4.0,
                      rope_orig_ctx=65536)
    assert yarn_corr_dims(far) == (40.0, 63.0)
    mild = tiny_config("llama", rope_dim=64, head_dim=64, rope_scaling="yarn", rope_scale=1.5, rope_orig_ctx=4096)
    assert rope_table(mild, 8192, None).mscale == pytest.approx(1 + 0.1 * math.log(1.5), rel=1e-12)


def test_linear_scaling_divides_positions_and_unscaled_models_keep_their_table():
    plain = tiny_config("llama")
    lin = tiny_config("llama", rope_scaling="linear", rope_scale=8.0)
    a, b = rope_table(plain, 128, None), rope_table(lin, 128, None)
    np.testing.assert_allclose(b.inv_freq, a.inv_freq / 8, rtol=1e-15)
    assert a.mscale == b.mscale == 1.0
    np.testing.assert_array_equal(a.inv_freq, 10000.0 ** (-np.arange(8, dtype=np.float64) * 2 / 16))


@pytest.mark.parametrize("kind, want", [("yarn", "yarn"), ("linear", "linear")])
def test_scaling_keys_are_read_back(data, tmp_path, kind, want):
    cfg = tiny_config("llama", rope_scaling=kind, rope_scale=4.0, rope_orig_ctx=16)
    got = open_model(write_tiny(tmp_path / "m.gguf", vocab(data), cfg, T.F32)).config
    assert (got.rope_scaling, got.rope_scale, got.rope_orig_ctx) == (want, 4.0, 16)
    assert (got.rope_yarn_beta_fast, got.rope_yarn_beta_slow) == (32.0, 1.0)


def test_scaling_type_k4_does_not_run_is_one_line(data, tmp_path):
    cfg = tiny_config("llama")
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    write_metadata(w, cfg, vocab_from(vocab(data), cfg.n_vocab))
    w.add_string("llama.rope.scaling.type", "dynamic-ntk")
    rng = np.random.default_rng(0)
    for name, shape in expected_shapes(cfg).items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'dynamic-ntk' is not supported"):
        open_model(path)


@pytest.mark.cuda
@pytest.mark.parametrize("scaling", ["yarn", "longrope"])
def test_gpu_rope_applies_the_scaled_table_and_its_magnitude(scaling):
    """rope_qk_store with a YaRN table (magnitude 1.139) or LongRoPE factors with a magnitude of
    1.25 and partial rotary (24 of 32 dims): q and the cached k as numpy's apply_rope over
    rope_tables of the same runtime/rope.py table (fp16 cache: 1e-3; the pass-through dims are
    not scaled)."""
    import cupy as cp

    from k4.runtime.cuda.ops import Ops, RopeArgs
    from k4.runtime.reference import apply_rope, rope_tables
    from k4.runtime.trace import Trace

    rng = np.random.default_rng(11)
    n_tok, n_head, n_kv, D, rope_dim, pos0 = 5, 4, 2, 32, 24, 300
    over = (dict(rope_scaling="yarn", rope_scale=4.0, rope_orig_ctx=64) if scaling == "yarn"
            else dict(rope_scaling="longrope", rope_orig_ctx=64, rope_attn_factor=1.25))
    cfg = tiny_config("llama" if scaling == "yarn" else "phi3", head_dim=D, rope_dim=rope_dim, n_head=n_head, n_head_kv=n_kv, **over)
    factors = (1.0 + 3.0 * rng.random(rope_dim // 2)) if scaling == "longrope" else None
    table = rope_table(cfg, 512, factors)
    assert table.mscale != 1.0
    q = rng.standard_normal((n_tok, n_head, D)).astype(np.float32)
    k = rng.standard_normal((n_tok, n_kv, D)).astype(np.float32)
    v = rng.standard_normal((n_tok, n_kv, D)).astype(np.float32)
    cos, sin = rope_tables(table, np.arange(pos0, pos0 + n_tok))
    q_want = apply_rope(q, cos, sin, rope_dim, cfg.rope_neox)
    k_want = apply_rope(k, cos, sin, rope_dim, cfg.rope_neox)
    kc, vc = cp.zeros((512, n_kv, D), cp.float16), cp.zeros((512, n_kv, D), cp.float16)
    qd = cp.asarray(q)
    rope = RopeArgs(None, None, cp.asarray(table.inv_freq), rope_dim, cfg.rope_neox, cfg.rms_eps, table.mscale)
    Ops(Trace()).rope_qk_store(qd, cp.asarray(k), cp.asarray(v), kc, vc, rope, cp.asarray([pos0], dtype=cp.int32))
    got_q, got_k = qd.get(), kc.get()[pos0 : pos0 + n_tok].astype(np.float32)
    assert np.linalg.norm(got_q - q_want) / np.linalg.norm(q_want) < 1e-5
    assert np.linalg.norm(got_k - k_want) / np.linalg.norm(k_want) < 1e-3
    np.testing.assert_array_equal(got_q[..., rope_dim:], q[..., rope_dim:])  # pass-through: no magnitude


def test_info_names_the_rope_scaling(data):
    from typer.testing import CliRunner

    from k4.cli.app import app

    def rope_row(name):
        r = CliRunner().invoke(app, ["info", "-m", str(data / "oracles" / name)])
        assert r.exit_code == 0, r.output
        return next(line for line in r.stdout.splitlines() if " rope " in line)

    assert "normal, dim 16, freq_base 10000, yarn x4 from 32 " in rope_row("tiny-llama-yarn.gguf")
    assert "neox, dim 24, freq_base 10000, longrope from 32 " in rope_row("tiny-phi3.gguf")
