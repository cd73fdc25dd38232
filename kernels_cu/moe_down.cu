// Decode's down product of one token's chosen experts, their weighted sum and the residual in one
// launch (runtime/cuda/moe.py decode_fused, down_combine): what moe_gemv.cu moe_gemv_q8 and moe.cu
// moe_combine did in two. The experts stay in the file's raw blocks, so raw Q6_K's 210-byte blocks
// are read with two wide loads per 16 bytes (K4_WIDE_RAW_Q6_K, device.cuh load16).
#define K4_WIDE_RAW_Q6_K 1
#include "gemv_common.cuh"
#include "moe_route.cuh"

// Decode: y[r] = res[r] + sum_j w_j * (expert e_j's row r . x_j) over the token's k chosen experts
// (e_j, w_j: moe_route of the router logits `route`), x_j = x + j * n_in (the routed SwiGLU
// launch's output rows, quantized here to 8 bits per 32 values: k q8 x in shared memory). A warp
// takes whole rows; its lanes split into k groups of 32 / k (k divides 32), group j taking the
// chunks of expert e_j's row, lane sub of the group chunks sub, sub + 32 / k, ..., U in flight.
// Each group sums over its lanes, scales by w_j, and the groups sum (xor shuffles: another
// order than moe_combine's, within float32 rounding of it). The grid is one wave (at most the
// resident blocks), so it lets the next kernel launch at once. y may alias res.
// Dynamic shared memory: k q8x_bytes(n_in) + 4 n_expert.
template <class T, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32, 1)
moe_down_combine(const u8* __restrict__ w,        // (n_expert, n_out, n_in) in T's raw blocks
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

    constexpr int cpb = T::block_elems / T::chunk_elems;
    const int lane = threadIdx.x & 31, lps = 32 / k, j = lane / lps, sub = lane % lps;
    const int n_chunks = n_in / T::chunk_elems, nblk_row = n_in / T::block_elems;
    const i64 nblk = (i64)n_out * nblk_row;  // unused by the raw layout
    const u8* we = w + (i64)c.ids[j] * expert_bytes;
    typename T::chunk ch[U];
    auto load = [&](int r, int c0) {
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int ci = c0 + lps * i;
            if (ci < n_chunks) ch[i] = T::template load<false>(we, nblk, (i64)r * nblk_row + ci / cpb, ci % cpb);
        }
    };
    const int row_step = gridDim.x * WARPS;
    int row = blockIdx.x + gridDim.x * (threadIdx.x >> 5);
    if (row < n_out) load(row, sub);  // before x is quantized, so the loads overlap it

    // the k rows of x into k q8 x (slot j's at smem + j * xb); units 2i and 2i + 1 of a row sit in
    // adjacent lanes (n_in / 16 is even), as q8_unit needs
    const int n_units = n_in >> 4, units = k * n_units;
    for (int base = 0; base < units; base += blockDim.x) {  // warp-uniform trip count
        const int t = base + threadIdx.x;
        const bool ok = t < units;
        const int js = ok ? t / n_units : 0, u = ok ? t - js * n_units : 0;
        q8_row_unit(x + (i64)js * n_in, n_in, u, ok, T::x_swizzle, reinterpret_cast<u8*>(smem) + js * xb);
    }
    __syncthreads();
    u8* xq = reinterpret_cast<u8*>(smem) + j * xb;
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_in));
    const q8x<T::x_swizzle> xv{xq, xd, xd + q8x_d_floats(n_in)};
    const float wj = c.w[j];

    while (row < n_out) {
        float acc = 0.f;
        for (int c0 = sub;;) {
#pragma unroll
            for (int i = 0; i < U; ++i) {
                const int ci = c0 + lps * i;
                if (ci < n_chunks) acc += T::dot(ch[i], ci, xv);
            }
            c0 += lps * U;
            if (c0 >= n_chunks) break;
            load(row, c0);
        }
        for (int o = 1; o < lps; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        float v = wj * acc;
        for (int o = lps; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) y[row] = res[row] + v;
        row += row_step;
        if (row < n_out) load(row, sub);
    }
}
