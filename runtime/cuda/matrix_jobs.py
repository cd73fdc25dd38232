"""The compile jobs of a model's matrix kernels (runtime/cuda/quant_kernels.py's compile groups):
which groups of gemv.cu, gemv_batch.cu, gemv_mma*.cu and matmul.cu a model with weights of given
ggml types needs, for compile.compile_async at load. Importable without CuPy."""

from __future__ import annotations

from collections.abc import Iterable

from gguf import GGMLQuantizationType as T

from .gemv_choice import NQ_TYPES, QKV_PAIRS, QKV_VARIANT
from .quant_kernels import GLU_ACTS, GROUPS, MMA8_DECODERS, _batch_names, _defines, _mma8_names
from .quant_types import FLOAT, QUANT


def compile_jobs(types: Iterable[T], evict_first: bool = True, activation: str = "silu", mma8: bool = False,
                 head: T | None = None, qkv: bool = False) -> list:
    """compile.module() arguments for the matrix kernels of weights of `types` (ggml types with
    CUDA kernels; others are skipped): their gemv, gemv_batch (quantized types), gemv_mma
    (MMA8_DECODERS) and dequantization instances, matmul.cu's conversions, and the gemv_q8_pair
    instances of every QKV_PAIRS entry whose two types are present; with activation "gelu_tanh"
    (ModelConfig.activation) also the GeGLU-epilogue instances, else the NQ instances of
    NQ_TYPES (gemv norm_out); mma8 False (flag K4_MMA8 off):
    no gemv_mma instances; head: the output head's type, whose AM instances (K4_HEAD_ARGMAX) come
    too where it is quantized; qkv (K4_QKV_WIDE): the QKV_VARIANT instances. For compile.compile_async at
    load: each gemv_batch and gemv_mma instance is a job of its own (~1 s each with nvcc), so the compile
    threads build them in parallel with the rest."""
    present = [t for t in dict.fromkeys(types) if t in QUANT or t in FLOAT]
    jobs = [("matmul.cu", GROUPS["matmul.cu"]["common"], ())]
    jobs += [("gemv.cu", GROUPS["gemv.cu"][f"{head.name}.am"], _defines(evict_first))] if head in QUANT else []
    gelu = activation != "silu" and activation in GLU_ACTS
    jobs += [("gemv.cu", GROUPS["gemv.cu"][f"pair.{a.name}.{b.name}"], _defines(evict_first))
             for a, b in QKV_PAIRS if a in present and b in present]
    for t in present:
        jobs += [("gemv.cu", GROUPS["gemv.cu"][t.name], _defines(evict_first)),
                 ("matmul.cu", GROUPS["matmul.cu"][t.name], _defines(evict_first))]
        if qkv and t in QKV_VARIANT:
            jobs.append(("gemv.cu", GROUPS["gemv.cu"][f"{t.name}.qkv"], _defines(evict_first)))
        if gelu:
            jobs.append(("gemv.cu", GROUPS["gemv.cu"][f"{t.name}.{activation}"], _defines(evict_first)))
        elif t in NQ_TYPES:  # the gelu_tanh families (gemma) have post-norms, which take no handoff
            jobs.append(("gemv.cu", GROUPS["gemv.cu"][f"{t.name}.nq"], _defines(evict_first)))
        if t in QUANT:
            names = _batch_names(t) + (_batch_names(t, activation) if gelu else ())
            jobs += [("gemv_batch.cu", (name,), _defines(evict_first)) for name in names]
        if mma8 and t in MMA8_DECODERS:
            names = _mma8_names(t) + (_mma8_names(t, activation) if gelu else ())
            jobs += [(f, (name,), _defines(evict_first)) for f, name in names]
    return jobs
