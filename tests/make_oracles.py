"""Make the transformers oracles in tests/data/oracles (run on a machine with torch and
transformers; the tests read only the files it writes, so CI needs neither).

For each family llama.cpp's goldens do not cover, a tiny model is built from transformers'
own class with seeded random weights (matrices with standard deviation 1/sqrt(fan_in), norm
weights 1 + 0.1 N(0, 1), so every weight matters; Gemma's zero-centred norms 0.1 N(0, 1)),
written to GGUF as llama.cpp's converter (convert_hf_to_gguf.py) writes that family: the HF
tensor names mapped to GGUF's, F32, and no q/k permutation for NeoX-RoPE families. Gemma
(Gemma2Model / Gemma3Model there): names from gguf-py's tensor map (post_attention_norm,
post_ffw_norm), every `*norm.weight` stored plus 1 (Gemma's RMSNorm multiplies by 1 + w), no
lm_head (tied), the sliding window, soft-caps and linear RoPE scaling keys as the converter
writes them; sliding window 8 under a 40-token prompt, so sliding and global layers differ. The tokenizer metadata comes from stories260K.gguf
(512 tokens; the oracle compares logits of token ids, so its text form does not matter).
Then the model's float32 logits for every position of a fixed prompt are saved as .npy.

Scaled RoPE (the prompt runs past the original context of ORIG_CTX tokens): phi3 with partial
rotary and LongRoPE (Phi3MiniModel: qkv_proj and gate_up_proj stored fused as attn_qkv and
ffn_up, the long/short factors as rope_factors_long/short tensors, its attention factor as
rope.scaling.attn_factor), and llama with YaRN (LlamaModel: rope.scaling.type/factor/original
context, q/k rows permuted for interleaved RoPE by LlamaModel.permute).

    python tests/make_oracles.py [OUT_DIR]      # default tests/data/oracles
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter

from k4.runtime.model import ModelConfig
from k4.runtime.synthetic import vocab_from, write_metadata

DATA = Path(__file__).resolve().parent / "data"
PROMPT_LEN = 40  # tokens: BOS then seeded random ids
ORIG_CTX = 32  # the pre-scaling context of the scaled-RoPE oracles: the prompt runs past it


def qwen3_model():
    """(transformers Qwen3ForCausalLM, k4 ModelConfig of the same hyper-parameters)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                     rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, attention_bias=False)
    cfg = ModelConfig(arch="qwen3", name="tiny-qwen3-transformers", n_vocab=512, n_embd=64, n_layer=3, n_head=4,
                      n_head_kv=2, head_dim=32, n_ff=96, n_ctx_train=256, rms_eps=1e-6, rope_freq_base=1_000_000.0,
                      rope_dim=32, rope_neox=True, has_qkv_bias=False, has_qk_norm=True, has_rope_freqs=False,
                      tied_embeddings=False)
    return Qwen3ForCausalLM(hf), cfg


def phi3_model():
    """Phi3ForCausalLM with partial rotary (0.75 of each head, as Phi-4-mini) and LongRoPE
    (factor 128 / 32 = 4; the 40-token prompt is past the original 32, so transformers, by
    sequence length, and llama.cpp and k4, by a context of 256 > 32, all take the long
    factors), GQA."""
    from transformers import Phi3Config, Phi3ForCausalLM

    g = np.random.default_rng(3)
    half = 12  # rope_dim 24 of head_dim 32
    long_f, short_f = (1.0 + 7.0 * g.random(half)).tolist(), (1.0 + 0.5 * g.random(half)).tolist()
    hf = Phi3Config(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=4 * ORIG_CTX, original_max_position_embeddings=ORIG_CTX,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                     "long_factor": long_f, "short_factor": short_f})
    attn = math.sqrt(1 + math.log(4) / math.log(ORIG_CTX))  # Phi3MiniModel's attn_factor for scale 4
    cfg = ModelConfig(arch="phi3", name="tiny-phi3-transformers", n_vocab=512, n_embd=128, n_layer=2, n_head=4,
                      n_head_kv=2, head_dim=32, n_ff=96, n_ctx_train=4 * ORIG_CTX, rms_eps=1e-5, rope_freq_base=10000.0,
                      rope_dim=24, rope_neox=True, has_qkv_bias=False, has_qk_norm=False, has_rope_freqs=False,
                      tied_embeddings=False, fused_qkv=True, fused_gate_up=True, rope_scaling="longrope",
                      rope_orig_ctx=ORIG_CTX, rope_attn_factor=attn)
    return Phi3ForCausalLM(hf), cfg


def llama_yarn_model():
    """LlamaForCausalLM with YaRN (factor 4 over an original context of 32), GQA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=4 * ORIG_CTX, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, attention_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": ORIG_CTX})
    cfg = ModelConfig(arch="llama", name="tiny-llama-yarn-transformers", n_vocab=512, n_embd=64, n_layer=2, n_head=4,
                      n_head_kv=2, head_dim=16, n_ff=96, n_ctx_train=4 * ORIG_CTX, rms_eps=1e-5, rope_freq_base=10000.0,
                      rope_dim=16, rope_neox=False, has_qkv_bias=False, has_qk_norm=False, has_rope_freqs=False,
                      tied_embeddings=False, rope_scaling="yarn", rope_scale=4.0, rope_orig_ctx=ORIG_CTX)
    return LlamaForCausalLM(hf), cfg


def moe_model(arch: str):
    """Qwen3MoeForCausalLM (8 experts, 2 used, top-k weights renormalized: norm_topk_prob, as
    Qwen3-30B-A3B) or Qwen2MoeForCausalLM (the same experts, not renormalized, plus a shared
    expert of width 96 behind its sigmoid gate, q/k/v biases), 2 layers, both sparse."""
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=64, num_experts=8,
                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
                  decoder_sparse_step=1, mlp_only_layers=[])
    qwen3 = arch == "qwen3moe"
    if qwen3:
        hf = transformers.Qwen3MoeConfig(head_dim=32, norm_topk_prob=True, attention_bias=False, **common)
        model = transformers.Qwen3MoeForCausalLM(hf)
    else:
        hf = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=96, norm_topk_prob=False, qkv_bias=True, **common)
        model = transformers.Qwen2MoeForCausalLM(hf)
    cfg = ModelConfig(arch=arch, name=f"tiny-{arch}-transformers", n_vocab=512, n_embd=64, n_layer=2, n_head=4,
                      n_head_kv=2, head_dim=32 if qwen3 else 16, n_ff=96, n_ctx_train=256, rms_eps=1e-6,
                      rope_freq_base=1_000_000.0, rope_dim=32 if qwen3 else 16, rope_neox=True, has_qkv_bias=not qwen3,
                      has_qk_norm=qwen3, has_rope_freqs=False, tied_embeddings=False, n_expert=8, n_expert_used=2,
                      n_ff_exp=64, n_ff_shexp=0 if qwen3 else 96, expert_norm=qwen3)
    return model, cfg


def gemma_config(arch: str, n_layer: int, head_dim: int, rope_base: float, window: int, keys: dict) -> ModelConfig:
    """The k4 ModelConfig of a tiny Gemma (64 wide, 4 heads, 2 KV heads, n_ff 128) whose file
    has the `{arch}.*` keys `keys` (runtime/family_keys.py derives the Gemma fields)."""
    from k4.runtime.arch import ARCHITECTURES
    from k4.runtime.family_keys import family_fields

    fields = family_fields(ARCHITECTURES[arch], {"attention.sliding_window": window, **keys}, n_layer, 64, 4, head_dim, rope_base)
    return ModelConfig(arch=arch, name=f"tiny-{arch}-transformers", n_vocab=512, n_embd=64, n_layer=n_layer, n_head=4,
                       n_head_kv=2, head_dim=head_dim, n_ff=128, n_ctx_train=256, rms_eps=1e-6, rope_freq_base=rope_base,
                       rope_dim=head_dim, rope_neox=True, has_qkv_bias=False, has_qk_norm=arch == "gemma3",
                       has_rope_freqs=False, tied_embeddings=True, **fields)


def gemma3_model():
    """Gemma3ForCausalLM, 6 layers (5 sliding, 1 global: the default pattern), head_dim 64 (the
    tensor-core prefill kernel's), global RoPE 1e6 with linear scaling 8 (as Gemma 3 4B-27B),
    local RoPE 10,000."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hf = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                          max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=8, tie_word_embeddings=True,
                          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                          attn_implementation="eager")
    cfg = gemma_config("gemma3", 6, 64, 1e6, 8, {})
    keys = {"attention.sliding_window": ("uint32", 8), "rope.scaling.type": ("string", "linear"),
            "rope.scaling.factor": ("float32", 8.0)}
    return Gemma3ForCausalLM(hf), cfg, keys


def gemma2_model():
    """Gemma2ForCausalLM, 4 layers (sliding, global, sliding, global), head_dim 128, attention
    soft-cap 5 and final soft-cap 10 (small enough to bend this model's scores and logits)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    hf = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, query_pre_attn_scalar=128,
                      max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=8,
                      attn_logit_softcapping=5.0, final_logit_softcapping=10.0, tie_word_embeddings=True,
                      attn_implementation="eager")
    keys = {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}
    cfg = gemma_config("gemma2", 4, 128, 10000.0, 8, keys)
    gguf_keys = {"attention.sliding_window": ("uint32", 8), "attn_logit_softcapping": ("float32", 5.0),
                 "final_logit_softcapping": ("float32", 10.0)}
    return Gemma2ForCausalLM(hf), cfg, gguf_keys


GGUF_NAMES = {  # transformers name -> GGUF name (llama.cpp's tensor_mapping), {i} the layer
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.qkv_proj.weight": "blk.{i}.attn_qkv.weight",
    "model.layers.{i}.mlp.gate_up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    # mixture of experts (qwen2moe, qwen3moe): the router, the shared expert and its gate
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight",
    "model.layers.{i}.mlp.shared_expert.gate_proj.weight": "blk.{i}.ffn_gate_shexp.weight",
    "model.layers.{i}.mlp.shared_expert.up_proj.weight": "blk.{i}.ffn_up_shexp.weight",
    "model.layers.{i}.mlp.shared_expert.down_proj.weight": "blk.{i}.ffn_down_shexp.weight",
    "model.layers.{i}.mlp.shared_expert_gate.weight": "blk.{i}.ffn_gate_inp_shexp.weight",
    "model.layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
}


def gguf_name(hf_name: str) -> str:
    parts = hf_name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        key = ".".join(parts[:2] + ["{i}"] + parts[3:])
        return GGUF_NAMES[key].format(i=parts[2])
    return GGUF_NAMES[hf_name]


def randomize(model, seed: int, norm_base: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(norm_base + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)  # fan_in: the last axis


def write_gguf(model, cfg: ModelConfig, path: Path, keys: dict | None = None) -> None:
    """Write `model` as convert_hf_to_gguf.py would: Gemma families (`keys` not None) through
    gemma_tensors, with `keys` (suffix -> (gguf type, value)) the converter's `{arch}.*` keys
    beyond the common ones."""
    w = GGUFWriter(str(path), cfg.arch)
    write_metadata(w, cfg, vocab_from(DATA / "models" / "stories260K.gguf", cfg.n_vocab), family=keys is None)
    if keys is None:
        tensors = hf_tensors(model, cfg)
    else:
        for key, (kind, value) in keys.items():
            getattr(w, f"add_{kind}")(f"{cfg.arch}.{key}", value)
        tensors = gemma_tensors(model, cfg)
    for name, array in tensors:
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def permute_for_llama(w: np.ndarray, n_head: int) -> np.ndarray:
    """q or k rows (n_head * head_dim, n_in) reordered from transformers' rotate-half pairs to
    llama.cpp's interleaved ones: within each head, rows (j, head_dim/2 + j) become (2j, 2j + 1)
    (convert_hf_to_gguf.py LlamaModel.permute; k with the KV head count)."""
    rows = w.shape[0] // n_head
    return w.reshape(n_head, 2, rows // 2, -1).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(model, cfg: ModelConfig):
    """(GGUF name, float32 array) of a qwen3, phi3 or llama model as the converter writes it:
    GGUF_NAMES, llama's q/k permuted, phi3's LongRoPE factors from its config as tensors."""
    for name, p in model.state_dict().items():
        array = p.detach().float().cpu().numpy()
        if cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = permute_for_llama(array, cfg.n_head if "q_proj" in name else cfg.n_head_kv)
        if name.endswith("mlp.experts.gate_up_proj"):
            # transformers 5 holds the experts fused, (n_expert, 2 n_ff_exp, n_embd), gate rows first
            # (chunk(2) of the product); the converter stacks each expert's gate_proj and up_proj
            # (Qwen2MoeModel.modify_tensors: torch.stack over experts) into two tensors
            i = name.split(".")[2]
            yield f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(array[:, : cfg.n_ff_exp])
            yield f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(array[:, cfg.n_ff_exp :])
            continue
        if name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)  # (1, n_embd) squeezed to (n_embd,), as the converter writes it
        yield gguf_name(name), array
    if cfg.rope_scaling == "longrope":
        rope = model.config.rope_parameters
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32)


def gemma_tensors(model, cfg: ModelConfig):
    """(GGUF name, float32 array) of a Gemma model as Gemma2Model / Gemma3Model convert it:
    names by gguf-py's tensor map, lm_head skipped (tied to the embeddings), `*norm.weight` + 1."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[cfg.arch.upper()], cfg.n_layer)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        array = p.detach().float().cpu().numpy()
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        yield names.get_name(name, try_suffixes=(".weight",)), array


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for family, build in (("qwen3", qwen3_model), ("gemma3", gemma3_model), ("gemma2", gemma2_model), ("phi3", phi3_model),
                          ("llama-yarn", llama_yarn_model), ("qwen3moe", lambda: moe_model("qwen3moe")),
                          ("qwen2moe", lambda: moe_model("qwen2moe"))):
        torch.manual_seed(0)
        model, cfg, *keys = build()
        keys = keys[0] if keys else None
        randomize(model, seed=1, norm_base=1.0 if keys is None else 0.0)
        model = model.float().eval()
        rng = np.random.default_rng(2)
        ids = [1] + rng.integers(3, cfg.n_vocab, size=PROMPT_LEN - 1).tolist()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()  # (PROMPT_LEN, n_vocab)
        stem = f"tiny-{family}"
        write_gguf(model, cfg, out / f"{stem}.gguf", keys)
        np.save(out / f"{stem}.logits.npy", logits.astype(np.float32))
        import transformers

        index[family] = {"model": f"{stem}.gguf", "logits": f"{stem}.logits.npy", "prompt_ids": ids,
                         "transformers": transformers.__version__, "torch": torch.__version__}
    (out / "oracles.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DATA / "oracles")
