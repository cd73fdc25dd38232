"""The device layouts of weight matrices (runtime/cuda/layout.py): planar groups, rows of several
tensors stacked or gate/up interleaved into one matrix, and device_layout (the load path's
rearrangement, on numpy arrays and on the GPU) equal to the host layout to the byte."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import layout as lay
from k4.runtime.cuda import matmul as mm
from k4.runtime.cuda.microbench import random_weight
from k4.runtime.model import Tensor
from tests.helpers_matmul import interleave_rows, stack_rows
from tests.matmul_ref import QUANTIZED

@pytest.mark.parametrize("type_name", QUANTIZED)
def test_planar_layout_holds_every_group_contiguously(type_name):
    rng = np.random.default_rng(1)
    t = random_weight(T[type_name], 3, 2 * GGML_QUANT_SIZES[T[type_name]][0], rng)
    raw = t.raw_bytes().reshape(-1)
    groups = mm.QUANT[t.ggml_type].groups
    blocks = raw.reshape(-1, groups[-1])
    planar = lay.weight_layout(t, repack=True)
    assert planar.nbytes == lay.planar_nbytes(t.ggml_type, blocks.shape[0])
    off = 0
    for a, b in pairwise(groups):
        n = blocks.shape[0] * (b - a)
        assert np.array_equal(planar[off : off + n], blocks[:, a:b].reshape(-1))
        assert off % 16 == 0
        off += -(-n // 16) * 16
    assert np.array_equal(lay.weight_layout(t, repack=False), raw)


def test_stack_rows_needs_one_type_and_width():
    rng = np.random.default_rng(0)
    a, b = random_weight(T.Q4_K, 4, 256, rng), random_weight(T.Q6_K, 4, 256, rng)
    with pytest.raises(ValueError, match="cannot stack"):
        stack_rows([a, b], "ab")
    s = stack_rows([a, a], "aa")
    assert np.array_equal(lay.weight_layout(s, False), np.concatenate([a.raw_bytes().reshape(-1)] * 2))


def test_interleave_rows_alternates_gate_and_up():
    rng = np.random.default_rng(0)
    gate, up = random_weight(T.Q4_K, 3, 512, rng), random_weight(T.Q4_K, 3, 512, rng)
    t = interleave_rows(gate, up, "blk.0.ffn_gate.weight")
    assert t.shape == (6, 512)
    rows = t.raw_bytes()
    assert np.array_equal(rows[0::2], gate.raw_bytes()) and np.array_equal(rows[1::2], up.raw_bytes())
    with pytest.raises(ValueError, match="cannot stack"):
        interleave_rows(gate, random_weight(T.Q6_K, 3, 512, rng), "x")
    with pytest.raises(ValueError, match="two matrices of one shape"):
        interleave_rows(gate, random_weight(T.Q4_K, 4, 512, rng), "x")


def _device_layout_cases(xp):
    """(host layout, device_layout's result on xp arrays) for stacked and gate/up-interleaved
    matrices of every type, raw and planar."""
    rng = np.random.default_rng(3)
    for type_name in (*QUANTIZED, "F16", "F32"):
        t = T[type_name]
        a, b, c = (random_weight(t, n, 2 * GGML_QUANT_SIZES[t][0], rng) for n in (5, 5, 3))
        for repack in (False, True):
            for tensors, glu in (([a, b, c], False), ([a, b], True), ([c], False)):
                spec = lay.combined(tensors, "m", glu)
                host = lay.weight_layout(interleave_rows(a, b, "m") if glu else stack_rows(tensors, "m"), repack)
                src = xp.asarray(np.concatenate([x.raw_bytes().reshape(-1) for x in tensors]))
                dst = xp.full(lay.layout_nbytes(spec, repack), 0xA5, xp.uint8)  # pads must be written too
                lay.device_layout(dst, src, spec, repack, glu)
                yield f"{type_name} repack={repack} glu={glu} n={len(tensors)}", host, dst


def test_device_layout_equals_the_host_layout():
    """The load path rearranges file bytes on the device; numpy arrays take the same code path."""
    for case, host, got in _device_layout_cases(np):
        assert np.array_equal(got, host), case


@pytest.mark.cuda
def test_device_layout_equals_the_host_layout_on_the_gpu():
    import cupy as cp

    for case, host, got in _device_layout_cases(cp):
        assert np.array_equal(got.get(), host), case


def test_combined_rejects_what_stack_and_interleave_reject():
    rng = np.random.default_rng(0)
    a, b = random_weight(T.Q4_K, 4, 256, rng), random_weight(T.Q6_K, 4, 256, rng)
    with pytest.raises(ValueError, match="cannot stack"):
        lay.combined([a, b], "ab")
    with pytest.raises(ValueError, match="two matrices of one shape"):
        lay.combined([a, random_weight(T.Q4_K, 6, 256, rng)], "g", glu=True)
    assert lay.combined([a, a], "aa").shape == (8, 256)


def test_weight_layout_rejects_partial_blocks():
    t = random_weight(T.F32, 2, 8, np.random.default_rng(0))
    bad = Tensor("w", T.Q4_K, (2, 100), t.raw)
    with pytest.raises(ValueError, match="multiple of the Q4_K block"):
        lay.weight_layout(bad, repack=True)


# ---- stacked expert tensors (runtime/cuda/moe_load.py upload_experts) --------------------------------

def _expert_layout_cases(xp):
    """(host: each expert's weight_layout(repack=True) one after the other, expert_layout's result
    on xp arrays) for every quantized type; 3 rows of 2 blocks a row: planes that need pads."""
    rng = np.random.default_rng(5)
    for type_name in QUANTIZED:
        t = T[type_name]
        E, rows, n_in = 3, 3, 2 * GGML_QUANT_SIZES[t][0]
        experts = [random_weight(t, rows, n_in, rng) for _ in range(E)]
        host = np.concatenate([lay.weight_layout(e, repack=True) for e in experts])
        src = xp.asarray(np.concatenate([e.raw_bytes().reshape(-1) for e in experts]))
        dst = xp.full(E * lay.expert_nbytes(t, (E, rows, n_in), True), 0xA5, xp.uint8)  # pads must be written too
        lay.expert_layout(dst, src, t, (E, rows, n_in))
        assert lay.expert_nbytes(t, (E, rows, n_in), False) * E == src.nbytes
        yield type_name, host, dst


def test_expert_layout_is_each_experts_planar_layout():
    """Expert e's bytes at e * expert_nbytes are weight_layout's of its matrix with repack, so the
    kernels read them as planar blocks of one expert (T::expert_planar); numpy arrays take the
    load path's code."""
    for case, host, got in _expert_layout_cases(np):
        assert np.array_equal(got, host), case


@pytest.mark.cuda
def test_expert_layout_on_the_gpu_equals_the_host_layout():
    import cupy as cp

    for case, host, got in _expert_layout_cases(cp):
        assert np.array_equal(got.get(), host), case


def test_expert_layout_rejects_other_sizes_and_float_types():
    src = np.zeros(2 * 3 * 210, np.uint8)
    with pytest.raises(ValueError, match="destination bytes"):
        lay.expert_layout(np.zeros(10, np.uint8), src, T.Q6_K, (2, 3, 256))
    with pytest.raises(ValueError, match="no planar layout"):
        lay.expert_layout(np.zeros(8, np.uint8), np.zeros(8, np.uint8), T.F32, (2, 1, 1))


def test_only_types_that_say_so_go_planar_and_the_flag_keeps_them_raw():
    from k4.runtime.cuda.moe import planar_experts

    assert planar_experts(T.Q6_K, True) and not planar_experts(T.Q6_K, False)
    assert not planar_experts(T.Q4_K, True) and not planar_experts(T.F32, True)
