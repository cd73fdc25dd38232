// Matrix-vector products for decode: y[n_out] = W[n_out, n_in] @ x[n_in] (+ bias) (+ residual),
// x, y, bias, residual float32; W in its ggml encoding (raw or planar, see quant_layouts.cuh).
//
// gemv_q8 (quantized types, matmul.py QUANT): each thread block first quantizes x to 8 bits per 32
// values in shared memory (the q8_1 idea of llama.cpp's mmvq), then every warp computes whole
// rows with integer dot products (dp4a): lane l takes chunks l, l+32, ... of the row, U chunks in
// flight at a time, 16-byte loads; with PF the next U chunks (of this row or the next) are
// loaded while the current ones are multiplied, which doubles the bytes in flight. The grid
// is as many blocks (WARPS warps each) as are resident at once, at most one per row; rows go
// round-robin to warps, so x is quantized once per block, one or two blocks per
// multiprocessor. The first loads of each warp are issued before the quantization (and, launched with programmatic dependent
// launch, before waiting for the previous kernel), so they overlap it. The grid fits on the GPU
// in one wave, so letting the next kernel launch early (pdl_trigger) cannot starve this one.
// gemv_f (F32, F16, BF16): the same row-per-warp loop on float x from global memory (L1-cached).
//
// Fusions, each optional per launch:
//  - RMSNorm prologue (norm_w non-null): x is first normalized, x * rsqrt(mean(x^2) + eps) * norm_w
//    (Zhang & Sennrich 2019, as llama.cpp's rms_norm then mul), each block computing the sum of
//    squares itself while x sits in L2, so the separate norm kernel and its output vanish. Blocks
//    of at most 16 warps without a post-norm or x_q8_out do it in one pass: they quantize x * norm_w
//    and multiply each output by the norm's scale (norm_prologue.cuh quantize_x_unscaled; the
//    quants are the same up to the rounding of a unit's scale), so no block reduction stands
//    between x's loads and the row loop.
//  - SwiGLU epilogue (GLU instances): W holds 2 * n_out rows interleaved, row 2i = ffn_gate row i,
//    row 2i + 1 = ffn_up row i (runtime/cuda/matmul.py interleave_rows), one warp takes both rows
//    of a pair as one row of 2 * n_in, and writes y[i] = silu(gate_i . x) * (up_i . x); with the
//    template flag GELU (gemma's GeGLU, runtime/cuda/quant_kernels.py GLU_ACTS) gelu_tanh instead
//    of silu, as elementwise.cu geglu computes it.
//  - q8 handoff: a SwiGLU product given y_q8 also writes y quantized, in the layout the next
//    product keeps in shared memory (each block quantizes the 32-output groups it computed), and
//    the down product given that as x_q8 copies its ~15 KB (n_in 11008) instead of reading 44 KB
//    of floats and quantizing them in every block: on the H200 its 4096x11008 Q4_K product takes
//    7.9 instead of 9.2 µs, but the SwiGLU product loses as much to its group mapping, so decode
//    leaves it off by default (K4_FUSE_QUANT, docs/PERF.md). Given x_q8_out, block 0 also writes
//    its own x quantized (after the norm and post-norm prologue) for the next product of the same
//    x, a q/k/v run of another type, which then copies it instead of its prologue (K4_QKV_Q8).
//  - norm handoff (NQ and NX instances, K4_NORM_Q8): the output and down products also write the
//    next RMSNorm's input quantized, without the norm's scale, and their blocks' sums of squares;
//    the products after the norm copy it and apply the scale (see the template flags below).
//
// Thread mapping: warp w of block b starts at output b + gridDim.x * w and steps by
// gridDim.x * WARPS (with y_q8: see gemv_q8). The launcher (runtime/cuda/matmul.py) validates
// shapes and types.
#include "argmax.cuh"       // NO_INDEX, beats (AM)
#include "gemv_common.cuh"
#include "mma_common.cuh"  // k4mma::cp_async16 (NQ's norm weights)

// Quantize units u0 .. u0 + n_units - 1 of a q8 y (q8x_bytes(n_out) at y_q8) from their values
// yo[0 .. 16 n_units) in shared memory: the SwiGLU epilogue's handoff to the down product.
// Every thread of the block calls it.
__device__ __forceinline__ void quantize_outputs(const float* yo, int u0, int n_units, int n_out, int swz, u8* y_q8) {
    float* yd = reinterpret_cast<float*>(y_q8 + q8x_bytes_q(n_out));
    const float4* y4 = reinterpret_cast<const float4*>(yo);
    q8_units(n_units, u0, swz, y_q8, yd, yd + q8x_d_floats(n_out), [=](int t, int k, bool ok) {
        return ok ? y4[4 * t + k] : make_float4(0.f, 0.f, 0.f, 0.f);
    });
}

// The register cap of a gemv_q8 block of `warps` warps: what __launch_bounds__(32 warps, 1)
// implies (one block a multiprocessor), or for the q/k/v products' QKV_WARPS (runtime/cuda/
// constants.py QKV_REGS) what leaves attn_short's block, the launch after them, room beside it.
__host__ __device__ constexpr int gemv_q8_regs(int warps) {
    const int one_block = 65536 / (32 * warps) / 8 * 8;
    return warps == QKV_WARPS ? QKV_REGS : one_block < 255 ? one_block : 255;
}

// Which GLU instances can hand a q8 y on (y_q8): T::handoff (runtime/cuda/constants.py
// QuantLayout.handoff), false for the legacy 5-bit types, whose 1024-thread instances would
// spill registers for it.

// GELU (GLU only): the epilogue is gelu_tanh(gate) * up instead of silu(gate) * up.
// CLUSTER (not GLU; launched in thread-block clusters, x without norm, post-norm or x_q8): the
// blocks of a cluster quantize x together (quantize_x_cluster). Its own instances, so that the
// others keep their registers (runtime/cuda/quant_kernels.py gemv_cluster).
// NQ (not GLU; y_q8, nq_w and nq_parts non-null; n_out a multiple of 32): the residual product
// before an RMSNorm hands the next products their input (K4_NORM_Q8). Each block takes whole
// 32-output groups (as the SwiGLU handoff does), writes y as usual, and also y * nq_w quantized
// (q8_unit's scheme, without the norm's scale) into y_q8 and the sum of y^2 over its outputs into
// nq_parts[blockIdx.x]. The next product (NX), given that as x_q8 with x_parts, copies it and
// multiplies its units' scales (d and d * sum) by rsqrt(mean(y^2) + eps): the RMSNorm's scale is
// common to every unit of x, and each output is linear in those scales. Its own instances
// (quant_kernels.py NQ_TYPES).
// NX (x_q8 and x_parts non-null, no norm_w or post-norm): x_q8 is an NQ product's handoff, copied
// and scaled by copy_q8x_normed. Instances of their own too: the reader's code in every instance
// cost TinyLlama, which never runs it, 1.6% (docs/PERF.md, session 28).
// AM (not GLU, NQ or CLUSTER; no bias or residual): decode's output head also does the sampler's
// first argmax pass (sampling.cu sample_argmax_partial's, flag K4_HEAD_ARGMAX): each warp writes
// the largest of its outputs y[r] and its r (argmax.cuh beats: the lowest r on equal values) to
// am_val[i], am_idx[i], i = blockIdx.x * WARPS + warp, gridDim.x * WARPS partials for sample_finish
// (a warp without rows: -inf and NO_INDEX). A partial per block cost the block a barrier.
template <class T, bool PLANAR, int WARPS, int U, bool PF, bool GLU, bool GELU = false, bool CLUSTER = false, bool NQ = false,
          bool NX = false, bool AM = false>
__global__ void __launch_bounds__(WARPS * 32, 1) __maxnreg__(gemv_q8_regs(WARPS))
gemv_q8(const u8* __restrict__ w,          // (n_out, n_in) in T's blocks, raw or planar; GLU: (2 n_out, n_in) interleaved
        const float* __restrict__ x,       // (n_in,)
        float* y,                          // (n_out,)
        const float* residual,             // (n_out,) or null; may alias y (not with GLU)
        const float* __restrict__ bias,    // (n_out,) or null (not with GLU)
        const float* __restrict__ norm_w,  // (n_in,) or null: RMSNorm prologue
        float eps,
        int n_out, int n_in,
        const u8* __restrict__ x_q8,       // q8x_bytes(n_in) or null: x already quantized (then not read; no norm_w)
        u8* __restrict__ y_q8,             // GLU only: q8x_bytes(n_out) or null: y also quantized, for a product of swizzle y_swz
        int y_swz,
        const float* __restrict__ post_t,  // (n_in,) or null: the input is x + rmsnorm(post_t) * post_w (with norm_w; no x_q8)
        const float* __restrict__ post_w,  // (n_in,) or null
        float* x_out,                      // (n_in,) or null (with post_t): block 0 writes that input here
        u8* __restrict__ x_q8_out,         // q8x_bytes(n_in) or null (not with x_q8): block 0 also writes x's q8 here,
        int x_out_swz,                     // for a product of swizzle x_out_swz (the next q/k/v run reads it as its x_q8)
        const float* __restrict__ nq_w,    // NQ: (n_out,) the next RMSNorm's weights
        float* __restrict__ nq_parts,      // NQ: (gridDim.x,) each block's sum of y^2
        const float* __restrict__ x_parts,  // NX: (n_parts,) the nq_parts of the NQ product whose y_q8 is x_q8
        int n_parts,
        float* __restrict__ am_val,        // AM: (gridDim.x * WARPS,) each warp's largest output
        int* __restrict__ am_idx) {        // AM: (gridDim.x * WARPS,) its row
    extern __shared__ uint4 smem[];
    static_assert(!NX || ((WARPS <= 16 || WARPS == QKV_WARPS) && !CLUSTER && !NQ),
                  "NX: instances of 16 warps or fewer, or QKV_WARPS; no cluster, no NQ");
    static_assert(!AM || !(GLU || CLUSTER || NQ), "AM: a plain product");
    u8* xq = reinterpret_cast<u8*>(smem);
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_in));
    float* xs = xd + q8x_d_floats(n_in);
    const q8x<T::x_swizzle> xv{xq, xd, xs};

    const int lane = threadIdx.x & 31;
    const int n_chunks = n_in / T::chunk_elems;  // per weight row
    const int nblk_row = n_in / T::block_elems;
    const i64 nblk = (i64)(GLU ? 2 : 1) * n_out * nblk_row;
    const float* norm_part = nullptr;  // the RMSNorm folded into the outputs: quantize_x_unscaled's sums
    // first group of 32 outputs of block b, and the block's outputs in shared memory after x
    // (with y_q8); both recomputed where used: 1024-thread instances have 64 registers and no more
    auto group = [&](int b) { return (int)((i64)b * ((n_out + 31) / 32) / gridDim.x); };
    auto y_smem = [&]() { return reinterpret_cast<float*>(reinterpret_cast<u8*>(smem) + q8x_bytes(n_in)); };
    constexpr bool HANDOFF = (GLU && T::handoff) || NQ;
    static_assert(!(NQ && GLU), "NQ: a residual product");
    // Rows go round-robin over all warps; with y_q8 each block takes a run of whole 32-output
    // groups instead (balanced over the grid), so it can quantize its own outputs. That costs
    // balance: 344 groups (n_ff 11008) over 132 blocks is 3 groups on some, 2 on others.
    int row, row_end, row_step;
    if (HANDOFF && y_q8) {
        row = 32 * group(blockIdx.x) + (threadIdx.x >> 5);
        row_end = min(n_out, 32 * group(blockIdx.x + 1));
        row_step = WARPS;
    } else {
        row = blockIdx.x + gridDim.x * (threadIdx.x >> 5);
        row_end = n_out;
        row_step = gridDim.x * WARPS;
    }

    typename T::chunk ch[U];
    pdl_trigger();
    if (row < row_end) q8_load<T, PLANAR, U, GLU>(ch, w, nblk, nblk_row, n_chunks, row, lane);  // weights only: before the wait
    prefetch_l1_floats(x_q8 ? nullptr : norm_w, n_in);  // the prologue's weights too
    prefetch_l1_floats(x_q8 ? nullptr : post_w, n_in);
    if constexpr (NQ) {  // the block's norm weights into shared memory after its outputs, on their way during the loop
        const int g0 = group(blockIdx.x), n16 = 8 * (group(blockIdx.x + 1) - g0);
        if ((int)threadIdx.x < n16)
            k4mma::cp_async16(k4mma::smem_u32(y_smem() + 4 * (n16 + threadIdx.x)), nq_w + 32 * g0 + 4 * threadIdx.x, true);
        k4mma::cp_async_commit();
    }
    if constexpr (CLUSTER) cluster_arrive_relaxed();
    pdl_wait();
    if constexpr (CLUSTER) {
        quantize_x_cluster<T::x_swizzle>(x, n_in, xq, xd, xs);
    } else if constexpr (NX) {
        copy_q8x_normed(x_q8, n_in, T::x_swizzle, T::x_swizzle, x_parts, n_parts, eps, smem);
    } else if (x_q8) {
        copy_q8x(reinterpret_cast<const uint4*>(x_q8), q8x_bytes(n_in) / 16, smem);
    } else if (WARPS <= FOLD_MAX_WARPS && norm_w && !post_t && !x_q8_out) {
        // the RMSNorm's scale goes to the outputs (out_scale; q8_handoff.folds_norm). Two passes stay for
        // 32-warp instances (constants.py FOLD_MAX_WARPS) and where block 0 hands its q8 x on (K4_QKV_Q8,
        // whose readers copy x normalized: forward.py qkv). A reader of an unscaled q8 x computing the
        // scale from x cost Qwen3-30B-A3B 0.8% in every instance
        norm_part = quantize_x_unscaled<T::x_swizzle>(x, n_in, norm_w, xq, xd, xs);
    } else {
        // with post_t: its x and t * w kept in shared memory after x's q8 (the y_q8 outputs reuse it)
        quantize_x<T::x_swizzle>(x, n_in, norm_w, eps, xq, xd, xs,
                                 PostNorm{post_t, post_w, x_out, reinterpret_cast<float*>(reinterpret_cast<u8*>(smem) + q8x_bytes(n_in))});
    }
    __syncthreads();
    const float out_scale = norm_part ? folded_scale(norm_part, n_in, eps) : 1.f;  // 1: the outputs' bits unchanged
    if (x_q8_out && blockIdx.x == 0) q8x_store(xq, n_in, T::x_swizzle, x_q8_out, x_out_swz);

    auto load = [&](typename T::chunk (&dst)[U], int r, int c0) { q8_load<T, PLANAR, U, GLU>(dst, w, nblk, nblk_row, n_chunks, r, c0); };
    float am_v = -k4ops::inf_f32();  // AM: the warp's largest output so far (lane 0), in ascending rows
    int am_i = NO_INDEX;
    q8_rows<T, U, PF, GLU>(n_chunks, row, row_end, row_step, lane, ch, true, xv, load, [&](int r, float acc, float acc_up) {
        acc *= out_scale;
        acc_up *= out_scale;
        if constexpr (GLU) {
            const float v = glu_act<GELU>(acc, acc_up);
            y[r] = v;
            if (HANDOFF && y_q8) y_smem()[r - 32 * group(blockIdx.x)] = v;
        } else if constexpr (NQ) {
            if (bias) acc += bias[r];
            if (residual) acc += residual[r];
            y[r] = acc;
            y_smem()[r - 32 * group(blockIdx.x)] = acc;
        } else {
            write_row(y, residual, bias, r, acc);
            if (AM && beats(acc, r, am_v, am_i)) {
                am_v = acc;
                am_i = r;
            }
        }
    });
    if (AM && lane == 0) {  // no barrier: the warp's own partial (NO_INDEX where it had no row)
        am_val[blockIdx.x * WARPS + (threadIdx.x >> 5)] = am_v;
        am_idx[blockIdx.x * WARPS + (threadIdx.x >> 5)] = am_i;
    }
    if constexpr (NQ) {  // warp 0 hands the block's groups over, a value a lane: y * nq_w quantized, the sum of y^2
        k4mma::cp_async_wait_all();
        __syncthreads();
        if (threadIdx.x < 32) {
            const int g0 = group(blockIdx.x), n = group(blockIdx.x + 1) - g0;
            const float* yo = y_smem();
            float ss = 0.f;
            for (int j = 0; j < n; ++j) {
                const float v = yo[32 * j + lane];
                ss += v * v;
                q8_lane_store(v * yo[32 * (n + j) + lane], 32 * (g0 + j) + lane, n_out, y_swz, y_q8, lane);
            }
            ss = warp_sum(ss);
            if (lane == 0) nq_parts[blockIdx.x] = ss;
        }
    } else if (HANDOFF && y_q8) {  // quantize this block's outputs (n_out a multiple of 32)
        __syncthreads();
        const int g0 = group(blockIdx.x);
        quantize_outputs(y_smem(), 2 * g0, 2 * (group(blockIdx.x + 1) - g0), n_out, y_swz, y_q8);
    }
}

// gemv_q8_pair: two products of the same x in one launch, y1 = w1 @ x (+ bias1) and y2 = w2 @ x
// (+ bias2), w1 in T1's blocks and w2 in T2's (Q4_K_M's q|k and its Q6_K v). The grid is split by
// block: blocks 0 .. b2 - 1 take w2's rows, the others w1's (the launcher balances the bytes per
// warp, runtime/cuda/gemv_pair.py), rows round-robin over the part's warps as gemv_q8 hands them
// out. So every warp runs one type's loop (its own gemv_q8 instance's: U1, PF1 or U2, PF2) and
// issues its first row's loads before the wait, and each block quantizes x once, in its type's
// swizzle (the RMSNorm and Gemma's post-norm folded in as gemv_q8 does, in blocks of the size both
// types' gemv_q8 instances run: WARPS). Every output has the bits gemv_q8 gives it, and the second
// launch, its kernel boundary and its prologue are gone (docs/PERF.md, sessions 17 and 26; the
// rows of both types in one list over every warp, the w2 rows after each warp's w1 rows, cost a
// dependent round of loads between the two loops). Shared memory: q8x_bytes(n_in), then 8 n_in
// bytes with post_t (its x and t * w, as gemv_q8's). NX (instances of their own, as gemv_q8's):
// x is an NQ product's handoff, copied into each part's swizzle. Launched by runtime/cuda/gemv_pair.py.
template <class T, bool PLANAR, int U, bool PF, bool NX>
__device__ __forceinline__ void pair_part(const u8* __restrict__ w, const float* __restrict__ x, float* y, const float* __restrict__ bias,
                                          const float* __restrict__ norm_w, float eps, int n, int n_in, int part_block, int part_grid,
                                          const PostNorm& post, uint4* smem, const u8* __restrict__ x_q8, int x_q8_swz,
                                          const float* __restrict__ x_parts, int n_parts) {
    u8* xq = reinterpret_cast<u8*>(smem);
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_in));
    float* xs = xd + q8x_d_floats(n_in);
    const int lane = threadIdx.x & 31, step = part_grid * (int)(blockDim.x >> 5);
    const int row = part_block + part_grid * (int)(threadIdx.x >> 5);
    const int n_chunks = n_in / T::chunk_elems, nblk_row = n_in / T::block_elems;
    typename T::chunk ch[U];
    if (row < n) q8_load<T, PLANAR, U, false>(ch, w, (i64)n * nblk_row, nblk_row, n_chunks, row, lane);  // before the wait
    prefetch_l1_floats(norm_w, n_in);  // the prologue's weights too
    prefetch_l1_floats(post.w, n_in);
    pdl_wait();
    const float* norm_part = nullptr;  // as gemv_q8's: the RMSNorm's scale goes to the outputs
    if constexpr (NX) {  // an NQ product's y_q8 (gemv_q8), in its swizzle
        copy_q8x_normed(x_q8, n_in, x_q8_swz, T::x_swizzle, x_parts, n_parts, eps, smem);
    } else if (norm_w && !post.t) {
        norm_part = quantize_x_unscaled<T::x_swizzle>(x, n_in, norm_w, xq, xd, xs);
    } else {
        quantize_x<T::x_swizzle>(x, n_in, norm_w, eps, xq, xd, xs, post);
    }
    __syncthreads();
    const float out_scale = norm_part ? folded_scale(norm_part, n_in, eps) : 1.f;
    auto load = [&](typename T::chunk (&dst)[U], int r, int c0) {
        q8_load<T, PLANAR, U, false>(dst, w, (i64)n * nblk_row, nblk_row, n_chunks, r, c0);
    };
    q8_rows<T, U, PF, false>(n_chunks, row, n, step, lane, ch, true, q8x<T::x_swizzle>{xq, xd, xs}, load,
                             [&](int r, float acc, float) { write_row(y, nullptr, bias, r, acc * out_scale); });
}

template <class T1, class T2, bool PLANAR, int WARPS, int U1, bool PF1, int U2, bool PF2, bool NX = false>
__global__ void __maxnreg__(PAIR_REGS)  // constants.py PAIR_REGS: attention's blocks launch beside it
gemv_q8_pair(const u8* __restrict__ w1, const u8* __restrict__ w2,  // (n1, n_in) of T1, (n2, n_in) of T2, raw or planar
             const float* __restrict__ x,                           // (n_in,)
             float* y1, float* y2,                                  // (n1,), (n2,)
             const float* __restrict__ bias1, const float* __restrict__ bias2,  // (n1,), (n2,) or null
             const float* __restrict__ norm_w, float eps,            // (n_in,) or null: RMSNorm prologue
             int n1, int n2, int n_in,
             const float* __restrict__ post_t, const float* __restrict__ post_w, float* x_out,  // as gemv_q8's
             int b2,                                                 // blocks taking w2's rows: 1 .. gridDim.x - 1
             const u8* __restrict__ x_q8, int x_q8_swz,              // NX: an NQ product's y_q8 (no norm_w, no post)
             const float* __restrict__ x_parts, int n_parts) {       // NX: that product's nq_parts
    static_assert(32 * WARPS == PAIR_THREADS, "PAIR_REGS is the cap of a block of PAIR_THREADS");
    extern __shared__ uint4 smem[];
    const PostNorm post{post_t, post_w, x_out, reinterpret_cast<float*>(reinterpret_cast<u8*>(smem) + q8x_bytes(n_in))};
    pdl_trigger();
    if ((int)blockIdx.x < b2)  // block-uniform: the barriers inside are the whole block's
        pair_part<T2, PLANAR, U2, PF2, NX>(w2, x, y2, bias2, norm_w, eps, n2, n_in, blockIdx.x, b2, post, smem, x_q8, x_q8_swz, x_parts,
                                       n_parts);
    else
        pair_part<T1, PLANAR, U1, PF1, NX>(w1, x, y1, bias1, norm_w, eps, n1, n_in, blockIdx.x - b2, gridDim.x - b2, post, smem, x_q8,
                                       x_q8_swz, x_parts, n_parts);
}

// Sum over one weight row (n_in of T at wr) times x (global or shared memory, 16-byte aligned),
// in every lane of the warp.
template <class T, int U, bool VEC>
__device__ __forceinline__ float row_dot_f(const u8* __restrict__ wr, const float* x, int n_in, int lane) {
    float acc = 0.f;
    if (VEC) {
        const int n_chunks = n_in / T::per16;
        for (int c0 = lane; c0 < n_chunks; c0 += 32 * U) {
            uint4 v[U];
#pragma unroll
            for (int k = 0; k < U; ++k)
                if (c0 + 32 * k < n_chunks) v[k] = __ldg(reinterpret_cast<const uint4*>(wr) + c0 + 32 * k);
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int c = c0 + 32 * k;
                if (c >= n_chunks) break;
                float f[T::per16];
                T::unpack(v[k], f);
#pragma unroll
                for (int e = 0; e < T::per16; e += 4) {
                    const float4 xv = *reinterpret_cast<const float4*>(x + c * T::per16 + e);
                    acc += f[e] * xv.x + f[e + 1] * xv.y + f[e + 2] * xv.z + f[e + 3] * xv.w;
                }
            }
        }
    } else {
        for (int i = lane; i < n_in; i += 32) acc += T::get(wr, i) * x[i];
    }
    return warp_sum(acc);
}

// x (n_in,) into xn (n_in,) shared memory, normalized (x * rms_scale(x) * norm_w) when norm_w is
// non-null, with post.t non-null the post-norm's input (post_split; xn then holds 2 n_in floats)
// in place of x; returns the vector the rows multiply (x itself, or xn). Every thread must call it.
__device__ const float* normalized_x(const float* __restrict__ x, const float* __restrict__ norm_w, float eps, int n_in, float* xn,
                                     const PostNorm& post) {
    if (!norm_w) return x;
    if (post.t) {
        const float2 ps = post_split(x, n_in, eps, post);  // post.xf is xn
        post_store(post, n_in, ps.x);
        for (int i = threadIdx.x; i < n_in / 4; i += blockDim.x) {  // in place: thread i reads and writes float4 i only
            const float4 v = post_input(post, n_in, i, ps.x), g = __ldg(reinterpret_cast<const float4*>(norm_w) + i);
            reinterpret_cast<float4*>(xn)[i] = make_float4(v.x * ps.y * g.x, v.y * ps.y * g.y, v.z * ps.y * g.z, v.w * ps.y * g.w);
        }
    } else {
        const float scale = rms_scale(x, n_in, eps);
        for (int i = threadIdx.x; i < n_in; i += blockDim.x) xn[i] = __ldg(x + i) * scale * __ldg(norm_w + i);
    }
    __syncthreads();
    return xn;
}

// Dynamic shared memory: n_in floats when norm_w is non-null (2 n_in with post_t), else none.
// GELU: as gemv_q8.
template <class T, int WARPS, int U, bool VEC, bool GLU, bool GELU = false>
__global__ void __launch_bounds__(WARPS * 32)
gemv_f(const u8* __restrict__ w,           // (n_out, n_in) of T, GLU: (2 n_out, n_in) interleaved; VEC: rows 16-byte aligned
       const float* __restrict__ x,        // (n_in,), 16-byte aligned
       float* y, const float* residual, const float* __restrict__ bias,
       const float* __restrict__ norm_w, float eps, int n_out, int n_in,
       const float* __restrict__ post_t, const float* __restrict__ post_w, float* x_out) {  // as gemv_q8's (with norm_w)
    extern __shared__ float xn[];
    const int lane = threadIdx.x & 31;
    pdl_trigger();
    pdl_wait();
    const float* xv = normalized_x(x, norm_w, eps, n_in, xn, PostNorm{post_t, post_w, x_out, xn});
    const i64 row_bytes = (i64)n_in * T::elem_bytes;
    for (int row = blockIdx.x + gridDim.x * (threadIdx.x >> 5); row < n_out; row += gridDim.x * WARPS) {
        if (GLU) {
            const float g = row_dot_f<T, U, VEC>(w + 2 * row * row_bytes, xv, n_in, lane);
            const float u = row_dot_f<T, U, VEC>(w + (2 * row + 1) * row_bytes, xv, n_in, lane);
            if (lane == 0) y[row] = glu_act<GELU>(g, u);
        } else {
            const float acc = row_dot_f<T, U, VEC>(w + row * row_bytes, xv, n_in, lane);
            if (lane == 0) write_row(y, residual, bias, row, acc);
        }
    }
}

// The ceilings the products are measured against (runtime/cuda/matmul.py bench_read): read n16
// 16-byte words at p once, grid-stride with four loads in flight per thread, launched as the
// products are (one wave of 512-thread blocks, PDL). Nothing is written unless the xor of all
// words is one chosen value (so the loads cannot be dropped).
//  - read_stream waits for the previous kernel last: consecutive launches overlap freely, so it
//    measures the memory alone.
//  - read_stream_dependent waits after its first batch of loads, as a product must before it
//    reads its x (the previous kernel's output): each launch drains the memory pipeline and
//    fills it again. No product in a chain of dependent launches can beat it by more than the
//    loads it issues before its wait.
template <bool DEPENDENT>
__device__ __forceinline__ void read_once(const uint4* __restrict__ p, i64 n16, u32* out) {
    pdl_trigger();
    const i64 step = (i64)gridDim.x * blockDim.x;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 a = 0;
    bool waited = !DEPENDENT;
    for (; i + 3 * step < n16; i += 4 * step) {
        const uint4 v0 = __ldg(p + i), v1 = __ldg(p + i + step), v2 = __ldg(p + i + 2 * step), v3 = __ldg(p + i + 3 * step);
        if (!waited) {
            pdl_wait();
            waited = true;
        }
        a ^= v0.x ^ v0.y ^ v0.z ^ v0.w ^ v1.x ^ v1.y ^ v1.z ^ v1.w ^ v2.x ^ v2.y ^ v2.z ^ v2.w ^ v3.x ^ v3.y ^ v3.z ^ v3.w;
    }
    for (; i < n16; i += step) {
        const uint4 v = __ldg(p + i);
        a ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    pdl_wait();
    if (a == 0x9E3779B9u) out[0] = a;
}

extern "C" __global__ void __launch_bounds__(512, 1) read_stream(const uint4* __restrict__ p, i64 n16, u32* out) {
    read_once<false>(p, n16, out);
}

extern "C" __global__ void __launch_bounds__(512, 1) read_stream_dependent(const uint4* __restrict__ p, i64 n16, u32* out) {
    read_once<true>(p, n16, out);
}
