// Matrix-vector products of a few tokens at once, reading the weights once: for each of n_tok
// (<= NT) rows of X, Y[t] = W @ X[t] (+ bias) (+ residual[t]), or with GLU the gate/up epilogue of
// gemv_q8 (act(gate . x) * (up . x), act silu or with GELU gelu_tanh). For speculative decoding's
// verify step and short prefills (runtime/cuda/gemv_batch.py); quantized types only.
//
// gemv_q8_batch is gemv_q8 (kernels_cu/gemv.cu) with n_tok x vectors: each block quantizes every
// row of X into shared memory exactly as gemv_q8 quantizes its one x (q8_unit, n_tok *
// q8x_bytes(n_in) bytes: 121 KB for 8 rows of 11008), then every warp walks rows with gemv_q8's
// lane/chunk assignment (lane l takes chunks l, l + 32, ... of a row, U at a time, the next U in
// flight during the dots with PF), keeping one accumulator per (row, token). Each output's lane
// sums and warp_sum are gemv_q8's, in the same order, so each token's result is bit-identical to
// gemv_q8 on that token alone.
//
// The work per weight byte is n_tok times gemv_q8's, so two things keep it from becoming bound by
// the multiprocessors instead of memory:
//  - a chunk's weights are unpacked once for all tokens: token 0's T::dot always runs first, its
//    decoding (nibble masks, scale codes: pure functions of the chunk) dominates the dots of
//    tokens 1..n_tok-1, which the compiler's value numbering then reuses (not the fp16 scale
//    conversions, an asm it repeats: 2 per token and Q4_K chunk);
//  - each warp takes R rows at once (the same chunk index of each), so the shared-memory loads
//    of one token's x units, scales and sums serve R rows: at 8 tokens gemv_q8's walk would read
//    ~20 bytes of shared memory per weight byte for Q4_K, about 1.7 TB/s of weights at the
//    H200's 128 bytes per clock per multiprocessor; R = 2 halves that. The compiler merges the R
//    rows' identical loads only because this file's dp4a is not an asm volatile (K4_DP4A_PURE,
//    common.cuh). The dp4a count itself (8 tokens: 128 per 64 Q4_K weights) stays, near the
//    integer units' rate at the memory's speed: past that, tensor cores (int8 mma with the tokens
//    as the n = 8 side) would be the next step.
// Both were checked in the PTX (nvcc 13, sm_90, Q4_K, 8 tokens, U = 1): one chunk's dots of 8
// tokens and 2 rows issue 256 dp4a, 48 shared loads (8 tokens x 6, not 96) and one set of nibble
// masks per row.
// The rows of a group past n_out load the last row again (no branch around the dots) and are not
// written. Reading X itself costs every block n_tok * 4 * n_in bytes from L2 (352 KB at 8 x
// 11008) before its main loop; with x_q8 (X quantized once by quantize_q8_rows) a block copies
// n_tok * q8x_bytes(n_in) instead (121 KB), the same bytes it would have computed.
//
// Thread mapping: warp w of block b takes row group g = b + gridDim.x * w (rows R g .. R g + R - 1)
// and steps by gridDim.x * WARPS. The launcher validates shapes, strides and alignment.
#define K4_DP4A_PURE  // common.cuh dp4a: merged x loads (see there)
#include "gemv_common.cuh"

// Quantize unit f (0 .. n_tok * n_in / 16 - 1) of rows 0 .. n_tok - 1 of x (row t at x + t *
// x_stride floats, each n_in floats, n_in a multiple of 32, 16-byte aligned): unit f % (n_in / 16)
// of row f / (n_in / 16), into the q8 x of row t at q8 + t * q8x_bytes(n_in), swizzle swz: the
// values quantize_x computes for each row alone. Every lane of the warp calls it (q8_unit); a
// row's units 2i, 2i + 1 stay in adjacent lanes when f is the thread's index in a multiple of
// 32 threads, since rows have an even number of units (f past the last unit: no store).
__device__ __forceinline__ void quantize_row_unit(const float* __restrict__ x, int x_stride, int n_tok, int n_in, int f, int swz,
                                                  u8* q8) {
    const int n_units = n_in >> 4;
    const bool ok = f < n_tok * n_units;
    const int t = ok ? f / n_units : 0, u = ok ? f - t * n_units : 0;
    q8_row_unit(x + (i64)t * x_stride, n_in, u, ok, swz, q8 + (i64)t * q8x_bytes(n_in));
}

// X (n_tok rows as above) quantized into n_tok q8 x vectors q8x_bytes(n_in) apart at q8 (shared
// memory) by the whole block, one loop over all rows' units (several rows' loads in flight).
__device__ void quantize_rows(const float* __restrict__ x, int x_stride, int n_tok, int n_in, int swz, u8* q8) {
    const int total = n_tok * (n_in >> 4);
    for (int base = 0; base < total; base += blockDim.x)  // warp-uniform trip count
        quantize_row_unit(x, x_stride, n_tok, n_in, base + threadIdx.x, swz, q8);
}

// The same n_tok q8 x vectors written to global memory at q8 (n_tok * q8x_bytes(n_in) bytes; the
// padding is not written), for gemv_q8_batch's x_q8: X quantized once instead of in every block
// of the product. One thread per 16-value unit, blocks of a multiple of 32 threads.
extern "C" __global__ void quantize_q8_rows(const float* __restrict__ x, int x_stride, int n_tok, int n_in, int swz, u8* q8) {
    pdl_trigger();
    pdl_wait();
    quantize_row_unit(x, x_stride, n_tok, n_in, blockIdx.x * blockDim.x + threadIdx.x, swz, q8);
}

// Dynamic shared memory: n_tok * q8x_bytes(n_in) bytes.
template <class T, bool PLANAR, int WARPS, int U, bool PF, int R, int NT, bool GLU, bool GELU = false>
__global__ void __launch_bounds__(WARPS * 32, 1)
gemv_q8_batch(const u8* __restrict__ w,        // (n_out, n_in) in T's blocks, raw or planar; GLU: (2 n_out, n_in) interleaved
              const float* __restrict__ x,     // (n_tok, n_in) rows x_stride floats apart, 16-byte aligned
              int x_stride,
              float* y,                        // (n_tok, n_out) rows y_stride floats apart
              int y_stride,
              const float* residual,           // (n_tok, n_out) rows r_stride apart, or null; may alias y (not with GLU)
              int r_stride,
              const float* __restrict__ bias,  // (n_out,) or null, added to every row (not with GLU)
              int n_out, int n_in, int n_tok,  // 1 <= n_tok <= NT
              const u8* __restrict__ x_q8) {   // n_tok * q8x_bytes(n_in) (quantize_q8_rows, swizzle T::x_swizzle) or null: X already quantized (then not read)
    extern __shared__ uint4 smem[];
    u8* q8 = reinterpret_cast<u8*>(smem);
    auto xv = [&](int t) {  // token t's q8 x
        const u8* q = q8 + t * q8x_bytes(n_in);
        const float* d = reinterpret_cast<const float*>(q + q8x_bytes_q(n_in));
        return q8x<T::x_swizzle>{q, d, d + q8x_d_floats(n_in)};
    };

    constexpr int cpb = T::block_elems / T::chunk_elems;  // chunks per block
    constexpr int span = GLU ? 2 : 1;                      // weight rows per output
    const int lane = threadIdx.x & 31;
    const int n_chunks = n_in / T::chunk_elems;            // per weight row
    const int out_chunks = span * n_chunks;                // per output (both rows of a GLU pair)
    const int nblk_row = n_in / T::block_elems;
    const i64 nblk = (i64)span * n_out * nblk_row;
    const int n_groups = (n_out + R - 1) / R;
    const int step = gridDim.x * WARPS;
    int g = blockIdx.x + gridDim.x * (threadIdx.x >> 5);

    typename T::chunk ch[R][U], nx[R][U];  // nx: the next U chunks of each row, in flight during the dots of ch (PF)
    auto load = [&](typename T::chunk (&dst)[R][U], int grp, int c0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const i64 row = min(R * grp + r, n_out - 1);
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int c = c0 + 32 * k;
                if (c < out_chunks) dst[r][k] = T::template load<PLANAR>(w, nblk, row * span * nblk_row + c / cpb, c % cpb);
            }
        }
    };
    pdl_trigger();
    if (g < n_groups) load(ch, g, lane);  // weights only: before the wait
    pdl_wait();
    if (x_q8) {
        copy_q8x(reinterpret_cast<const uint4*>(x_q8), n_tok * q8x_bytes(n_in) / 16, smem);
    } else {
        quantize_rows(x, x_stride, n_tok, n_in, T::x_swizzle, q8);
    }
    __syncthreads();

    float acc[R][NT], acc_up[R][NT];  // acc_up: the up rows of GLU pairs
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = acc_up[r][t] = 0.f;
    int c0 = lane;
    while (g < n_groups) {
        int next_g = g, next_c0 = c0 + 32 * U;
        if (next_c0 >= out_chunks) {
            next_g += step;
            next_c0 = lane;
        }
        if (PF && next_g < n_groups) load(nx, next_g, next_c0);
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int c = c0 + 32 * k;
            if (c < n_chunks) {
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t > 0 && t >= n_tok) break;
                    const auto xt = xv(t);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r][t] += T::dot(ch[r][k], c, xt);
                }
            } else if (GLU && c < out_chunks) {
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t > 0 && t >= n_tok) break;
                    const auto xt = xv(t);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc_up[r][t] += T::dot(ch[r][k], c - n_chunks, xt);
                }
            }
        }
        if (next_g != g) {  // the group's outputs done
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = R * g + r;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t > 0 && t >= n_tok) break;
                    const float a = warp_sum(acc[r][t]);
                    if (GLU) {
                        const float u = warp_sum(acc_up[r][t]);
                        if (lane == 0 && row < n_out) y[(i64)t * y_stride + row] = glu_act<GELU>(a, u);
                    } else if (lane == 0 && row < n_out) {
                        write_row(y + (i64)t * y_stride, residual ? residual + (i64)t * r_stride : nullptr, bias, row, a);
                    }
                    acc[r][t] = acc_up[r][t] = 0.f;
                }
            }
        }
        g = next_g;
        c0 = next_c0;
        if (g >= n_groups) break;
        if (PF) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int k = 0; k < U; ++k) ch[r][k] = nx[r][k];
        } else {
            load(ch, g, c0);
        }
    }
}
