"""How kernels_cu handles each ggml type: the decoder struct of every quantized type
(kernels_cu/decoders.cuh, decoders_lowbit.cuh) with its one-token product's default launch
variants, and the float types' decoders. The table the kernel names (quant_kernels.py) and the
launch choices (gemv_choice.py) both read. Importable without CuPy.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

from .constants import QUANT_LAYOUTS


@dataclass(frozen=True)
class QuantKernels:
    """How kernels_cu handles one quantized ggml type.

    decoder: the C++ decoder struct in kernels_cu/decoders.cuh (or decoders_lowbit.cuh).
    gemv:    (WARPS, U, PF) of the gemv_q8 instance used: warps per block, chunks in flight per
             lane, and whether the next U chunks load while the current ones are multiplied.
    glu:     the same for the SwiGLU-epilogue instance (Q8_0 holds fewer chunks: more spill), and
             for its GeGLU twin (quant_kernels.GLU_ACTS).
    groups, x_swizzle, handoff: constants.QuantLayout, shared with the kernels (planar groups,
             the layout of its q8 x (Q8Vector), whether its SwiGLU instance can also write its
             output as a Q8Vector (gemv y_q8)).
    """

    decoder: str
    gemv: tuple[int, int, int]
    glu: tuple[int, int, int]
    groups: tuple[int, ...]
    x_swizzle: int
    handoff: bool


def _quant(t: T, decoder: str, gemv: tuple[int, int, int], glu: tuple[int, int, int]) -> tuple[T, QuantKernels]:
    layout = QUANT_LAYOUTS[t]
    return t, QuantKernels(decoder, gemv, glu, layout.groups, layout.x_swizzle, layout.handoff)


QUANT: dict[T, QuantKernels] = dict((
    _quant(T.Q4_K, "type_q4_K", (16, 2, 1), (16, 2, 1)),
    _quant(T.Q5_K, "type_q5_K", (32, 1, 0), (32, 1, 0)),
    _quant(T.Q6_K, "type_q6_K", (16, 2, 1), (32, 1, 0)),
    _quant(T.Q8_0, "type_q8_0", (32, 4, 0), (32, 2, 0)),
    _quant(T.Q5_0, "type_q5_0", (32, 4, 0), (32, 4, 0)),
    _quant(T.Q5_1, "type_q5_1", (32, 4, 0), (32, 4, 0)),
    # chosen by analogy, not yet measured: Q2_K and Q3_K read as Q6_K does, Q4_0 and IQ4_NL as Q5_0, IQ4_XS as Q4_K
    _quant(T.Q2_K, "type_q2_K", (16, 2, 1), (32, 1, 0)),
    _quant(T.Q3_K, "type_q3_K", (16, 2, 1), (32, 1, 0)),
    _quant(T.Q4_0, "type_q4_0", (32, 4, 0), (32, 4, 0)),
    _quant(T.IQ4_XS, "type_iq4_xs", (16, 2, 1), (16, 2, 1)),
    _quant(T.IQ4_NL, "type_iq4_nl", (32, 4, 0), (32, 4, 0)),
))
# Unquantized types: C++ decoder and bytes per weight.
FLOAT: dict[T, tuple[str, int]] = {T.F32: ("type_f32", 4), T.F16: ("type_f16", 2), T.BF16: ("type_bf16", 2)}
