"""`k4 quantize`: byte identity with llama-quantize, the quantizers against a line-by-line
transcription of ggml-quants.c, round trips through gguf's dequantizers, the mix planner, the CLI."""

from __future__ import annotations

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
from k4.runtime.quant_mix import MIXES, choose_types, get_mix, llama_order, use_more_bits
from k4.runtime.quantize import plan_quantization, quantize_model
from tests.ggml_quants_oracle import ORACLES, F, c_nearest_int, hard_blocks
from tests.tiny import tiny_config, write_tiny


# ---------------------------------------------------------------------------------------------
# Against the scalar transcription of ggml-quants.c (tests/ggml_quants_oracle.py).
# ---------------------------------------------------------------------------------------------


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
    calls = []
    plan = quantize_model(data / "models" / "stories260K-pad-f32.gguf", out, "Q4_K_M", threads=threads,
                          progress=lambda done, total, name: calls.append((done, total, name)))
    done = [c[0] for c in calls]  # progress in weights: rising to every weight of the plan, tensor by tensor
    assert done == sorted(set(done)) and done[-1] == plan.n_elements and {c[1] for c in calls} == {plan.n_elements}
    assert list(dict.fromkeys(c[2] for c in calls)) == [t.name for t in plan.tensors]
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
