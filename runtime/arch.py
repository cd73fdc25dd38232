"""A description of each model architecture k4 runs: its tensors, the ops of one block in order,
and the options that tell one family from another. Both backends execute it: the config
(runtime/model.py) takes the family's options from here, expected_shapes its tensor table, and
the forward passes (runtime/reference.py, runtime/cuda/forward.py) walk the same op order,
switching on the options only.

Adding a family that shares this block structure is one entry in ARCHITECTURES; a new op (a
different norm, activation or attention) is a new option here, a step in both forward passes
and, on the GPU, a kernel. Names follow llama.cpp (GGUF `general.architecture`, tensor names
as its converter writes them, LLM_ARCH_* in llama-arch.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

# One block, in execution order; each step names the GGUF tensors it reads (blk.N.<name>).
# Steps in brackets run only where an option says so.
BLOCK = (
    ("attn_norm", "RMSNorm of the residual stream", ("attn_norm.weight",)),
    ("qkv", "q, k, v projections [+ bias: qkv_bias] [one attn_qkv tensor: fused_qkv]", ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
    ("qk_norm", "[per-head RMSNorm of q and k: qk_norm]", ("attn_q_norm.weight", "attn_k_norm.weight")),
    ("rope", "RoPE on q and k (rope_neox: halves, else interleaved pairs; rope_freqs divisors)", ()),
    ("kv_store", "k and v into the KV cache", ()),
    ("attention", "causal grouped-query attention over the cache, scale query_scale [only the last window "
                  "keys on sliding layers: sliding_window] [tanh soft-cap of the scores: attn_softcap]", ()),
    ("attn_output", "output projection + residual", ("attn_output.weight",)),
    ("attn_post_norm", "[RMSNorm of the projection before the residual: post_norms]", ("post_attention_norm.weight",)),
    ("ffn_norm", "RMSNorm of the residual stream", ("ffn_norm.weight",)),
    ("gate_up", "gate and up projections [one ffn_up tensor, gate rows first: fused_gate_up]", ("ffn_gate.weight", "ffn_up.weight")),
    ("glu", "act(gate) * up: silu (SwiGLU) or gelu_tanh (GeGLU): activation", ()),
    ("ffn_down", "down projection + residual", ("ffn_down.weight",)),
    ("ffn_post_norm", "[RMSNorm of the projection before the residual: post_norms]", ("post_ffw_norm.weight",)),
)
# Mixture of experts (moe): gate_up, glu and ffn_down are replaced by the routed experts
# (runtime/moe.py): router logits ffn_gate_inp, softmax, top expert_used_count, [weights
# renormalized: moe_norm_topk]; per selected expert SwiGLU of ffn_{gate,up,down}_exps[e]; the
# weighted sum [+ sigmoid(ffn_gate_inp_shexp . x) times the shared expert's SwiGLU: moe_shared].
MOE_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
MOE_SHARED_TENSORS = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
# Around the blocks: the token embedding rows [times sqrt(n_embd): embed_scale] before the first,
# and after the last the output RMSNorm, the output projection [tanh soft-cap: final_softcap].


@dataclass(frozen=True)
class Architecture:
    """One family. rope_neox: RoPE rotates halves (NeoX) rather than interleaved pairs (llama.cpp's
    "normal" mode, for which its converter permutes q/k rows). qkv_bias: "always", "never" or
    "if present" (attn_{q,k,v}.bias). qk_norm: per-head RMSNorm of q and k before RoPE
    (attn_{q,k}_norm.weight, (head_dim,)).

    The Gemma options (llama.cpp src/models/gemma2-iswa.cpp, gemma3.cpp and their hparams;
    transformers' Gemma2/Gemma3ForCausalLM): embed_scale multiplies the embedding rows by
    sqrt(n_embd); activation "gelu_tanh" is GeGLU with the tanh-approximated GELU; post_norms adds
    an RMSNorm of each sub-block's output before its residual add; swa_period: layer il attends
    to a sliding window when il % period < period - 1 (llama.cpp's set_swa_pattern) unless the
    file's attention.sliding_window_pattern says otherwise, the window from
    attention.sliding_window (swa_window when the file has none; 0: required); swa_rope_base:
    the RoPE base of sliding layers when the file has no rope.freq_base_swa (0: the global
    base); attn_softcap / final_softcap: the cap when the file has no {attn,final}_logit_softcapping
    key (None: the family reads no such key; 0: off); wide_query_layers: the block count at which
    llama.cpp scales queries by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim) (the 27B
    models; 0: never). runtime/family_keys.py turns these and the file's keys into ModelConfig
    fields."""

    name: str
    rope_neox: bool
    qkv_bias: str
    qk_norm: bool
    fused_qkv: str = "never"  # "if present": q|k|v rows in one blk.N.attn_qkv.weight (phi3)
    fused_gate_up: bool = False  # ffn_up holds gate rows then up rows (2 x n_ff), no ffn_gate (phi3)
    embed_scale: bool = False
    activation: str = "silu"
    post_norms: bool = False
    swa_period: int = 0
    swa_window: int = 0
    swa_rope_base: float = 0.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    wide_query_layers: int = 0
    moe: bool = False  # routed experts in place of the dense FFN (qwen2moe, qwen3moe)
    moe_shared: bool = False  # plus a shared expert with a sigmoid gate (qwen2moe)
    moe_norm_topk: bool = False  # the k selected softmax weights renormalized to sum 1 (qwen3moe)

    def has_qkv_bias(self, tensor_names) -> bool:
        """Whether the q/k/v biases are read, given the file's tensor names."""
        if self.qkv_bias == "if present":
            return "blk.0.attn_q.bias" in tensor_names
        return self.qkv_bias == "always"

    def has_fused_qkv(self, tensor_names) -> bool:
        """Whether the file holds q, k, v as one attn_qkv tensor (llama.cpp's phi3 loads it when
        present, else separate attn_q/k/v)."""
        return self.fused_qkv == "if present" and "blk.0.attn_qkv.weight" in tensor_names


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", rope_neox=False, qkv_bias="if present", qk_norm=False),  # Llama 2/3/3.1/3.2, Mistral, SmolLM
        Architecture("qwen2", rope_neox=True, qkv_bias="always", qk_norm=False),  # Qwen2, Qwen2.5
        Architecture("qwen3", rope_neox=True, qkv_bias="never", qk_norm=True),  # Qwen3 dense
        # Phi-3/3.5-mini, Phi-4, Phi-4-mini (llama.cpp src/models/phi3.cpp): NeoX RoPE, partial
        # rotary by rope.dimension_count, LongRoPE factors by context (runtime/rope.py)
        Architecture("phi3", rope_neox=True, qkv_bias="never", qk_norm=False, fused_qkv="if present", fused_gate_up=True),
        # Gemma 2 2B/9B/27B: local/global layers alternate (window 4096 by default), soft-capped
        # attention scores (50) and logits (30)
        Architecture("gemma2", rope_neox=True, qkv_bias="never", qk_norm=False, embed_scale=True, activation="gelu_tanh",
                     post_norms=True, swa_period=2, swa_window=4096, attn_softcap=50.0, final_softcap=30.0,
                     wide_query_layers=46),
        # Gemma 3 1B/4B/12B/27B: 5 sliding layers (RoPE base 10,000) to 1 global, q/k norm
        Architecture("gemma3", rope_neox=True, qkv_bias="never", qk_norm=True, embed_scale=True, activation="gelu_tanh",
                     post_norms=True, swa_period=6, swa_rope_base=10000.0, final_softcap=0.0, wide_query_layers=62),
        # Mixture of experts (llama.cpp src/models/qwen2moe.cpp, qwen3moe.cpp: build_moe_ffn with
        # softmax gating, norm_w false / true): Qwen1.5-MoE, Qwen2-57B-A14B (60/64 experts + a
        # shared expert); Qwen3-30B-A3B, Qwen3-235B-A22B (128 experts, 8 used)
        Architecture("qwen2moe", rope_neox=True, qkv_bias="always", qk_norm=False, moe=True, moe_shared=True),
        Architecture("qwen3moe", rope_neox=True, qkv_bias="never", qk_norm=True, moe=True, moe_norm_topk=True),
    )
}


def layer_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The tensors of one block (names after `blk.N.`) with their numpy shapes, for a
    runtime.model.ModelConfig: the BLOCK steps' tensors that its options select."""
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (cfg.n_embd,),
        **({"attn_qkv.weight": (cfg.q_dim + 2 * cfg.kv_dim, cfg.n_embd)} if cfg.fused_qkv else {
            "attn_q.weight": (cfg.q_dim, cfg.n_embd),
            "attn_k.weight": (cfg.kv_dim, cfg.n_embd),
            "attn_v.weight": (cfg.kv_dim, cfg.n_embd)}),
        "attn_output.weight": (cfg.n_embd, cfg.q_dim),
        "ffn_norm.weight": (cfg.n_embd,),
    }
    if cfg.n_expert:
        shapes.update(moe_shapes(cfg))
    else:
        shapes.update({**({"ffn_up.weight": (2 * cfg.n_ff, cfg.n_embd)} if cfg.fused_gate_up else {
            "ffn_gate.weight": (cfg.n_ff, cfg.n_embd),
            "ffn_up.weight": (cfg.n_ff, cfg.n_embd)}),
            "ffn_down.weight": (cfg.n_embd, cfg.n_ff)})
    if cfg.has_qkv_bias:
        shapes.update({"attn_q.bias": (cfg.q_dim,), "attn_k.bias": (cfg.kv_dim,), "attn_v.bias": (cfg.kv_dim,)})
    if cfg.has_qk_norm:
        shapes.update({"attn_q_norm.weight": (cfg.head_dim,), "attn_k_norm.weight": (cfg.head_dim,)})
    if cfg.has_post_norms:
        shapes.update({"post_attention_norm.weight": (cfg.n_embd,), "post_ffw_norm.weight": (cfg.n_embd,)})
    return shapes


def moe_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The expert tensors of one block (names after `blk.N.`), numpy shapes: the router
    (n_expert, n_embd); experts stacked on the first axis as convert_hf_to_gguf.py stacks them
    (ggml ne {n_embd, n_ff_exp, n_expert}): gate and up (n_expert, n_ff_exp, n_embd), down
    (n_expert, n_embd, n_ff_exp); the shared expert's gate vector (n_embd,) and its matrices
    (n_ff_shexp rows) when cfg.n_ff_shexp > 0 (llama.cpp's LLM_ARCH_QWEN2MOE tensors)."""
    e, d, f = cfg.n_expert, cfg.n_embd, cfg.n_ff_exp
    shapes = dict(zip(MOE_TENSORS, ((e, d), (e, f, d), (e, f, d), (e, d, f))))
    if cfg.n_ff_shexp:
        s = cfg.n_ff_shexp
        shapes.update(zip(MOE_SHARED_TENSORS, ((d,), (s, d), (s, d), (d, s))))
    return shapes
