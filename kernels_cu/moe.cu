// Mixture-of-experts kernels (qwen2moe, qwen3moe; runtime/cuda/moe.py launches them, runtime/moe.py
// is the numpy twin). Routing stays on the device, so decode never syncs with the host and is
// captured in the decode graph like any other layer:
//  - moe_topk: per token, the router's choice (moe_route.cuh: softmax of the logits, the k
//    largest, their probabilities [divided by their sum: renorm]) into ids (k int32) and
//    weights (k f32) in device memory (transformers' Qwen3MoeSparseMoeBlock).
//  - moe_gemv_q / moe_gemv_f: the matrix-vector products of the selected experts on float x:
//    float expert types and the router (quantized routed experts use moe_gemv.cu's 8-bit x). The
//    stacked expert tensor (n_expert, n_out, n_in) sits on the device expert by expert, expert e
//    at e * expert_bytes, each in the file's raw ggml blocks or, where T::expert_planar, in the
//    planar layout of its own blocks (runtime/cuda/layout.py expert_layout); the kernel reads e = ids[slot] itself, so one launch
//    covers every (token, slot) pair: grid (row blocks, slots). Slot s reads its x at
//    x + (s / x_div) * x_stride (the token's normed input for gate and up: x_div k; its own
//    SwiGLU output for down: x_div 1) and writes y + s * n_out. Weights are decoded one ggml
//    block at a time into the warp's shared buffer (T::dequant, exact to the gguf package's
//    dequantization) and dotted with float x: no q8 rounding of x, which could change the
//    router's choice against the reference.
//  - moe_combine: y = res + sum_k w_k d_k [+ sigmoid(gate_shexp . h) * shared] per token
//    (qwen2moe's shared expert: the sigmoid gate of src/models/qwen2moe.cpp).
#include "ops_common.cuh"  // (and common.cuh: MOE_WARPS, MOE_MAX_K from runtime/cuda/constants.py)
#include "moe_route.cuh"


// Grid (n_tok), 32 to 1024 threads (at least k); dynamic shared memory n_expert floats.
extern "C" __global__ void moe_topk(const float* __restrict__ logits,  // (n_tok, n_expert)
                                    int n_expert, int k, int renorm,
                                    int* __restrict__ ids,            // (n_tok, k)
                                    float* __restrict__ weights) {    // (n_tok, k)
    extern __shared__ float prob[];
    pdl_wait();
    const MoeChoice c = moe_route(logits + (i64)blockIdx.x * n_expert, n_expert, k, renorm, prob);
    if (threadIdx.x < k) {
        ids[(i64)blockIdx.x * k + threadIdx.x] = c.ids[threadIdx.x];
        weights[(i64)blockIdx.x * k + threadIdx.x] = c.w[threadIdx.x];
    }
}

// Decode's router product with the RMSNorm in its prologue (runtime/cuda/moe.py decode_fused):
// y[e] = router row e . (x * rsqrt(mean(x^2) + eps) * norm_w), float32, for a float router (T
// type_f32, type_f16 or type_bf16; (n_expert, n_in) as in the file). Grid (n_expert): a block per
// expert, its threads splitting the row (8 KB of an F32 row of 2048 in one round of loads; a
// warp per row took four). One pass sums both x . x and the row's dot with x * norm_w; the norm's
// scale multiplies the dot at the end (a factor of every term: the same value up to float32
// rounding), so the block reduces once. The grid is one wave (a few hundred blocks at most), so
// it lets the next kernel launch at once. Block: ROUTER_THREADS threads (moe_route.cuh router_logit).
template <class T>
__global__ void __launch_bounds__(ROUTER_THREADS)
moe_router(const u8* __restrict__ w, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
           float* __restrict__ y, int n_in) {
    pdl_trigger();
    pdl_wait();
    const float v = router_logit<T>(w + (i64)blockIdx.x * n_in * T::elem_bytes, x, norm_w, eps, n_in);
    if (threadIdx.x == 0) y[blockIdx.x] = v;
}

// Quantized experts (T a decoders.cuh decoder, raw layout). Block MOE_WARPS warps, grid
// (row blocks, n_slots); each warp takes rows blockIdx.x * MOE_WARPS + warp, stepping by the grid.
template <class T>
__global__ void __launch_bounds__(MOE_WARPS * 32)
moe_gemv_q(const u8* __restrict__ w, i64 expert_bytes, const int* __restrict__ ids,
           const float* __restrict__ x, int x_div, i64 x_stride, float* __restrict__ y, int n_out, int n_in) {
    __shared__ __align__(16) float buf[MOE_WARPS][T::block_elems];  // T::dequant stores float4s
    constexpr int runs_per_chunk = T::chunk_elems / 16, runs = T::block_elems / 16;
    pdl_wait();
    const int slot = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u8* we = w + (i64)ids[slot] * expert_bytes;
    const float* xs = x + (i64)(slot / x_div) * x_stride;
    const int nblk_row = n_in / T::block_elems;
    const i64 nblk = (i64)n_out * nblk_row;
    float* b = buf[warp];
    for (int row = blockIdx.x * MOE_WARPS + warp; row < n_out; row += gridDim.x * MOE_WARPS) {
        float acc = 0.f;
        for (int blk = 0; blk < nblk_row; ++blk) {
            for (int r = lane; r < runs; r += 32) {
                const int c = r / runs_per_chunk;
                const typename T::chunk ch = T::template load<T::expert_planar>(we, nblk, (i64)row * nblk_row + blk, c);
                T::dequant(ch, c, r % runs_per_chunk, b);
            }
            __syncwarp();
            const float* xb = xs + (i64)blk * T::block_elems;
            for (int i = lane; i < T::block_elems; i += 32) acc += b[i] * xb[i];
            __syncwarp();
        }
        acc = warp_sum(acc);
        if (lane == 0) y[(i64)slot * n_out + row] = acc;
    }
}

// Float experts (T type_f32, type_f16 or type_bf16); launched as moe_gemv_q.
template <class T>
__global__ void __launch_bounds__(MOE_WARPS * 32)
moe_gemv_f(const u8* __restrict__ w, i64 expert_bytes, const int* __restrict__ ids,
           const float* __restrict__ x, int x_div, i64 x_stride, float* __restrict__ y, int n_out, int n_in) {
    pdl_wait();
    const int slot = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u8* we = w + (i64)ids[slot] * expert_bytes;
    const float* xs = x + (i64)(slot / x_div) * x_stride;
    for (int row = blockIdx.x * MOE_WARPS + warp; row < n_out; row += gridDim.x * MOE_WARPS) {
        const u8* wr = we + (i64)row * n_in * T::elem_bytes;
        float acc = 0.f;
        for (int i = lane; i < n_in; i += 32) acc += T::get(wr, i) * xs[i];
        acc = warp_sum(acc);
        if (lane == 0) y[(i64)slot * n_out + row] = acc;
    }
}

// y = res + sum_j weights[j] * d[j] (+ sigmoid(gate_shexp . h) * shared) per token. Grid (n_tok),
// any multiple of 32 threads up to 1024. d: (n_tok, k, n); shared, h: (n_tok, n) or null (then
// gate_shexp is not read); y may alias res.
extern "C" __global__ void moe_combine(const float* __restrict__ d, const float* __restrict__ weights, int k,
                                       const float* res, float* y, int n,
                                       const float* __restrict__ shared, const float* __restrict__ h,
                                       const float* __restrict__ gate_shexp) {
    pdl_wait();
    const i64 t = blockIdx.x;
    float g = 0.f;
    if (shared) {
        float s = 0.f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += h[t * n + i] * gate_shexp[i];
        s = k4ops::block_sum(s);
        g = 1.f / (1.f + __expf(-s));
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < k; ++j) acc += weights[t * k + j] * d[(t * k + j) * n + i];
        if (shared) acc += g * shared[t * n + i];
        y[t * n + i] = res[t * n + i] + acc;
    }
}
