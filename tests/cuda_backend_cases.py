"""Shared by the CUDA backend tests (test_cuda_backend, test_cuda_runner, test_cuda_switches): the
switches they vary, the error limits against the numpy backend, the tiny models of every
architecture and tensor type (ARCH_CASES; tests/conftest.py's tiny_model writes them), llama.cpp's
greedy goldens and small helpers. Importing it needs no GPU."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
from gguf import GGMLQuantizationType as T

from k4.runtime.sampling import SamplingParams
from k4.runtime.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)
FUSIONS = ("K4_STACK", "K4_FUSE_NORM", "K4_FUSE_SWIGLU", "K4_FUSE_ROPE", "K4_PREFILL_F16_CACHE", "K4_PDL", "K4_TILED_ATTN",
           "K4_MMA_ATTN", "K4_PREFILL_GRAPH", "K4_EVICT_FIRST")
ALL_FLAGS = ("K4_CUDA_GRAPH", "K4_PINGPONG", "K4_CHAIN_EVENTS", "K4_PINNED_UPLOAD", "K4_REPACK", "K4_PREFILL_TC", "K4_SPLIT_ATTN", "K4_GQA_MMA",
             "K4_CARVEOUT", "K4_QKV_Q8", "K4_QKV_PAIR", "K4_ATTN_Q8", "K4_DYN_SPLIT", "K4_SHARED_MERGE",
             "K4_SHORT_ATTN", "K4_X_CLUSTER", "K4_NORM_Q8", "K4_MMA8_NQ", "K4_MMA8_FFQ8", "K4_WO_WIDE", "K4_MMA8_CLUSTER", "K4_HEAD_ARGMAX",
             "K4_QKV_WIDE") + FUSIONS


def sampling_kernels(mf, head_argmax: bool = True) -> int:
    """The sampling kernels of a decode step: sample_argmax_partial (unless the output head writes
    its partials: K4_HEAD_ARGMAX on, a quantized head whose default gemv_q8 variant runs, no final
    soft-cap) and sample_finish (the repeat penalty inside)."""
    from k4.runtime.cuda.gemv_choice import gemv_variant
    from k4.runtime.cuda.quant_types import QUANT

    cfg = mf.config
    head = mf.tensor("token_embd.weight" if cfg.tied_embeddings else "output.weight")
    t, (n_out, n_in) = head.ggml_type, head.shape
    fused = head_argmax and t in QUANT and gemv_variant(t, n_out, n_in) == QUANT[t].gemv and not cfg.final_softcap
    return 1 if fused else 2


# Error limits against the numpy backend (relative L2 of the logits), each just above what a
# correct backend errs on these seeded inputs (measured on the H200 over 4 prompts per case):
# - prefill (fp16 tensor cores, fp16 KV): at most 6.3e-4 on every ARCH_CASES entry -> 1.5e-3.
# - decode with quantized weights: matmul.gemv quantizes activations to 8 bits per 32 values
#   (llama.cpp's q8_1 scheme), compounded over the layers: at most 1.39e-2 -> 1.6e-2. A q/k norm
#   applied after RoPE instead of before errs 2.4e-2 here and fails.
#   Q2_K's random 2-bit blocks (llama-q2_k) amplify the same rounding more: 1.85e-2 -> 2.2e-2
#   (its gemv is exact to 1e-4 against 8-bit-rounded input in test_cuda_gemv).
# - decode with float weights (F32/F16/BF16; float products, fp16 KV): at most 2.8e-4 -> 1e-3.
LIMIT_PREFILL = 1.5e-3
LIMIT_DECODE_Q8 = 1.6e-2
LIMIT_DECODE_Q2_K = 2.2e-2
LIMIT_DECODE_FLOAT = 1e-3
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def prefill_errors(mf, got, want) -> list[float]:
    """The positions of a prefill (logits (n, n_vocab) each) whose error is beyond the model's
    limit: LIMIT_PREFILL on the whole; for quantized routed experts, which run on 8-bit x in prefill
    too (runtime/cuda/moe_grouped.py), the decode limit per position, and one position in 20 may
    exceed it: a near-tie of the router sends that token to another expert on one side (measured
    on qwen3moe-q8_0, 40 positions: one at 0.24, the others at most 1.0e-2)."""
    experts = {t.ggml_type for name, t in mf.tensors.items() if "_exps." in name}
    if not experts - set(FLOAT_TYPES):
        err = rel_l2(got, want)
        return [err] if err >= LIMIT_PREFILL else []
    bad = [e for e in (rel_l2(g, w) for g, w in zip(got, want)) if e >= decode_limit(mf)]
    return bad if len(bad) > len(got) // 20 else []


def decode_limit(mf) -> float:
    """The decode limit for a model: float products unless some layer matrix is quantized."""
    types = {t.ggml_type for name, t in mf.tensors.items() if name.startswith("blk.") and len(t.shape) == 2}
    if T.Q2_K in types:
        return LIMIT_DECODE_Q2_K
    return LIMIT_DECODE_FLOAT if types <= set(FLOAT_TYPES) else LIMIT_DECODE_Q8


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def take(gen, n: int) -> list[int]:
    out = list(islice(gen, n))
    gen.close()
    return out


def cuda(mf, n_ctx: int, **kw):
    from k4.runtime.cuda.backend import CudaBackend

    return CudaBackend(mf, n_ctx, **kw)


def decode_by_flag(monkeypatch, mf, flag: str, prompt: list[int], tokens, calls: list, expect) -> dict[bool, list]:
    """{on: the decode logits of `tokens` after `prompt`} for `flag` on and off (CudaBackend, n_ctx 64).
    calls: a list some patched launcher appends to (a bool per launch), cleared before each setting;
    expect(on, calls) must hold after each (what the flag's launches were)."""
    logits = {}
    for on in (True, False):
        monkeypatch.setenv(flag, str(int(on)))
        calls.clear()
        be = cuda(mf, 64)
        be.eval(prompt)
        logits[on] = [be.eval([t]) for t in tokens]
        assert expect(on, calls), f"{flag}={int(on)}: {sum(calls)} of {len(calls)} launches counted"
        be.close()
    return logits


def greedy_cases(data, model: str) -> list[dict]:
    return [c for c in json.loads((data / "golden" / "greedy.json").read_text())["cases"] if c["model"] == model]


def continuation(tok: Tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    return tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)) :]


def check_q4_k_m_greedy(data, tok: Tokenizer, be, n: int = 16) -> None:
    """The first n greedy tokens of each of llama.cpp's stories260K-pad-q4_k_m cases, generated by
    `be`, start its completion."""
    cases = greedy_cases(data, "stories260K-pad-q4_k_m.gguf")
    assert cases
    for case in cases:
        be.reset()
        ids = tok.encode(case["prompt"])
        out = take(be.generate(ids, GREEDY), n)
        assert case["completion"].startswith(continuation(tok, ids, out)), case["prompt"]


K_CFG = dict(n_embd=256, n_ff=256, n_head=8, n_head_kv=2, head_dim=32, rope_dim=32)
ARCH_CASES = {
    "llama-q8_0-gqa": ("llama", T.Q8_0, {}),
    "qwen2-q8_0-bias": ("qwen2", T.Q8_0, {}),
    "qwen3-q8_0-qknorm": ("qwen3", T.Q8_0, {}),
    "llama-f16-tied": ("llama", T.F16, {"tied_embeddings": True}),
    "llama-bf16": ("llama", T.BF16, {}),
    "llama-f32-rope-freqs": ("llama", T.F32, {"has_rope_freqs": True}),
    "qwen2-q5_0": ("qwen2", T.Q5_0, {}),
    "llama-q5_1": ("llama", T.Q5_1, {}),
    "llama-q4_k": ("llama", T.Q4_K, K_CFG),
    "qwen3-q5_k": ("qwen3", T.Q5_K, K_CFG),
    "llama-q6_k-tied": ("llama", T.Q6_K, {**K_CFG, "tied_embeddings": True}),
    # 4 query heads per KV head: decode attention on attn_gqa (attention_launch.GQA_MIN_GROUP)
    "qwen2-q8_0-hd64": ("qwen2", T.Q8_0, {"n_embd": 128, "n_head": 8, "n_head_kv": 2, "head_dim": 64, "rope_dim": 64}),
    # Q2_K, Q3_K, IQ4_XS, IQ4_NL: random valid blocks (tests/quant_blocks.py); Q4_0 from gguf's quantizer
    "llama-q2_k": ("llama", T.Q2_K, K_CFG),
    "qwen3-q3_k": ("qwen3", T.Q3_K, K_CFG),
    "qwen2-q4_0": ("qwen2", T.Q4_0, {}),
    "llama-iq4_xs-tied": ("llama", T.IQ4_XS, {**K_CFG, "tied_embeddings": True}),
    "llama-iq4_nl": ("llama", T.IQ4_NL, {}),
    # phi3: fused attn_qkv and gate|up ffn_up as row views; partial rotary with LongRoPE's long
    # factors (n_ctx 64 > 32) and magnitude; Q4_K: the views repacked and gate/up interleaved
    "phi3-q8_0-longrope": ("phi3", T.Q8_0, {"rope_dim": 12, "rope_scaling": "longrope", "rope_orig_ctx": 32,
                                            "rope_attn_factor": 1.18}),
    "phi3-q4_k": ("phi3", T.Q4_K, K_CFG),
    "llama-q8_0-yarn": ("llama", T.Q8_0, {"rope_scaling": "yarn", "rope_scale": 4.0, "rope_orig_ctx": 16}),
    "qwen2-q8_0-linear": ("qwen2", T.Q8_0, {"rope_scaling": "linear", "rope_scale": 2.0}),
    # qwen3moe with quantized experts and an F32 router, as llama.cpp's files: decode in three launches
    # (runtime/cuda/moe.py decode_fused; k = 2 and k = 8: lane groups of 16 and 4 in moe_down_combine)
    "qwen3moe-q8_0": ("qwen3moe", T.Q8_0, {"has_qk_norm": True, "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 32,
                                           "expert_norm": True}),
    "qwen3moe-q4_k": ("qwen3moe", T.Q4_K, {**K_CFG, "has_qk_norm": True, "n_expert": 16, "n_expert_used": 8, "n_ff_exp": 256,
                                           "expert_norm": True}),
    # Q6_K experts go to the device planar (K4_PLANAR_EXPERTS; moe_one's Q6_K/Q6_K instance)
    "qwen3moe-q6_k": ("qwen3moe", T.Q6_K, {**K_CFG, "has_qk_norm": True, "n_expert": 16, "n_expert_used": 8, "n_ff_exp": 256,
                                           "expert_norm": True}),
}
