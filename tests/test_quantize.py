"""`k4 quantize`: byte identity with llama-quantize, the quantizers against a line-by-line
transcription of ggml-quants.c, round trips through gguf's dequantizers, the mix planner, the CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime import kquants, quantize_pool
from k4.runtime.errors import ModelFileError, UnsupportedModelError, UsageError
from k4.runtime.model import open_model
from k4.runtime.quantize import MIXES, choose_types, get_mix, llama_order, plan_quantization, quantize_model, use_more_bits
from tests.tiny import tiny_config, write_tiny

F = np.float32
EPS = F(1e-15)


# ---------------------------------------------------------------------------------------------
# A scalar transcription of ggml-quants.c (float32 scalars, loops in C order): the oracle.
# ---------------------------------------------------------------------------------------------


def c_nearest_int(v) -> int:
    bits = np.array([F(v) + F(12582912.0)], dtype=np.float32).view(np.int32)[0]
    return int(bits & 0x7FFFFF) - 0x400000


def c_fp16(v) -> bytes:
    return np.array([v], dtype=np.float32).astype(np.float16).tobytes()


def c_make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep):
    n = len(x)
    mn, mx, sum_w = x[0], x[0], w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return F(0), -mn, [0] * n
    iscale = F(nmax) / (mx - mn)
    scale = F(1) / iscale
    best_error = F(0)
    L = []
    for i in range(n):
        L.append(max(0, min(nmax, c_nearest_int(iscale * (x[i] - mn)))))
        diff = scale * F(L[i]) + mn - x[i]
        best_error += w[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / (mx - mn)
        sum_l = sum_l2 = sum_xl = F(0)
        laux = []
        for i in range(n):
            laux.append(max(0, min(nmax, c_nearest_int(iscale * (x[i] - mn)))))
            sum_l += w[i] * F(laux[i])
            sum_l2 += w[i] * F(laux[i]) * F(laux[i])
            sum_xl += w[i] * F(laux[i]) * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F(0)
                this_scale = sum_xl / sum_l2
            cur_error = F(0)
            for i in range(n):
                diff = this_scale * F(laux[i]) + this_min - x[i]
                cur_error += w[i] * (diff * diff)
            if cur_error < best_error:
                L, best_error, scale, mn = laux, cur_error, this_scale, this_min
    return scale, -mn, L


def c_make_qx_quants(x, nmax):
    mx = amax = F(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < EPS:
        return F(0), [0] * len(x)
    iscale = F(-nmax) / mx

    def sums(iscale):
        sumlx = suml2 = F(0)
        ls = []
        for v in x:
            l = max(-nmax, min(nmax - 1, c_nearest_int(iscale * v)))
            ls.append(l + nmax)
            w = v * v
            sumlx += w * v * F(l)
            suml2 += w * F(l) * F(l)
        return ls, sumlx, suml2

    L, sumlx, suml2 = sums(iscale)
    scale = sumlx / suml2 if suml2 else F(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        ls, sumlx, suml2 = sums(-(F(nmax) + F(0.1) * F(step)) / mx)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L, scale = ls, sumlx / suml2
            best = scale * sumlx
    return scale, L


def c_kx_block(x, nmax, rmin, rdelta, nstep):
    """The shared part of quantize_row_q4_K_ref / q5_K_ref for one super-block."""
    L, scales, mins = [0] * 256, [], []
    max_scale = max_min = F(0)
    for j in range(8):
        sub = x[32 * j: 32 * j + 32]
        sum_x2 = F(0)
        for v in sub:
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / F(32))
        w = [av_x + abs(v) for v in sub]
        s, m, l = c_make_qkx2_quants(sub, w, nmax, rmin, rdelta, nstep)
        scales.append(s)
        mins.append(m)
        L[32 * j: 32 * j + 32] = l
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    with np.errstate(over="ignore"):  # 63 / a subnormal max is inf in C too
        inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
        inv_min = F(63) / max_min if max_min > 0 else F(0)
    sc = [0] * 12
    ls_all, lm_all = [], []
    for j in range(8):
        ls = min(63, c_nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, c_nearest_int(inv_min * mins[j]) & 0xFF)
        ls_all.append(ls)
        lm_all.append(lm)
        if j < 4:
            sc[j], sc[j + 4] = ls, lm
        else:
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
    d, dmin = c_fp16(max_scale / F(63)), c_fp16(max_min / F(63))
    df, dminf = np.frombuffer(d, np.float16)[0].astype(F), np.frombuffer(dmin, np.float16)[0].astype(F)
    for j in range(8):
        dd = df * F(ls_all[j])
        if dd == 0:
            continue
        dm = dminf * F(lm_all[j])
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, c_nearest_int((x[32 * j + ii] + dm) / dd)))
    return d + dmin + bytes(sc), L


def c_q4_K(x):
    head, L = c_kx_block(x, 15, -1.0, 0.1, 20)
    qs = [L[j + l] | (L[j + l + 32] << 4) for j in range(0, 256, 64) for l in range(32)]
    return head + bytes(qs)


def c_q5_K(x):
    head, L = c_kx_block(x, 31, -0.5, 0.1, 15)
    qh, ql = [0] * 32, []
    m1, m2 = 1, 2
    for n in range(0, 256, 64):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= m1
            if l2 > 15:
                l2 -= 16
                qh[j] |= m2
            ql.append(l1 | (l2 << 4))
        m1, m2 = m1 << 2, m2 << 2
    return head + bytes(qh) + bytes(ql)


def c_q6_K(x):
    L, scales = [], []
    max_scale = max_abs = F(0)
    for ib in range(16):
        s, l = c_make_qx_quants(x[16 * ib: 16 * ib + 16], 32)
        scales.append(s)
        L += l
        if abs(s) > max_abs:
            max_abs, max_scale = abs(s), s
    if max_abs < EPS:
        return bytes(210)
    iscale = F(-128) / max_scale
    d = c_fp16(F(1) / iscale)
    sc = [np.int32(min(127, c_nearest_int(iscale * s))).astype(np.int8) for s in scales]
    for j in range(16):
        dd = np.frombuffer(d, np.float16)[0].astype(F) * F(sc[j])
        if dd == 0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, c_nearest_int(x[16 * j + ii] / dd))) + 32
    ql, qh = [0] * 128, [0] * 64
    for j in range(0, 256, 128):
        for l in range(32):
            q = [L[j + l + 32 * k] for k in range(4)]
            ql[j // 2 + l] = (q[0] & 0xF) | ((q[2] & 0xF) << 4)
            ql[j // 2 + l + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4)
            qh[j // 4 + l] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6)
    return bytes(ql) + bytes(qh) + np.array(sc, dtype=np.int8).tobytes() + d


def c_q5_pack(q):
    qh = 0
    for j in range(16):
        qh |= ((q[j] & 0x10) >> 4) << j
        qh |= ((q[j + 16] & 0x10) >> 4) << (j + 16)
    return qh.to_bytes(4, "little") + bytes((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4) for j in range(16))


def c_q5_0(x):
    amax = mx = F(0)
    for v in x:
        if amax < abs(v):
            amax, mx = abs(v), v
    d = mx / F(-16)
    inv = F(1) / d if d else F(0)
    return c_fp16(d) + c_q5_pack([min(31, int(x[j] * inv + F(16.5))) for j in range(32)])


def c_q5_1(x):
    mn, mx = F(np.finfo(F).max), F(-np.finfo(F).max)
    for v in x:
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    d = (mx - mn) / F(31)
    inv = F(1) / d if d else F(0)
    return c_fp16(d) + c_fp16(mn) + c_q5_pack([int((x[j] - mn) * inv + F(0.5)) for j in range(32)])


def c_roundf(v) -> int:
    """C roundf: half away from zero (exact in double for a float32 argument)."""
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))


def c_q8_0(x):
    amax = F(0)
    for v in x:
        amax = max(amax, abs(v))
    d = amax / F(127)
    inv = F(1) / d if d else F(0)
    return c_fp16(d) + bytes(c_roundf(v * inv) & 0xFF for v in x)


ORACLES = {T.Q4_K: (c_q4_K, 256), T.Q5_K: (c_q5_K, 256), T.Q6_K: (c_q6_K, 256), T.Q5_0: (c_q5_0, 32), T.Q5_1: (c_q5_1, 32), T.Q8_0: (c_q8_0, 32)}


def hard_blocks(n: int, seed: int) -> np.ndarray:
    """(n + 10) * 256 float32 weights: ordinary blocks and the cases that take special paths (zero
    and constant sub-blocks, one-signed blocks, outliers, fp16 underflow, exact ties, -0.0, spans
    too small for float rounding)."""
    rng = np.random.default_rng(seed)
    blocks = [rng.standard_normal(256) * 0.02 for _ in range(n)]
    b = rng.standard_normal(256) * 0.05
    b[:32] = 0
    b[32:64] = -0.25
    b[64:96] = 1e-7 * rng.standard_normal(32)
    blocks.append(b)
    blocks.append(-np.abs(rng.standard_normal(256)) - 0.5)
    blocks.append(np.abs(rng.standard_normal(256)) + 0.1)
    o = rng.standard_normal(256) * 0.01
    o[7] = 3.0
    o[200] = -5.0
    blocks.append(o)
    blocks.append(rng.standard_normal(256) * 1e-9)
    blocks.append(rng.integers(-8, 8, 256) * 0.125)
    blocks.append(np.zeros(256))
    z = rng.standard_normal(256)
    z[::3] = -0.0
    blocks.append(z)
    blocks.append(rng.standard_normal(256) * 1e-36)  # spans below 1e-30: kquants' integer rounding path
    blocks.append(np.where(rng.random(256) < 0.1, -1.0, 1e-7 * rng.standard_normal(256)))  # sparse outliers
    return np.concatenate(blocks).astype(np.float32)


@pytest.mark.parametrize("qtype", list(ORACLES), ids=lambda t: t.name)
def test_quantizers_match_the_c_reference(qtype):
    oracle, block = ORACLES[qtype]
    x = hard_blocks(2, seed=int(qtype))
    expected = b"".join(oracle([F(v) for v in x[i: i + block]]) for i in range(0, x.size, block))
    got = kquants.quantize(x.reshape(-1, 512), qtype)
    assert got.shape == (x.size // 512, len(expected) * 512 // x.size)
    assert got.tobytes() == expected


def test_nearest_int_and_round_clip_follow_the_c_bit_trick():
    v = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.49, 1e7, -1e7, 5e6, np.inf, -np.inf, np.nan, 4194303.0], dtype=np.float32)
    expected = [c_nearest_int(a) for a in v]
    assert kquants.nearest_int(v).tolist() == expected
    fast = np.array([0.5, 1.5, 2.5, -2.5, 3.49, 17.0, -40.0], dtype=np.float32)
    for values in (fast, v):  # in range: float path; with inf/nan/huge: the integer path
        clipped = kquants._round_clip(values.copy(), -32, 31)
        assert clipped.tolist() == [float(max(-32, min(31, c_nearest_int(a)))) for a in values]


def test_sum_seq_adds_left_to_right():
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((32, 300)) * 10.0 ** rng.integers(-6, 7, (32, 300))).astype(np.float32)
    expected = a[0].copy()
    for row in a[1:]:
        expected = (expected + row).astype(np.float32)
    assert np.array_equal(kquants._sum_seq(a), expected)
    assert not np.array_equal(kquants._sum_seq(a[::-1]), expected)  # the data is order-sensitive


# ---------------------------------------------------------------------------------------------
# Round trips through the gguf package's dequantizers (an independent decoder).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "qtype,limit",
    [(T.Q4_K, 0.10), (T.Q5_K, 0.05), (T.Q6_K, 0.025), (T.Q5_0, 0.05), (T.Q5_1, 0.05), (T.Q8_0, 0.006), (T.F16, 0.001)],
    ids=lambda v: v.name if isinstance(v, T) else str(v),
)
def test_round_trip_error(qtype, limit):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 512)) * 0.03).astype(np.float32)
    y = dequantize(kquants.quantize(x, qtype), qtype).reshape(x.shape)
    rel_rms = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    assert rel_rms < limit
    assert np.abs(y - x).max() < 8 * limit * np.abs(x).max()


def test_quantize_rejects_rows_that_do_not_fit_the_block():
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize(np.zeros((2, 96), np.float32), T.Q4_K)


# ---------------------------------------------------------------------------------------------
# Against llama.cpp's own output.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "threads,chunk,cache",
    [(1, None, None), (2, None, None), (2, 3 * 256, None), (1, None, 2 * 256)],
    ids=["in-process", "2-workers", "2-workers-3-row-chunks", "in-process-2-row-passes"],
)
def test_q4_k_m_is_byte_identical_to_llama_quantize(tmp_path, data, monkeypatch, threads, chunk, cache):
    """Also with units of work (chunk, in weights) and quantizer passes (cache) that split
    tensors into many pieces, the last one short."""
    if chunk:
        monkeypatch.setattr(quantize_pool, "CHUNK_WEIGHTS", chunk)
    if cache:
        monkeypatch.setattr(kquants, "CACHE_WEIGHTS", cache)
    ref_path = data / "models" / "stories260K-pad-q4_k_m.gguf"
    out = tmp_path / "q.gguf"
    quantize_model(data / "models" / "stories260K-pad-f32.gguf", out, "Q4_K_M", threads=threads)
    ours, ref = GGUFReader(out), GGUFReader(ref_path)
    assert len(ref.tensors) == 48
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
    assert out.read_bytes() == ref_path.read_bytes()  # metadata and layout too


def test_plan_of_the_5_layer_model_matches_llama_cpp(data):
    ref = {t.name: t.tensor_type for t in GGUFReader(data / "models" / "stories260K-pad-q4_k_m.gguf").tensors}
    plan = plan_quantization(open_model(data / "models" / "stories260K-pad-f32.gguf"), get_mix("q4_k_m"))
    assert {t.name: t.dst_type for t in plan.tensors} == ref
    q6 = sorted(t.name for t in plan.tensors if t.dst_type == T.Q6_K)
    assert q6 == ["blk.2.attn_v.weight", "blk.2.ffn_down.weight", "blk.4.attn_v.weight", "blk.4.ffn_down.weight", "output.weight"]
    assert plan.dst_bytes == sum(t.n_bytes for t in GGUFReader(data / "models" / "stories260K-pad-q4_k_m.gguf").tensors)


# ---------------------------------------------------------------------------------------------
# The mix planner on synthetic tensor lists.
# ---------------------------------------------------------------------------------------------


def dense_tensors(n_layer: int, n_embd: int = 4096, n_ff: int = 11008, kv: int = 1024, tied: bool = False):
    names = {"token_embd.weight": (32000, n_embd), "output_norm.weight": (n_embd,)}
    if not tied:
        names["output.weight"] = (32000, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        names.update({p + "attn_norm.weight": (n_embd,), p + "attn_q.weight": (n_embd, n_embd), p + "attn_k.weight": (kv, n_embd),
                      p + "attn_v.weight": (kv, n_embd), p + "attn_output.weight": (n_embd, n_embd), p + "ffn_norm.weight": (n_embd,),
                      p + "ffn_gate.weight": (n_ff, n_embd), p + "ffn_up.weight": (n_ff, n_embd), p + "ffn_down.weight": (n_embd, n_ff)})
    order = llama_order(list(names))
    return [(n, names[n]) for n in order]


def planned(mix: str, tensors, arch="llama", n_head=32, n_head_kv=8):
    n_layer = sum(n.endswith("attn_q.weight") for n, _ in tensors)
    return dict(zip([n for n, _ in tensors], choose_types(tensors, MIXES[mix], arch, n_layer, n_head, n_head_kv)))


def layers_with(types: dict, suffix: str, qtype: T) -> list[int]:
    return sorted(int(n.split(".")[1]) for n, t in types.items() if n.endswith(suffix) and t == qtype)


def test_llama_order_sorts_by_layer_number_then_name():
    names = ["blk.10.attn_q.weight", "output.weight", "blk.2.ffn_up.weight", "blk.2.attn_k.weight", "token_embd.weight"]
    assert llama_order(names) == ["output.weight", "token_embd.weight", "blk.2.attn_k.weight", "blk.2.ffn_up.weight", "blk.10.attn_q.weight"]


def test_use_more_bits_picks_ends_and_every_third_layer():
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_mix_rules_for_a_32_layer_model():
    t = dense_tensors(32)
    m = planned("Q4_K_M", t)
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert layers_with(m, "attn_v.weight", T.Q6_K) == more and layers_with(m, "ffn_down.weight", T.Q6_K) == more
    assert m["output.weight"] == T.Q6_K and m["token_embd.weight"] == T.Q4_K and m["blk.0.attn_norm.weight"] is None
    assert {m[f"blk.5.{k}.weight"] for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {T.Q4_K}
    s = planned("Q4_K_S", t)
    assert layers_with(s, "attn_v.weight", T.Q5_K) == [0, 1, 2, 3] and layers_with(s, "ffn_down.weight", T.Q5_K) == [0, 1, 2, 3]
    assert s["output.weight"] == T.Q6_K and s["blk.9.ffn_down.weight"] == T.Q4_K
    m5 = planned("Q5_K_M", t)
    assert layers_with(m5, "attn_v.weight", T.Q6_K) == more and m5["blk.5.attn_q.weight"] == T.Q5_K
    assert set(planned("Q6_K", t).values()) == {T.Q6_K, None}
    assert set(planned("Q8_0", t).values()) == {T.Q8_0, None}


def test_tied_embeddings_take_the_output_rule():
    m = planned("Q4_K_M", dense_tensors(2, tied=True))
    assert m["token_embd.weight"] == T.Q6_K
    assert planned("Q8_0", dense_tensors(2, tied=True))["token_embd.weight"] == T.Q8_0


def test_fallbacks_for_rows_that_are_not_a_multiple_of_256():
    t = dense_tensors(8, n_embd=896, n_ff=4832, kv=128)  # 896 = 3.5 * 256; 4832 % 256 = 224, % 32 = 0
    m = planned("Q4_K_M", t)
    assert m["blk.3.attn_q.weight"] == T.Q5_0 and m["output.weight"] == T.Q8_0 and m["blk.0.attn_v.weight"] == T.Q8_0
    assert m["blk.0.ffn_down.weight"] == T.Q8_0 and m["blk.2.ffn_down.weight"] == T.Q5_0
    assert planned("Q5_K_M", t)["blk.3.attn_q.weight"] == T.Q5_1
    odd = planned("Q4_K_M", dense_tensors(2, n_embd=100, n_ff=256, kv=100))
    assert odd["blk.0.attn_q.weight"] == T.F16 and odd["output.weight"] == T.F16


def test_70b_attn_v_rule():
    t = dense_tensors(80, n_embd=256, n_ff=256, kv=256)
    assert planned("Q4_K_S", t)["blk.40.attn_v.weight"] == T.Q5_K
    assert planned("Q4_K_S", t, n_head_kv=32)["blk.40.attn_v.weight"] == T.Q4_K  # 65B: no GQA
    assert planned("Q4_K_S", t, arch="qwen3")["blk.40.attn_v.weight"] == T.Q4_K


# ---------------------------------------------------------------------------------------------
# Inputs: F16 / BF16, bad files.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("src_type", [T.F16, T.BF16])
def test_f16_and_bf16_inputs_quantize_their_exact_values(tmp_path, data, src_type):
    cfg = tiny_config("qwen2", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, tied_embeddings=True)
    src = write_tiny(tmp_path / "in.gguf", data / "models" / "stories260K.gguf", cfg, matrix_type=src_type)
    out = tmp_path / "out.gguf"
    plan = quantize_model(src, out, "Q4_K_M")
    mf_in, mf_out = open_model(src), open_model(out)
    assert mf_out.meta("general.file_type") == 15 and mf_out.meta("general.quantization_version") == 2
    assert mf_out.meta("tokenizer.ggml.tokens") == mf_in.meta("tokenizer.ggml.tokens")
    assert mf_out.tensors["token_embd.weight"].ggml_type == T.Q6_K  # tied
    assert mf_out.tensors["blk.0.attn_q.bias"].ggml_type == T.F32
    for tp in plan.tensors:
        t_in, t_out = mf_in.tensors[tp.name], mf_out.tensors[tp.name]
        assert t_out.ggml_type == tp.dst_type and t_out.shape == t_in.shape
        x = dequantize(t_in.raw_bytes(), t_in.ggml_type).reshape(-1, t_in.shape[-1])
        expected = t_in.raw_bytes() if tp.dst_type == tp.src_type else kquants.quantize(x, tp.dst_type)
        assert np.array_equal(t_out.raw_bytes(), expected), tp.name


def test_quantized_input_is_refused(data, tmp_path):
    with pytest.raises(UnsupportedModelError, match="already Q6_K; k4 quantize reads F32, F16 or BF16"):
        quantize_model(data / "models" / "stories260K-pad-q4_k_m.gguf", tmp_path / "o.gguf", "Q8_0")
    assert list(tmp_path.iterdir()) == []


def test_nan_weights_are_reported_and_leave_nothing(data, tmp_path):
    src = data / "models" / "stories260K-pad-f32.gguf"
    data = bytearray(src.read_bytes())
    t = next(t for t in GGUFReader(src).tensors if t.name == "blk.3.ffn_up.weight")
    data[t.data_offset + 400: t.data_offset + 404] = np.float32(np.nan).tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="'blk.3.ffn_up.weight' contains NaN"):
        quantize_model(bad, tmp_path / "o.gguf", "Q4_K_M")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_usage_errors(data, tmp_path):
    src = data / "models" / "stories260K-pad-f32.gguf"
    with pytest.raises(UsageError, match="unknown quantization type 'Q3_K_M'; use one of Q4_K_M, Q4_K_S, Q5_K_M, Q6_K, Q8_0"):
        quantize_model(src, tmp_path / "o.gguf", "Q3_K_M")
    with pytest.raises(UsageError, match="is the input file"):
        quantize_model(src, src, "Q4_K_M", force=True)
    with pytest.raises(UsageError, match="is a folder; give a file name"):
        quantize_model(src, tmp_path, "Q4_K_M", force=True)
    with pytest.raises(UsageError, match="is not a folder; create it first"):
        quantize_model(src, tmp_path / "missing" / "o.gguf", "Q4_K_M")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# The CLI.
# ---------------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_dry_run_prints_the_plan_and_size(data, tmp_path):
    res = runner.invoke(app, ["quantize", "--dry-run", str(data / "models" / "stories260K-pad-f32.gguf"), "q4_k_m"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert any("blk.2.attn_v.weight" in l and "128 x 256" in l and "F32" in l and "Q6_K" in l for l in lines)
    assert any("blk.1.attn_v.weight" in l and "Q4_K" in l for l in lines)
    assert any("output_norm.weight" in l and l.count("F32") == 2 for l in lines)
    assert "Q4_K_M: 48 tensors, 2,231,040 weights, 8.51 MiB -> 1.29 MiB (4.84 bits per weight)" in res.output


def test_cli_writes_refuses_to_overwrite_and_forces(data, tmp_path):
    src = str(data / "models" / "stories260K-pad-f32.gguf")
    out = tmp_path / "m.gguf"
    res = runner.invoke(app, ["quantize", src, str(out), "Q8_0"])
    assert res.exit_code == 0, res.output
    assert open_model(out).meta("general.file_type") == 7
    first = out.read_bytes()
    res = runner.invoke(app, ["quantize", src, str(out), "Q6_K"])
    assert res.exit_code == 2 and "already exists; pass --force" in res.output
    assert out.read_bytes() == first
    res = runner.invoke(app, ["quantize", src, str(out), "Q6_K", "--force"])
    assert res.exit_code == 0, res.output
    assert open_model(out).meta("general.file_type") == 18
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["OUT", "Q2_K"], "unknown quantization type 'Q2_K'; use one of Q4_K_M, Q4_K_S, Q5_K_M, Q6_K, Q8_0"),
        (["OUT"], "missing TYPE"),
        (["--dry-run", "OUT", "Q4_K_M"], "--dry-run takes IN TYPE"),
    ],
)
def test_cli_usage_errors_exit_2_with_one_line(data, tmp_path, args, message):
    args = [str(tmp_path / "o.gguf") if a == "OUT" else a for a in args]
    res = runner.invoke(app, ["quantize", str(data / "models" / "stories260K-pad-f32.gguf"), *args])
    assert res.exit_code == 2
    assert message in res.output and "Traceback" not in res.output
    assert list(tmp_path.iterdir()) == []


def test_cli_interrupt_leaves_no_output_and_no_temp_file(data, tmp_path, monkeypatch):
    calls = []
    real = kquants.quantize

    def interrupted(x, qtype):
        calls.append(qtype)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(x, qtype)

    monkeypatch.setattr(kquants, "quantize", interrupted)
    res = runner.invoke(app, ["quantize", str(data / "models" / "stories260K-pad-f32.gguf"), str(tmp_path / "o.gguf"), "Q4_K_M", "-t", "1"])
    assert res.exit_code == 130
    assert len(calls) >= 3
    assert list(tmp_path.iterdir()) == []


def test_q5_1_fallback_output_runs(data, tmp_path):
    """Q5_K_M on rows that are not a multiple of 256 falls back to Q5_1, which k4 runs."""
    from k4.runtime.reference import NumpyBackend

    src = write_tiny(tmp_path / "t.gguf", data / "models" / "stories260K.gguf", tiny_config("llama"), matrix_type=T.F32)
    dst = tmp_path / "q5km.gguf"
    res = runner.invoke(app, ["quantize", str(src), str(dst), "Q5_K_M"])
    assert res.exit_code == 0 and "warning" not in res.output
    mf = open_model(dst)
    assert "Q5_1" in {t.type_name for t in mf.tensors.values()}
    logits = NumpyBackend(mf, 16).eval([1, 2, 3])
    ref = NumpyBackend(open_model(src), 16).eval([1, 2, 3])
    assert np.linalg.norm(logits - ref) / np.linalg.norm(ref) < 0.15  # 5-bit weights of a 64-wide random model: 0.08
