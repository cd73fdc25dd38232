"""The megakernel's plan (runtime/cuda/megakernel.py), on the host: tile sizes, and the tile
lists covering every row of every product once, in op order, balanced, within a slot, on the
alignment the kernel's copies need (kernels_cu/megakernel.cu copy_range: 4 bytes at least)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda.constants import MK_SLOTS, QUANT_LAYOUTS
from k4.runtime.cuda.megakernel import MatSpec, schedule, tile_bytes, tile_rows

# Llama 2 7B's Q4_K_M products of one layer (q|k, v, output, gate/up interleaved, down), lm_head
SEVEN_B = [[(0, MatSpec(T.Q4_K, 8192, 4096)), (1, MatSpec(T.Q6_K, 4096, 4096))], [], [(2, MatSpec(T.Q4_K, 4096, 4096))],
           [(3, MatSpec(T.Q4_K, 22016, 4096))], [(4, MatSpec(T.Q6_K, 4096, 11008))], [(5, MatSpec(T.Q6_K, 32000, 4096))]]
SLOT = 50 << 10


def test_tile_bytes_are_the_planar_groups_of_the_rows():
    assert tile_bytes(T.Q4_K, 4096, 16) == 16 * 16 * (16 + 128)  # d, dmin, scales | qs: both 16-byte multiples
    # Q6_K 11008 (43 blocks a row), 4 rows: ql 128, qh 64, scales 16, d 2 bytes a block, each plane padded
    assert tile_bytes(T.Q6_K, 11008, 4) == 172 * (128 + 64 + 16) + 352
    assert tile_rows(MatSpec(T.Q4_K, 4096, 4096), SLOT) == 22  # 22 x 2,304 bytes: the most even rows in 50 KB
    assert tile_rows(MatSpec(T.Q6_K, 4096, 11008), SLOT) == 4
    with pytest.raises(ValueError, match="exceed"):
        tile_rows(MatSpec(T.Q6_K, 4096, 11008), 1 << 10)


@pytest.mark.parametrize("n_blocks", [132, 7])
def test_tiles_cover_every_row_once_in_op_order(n_blocks):
    tiles = schedule(SEVEN_B, n_blocks, SLOT)
    assert (tiles[:, -(MK_SLOTS + 1):, 0] == -1).all()  # the ring's look-ahead stays inside the list
    seen = {i: np.zeros(m.n_rows, int) for mats in SEVEN_B for i, m in mats}
    specs = {i: m for mats in SEVEN_B for i, m in mats}
    for b in range(n_blocks):
        ops = [t[0] for t in tiles[b] if t[0] >= 0]
        assert ops == sorted(ops)
        assert (tiles[b, len(ops):, 0] == -1).all()
        for op, i, r0, rows in tiles[b, : len(ops)]:
            m = specs[i]
            assert rows % 2 == 0 and rows <= 32
            assert tile_bytes(m.ggml_type, m.n_in, rows) <= SLOT
            seen[i][r0 : r0 + rows] += 1
            # every plane range of the tile is 4-byte aligned (start and length)
            per_row = m.n_in // GGML_QUANT_SIZES[m.ggml_type][0]
            g = QUANT_LAYOUTS[m.ggml_type].groups
            for size in (b_ - a for a, b_ in zip((0,) + g[:-1], g)):
                assert (r0 * per_row * size) % 4 == 0 and (rows * per_row * size) % 4 == 0
    assert all((s == 1).all() for s in seen.values())


def test_tiles_of_an_op_are_balanced_over_the_blocks():
    tiles = schedule(SEVEN_B, 132, SLOT)
    for op in range(len(SEVEN_B)):
        per_block = (tiles[:, :, 0] == op).sum(axis=1)
        assert per_block.max() - per_block.min() <= 1


# ---- which models it runs (megakernel.unsupported), on stand-ins for the device weights ------------

def _model(over=None, **changes):
    """(cfg, weights, kv) stand-ins of a 2-layer llama the megakernel runs; `changes` edits them."""
    from types import SimpleNamespace as NS

    from k4.runtime.kv_types import F16
    from tests.tiny import tiny_config

    cfg = tiny_config("llama", **{"n_embd": 256, "n_ff": 512, "n_head": 8, "n_head_kv": 2, "head_dim": 32, "rope_dim": 32,
                                  **(over or {})})
    mat = lambda rows, cols, t=T.Q4_K, **kw: NS(ggml_type=t, planar=True, shape=(rows, cols), glu=False, glu_act="silu", **kw)  # noqa: E731

    def layer():
        return NS(moe=None, attn_post_norm=None, ffn_post_norm=None, qkv=[NS(w=mat(cfg.q_dim + 2 * cfg.kv_dim, cfg.n_embd))],
                  wo=mat(cfg.n_embd, cfg.q_dim), w_down=mat(cfg.n_embd, cfg.n_ff),
                  gate_up=[NS(w=NS(ggml_type=T.Q4_K, planar=True, shape=(2 * cfg.n_ff, cfg.n_embd), glu=True, glu_act="silu"))])

    w = NS(layers=[layer(), layer()], output=mat(cfg.n_vocab, cfg.n_embd, T.Q6_K))
    kv = NS(rings=[0, 0], types=F16)
    for edit in changes.values():
        edit(cfg, w, kv)
    return cfg, w, kv


def test_a_dense_llama_runs_and_each_unsupported_feature_says_so():
    from k4.runtime.cuda.megakernel import unsupported
    from k4.runtime.kv_types import KVTypes

    assert unsupported(*_model()) is None
    cases = {
        "mixture-of-experts": dict(e=lambda c, w, kv: setattr(w.layers[1], "moe", object())),
        "post-norms": dict(e=lambda c, w, kv: setattr(w.layers[0], "ffn_post_norm", object())),
        "sliding-window": dict(e=lambda c, w, kv: kv.rings.__setitem__(1, 512)),
        "KV cache": dict(e=lambda c, w, kv: setattr(kv, "types", KVTypes("q8_0", "q8_0"))),
        "SwiGLU": dict(e=lambda c, w, kv: setattr(w.layers[0].gate_up[0].w, "glu", False)),
        "raw layout": dict(e=lambda c, w, kv: setattr(w.layers[1].wo, "planar", False)),
        "IQ4_XS": dict(e=lambda c, w, kv: setattr(w.output, "ggml_type", T.IQ4_XS)),
    }
    for words, edit in cases.items():
        why = unsupported(*_model(**edit))
        assert why is not None and words in why, (words, why)
    assert "heads" in unsupported(*_model({"head_dim": 96, "rope_dim": 96}))  # 12 pieces of 8: not a power of two
    assert "heads" in unsupported(*_model({"n_head": 32, "n_head_kv": 2}))  # 16 query heads per KV head


def test_the_ring_plan_fits_its_budget_and_says_when_it_cannot():
    from k4.runtime.cuda.megakernel import PlanError, list_bytes, plan_ring

    budget = 200 << 10
    tiles, slot, lists = plan_ring(SEVEN_B, 6, 132, budget)
    assert lists == list_bytes(tiles.shape[1], 6) and lists + MK_SLOTS * slot <= budget and slot % 16 == 0
    specs = {i: m for mats in SEVEN_B for i, m in mats}
    assert max(tile_bytes(specs[t[1]].ggml_type, specs[t[1]].n_in, t[3]) for t in tiles.reshape(-1, 4) if t[0] >= 0) <= slot
    with pytest.raises(PlanError, match="exceed"):
        plan_ring(SEVEN_B, 6, 132, 16 << 10)
