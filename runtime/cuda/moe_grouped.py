"""Prefill's routed experts grouped by expert (kernels_cu/moe_grouped.cu; issue 18: "prefill
groups tokens by expert"). A chunk of n tokens chooses n * k (token, expert) slots; moe.gathered
multiplies each slot by its expert's matrix on its own, so an expert chosen by 30 tokens has its
rows read 30 times. Here moe_group orders the slots by expert into work items of up to
MOE_GROUP_TOKENS slots of one expert, and moe_gemv_grouped multiplies each item's slots reading
the expert's rows once (8-bit x, dp4a). Each slot's output is moe.gathered's within float32
rounding (the same dot products summed in another order). All on the device: the items follow
the ids moe_topk wrote, no host round trip, so prefill chunks stay capturable as graphs.
"""

from __future__ import annotations

import numpy as np

from .constants import chunk_elems, q8x_bytes
from .kernel_names import MOE_GROUP_TOKENS, MOE_GROUPED_VARIANT, moe_grouped_name
from .quant_types import QUANT

GROUP_THREADS = 1024  # moe_group: one block
GROUPED_MIN_TOKENS = 9  # chunks of fewer tokens (the verify step's up to 8) keep moe.gathered
MAX_ITEMS = 65535  # CUDA's limit on gridDim.y: moe_gemv_grouped's items (a 512-token chunk of 8 of 128 experts: 640)
# moe_gemv_grouped: rows each lane group of a warp takes per item (the blocks per item follow). Measured
# on the H200 (Qwen3-30B-A3B pp512, t/s): 1 4,938, 2 5,834, 4 6,391, 8 6,653, 16 6,759, 32 6,718, one
# block per item 6,653: fewer blocks quantize each item's x fewer times, too few leave the GPU idle.
ROW_PASSES = 16


def max_items(n_slots: int, n_expert: int) -> int:
    """The most work items any choice of n_slots slots over n_expert experts needs: each expert's
    slots in items of MOE_GROUP_TOKENS, one part-filled item per expert at most."""
    return -(-n_slots // MOE_GROUP_TOKENS) + n_expert


def applies(e, n_tok: int) -> bool:
    """Whether a chunk of n_tok tokens runs expert tensor e (a moe.Experts) grouped: quantized
    experts on 8-bit x (moe_gemv.cu's kind) and more tokens than a verify step."""
    return n_tok >= GROUPED_MIN_TOKENS and e.kernel[0] == "moe_gemv.cu"


def group(o, ids, n_slots: int, n_expert: int, items, order) -> None:
    """Order the slots by expert: ids (n_slots,) int32 (each < n_expert) -> items (at least
    max_items(n_slots, n_expert), 4) int32 rows (expert, first, count, 0), order (n_slots,)
    int32. o: the ops.Ops that launches it. Raises ValueError when items or order is too short or
    the items would pass CUDA's grid limit."""
    need = max_items(n_slots, n_expert)
    if items.shape[0] < need or order.shape[0] < n_slots or need > MAX_ITEMS:
        raise ValueError(f"moe_group needs {need} items (at most {MAX_ITEMS}) and {n_slots} order entries, got {items.shape[0]} "
                         f"and {order.shape[0]}")
    o._launch("moe_grouped.cu", "moe_group", (1,), (GROUP_THREADS,),
              (ids, np.int32(n_slots), np.int32(n_expert), np.int32(MOE_GROUP_TOKENS), np.int32(need), items, order),
              shared_mem=12 * n_expert, pdl=False)


def grouped(o, e, items, order, n_items: int, x, x_div: int, x_stride: int, y, up=None) -> None:
    """y[s] (n_out,) = expert ids[s]'s matrix times x[s // x_div] for every slot s of the items
    (group's, n_items of them as group() sized them), with up (moe.fused_glu) silu(gate) * up as
    moe.gathered; y: (n_slots, n_out) f32. Raises ValueError for experts applies() refuses or x
    rows that are not 16-byte aligned."""
    from . import moe

    _, n_out, n_in = e.shape
    if e.kernel[0] != "moe_gemv.cu" or (up is not None and not moe.fused_glu(e, up, "silu")):
        raise ValueError(f"grouped products take quantized experts (and gate/up of one type and shape); got {e.ggml_type.name}")
    if x.data.ptr % 16 or x_stride % 4 or n_in % 32:
        raise ValueError(f"grouped products need 16-byte aligned x rows and n_in a multiple of 32; got x at {x.data.ptr:#x}, "
                         f"x_stride {x_stride}, n_in {n_in}")
    warps, u = MOE_GROUPED_VARIANT
    glu = up is not None
    name = moe_grouped_name(QUANT[e.ggml_type].decoder, glu)
    smem = MOE_GROUP_TOKENS * q8x_bytes(n_in)
    key = ("grouped", glu, n_items)
    if key not in e._grids:
        from .launch import allow_shared

        allow_shared(o.function("moe_grouped.cu", name), smem)
        out_chunks, lps = (2 if glu else 1) * n_in // chunk_elems(e.ggml_type), 1  # lanes per row, as the kernel chooses them
        while lps < 32 and lps * u < out_chunks:
            lps *= 2
        rows_per_block = warps * (32 // lps) * ROW_PASSES
        e._grids[key] = (max(1, -(-n_out // rows_per_block)), n_items)
    args = (e.data, up.data if glu else np.uint64(0), np.int64(e.expert_bytes), items, order, x, np.int32(x_div),
            np.int64(x_stride), y, np.int32(n_out), np.int32(n_in))
    o._launch("moe_grouped.cu", name, e._grids[key], (32 * warps,), args, shared_mem=smem, pdl=False)
