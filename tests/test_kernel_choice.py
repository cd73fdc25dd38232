"""Which gemv_q8 instance a matrix gets (runtime/cuda/quant_kernels.py gemv_variant): the
per-type default, or the row-blocks variant where the default runs at half speed. No GPU."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from k4.runtime.cuda import quant_kernels as qk


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K])
def test_rows_of_slow_block_counts_take_the_row_blocks_variant(t):
    # 17, 18, 20, 21, 22, 23, 34, 35, 54, 70, 84 blocks
    for n_in in (4352, 4608, 5120, 5376, 5632, 5888, 8704, 8960, 13824, 17920, 21504):
        assert qk.gemv_variant(t, n_in) == qk.ROW_BLOCKS_VARIANT[t], n_in
    for n_in in (512, 768, 1792, 2048, 3072, 3584, 3840, 4096, 6144, 11008, 14336, 15360, 18944):
        assert qk.gemv_variant(t, n_in) == qk.QUANT[t].gemv, n_in


def test_swiglu_pairs_and_other_types_keep_their_variant():
    assert qk.gemv_variant(T.Q4_K, 5120, glu=True) == qk.QUANT[T.Q4_K].glu
    for t in (T.Q5_K, T.Q8_0, T.Q3_K):
        assert qk.gemv_variant(t, 5120) == qk.QUANT[t].gemv


def test_the_row_blocks_variant_is_compiled_with_the_type():
    for t, v in qk.ROW_BLOCKS_VARIANT.items():
        for planar in (False, True):
            assert qk._gemv_q8_name(t, planar, v) in qk.GROUPS["gemv.cu"][t.name]
