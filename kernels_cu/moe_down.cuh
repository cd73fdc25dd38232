// Decode's down product of one token's k chosen experts with their weighted sum and the residual,
// row by row (moe_down.cu moe_down_combine, moe_one.cu's down phase), and the k rows of its x
// quantized: what both kernels compute the same way, so their outputs have the same bits.
#pragma once
#include "gemv_common.cuh"

// The k rows of x (k, n_in) f32 quantized to 8 bits per 32 values: row j's q8 x at q + j * xb
// (q8x_bytes(n_in) <= xb bytes, the layout quantize_x leaves), units in swizzle swz; the bits
// q8_row_unit gives. cg: x read through L2 only (__ldcg: rows other blocks of the grid wrote in
// this launch, moe_one.cu), else through the read-only path. One thread per 16-value unit, units
// 2i and 2i + 1 in adjacent lanes (n_in / 16 is even). Every thread of the block calls it; a
// barrier publishes q.
template <bool CG>
__device__ void quantize_k_rows(const float* x, int k, int n_in, int swz, u8* q, int xb) {
    const int n_units = n_in >> 4, units = k * n_units;
    for (int base = 0; base < units; base += blockDim.x) {  // warp-uniform trip count
        const int t = base + threadIdx.x;
        const bool ok = t < units;
        const int j = ok ? t / n_units : 0, u = ok ? t - j * n_units : 0;
        const float4* p = reinterpret_cast<const float4*>(x + (i64)j * n_in + 16 * u);
        float v[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 a = !ok ? make_float4(0.f, 0.f, 0.f, 0.f) : CG ? __ldcg(p + i) : __ldg(p + i);
            v[4 * i] = a.x; v[4 * i + 1] = a.y; v[4 * i + 2] = a.z; v[4 * i + 3] = a.w;
        }
        u8* qj = q + j * xb;
        float* d = reinterpret_cast<float*>(qj + q8x_bytes_q(n_in));
        q8_unit(v, ok, u, swz, qj, d, d + q8x_d_floats(n_in));
    }
}

// One lane's share of the down rows: y[r] = res[r] + sum_j w_j * (expert e_j's row r . x_j). The
// warp's lanes split into k groups of 32 / k (k divides 32), group j taking the chunks of expert
// e_j's row (ids[j], in T's blocks at w + e_j * expert_bytes, raw or
// T::expert_planar), lane sub of the
// group chunks sub, sub + 32 / k, ..., U in flight. Each group sums over its lanes, scales by w_j,
// and the groups sum (xor shuffles).
template <class T, int U>
struct DownRows {
    const u8* we;  // the lane's expert matrix
    i64 nblk;      // blocks of one expert (read by the planar layout)
    int lps, j, sub, n_chunks, nblk_row;

    __device__ DownRows(const u8* w, i64 expert_bytes, const int* ids, int k, int n_out, int n_in, int lane)
        : nblk((i64)n_out * (n_in / T::block_elems)), lps(32 / k), j(lane / (32 / k)), sub(lane % (32 / k)),
          n_chunks(n_in / T::chunk_elems), nblk_row(n_in / T::block_elems) {
        we = w + (i64)ids[j] * expert_bytes;
    }

    // row r's U chunks of the lane from c0 on
    __device__ __forceinline__ void load(typename T::chunk (&ch)[U], int r, int c0) const {
        constexpr int cpb = T::block_elems / T::chunk_elems;
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int ci = c0 + lps * i;
            if (ci < n_chunks) ch[i] = T::template load<T::expert_planar>(we, nblk, (i64)r * nblk_row + ci / cpb, ci % cpb);
        }
    }

    // the warp's rows row, row + row_step, ... below n_out; ch holds row's first chunks (load(ch,
    // row, sub) issued by the caller); xv: x_j's q8 x; wj: w_j. res may alias y.
    __device__ __forceinline__ void rows(typename T::chunk (&ch)[U], int row, int row_step, int n_out,
                                         const q8x<T::x_swizzle>& xv, float wj, const float* res, float* y, int lane) const {
        while (row < n_out) {
            const float r_res = res[row];  // issued before the dots, not after them
            float acc = 0.f;
            for (int c0 = sub;;) {
#pragma unroll
                for (int i = 0; i < U; ++i) {
                    const int ci = c0 + lps * i;
                    if (ci < n_chunks) acc += T::dot(ch[i], ci, xv);
                }
                c0 += lps * U;
                if (c0 >= n_chunks) break;
                load(ch, row, c0);
            }
            for (int o = 1; o < lps; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            float v = wj * acc;
            for (int o = lps; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) y[row] = r_res + v;
            row += row_step;
            if (row < n_out) load(ch, row, sub);
        }
    }
};
