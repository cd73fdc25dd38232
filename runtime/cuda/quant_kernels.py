"""Which kernels serve each ggml type: the template-instance names of the matrix kernels
(kernels_cu/gemv.cu, kernels_cu/gemv_batch.cu, kernels_cu/gemv_mma.cu, kernels_cu/matmul.cu) the
launchers use (the one list: NVRTC gets them as name expressions, the nvcc test instantiates
exactly them), the multi-token products' variants, their compile groups, and the lookup of a
compiled kernel. The per-type decoders: quant_types.py; the one-token products' launch choices:
gemv_choice.py. Importable without CuPy.
"""

from __future__ import annotations

from functools import cache

from gguf import GGMLQuantizationType as T

from .compile import module
from .gemv_choice import CLUSTER_TYPES, NQ_TYPES, QKV_PAIRS, QKV_VARIANT, ROW_BLOCKS_VARIANT, nq_variants
from .quant_types import FLOAT, QUANT


# gemv_q8 variants compiled besides each type's default, for microbench.bench_gemv(variant=...). Measured on
# the H200 (CUDA graph, PDL, bench_gemv): with the next chunks loading during the products (PF),
# Q4_K (16, 2, 1) beats (16, 2, 0), (32, 2, 0) and (16, 1, 1) from 4096x4096 (4.59 us, 2.07 TB/s)
# to 22016x4096 (14.3 us, 3.56 TB/s) and 4096x11008 (9.18 us); Q6_K (16, 2, 1) beats (32, 1, 0),
# (32, 2, 0) and (16, 1, 1) except at 4096x4096 (5.81 us vs 5.45 for (16, 1, 1)); 32000x4096 26.8 us,
# 4.02 TB/s; Q4_K (16, 3, 1) is no faster than (16, 2, 1). Llama 2 7B tg128: 456 t/s without PF,
# 550 with it (docs/PERF.md).
EXTRA_GEMV_VARIANTS: dict[T, tuple[tuple[int, int, int], ...]] = {
    T.Q4_K: ((16, 2, 0), (16, 1, 1), (32, 1, 0)), T.Q6_K: ((32, 1, 0), (16, 1, 1), (16, 2, 0)),
    T.Q5_K: ((16, 2, 1), (16, 1, 1))}
# SwiGLU-epilogue variants compiled besides the default
EXTRA_GLU_VARIANTS: dict[T, tuple[tuple[int, int, int], ...]] = {T.Q4_K: ((16, 2, 0),)}
FLOAT_GEMV = (8, 4)  # gemv_f: warps per block, 16-byte chunks in flight per lane

# gemv_q8_batch (kernels_cu/gemv_batch.cu): the most tokens one launch multiplies (its NT), and its
# (WARPS, U, PF, R) per quantized type: gemv's first three, R rows per warp sharing each x load.
# Not yet measured: chosen by the compiler's register counts (ptxas, sm_90, 8 tokens): with
# (8, 2, 1, 2) no instance spills (Q5_K's gate/up one uses 236 registers, Q4_K's 190), one block
# of 8 warps per multiprocessor keeps 2 rows x 2 chunks x 2 (PF) in flight per lane, as many
# bytes as gemv's (16, 2, 1). The extra variants (the "bench" group) are for bench_gemv_batch.
BATCH_TOKENS = 8
BATCH_VARIANT: dict[T, tuple[int, int, int, int]] = {t: (8, 2, 1, 2) for t in QUANT}
EXTRA_BATCH_VARIANTS: dict[T, tuple[tuple[int, int, int, int], ...]] = {
    t: ((8, 1, 1, 2), (12, 1, 1, 2), (8, 2, 1, 1)) for t in (T.Q4_K, T.Q6_K)}
# matmul of at most this many tokens runs as gemv (gemv_batch) instead of fp16 tensor cores. On the
# H200 (scripts/bench_gemv_batch.py, the 7B's Q4_K products) a batch of n costs 1.12, 1.43,
# 1.80, 2.15, 2.51, 2.87, 3.23, 3.58x one token's gemv for n = 1..8 (dp4a-bound: 8x the integer
# work), while a tensor-core verify step of 5 to 8 tokens costs about 2.7x a decode step, flat:
# the batch wins up to 4 tokens. Q4_K and Q6_K go to gemv_mma (int8 tensor cores, about 1.4-2.1x
# one gemv whatever the count) from MMA8_MIN_TOKENS on: batches of 2 stay on gemv_batch (7B verify
# step of 3 tokens: 1.72x a one-token step on gemv_batch, 1.42x on gemv_mma; of 2: 1.46x against
# 1.36x, but with gemv_mma from 2 tokens the GPU's speculative test flipped a near-tie against numpy,
# a top-2 margin of 0.027 in logits that differ by up to 0.28 between the two: docs/PERF.md).
GEMV_MAX_TOKENS = 4
MMA8_MIN_TOKENS = 3
# gemv_mma: products of MMA8_MIN_TOKENS..MMA8_TOKENS tokens on int8 tensor cores. MMA8_KERNELS[t]:
# (staged, layouts, warps) in the order the launcher tries them (gemv_mma.mma_shape: the first
# whose shared memory fits the matrix): gemv_mma_staged.cu (weights through cp.async rings; Q4_K
# raw or planar, Q6_K planar: raw Q6_K blocks are not 16-byte aligned), then gemv_mma.cu (weights
# through registers; Q6_K, also planar where the staged kernel's rings do not fit beside x, past
# about 11,000 inputs; Q4_K's staged kernel takes 8 warps past about 11,800). How many warps split each 16-row tile's blocks is chosen per matrix
# (gemv_mma.mma_ks). Measured on the H200 (docs/PERF.md, 4096 x 11008, 8 tokens): Q4_K 16 warps with
# 2 stages 18.7 µs, 12 with 3 19.9; Q6_K 12 warps with 2 stages 27.6, 8 with 3 33.4. The register
# kernel's Q6_K decoder spills at 16 warps' 128 registers and keeps 8. EXTRA_MMA8_WARPS (the
# "bench" group, the register kernel) are for scripts/bench_gemv_mma.py.
MMA8_KERNELS: dict[T, tuple[tuple[bool, tuple[bool, ...], tuple[int, ...]], ...]] = {
    T.Q4_K: ((True, (False, True), (16, 8)),),
    T.Q6_K: ((True, (True,), (16, 12)), (False, (False, True), (8,))),
}
MMA8_DECODERS = tuple(MMA8_KERNELS)  # the types with a gemv_mma kernel
# The staged kernel in thread-block clusters whose blocks split every row's blocks (flag
# K4_MMA8_CLUSTER; kernels_cu/gemv_mma_staged.cu CL): each block stages 1 / MMA8_CLUSTER of the
# tokens' x. Every staged instance also has one for clusters of this size.
MMA8_CLUSTER = 2
EXTRA_MMA8_WARPS: dict[T, tuple[int, ...]] = {T.Q6_K: (12,)}


def mma8_file(staged: bool) -> str:
    """The kernels_cu file of the staged or the register gemv_mma kernel."""
    return "gemv_mma_staged.cu" if staged else "gemv_mma.cu"


DEQUANT_CHUNK_BYTES = 32 << 20  # fp16 rows dequantized per cuBLAS call (fits the H200's 60 MB L2)


def _bool(b: bool) -> str:
    return "true" if b else "false"


# The GLU epilogues (gemv.cu glu_act): ModelConfig.activation -> the instances' trailing GELU
# template argument ("" leaves the default, false: the SwiGLU instances keep their names).
GLU_ACTS: dict[str, str] = {"silu": "", "gelu_tanh": ", true"}


def _gemv_q8_name(t: T, planar: bool, variant: tuple[int, int, int], glu: bool = False, act: str = "silu",
                  cluster: bool = False, nq: bool = False, nx: bool = False, am: bool = False) -> str:
    warps, u, pf = variant
    if am:  # the output head's argmax partials (gemv.cu AM; not GLU, CLUSTER or NQ), NX as given
        tail = f", false, false, false, {_bool(nx)}, true"
    elif nx:  # GELU, CLUSTER and NQ false (the readers of gemv.cu's NX)
        tail = ", false, false, false, true"
    else:
        tail = GLU_ACTS[act] if glu else f", false, {_bool(cluster)}, true" if nq else ", false, true" if cluster else ""
    return f"gemv_q8<{QUANT[t].decoder}, {_bool(planar)}, {warps}, {u}, {_bool(pf)}, {_bool(glu)}{tail}>"


def gemv_pair_name(t1: T, t2: T, planar: bool, nx: bool = False) -> str:
    """The gemv_q8_pair instance of the types (t1, t2) and layout: the warps of both types' default
    gemv_q8 variants (QKV_PAIRS), each type's rows in the loop of its own variant (U, PF), so
    their sums are that instance's bits; nx: the reader of an NQ handoff (gemv.cu NX)."""
    (w1, u1, pf1), (w2, u2, pf2) = QUANT[t1].gemv, QUANT[t2].gemv
    assert w1 == w2, "a pair's types run blocks of one size"
    tail = ", true" if nx else ""
    return f"gemv_q8_pair<{QUANT[t1].decoder}, {QUANT[t2].decoder}, {_bool(planar)}, {w1}, {u1}, {_bool(pf1)}, {u2}, {_bool(pf2)}{tail}>"


def _pair_names(t1: T, t2: T) -> tuple[str, ...]:
    """The gemv_q8_pair instances of a QKV_PAIRS entry, both layouts, and (both types in NQ_TYPES)
    their NQ-handoff readers."""
    nx = (False, True) if t1 in NQ_TYPES and t2 in NQ_TYPES else (False,)
    return tuple(gemv_pair_name(t1, t2, p, x) for x in nx for p in (False, True))


def _gemv_batch_name(t: T, planar: bool, variant: tuple[int, int, int, int] | None = None, glu: bool = False,
                     act: str = "silu") -> str:
    warps, u, pf, r = variant or BATCH_VARIANT[t]
    return (f"gemv_q8_batch<{QUANT[t].decoder}, {_bool(planar)}, {warps}, {u}, {_bool(pf)}, {r}, {BATCH_TOKENS}, "
            f"{_bool(glu)}{GLU_ACTS[act] if glu else ''}>")


def _gemv_mma_name(t: T, planar: bool, warps: int, glu: bool = False, act: str = "silu", staged: bool = True, cl: int = 1) -> str:
    """The gemv_mma instance of type t and layout, the staged or the register kernel (mma8_file);
    cl > 1: the staged kernel's instance for thread-block clusters of cl blocks (MMA8_CLUSTER)."""
    args = f"{_bool(planar)}, {warps}, {_bool(glu)}{GLU_ACTS[act] if glu else ''}"
    if cl > 1:
        args += f"{'' if glu and act != 'silu' else ', false'}, {cl}"
    return f"gemv_mma_staged<staged_{t.name[:2].lower()}_K, {args}>" if staged else f"gemv_mma<mma_{t.name[:2].lower()}_K, {args}>"


def _gemv_f_name(t: T, vec: bool, glu: bool = False, act: str = "silu") -> str:
    return f"gemv_f<{FLOAT[t][0]}, {FLOAT_GEMV[0]}, {FLOAT_GEMV[1]}, {_bool(vec)}, {_bool(glu)}{GLU_ACTS[act] if glu else ''}>"


def _dequant_name(t: T, planar: bool, out: str) -> str:
    if t in QUANT:
        return f"dequant_q<{QUANT[t].decoder}, {_bool(planar)}, {out}>"
    return f"dequant_f<{FLOAT[t][0]}, {out}>"


def _gemv_names(t: T) -> tuple[str, ...]:
    """The gemv.cu instances a matrix of type t uses (both layouts, with and without SwiGLU, and
    for CLUSTER_TYPES the default's cluster instance)."""
    if t in QUANT:
        variants = ((False, QUANT[t].gemv), (True, QUANT[t].glu))
        if t in ROW_BLOCKS_VARIANT:
            variants += ((False, ROW_BLOCKS_VARIANT[t]),)
        names = tuple(_gemv_q8_name(t, p, v, glu) for glu, v in variants for p in (False, True))
        if t in CLUSTER_TYPES:
            names += tuple(_gemv_q8_name(t, p, QUANT[t].gemv, cluster=True) for p in (False, True))
        return names
    return tuple(_gemv_f_name(t, vec, glu) for vec in (True, False) for glu in (False, True))


def _nq_names(t: T) -> tuple[str, ...]:
    """The NQ instances of type t (NQ_TYPES): nq_variants(t) in both layouts, the default's with
    clusters too for CLUSTER_TYPES; and its readers (NX): the default variant and the gate/up one
    where that runs 16 warps or fewer. Their own compile group (f"{t.name}.nq")."""
    clusters = (False, True) if t in CLUSTER_TYPES else (False,)
    names = tuple(_gemv_q8_name(t, p, QUANT[t].gemv, cluster=c, nq=True) for c in clusters for p in (False, True))
    names += tuple(_gemv_q8_name(t, p, v, nq=True) for v in nq_variants(t)[1:] for p in (False, True))
    readers = [(False, QUANT[t].gemv)] + ([(True, QUANT[t].glu)] if QUANT[t].glu[0] <= 16 else [])
    return names + tuple(_gemv_q8_name(t, p, v, glu, nx=True) for glu, v in readers for p in (False, True))


def _qkv_names(t: T) -> tuple[str, ...]:
    """The instances of QKV_VARIANT[t] (qkv_variant), both layouts, reading x (norm folded in) or,
    for NQ_TYPES, an NQ handoff (NX). Their own compile group (f"{t.name}.qkv"), built only with
    K4_QKV_WIDE on (compile_jobs qkv)."""
    readers = (False, True) if t in NQ_TYPES else (False,)
    return tuple(_gemv_q8_name(t, p, QKV_VARIANT[t], nx=nx) for nx in readers for p in (False, True))


def _am_names(t: T) -> tuple[str, ...]:
    """The output head's AM instances of quantized type t (K4_HEAD_ARGMAX): its default variant in
    both layouts, reading x itself or, where NX instances exist (16 warps or fewer), an NQ handoff.
    Their own compile group (f"{t.name}.am")."""
    readers = (False, True) if QUANT[t].gemv[0] <= 16 else (False,)
    return tuple(_gemv_q8_name(t, p, QUANT[t].gemv, nx=nx, am=True) for nx in readers for p in (False, True))


def _gelu_names(t: T) -> tuple[str, ...]:
    """The GeGLU-epilogue gemv.cu instances of type t (both layouts): their own compile group
    (f"{t.name}.gelu_tanh"), compiled only for a model whose activation is gelu_tanh."""
    if t in QUANT:
        return tuple(_gemv_q8_name(t, p, QUANT[t].glu, True, "gelu_tanh") for p in (False, True))
    return tuple(_gemv_f_name(t, vec, True, "gelu_tanh") for vec in (True, False))


def _batch_names(t: T, act: str = "silu") -> tuple[str, ...]:
    """The gemv_batch.cu instances of quantized type t (both layouts): plain and SwiGLU, or with
    act "gelu_tanh" the GeGLU ones only (compiled only for such a model, as _gelu_names)."""
    if act != "silu":
        return tuple(_gemv_batch_name(t, p, None, True, act) for p in (False, True))
    return tuple(_gemv_batch_name(t, p, None, glu) for glu in (False, True) for p in (False, True))


def _mma8_names(t: T, act: str = "silu") -> tuple[tuple[str, str], ...]:
    """(file, name) of the gemv_mma instances of type t, every MMA8_KERNELS entry, layout and warp
    count: plain and SwiGLU, or with act "gelu_tanh" the GeGLU ones only (as _batch_names)."""
    glus = (True,) if act != "silu" else (False, True)
    return tuple((mma8_file(staged), _gemv_mma_name(t, p, w, glu, act if glu else "silu", staged, cl))
                 for staged, layouts, warps in MMA8_KERNELS[t] for p in layouts for w in warps for glu in glus
                 for cl in ((1, MMA8_CLUSTER) if staged else (1,)))


def _matmul_names(t: T) -> tuple[str, ...]:
    """The matmul.cu dequantization instances of type t (both output types, both layouts)."""
    layouts = (False, True) if t in QUANT else (False,)
    return tuple(_dequant_name(t, p, out) for p in layouts for out in ("float", "u16"))


# Compile groups: one module per (file, group), so a model compiles only its types' instances.
# "bench" holds the gemv_q8 variants only microbench.bench_gemv(variant=...) uses; read_stream* are extern
# "C" (no name expressions).
GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "gemv.cu": {
        **{t.name: _gemv_names(t) for t in (*QUANT, *FLOAT)},
        **{f"{t.name}.gelu_tanh": _gelu_names(t) for t in (*QUANT, *FLOAT)},
        **{f"{t.name}.nq": _nq_names(t) for t in NQ_TYPES},
        **{f"{t.name}.am": _am_names(t) for t in QUANT},
        **{f"{t.name}.qkv": _qkv_names(t) for t in QKV_VARIANT},
        **{f"pair.{a.name}.{b.name}": _pair_names(a, b) for a, b in QKV_PAIRS},
        "bench": tuple(_gemv_q8_name(t, p, v, glu) for glu, extra in ((False, EXTRA_GEMV_VARIANTS), (True, EXTRA_GLU_VARIANTS))
                       for t, vs in extra.items() for v in vs for p in (False, True)),
    },
    "gemv_batch.cu": {  # one instance per group: each takes ~1 s to compile, so they compile in parallel
        **{name: (name,) for t in QUANT for act in GLU_ACTS for name in _batch_names(t, act)},
        "bench": tuple(_gemv_batch_name(t, p, v, glu) for t, vs in EXTRA_BATCH_VARIANTS.items() for v in vs
                       for glu in (False, True) for p in (False, True)),
    },
    **{f: {  # one instance per group, as gemv_batch.cu's
        **{name: (name,) for t in MMA8_DECODERS for act in GLU_ACTS for nf, name in _mma8_names(t, act) if nf == f},
        "bench": tuple(_gemv_mma_name(t, False, v, glu, staged=False) for t, vs in EXTRA_MMA8_WARPS.items()
                       if f == "gemv_mma.cu" for v in vs for glu in (False, True)),
    } for f in ("gemv_mma_staged.cu", "gemv_mma.cu")},
    "matmul.cu": {**{t.name: _matmul_names(t) for t in (*QUANT, *FLOAT)}, "common": ("convert_f32_f16", "add_rows")},
}
_GROUP_OF = {(f, name): names for f, groups in GROUPS.items() for names in groups.values() for name in names}


def _defines(evict_first: bool) -> tuple[str, ...]:
    return () if evict_first else ("K4_EVICT_FIRST=0",)


@cache  # a RawModule lookup per launch showed in the prefill profile (host-bound)
def _kernel(filename: str, name: str, evict_first: bool = True):
    """Kernel `name` of kernels_cu/`filename`, from the module of its compile group; evict_first:
    its weight loads carry the L1 evict-first hint (device.cuh load16, flag K4_EVICT_FIRST)."""
    group = _GROUP_OF.get((filename, name))  # None: an extern "C" kernel
    return module(filename, group, _defines(evict_first) if group else ()).get_function(name)
