"""The numbers Python and the kernels share (runtime/cuda/constants.py), as a kernel sees them on
the GPU: small probe kernels compiled the way k4 compiles its modules (compile.OPTIONS), each
including one kernels_cu file and writing the values it computes (struct sizes, planar groups,
shared-memory sizes, q8 x layout, sampling constants) to an int32 array that is compared with
Python's. The compile-time checks (kernels_cu/constants.cuh, tests/test_kernels_compile.py)
cover the same ground without a GPU; this test covers what NVRTC builds."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import constants as c
from k4.runtime.cuda.kernel_names import MMA_TILE_KEYS
from tests.gpu import cupy_or_skip

cp = cupy_or_skip()
pytestmark = pytest.mark.cuda

DECODERS = {T.Q4_K: "q4_K", T.Q5_K: "q5_K", T.Q6_K: "q6_K", T.Q8_0: "q8_0", T.Q5_0: "q5_0", T.Q5_1: "q5_1",
            T.Q2_K: "q2_K", T.Q3_K: "q3_K", T.Q4_0: "q4_0", T.IQ4_XS: "iq4_xs", T.IQ4_NL: "iq4_nl"}
HEAD_DIMS = (64, 128, 256)
Q8X_N = (256, 4096, 11008)
MAX_GROUPS = 5


def probe(include: str, body: str, n: int) -> np.ndarray:
    """Compile `body` (statements writing out[0..n)) into a kernel in a file that includes
    kernels_cu/`include`, with k4's compile options; run it on one thread; out as int32."""
    from k4.runtime.cuda.compile import OPTIONS

    src = f'#include "{include}"\nextern "C" __global__ void k4_probe(int* out) {{\n{body}\n}}\n'
    fn = cp.RawModule(code=src, options=OPTIONS).get_function("k4_probe")
    out = cp.full(n, -1, cp.int32)
    fn((1,), (1,), (out,))
    return out.get()


def test_quantized_blocks_as_the_kernels_see_them():
    lines = []
    for t, d in DECODERS.items():
        lines.append(f"*out++ = sizeof(block_{d}); *out++ = type_{d}::block_elems;"
                     f" *out++ = type_{d}::x_swizzle; *out++ = type_{d}::handoff;")
        lines += [f"*out++ = type_{d}::cut({g});" for g in range(MAX_GROUPS)]
    got = probe("common.cuh", "\n".join(lines), len(DECODERS) * (4 + MAX_GROUPS)).reshape(len(DECODERS), -1)
    for row, t in zip(got, DECODERS):
        q = c.QUANT_LAYOUTS[t]
        elems, nbytes = GGML_QUANT_SIZES[t]
        cuts = [*q.groups, *[nbytes] * (MAX_GROUPS - len(q.groups))]  # cut(g) past the last group: the block size
        assert row.tolist() == [nbytes, elems, q.x_swizzle, int(q.handoff), *cuts], t.name


def test_q8x_layout_as_gemv_sees_it():
    body = "\n".join(f"*out++ = q8x_bytes_q({n}); *out++ = q8x_bytes_q({n}) + 4 * q8x_d_floats({n}); *out++ = q8x_bytes({n});"
                     for n in Q8X_N)
    got = probe("gemv.cu", body, 3 * len(Q8X_N)).reshape(len(Q8X_N), 3)
    assert [tuple(r) for r in got.tolist()] == [c.q8x_offsets(n) for n in Q8X_N]


def test_attention_shapes_as_attention_sees_them():
    body = ["*out++ = ATT_THREADS; *out++ = ATT_CHUNK; *out++ = TILE_Q; *out++ = TILE_K; *out++ = TILE_THREADS;",
            "*out++ = MMA_THREADS; *out++ = MMA_BQ;"]
    body += [f"*out++ = att_smem({d}); *out++ = tiled_smem({d});" for d in HEAD_DIMS]
    body += [f"*out++ = mma_smem({d}, {bk});" for d, bk in MMA_TILE_KEYS.items()]
    got = probe("attention.cu", "\n".join(body), 7 + 2 * len(HEAD_DIMS) + len(MMA_TILE_KEYS)).tolist()
    want = [c.ATT_THREADS, c.ATT_CHUNK, c.TILE_Q, c.TILE_K, c.TILE_THREADS, c.MMA_THREADS, c.MMA_BQ]
    want += [v for d in HEAD_DIMS for v in (c.att_smem(d), c.tiled_smem(d))]
    want += [c.mma_smem(d, bk) for d, bk in MMA_TILE_KEYS.items()]
    assert got == want


def test_sampling_state_as_sampling_sees_it():
    body = ("*out++ = SAMPLE_THREADS; *out++ = SAMPLE_CAP; *out++ = sizeof(SamplerParams);"
            " *out++ = ST_TOK; *out++ = ST_POS; *out++ = ST_RING; *out++ = ST_DRAW;")
    got = probe("sampling.cu", body, 7).tolist()
    assert got == [c.SAMPLE_THREADS, c.SAMPLE_CAP, 8 * c.SAMPLER_PARAM_WORDS, c.ST_TOK, c.ST_POS, c.ST_RING, c.ST_DRAW]
