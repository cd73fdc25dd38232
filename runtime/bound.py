"""The memory-bandwidth bound of decoding: the bytes one decode step must read from memory (the
weights it multiplies and the KV cache it attends over) and the tokens/s that reading them at a
given bandwidth allows. `k4 bench` shows it beside each tgN test (k4 issues 18 and 19: "the bound
is (weight bytes + KV bytes read per token) / 4.2 TB/s", 4.2 TB/s being the H200's HBM3e).

Weights read per token, from the file's tensors at their on-disk sizes (ggml type block sizes):
every tensor once, except
  - token_embd.weight: one row (the embedding lookup), unless the output projection is tied to
    it (no output.weight), when the whole matrix is read once by the output product;
  - the routed experts of a mixture of experts (ffn_{gate,up,down}_exps): n_expert_used of the
    n_expert stacked experts; the router (ffn_gate_inp) and the shared expert count whole.
KV cache read per step, per layer: n_head_kv * head_dim keys and as many values, at 2 bytes a
value for f16 and 34/32 for q8_0 (-ctk/-ctv; runtime/kv_types.py, as runtime/cuda/kv_cache.py
KVCache holds them) * the positions attended: p + 1 at position p, at most the window on a
sliding-window layer (gemma; keys p - n_swa + 1 .. p as runtime/reference.py attends).
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import MOE_TENSORS
from .kv_types import F16, KVTypes
from .model import ModelConfig, ModelFile

H200_BANDWIDTH_GBS = 4200.0  # GB/s (1e9 B/s): the H200's HBM3e figure
EXPERT_TENSORS = MOE_TENSORS[1:]  # the stacked experts, past the router


def weight_bytes_per_token(mf: ModelFile) -> int:
    """Bytes of weights one decode step reads (see the module docstring), an int. The routed
    experts count n_expert_used / n_expert of their stacked tensors (whole experts: each expert
    is a whole (n_ff_exp, n_embd) or (n_embd, n_ff_exp) block of the stack)."""
    cfg = mf.config
    assert cfg is not None, "a model file with weights"
    tied = "output.weight" not in mf.tensors
    total = 0
    for name, t in mf.tensors.items():
        if name == "token_embd.weight" and not tied:
            total += t.n_bytes // t.shape[0]  # one row of (n_vocab, n_embd)
        elif cfg.n_expert and name.endswith(EXPERT_TENSORS):
            total += t.n_bytes // cfg.n_expert * cfg.n_expert_used  # (n_expert, rows, cols): k experts
        else:
            total += t.n_bytes
    return total


def kv_bytes(cfg: ModelConfig, n_keys: int, kv: KVTypes = F16) -> int:
    """Bytes of a KV cache of types kv one decode step reads when its token attends `n_keys`
    positions (its own included): per layer one key and one value row of n_head_kv * head_dim
    (KVTypes.bytes_per_token's bytes) * min(n_keys, n_swa) on a sliding layer, n_keys on the
    others."""
    per_key = kv.bytes_per_token(1, cfg.n_head_kv * cfg.head_dim)
    return sum(per_key * (min(n_keys, cfg.n_swa) if cfg.sliding(i) else n_keys) for i in range(cfg.n_layer))


def decode_keys(depth: int, n_gen: int) -> range:
    """The positions attended by each of the n_gen decode steps of a bench tgN test at `depth`
    (runtime/bench.py run_once): the first step re-evaluates the last cached token at position
    depth - 1 (position 0 at depth 0), so step i attends max(depth, 1) + i keys."""
    first = max(depth, 1)
    return range(first, first + n_gen)


@dataclass(frozen=True)
class DecodeBound:
    """The bound of one tgN test: bytes read per decode step (weights; KV averaged over the
    steps) and the tokens/s the bandwidth allows; bandwidth in bytes/s."""

    weight_bytes: int
    kv_bytes: float
    bandwidth: float

    @property
    def bytes_per_token(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.bandwidth / self.bytes_per_token


def decode_bound(mf: ModelFile, depth: int, n_gen: int, bandwidth_gbs: float = H200_BANDWIDTH_GBS,
                 kv_types: KVTypes = F16) -> DecodeBound:
    """The bandwidth bound of decoding n_gen > 0 tokens after `depth` cached ones: weights per
    token plus the KV bytes of a cache of kv_types averaged over the steps (decode_keys), at
    bandwidth_gbs GB/s (1e9 B/s)."""
    assert mf.config is not None and n_gen > 0
    keys = decode_keys(depth, n_gen)
    kv = sum(kv_bytes(mf.config, k, kv_types) for k in keys) / len(keys)
    return DecodeBound(weight_bytes_per_token(mf), kv, bandwidth_gbs * 1e9)
