// Element-wise kernels: the gated feed-forward activations (Shazeer 2020): SwiGLU of the llama
// families and GeGLU (tanh-approximated GELU) of Gemma; Gemma 2's tanh soft-cap of the logits;
// and the scalar store that sets decode state (the cache position) from a kernel argument, so no
// host copy is needed. Launched by runtime/cuda/ops.py (Ops.swiglu, Ops.swiglu_rows with act,
// Ops.softcap, Ops.set_i32).
#include "ops_common.cuh"

__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(u16* p, float v) { *p = f32_to_f16(v); }

// out[t, i] = silu(gate[t * ld + i * step]) * up[t * ld + i * step], silu(x) = x / (1 + e^-x),
// t < n_tok, i < n_ff. gate and up point into f32 product outputs: two separate (n_tok, n_ff)
// arrays (ld = n_ff, step 1), the halves of one (n_tok, 2 n_ff) (ld = 2 n_ff, step 1, up =
// gate + n_ff), or its interleaved columns (ld = 2 n_ff, step 2, up = gate + 1).
// out: (n_tok, n_ff) contiguous, f32 or fp16 bits (OUT = u16), and may alias gate when both are
// contiguous f32. Thread mapping: one output per thread, grid-stride.
struct Silu {
    static __device__ __forceinline__ float f(float g) { return __fdiv_rn(g, 1.0f + __expf(-g)); }
};

// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))): ggml's op_gelu (CUDA), transformers'
// gelu_pytorch_tanh.
struct GeluTanh {
    static __device__ __forceinline__ float f(float g) {
        return k4ops::gelu_tanh_f32(g);
    }
};

template <class ACT, class OUT>
__device__ __forceinline__ void glu(const float* gate, const float* up, OUT* out, int n_tok, int n_ff, int ld, int step) {
    pdl_trigger();
    pdl_wait();
    const long long n = (long long)n_tok * n_ff;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long src = (i / n_ff) * ld + (i % n_ff) * step;
        put(out + i, ACT::f(gate[src]) * up[src]);
    }
}

template <class OUT>
__global__ void swiglu(const float* gate, const float* up, OUT* out, int n_tok, int n_ff, int ld, int step) {
    glu<Silu>(gate, up, out, n_tok, n_ff, ld, step);
}

// out = gelu(gate) * up, laid out as swiglu's arguments.
template <class OUT>
__global__ void geglu(const float* gate, const float* up, OUT* out, int n_tok, int n_ff, int ld, int step) {
    glu<GeluTanh>(gate, up, out, n_tok, n_ff, ld, step);
}

// x[i] = cap * tanh(x[i] / cap), i < n (f32, in place): Gemma 2's final logit soft-cap, as
// llama.cpp's scale, tanh, scale. Thread mapping: one value per thread, grid-stride.
extern "C" __global__ void softcap_f32(float* x, long long n, float cap) {
    pdl_trigger();
    pdl_wait();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * k4ops::tanh_f32(x[i] / cap);
}


// dst[0] = value. One thread.
extern "C" __global__ void set_i32(int* dst, int value) { *dst = value; }
