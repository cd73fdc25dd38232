// RMSNorm (Zhang & Sennrich 2019, as llama.cpp's ggml_rms_norm followed by the weight multiply):
//   y[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * w[i]
// Launched by runtime/cuda/ops.py (Ops.rms_norm).
#include "ops_common.cuh"

// x, y: (n_rows, n) f32, row-major; y may alias x. w: (n,) f32.
// Thread mapping: one block per row (gridDim.x = n_rows), threads stride over the row.
extern "C" __global__ void rms_norm_f32(const float* x, const float* __restrict__ w, float* y, int n, float eps) {
    const size_t row = (size_t)blockIdx.x * n;
    const float* xr = x + row;
    float* yr = y + row;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i];
        ss += v * v;
    }
    ss = k4ops::block_sum(ss);
    const float scale = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}
