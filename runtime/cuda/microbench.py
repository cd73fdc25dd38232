"""Microbenchmarks of single kernels on the GPU (`k4 bench --kernels`, tests/test_cuda_bench.py):
matrix-vector products (bench_gemv; of up to 8 tokens, bench_gemv_batch) against a kernel
that only streams the same bytes (bench_read), prefill products (bench_matmul) and attention
(bench_attention), all timed on the device by device_time. Inputs are random; weights are
rotated over copies that exceed the L2, so timings stream from memory as decode does. Switches not given as arguments come from `flags`
(default: the environment's, runtime/flags.py Flags()). Importable without CuPy (tests take
random_weight from here on machines without a GPU); the timing functions import it when called.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from gguf import GGMLQuantizationType as T

from k4.runtime.flags import Flags
from k4.runtime.kv_types import F16, KVTypes, quantize_q8_0
from k4.runtime.model import Tensor
from k4.runtime.trace import Trace

from .compile import module
from .quant_kernels import BATCH_TOKENS, MMA8_DECODERS
from .launch import device_limits, launch
from .layout import weight_layout
from .device_weight import DeviceWeight, WeightOptions, make_weight
from .matmul import FLOAT, QUANT, gemv, matmul, matmul_scratch_bytes, q8x_bytes
from .q8_handoff import Q8Vector, q8x_host


def random_weight(ggml_type: T, n_out: int, n_in: int, rng: np.random.Generator) -> Tensor:
    """A random (n_out, n_in) weight matrix of `ggml_type` with valid blocks (finite fp16 scales,
    sub-block scales over their fields' full ranges, random quants; runtime.synthetic.random_blocks)
    and weights of standard deviation ~1/sqrt(n_in)."""
    from k4.runtime.synthetic import random_blocks

    scale = 1.0 / math.sqrt(n_in)
    if ggml_type in QUANT:
        raw = random_blocks(ggml_type, n_out, n_in, rng, scale, full_range=True)
    else:
        f = (rng.standard_normal((n_out, n_in)) * scale).astype(np.float32)
        raw = {T.F32: f, T.F16: f.astype(np.float16), T.BF16: (f.view(np.uint32) >> 16).astype(np.uint16)}[ggml_type]
    return Tensor("random", ggml_type, (n_out, n_in), raw)


def _copies(t: Tensor, repack: bool, f: Flags, factor: float, cap: int, glu: bool = False) -> list[DeviceWeight]:
    """Enough device copies of t to exceed `factor` times the L2, so timings stream from memory;
    their options from the flags K4_PREFILL_TC, K4_PDL, K4_EVICT_FIRST, K4_MMA8, K4_MMA8_CLUSTER of `f`; glu: the rows
    count as interleaved gate/up pairs (make_weight glu)."""
    import cupy as cp

    host = weight_layout(t, repack)
    opts = WeightOptions(f.on("K4_PREFILL_TC"), f.on("K4_PDL"), f.on("K4_EVICT_FIRST"), f.on("K4_MMA8"),
                          f.on("K4_MMA8_CLUSTER"))
    return [make_weight(t, cp.asarray(host), repack, glu, opts) for _ in range(_n_copies(host.nbytes, factor, cap))]


# Buffers bench_read rotates at least: one more than the launches of read_stream (512 threads,
# one block a multiprocessor each) that fit on a multiprocessor at once (2048 threads).
READ_COPIES = 5


def _n_copies(nbytes: int, factor: float, cap: int) -> int:
    """How many buffers of nbytes exceed `factor` times the L2 (at least 2, at most cap)."""
    return max(2, min(cap, math.ceil(factor * device_limits()[1] / nbytes)))


def device_time(body, n_calls: int, iters: int, graph: bool) -> float:
    """Median device time (µs) of one of `n_calls` calls body(i), after a warm-up round.

    graph: the calls are recorded in a CUDA graph and the replays timed with CUDA events.
    Otherwise (cuBLAS cannot be captured through CuPy) they are enqueued behind memsets that
    keep the GPU busy twice as long as the host took to issue the warm-up round, so the GPU
    never waits for the host and the events time the GPU only.
    """
    import cupy as cp

    # The caller built the inputs on the default stream (H2D copies from pageable memory may
    # still be landing, memsets still running); the timing stream does not order itself after
    # that stream, so wait for the device before the first call reads them.
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        t0 = time.perf_counter()
        for i in range(n_calls):  # compile, create handles, warm up
            body(i)
        host_us = (time.perf_counter() - t0) * 1e6
        busy = None
        if graph:
            stream.begin_capture()
            for i in range(n_calls):
                body(i)
            run = stream.end_capture().launch
        else:
            def run():
                for i in range(n_calls):
                    body(i)
            busy = cp.empty(1 << 30, cp.uint8)  # one memset of it: ~250 µs
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(max(5, iters // n_calls)):
            for _ in range(0 if busy is None else math.ceil(2 * host_us / 250)):
                cp.cuda.runtime.memsetAsync(busy.data.ptr, 0, busy.nbytes, stream.ptr)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / n_calls)
    return float(np.median(times))


def _type(name: str) -> T:
    try:
        t = T[name]
    except KeyError:
        t = None
    if t not in QUANT and t not in FLOAT:
        raise ValueError(f"no CUDA kernels for type {name!r}; use one of {', '.join(x.name for x in (*QUANT, *FLOAT))}")
    return t


def bench_gemv(ggml_type: str, n_out: int, n_in: int, iters: int = 200, *, repack: bool | None = None,
               variant: tuple[int, int, int] | None = None, pdl: bool | None = None, x_q8: bool = False,
               flags: Flags | None = None) -> dict:
    """Time y = W @ x for a random (n_out, n_in) W of `ggml_type` (a ggml type name, e.g. "Q4_K").

    Launches are recorded in a CUDA graph (as decode runs them), rotating over copies of W that
    together exceed 4x the L2; warm-up first, then the median over CUDA-event timings of graph
    replays. repack: layout (default: flag K4_REPACK); variant, pdl: see matmul.gemv; x_q8: x
    comes quantized (gemv x_q8, as the down product gets it from the SwiGLU epilogue; quantized
    types). Returns {"us": µs per product, "gb_s": GB/s, "bytes": bytes read and written per
    product (x counted as q8x_bytes(n_in) with x_q8, else as n_in floats)}.
    Raises ValueError for a type without kernels, or x_q8 on a float type.
    """
    import cupy as cp

    t = _type(ggml_type)
    f = Flags() if flags is None else flags
    repack = f.on("K4_REPACK") if repack is None else repack
    rng = np.random.default_rng(0)
    weights = _copies(random_weight(t, n_out, n_in, rng), repack, f, 4.0, 64)
    x_host = rng.standard_normal(n_in, dtype=np.float32)
    x = cp.asarray(x_host)
    q8 = None
    if x_q8:
        q8 = Q8Vector.for_weight(weights[0], cp.empty(q8x_bytes(n_in), cp.uint8))
        q8.data.set(q8x_host(x_host, q8.swizzle))
    y = cp.empty(n_out, cp.float32)
    n_calls = len(weights) * math.ceil(20 / len(weights))
    us = device_time(lambda i: gemv(weights[i % len(weights)], x, y, variant=variant, pdl=pdl, x_q8=q8), n_calls, iters, graph=True)
    nbytes = weights[0].nbytes + (q8x_bytes(n_in) if x_q8 else 4 * n_in) + 4 * n_out
    return {"us": us, "gb_s": nbytes / us / 1e3, "bytes": nbytes}


def bench_gemv_batch(ggml_type: str, n_out: int, n_in: int, tokens: Sequence[int] = tuple(range(1, BATCH_TOKENS + 1)),
                     iters: int = 200, *, glu: bool = False, variant: tuple[int, ...] | None = None,
                     x_q8: bool = False, repack: bool | None = None, flags: Flags | None = None, mma8: bool = False) -> dict:
    """Time gemv_batch (runtime/cuda/gemv_batch.py) of n_tok tokens, for each n_tok in `tokens`,
    against one gemv (one token) on the same random (n_out, n_in) weight of quantized type
    `ggml_type`; with mma8, gemv_mma (runtime/cuda/gemv_mma.py, Q4_K and Q6_K) instead.
    glu: the rows are interleaved gate/up pairs (the gate/up epilogue, n_out / 2
    outputs); variant: see gemv_batch (quant_kernels.EXTRA_BATCH_VARIANTS), with mma8 gemv_mma
    ((WARPS, KS), gemv_mma.gemv_mma); x_q8: X comes
    quantized (gemv_batch x_q8, made once by quantize_rows before the timing, as bench_gemv's
    x_q8: the product's time without its producer's). Timed as bench_gemv times (CUDA graph of PDL launches over copies of W exceeding
    4x the L2, warm-up, median of CUDA-event timings). Returns {"gemv_us": µs of one gemv,
    "rows": [{"n_tok", "us": µs per launch, "ratio": us / gemv_us, "tb_s": (weight bytes + 4 *
    n_tok * (n_in + outputs)) / us in TB/s, X counted as floats even with x_q8}]}. Raises ValueError for a type without kernels or a
    float type (with mma8: a type without gemv_mma), n_tok outside 1..BATCH_TOKENS, or
    glu with an odd n_out.
    """
    import cupy as cp

    from .gemv_batch import gemv_batch, quantize_rows
    from .q8_handoff import Q8Rows
    from .gemv_mma import gemv_mma

    t = _type(ggml_type)
    if t not in QUANT:
        raise ValueError(f"gemv_batch multiplies quantized weights, not {ggml_type}")
    if mma8 and t not in MMA8_DECODERS:
        raise ValueError(f"gemv_mma multiplies {', '.join(d.name for d in MMA8_DECODERS)} weights, not {ggml_type}")
    if not tokens or any(not 1 <= n <= BATCH_TOKENS for n in tokens):
        raise ValueError(f"token counts must be 1 to {BATCH_TOKENS}, got {list(tokens)}")
    if glu and n_out % 2:
        raise ValueError(f"a gate/up weight has an even number of rows, got {n_out}")
    f = Flags() if flags is None else flags
    repack = f.on("K4_REPACK") if repack is None else repack
    rng = np.random.default_rng(0)
    weights = _copies(random_weight(t, n_out, n_in, rng), repack, f, 4.0, 64, glu)
    n_y = n_out // 2 if glu else n_out
    X = cp.asarray(rng.standard_normal((BATCH_TOKENS, n_in), dtype=np.float32))
    Y = cp.empty((BATCH_TOKENS, n_y), cp.float32)
    n_calls = len(weights) * math.ceil(20 / len(weights))

    def timed(product) -> float:
        return device_time(lambda i: product(weights[i % len(weights)]), n_calls, iters, graph=True)

    gemv_us = timed(lambda w: gemv(w, X[0], Y[0]))
    q8 = {}  # n_tok -> X[:n_tok] quantized for w's swizzle
    for n in tokens if x_q8 else ():
        q8[n] = Q8Rows(cp.zeros(Q8Rows.nbytes(n, n_in), cp.uint8), n, n_in, QUANT[t].x_swizzle)
        quantize_rows(X[:n], q8[n])
    rows = []
    for n in tokens:
        if mma8:
            us = timed(lambda w, n=n: gemv_mma(w, X[:n], Y[:n], variant=variant, x_q8=q8.get(n)))
        else:
            us = timed(lambda w, n=n: gemv_batch(w, X[:n], Y[:n], variant=variant, x_q8=q8.get(n)))
        rows.append({"n_tok": n, "us": us, "ratio": us / gemv_us, "tb_s": (weights[0].nbytes + 4 * n * (n_in + n_y)) / us / 1e6})
    return {"gemv_us": gemv_us, "rows": rows}


def bench_read(nbytes: int, iters: int = 200, dependent: bool = False) -> dict:
    """Time one streaming read of `nbytes` (rounded down to 16) of random bytes, as weights are:
    the ceiling a matrix-vector product of that many weight bytes is measured against, timed as
    bench_gemv times one (CUDA graph of PDL launches, one wave of 512-thread blocks, copies
    rotated beyond 4x the L2 and at least READ_COPIES of them, median). dependent: each launch
    waits for the previous one after its first batch of loads, as a product waits for its x
    (kernels_cu/gemv.cu read_stream_dependent), so the memory pipeline drains and refills at
    every launch; else launches overlap freely. Returns {"us": µs per read, "gb_s": GB/s}.
    """
    import cupy as cp

    n16 = nbytes // 16
    # at least READ_COPIES: free launches overlap, and two running at once on one buffer would
    # share its lines in L2 (134 MB in 2 copies read at 5.6 TB/s, past the memory's 4.8)
    n = max(READ_COPIES, _n_copies(16 * n16, 4.0, 64))
    rng = cp.random.RandomState(0)
    bufs = [rng.randint(0, 2**31, 4 * n16, dtype=cp.uint32) for _ in range(n)]
    out = cp.zeros(1, cp.uint32)
    kernel = module("gemv.cu").get_function("read_stream_dependent" if dependent else "read_stream")  # extern "C"
    grid = device_limits()[0]
    n_calls = n * math.ceil(20 / n)
    us = device_time(lambda i: launch(kernel, (grid,), (512,), (bufs[i % n], np.int64(n16), out), 0, None, None, True),
                     n_calls, iters, graph=True)
    return {"us": us, "gb_s": 16 * n16 / us / 1e3}


def bench_matmul(ggml_type: str, n_tok: int, n_out: int, n_in: int, iters: int = 50, *, tensor_cores: bool = True,
                 repack: bool | None = None, flags: Flags | None = None) -> dict:
    """Time Y = X @ W^T (prefill) for n_tok tokens and a random (n_out, n_in) W of `ggml_type`.

    tensor_cores=False times the per-token gemv path. Timed with CUDA events, not in a graph
    (CuPy refuses cuBLAS calls during capture), rotating over copies of W exceeding 2x the L2;
    median. Returns {"us": µs per product, "tflop_s":
    2*n_tok*n_out*n_in / time in TFLOP/s, "tok_s": tokens per second}.
    Raises ValueError for a type without kernels.
    """
    import cupy as cp

    t = _type(ggml_type)
    f = Flags() if flags is None else flags
    repack = f.on("K4_REPACK") if repack is None else repack
    rng = np.random.default_rng(0)
    weights = _copies(random_weight(t, n_out, n_in, rng), repack, f, 2.0, 8)
    for w in weights:
        w.prefill_tc = tensor_cores
    X = cp.asarray(rng.standard_normal((n_tok, n_in), dtype=np.float32))
    Y = cp.empty((n_tok, n_out), cp.float32)
    scratch = cp.empty(max(1, matmul_scratch_bytes(weights, n_tok)), cp.uint8)
    us = device_time(lambda i: matmul(weights[i % len(weights)], X, Y, scratch=scratch), len(weights), iters, graph=False)
    return {"us": us, "tflop_s": 2.0 * n_tok * n_out * n_in / us / 1e6, "tok_s": n_tok / us * 1e6}


def bench_attention(n_tok: int, n_ctx: int, n_head: int = 32, n_head_kv: int = 32, head_dim: int = 128,
                    iters: int = 20, *, split: bool | None = None, tiled: bool | None = None,
                    mma: bool | None = None, flags: Flags | None = None, kv: KVTypes = F16, gqa: bool | None = None) -> dict:
    """Time causal attention of n_tok queries ending at position n_ctx - 1 over a KV cache of
    types kv (f16 or q8_0 keys and values, runtime/cuda/kv_cache.py) of n_ctx positions (one
    layer): n_tok == n_ctx is prefill from position 0, n_tok == 1 is a
    decode step at depth n_ctx - 1. Random inputs; recorded in a CUDA graph, median of CUDA-event
    timings (device_time). split/tiled/mma/gqa: K4_SPLIT_ATTN/K4_TILED_ATTN/K4_MMA_ATTN/K4_GQA_MMA
    (default: the flags; mma=False with tiled=True times attn_tiled; gqa: decode of grouped
    heads on attn_gqa). Returns {"us": µs, "tflop_s": 4 *
    head_dim * n_head * (query, key) pairs / time, "gb_s": KV cache bytes read (quants and
    scales) / time}. FLOP count as FlashAttention's: causal halves the pairs.
    """
    import cupy as cp

    from .attention_launch import attention_split
    from .op_switches import OpSwitches
    from .ops import Ops

    f = Flags() if flags is None else flags
    split = f.on("K4_SPLIT_ATTN") if split is None else split
    tiled = f.on("K4_TILED_ATTN") if tiled is None else tiled
    mma = f.on("K4_MMA_ATTN") if mma is None else mma
    gqa = f.on("K4_GQA_MMA") if gqa is None else gqa
    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((n_tok, n_head, head_dim), dtype=np.float32))  # (n_tok, n_head, D)
    planes = [_plane(rng.standard_normal((n_ctx, n_head_kv, head_dim), dtype=np.float32), t) for t in (kv.k, kv.v)]
    (k_cache, k_d), (v_cache, v_d) = planes  # (n_ctx, n_head_kv, D) each; q8_0: + (n_ctx, n_head_kv, D / 32) scales
    kv_bytes = sum(a.nbytes for p in planes for a in p if a is not None)
    out = cp.empty_like(q)
    pos = cp.asarray(np.array([n_ctx - n_tok], dtype=np.int32))
    ops = Ops(Trace(), kv, replace(OpSwitches.from_flags(f), pdl=False, tiled=tiled, mma=mma, gqa=gqa))
    n_split, split_len = attention_split(n_ctx, split, *ops.decode_plan(head_dim, n_head, n_head_kv)) if n_tok == 1 else (1, n_ctx)
    part = cp.empty((n_tok, n_head, n_split, head_dim + 2), cp.float32) if n_split > 1 else None
    ticket = cp.zeros(n_tok * n_head, cp.int32) if n_split > 1 else None
    us = device_time(lambda i: ops.attention(q, k_cache, v_cache, out, pos, n_split, split_len, part, ticket,
                                             scales=(k_d, v_d)), 1, iters, graph=True)
    p0 = n_ctx - n_tok
    pairs = n_tok * p0 + n_tok * (n_tok + 1) // 2
    return {"us": us, "tflop_s": 4 * head_dim * n_head * pairs / us / 1e6, "gb_s": kv_bytes / us / 1e3}


def _plane(x: np.ndarray, cache_type: str) -> tuple:
    """A device cache plane of cache_type holding x (n_ctx, n_head_kv, D) f32: (fp16 values,
    None) or (int8 quants, fp16 scales)."""
    import cupy as cp

    if cache_type == "f16":
        return cp.asarray(x.astype(np.float16)), None
    q, d = quantize_q8_0(x)
    return cp.asarray(q), cp.asarray(d)
