"""Mixture of experts on the GPU (qwen3moe, qwen2moe): the expert weights, their buffers and the
feed-forward step of runtime/cuda/forward.py; the twin of runtime/moe.py (numpy).

Weights: each stacked expert tensor (n_expert, n_out, n_in) goes to the device expert by expert
(expert e at e * expert_bytes): as in the file (raw ggml blocks), or, for a type whose
constants.QuantLayout says expert_planar (Q6_K) and unless K4_PLANAR_EXPERTS=0, each expert in the
planar layout (layout.expert_layout), which the kernels read as T::expert_planar says; the router
and the shared expert's matrices as ordinary DeviceWeights (weights.matrix_plan takes every 2-D
tensor), the shared expert's gate as an f32 vector. Routing stays on the device (kernels_cu/moe.cu): router product,
moe_topk writing (k ids, k weights) per token, the gathered products of the selected experts
reading those ids (one launch per matrix over every (token, slot); quantized experts with 8-bit
x and dp4a, kernels_cu/moe_gemv.cu, float ones and the router on float x), SwiGLU, moe_combine adding
the weighted sum (and qwen2moe's sigmoid-gated shared expert) to the residual. No host round
trip: decode is captured in the graph as the dense layers are; with K4_FUSE_MOE its feed-forward
is three launches (decode_fused). Prefill chunks of quantized experts group their slots by expert
(runtime/cuda/moe_grouped.py: each expert's rows read once per 8 of its slots); the verify
step's few tokens, and float experts, run the gathered products. The upload and the compile
jobs: runtime/cuda/moe_load.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model import ModelConfig
from .constants import MOE_MAX_K, MOE_WARPS as ROW_WARPS, QUANT_LAYOUTS, ROUTER_THREADS, q8x_bytes
from .device_weight import WeightOptions, make_weight
from .kernel_names import MOE_DOWN_VARIANT, MOE_Q8_GLU_VARIANTS, MOE_Q8_VARIANTS, moe_down_name, moe_q8_name
from .quant_types import FLOAT, QUANT
from . import moe_grouped, moe_one

TOPK_THREADS = 128
COMBINE_THREADS = 256


def router_name(t) -> str:
    """The moe.cu moe_router instance for a float router of ggml type t."""
    return f"moe_router<{FLOAT[t][0]}>"


@dataclass
class Experts:
    """One stacked expert tensor on the device: data (n_expert * expert_bytes,) uint8, each
    expert in the file's ggml blocks or, where planar_experts says so, in the planar layout
    (layout.expert_layout), as the kernels read it (T::expert_planar); shape (n_expert, n_out,
    n_in); float_x: its products run on float32 x even when quantized (the router: 8-bit x could
    pick other experts than the reference)."""

    data: object
    ggml_type: object
    shape: tuple[int, int, int]
    float_x: bool = False
    _grids: dict = field(default_factory=dict, repr=False, compare=False)  # (n_slots, glu) -> gathered's launch plan

    @classmethod
    def from_raw(cls, raw, ggml_type, shape: tuple[int, int, int], float_x: bool = False, planar: bool = True) -> Experts:
        """The Experts of a stacked tensor given as the file holds it (raw: cupy uint8), laid out
        as upload_experts lays it out: a new planar array where planar_experts(ggml_type, planar),
        else raw itself. planar: flag K4_PLANAR_EXPERTS, as the kernels were compiled."""
        if not planar_experts(ggml_type, planar):
            return cls(raw, ggml_type, shape, float_x)
        import cupy as cp

        from .layout import expert_layout, expert_nbytes

        out = cp.empty(shape[0] * expert_nbytes(ggml_type, shape, True), cp.uint8)
        expert_layout(out, raw, ggml_type, shape)
        return cls(out, ggml_type, shape, float_x)

    @property
    def expert_bytes(self) -> int:
        return self.data.nbytes // self.shape[0]

    @property
    def kernel(self) -> tuple[str, str]:
        """(file, name) of the kernel of its gathered product: moe_gemv.cu moe_gemv_q8 for a
        quantized type, else (or with float_x) moe.cu moe_gemv_q / moe_gemv_f."""
        t = self.ggml_type
        if t in QUANT and self.float_x:
            return "moe.cu", f"moe_gemv_q<{QUANT[t].decoder}>"
        if t in QUANT:
            return "moe_gemv.cu", moe_q8_name(QUANT[t].decoder)
        return "moe.cu", f"moe_gemv_f<{FLOAT[t][0]}>"


def fused_glu(gate: Experts, up: Experts, activation: str) -> bool:
    """Whether gate and up run as one moe_gemv_q8 SwiGLU launch (gathered with up): both of one
    quantized type and shape on 8-bit x, activation silu (ModelConfig.activation)."""
    return (gate.kernel[0] == "moe_gemv.cu" and up.kernel == gate.kernel and up.shape == gate.shape
            and activation == "silu")


@dataclass(frozen=True)
class Route:
    """One token's router logits (n_expert,) f32 on the device, from which a decode product makes
    the router's choice itself (kernels_cu/moe_route.cuh); renorm: divide the k weights by their sum."""

    logits: object
    n_expert: int
    renorm: bool


@dataclass
class MoeWeights:
    """One block's experts: router Experts (1, n_expert, n_embd); gate, up, down Experts; the
    shared expert's gate (n_embd,) f32 and its gate/up/down DeviceWeights, or None."""

    router: object
    gate: Experts
    up: Experts
    down: Experts
    shared_gate: object = None
    shared: tuple | None = None
    router_w: object = None  # the router as a dense matrix.DeviceWeight (router_weight), made on first use


def router_weight(m: MoeWeights, o):
    """The router of a float type (F32, F16, BF16: what convert_hf_to_gguf writes) as a dense
    DeviceWeight (device_weight.py) over its uploaded bytes, so its product runs as the dense ones do in
    float32: gemv_f for up to GEMV_MAX_TOKENS tokens (one block per row, instead of moe.cu's
    per-slot kernel: a 128 x 2048 F32 router per layer), cuBLAS fp32 for more. None for a
    quantized router, which stays on moe.cu's float-x kernel (8-bit x could change the experts
    chosen). o: the ops.Ops whose PDL and evict-first switches the product takes."""
    from .layout import MatrixSpec

    if m.router_w is None and m.router.ggml_type in FLOAT:
        _, n_out, n_in = m.router.shape
        spec = MatrixSpec("ffn_gate_inp.weight", m.router.ggml_type, (n_out, n_in))
        opts = WeightOptions(tensor_cores=True, pdl=o.sw.pdl, evict_first=o.sw.evict_first)
        m.router_w = make_weight(spec, m.router.data, repack=False, opts=opts)
    return m.router_w


def moe_spec(cfg: ModelConfig, P: int) -> dict:
    """The MoE activations of up to P tokens (buffers.activation_spec): router logits, the chosen
    ids and weights, the selected experts' gate/up and down outputs, the shared expert's."""
    from .buffers import Buffer  # buffers.activation_spec calls this

    if not cfg.n_expert:
        return {}
    k, f32 = cfg.n_expert_used, np.float32
    spec = {
        "moe_logits": Buffer((P, cfg.n_expert), f32),
        "moe_zero": Buffer((P,), np.int32, zero=True),  # expert 0 for every token: the router's product
        "moe_ids": Buffer((P * k,), np.int32),
        "moe_w": Buffer((P * k,), f32),
        "moe_g": Buffer((P * k, cfg.n_ff_exp), f32),
        "moe_u": Buffer((P * k, cfg.n_ff_exp), f32),
        "moe_d": Buffer((P * k, cfg.n_embd), f32),
        "moe_items": Buffer((moe_grouped.max_items(P * k, cfg.n_expert), 4), np.int32),  # prefill's slots grouped by expert
        "moe_order": Buffer((P * k,), np.int32),
        # moe_one.Handoff: tagged logits, the blocks whose SwiGLU rows are written, the finished blocks
        "moe_words": Buffer((cfg.n_expert,), np.uint64, zero=True),
        "moe_arrived": Buffer((1,), np.uint64, zero=True),
        "moe_count": Buffer((1,), np.uint64, zero=True),
    }
    if cfg.n_ff_shexp:
        spec.update({"shexp_g": Buffer((P, cfg.n_ff_shexp), f32), "shexp_u": Buffer((P, cfg.n_ff_shexp), f32),
                     "shexp_d": Buffer((P, cfg.n_embd), f32)})
    return spec


def planar_experts(t, on: bool) -> bool:
    """Whether expert tensors of ggml type t go to the device planar: on (flag K4_PLANAR_EXPERTS,
    which also compiles the kernels' T::expert_planar) and the type's QuantLayout.expert_planar."""
    return on and t in QUANT_LAYOUTS and QUANT_LAYOUTS[t].expert_planar


MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: moe_gemv_q8 blocks step over the slots beyond it


def gathered(o, e: Experts, ids, x, x_div: int, x_stride: int, y, n_slots: int, up: Experts | None = None,
             route: Route | None = None, norm: tuple | None = None) -> None:
    """y[s] (n_out,) = expert ids[s]'s matrix times x[s // x_div] (x rows x_stride floats apart),
    for s < n_slots; y: (n_slots, n_out) f32; ids: (n_slots,) int32; all on the device.
    Quantized experts (not float_x): kernels_cu/moe_gemv.cu moe_gemv_q8, x quantized to 8 bits
    per 32 values as gemv_q8 does (relative error about 5e-3 on random data; each slot's y bit
    for bit runtime/cuda/matmul.py gemv's on that expert's matrix); float types and float_x:
    moe.cu moe_gemv_f / moe_gemv_q in float32. With up (fused_glu(e, up, "silu")): e holds the
    gate experts and y[s] = silu(gate product) * (up product), one launch (bit for bit gemv's
    SwiGLU instance on the expert's interleaved gate/up pair). Decode (one token, the SwiGLU
    launch): with route, slot s takes the s-th expert of the router's choice, made in each block
    (ids is not read; n_slots = k), and with norm = (norm_w (n_in,) f32, eps) x is the token's
    residual stream, normalized in each block's prologue; the launch then uses programmatic
    dependent launch. Raises ValueError when a q8 product's x rows are not 16-byte aligned (x's
    address or x_stride), n_in is not a multiple of 32, up cannot be fused with e, or route or
    norm come without up."""
    _, n_out, n_in = e.shape
    f, name = e.kernel
    if up is not None and not fused_glu(e, up, "silu"):
        raise ValueError(f"gate experts {e.ggml_type.name} {e.shape} and up experts {up.ggml_type.name} {up.shape} "
                         "cannot run as one launch: both must be of one quantized type and shape")
    if (route is not None or norm is not None) and up is None:
        raise ValueError("a routed or normalized gathered product is the SwiGLU launch: pass up")
    if route is not None and not 1 <= n_slots <= min(MOE_MAX_K, route.n_expert):
        raise ValueError(f"a routed launch takes one token's k slots (1 to {MOE_MAX_K}, at most n_expert), got {n_slots}")
    if f == "moe.cu":
        args = (e.data, np.int64(e.expert_bytes), ids, x, np.int32(x_div), np.int64(x_stride), y, np.int32(n_out), np.int32(n_in))
        blocks = max(1, min(-(-n_out // ROW_WARPS), 1024 // max(1, n_slots) + 1))
        o._launch(f, name, (blocks, n_slots), (ROW_WARPS * 32,), args, pdl=False)
        return
    if x.data.ptr % 16 or x_stride % 4 or n_in % 32:
        raise ValueError(f"the 8-bit expert product needs 16-byte aligned x rows and n_in a multiple of 32; got x at "
                         f"{x.data.ptr:#x}, x_stride {x_stride}, n_in {n_in}")
    name, grid, block, smem = _q8_plan(o, e, n_slots, up is not None, route.n_expert if route else 0)
    null = np.uint64(0)
    norm_w, eps = norm if norm is not None else (null, 0.0)
    args = (e.data, up.data if up is not None else null, np.int64(e.expert_bytes), null if route else ids, x, np.int32(x_div),
            np.int64(x_stride), y, np.int32(n_out), np.int32(n_in), np.int32(n_slots),
            route.logits if route else null, np.int32(route.n_expert if route else 0), np.int32(bool(route and route.renorm)),
            norm_w, np.float32(eps), np.int32(route is not None))
    o._launch(f, name, grid, block, args, shared_mem=smem, pdl=route is not None)


def down_combine(o, e: Experts, route: Route, x, res, y) -> None:
    """Decode's down product of one token's k chosen experts with their weighted sum and the
    residual, one launch (kernels_cu/moe_down.cu moe_down_combine): y (n_out,) = res + sum_j w_j *
    expert e_j's matrix times x[j], (e_j, w_j) the router's choice from route, made in each block.
    x: (k, n_in) f32, the routed SwiGLU launch's output; res, y: (n_out,) f32 (y may be res).
    Quantized experts only (Experts.kernel in moe_gemv.cu); k must divide 32. Raises ValueError
    otherwise or for x rows not 16-byte aligned."""
    _, n_out, n_in = e.shape
    k = x.shape[0]
    if e.kernel[0] != "moe_gemv.cu" or 32 % k or n_in % 32 or x.data.ptr % 16 or x.shape[1] != n_in:
        raise ValueError(f"down_combine takes quantized experts, k dividing 32 and x (k, n_in) 16-byte aligned; got "
                         f"{e.ggml_type.name} experts {e.shape}, x {x.shape} at {x.data.ptr:#x}")
    plan = e._grids.get(("down", k, route.n_expert))
    if plan is None:
        from .launch import allow_shared, blocks_per_sm, device_limits

        warps = MOE_DOWN_VARIANT[0]
        name = moe_down_name(QUANT[e.ggml_type].decoder)
        kernel, smem = o.function("moe_down.cu", name), k * q8x_bytes(n_in) + 4 * route.n_expert
        allow_shared(kernel, smem)
        resident = device_limits()[0] * blocks_per_sm(kernel, 32 * warps, smem)
        plan = e._grids[("down", k, route.n_expert)] = (name, (max(1, min(-(-n_out // warps), resident)),), (32 * warps,), smem)
    name, grid, block, smem = plan
    args = (e.data, np.int64(e.expert_bytes), route.logits, np.int32(route.n_expert), np.int32(k), np.int32(route.renorm),
            x, res, y, np.int32(n_out), np.int32(n_in))
    o._launch("moe_down.cu", name, grid, block, args, shared_mem=smem)


def _q8_plan(o, e: Experts, n_slots: int, glu: bool, n_expert: int = 0) -> tuple[str, tuple[int, int], tuple[int], int]:
    """(kernel name, grid, block, shared bytes) of moe_gemv_q8 for n_slots slots (n_expert: the
    router's logits it routes by, 0: none), cached on e. The row blocks per slot share the
    resident blocks among the slots (decode's 8 slots fill the GPU: one wave), at most one per
    WARPS rows, at least one; grid.y is the slots up to CUDA's limit."""
    plan = e._grids.get((n_slots, glu, n_expert))
    if plan is None:
        from .launch import allow_shared, blocks_per_sm, device_limits

        _, n_out, n_in = e.shape
        decoder = QUANT[e.ggml_type].decoder
        name, warps = moe_q8_name(decoder, glu), (MOE_Q8_GLU_VARIANTS if glu else MOE_Q8_VARIANTS)[decoder][0]
        kernel, smem = o.function("moe_gemv.cu", name), q8x_bytes(n_in) + 4 * n_expert
        allow_shared(kernel, smem)
        resident = device_limits()[0] * blocks_per_sm(kernel, 32 * warps, smem)
        row_blocks = max(1, min(-(-n_out // warps), resident // n_slots))
        plan = e._grids[(n_slots, glu, n_expert)] = (name, (row_blocks, min(n_slots, MAX_GRID_Y)), (32 * warps,), smem)
    return plan


def decode_fusable(cfg: ModelConfig, gate: Experts, up: Experts, down: Experts, router_float: bool, shared: bool) -> bool:
    """Whether a layer's decode step can run as three launches (decode_fused): a float router (F32,
    F16, BF16: moe_router takes the RMSNorm), gate and up fused (fused_glu), quantized down experts, k
    dividing 32 (moe_down_combine's lane groups), no shared expert (qwen2moe's: moe_combine)."""
    return (router_float and not shared and fused_glu(gate, up, cfg.activation) and down.kernel[0] == "moe_gemv.cu"
            and 32 % cfg.n_expert_used == 0 and cfg.n_embd % 32 == 0 and cfg.n_ff_exp % 32 == 0)


def decode_fused(fwd, L, x1, x) -> bool:
    """One token's feed-forward in three launches when decode_fusable and the forward options
    fuse it (K4_FUSE_MOE): the router product with the RMSNorm in its prologue (moe.cu moe_router), the
    routed SwiGLU launch of gate and up (each block makes the router's choice and normalizes
    x1 itself), and moe_down_combine (the same choice; the weighted sum and the residual in
    its epilogue), instead of RMSNorm, router, moe_topk, SwiGLU, down and moe_combine, all three
    with programmatic dependent launch; with K4_MOE_ONE, where runtime/cuda/moe_one.py covers the
    layer, those three as one launch. Returns False (nothing enqueued) otherwise."""
    cfg, o, a, m = fwd.cfg, fwd.ops, fwd.act, L.moe
    if not fwd.opts.fuse_moe or x1.shape[0] != 1:
        return False
    if not decode_fusable(cfg, m.gate, m.up, m.down, m.router.ggml_type in FLOAT, m.shared is not None):
        return False
    k, norm = cfg.n_expert_used, (L.ffn_norm, cfg.rms_eps)
    logits = a.moe_logits[:1]
    handoff = moe_one.Handoff(a.moe_words, a.moe_arrived, a.moe_count)
    if fwd.opts.moe_one and moe_one.launch(o, m, x1[0], L.ffn_norm, cfg.rms_eps, a.moe_g[:k], handoff, x[0], k, cfg.expert_norm):
        return True
    o._launch("moe.cu", router_name(m.router.ggml_type), (cfg.n_expert,), (ROUTER_THREADS,),
              (m.router.data, x1, L.ffn_norm, np.float32(cfg.rms_eps), logits, np.int32(cfg.n_embd)))
    route = Route(logits, cfg.n_expert, cfg.expert_norm)
    g = a.moe_g[:k]  # (k, n_ff_exp)
    gathered(o, m.gate, None, x1, k, cfg.n_embd, g, k, up=m.up, route=route, norm=norm)
    down_combine(o, m.down, route, g, x1[0], x[0])
    return True


def moe_ffn(fwd, L, x1, x, n: int) -> None:
    """x (n, n_embd) = x1 + the experts' output for rmsnorm(x1) * ffn_norm (runtime/moe.py
    MoeFfn.forward), enqueued on fwd's stream: fwd is the runtime/cuda/forward.py Forward, L the
    layer's LayerWeights (L.moe a MoeWeights). One token: decode_fused where it applies."""
    if n == 1 and decode_fused(fwd, L, x1, x):
        return
    cfg, o, a, m = fwd.cfg, fwd.ops, fwd.act, L.moe
    k, E = cfg.n_expert_used, cfg.n_expert
    h = a.h[:n]  # (n, n_embd) f32
    o.rms_norm(x1, L.ffn_norm, h, cfg.rms_eps)
    logits = a.moe_logits[:n]  # (n, n_expert)
    router = router_weight(m, o)
    if router is not None:  # a dense float32 product
        fwd.linear(router, h, logits)
    else:  # float32 x on the quantized router, ids all 0: the one "expert"
        gathered(o, m.router, a.moe_zero[:n], h, 1, cfg.n_embd, logits, n)
    ids, w = a.moe_ids[: n * k], a.moe_w[: n * k]
    o._launch("moe.cu", "moe_topk", (n,), (TOPK_THREADS,), (logits, np.int32(E), np.int32(k), np.int32(cfg.expert_norm), ids, w),
              shared_mem=4 * E, pdl=False)
    g, u, d = a.moe_g[: n * k], a.moe_u[: n * k], a.moe_d[: n * k]
    product = gathered
    if all(moe_grouped.applies(t, n) for t in (m.gate, m.up, m.down)):  # a prefill chunk: slots grouped by expert
        n_items = moe_grouped.max_items(n * k, E)
        items, order = a.moe_items[:n_items], a.moe_order[: n * k]
        moe_grouped.group(o, ids, n * k, E, items, order)

        def grouped_product(o, e, ids, x, x_div, x_stride, y, n_slots, up=None):  # gathered's arguments
            moe_grouped.grouped(o, e, items, order, n_items, x, x_div, x_stride, y, up=up)
        product = grouped_product
    if fused_glu(m.gate, m.up, cfg.activation):
        product(o, m.gate, ids, h, k, cfg.n_embd, g, n * k, up=m.up)  # silu(gate) * up, (n k, n_ff_exp)
    else:
        product(o, m.gate, ids, h, k, cfg.n_embd, g, n * k)
        product(o, m.up, ids, h, k, cfg.n_embd, u, n * k)
        o.swiglu(g, u, g, cfg.activation)  # (n k, n_ff_exp)
    product(o, m.down, ids, g, 1, cfg.n_ff_exp, d, n * k)
    null = np.uint64(0)
    shared, gate = null, null
    if m.shared is not None:
        sg, su, sd = a.shexp_g[:n], a.shexp_u[:n], a.shexp_d[:n]
        fwd.linear(m.shared[0], h, sg)
        fwd.linear(m.shared[1], h, su)
        o.swiglu(sg, su, sg, cfg.activation)
        fwd.linear(m.shared[2], sg, sd)
        shared, gate = sd, m.shared_gate
    o._launch("moe.cu", "moe_combine", (n,), (COMBINE_THREADS,),
              (d, w, np.int32(k), x1, x, np.int32(cfg.n_embd), shared, h if m.shared is not None else null, gate), pdl=False)
