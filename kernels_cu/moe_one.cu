// Decode's whole mixture-of-experts feed-forward of one token in one launch (runtime/cuda/moe_one.py,
// K4_MOE_ONE): what moe.cu moe_router, moe_gemv.cu's routed SwiGLU launch and moe_down.cu
// moe_down_combine do in three, with the same bits. Three phases, each ended by a barrier of the
// whole grid (device.cuh grid_sync) instead of a kernel boundary:
//  1. the router: block b computes the logits of experts b, b + G, ... (G blocks; moe_route.cuh
//     router_logit, moe_router's arithmetic; the rows fetched into L1 before the wait for x) into
//     `logits`, and every block normalizes and quantizes x (quantize_x, as the SwiGLU launch);
//  2. gate and up: every block copies the logits through L2, makes the router's choice
//     (moe_route.cuh), and its warps take the outputs R = b + G w, stepping by G WARPS, of the k
//     chosen experts' SwiGLU rows flattened (slot R / n_ff, row R % n_ff), each as moe_gemv_q8
//     computes it (gemv_common.cuh q8_rows: gate row then up row), into h (k, n_ff);
//  3. down: each warp loads its first row's weights before the barrier (the experts are known
//     since phase 2), then every block quantizes the k rows of h (read through L2) and its warps
//     take rows b + G w, stepping by G WARPS, as moe_down_combine does (moe_down.cuh DownRows).
// A kernel boundary costs its wait, the next grid's start and its prologue; a barrier costs one
// round of atomics through L2, and the down weights stream while the last SwiGLU rows finish.
//
// The grid must be all resident: one block per multiprocessor (the launcher's grid), none waiting
// for a later kernel. Programmatic dependent launch as the products: trigger, then wait for x.
// Dynamic shared memory: max(q8x_bytes(n_embd), k q8x_bytes(n_ff)) + 8 n_expert bytes.
#define K4_WIDE_RAW_Q6_K 1
#include "gemv_common.cuh"
#include "moe_down.cuh"
#include "moe_route.cuh"

template <class TG, class TD, int WARPS, int U, bool PF, int DU>
__global__ void __launch_bounds__(WARPS * 32, 1)
moe_one(const u8* __restrict__ router,   // (n_expert, n_embd) f32 (type_f32)
        const u8* __restrict__ w_gate,   // (n_expert, n_ff, n_embd) in TG's raw blocks
        const u8* __restrict__ w_up,     // likewise
        i64 gate_bytes,                  // bytes of one gate (or up) expert
        const u8* __restrict__ w_down,   // (n_expert, n_embd, n_ff) in TD's raw blocks
        i64 down_bytes,
        const float* x,                  // (n_embd,) the residual stream
        const float* __restrict__ norm_w, float eps,  // ffn_norm (n_embd,)
        float* logits,                   // (n_expert,) scratch
        float* h,                        // (k, n_ff) scratch: the SwiGLU rows
        float* y,                        // (n_embd,) x + the experts' weighted sum (may alias x)
        int* bar,                        // (2,) the grid barrier's ints, zero between launches
        int n_expert, int k, int renorm, int n_embd, int n_ff) {
    extern __shared__ uint4 smem[];
    u8* base = reinterpret_cast<u8*>(smem);
    const int xb = q8x_bytes(n_ff), x_area = max(q8x_bytes(n_embd), k * xb);
    float* prob = reinterpret_cast<float*>(base + x_area);
    float* lg = prob + n_expert;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = gridDim.x;
    for (int e = blockIdx.x; e < n_expert; e += G)  // the block's router rows into L1 while the product before ends
        for (int i = 32 * threadIdx.x; i < n_embd; i += 32 * blockDim.x)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(router + ((i64)e * n_embd + i) * type_f32::elem_bytes));
    pdl_trigger();
    pdl_wait();

    // 1. the router's logits, and x normalized and quantized for gate and up (it needs no logits)
    for (int e = blockIdx.x; e < n_expert; e += G) {
        const float v = router_logit<type_f32>(router + (i64)e * n_embd * type_f32::elem_bytes, x, norm_w, eps, n_embd);
        if (threadIdx.x == 0) logits[e] = v;
    }
    u8* xq = base;
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_embd));
    float* xs = xd + q8x_d_floats(n_embd);
    quantize_x<TG::x_swizzle>(x, n_embd, norm_w, eps, xq, xd, xs);
    grid_sync(bar);
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) lg[e] = __ldcg(logits + e);
    __syncthreads();
    const MoeChoice c = moe_route(lg, n_expert, k, renorm, prob);

    // 2. gate and up of the k chosen experts
    {
        constexpr int cpb = TG::block_elems / TG::chunk_elems;
        const int n_chunks = n_embd / TG::chunk_elems, nblk_row = n_embd / TG::block_elems;
        const i64 nblk = (i64)n_ff * nblk_row;  // unused by the raw layout
        auto load = [&](typename TG::chunk (&dst)[U], int R, int c0) {  // chunks past n_chunks: the up row's
            const int slot = R / n_ff, r = R - slot * n_ff;
            const i64 e_off = (i64)c.ids[slot] * gate_bytes;
#pragma unroll
            for (int i = 0; i < U; ++i) {
                const int ci = c0 + 32 * i;
                const bool up = ci >= n_chunks;
                const int cr = up ? ci - n_chunks : ci;
                if (ci < 2 * n_chunks) dst[i] = TG::template load<false>((up ? w_up : w_gate) + e_off, nblk, (i64)r * nblk_row + cr / cpb, cr % cpb);
            }
        };
        typename TG::chunk ch[U];
        q8_rows<TG, U, PF, true>(n_chunks, blockIdx.x + G * warp, k * n_ff, G * WARPS, lane, ch, false, q8x<TG::x_swizzle>{xq, xd, xs},
                                 load, [&](int R, float acc, float acc_up) { h[R] = glu_act<false>(acc, acc_up); });
    }

    // 3. down, the weighted sum and the residual
    const DownRows<TD, DU> d(w_down, down_bytes, c.ids, k, n_embd, n_ff, lane);
    typename TD::chunk dch[DU];
    const int row = blockIdx.x + G * warp;
    if (row < n_embd) d.load(dch, row, d.sub);  // the weights stream while the barrier waits
    grid_sync(bar);
    quantize_k_rows<true>(h, k, n_ff, TD::x_swizzle, base, xb);
    __syncthreads();
    u8* hq = base + d.j * xb;
    float* hd = reinterpret_cast<float*>(hq + q8x_bytes_q(n_ff));
    d.rows(dch, row, G * WARPS, n_embd, q8x<TD::x_swizzle>{hq, hd, hd + q8x_d_floats(n_ff)}, c.w[d.j], x, y, lane);
}
