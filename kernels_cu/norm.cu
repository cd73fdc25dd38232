// RMSNorm (Zhang & Sennrich 2019, as llama.cpp's ggml_rms_norm followed by the weight multiply):
//   y[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * w[i]
// Launched by runtime/cuda/ops.py (Ops.rms_norm). In decode the matrix-vector kernels usually
// fold this into their prologue instead (gemv.cu, flag K4_FUSE_NORM).
#include "gemv_common.cuh"  // q8_unit, q8x_bytes (and ops_common.cuh)

__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(u16* p, float v) { *p = f32_to_f16(v); }

// x: (n_rows, n) f32, row-major; y: (n_rows, n) f32 (may alias x) or fp16 bits (OUT = u16, the
// tensor-core input of prefill). w: (n,) f32.
// Thread mapping: one block per row (gridDim.x = n_rows), threads stride over the row.
template <class OUT>
__global__ void rms_norm(const float* x, const float* __restrict__ w, OUT* y, int n, float eps) {
    pdl_trigger();
    pdl_wait();
    const size_t row = (size_t)blockIdx.x * n;
    const float* xr = x + row;
    OUT* yr = y + row;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i];
        ss += v * v;
    }
    ss = k4ops::block_sum(ss);
    const float scale = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) put(yr + i, xr[i] * scale * w[i]);
}

// Gemma's post-norm and residual add in one pass: y[r, i] = res[r, i] + t[r, i] / sqrt(mean_i(t[r, :]^2)
// + eps) * w[i]. t, res, y: (n_rows, n) f32 (y may alias res); w: (n,) f32.
// Thread mapping: one block per row, threads stride over the row.
extern "C" __global__ void rms_norm_add(const float* t, const float* __restrict__ w, const float* res, float* y, int n,
                                        float eps) {
    pdl_trigger();
    pdl_wait();
    const size_t row = (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = t[row + i];
        ss += v * v;
    }
    ss = k4ops::block_sum(ss);
    const float scale = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[row + i] = res[row + i] + t[row + i] * scale * w[i];
}

// RMSNorm of a few rows that products of few tokens read quantized (runtime/cuda/forward.py, the
// speculative verify step's gemv_mma): y as rms_norm<float> (its sum of squares in another order),
// and each row of y also quantized to
// 8 bits per 32 values exactly as the products would quantize it (q8_unit), into q8 + r *
// q8x_bytes(n) with unit swizzle swz. x, y: (n_rows, n) f32 (y may alias x), n a multiple of 32,
// at most 16 * 1024; w: (n,) f32. Thread mapping: one block per row, one thread per 16-value unit
// (blockDim.x: n / 16 rounded up to a multiple of 32); the row's values stay in registers between
// the sum of squares and the stores.
extern "C" __global__ void rms_norm_q8(const float* x, const float* __restrict__ w, float* y, u8* q8, int n, float eps, int swz) {
    pdl_trigger();
    pdl_wait();
    const int u = threadIdx.x;
    const bool ok = u < n / 16;
    const size_t row = (size_t)blockIdx.x * n;
    float v[16];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 f = ok ? reinterpret_cast<const float4*>(x + row)[4 * u + k] : make_float4(0.f, 0.f, 0.f, 0.f);
        v[4 * k] = f.x; v[4 * k + 1] = f.y; v[4 * k + 2] = f.z; v[4 * k + 3] = f.w;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) ss += v[i] * v[i];
    ss = k4ops::block_sum(ss);  // its barriers: every x read before y (which may alias it) is written
    const float scale = rsqrtf(ss / (float)n + eps);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 g = ok ? __ldg(reinterpret_cast<const float4*>(w) + 4 * u + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        v[4 * k] = v[4 * k] * scale * g.x;
        v[4 * k + 1] = v[4 * k + 1] * scale * g.y;
        v[4 * k + 2] = v[4 * k + 2] * scale * g.z;
        v[4 * k + 3] = v[4 * k + 3] * scale * g.w;
        if (ok) reinterpret_cast<float4*>(y + row)[4 * u + k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
    u8* q = q8 + (size_t)blockIdx.x * q8x_bytes(n);
    float* qd = reinterpret_cast<float*>(q + q8x_bytes_q(n));
    q8_unit(v, ok, u, swz, q, qd, qd + q8x_d_floats(n));
}
