"""The mixture-of-experts weights at load (qwen3moe, qwen2moe): their bytes and upload, expert by
expert and planar where moe.planar_experts says (upload_experts), each layer's MoeWeights
(layer_moe), and the MoE kernels a model compiles (compile_jobs). What runs them: moe.py.
"""

from __future__ import annotations

from ..arch import MOE_TENSORS
from ..errors import UnsupportedModelError
from ..model import ModelConfig, ModelFile
from . import moe_one
from .constants import MOE_MAX_K
from .kernel_names import moe_down_name, moe_grouped_name, moe_q8_name
from .moe import Experts, MoeWeights, decode_fusable, fused_glu, planar_experts, router_name
from .quant_types import FLOAT, QUANT


EXPERT_TENSORS = tuple(n.removesuffix(".weight") for n in MOE_TENSORS)  # the router as one "expert"


def scratch_bytes(mf: ModelFile, cfg: ModelConfig, planar: bool) -> int:
    """The largest expert tensor that upload_experts passes through scratch (0: none)."""
    names = (f"blk.{i}.{n}.weight" for i in range(cfg.n_layer if cfg.n_expert else 0) for n in EXPERT_TENSORS)
    return max((t.n_bytes for t in map(mf.tensor, names) if planar_experts(t.ggml_type, planar)), default=0)


def upload_experts(mem, up, mf: ModelFile, cfg: ModelConfig, planar: bool, scratch, copy_stream, trace) -> dict:
    """Upload every layer's stacked expert tensors and router (an Experts of one expert, so its
    product runs in float32 through the same kernel: a router rounded to fp16 on tensor cores
    could pick other experts than the reference) with memory.Uploader `up` into buffers of
    memory.DeviceMemory `mem`: tensor name -> Experts. planar: flag K4_PLANAR_EXPERTS; a tensor
    of a type that goes planar lands in `scratch` (cupy uint8 of at least scratch_bytes) and
    layout.expert_layout rearranges it on `copy_stream` (up's stream), counted in `trace`."""
    import cupy as cp

    from .layout import expert_layout, expert_nbytes

    out = {}
    for i in range(cfg.n_layer if cfg.n_expert else 0):
        for n in EXPERT_TENSORS:
            t = mf.tensor(f"blk.{i}.{n}.weight")
            shape = t.shape if len(t.shape) == 3 else (1, *t.shape)
            pl = planar_experts(t.ggml_type, planar)
            buf = mem.empty(shape[0] * expert_nbytes(t.ggml_type, shape, True) if pl else t.n_bytes, cp.uint8, "weights")
            target, then = buf, None
            if pl:
                target = scratch[: t.n_bytes]

                def then(buf=buf, target=target, t=t, shape=shape) -> None:
                    with copy_stream:
                        expert_layout(buf, target, t.ggml_type, shape, trace)
            if t.file_offset is None:
                up.upload(target.data.ptr, t.raw_bytes(), then)
            else:
                up.upload_file(target.data.ptr, mf.path, t.file_offset, t.n_bytes, then)
            out[t.name] = Experts(buf, t.ggml_type, shape, n == "ffn_gate_inp")
    return out


def compile_jobs(mf: ModelFile, cfg: ModelConfig, o) -> list:
    """compile.module() arguments of the MoE kernels a model launches (kernels_cu/moe*.cu; ops.Ops
    `o`'s defines): none for a dense model; moe_topk, moe_combine, the expert product of each
    expert and router tensor type of every layer (Experts.kernel; Q4_K_M mixes Q4_K and Q6_K down
    experts), the SwiGLU instance where gate and up fuse (fused_glu), prefill's moe_group and
    grouped products for quantized experts, and decode's moe_router and moe_down_combine where a
    layer's decode step fuses (decode_fusable). Raises
    UnsupportedModelError for more than MOE_MAX_K experts per token."""
    from .kernel_names import GROUP_OF

    if not cfg.n_expert:
        return []
    if cfg.n_expert_used > MOE_MAX_K:
        raise UnsupportedModelError(f"{mf.path.name}: {cfg.n_expert_used} experts per token; the cuda backend takes at most "
                                    f"{MOE_MAX_K}; use --backend numpy")
    kernels = {("moe.cu", "moe_topk"), ("moe.cu", "moe_combine")}
    for i in range(cfg.n_layer):
        tensors = {n: mf.tensor(f"blk.{i}.{n}.weight") for n in EXPERT_TENSORS}
        e = {n: Experts(None, t.ggml_type, t.shape, n == "ffn_gate_inp") for n, t in tensors.items()}
        kernels.update(x.kernel for x in e.values())
        if fused_glu(e["ffn_gate_exps"], e["ffn_up_exps"], cfg.activation):
            kernels.add(("moe_gemv.cu", moe_q8_name(QUANT[e["ffn_gate_exps"].ggml_type].decoder, glu=True)))
        gate, up, down = (e[n] for n in EXPERT_TENSORS[1:])
        decoder = lambda x: QUANT[x.ggml_type].decoder  # noqa: E731
        if all(x.kernel[0] == "moe_gemv.cu" for x in (gate, up, down)):  # prefill's grouped products
            glu = fused_glu(gate, up, cfg.activation)
            kernels.update(("moe_grouped.cu", n) for n in ("moe_group", moe_grouped_name(decoder(down)),
                                                           moe_grouped_name(decoder(gate), glu), moe_grouped_name(decoder(up), glu)))
        router = tensors["ffn_gate_inp"].ggml_type
        if decode_fusable(cfg, gate, up, down, router in FLOAT, bool(cfg.n_ff_shexp)):
            kernels.update((("moe.cu", router_name(router)), ("moe_down.cu", moe_down_name(decoder(down)))))
            if (one := moe_one.kernel_name(router, gate, down)) is not None:
                kernels.add(("moe_one.cu", one))
    return [(f, GROUP_OF[(f, name)], o._defines()) for f, name in sorted(kernels)]


def layer_moe(cfg: ModelConfig, i: int, dev: dict) -> MoeWeights | None:
    """Layer i's MoeWeights from the uploaded pieces (dev: tensor name -> device array,
    DeviceWeight or Experts), None for a dense model."""
    if not cfg.n_expert:
        return None
    g = lambda n: dev.get(f"blk.{i}.{n}.weight")  # noqa: E731
    m = MoeWeights(g("ffn_gate_inp"), g("ffn_gate_exps"), g("ffn_up_exps"), g("ffn_down_exps"))
    if cfg.n_ff_shexp:
        m.shared_gate = g("ffn_gate_inp_shexp").reshape(-1)  # (n_embd,) f32
        m.shared = (g("ffn_gate_shexp"), g("ffn_up_shexp"), g("ffn_down_shexp"))
    return m
