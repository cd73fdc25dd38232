"""llama.cpp's per-tensor type rules (runtime/quant_mix.py) for the families beyond the dense
llama/qwen ones: Phi-3/Phi-4's fused attn_qkv, the attention-v count that includes it, and the
mixtures of experts (layer from the name, the 8-expert rules); then a quantized phi3 and
qwen2moe file that loads and computes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from k4.runtime.model import expected_shapes, open_model
from k4.runtime.quant_mix import MIXES, allows_quantization, choose_types, llama_order, use_more_bits
from k4.runtime.quantize import quantize_model
from k4.runtime.reference import NumpyBackend
from k4.runtime.synthetic import PRESETS
from tests.tiny import tiny_config


def plan_of(cfg, mix: str) -> dict:
    """name -> chosen type (None: kept) for every tensor of a model of config `cfg`."""
    shapes = expected_shapes(cfg)
    names = llama_order(list(shapes))
    types = choose_types([(n, shapes[n]) for n in names], MIXES[mix], cfg.arch, cfg.n_layer, cfg.n_head, cfg.n_head_kv,
                         cfg.n_expert)
    return dict(zip(names, types))


def layers_with(types: dict, suffix: str, qtype: T) -> list[int]:
    return sorted(int(n.split(".")[1]) for n, t in types.items() if n.endswith(suffix) and t == qtype)


@pytest.mark.parametrize("mix, qkv", [("Q4_K_M", T.Q5_K), ("Q5_K_M", T.Q6_K), ("Q4_K_S", T.Q4_K), ("Q6_K", T.Q6_K),
                                      ("Q8_0", T.Q8_0)], ids=lambda v: v if isinstance(v, str) else v.name)
def test_phi4_fused_qkv_takes_the_attn_qkv_rule(mix, qkv):
    cfg = PRESETS["phi4-14b"].config("phi4")  # 40 layers, n_embd 5120: no fallbacks
    types = plan_of(cfg, mix)
    assert "blk.0.attn_v.weight" not in types and {types[f"blk.{i}.attn_qkv.weight"] for i in range(40)} == {qkv}
    more = [i for i in range(40) if use_more_bits(i, 40)]
    default = MIXES[mix].default_type
    if mix in ("Q4_K_M", "Q5_K_M"):
        assert layers_with(types, "ffn_down.weight", T.Q6_K) == more
        assert layers_with(types, "ffn_down.weight", default) == sorted(set(range(40)) - set(more))
    if mix == "Q4_K_S":
        assert layers_with(types, "ffn_down.weight", T.Q5_K) == [0, 1, 2, 3, 4]  # n_layer / 8
    for i in (0, 17, 39):  # the fused gate|up and the output projection keep the default
        assert types[f"blk.{i}.ffn_up.weight"] == default and types[f"blk.{i}.attn_output.weight"] == default
        assert types[f"blk.{i}.attn_norm.weight"] is None
    assert types["output.weight"] == (T.Q8_0 if mix == "Q8_0" else T.Q6_K) and types["token_embd.weight"] == default


def test_what_may_be_quantized_counts_dimensions_as_ggml_does():
    """llama-quant.cpp tensor_allows_quantization: ggml_n_dims >= 2, where a numpy shape (1, n) is
    ggml's {n, 1}, one dimension (qwen2moe's shared-expert gate as a row stays in its type), as
    are vectors, norms and the expert router."""
    assert allows_quantization("blk.0.ffn_down.weight", (2048, 5632))
    assert allows_quantization("blk.0.ffn_gate_exps.weight", (60, 1408, 2048))
    assert not allows_quantization("blk.0.ffn_gate_inp_shexp.weight", (1, 2048))
    assert not allows_quantization("blk.0.ffn_gate_inp_shexp.weight", (2048,))
    assert not allows_quantization("blk.0.attn_norm.weight", (2048, 2))  # a norm, whatever its shape
    assert not allows_quantization("blk.0.ffn_gate_inp.weight", (60, 2048))
    assert not allows_quantization("blk.0.attn_q.bias", (2048, 2))


def test_attention_v_count_includes_attn_qkv():
    """llama.cpp's n_attention_wv counts attn_v and attn_qkv; only attn_v advances the index: 8
    layers with attn_v then 8 with attn_qkv put the Q6_K attn_v at use_more_bits(i, 16), not (i, 8)."""
    tensors = [(f"blk.{i}.{'attn_v' if i < 8 else 'attn_qkv'}.weight", (256, 256)) for i in range(16)]
    tensors += [("output.weight", (512, 256)), ("token_embd.weight", (512, 256))]
    names = llama_order([n for n, _ in tensors])
    shapes = dict(tensors)
    types = dict(zip(names, choose_types([(n, shapes[n]) for n in names], MIXES["Q4_K_M"], "phi3", 16, 4, 4)))
    assert layers_with(types, "attn_v.weight", T.Q6_K) == [0, 1, 4, 7]  # [i for i < 8 if use_more_bits(i, 16)]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]  # what counting attn_v alone would give
    assert {types[f"blk.{i}.attn_qkv.weight"] for i in range(8, 16)} == {T.Q5_K}


def test_moe_ffn_down_takes_its_layer_from_the_name():
    """qwen2moe, 8 layers, 8 experts and a shared expert: each block holds ffn_down_exps and
    ffn_down_shexp; both get the rule of the block's number (a running count would give two
    per block). With exactly 8 experts attn_v and attn_k become Q8_0, attn_output Q5_K."""
    cfg = tiny_config("qwen2moe", n_embd=256, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, n_expert=8,
                      n_expert_used=2, n_ff_exp=256, n_ff_shexp=512)
    types = plan_of(cfg, "Q4_K_M")
    more = [i for i in range(8) if use_more_bits(i, 8)]
    assert more == [0, 3, 6, 7]
    for name in ("ffn_down_exps.weight", "ffn_down_shexp.weight"):
        assert layers_with(types, name, T.Q6_K) == more and layers_with(types, name, T.Q4_K) == [1, 2, 4, 5]
    for i in range(8):
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.attn_k.weight"] == T.Q8_0
        assert types[f"blk.{i}.attn_output.weight"] == T.Q5_K and types[f"blk.{i}.attn_q.weight"] == T.Q4_K
        assert types[f"blk.{i}.ffn_gate_inp.weight"] is None and types[f"blk.{i}.ffn_gate_inp_shexp.weight"] is None
        assert {types[f"blk.{i}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_shexp", "ffn_up_shexp")} == {T.Q4_K}
    s = plan_of(cfg, "Q4_K_S")
    assert layers_with(s, "ffn_down_exps.weight", T.Q5_K) == [0] and s["blk.3.attn_output.weight"] == T.Q5_K
    assert plan_of(cfg, "Q5_K_M")["blk.3.attn_output.weight"] == T.Q5_K  # the mix's default: the 8-expert rule is Q4_K only


def test_qwen3moe_with_128_experts_keeps_the_dense_rules():
    cfg = PRESETS["qwen3-30b-a3b"].config("qwen3moe")  # 48 layers, 128 experts: no 8-expert rule
    types = plan_of(cfg, "Q4_K_M")
    more = [i for i in range(48) if use_more_bits(i, 48)]
    assert layers_with(types, "attn_v.weight", T.Q6_K) == more and layers_with(types, "ffn_down_exps.weight", T.Q6_K) == more
    assert {types[f"blk.{i}.attn_k.weight"] for i in range(48)} == {T.Q4_K}
    assert {types[f"blk.{i}.attn_output.weight"] for i in range(48)} == {T.Q4_K}
    assert types["blk.0.ffn_gate_inp.weight"] is None and types["blk.5.ffn_up_exps.weight"] == T.Q4_K


@pytest.mark.parametrize("name, expected", [
    # tiny-phi3: n_embd 128 (rows not a multiple of 256): attn_qkv Q5_K -> Q5_1, the rest Q4_K -> Q5_0,
    # output Q8_0; 2 layers: use_more_bits picks layer 1 (>= 7 * 2 / 8) for ffn_down
    ("tiny-phi3", {"blk.0.attn_qkv.weight": T.Q5_1, "blk.1.attn_qkv.weight": T.Q5_1, "blk.0.ffn_down.weight": T.Q5_0,
                   "blk.1.ffn_down.weight": T.Q8_0, "blk.0.ffn_up.weight": T.Q5_0, "output.weight": T.Q8_0}),
    # tiny-qwen2moe: 8 experts of width 64: attn_v/k Q8_0, attn_output Q5_K -> Q5_1, both down
    # projections of layer 1 Q6_K -> Q8_0, of layer 0 Q4_K -> Q5_0
    ("tiny-qwen2moe", {"blk.0.attn_v.weight": T.Q8_0, "blk.1.attn_k.weight": T.Q8_0, "blk.0.attn_output.weight": T.Q5_1,
                       "blk.0.ffn_down_exps.weight": T.Q5_0, "blk.0.ffn_down_shexp.weight": T.Q5_0,
                       "blk.1.ffn_down_exps.weight": T.Q8_0, "blk.1.ffn_down_shexp.weight": T.Q8_0,
                       "blk.0.ffn_gate_inp.weight": T.F32, "blk.0.ffn_up_exps.weight": T.Q5_0}),
])
def test_quantized_phi3_and_moe_files_load_and_compute(data, tmp_path, name, expected):
    src = data / "oracles" / f"{name}.gguf"
    out = tmp_path / f"{name}-q4_k_m.gguf"
    quantize_model(src, out, "Q4_K_M", threads=1)
    written = {t.name: t.tensor_type for t in GGUFReader(out).tensors}
    assert {k: written[k] for k in expected} == expected
    ids = [1, 20, 30, 40, 50]
    ref = NumpyBackend(open_model(src), 16).eval(ids, all_logits=True)  # (5, n_vocab)
    got = NumpyBackend(open_model(out), 16).eval(ids, all_logits=True)
    cos = (ref * got).sum(-1) / np.linalg.norm(ref, axis=-1) / np.linalg.norm(got, axis=-1)
    assert np.isfinite(got).all() and cos.min() > 0.98, cos
