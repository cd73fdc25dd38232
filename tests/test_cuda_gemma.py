"""The Gemma ops on the GPU against numpy (the oracle of every kernel): attention with a sliding
window, a query scale and a score soft-cap in each kernel (attn_mma, attn_tiled, attn_f16kv,
split decode whose first splits hold no keys); GeGLU; the embedding scale; the logit soft-cap;
the post-norm with its residual add; and whole tiny gemma3 / gemma2 models (F32 weights) on
the CUDA backend against the numpy backend, prefill and decode, with the fusions on and off;
the kernels of a decode step (GeGLU in the gate/up product's epilogue, the embedding scale in
the lookup) on a Q8_0 tiny gemma, fused against unfused.

Limits: attn_mma rounds the pre-scaled queries and the probabilities to fp16 (2e-3,
tests/attention_ref.py MMA_ATTN_REL_L2); the other attention kernels are f32 over the same fp16
cache as the float64 formula (2e-5). Element-wise kernels: tanhf/expf against numpy's float32 within a
few ulps (rtol 1e-5). Models: 1e-3 relative L2, as the transformers oracle's CUDA limit
(tests/test_oracles.py: F32 weights, fp16 KV cache and fp16 tensor-core prefill)."""

from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime import reference
from k4.runtime.flags import Flags
from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend
from tests.attention_ref import attention_inputs, check_attention_kernels, f16_plane
from tests.cuda_backend_cases import sampling_kernels
from tests.gpu import cupy_or_skip
from tests.test_gemma import GEMMA_CASES, attention_f64, gemma_tiny, rel_l2
from tests.tiny import write_tiny

cp = cupy_or_skip()
pytestmark = pytest.mark.cuda

MODEL_REL_L2 = 1e-3




ATTN_CASES = [
    # n_tok, pos0, n_head, n_head_kv, D, n_ctx, split, window, cap
    (1, 700, 4, 2, 128, 1024, True, 100, 0.0),  # split decode: splits 0..17 hold no key
    (1, 700, 4, 2, 256, 1024, True, 64, 5.0),
    (1, 2047, 8, 2, 128, 2048, True, 1024, 50.0),
    (1, 30, 4, 4, 64, 64, False, 8, 0.0),
    (1, 30, 4, 4, 64, 64, False, 0, 2.0),  # soft-cap alone
    (100, 0, 4, 2, 64, 128, False, 8, 0.0),
    (130, 50, 4, 2, 128, 256, False, 33, 3.0),
    (70, 200, 4, 4, 256, 300, False, 64, 0.0),
    (37, 5, 2, 1, 256, 64, False, 1, 0.0),  # each query sees itself only
    (200, 300, 2, 1, 128, 600, False, 70, 0.0),
    (64, 0, 2, 2, 128, 64, False, 0, 1.5),
]


@pytest.mark.parametrize("n_tok,pos0,n_head,n_head_kv,D,n_ctx,split,window,cap", ATTN_CASES)
def test_attention_window_scale_softcap(ops, rng, n_tok, pos0, n_head, n_head_kv, D, n_ctx, split, window, cap):
    from k4.runtime.cuda.op_args import AttnShape

    q, keys, values = attention_inputs(rng, n_tok, pos0, n_head, n_head_kv, D)
    kc, vc = f16_plane(keys, n_ctx), f16_plane(values, n_ctx)
    scale = 0.11
    want = attention_f64(q, kc, vc, pos0, scale, window, cap)
    check_attention_kernels(ops, q, cp.asarray(kc), cp.asarray(vc), pos0, n_ctx, split, want, shape=AttnShape(scale, window, cap))


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_geglu(ops, rng, out_dtype):
    g = (3 * rng.standard_normal((5, 300))).astype(np.float32)
    u = rng.standard_normal((5, 300)).astype(np.float32)
    want = reference.gelu_tanh(g) * u
    out = cp.empty((5, 300), out_dtype)
    ops.swiglu(cp.asarray(g), cp.asarray(u), out, act="gelu_tanh")
    np.testing.assert_allclose(out.get().astype(np.float32), want, rtol=1e-5 if out_dtype == np.float32 else 1e-3, atol=1e-6)
    gu = cp.asarray(np.concatenate([g, u], axis=1))  # one stacked gate|up product
    out = cp.empty((5, 300), cp.float32)
    ops.swiglu_rows(gu, out, interleaved=False, act="gelu_tanh")
    np.testing.assert_allclose(out.get(), want, rtol=1e-5, atol=1e-6)


def test_softcap_and_post_norm(ops, rng):
    x = rng.standard_normal((3, 1000)).astype(np.float32) * 20
    d = cp.asarray(x)
    ops.softcap(d, 30.0)
    np.testing.assert_allclose(d.get(), reference.softcap(x, 30.0), rtol=1e-5, atol=1e-5)
    t, res = (rng.standard_normal((4, 640)).astype(np.float32) for _ in range(2))
    w = (1 + 0.1 * rng.standard_normal(640)).astype(np.float32)
    y = cp.empty((4, 640), cp.float32)
    ops.rms_norm_add(cp.asarray(t), cp.asarray(w), cp.asarray(res), y, 1e-6)
    np.testing.assert_allclose(y.get(), res + reference.rms_norm(t, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(GEMMA_CASES))
@pytest.mark.parametrize("flags", [{}, {"K4_FUSE_ROPE": "0", "K4_FUSE_NORM": "0", "K4_MMA_ATTN": "0"}])
def test_tiny_gemma_matches_numpy(tmp_path, data, case, flags):
    """40 tokens past windows of 4-5 (head_dim 64: the tensor-core prefill kernel), then 8 decode
    steps, against the numpy backend on the same F32 file."""
    from k4.runtime.cuda.backend import CudaBackend

    arch, keys, over = GEMMA_CASES[case]
    cfg = gemma_tiny(arch, keys, head_dim=64, **over)
    mf = open_model(write_tiny(tmp_path / f"{arch}.gguf", data / "models" / "stories260K.gguf", cfg, matrix_type=T.F32))
    ids = [1] + np.random.default_rng(1).integers(3, 512, size=47).tolist()
    want = NumpyBackend(mf, 128).eval(ids, all_logits=True)
    be = CudaBackend(mf, 128, flags=Flags({**flags}))
    try:
        assert rel_l2(be.eval(ids[:-8], all_logits=True), want[:-8]) < MODEL_REL_L2  # prefill
        assert rel_l2(np.stack([be.eval([t]) for t in ids[-8:]]), want[-8:]) < MODEL_REL_L2  # decode steps
    finally:
        be.close()


def gemma_step_kernels(mf, fuse_glu: bool) -> int:
    """Kernels of one gemma decode step: per layer the q/k/v products (one per run of one type),
    attention (RoPE, q/k norms and the cache store inside), output, gate/up with GeGLU in its
    epilogue (a separate geglu kernel without K4_FUSE_SWIGLU), down; the post-attention and
    post-FFN norms with their residual adds are folded into the next products' prologue; then
    the embedding (its sqrt(n_embd) scale inside), lm_head (the final norm and the last post-FFN
    norm folded in), gemma 2's logit soft-cap, and the sampling kernels (sampling_kernels). Before the GeGLU epilogue
    and the scale fold: 7 per layer + 6; before the post-norm fold: 6 per layer + 5."""
    from k4.runtime.cuda.weights import runs_of_one_type

    cfg = mf.config
    qkv = sum(len(runs_of_one_type([mf.tensor(f"blk.{i}.attn_{p}.weight").ggml_type for p in "qkv"], True))
              for i in range(cfg.n_layer))
    return qkv + (4 if fuse_glu else 5) * cfg.n_layer + 2 + sampling_kernels(mf) + (1 if cfg.final_softcap else 0)


@pytest.mark.parametrize("case", list(GEMMA_CASES))
def test_gemma_decode_step_kernels_and_fused_geglu(tmp_path, data, case):
    """A Q8_0 tiny gemma: the decode graph runs gemma_step_kernels kernels with and without
    K4_FUSE_SWIGLU (the fused GeGLU epilogue saves one kernel per layer), and the two give the
    same decode logits within 1e-4 relative L2 (the same q8 dot products, the same gelu_tanh
    formula; only the kernel that applies it differs) and numpy's within 3e-2 (x quantized to
    8 bits per 32 values in every product: cuda_backend_cases's LIMIT_DECODE_Q8 is 1.6e-2 for one
    step; these are 6 on a cache the fp16 prefill wrote)."""
    from k4.runtime.cuda.backend import CudaBackend

    arch, keys, over = GEMMA_CASES[case]
    cfg = gemma_tiny(arch, keys, head_dim=64, **over)
    mf = open_model(write_tiny(tmp_path / f"{arch}.gguf", data / "models" / "stories260K.gguf", cfg))
    ids = [1] + np.random.default_rng(2).integers(3, 512, size=19).tolist()
    want = NumpyBackend(mf, 64).eval(ids, all_logits=True)[-6:]
    got = {}
    for fused in (True, False):
        be = CudaBackend(mf, 64, flags=Flags({} if fused else {"K4_FUSE_SWIGLU": "0"}))
        try:
            be.eval(ids[:-6])
            got[fused] = np.stack([be.eval([t]) for t in ids[-6:]])
            assert be.graph_launches == gemma_step_kernels(mf, fused), f"fused={fused}"
            glu = be.weights.layers[0].gate_up
            assert (len(glu) == 1 and glu[0].w.glu and glu[0].w.glu_act == "gelu_tanh") == fused
        finally:
            be.close()
    assert rel_l2(got[True], got[False]) < 1e-4
    assert rel_l2(got[True], want) < 3e-2
