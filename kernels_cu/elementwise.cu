// Element-wise kernels: the SwiGLU gate of the llama feed-forward (Shazeer 2020), and the
// scalar store that sets decode state (the cache position) from a kernel argument, so no host
// copy is needed. Launched by runtime/cuda/ops.py (Ops.swiglu, Ops.set_i32).
#include "ops_common.cuh"

__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(u16* p, float v) { *p = f32_to_f16(v); }

// out[t, i] = silu(gate[t * ld + i * step]) * up[t * ld + i * step], silu(x) = x / (1 + e^-x),
// t < n_tok, i < n_ff. gate and up point into f32 product outputs: two separate (n_tok, n_ff)
// arrays (ld = n_ff, step 1), the halves of one (n_tok, 2 n_ff) (ld = 2 n_ff, step 1, up =
// gate + n_ff), or its interleaved columns (ld = 2 n_ff, step 2, up = gate + 1).
// out: (n_tok, n_ff) contiguous, f32 or fp16 bits (OUT = u16), and may alias gate when both are
// contiguous f32. Thread mapping: one output per thread, grid-stride.
template <class OUT>
__global__ void swiglu(const float* gate, const float* up, OUT* out, int n_tok, int n_ff, int ld, int step) {
    pdl_trigger();
    pdl_wait();
    const long long n = (long long)n_tok * n_ff;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long src = (i / n_ff) * ld + (i % n_ff) * step;
        const float g = gate[src];
        put(out + i, __fdiv_rn(g, 1.0f + __expf(-g)) * up[src]);
    }
}


// dst[0] = value. One thread.
extern "C" __global__ void set_i32(int* dst, int value) { *dst = value; }
