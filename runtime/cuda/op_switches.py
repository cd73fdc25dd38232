"""Which kernels ops.Ops launches: the K4_* switches of its launchers, as one value.

Ops (and its attention part, runtime/cuda/attention_launch.py AttentionLaunchers) reads each
choice from an OpSwitches it is given; sizing.options builds it from Flags, so the backend, the
size plan and `k4 bench --kernels` make the same choices for the same flags. Tests change one
switch with dataclasses.replace.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..flags import Flags


@dataclass(frozen=True)
class OpSwitches:
    """Every field but pdl is on by default, as its flag is (runtime/flags.py has what each is
    worth); pdl is off unless given, so launchers built for one test or microbenchmark launch plainly.

    pdl: programmatic dependent launch inside a CUDA graph capture (K4_PDL).
    tiled: prefill attention on attn_tiled where attn_mma is off (K4_TILED_ATTN).
    mma: prefill attention on attn_mma, tensor cores (K4_MMA_ATTN).
    evict_first: the L1 evict-first hint on the KV cache's loads in decode attention (K4_EVICT_FIRST).
    gqa: decode attention of a grouped-query model on attn_gqa (K4_GQA_MMA).
    gqa_cols: attn_gqa with the group's query heads as the mma's columns (K4_GQA_COLS).
    gqa_int8: attn_gqa's q8_0 keys by int8 mma (K4_GQA_INT8).
    attn_q8: decode attention hands the output product its output quantized (K4_ATTN_Q8).
    dyn_split: decode attention sizes each step's splits on the device (K4_DYN_SPLIT).
    shared_merge: attn_gqa's last blocks of a KV head share its merge (K4_SHARED_MERGE).
    short_attn: short decode ranges over an fp16 cache on attn_short (K4_SHORT_ATTN).
    planar_experts: the MoE kernels read Q6_K expert tensors planar (K4_PLANAR_EXPERTS; compiled in
        as T::expert_planar, so it must match how runtime/cuda/moe.py uploaded them).
    """

    pdl: bool = False
    tiled: bool = True
    mma: bool = True
    evict_first: bool = True
    gqa: bool = True
    gqa_cols: bool = True
    gqa_int8: bool = True
    attn_q8: bool = True
    dyn_split: bool = True
    shared_merge: bool = True
    short_attn: bool = True
    planar_experts: bool = True

    @classmethod
    def from_flags(cls, flags: Flags) -> OpSwitches:
        """The switches of `flags` (FLAG_OF names each field's flag)."""
        return cls(**{f.name: flags.on(FLAG_OF[f.name]) for f in fields(cls)})


FLAG_OF = {"pdl": "K4_PDL", "tiled": "K4_TILED_ATTN", "mma": "K4_MMA_ATTN", "evict_first": "K4_EVICT_FIRST",
           "gqa": "K4_GQA_MMA", "gqa_cols": "K4_GQA_COLS", "gqa_int8": "K4_GQA_INT8", "attn_q8": "K4_ATTN_Q8",
           "dyn_split": "K4_DYN_SPLIT", "shared_merge": "K4_SHARED_MERGE", "short_attn": "K4_SHORT_ATTN",
           "planar_experts": "K4_PLANAR_EXPERTS"}
