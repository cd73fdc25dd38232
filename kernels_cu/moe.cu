// Mixture-of-experts kernels (qwen2moe, qwen3moe; runtime/cuda/moe.py launches them, runtime/moe.py
// is the numpy twin). Routing stays on the device, so decode never syncs with the host and is
// captured in the decode graph like any other layer:
//  - moe_topk: per token, softmax of the router logits, the k largest (ties: the lower id, as
//    the numpy reference's stable sort), their probabilities [divided by their sum: renorm]
//    into ids (k int32) and weights (k f32) in device memory (llama.cpp build_moe_ffn with
//    softmax gating, argsort_top_k then get_rows; transformers' Qwen3MoeSparseMoeBlock).
//  - moe_gemv_q / moe_gemv_f: the matrix-vector products of the selected experts on float x:
//    float expert types and the router (quantized routed experts use moe_gemv.cu's 8-bit x). The
//    stacked expert tensor (n_expert, n_out, n_in) sits on the device as in the file (raw ggml
//    blocks, expert e at e * expert_bytes); the kernel reads e = ids[slot] itself, so one launch
//    covers every (token, slot) pair: grid (row blocks, slots). Slot s reads its x at
//    x + (s / x_div) * x_stride (the token's normed input for gate and up: x_div k; its own
//    SwiGLU output for down: x_div 1) and writes y + s * n_out. Weights are decoded one ggml
//    block at a time into the warp's shared buffer (T::dequant, exact to the gguf package's
//    dequantization) and dotted with float x: no q8 rounding of x, which could change the
//    router's choice against the reference.
//  - moe_combine: y = res + sum_k w_k d_k [+ sigmoid(gate_shexp . h) * shared] per token
//    (qwen2moe's shared expert: the sigmoid gate of src/models/qwen2moe.cpp).
#include "ops_common.cuh"  // (and common.cuh: MOE_WARPS, MOE_MAX_K from runtime/cuda/constants.py)


// The block-wide maximum (value, lowest index) pair; every thread gets it. red_v/red_i: 32 each.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* red_v, int* red_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { red_v[warp] = v; red_i[warp] = i; }
    __syncthreads();
    v = lane < n_warps ? red_v[lane] : -k4ops::inf_f32();
    i = lane < n_warps ? red_i[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
}

// Grid (n_tok), any multiple of 32 threads up to 1024; dynamic shared memory n_expert floats.
extern "C" __global__ void moe_topk(const float* __restrict__ logits,  // (n_tok, n_expert)
                                    int n_expert, int k, int renorm,
                                    int* __restrict__ ids,            // (n_tok, k)
                                    float* __restrict__ weights) {    // (n_tok, k)
    extern __shared__ float prob[];
    __shared__ float red_v[32], sel_w[MOE_MAX_K];
    __shared__ int red_i[32];
    pdl_wait();
    const float* l = logits + (i64)blockIdx.x * n_expert;
    float m = -k4ops::inf_f32();
    int unused = 0;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) m = fmaxf(m, l[e]);
    block_argmax(m, unused, red_v, red_i);
    float s = 0.f;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        const float p = __expf(l[e] - m);
        prob[e] = p;
        s += p;
    }
    s = k4ops::block_sum(s);
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) prob[e] = __fdiv_rn(prob[e], s);
    __syncthreads();
    for (int j = 0; j < k; ++j) {
        float v = -k4ops::inf_f32();
        int i = 0x7fffffff;
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            if (prob[e] > v) { v = prob[e]; i = e; }  // e rises: the lowest index of a tie stays
        }
        block_argmax(v, i, red_v, red_i);
        if (threadIdx.x == 0) {
            ids[(i64)blockIdx.x * k + j] = i;
            sel_w[j] = v;
            prob[i] = -1.f;  // taken (probabilities are >= 0)
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int j = 0; j < k; ++j) total += sel_w[j];
        for (int j = 0; j < k; ++j) weights[(i64)blockIdx.x * k + j] = renorm ? __fdiv_rn(sel_w[j], total) : sel_w[j];
    }
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
                const typename T::chunk ch = T::template load<false>(we, nblk, (i64)row * nblk_row + blk, c);
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
