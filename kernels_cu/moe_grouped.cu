// Prefill's routed experts grouped by expert (runtime/cuda/moe_grouped.py): instead of every
// (token, chosen expert) slot reading its expert's matrix (moe_gemv.cu moe_gemv_q8: 4,096 reads of
// a 1.8 MB gate/up pair for a 512-token chunk of Qwen3-30B-A3B), the slots of one expert are
// multiplied together, NT at a time, so each expert's rows are read once per NT slots.
//
//  - moe_group: from the chosen ids (n_slots), the slots ordered by expert (order) and the work
//    items (expert, first position in order, count <= NT), every expert's items in turn; the
//    items past the last have count 0. The order within an expert follows atomics (it changes
//    from run to run), but no result depends on it: each slot's output is its own.
//  - moe_gemv_grouped: grid (row blocks, items). Block (bx, i) quantizes item i's x rows (slot s
//    reads x + (s / x_div) * x_stride, as moe_gemv_q8) to 8 bits per 32 values in shared memory,
//    then its warps walk expert e's rows with one accumulator per slot: a row's chunks go to lps
//    lanes (the power of two that leaves each at most U chunks: 4 lanes for the 12 chunks of a
//    768-weight row, so a warp takes 8 rows at once; all 32 for a 2 x 2048 gate/up pair), summed
//    over those lanes by xor shuffles, then y + s * n_out. Within float32 rounding of
//    moe_gemv_q8 (another order of the same sums). GLU: w_up holds the up experts; each output
//    takes the gate row's chunks, then the up row's, and writes silu(gate . x) * (up . x).
//
// The grid is not one wave (hundreds of items), so neither kernel lets the next launch early.
// Dynamic shared memory: moe_group 3 * n_expert ints; moe_gemv_grouped NT * q8x_bytes(n_in).
#define K4_WIDE_RAW_Q6_K 1  // decoders.cuh: the raw Q6_K experts in two wide loads per 16 bytes
#define K4_DP4A_PURE  // common.cuh dp4a without asm volatile: the x loads schedule across it
#include "gemv_common.cuh"

// Grid (1), up to 1024 threads. ids: (n_slots,) each < n_expert (moe_route's choice); items:
// (max_items,) int4 (expert, first, count, 0); order: (n_slots,). max_items >= n_slots / nt +
// n_expert (the most items any choice can need).
extern "C" __global__ void moe_group(const int* __restrict__ ids, int n_slots, int n_expert, int nt, int max_items,
                                     int4* __restrict__ items, int* __restrict__ order) {
    extern __shared__ int sh[];
    int *count = sh, *first = sh + n_expert, *item0 = sh + 2 * n_expert;
    pdl_wait();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
        const int e = ids[s];
        if ((unsigned)e < (unsigned)n_expert) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    __shared__ int used;
    if (threadIdx.x == 0) {
        int f = 0, it = 0;
        for (int e = 0; e < n_expert; ++e) {
            first[e] = f;
            item0[e] = it;
            f += count[e];
            it += (count[e] + nt - 1) / nt;
        }
        used = it;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        const int c = count[e];
        for (int j = 0, i = item0[e]; j < c; j += nt, ++i) items[i] = make_int4(e, first[e] + j, min(nt, c - j), 0);
    }
    for (int i = used + threadIdx.x; i < max_items; i += blockDim.x) items[i] = make_int4(0, 0, 0, 0);
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = 0;  // now each expert's cursor
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
        const int e = ids[s];
        if ((unsigned)e < (unsigned)n_expert) order[first[e] + atomicAdd(&count[e], 1)] = s;
    }
}

template <class T, int WARPS, int U, int NT, bool GLU>
__global__ void __launch_bounds__(WARPS * 32)
moe_gemv_grouped(const u8* __restrict__ w,      // (n_expert, n_out, n_in) in T's blocks, expert by expert (GLU: the gate experts)
                 const u8* __restrict__ w_up,   // GLU: the up experts, like w; else null
                 i64 expert_bytes,
                 const int4* __restrict__ items, const int* __restrict__ order,  // moe_group's
                 const float* __restrict__ x, int x_div, i64 x_stride,
                 float* __restrict__ y,         // (n_slots, n_out)
                 int n_out, int n_in) {
    extern __shared__ uint4 smem[];
    __shared__ int slot[NT];
    pdl_wait();
    const int4 item = items[blockIdx.y];
    const int n_tok = item.z;
    if (n_tok == 0) return;  // past the last item (the whole block)
    if (threadIdx.x < n_tok) slot[threadIdx.x] = order[item.y + threadIdx.x];
    __syncthreads();

    u8* q8 = reinterpret_cast<u8*>(smem);
    auto xv = [&](int t) {  // slot t's q8 x
        const u8* q = q8 + t * q8x_bytes(n_in);
        const float* d = reinterpret_cast<const float*>(q + q8x_bytes_q(n_in));
        return q8x<T::x_swizzle>{q, d, d + q8x_d_floats(n_in)};
    };
    constexpr int cpb = T::block_elems / T::chunk_elems;
    const int lane = threadIdx.x & 31;
    const int n_chunks = n_in / T::chunk_elems;
    const int out_chunks = (GLU ? 2 : 1) * n_chunks;
    int lps = 1;  // lanes per row: a power of two, each lane taking at most U chunks of a row where it can
    while (lps < 32 && lps * U < out_chunks) lps *= 2;
    const int sub = lane & (lps - 1), rows_per_warp = 32 / lps;
    const int nblk_row = n_in / T::block_elems;
    const i64 nblk = (i64)n_out * nblk_row;  // blocks of one expert (read by the planar layout)
    const u8* we = w + (i64)item.x * expert_bytes;
    const u8* wu = GLU ? w_up + (i64)item.x * expert_bytes : nullptr;
    const int step = gridDim.x * WARPS * rows_per_warp;
    int row0 = (blockIdx.x + gridDim.x * (threadIdx.x >> 5)) * rows_per_warp;  // the warp's first row
    const int mine = lane / lps;                                              // its lane group's row: row0 + mine

    typename T::chunk ch[U];
    auto load = [&](int row, int c0) {
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int c = c0 + lps * k;
            const bool up = GLU && c >= n_chunks;
            const int cr = up ? c - n_chunks : c;
            if (c < out_chunks && row < n_out) ch[k] = T::template load<T::expert_planar>(up ? wu : we, nblk, (i64)row * nblk_row + cr / cpb, cr % cpb);
        }
    };
    if (row0 < n_out) load(row0 + mine, sub);  // before x is quantized, so the loads overlap it

    const int n_units = n_in >> 4;
    for (int base = 0; base < n_tok * n_units; base += blockDim.x) {  // warp-uniform trip count
        const int f = base + threadIdx.x;
        const bool ok = f < n_tok * n_units;
        const int t = ok ? f / n_units : 0, u = ok ? f - t * n_units : 0;
        q8_row_unit(x + (i64)(slot[t] / x_div) * x_stride, n_in, u, ok, T::x_swizzle, q8 + t * q8x_bytes(n_in));
    }
    __syncthreads();

    for (; row0 < n_out; row0 += step) {  // warp-uniform
        const int row = row0 + mine;
        float acc[NT], acc_up[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = acc_up[t] = 0.f;
        for (int c0 = sub;;) {
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int c = c0 + lps * k;
                if (c >= out_chunks || row >= n_out) continue;
                const bool up = GLU && c >= n_chunks;
                const int cr = up ? c - n_chunks : c;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t > 0 && t >= n_tok) break;
                    const float d = T::dot(ch[k], cr, xv(t));
                    if (up) acc_up[t] += d; else acc[t] += d;
                }
            }
            c0 += lps * U;
            if (c0 >= out_chunks) break;
            load(row, c0);
        }
        if (row0 + step < n_out) load(row0 + step + mine, sub);  // the next rows' first chunks, during the sums
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t > 0 && t >= n_tok) break;
            float a = acc[t], u = acc_up[t];
            for (int o = 1; o < lps; o <<= 1) {
                a += __shfl_xor_sync(0xffffffffu, a, o);
                if (GLU) u += __shfl_xor_sync(0xffffffffu, u, o);
            }
            if (sub == 0 && row < n_out) y[(i64)slot[t] * n_out + row] = GLU ? glu_act<false>(a, u) : a;
        }
    }
}
