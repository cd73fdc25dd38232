"""Make the transformers oracles in tests/data/oracles (run on a machine with torch and
transformers; the tests read only the files it writes, so CI needs neither).

For each family llama.cpp's goldens do not cover, a tiny model is built from transformers'
own class with seeded random weights (matrices with standard deviation 1/sqrt(fan_in), norm
weights 1 + 0.1 N(0, 1), so every weight matters), written to GGUF as llama.cpp's converter
(convert_hf_to_gguf.py) writes that family: the HF tensor names mapped to GGUF's, F32, and no
q/k permutation for NeoX-RoPE families. The tokenizer metadata comes from stories260K.gguf
(512 tokens; the oracle compares logits of token ids, so its text form does not matter).
Then the model's float32 logits for every position of a fixed prompt are saved as .npy.

    python tests/make_oracles.py [OUT_DIR]      # default tests/data/oracles
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter

from k4.runtime.model import ModelConfig
from k4.runtime.synthetic import vocab_from, write_metadata

DATA = Path(__file__).resolve().parent / "data"
PROMPT_LEN = 40  # tokens: BOS then seeded random ids


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


GGUF_NAMES = {  # transformers name -> GGUF name (llama.cpp's tensor_mapping), {i} the layer
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    parts = hf_name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        key = ".".join(parts[:2] + ["{i}"] + parts[3:])
        return GGUF_NAMES[key].format(i=parts[2])
    return GGUF_NAMES[hf_name]


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def write_gguf(model, cfg: ModelConfig, path: Path) -> None:
    w = GGUFWriter(str(path), cfg.arch)
    write_metadata(w, cfg, vocab_from(DATA / "models" / "stories260K.gguf", cfg.n_vocab))
    for name, p in model.state_dict().items():
        w.add_tensor(gguf_name(name), p.detach().float().cpu().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for family, build in (("qwen3", qwen3_model),):
        torch.manual_seed(0)
        model, cfg = build()
        randomize(model, seed=1)
        model = model.float().eval()
        rng = np.random.default_rng(2)
        ids = [1] + rng.integers(3, cfg.n_vocab, size=PROMPT_LEN - 1).tolist()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()  # (PROMPT_LEN, n_vocab)
        stem = f"tiny-{family}"
        write_gguf(model, cfg, out / f"{stem}.gguf")
        np.save(out / f"{stem}.logits.npy", logits.astype(np.float32))
        import transformers

        index[family] = {"model": f"{stem}.gguf", "logits": f"{stem}.logits.npy", "prompt_ids": ids,
                         "transformers": transformers.__version__, "torch": torch.__version__}
    (out / "oracles.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DATA / "oracles")
