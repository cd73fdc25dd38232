"""Stream-K residual products with the next RMSNorm's handoff (K4_STREAM_K; kernels_cu/gemv_streamk.cu,
runtime/cuda/gemv_streamk.py): the rule that picks them (no GPU), then on the GPU: y within float
rounding of gemv's plain product (the sums split over blocks: relative 1e-5 of the output's scale),
the handoff q8x_host(y * norm_w) of the kernel's own y to the byte, each group's sum of y^2, the
same bits on a second launch (the arrival counts back at zero) and with y aliasing the residual;
end to end, decode logits with the flag on and off within the 8-bit limit, and of the numpy backend.
Inputs: tests/matmul_ref.py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda.constants import SK_SLOTS
from k4.runtime.cuda.gemv_streamk import sk_grid, sk_pieces

H200_SLOTS = 132  # one block of 16 warps per multiprocessor


def split(groups: int, units: int, grid: int) -> list[list[int]]:
    """The blocks holding each group's items, from the kernel's runs [b total / grid, (b + 1) total / grid)."""
    total = groups * units
    blocks = [[] for _ in range(groups)]
    for b in range(grid):
        for i in range(b * total // grid, (b + 1) * total // grid):
            if b not in blocks[i // units]:
                blocks[i // units].append(b)
    return blocks


def test_the_rule_takes_the_products_whose_groups_leave_blocks_idle():
    """Qwen2.5 7B's down (112 groups) and TinyLlama's down and output products (64) run stream-K on
    the H200's 132 slots; Llama 2 7B's (128 groups of 4,096) and Qwen2.5 7B's 3,584-input output
    product (a block's share is a whole group's row: no gain) do not, nor glu, odd or F32 ones."""
    assert sk_grid(T.Q4_K, 3584, 18944, False, H200_SLOTS) == 132
    assert sk_grid(T.Q6_K, 3584, 18944, False, H200_SLOTS) == 132
    assert sk_grid(T.Q6_K, 2048, 5632, False, H200_SLOTS) == 128
    assert sk_grid(T.Q4_K, 2048, 2048, False, H200_SLOTS) == 128
    for t, n_out, n_in, glu in ((T.Q4_K, 4096, 11008, False), (T.Q4_K, 4096, 4096, False), (T.Q4_K, 3584, 3584, False),
                                (T.Q4_K, 2048, 5632, True), (T.Q4_K, 2040, 5632, False), (T.Q8_0, 2048, 5632, False),
                                (T.F32, 2048, 5632, False), (T.Q4_K, 2048, 5600, False)):
        assert sk_grid(t, n_out, n_in, glu, H200_SLOTS) == 0, (t.name, n_out, n_in, glu)


def test_no_group_is_split_over_more_blocks_than_its_slots():
    """sk_pieces counts what the kernel's split gives, and every grid sk_grid allows keeps each
    group within SK_SLOTS blocks, each block's blocks consecutive."""
    for groups in range(1, 70, 3):
        for n_in in range(256, 20 * 1024, 1792):
            for slots in (16, 60, 132, 264):
                grid = sk_grid(T.Q4_K, 32 * groups, n_in, False, slots)
                if not grid:
                    continue
                blocks = split(groups, -(-n_in // 1024), grid)
                assert max(len(b) for b in blocks) == sk_pieces(groups, -(-n_in // 1024), grid) <= SK_SLOTS
                assert all(b == list(range(b[0], b[0] + len(b))) for b in blocks)


@pytest.mark.cuda
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("shape", [(3584, 18944), (2048, 5632), (2048, 2048), (256, 3072)])
def test_the_stream_k_product_matches_gemv_and_hands_over(type_name, shape):
    """Qwen2.5 7B's down shape (float x; some groups split over three blocks), TinyLlama's down and
    output products (the output product's x a q8 x from attention, x_q8) and 8 groups of 3 units on
    16 blocks. y aliasing the residual, and no residual (y = w x)."""
    import cupy as cp

    from k4.runtime.cuda import gemv_streamk as sk
    from k4.runtime.cuda import matmul as mm
    from k4.runtime.cuda import q8_handoff as hand
    from tests.matmul_ref import fresh_rng, nan_like, weight

    rng, seed = fresh_rng()
    n_out, n_in = shape
    w, _ = weight(type_name, n_out, n_in, rng, True)
    reader, _ = weight("Q4_K", 64, n_out, rng, True)
    groups = sk.sk_groups(w)
    assert groups == n_out // 32, f"no stream-K product of {shape}"
    x = rng.standard_normal(n_in).astype(np.float32)
    x_q8 = None
    if n_in == n_out == 2048:
        swz = mm.QUANT[w.ggml_type].x_swizzle
        x_q8 = hand.Q8Vector(cp.asarray(hand.q8x_host(x, swz)), n_in, swz)
    xd = cp.asarray(x)
    res = cp.asarray((rng.standard_normal(n_out) * 4).astype(np.float32))
    nw = cp.asarray((1 + 0.5 * rng.standard_normal(n_out)).astype(np.float32))
    scratch = (cp.full(sk.scratch_floats(n_out), cp.nan, cp.float32), cp.zeros(groups, cp.int32))

    swz = mm.QUANT[reader.ggml_type].x_swizzle

    def run(y, residual):
        vec = hand.Q8Vector(cp.zeros(mm.q8x_bytes(n_out), cp.uint8), n_out, swz)
        q8 = hand.Q8Vector(vec.data, vec.n, vec.swizzle, cp.full(groups, cp.nan, cp.float32), groups, 1e-5)
        sk.gemv_sk(w, xd, y, y_q8=q8, norm_w=nw, parts=q8.parts, scratch=scratch, residual=residual, x_q8=x_q8)
        return y.get(), q8.data.get(), q8.parts.get()

    y, q, parts = run(nan_like(n_out), res)
    plain = nan_like(n_out)
    mm.gemv(w, xd, plain, residual=res, x_q8=x_q8)
    plain = plain.get()
    assert not np.isnan(y).any()
    np.testing.assert_allclose(y, plain, rtol=0, atol=1e-5 * float(np.abs(plain).max()), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(q, hand.q8x_host(y * nw.get(), swz))
    np.testing.assert_allclose(parts, (y.astype(np.float64) ** 2).reshape(groups, 32).sum(axis=1), rtol=1e-5)
    assert not scratch[1].any(), "the arrival counts are not back at zero"
    again = run(nan_like(n_out), res)
    stream = res.copy()
    aliased = run(stream, stream)  # y is the residual stream: res + w x in place
    for got in (again, aliased):
        assert all(np.array_equal(a, b) for a, b in zip(got, (y, q, parts))), f"seed {seed}"
    no_res = run(nan_like(n_out), None)[0]  # w x
    np.testing.assert_allclose(no_res + res.get(), y, rtol=0, atol=1e-5 * float(np.abs(y).max()))


@pytest.mark.cuda
def test_the_stream_k_product_refuses_what_it_cannot_multiply():
    import cupy as cp

    from k4.runtime.cuda import gemv_streamk as sk
    from tests.matmul_ref import fresh_rng, weight

    rng, _ = fresh_rng()
    w, _ = weight("Q4_K", 4096, 4096, rng, True)
    assert sk.sk_groups(w) == 0
    with pytest.raises(ValueError, match="no stream-K product"):
        sk.gemv_sk(w, cp.zeros(4096, cp.float32), cp.zeros(4096, cp.float32), y_q8=None, norm_w=None, parts=None, scratch=None)


@pytest.mark.cuda
@pytest.mark.usefixtures("unset_backend_flags")
def test_decode_with_stream_k_keeps_numpy_logits(tiny_model, monkeypatch):
    """A tiny Q4_K llama model whose down products (256 outputs of 2,048 inputs: 8 groups on 16
    blocks) run stream-K: every layer's down product launches it with the flag on and none with it
    off, and the decode logits stay within the 8-bit limit of each other and of the numpy backend's."""
    from k4.runtime.cuda import gemv_streamk as sk
    from k4.runtime.reference import NumpyBackend
    from tests.cuda_backend_cases import ARCH_CASES, decode_by_flag, decode_limit, rel_l2

    monkeypatch.setitem(ARCH_CASES, "llama-q4_k-sk", ("llama", T.Q4_K, dict(ARCH_CASES["llama-q4_k"][2], n_ff=2048)))
    calls = []
    launch = sk.gemv_sk
    monkeypatch.setattr(sk, "gemv_sk", lambda *a, **k: (calls.append(True), launch(*a, **k))[1])
    small = tiny_model("llama-q4_k-sk")
    prompt = np.random.default_rng(6).integers(3, small.config.n_vocab, size=19).tolist()
    logits = decode_by_flag(monkeypatch, small, "K4_STREAM_K", prompt, (7, 8), calls,
                            lambda on, calls: len(calls) >= small.config.n_layer if on else not calls)
    ref = NumpyBackend(small, 64)
    ref.eval(prompt)
    want = [ref.eval([t]) for t in (7, 8)]
    for on in (True, False):
        assert all(rel_l2(got, w) < decode_limit(small) for got, w in zip(logits[on], want)), on
    assert all(rel_l2(a, b) < decode_limit(small) for a, b in zip(logits[True], logits[False]))
