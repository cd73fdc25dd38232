"""Sliding-window layers' KV cache as a ring on the GPU (runtime/swa_ring.py, K4_SWA_RING): every
attention kernel over a ring that holds only the last rows positions (position p at row p & (rows
- 1), the other rows poisoned) against the float64 formula over the whole context, f16 and q8_0
planes; the RoPE store and the fused decode store writing ring rows; and tiny gemma3 / gemma2
models run past their rings: the same logits, bit for bit, as with every layer's whole context
(K4_SWA_RING=0), numpy's within 1e-3, a cache a fraction of the size, and a cut back past the
ring's reach refused (reusable() says 0) while one within it gives the same logits again.

Limits: as tests/test_cuda_gemma.py (attention_ref.py: 2e-3 for the tensor-core kernels, 2e-5
for the others; models 1e-3). A ring changes only where a row lives, so the CUDA logits with and
without rings must be equal."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.flags import Flags
from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend
from k4.runtime.swa_ring import ring_rows
from tests.attention_ref import attention_inputs, check_attention_kernels
from tests.gpu import cupy_or_skip
from tests.test_gemma import GEMMA_CASES, attention_f64, gemma_tiny, rel_l2
from tests.tiny import write_tiny

cp = cupy_or_skip()
pytestmark = pytest.mark.cuda

from k4.runtime.cuda.op_args import AttnShape, FreshKV, RopeArgs  # noqa: E402  (needs CuPy)
from tests.test_cuda_kv import fill, plane  # noqa: E402

MODEL_REL_L2 = 1e-3
TYPES = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16")]


def ring_of(cache_type: str, x, d, n_kv: int, rows: int):
    """A poisoned ring plane of `rows` rows holding positions max(0, n_kv - rows) .. n_kv - 1 of the
    whole-context plane (x, d) at rows p & (rows - 1)."""
    rx, rd = plane(cache_type, rows, x.shape[1], x.shape[2])
    held = cp.arange(max(0, n_kv - rows), n_kv)
    rx[held & (rows - 1)] = x[held]
    if d is not None:
        rd[held & (rows - 1)] = d[held]
    return rx, rd


RING_CASES = [
    # n_tok, pos0, n_head, n_head_kv, D, n_ctx, split, window, cap: every ring wraps (pos0 + n_tok > rows)
    (1, 700, 4, 2, 128, 1024, True, 100, 0.0),
    (1, 5000, 8, 2, 128, 8192, True, 300, 0.0),  # attn_gqa (4 query heads per KV head)
    (1, 3000, 4, 2, 256, 4096, True, 1024, 5.0),
    (1, 999, 4, 4, 64, 1024, False, 8, 0.0),  # one split over a ring
    (100, 900, 4, 2, 256, 1024, False, 100, 0.0),
    (200, 1000, 4, 2, 128, 1500, False, 70, 2.0),
    (64, 2000, 4, 1, 64, 2100, False, 33, 0.0),
    (5, 600, 2, 1, 96, 700, False, 40, 0.0),  # no tiled or tensor-core instance: attn_kv for the queries
]


@pytest.mark.parametrize("kt,vt", TYPES)
@pytest.mark.parametrize("n_tok,pos0,n_head,n_head_kv,D,n_ctx,split,window,cap", RING_CASES)
def test_attention_over_a_ring(ops, rng, kt, vt, n_tok, pos0, n_head, n_head_kv, D, n_ctx, split, window, cap):
    if D % 32 and "q8_0" in (kt, vt):
        pytest.skip("q8_0 rows need head_dim % 32 == 0")
    q, keys, values = attention_inputs(rng, n_tok, pos0, n_head, n_head_kv, D)
    n_kv = pos0 + n_tok
    (kx, kd), k_read = fill(kt, keys.astype(np.float32), n_ctx)
    (vx, vd), v_read = fill(vt, values.astype(np.float32), n_ctx)
    rows = ring_rows(window, n_tok, n_ctx)
    assert 0 < rows < n_kv
    (rk, rkd), (rv, rvd) = ring_of(kt, kx, kd, n_kv, rows), ring_of(vt, vx, vd, n_kv, rows)
    want = attention_f64(q, k_read, v_read, pos0, 0.09, window, cap)
    # split over the whole context (the full layers' configuration), then over the window's keys
    # (the sliding layers': splits count from the window's first key)
    for keys in (n_ctx, window) if split else (n_ctx,):
        check_attention_kernels(ops, q, rk, rv, pos0, keys, split, want,
                                lambda qq: attention_f64(qq, k_read, v_read, pos0, 0.09, window, cap), scales=(rkd, rvd),
                                shape=AttnShape(0.09, window, cap, rows))


@pytest.mark.parametrize("kt,vt", TYPES)
def test_rope_store_and_fused_decode_store_write_ring_rows(ops, rng, kt, vt):
    """rope_qk_store of 40 tokens at positions 1,000 .. 1,039 writes ring rows p & 255 and no
    other; the decode kernel with RoPE and the store fused in (split, position 1,040) writes row
    1,040 & 255 as rope_qk_store would, and attends as over the whole context."""
    from k4.runtime.cuda.attention_launch import attention_split
    from tests.attention_ref import SPLIT_KEYS

    n_head, n_head_kv, D, rows, window, n_ctx = 8, 2, 128, 256, 100, 2048
    rope = RopeArgs(None, None, cp.asarray(10000.0 ** (-np.arange(0, D, 2) / D)), D, False, 1e-6)
    (kx, kd), _ = fill(kt, rng.standard_normal((1000, n_head_kv, D)).astype(np.float32), n_ctx)
    (vx, vd), _ = fill(vt, rng.standard_normal((1000, n_head_kv, D)).astype(np.float32), n_ctx)
    (rk, rkd), (rv, rvd) = ring_of(kt, kx, kd, 1000, rows), ring_of(vt, vx, vd, 1000, rows)
    before = [a.copy() for a in (rk, rv)]
    for n_tok, pos0 in ((40, 1000), (1, 1040)):
        qkv = cp.asarray(rng.standard_normal((n_tok, (n_head + 2 * n_head_kv) * D)).astype(np.float32))
        a, b = n_head * D, (n_head + n_head_kv) * D
        src = qkv[:, :a], qkv[:, a:b], qkv[:, b:]
        pos = cp.asarray([pos0], dtype=cp.int32)
        if n_tok > 1:
            q = cp.empty((n_tok, n_head, D), cp.float32)
            ops.rope_qk_store(*src, kx, vx, rope, pos, q_out=q, scales=(kd, vd))  # the whole-context plane
            ops.rope_qk_store(*src, rk, rv, rope, pos, q_out=q, scales=(rkd, rvd), ring=rows)
            changed = np.arange(pos0, pos0 + n_tok) & (rows - 1)
            for x, x0 in zip((rk, rv), before):  # as bits: the rest of the ring is as before
                bits = lambda y: y.view(cp.int8).reshape(rows, -1).get()  # noqa: E731
                keep = np.setdiff1d(np.arange(rows), changed)
                assert np.array_equal(bits(x)[keep], bits(x0)[keep])
        else:
            n_split, split_len = attention_split(n_ctx, True, keys=SPLIT_KEYS)
            part, ticket = cp.empty((1, n_head, n_split, D + 2), cp.float32), cp.zeros(n_head, cp.int32)
            outs = []
            for planes, scales, ring in (((kx, vx), (kd, vd), 0), ((rk, rv), (rkd, rvd), rows)):
                out = cp.full((1, n_head, D), np.nan, cp.float32)
                ops.attention(cp.full((1, n_head, D), np.nan, cp.float32), *planes, out, pos, n_split, split_len, part,
                              ticket, FreshKV(*src, rope), AttnShape(None, window, 0.0, ring), scales=scales)
                outs.append(out.get())
            assert np.array_equal(outs[0], outs[1])
        held = np.arange(pos0 + n_tok - rows, pos0 + n_tok)
        for whole, ring in ((kx, rk), (vx, rv), (kd, rkd), (vd, rvd)):
            if whole is not None:
                assert np.array_equal(ring[held & (rows - 1)].get().view(np.int8), whole[held].get().view(np.int8))


def tiny_gemma(tmp_path, data, case: str, window: int):
    """The tiny gemma of GEMMA_CASES[case] (F32 weights, head_dim 64) with a window of `window`."""
    arch, keys, over = GEMMA_CASES[case]
    cfg = gemma_tiny(arch, {**keys, "attention.sliding_window": window}, head_dim=64, **over)
    return open_model(write_tiny(tmp_path / f"{arch}.gguf", data / "models" / "stories260K.gguf", cfg, matrix_type=T.F32))


@pytest.mark.parametrize("case", list(GEMMA_CASES))
def test_tiny_gemma_on_rings_equals_the_whole_cache(tmp_path, data, case):
    """Window 300, n_ctx 4,096, prefill chunks of 512: rings of 1,024 rows. 2,100 tokens of
    prefill (full chunks as graphs), 6 decode steps; then a cut back within the ring's reach
    (to 1,500) and the same tokens again (other chunk boundaries: within 1e-5), one past it (to
    500) refused, and one to 0 giving the first prefill's logits again."""
    from k4.runtime.cuda.backend import CudaBackend

    mf = tiny_gemma(tmp_path, data, case, 300)
    ids = [1] + np.random.default_rng(3).integers(3, 512, size=2105).tolist()
    got, sizes = {}, {}
    for ring in (True, False):
        be = CudaBackend(mf, 4096, flags=Flags({"K4_SWA_RING": "1" if ring else "0"}))
        try:
            assert [r for r in be.kv.rings if r] == ([1024] * sum(map(mf.config.sliding, range(mf.config.n_layer)))
                                                     if ring else [])
            prefill = be.eval(ids[:-6], all_logits=False)
            steps = np.stack([be.eval([t]) for t in ids[-6:]])
            got[ring] = np.vstack([prefill[None], steps])
            sizes[ring] = be.memory_report()["kv_cache"]
            if ring:
                assert be.reusable(500) == 0 and be.reusable(1500) == 1500
                with pytest.raises(ValueError):
                    be.truncate(500)
                be.truncate(1500)
                again = be.eval(ids[1500:-6], all_logits=False)  # other chunks: prefill's tiles start elsewhere
                assert rel_l2(again, prefill) < 1e-5
                be.truncate(be.reusable(10))  # 0: the whole text again
                assert be.n_past == 0 and np.array_equal(be.eval(ids[:-6]), prefill)
        finally:
            be.close()
    assert np.array_equal(got[True], got[False])
    want = NumpyBackend(mf, 4096).eval(ids, all_logits=True)
    assert rel_l2(got[True][1:], want[-6:]) < MODEL_REL_L2 and rel_l2(got[True][0], want[-7]) < MODEL_REL_L2
    n_layer, n_sliding = mf.config.n_layer, sum(map(mf.config.sliding, range(mf.config.n_layer)))
    per_row = sizes[False] // (n_layer * 4096)
    assert sizes[True] == per_row * ((n_layer - n_sliding) * 4096 + n_sliding * 1024)


@pytest.mark.parametrize("case", list(GEMMA_CASES))
def test_generate_cuts_back_to_zero_past_the_ring(tmp_path, data, case):
    """Generator over a prompt that shares only its first tokens with what the cache holds, far
    behind the ring's reach: the prompt is evaluated from position 0, and its greedy tokens are
    those of a fresh backend."""
    from k4.runtime.cuda.backend import CudaBackend
    from k4.runtime.generate import Generator
    from k4.runtime.sampling import SamplingParams
    from k4.runtime.tokenizer import Tokenizer

    mf = tiny_gemma(tmp_path, data, case, 300)
    tok = Tokenizer.from_model(mf)
    rng = np.random.default_rng(4)
    first = [1] + rng.integers(3, 512, size=1800).tolist()
    second = first[:100] + rng.integers(3, 512, size=1000).tolist()
    outs = []
    for warm in (True, False):
        be = CudaBackend(mf, 4096)
        try:
            gen = Generator(be, tok)
            if warm:
                "".join(gen.stream(first, SamplingParams(temperature=0.0), n_predict=4))
            outs.append("".join(gen.stream(second, SamplingParams(temperature=0.0), n_predict=8)))
            if warm:
                assert gen.result.prefill_tokens == len(second)  # nothing reused
        finally:
            be.close()
    assert outs[0] == outs[1]
