// Decode's down product of one token's chosen experts, their weighted sum and the residual in one
// launch (runtime/cuda/moe.py decode_fused, down_combine): what moe_gemv.cu moe_gemv_q8 and moe.cu
// moe_combine did in two. Experts of a type without T::expert_planar stay in the file's raw
// blocks; raw Q6_K's 210-byte blocks (K4_PLANAR_EXPERTS=0) are read with two wide loads per 16
// bytes (K4_WIDE_RAW_Q6_K, device.cuh load16).
#define K4_WIDE_RAW_Q6_K 1
#include "gemv_common.cuh"
#include "moe_down.cuh"
#include "moe_route.cuh"

// Decode: y[r] = res[r] + sum_j w_j * (expert e_j's row r . x_j) over the token's k chosen experts
// (e_j, w_j: moe_route of the router logits `route`), x_j = x + j * n_in (the routed SwiGLU
// launch's output rows, quantized here to 8 bits per 32 values: k q8 x in shared memory). A warp
// takes whole rows, its lanes in k groups (moe_down.cuh DownRows: another order than
// moe_combine's, within float32 rounding of it). The grid is one wave (at most the resident
// blocks), so it lets the next kernel launch at once. y may alias res.
// Dynamic shared memory: k q8x_bytes(n_in) + 4 n_expert.
template <class T, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32, 1)
moe_down_combine(const u8* __restrict__ w,        // (n_expert, n_out, n_in) in T's blocks, expert by expert (raw or T::expert_planar)
                 i64 expert_bytes,
                 const float* __restrict__ route,  // (n_expert,) router logits
                 int n_expert, int k, int renorm,
                 const float* __restrict__ x,      // (k, n_in)
                 const float* res, float* y,       // (n_out,) each
                 int n_out, int n_in) {
    extern __shared__ uint4 smem[];
    const int xb = q8x_bytes(n_in);
    pdl_trigger();
    pdl_wait();
    const MoeChoice c = moe_route(route, n_expert, k, renorm, reinterpret_cast<float*>(reinterpret_cast<u8*>(smem) + k * xb));
    const int lane = threadIdx.x & 31;
    const DownRows<T, U> d(w, expert_bytes, c.ids, k, n_out, n_in, lane);
    typename T::chunk ch[U];
    const int row = blockIdx.x + gridDim.x * (threadIdx.x >> 5);
    if (row < n_out) d.load(ch, row, d.sub);  // before x is quantized, so the loads overlap it
    quantize_k_rows<false>(x, k, n_in, T::x_swizzle, reinterpret_cast<u8*>(smem), xb);
    __syncthreads();
    u8* xq = reinterpret_cast<u8*>(smem) + d.j * xb;
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_in));
    d.rows(ch, row, gridDim.x * WARPS, n_out, q8x<T::x_swizzle>{xq, xd, xd + q8x_d_floats(n_in)}, c.w[d.j], res, y, lane);
}
