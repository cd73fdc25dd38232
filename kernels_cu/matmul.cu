// Dequantization for prefill and embeddings, and the small kernels around the cuBLAS product.
//
// Prefill computes Y[n_tok, n_out] = X[n_tok, n_in] @ W^T on tensor cores: dequant_q / dequant_f
// expand a range of W's rows to fp16 (into a scratch buffer that stays in L2), convert_f32_f16
// converts X, cuBLAS multiplies (fp16 in, fp32 accumulate and out), add_rows applies the
// epilogue. The same dequant kernels with float output and a row-id list are the embedding
// lookup (token_embd.weight rows), exact to the gguf package's numpy dequantize.
//
// Thread mapping: dequant_q, one thread per run of 16 weights (the threads of a chunk of T,
// decoders.cuh, each load the chunk and write one run, so a warp's stores are contiguous);
// dequant_f, one thread per weight; convert_f32_f16 and add_rows, one thread per element. The launcher validates everything.
#include "common.cuh"

// out[r, :] = dequantized row src(r) of W (times scale), r < n_rows, src(r) = row_ids ? row_ids[r] : row0 + r.
// scale (float out only; 1 leaves the values untouched): each value times it, one float32
// product as numpy's x * np.float32(scale) (gemma's embedding scale, reference.py). The runs a
// thread block writes are whole ggml blocks (blockDim.x a multiple of runs per block), so
// together they fill out's 16-value runs blockIdx.x * blockDim.x ...: after __syncthreads each
// thread scales one of those, whichever thread of the block decoded it.
template <class T, bool PLANAR, class OUT>
__global__ void dequant_q(const u8* __restrict__ w,       // (n_w_rows, n_in) in T's blocks
                          i64 nblk,                       // blocks in the whole tensor (planar layout)
                          int n_in,
                          const int* __restrict__ row_ids, // (n_rows,) or null
                          int row0, int n_rows,
                          OUT* __restrict__ out,           // (n_rows, n_in), float or fp16 bits
                          float scale) {
    constexpr int cpb = T::block_elems / T::chunk_elems, runs = T::chunk_elems / 16;
    const int n_runs = n_in / 16;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool ok = idx < (i64)n_rows * n_runs;
    if (ok) {
        const int r = (int)(idx / n_runs), c = (int)(idx % n_runs) / runs;
        const int src = row_ids ? row_ids[r] : row0 + r;
        const typename T::chunk ch = T::template load<PLANAR>(w, nblk, (i64)src * (n_in / T::block_elems) + c / cpb, c % cpb);
        T::dequant(ch, c, (int)(idx % runs), out + (i64)r * n_in);
    }
    if (sizeof(OUT) == 4 && scale != 1.0f) {  // uniform over the block
        __syncthreads();
        if (ok) {
            float4* p = reinterpret_cast<float4*>(out) + 4 * idx;  // run idx: values 16 idx .. 16 idx + 15
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float4 v = p[k];
                p[k] = make_float4(__fmul_rn(v.x, scale), __fmul_rn(v.y, scale), __fmul_rn(v.z, scale), __fmul_rn(v.w, scale));
            }
        }
    }
}

__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(u16* p, float v) { *p = f32_to_f16(v); }

// As dequant_q, scale included (a product by 1 is exact).
template <class T, class OUT>
__global__ void dequant_f(const u8* __restrict__ w,         // (n_w_rows, n_in) of T
                          int n_in, const int* __restrict__ row_ids, int row0, int n_rows,
                          OUT* __restrict__ out,             // (n_rows, n_in)
                          float scale) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)n_rows * n_in) return;
    const int r = (int)(idx / n_in), i = (int)(idx % n_in);
    const int src = row_ids ? row_ids[r] : row0 + r;
    put(out + idx, __fmul_rn(T::get(w + (i64)src * n_in * T::elem_bytes, i), scale));
}

extern "C" __global__ void convert_f32_f16(const float* __restrict__ x, u16* __restrict__ y, i64 n) {  // y = fp16(x), (n,)
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_f16(x[i]);
}

// Y[t, o] += residual[t, o] + bias[o]; either may be null.
extern "C" __global__ void add_rows(float* Y,                          // (n_tok, n_out)
                                    const float* __restrict__ residual, // (n_tok, n_out) or null
                                    const float* __restrict__ bias,     // (n_out,) or null
                                    int n_tok, int n_out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n_tok * n_out) return;
    float v = Y[i];
    if (residual) v += residual[i];
    if (bias) v += bias[i % n_out];
    Y[i] = v;
}

#define K4_DEQUANT_Q(T) \
    template __global__ void dequant_q<T, false, float>(const u8*, i64, int, const int*, int, int, float*, float); \
    template __global__ void dequant_q<T, true, float>(const u8*, i64, int, const int*, int, int, float*, float); \
    template __global__ void dequant_q<T, false, u16>(const u8*, i64, int, const int*, int, int, u16*, float); \
    template __global__ void dequant_q<T, true, u16>(const u8*, i64, int, const int*, int, int, u16*, float);
K4_DEQUANT_Q(type_q4_K)
K4_DEQUANT_Q(type_q5_K)
K4_DEQUANT_Q(type_q6_K)
K4_DEQUANT_Q(type_q8_0)
K4_DEQUANT_Q(type_q5_0)
K4_DEQUANT_Q(type_q5_1)
K4_DEQUANT_Q(type_q2_K)
K4_DEQUANT_Q(type_q3_K)
K4_DEQUANT_Q(type_q4_0)
K4_DEQUANT_Q(type_iq4_xs)
K4_DEQUANT_Q(type_iq4_nl)

#define K4_DEQUANT_F(T) \
    template __global__ void dequant_f<T, float>(const u8*, int, const int*, int, int, float*, float); \
    template __global__ void dequant_f<T, u16>(const u8*, int, const int*, int, int, u16*, float);
K4_DEQUANT_F(type_f32)
K4_DEQUANT_F(type_f16)
K4_DEQUANT_F(type_bf16)
