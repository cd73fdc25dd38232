"""Every K4_* environment flag, parsed in this one place.

Each optimization of the CUDA backend has a flag that turns it off (set it to 0), so
`k4 bench --flags "K4_X=0"` can measure what it is worth. Unknown K4_* variables get one
warning. The README's flag table lists every flag (tests/test_cli.py checks it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping


@dataclass(frozen=True)
class Flag:
    name: str
    default: int
    doc: str


FLAGS: dict[str, Flag] = {
    f.name: f
    for f in (
        Flag("K4_TRACE", 0, "1 prints the per-phase copy/sync/launch counters after `k4 run`."),
        Flag("K4_CUDA_GRAPH", 1, "Capture the decode step in a CUDA graph (one per range of context lengths, on first use) and replay it every token."),
        Flag("K4_PINGPONG", 1, "Two-stream ping-pong readback: enqueue step t+1 before reading token t."),
        Flag("K4_CHAIN_EVENTS", 1, "With K4_PINGPONG, each decode step records one CUDA event (its timing end, which the readback also waits for, and the next step's timing start while the GPU is still busy) instead of three: every record between two graph replays widens the gap between them (docs/PERF.md, session 35)."),
        Flag("K4_PINNED_UPLOAD", 1, "Upload weights through a ring of pinned staging buffers filled by reader threads, drained by a copy stream."),
        Flag("K4_REPACK", 1, "Repack quantized weights at load into the layout the matrix-vector kernels read fastest."),
        Flag("K4_PREFILL_TC", 1, "Prefill matrix products on tensor cores (dequantize tiles to fp16); 0 uses matrix-vector per token."),
        Flag("K4_MMA8", 1, "Products of 3 to 8 tokens (speculative verify) of Q4_K and Q6_K weights on int8 tensor cores (gemv_mma); 0: 3 and 4 tokens on dp4a (gemv_batch), 5 to 8 on fp16 tensor cores."),
        Flag("K4_PDL", 1, "Programmatic dependent launch of the kernels inside CUDA graphs (each starts while the previous drains); prefill attention always launches without it."),
        Flag("K4_SPLIT_ATTN", 1, "Decode attention split over the sequence (flash-decoding) for long contexts."),
        Flag("K4_STACK", 1, "Stack attn_q/k/v (runs of one type) and ffn_gate/up into one matrix each at load: one product instead of several."),
        Flag("K4_FUSE_NORM", 1, "Fold each RMSNorm into the prologue of the decode matrix-vector product that follows it."),
        Flag("K4_FUSE_SWIGLU", 1, "Interleave ffn_gate/up rows at load and apply SwiGLU (GeGLU for gemma) in the decode product's epilogue."),
        Flag("K4_EVICT_FIRST", 1, "Load what is read once per token, the weights (matrix-vector and dequantization kernels) and the KV cache (decode attention), with the L1 evict-first cache hint."),
        Flag("K4_FUSE_QUANT", 0, "1 quantizes the SwiGLU output to 8 bits once, in the decode gate/up epilogue, for the down product (else each of its blocks does); off by default: the gate/up product loses more to imbalance than down gains (docs/PERF.md)."),
        Flag("K4_QKV_Q8", 1, "In decode, the first of several q/k/v products of different types (Q4_K_M's q|k and v) also writes its normalized input quantized, and the others copy it instead of repeating the RMSNorm (and Gemma's post-norm) in every block, where they do not fold the RMSNorm's scale into their outputs (products of at most 16 warps without a post-norm do, in one pass over x)."),
        Flag("K4_QKV_PAIR", 1, "In decode, q/k/v in two runs of different quantized types (Q4_K_M's Q4_K q|k and Q6_K v) are one launch (gemv_q8_pair): the grid split by block between the two matrices, x quantized once per block; 0 launches one product per run."),
        Flag("K4_X_CLUSTER", 1, "In decode, a matrix-vector product that quantizes a long x itself (the down product past 8,192 inputs) launches in clusters of two blocks that each quantize half of x into both blocks' shared memory; the same bits."),
        Flag("K4_NORM_Q8", 1, "In decode, the output and down products of layers without post-norms also write the next RMSNorm's input times its weights quantized (no norm scale) and each block's sum of squares; the next products (gate/up, q/k/v, the output head) copy it and scale their sums by the norm instead of normalizing and quantizing x in every block."),
        Flag("K4_WO_WIDE", 1, "In decode, the Q4_K output product of more than 2,048 inputs (Llama 2 7B, Qwen2.5 7B, the MoE layers of Qwen3-30B-A3B) runs blocks of 32 warps without prefetch, which issue its arithmetic after attention faster than 16 warps that prefetch, with the next RMSNorm's handoff where K4_NORM_Q8 gives it one; the same bits."),
        Flag("K4_QKV_WIDE", 1, "In decode, the q/k/v product of one Q4_K run with a few rounds of rows (Qwen2.5 7B's 4,608, TinyLlama's 2,560, Qwen3-30B-A3B's 5,120 outputs) runs blocks of 20 warps, whose grid takes a round of rows off 16 warps' and leaves attention's block room beside it: the same bits reading a handoff, the RMSNorm's scale summed over other warps otherwise. tg128 on the H200 (session 52): TinyLlama +0.7-1.4%, Qwen2.5 7B +0.6-1.0%."),
        Flag("K4_HEAD_ARGMAX", 1, "In decode, the output head's product also finds each block's largest logit, the sampler's first argmax pass, so no sample_argmax_partial kernel runs after it; where the repeat penalty changes logits, greedy sampling takes the argmax of all of them. The same tokens."),
        Flag("K4_MMA8_CLUSTER", 1, "The products of 3 to 8 tokens on int8 tensor cores (K4_MMA8) in thread-block clusters of two whose blocks split every weight row's 256-weight blocks, each staging half of the tokens' x; 0: every block stages all of x."),
        Flag("K4_MMA8_NQ", 1, "In the speculative verify step (3 to 8 tokens on int8 tensor cores, K4_MMA8), the down products of layers without post-norms also write the next RMSNorm's input times its weights quantized (no norm scale) and each step's sum of squares; the next q/k/v products (or the output head) copy it and scale it by the norm, so no RMSNorm kernel runs between them."),
        Flag("K4_MMA8_FFQ8", 1, "In the speculative verify step (3 to 8 tokens on int8 tensor cores, K4_MMA8), the gate/up product also writes its SwiGLU (GeGLU) output quantized, a step's 32 outputs at a time, and the down product copies it; no quantize_q8_rows kernel runs between them. The same bytes."),
        Flag("K4_MEGAKERNEL", 0, "1 runs each decode step of a dense llama-style model (Q4_K/Q5_K/Q6_K/Q8_0 weights, f16 KV cache) attending up to 4,096 keys as one persistent kernel that streams every weight through shared memory while it waits on the op before (kernels_cu/megakernel.cu); other models and longer contexts keep the graph of one kernel per op."),
        Flag("K4_FUSE_MOE", 1, "Decode's mixture-of-experts feed-forward in three launches: the router product with the RMSNorm, gate/up and down each making the router's top-k choice themselves, the weighted sum and residual in down's epilogue (no RMSNorm, top-k or combine kernels)."),
        Flag("K4_MOE_ONE", 1, "With K4_FUSE_MOE, those three launches as one (Q4_K or Q6_K experts, F32 router): one block per multiprocessor, the logits handed over as tagged words each block polls and the SwiGLU rows behind a count of the blocks that wrote theirs, the down weights loading while the other blocks finish; the same logits bit for bit."),
        Flag("K4_PLANAR_EXPERTS", 1, "Stacked expert tensors of Q6_K (the down experts of Q4_K_M MoE files) go to the device in the planar layout, expert by expert, so their loads are aligned 16-byte words that do not stall the warp; moe_one then loads its first down rows before its block's arrival as it does for Q4_K. 0 keeps the file's raw blocks. The same bits."),
        Flag("K4_FUSE_ROPE", 1, "Apply RoPE and store the token's key/value inside the decode attention kernel (no separate RoPE kernel)."),
        Flag("K4_MMA_ATTN", 1, "Prefill attention on tensor cores (mma.sync fp16, f32 accumulate); 0 uses the CUDA-core tiles of K4_TILED_ATTN."),
        Flag("K4_GQA_MMA", 1, "Decode attention of grouped-query models with 4 or more query heads per KV head on tensor cores past 4,096 keys: the query heads of a KV head as the rows of one mma tile, each key and value read once for them; 0 uses one block per query head at every depth."),
        Flag("K4_GQA_COLS", 1, "With K4_GQA_MMA, a group of up to 8 query heads per KV head as the 8 columns of the mma tiles (keys as the rows: half the tensor-core work and accumulators of 4 query heads in 16 rows); 0 puts them in the rows."),
        Flag("K4_ATTN_Q8", 1, "Decode attention also writes its output quantized to 8 bits (attn_kv up to 4,096 keys with head_dim a multiple of 32 up to 256; attn_gqa, K4_GQA_MMA, in the merge of its splits), and the output product copies it instead of quantizing the whole attention output in every block; so does the speculative verify step's attention (attn_mma, head_dim a multiple of 32) for its output product on int8 tensor cores, instead of a quantize_q8_rows kernel. The same bytes, so the same logits."),
        Flag("K4_DYN_SPLIT", 1, "Split decode attention sizes each step's splits for the keys it sees, on the device (as many splits as the range's graph launches, each the shortest multiple of the kernel's tile that covers them); 0 keeps one split length per range of positions, planned for its longest context, so early in a range fewer, longer splits run."),
        Flag("K4_SHORT_ATTN", 1, "Decode attention over an f16 cache of at most 512 keys (head_dim 128; 1,024 at 64, 256 at 256) on attn_short: blocks of up to 128 keys (256, 64) per query head copy their cached keys and values into shared memory and tabulate RoPE before they wait for the q/k/v product; up to 128 keys one block writes the output, past it the head's last block merges the others' partials; 0 runs attn_kv there."),
        Flag("K4_SHARED_MERGE", 1, "attn_gqa's merge of a KV head's splits is shared by the last of its blocks to finish (up to one per 32 outputs, each reading its share of the partials), the others waiting for the last; 0 leaves the merge to the last block alone."),
        Flag("K4_GQA_INT8", 1, "With K4_GQA_COLS and a q8_0 key cache (-ctk q8_0), q.k on int8 tensor cores: the keys' quants as stored, the query quantized to 8 bits per 32 dims (as llama.cpp's vector kernels do for quantized keys); 0 dequantizes the keys to fp16 first."),
        Flag("K4_CARVEOUT", 1, "Every kernel asks for one split of the multiprocessor's L1 and shared memory (50% shared), so consecutive kernels do not make it reconfigure between them; 0 leaves the split to the driver per kernel."),
        Flag("K4_TILED_ATTN", 1, "Prefill attention in tiles of 32 queries x 64 keys staged in shared memory (keys read once per tile, not per query)."),
        Flag("K4_PREFILL_GRAPH", 1, "Replay full prefill chunks as CUDA graphs (cuBLAS through k4's own handle); 0 launches every kernel from Python."),
        Flag("K4_SWA_RING", 1, "Keep a sliding-window layer's KV cache (Gemma) as a ring of its window plus one prefill chunk of positions (rounded up to a power of two); 0 keeps the whole context on every layer (llama.cpp's --swa-full)."),
        Flag("K4_PREFILL_F16_CACHE", 1, "Keep an fp16 copy of the weights for prefill when it takes under 25% of free GPU memory; 0 dequantizes per call."),
    )
}


def _parse(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        from .errors import UsageError

        raise UsageError(f"environment variable {name}={raw!r} is not an integer; use 0 or 1") from None


NOT_FLAGS = frozenset({"K4_REQUIRE_GPU"})  # K4_* variables of the test harness (tests/conftest.py), not switches

class Flags:
    """Flag values from an environment mapping (default: os.environ), read once: the one place
    k4 reads its K4_* variables. The value is passed down (make_backend, CudaBackend, k4 bench)
    to everything that depends on a switch."""

    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.values = {n: _parse(n, env[n]) if n in env else f.default for n, f in FLAGS.items()}
        self.unknown = sorted(k for k in env if k.startswith("K4_") and k not in FLAGS and k not in NOT_FLAGS)

    def with_(self, overrides: Iterable[tuple[str, str]]) -> "Flags":
        """A copy with `overrides` ((name, raw value) pairs, e.g. from `k4 bench --flags`) applied.
        Raises UsageError on a malformed value."""
        out = Flags({})
        out.values = dict(self.values)
        out.values.update({name: _parse(name, raw) for name, raw in overrides})
        out.unknown = list(self.unknown)
        return out

    def __getitem__(self, name: str) -> int:
        return self.values[name]

    def on(self, name: str) -> bool:
        return bool(self.values[name])

    def warnings(self) -> list[str]:
        """One message per unknown K4_* variable in the environment."""
        return [f"unknown flag {name} is ignored; known flags: {', '.join(FLAGS)}" for name in self.unknown]
