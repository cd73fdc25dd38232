// Element-wise kernels: the SwiGLU gate of the llama feed-forward (Shazeer 2020), and the
// scalar store that sets decode state (the cache position) from a kernel argument, so no host
// copy is needed. Launched by runtime/cuda/ops.py (Ops.swiglu, Ops.set_i32).
#include "ops_common.cuh"

// out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + e^-x).
// gate, up, out: (n,) f32 (any row-major shape flattened); out may alias gate.
// Thread mapping: one element per thread, grid-stride.
extern "C" __global__ void swiglu_f32(const float* gate, const float* __restrict__ up, float* out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = __fdiv_rn(g, 1.0f + __expf(-g)) * up[i];
    }
}

// dst[0] = value. One thread.
extern "C" __global__ void set_i32(int* dst, int value) { *dst = value; }
