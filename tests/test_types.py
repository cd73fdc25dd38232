"""Q2_K, Q3_K, Q4_0, IQ4_XS and IQ4_NL on the CPU (issue 18; IQ4_NL: llama.cpp's fallback in Q2_K,
Q3_K and IQ4_XS files for rows that are not a multiple of 256): the numpy backend's dequantization (the
gguf package's, runtime/weights.py) against a scalar transcription of ggml-quants.c's
dequantize_row_* written here, bit for bit; a tiny model of each type through the numpy backend
against an F32 file holding the same weights decoded by that transcription; `k4 info` and the
quantize planner on such a file; runtime.synthetic.random_blocks for these types.

The CUDA decoders of these types are tested in tests/test_cuda_gemv.py and
tests/test_cuda_matmul.py (gemv, matmul, dequant_rows against gguf) and tests/test_cuda_backend.py
(whole models: tests/cuda_backend_cases.py ARCH_CASES)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime import weights
from k4.runtime.model import SUPPORTED_TYPES, Tensor, open_model
from k4.runtime.quantize import copy_metadata
from k4.runtime.reference import NumpyBackend
from k4.runtime.synthetic import random_blocks
from tests import tiny
from tests.quant_blocks import blocks_like

NEW_TYPES = (T.Q2_K, T.Q3_K, T.Q4_0, T.IQ4_XS, T.IQ4_NL)
F = np.float32
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h


# ---- ggml-quants.c dequantize_row_*, in C's loop order, vectorized over blocks only ------------
# Every product and difference is one float32 operation, as the C code (without FMA contraction)
# and the gguf package compute them. b: uint8 (n_blocks, block bytes) -> float32 (n_blocks, weights).

def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[:, at : at + 2].copy().view(np.float16).astype(F)[:, 0]


def c_q2_K(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b, 80), _f16(b, 82)
    y, sc_i = [], 0
    for n in (0, 128):
        q = b[:, 16 + n // 4 : 16 + n // 4 + 32]  # q += 32 after each 128 weights
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                sc = b[:, sc_i]
                sc_i += 1
                dl, ml = d * (sc & 0xF).astype(F), dmin * (sc >> 4).astype(F)
                y.append(dl[:, None] * ((q[:, half : half + 16] >> shift) & 3).astype(F) - ml[:, None])
    return np.concatenate(y, axis=1)


def q3_K_codes(b: np.ndarray) -> np.ndarray:
    """(n_blocks, 16) 6-bit scale codes of block_q3_K, unpacked as dequantize_row_q3_K does it:
    the 12 bytes as three little-endian words, rearranged with kmask1/kmask2 into 16 bytes."""
    aux = b[:, 96:108].copy().view("<u4").astype(np.uint32)  # (n, 3)
    k1, k2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    a0, a1, tmp = aux[:, 0], aux[:, 1], aux[:, 2]
    words = np.stack([(a0 & k2) | (((tmp >> 0) & k1) << 4), (a1 & k2) | (((tmp >> 2) & k1) << 4),
                      ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4), ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4)], axis=1)
    return words.astype("<u4").view(np.uint8)  # (n, 16)


def c_q3_K(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 108)
    scales = q3_K_codes(b).astype(np.int32) - 32
    hm = b[:, :32]
    y, sc_i, m = [], 0, 1
    for n in (0, 128):
        q = b[:, 32 + n // 4 : 32 + n // 4 + 32]
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                dl = d * scales[:, sc_i].astype(F)
                sc_i += 1
                low = ((q[:, half : half + 16] >> shift) & 3).astype(np.int32)
                y.append(dl[:, None] * (low - np.where(hm[:, half : half + 16] & m, 0, 4)).astype(F))
            m <<= 1
    return np.concatenate(y, axis=1)


def c_q4_0(b: np.ndarray) -> np.ndarray:
    d, qs = _f16(b, 0), b[:, 2:18]
    lo = ((qs & 0xF).astype(np.int32) - 8).astype(F)
    hi = ((qs >> 4).astype(np.int32) - 8).astype(F)
    return np.concatenate([lo * d[:, None], hi * d[:, None]], axis=1)


def iq4_xs_codes(b: np.ndarray) -> np.ndarray:
    """(n_blocks, 8) 6-bit scale codes of block_iq4_xs (dequantize_row_iq4_xs)."""
    scales_h = b[:, 2:4].copy().view("<u2")[:, 0].astype(np.int32)
    return np.stack([((b[:, 4 + ib // 2] >> 4 * (ib % 2)) & 0xF).astype(np.int32) | (((scales_h >> 2 * ib) & 3) << 4)
                     for ib in range(8)], axis=1)


def c_iq4_xs(b: np.ndarray) -> np.ndarray:
    d, kv = _f16(b, 0), np.array(KVALUES_IQ4NL, np.int32)
    codes = iq4_xs_codes(b)
    y = []
    for ib in range(8):
        dl = d * (codes[:, ib] - 32).astype(F)
        qs = b[:, 8 + 16 * ib : 8 + 16 * ib + 16]
        y += [dl[:, None] * kv[qs & 0xF].astype(F), dl[:, None] * kv[qs >> 4].astype(F)]
    return np.concatenate(y, axis=1)



def c_iq4_nl(b: np.ndarray) -> np.ndarray:
    d, kv, qs = _f16(b, 0), np.array(KVALUES_IQ4NL, np.int32), b[:, 2:18]
    return np.concatenate([d[:, None] * kv[qs & 0xF].astype(F), d[:, None] * kv[qs >> 4].astype(F)], axis=1)


ORACLE = {T.Q2_K: c_q2_K, T.Q3_K: c_q3_K, T.Q4_0: c_q4_0, T.IQ4_XS: c_iq4_xs, T.IQ4_NL: c_iq4_nl}


def oracle_dequantize(raw: np.ndarray, t: T) -> np.ndarray:
    """raw uint8 (..., bytes per row) of type t -> float32 (..., weights per row), by ORACLE."""
    block, size = GGML_QUANT_SIZES[t]
    rows = raw.reshape(-1, raw.shape[-1])
    out = ORACLE[t](rows.reshape(-1, size))  # (n_blocks, block)
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // size * block)


def hard_blocks(t: T, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in every field (full_range), plus blocks with d (and Q2_K's dmin) 0, < 0,
    the largest and the smallest (subnormal) fp16: (64 + 4, block bytes)."""
    raw = random_blocks(t, 64, GGML_QUANT_SIZES[t][0], rng, 0.05, full_range=True)
    extra = rng.integers(0, 256, size=(4, raw.shape[1]), dtype=np.uint8)
    at = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_0: (0,), T.IQ4_XS: (0,), T.IQ4_NL: (0,)}[t]
    for row, value in zip(extra, (0.0, -0.75, 65504.0, 6e-8)):
        for a in at:
            row[a : a + 2] = np.array([value], np.float16).view(np.uint8)
    return np.concatenate([raw, extra])


# ---- dequantization ----------------------------------------------------------------------------

@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_types_are_supported(t):
    assert t in SUPPORTED_TYPES


@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_numpy_dequantization_is_ggml_bit_for_bit(t):
    """gguf's numpy dequantize (what runtime/weights.py uses) and the scalar transcription of
    ggml-quants.c agree to the bit on random blocks over every field's full range."""
    raw = hard_blocks(t, np.random.default_rng(int(t)))
    ours = oracle_dequantize(raw, t)
    theirs = dequantize(raw, t)
    assert ours.shape == theirs.shape == (raw.shape[0], GGML_QUANT_SIZES[t][0])
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.abs(ours[:64]).max() > 0 and not ours[64].any()  # d = 0: all zero


@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_backend_dequantization_goes_through_gguf_in_pieces(t, monkeypatch):
    """weights.dequantize_rows (pieces of a few rows) and Matrix.rows give the values of the
    whole tensor, which are the transcription's."""
    monkeypatch.setattr(weights, "DEQUANT_PIECE_BYTES", 3 * 4 * 512)  # 3 rows of 512 per gguf call
    raw = random_blocks(t, 11, 512, np.random.default_rng(5), 0.05, full_range=True)
    tensor = Tensor("m", t, (11, 512), raw)
    want = oracle_dequantize(raw, t)
    np.testing.assert_array_equal(weights.dequantize_tensor(tensor), want)
    np.testing.assert_array_equal(weights.dequantize_rows(tensor, 2, 10), want[2:10])
    np.testing.assert_array_equal(weights.Matrix(tensor, 1 << 20).rows(np.array([7, 0, 7])), want[[7, 0, 7]])


@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_random_blocks_scale_and_code_ranges(t):
    """Synthetic blocks: weights of about the asked standard deviation, mean near zero; scale
    codes in a narrow band, or over every value of the field with full_range."""
    rng = np.random.default_rng(2)
    raw = random_blocks(t, 64, 2048, rng, 0.05)
    w = dequantize(raw, t)
    assert 0.03 < w.std() < 0.08 and abs(w.mean()) < 0.25 * w.std()
    size = GGML_QUANT_SIZES[t][1]
    full = random_blocks(t, 64, 2048, rng, 0.05, full_range=True).reshape(-1, size)
    blocks = raw.reshape(-1, size)
    if t == T.Q2_K:
        band, every = np.concatenate([blocks[:, :16] & 0xF, blocks[:, :16] >> 4]), np.concatenate([full[:, :16] & 0xF, full[:, :16] >> 4])
        assert set(np.unique(band)) == set(range(8, 16)) and set(np.unique(every)) == set(range(16))
    elif t in (T.Q3_K, T.IQ4_XS):
        codes = q3_K_codes if t == T.Q3_K else iq4_xs_codes
        mag = np.abs(codes(blocks).astype(np.int32) - 32)
        assert set(np.unique(mag)) == set(range(8, 16)) and set(np.unique(codes(full))) == set(range(64))


# ---- whole models on the numpy backend ---------------------------------------------------------

K_CFG = dict(n_embd=256, n_ff=256, n_head=8, n_head_kv=2, head_dim=32, rope_dim=32)
MODELS = {T.Q2_K: ("llama", K_CFG), T.Q3_K: ("qwen3", K_CFG), T.Q4_0: ("qwen2", {}), T.IQ4_XS: ("llama", {**K_CFG, "tied_embeddings": True}),
          T.IQ4_NL: ("llama", {})}


def write_model(path, data, t: T, monkeypatch):
    arch, over = MODELS[t]
    monkeypatch.setattr(tiny, "quantize", blocks_like)
    return tiny.write_tiny(path, data / "models" / "stories260K.gguf", tiny.tiny_config(arch, **over), t, seed=11)


def f32_copy(src, dst):
    """The model at src with every tensor decoded by the transcription (F32 ones as they are)."""
    mf = open_model(src)
    w = GGUFWriter(str(dst), mf.config.arch)
    copy_metadata(mf, w, {"general.architecture"})
    for name, t in mf.tensors.items():
        f = np.array(t.raw, F) if t.ggml_type == T.F32 else oracle_dequantize(t.raw_bytes(), t.ggml_type)
        w.add_tensor(name, f.reshape(t.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_tiny_model_equals_its_f32_decoding(t, data, tmp_path, monkeypatch):
    """Prefill and decode logits of a model of type t equal those of an F32 file of the same
    weights, decoded independently (float32 math on identical matrices: equal to the bit)."""
    q = write_model(tmp_path / "q.gguf", data, t, monkeypatch)
    mq = open_model(q)
    assert {x.ggml_type for x in mq.tensors.values() if len(x.shape) == 2} == {t}
    a, b = NumpyBackend(mq, 32), NumpyBackend(open_model(f32_copy(q, tmp_path / "f.gguf")), 32)
    prompt = [1, 400, 37, 90, 5, 300, 7]
    la, lb = a.eval(prompt, all_logits=True), b.eval(prompt, all_logits=True)
    assert np.isfinite(la).all() and la.std() > 0.1
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(a.eval([42]), b.eval([42]))


def test_info_and_quantize_planner_on_such_a_file(data, tmp_path, monkeypatch):
    """`k4 info` describes a Q3_K model as one k4 runs; `k4 quantize --dry-run` refuses it in
    one line (k4 quantizes F32/F16/BF16 models only)."""
    q = write_model(tmp_path / "q3.gguf", data, T.Q3_K, monkeypatch)
    runner = CliRunner()
    r = runner.invoke(app, ["info", "-m", str(q)])
    assert r.exit_code == 0, r.output
    assert "qwen3" in r.stdout and "Q3_K" in r.stdout and "n_embd" in r.stdout
    r = runner.invoke(app, ["quantize", "--dry-run", str(q), "Q4_K_M"])
    assert r.exit_code == 2 and "already Q3_K" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
