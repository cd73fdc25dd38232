// The routed experts' matrix-vector products with 8-bit x (qwen3moe, qwen2moe; launched by
// runtime/cuda/moe.py gathered): gemv.cu's gemv_q8 indexed by expert. The stacked expert tensor
// (n_expert, n_out, n_in) sits on the device expert by expert (expert e's matrix at w + e *
// expert_bytes, in T's raw ggml blocks or, with T::expert_planar, its planar layout). Slot s (one (token, chosen expert) pair) reads e = ids[s]
// from device memory (moe.cu moe_topk wrote it), quantizes its x row x + (s / x_div) * x_stride
// to 8 bits per 32 values in shared memory (gemv_common.cuh quantize_x: llama.cpp's q8_1 idea,
// as its mmvq does for MUL_MAT_ID) and computes y + s * n_out with dp4a dot products.
//
// Thread mapping: grid (row blocks, slot blocks), WARPS warps per block. Block (bx, by) takes
// slots by, by + gridDim.y, ...; for each, warp w computes rows bx + gridDim.x * w, stepping by
// gridDim.x * WARPS, each row exactly as gemv_q8 (raw layout, no fusion) computes it: lane l
// takes chunks l, l + 32, ... of the row, U chunks in flight, with PF the next U loaded during
// the dots of the current ones; the lane sums in chunk order, then warp_sum. So a slot's y is
// bit for bit gemv_q8's y for the same matrix and x (tests/test_cuda_moe.py checks it). The
// first loads of a slot are issued before its x is quantized, so they overlap the quantization.
// The grid is not one wave in prefill (thousands of slots), so the kernel never triggers the
// next launch early; it waits for the previous kernel before reading ids.
//
// GLU instances: w_up holds the up experts (same type and shape as w's gate experts) and slot s
// writes silu(gate . x) * (up . x) (rounded as elementwise.cu swiglu rounds it): the warp takes
// the gate row's chunks then the up row's as one row of 2 n_in, as gemv_q8's GLU instance takes
// an interleaved gate/up pair, so a slot's y is bit for bit that instance's on the pair.
//
// Decode (one token, its k chosen experts as the slots; GLU instances, the others ignore both): given route (the router's logits), each
// block makes the router's choice itself (moe_route.cuh) and slot s takes the s-th chosen expert
// (ids is not read; n_slots = k); given norm_w, x is the token's residual stream and each block
// normalizes it as it quantizes it (gemv_common.cuh quantize_x, as gemv_q8's RMSNorm prologue):
// the separate RMSNorm and top-k launches vanish (runtime/cuda/moe.py decode_fused).
// moe_down.cu moe_down_combine: the down product of the k chosen experts and their weighted sum
// with the residual in one launch (what moe_combine adds), routed the same way.
//
// Dynamic shared memory: q8x_bytes(n_in) (+ 4 n_expert with route). The launcher validates types,
// shapes and alignment: n_in a multiple of T::block_elems and of 32, x rows 16-byte aligned
// (x_stride a multiple of 4).
#include "gemv_common.cuh"
#include "moe_route.cuh"

template <class T, int WARPS, int U, bool PF, bool GLU>
__global__ void __launch_bounds__(WARPS * 32, 1)
moe_gemv_q8(const u8* __restrict__ w,      // (n_expert, n_out, n_in) in T's blocks, expert by expert (GLU: the gate experts)
            const u8* __restrict__ w_up,   // GLU: the up experts, like w; else null (not read)
            i64 expert_bytes,              // bytes of one expert's matrix
            const int* __restrict__ ids,   // (n_slots,) expert of each slot
            const float* __restrict__ x,   // (n_slots / x_div rows, x_stride floats apart) of (n_in,)
            int x_div, i64 x_stride,
            float* __restrict__ y,         // (n_slots, n_out)
            int n_out, int n_in, int n_slots,
            const float* __restrict__ route,   // GLU: (n_expert,) router logits of one token, or null: see "Decode"
            int n_expert, int renorm,
            const float* __restrict__ norm_w,  // GLU: (n_in,) or null: x normalized first (RMSNorm prologue)
            float eps, int trigger) {          // trigger: the grid is one wave; let the next kernel launch now
    extern __shared__ uint4 smem[];
    u8* xq = reinterpret_cast<u8*>(smem);
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_in));
    float* xs = xd + q8x_d_floats(n_in);
    const q8x<T::x_swizzle> xv{xq, xd, xs};

    constexpr int cpb = T::block_elems / T::chunk_elems;  // chunks per block
    const int lane = threadIdx.x & 31;
    const int n_chunks = n_in / T::chunk_elems;            // per row
    const int out_chunks = (GLU ? 2 : 1) * n_chunks;       // per output (GLU: gate row, then up row)
    const int nblk_row = n_in / T::block_elems;
    const i64 nblk = (i64)n_out * nblk_row;                // blocks of one expert (read by the planar layout)
    const int row0 = blockIdx.x + gridDim.x * (threadIdx.x >> 5), row_step = gridDim.x * WARPS;

    typename T::chunk ch[U];
    if (trigger) pdl_trigger();
    pdl_wait();  // ids (or the logits) and x are the previous kernels' outputs
    float* prob = reinterpret_cast<float*>(reinterpret_cast<u8*>(smem) + q8x_bytes(n_in));
    const int* chosen = GLU && route ? moe_route(route, n_expert, n_slots, renorm, prob, false).ids : ids;  // ids only
    for (int slot = blockIdx.y; slot < n_slots; slot += gridDim.y) {
        const i64 e_off = (i64)chosen[slot] * expert_bytes;
        const u8* we = w + e_off;
        const u8* wu = GLU ? w_up + e_off : nullptr;
        auto load = [&](typename T::chunk (&dst)[U], int r, int c0) {  // GLU: chunks past n_chunks are the up row's
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int c = c0 + 32 * k;
                const bool up = GLU && c >= n_chunks;
                const int cr = up ? c - n_chunks : c;  // chunk within its row
                if (c < out_chunks) dst[k] = T::template load<T::expert_planar>(up ? wu : we, nblk, (i64)r * nblk_row + cr / cpb, cr % cpb);
            }
        };
        if (row0 < n_out) load(ch, row0, lane);
        quantize_x<T::x_swizzle>(x + (i64)(slot / x_div) * x_stride, n_in, GLU ? norm_w : nullptr, eps, xq, xd, xs);
        __syncthreads();
        float* ys = y + (i64)slot * n_out;
        q8_rows<T, U, PF, GLU>(n_chunks, row0, n_out, row_step, lane, ch, true, xv, load, [&](int r, float acc, float acc_up) {
            ys[r] = GLU ? glu_act<false>(acc, acc_up) : acc;
        });
        __syncthreads();  // every warp is done with this slot's x before the next slot's overwrites it
    }
}
