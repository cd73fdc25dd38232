"""Mixture of experts on the numpy backend (runtime/moe.py; qwen3moe, qwen2moe): the router's
top-k, that only the selected experts are multiplied, the expert keys' schema and the synthetic
Qwen3-30B-A3B preset. The logits themselves are checked against transformers in test_oracles.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from gguf import GGUFWriter

from k4.runtime.errors import ModelFileError
from k4.runtime.model import ModelConfig, expected_shapes, open_model
from k4.runtime.moe import route
from k4.runtime.reference import NumpyBackend
from k4.runtime.synthetic import PRESETS, vocab_from, write_metadata


def test_route_picks_the_largest_and_renormalizes():
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, 0.0, 0.0]], np.float32)  # (2 tokens, 4 experts)
    ids, w = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 3], [0, 1]]  # decreasing probability; a tie: the lower id first
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(w[0], p[[1, 3]], rtol=1e-6)
    _, wn = route(logits, 2, renormalize=True)
    np.testing.assert_allclose(wn.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(wn[0], p[[1, 3]] / p[[1, 3]].sum(), rtol=1e-6)


def test_route_is_finite_for_large_router_logits():
    """The softmax subtracts the row's largest logit first: logits near 100 (exp overflows
    float32 at 88.7) still give the exact probabilities."""
    ids, w = route(np.array([[100.0, 99.0, 0.0, 98.0]], np.float32), 2, renormalize=False)
    e = np.exp(np.array([0.0, -1.0, -100.0, -2.0]))
    assert ids.tolist() == [[0, 1]] and np.all(np.isfinite(w))
    np.testing.assert_allclose(w[0], e[[0, 1]] / e.sum(), rtol=1e-6)

def test_route_breaks_ties_by_the_lower_id_among_128_experts():
    """Qwen3-30B-A3B's 128 experts with logits in three values, so most probabilities tie: the k
    chosen are the largest, ties taken by the lower id (what moe_route.cuh's ranks give), for
    every token. A sort that is not stable picks other ids at this size."""
    rng = np.random.default_rng(5)
    logits = rng.integers(0, 3, (16, 128)).astype(np.float32)  # (16 tokens, 128 experts)
    ids, _ = route(logits, 8, renormalize=True)
    for row, got in zip(logits, ids):
        assert got.tolist() == sorted(range(128), key=lambda e: (-row[e], e))[:8]


def test_decode_multiplies_only_the_selected_experts(data):
    folder = data / "oracles"
    entry = json.loads((folder / "oracles.json").read_text())["qwen3moe"]
    be = NumpyBackend(open_model(folder / entry["model"]), 64)
    calls: list[int] = []
    for L in be.layers:
        for e, m in enumerate(L.moe.gate):
            m.product = (lambda f, e: lambda x: (calls.append(e), f(x))[1])(m.product, e)
    be.eval(entry["prompt_ids"][:1])
    assert len(calls) == be.config.n_layer * be.config.n_expert_used  # 2 of 8 experts per layer


def tiny_moe(shexp: int = 0) -> ModelConfig:
    arch = "qwen2moe" if shexp else "qwen3moe"
    return ModelConfig(arch=arch, name="moe", n_vocab=512, n_embd=64, n_layer=1, n_head=4, n_head_kv=2, head_dim=16,
                       n_ff=96, n_ctx_train=256, rms_eps=1e-6, rope_freq_base=10000.0, rope_dim=16, rope_neox=True,
                       has_qkv_bias=bool(shexp), has_qk_norm=not shexp, has_rope_freqs=False, tied_embeddings=True,
                       n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=shexp, expert_norm=not shexp)


def write(path, cfg: ModelConfig, meta: ModelConfig, data, gate_shape=None):
    """A GGUF of cfg's tensors (random F32) with meta's keys."""
    w = GGUFWriter(str(path), cfg.arch)
    write_metadata(w, meta, vocab_from(data / "models" / "stories260K.gguf", cfg.n_vocab))
    rng = np.random.default_rng(0)
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("ffn_gate_inp_shexp.weight") and gate_shape:
            shape = gate_shape
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_expert_keys_are_checked(tmp_path, data):
    cfg = tiny_moe()
    mf = open_model(write(tmp_path / "ok.gguf", cfg, cfg, data))
    assert (mf.config.n_expert, mf.config.n_expert_used, mf.config.n_ff_exp, mf.config.expert_norm) == (4, 2, 32, True)
    with pytest.raises(ModelFileError, match="qwen3moe.expert_count' is missing"):
        open_model(write(tmp_path / "none.gguf", cfg, dataclasses.replace(cfg, n_expert=0), data))
    with pytest.raises(ModelFileError, match="expert_used_count.*at most expert_count"):
        open_model(write(tmp_path / "used.gguf", cfg, dataclasses.replace(cfg, n_expert_used=5), data))
    with pytest.raises(ModelFileError, match=r"ffn_gate_exps.weight. has shape \(4, 32, 64\), expected \(4, 64, 64\)"):
        open_model(write(tmp_path / "width.gguf", cfg, dataclasses.replace(cfg, n_ff_exp=64), data))


def test_shared_expert_gate_as_a_row_or_a_vector(tmp_path, data):
    cfg = tiny_moe(shexp=48)
    for i, shape in enumerate(((64,), (1, 64))):  # the converter's squeezed vector, or the HF (1, n_embd)
        mf = open_model(write(tmp_path / f"s{i}.gguf", cfg, cfg, data, gate_shape=shape))
        assert mf.config.n_ff_shexp == 48 and not mf.config.expert_norm
        be = NumpyBackend(mf, 16)
        assert np.isfinite(be.eval([1, 2, 3])).all()


def test_qwen3_30b_a3b_preset():
    cfg = PRESETS["qwen3-30b-a3b"].config("x")
    assert (cfg.arch, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == ("qwen3moe", 2048, 48, 32, 4, 128)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_vocab, cfg.expert_norm) == (128, 8, 768, 151936, True)
    shapes = expected_shapes(cfg)
    assert shapes["blk.47.ffn_down_exps.weight"] == (128, 2048, 768)
    assert "blk.0.ffn_up.weight" not in shapes


def test_cuda_compile_jobs_pick_the_q8_expert_products_and_a_float_x_router():
    """runtime/cuda/moe_load.py compile_jobs (no GPU needed): quantized routed experts compile
    moe_gemv.cu's 8-bit-x instance of their type (of every layer), gate and up of one type its
    SwiGLU instance too, a quantized router moe.cu's float-x one, an F32 router moe_gemv_f; only
    the types the model has. Where decode fuses (an F32 router, gate and up fused), moe_router and
    moe_down_combine of each down type too; moe_group and the grouped products of prefill for
    every quantized expert type."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as T

    from k4.runtime.cuda.kernel_names import moe_one_name
    from k4.runtime.cuda.moe_load import compile_jobs

    cfg = PRESETS["qwen3-30b-a3b"].config("qwen3moe")
    o = SimpleNamespace(_defines=lambda: ())
    def q8(t: str, glu: str) -> tuple:
        variant = "32, 1, false" if t == "type_q5_K" else "16, 2, true"
        return "moe_gemv.cu", (f"moe_gemv_q8<{t}, {variant}, {glu}>",)

    q6 = ("moe_gemv.cu", ("moe_gemv_q8<type_q6_K, 16, 1, true, false>",))
    base = {("moe.cu", ("moe_topk",)), ("moe.cu", ("moe_combine",))}
    cases = (  # router, up type, down type of layers other than 5 (5: Q6_K), expected kernels besides base and q6
        (T.F32, T.Q4_K, T.Q4_K, {("moe.cu", ("moe_gemv_f<type_f32>",)), q8("type_q4_K", "false"), q8("type_q4_K", "true"),
                                 *(("moe_down.cu", (f"moe_down_combine<{t}, 8, 4>",)) for t in ("type_q4_K", "type_q6_K")),
                                 ("moe.cu", ("moe_router<type_f32>",)),  # decode in one launch (moe_one) where it applies
                                 *(("moe_one.cu", (moe_one_name("type_q4_K", t),)) for t in ("type_q4_K", "type_q6_K"))}),
        (T.Q8_0, T.Q4_K, T.Q6_K, {("moe.cu", ("moe_gemv_q<type_q8_0>",)), q8("type_q4_K", "false"), q8("type_q4_K", "true")}),
        (T.F32, T.Q5_K, T.Q6_K, {("moe.cu", ("moe_gemv_f<type_f32>",)), q8("type_q4_K", "false"), q8("type_q5_K", "false")}),
    )
    def grouped(up: str, down: str, glu: bool) -> set:  # prefill's grouped products (quantized experts)
        b = lambda v: "true" if v else "false"  # noqa: E731
        return {("moe_grouped.cu", (n,)) for n in ("moe_group", *(f"moe_gemv_grouped<{t}, 8, 4, 8, {b(g)}>"
                                                                  for t, g in (("type_q4_K", glu), (up, glu), (down, False),
                                                                               ("type_q6_K", False))))}

    cases = [(*c[:3], c[3] | grouped(*g)) for c, g in zip(cases, (("type_q4_K", "type_q4_K", True),
                                                                   ("type_q4_K", "type_q6_K", True),
                                                                   ("type_q5_K", "type_q6_K", False)))]
    for router, up, down, want in cases:
        def tensor(name, router=router, up=up, down=down):
            layer, kind = int(name.split(".")[1]), name.split(".")[2]
            t = {"ffn_gate_inp": router, "ffn_gate_exps": T.Q4_K, "ffn_up_exps": up,
                 "ffn_down_exps": T.Q6_K if layer == 5 else down}[kind]
            return SimpleNamespace(ggml_type=t, shape=())

        jobs = {(f, names) for f, names, _ in compile_jobs(SimpleNamespace(tensor=tensor), cfg, o)}
        assert jobs == base | {q6} | want, (router, up, down)
