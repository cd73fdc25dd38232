"""A weight matrix on the GPU as every product launcher takes it (DeviceWeight), the options its
products run with (WeightOptions, each a K4_* flag) and its construction over uploaded bytes
(make_weight). Layouts: runtime/cuda/layout.py (raw ggml blocks, or planar with K4_REPACK).
Importable without CuPy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k4.runtime.model import Tensor

from .layout import MatrixSpec, _check_matrix, layout_nbytes
from .quant_kernels import GLU_ACTS
from .quant_types import QUANT


@dataclass(eq=False)
class DeviceWeight:
    """A weight matrix on the GPU in its quantized (raw or planar) layout.

    ggml_type: GGMLQuantizationType; shape: (n_out, n_in) as stored; data: cupy uint8 array
    (nbytes,); planar: repacked layout; prefill_tc: matmul uses tensor cores (flag
    K4_PREFILL_TC); pdl: gemv launches with programmatic dependent launch by default (flag
    K4_PDL); evict_first: its kernels load it with the L1 evict-first hint (flag K4_EVICT_FIRST);
    glu: the rows interleave ffn_gate and ffn_up (combined(glu=True)), so gemv yields
    act(gate) * up, (n_out / 2,), and matmul the interleaved (n_tok, n_out) products;
    glu_act: that act, a quant_kernels.GLU_ACTS key: "silu" (SwiGLU) or "gelu_tanh" (GeGLU);
    half: None or a cupy float16 (n_out, n_in) copy that matmul multiplies directly (make_half);
    mma8: products of 3 to 8 tokens run on int8 tensor cores where gemv_mma.uses_mma8 allows (flag
    K4_MMA8); mma8_cluster: in clusters where gemv_mma.mma8_cluster says (flag K4_MMA8_CLUSTER).
    """

    ggml_type: T
    shape: tuple[int, int]
    data: object
    planar: bool
    prefill_tc: bool = True
    pdl: bool = True
    glu: bool = False
    evict_first: bool = True
    half: object = None
    glu_act: str = "silu"
    mma8: bool = True
    mma8_cluster: bool = True
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        """Device bytes of the weight."""
        return int(self.data.nbytes)

    @property
    def n_blocks(self) -> int:
        return self.shape[0] * self.shape[1] // GGML_QUANT_SIZES[self.ggml_type][0]


@dataclass(frozen=True)
class WeightOptions:
    """How the products of a weight run (each a K4_* flag, runtime/flags.py)."""

    tensor_cores: bool = True  # K4_PREFILL_TC: prefill products on tensor cores
    pdl: bool = True  # K4_PDL: programmatic dependent launch inside graph capture
    evict_first: bool = True  # K4_EVICT_FIRST: weight loads with the L1 evict-first hint
    mma8: bool = True  # K4_MMA8: products of 3 to 8 tokens on int8 tensor cores (Q4_K, Q6_K)
    mma8_cluster: bool = True  # K4_MMA8_CLUSTER: those products in clusters that split each row's blocks


def make_weight(t: Tensor | MatrixSpec, device_bytes, repack: bool, glu: bool = False,
                opts: WeightOptions = WeightOptions(), glu_act: str = "silu") -> DeviceWeight:
    """Wrap `device_bytes` (cupy uint8, 1-D, the upload of weight_layout(t, repack), or what
    device_layout wrote) as a DeviceWeight; glu: t holds gate and up rows interleaved, whose
    gemv epilogue applies glu_act (a quant_kernels.GLU_ACTS key) to the gate.

    Raises ValueError when the bytes do not match the layout's size or `t` is not a matrix k4
    can multiply (see weight_layout), a glu matrix has an odd number of rows, or glu_act is
    not a GLU_ACTS key.
    """
    n_out, n_in = _check_matrix(t)
    planar = bool(repack and t.ggml_type in QUANT)
    expect = layout_nbytes(t, repack)
    if device_bytes.dtype != np.uint8 or device_bytes.ndim != 1 or device_bytes.nbytes != expect:
        raise ValueError(f"{t.name}: device bytes must be uint8 of shape ({expect},), got {device_bytes.dtype} {device_bytes.shape}")
    if glu and n_out % 2:
        raise ValueError(f"{t.name}: a gate/up interleaved matrix needs an even number of rows, got {n_out}")
    if glu_act not in GLU_ACTS:
        raise ValueError(f"{t.name}: no gate/up epilogue for activation {glu_act!r} (have {', '.join(GLU_ACTS)})")
    return DeviceWeight(t.ggml_type, (n_out, n_in), device_bytes, planar, opts.tensor_cores, opts.pdl, glu, evict_first=opts.evict_first,
                        glu_act=glu_act, mma8=opts.mma8, mma8_cluster=opts.mma8_cluster)


def half_bytes(w: DeviceWeight) -> int:
    """Device bytes of an fp16 copy of w (make_half); 0 for types matmul reads directly (F32, F16)."""
    return 0 if w.ggml_type in (T.F32, T.F16) else 2 * w.shape[0] * w.shape[1]
