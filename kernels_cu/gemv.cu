// Matrix-vector products for decode: y[n_out] = W[n_out, n_in] @ x[n_in] (+ bias) (+ residual),
// x, y, bias, residual float32; W in its ggml encoding (raw or planar, see common.cuh).
//
// gemv_q8 (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0): each thread block first quantizes x to 8 bits per 32
// values in shared memory (the q8_1 idea of llama.cpp's mmvq), then every warp computes whole
// rows with integer dot products (dp4a): lane l takes chunks l, l+32, ... of the row, U chunks in
// flight at a time, 16-byte loads. The grid is as many blocks (WARPS warps each) as are resident
// at once, at most one per row; rows go round-robin to warps, so x is quantized once per block,
// one or two blocks per multiprocessor. The first loads of
// each warp are issued before the quantization (and, launched with programmatic dependent
// launch, before waiting for the previous kernel), so they overlap it. The grid fits on the GPU
// in one wave, so letting the next kernel launch early (pdl_trigger) cannot starve this one.
// gemv_f (F32, F16, BF16): the same row-per-warp loop on float x from global memory (L1-cached).
//
// Thread mapping: warp w of block b starts at row b + gridDim.x * w and steps by
// gridDim.x * WARPS. The launcher (runtime/cuda/matmul.py) validates shapes and types.
#include "common.cuh"

// y[row] = acc (+ bias[row]) (+ residual[row]); residual may alias y.
__device__ __forceinline__ void write_row(float* y, const float* residual, const float* bias, int row, float acc) {
    if (bias) acc += bias[row];
    if (residual) acc += residual[row];
    y[row] = acc;
}

// Quantize x (n_in floats, n_in a multiple of 32, 16-byte aligned) into the q8x arrays in
// shared memory. One thread per 16-value unit; the two units of a 32-group share a scale.
template <int SWZ>
__device__ void quantize_x(const float* __restrict__ x, int n_in, u8* xq, float* xd, float* xs) {
    const int n_units = n_in >> 4;
    for (int base = 0; base < n_units; base += blockDim.x) {  // warp-uniform trip count
        const int u = base + threadIdx.x;
        const bool ok = u < n_units;
        float v[16];
        float amax = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 f = ok ? __ldg(reinterpret_cast<const float4*>(x) + 4 * u + k) : make_float4(0.f, 0.f, 0.f, 0.f);
            v[4 * k] = f.x; v[4 * k + 1] = f.y; v[4 * k + 2] = f.z; v[4 * k + 3] = f.w;
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(f.x), fabsf(f.y)), fmaxf(fabsf(f.z), fabsf(f.w))));
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        const float d = amax * (1.f / 127.f);
        const float id = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;  // IEEE, as numpy rounds it
        u32 packed[4];
        int sum = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            packed[k] = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int q = __float2int_rn(v[4 * k + b] * id);
                sum += q;
                packed[k] |= (u32)(q & 0xFF) << (8 * b);
            }
        }
        if (ok) {
            *reinterpret_cast<uint4*>(xq + 16 * x_unit_slot(u, SWZ)) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            xs[u] = d * (float)sum;
            if (!(u & 1)) xd[u >> 1] = d;
        }
    }
}

// Shared memory of gemv_q8 for n_in (bytes); the launcher computes the same.
__device__ __forceinline__ int q8x_bytes_q(int n_in) { return ((n_in / 16 + 7) & ~7) * 16; }

template <class T, bool PLANAR, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32, 1)
gemv_q8(const u8* __restrict__ w,          // (n_out, n_in) in T's blocks, raw or planar
        const float* __restrict__ x,       // (n_in,)
        float* y,                          // (n_out,)
        const float* residual,             // (n_out,) or null; may alias y
        const float* __restrict__ bias,    // (n_out,) or null
        int n_out, int n_in) {
    extern __shared__ uint4 smem[];
    u8* xq = reinterpret_cast<u8*>(smem);
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_in));
    float* xs = xd + ((n_in / 32 + 3) & ~3);
    const q8x<T::x_swizzle> xv{xq, xd, xs};

    constexpr int cpb = T::block_elems / T::chunk_elems;  // chunks per block
    const int lane = threadIdx.x & 31;
    const int n_chunks = n_in / T::chunk_elems;
    const int nblk_row = n_in / T::block_elems;
    const i64 nblk = (i64)n_out * nblk_row;
    const int row_step = gridDim.x * WARPS;
    int row = blockIdx.x + gridDim.x * (threadIdx.x >> 5);

    typename T::chunk ch[U];
    auto load = [&](int r, int c0) {
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int c = c0 + 32 * k;
            if (c < n_chunks) ch[k] = T::template load<PLANAR>(w, nblk, (i64)r * nblk_row + c / cpb, c % cpb);
        }
    };
    pdl_trigger();
    if (row < n_out) load(row, lane);  // weights only: before the wait
    pdl_wait();
    quantize_x<T::x_swizzle>(x, n_in, xq, xd, xs);
    __syncthreads();

    float acc = 0.f;
    int c0 = lane;
    while (row < n_out) {
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int c = c0 + 32 * k;
            if (c < n_chunks) acc += T::dot(ch[k], c, xv);
        }
        c0 += 32 * U;
        if (c0 >= n_chunks) {  // row done
            acc = warp_sum(acc);
            if (lane == 0) write_row(y, residual, bias, row, acc);
            acc = 0.f;
            c0 = lane;
            row += row_step;
            if (row >= n_out) break;
        }
        load(row, c0);
    }
}

template <class T, int WARPS, int U, bool VEC>
__global__ void __launch_bounds__(WARPS * 32)
gemv_f(const u8* __restrict__ w,           // (n_out, n_in) of T; VEC: rows 16-byte aligned
       const float* __restrict__ x,        // (n_in,), 16-byte aligned when VEC
       float* y, const float* residual, const float* __restrict__ bias, int n_out, int n_in) {
    const int lane = threadIdx.x & 31;
    pdl_trigger();
    pdl_wait();
    for (int row = blockIdx.x + gridDim.x * (threadIdx.x >> 5); row < n_out; row += gridDim.x * WARPS) {
        const u8* wr = w + (i64)row * n_in * T::elem_bytes;
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
                        const float4 xv = __ldg(reinterpret_cast<const float4*>(x + c * T::per16 + e));
                        acc += f[e] * xv.x + f[e + 1] * xv.y + f[e + 2] * xv.z + f[e + 3] * xv.w;
                    }
                }
            }
        } else {
            for (int i = lane; i < n_in; i += 32) acc += T::get(wr, i) * __ldg(x + i);
        }
        acc = warp_sum(acc);
        if (lane == 0) write_row(y, residual, bias, row, acc);
    }
}

// The instances runtime/cuda/matmul.py launches (and nvcc compile-checks).
#define K4_GEMV_Q8(T, W, U) \
    template __global__ void gemv_q8<T, false, W, U>(const u8*, const float*, float*, const float*, const float*, int, int); \
    template __global__ void gemv_q8<T, true, W, U>(const u8*, const float*, float*, const float*, const float*, int, int);
K4_GEMV_Q8(type_q4_K, 16, 2)
K4_GEMV_Q8(type_q4_K, 32, 2)
K4_GEMV_Q8(type_q5_K, 32, 1)
K4_GEMV_Q8(type_q6_K, 32, 1)
K4_GEMV_Q8(type_q6_K, 32, 2)
K4_GEMV_Q8(type_q8_0, 32, 4)
K4_GEMV_Q8(type_q5_0, 32, 4)

#define K4_GEMV_F(T) \
    template __global__ void gemv_f<T, 8, 4, true>(const u8*, const float*, float*, const float*, const float*, int, int); \
    template __global__ void gemv_f<T, 8, 4, false>(const u8*, const float*, float*, const float*, const float*, int, int);
K4_GEMV_F(type_f32)
K4_GEMV_F(type_f16)
K4_GEMV_F(type_bf16)
