// RMSNorm (Zhang & Sennrich 2019, as llama.cpp's ggml_rms_norm followed by the weight multiply):
//   y[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * w[i]
// Launched by runtime/cuda/ops.py (Ops.rms_norm). In decode the matrix-vector kernels usually
// fold this into their prologue instead (gemv.cu, flag K4_FUSE_NORM).
#include "ops_common.cuh"

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
