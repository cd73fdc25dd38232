// Stream-K matrix-vector products with the NQ handoff, for decode's residual products whose
// 32-output groups leave thread blocks idle (runtime/cuda/gemv_streamk.py; flag K4_STREAM_K).
//
// gemv.cu's NQ instances give each block whole 32-output groups, so that the block can quantize
// its own outputs for the next RMSNorm's products. Where the groups are fewer than the blocks
// (Qwen2.5 7B: 112 groups of 3,584 outputs on 132 multiprocessors; TinyLlama: 64 of 2,048) a
// sixth to a half of the GPU idles and the busy blocks' rows set the time (docs/PERF.md, session
// 43). Here the work is cut into (group, K-unit) items, a K-unit being SK_UNIT inputs of the
// group's 32 rows, numbered group-major, and block b of the grid takes items
// [b total / grid, (b + 1) total / grid): every block gets the same share to within one item, and
// a group is split over at most SK_SLOTS blocks (the launcher checks it). A block's run of one
// group's items is a piece: WARPS warps each multiply 32 / WARPS of the group's rows over the
// piece's inputs, as gemv_q8's row loop does (q8_rows, the same decoders and x layout: x's q8
// swizzle repeats every 1,024 inputs, so a piece starting at a unit boundary reads x through
// pointers moved by whole units), the next piece's first weights loading before the turn. A run of
// at most a group's items holds parts of two groups at most, and every piece of a group but its
// first is the first piece of its block: done early, while the group's first piece may be its
// block's second. So:
//  - a piece that is not its group's first (slot > 0 among the group's pieces) stores its partial
//    sums in part[group][slot], each warp its rows, and announces them after the block's last
//    piece (a fence and an add to count[group]: a fence between the pieces drained every warp's
//    loads);
//  - the group's first piece keeps its sums in shared memory; after its last piece the block
//    finishes those groups, a warp each: it waits until count[group] has every other piece's
//    warps (acquire; they are done by then, as a rule), adds their sums in slot order (so the
//    result does not depend on timing), and sets the count back to zero for the next launch.
// Waiting on other blocks needs every block resident at once: the grid is at most one block per
// multiprocessor slot (the launcher), as moe_one's.
// The finishing warp adds bias and residual, writes y, and writes the handoff as gemv_q8's NQ
// epilogue does: y * nq_w quantized (q8_lane_store) into y_q8, and the group's sum of y^2 into
// nq_parts[group] (the readers sum the parts in their own fixed order: gemv_common.cuh
// parts_rms_scale). The sums split differently from gemv_q8's, so y may differ from its in the
// last bits. x: floats, quantized by every block (quantize_x), or an earlier kernel's q8 x
// (x_q8). The first piece's first weight loads are issued before the programmatic-dependent-launch
// wait, as gemv_q8 does.
#include "gemv_common.cuh"

#ifndef SK_DIAG
#define SK_DIAG 0
#endif
static_assert(SK_UNIT % 1024 == 0, "a piece must start where x's q8 swizzle repeats (64 units of 16)");

// Units [ua, ub) of x (floats; ua even, so a scale's two units sit in adjacent lanes) quantized
// into the q8 x arrays in shared memory, as quantize_x does without norm. Every thread of the block calls it.
template <int SWZ>
__device__ void quantize_units(const float* __restrict__ x, int ua, int ub, u8* xq, float* xd, float* xs) {
    for (int base = ua; base < ub; base += blockDim.x) {  // block-uniform trip count
        const int u = base + threadIdx.x;
        const bool ok = u < ub;
        float v[16];
        load_unit16(x + 16 * u, ok, v);
        q8_unit(v, ok, u, SWZ, xq, xd, xs);
    }
}

template <class T, bool PLANAR, int WARPS, int U, bool PF>
__global__ void __launch_bounds__(WARPS * 32, 1)
gemv_q8_sk(const u8* __restrict__ w,           // (n_out, n_in) in T's blocks, raw or planar
           const float* __restrict__ x,        // (n_in,), or null with x_q8
           float* y,                           // (n_out,)
           const float* residual,              // (n_out,) or null; may alias y
           const float* __restrict__ bias,     // (n_out,) or null
           int n_out, int n_in,                // n_out a multiple of 32, n_in of T::block_elems
           const u8* __restrict__ x_q8,        // q8x_bytes(n_in) or null: x already quantized in T's swizzle
           u8* __restrict__ y_q8,              // q8x_bytes(n_out): the handoff, for a product of swizzle y_swz
           int y_swz,
           const float* __restrict__ nq_w,     // (n_out,) the next RMSNorm's weights
           float* __restrict__ nq_parts,       // (n_out / 32,) each group's sum of y^2
           float* part,                        // (n_out / 32, SK_SLOTS, 32) partial sums of split groups
           int* count) {                       // (n_out / 32,) zero between launches: pieces of the group done
    static_assert(32 % WARPS == 0, "a group's 32 rows spread evenly over the warps");
    extern __shared__ uint4 smem[];
    __shared__ float yo[2][32];  // the sums of pieces 0 and 1 where they are their groups' first
    u8* xq = reinterpret_cast<u8*>(smem);
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_in));
    float* xs = xd + q8x_d_floats(n_in);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int unit_chunks = SK_UNIT / T::chunk_elems;
    const int n_chunks = n_in / T::chunk_elems, nblk_row = n_in / T::block_elems;
    const i64 nblk = (i64)n_out * nblk_row;
    const int ku = (n_in + SK_UNIT - 1) / SK_UNIT;  // K-units per group
    const i64 total = (i64)(n_out >> 5) * ku, grid = gridDim.x;
    const i64 begin = blockIdx.x * total / grid, end = (blockIdx.x + 1) * total / grid;
    auto owner = [&](i64 i) { return (int)(((i + 1) * grid + total - 1) / total - 1); };  // the block whose items hold item i
    // The piece starting at item i: its group, its chunks [cb, ce) of each row; returns the item after it.
    auto piece = [&](i64 i, int& g, int& cb, int& ce) {
        g = (int)(i / ku);
        const i64 stop = min(end, (i64)(g + 1) * ku);
        cb = (int)(i - (i64)g * ku) * unit_chunks;
        ce = min(n_chunks, (int)(stop - (i64)g * ku) * unit_chunks);
        return stop;
    };

    // The block's pieces (at most two; at least one: the launcher gives no block an empty run): group,
    // chunks [cb, ce) of each of its rows, where the sums go.
    int g0, cb0, ce0, g1 = -1, cb1 = 0, ce1 = 0;
    const i64 mid = piece(begin, g0, cb0, ce0);
    const bool two = mid < end;
    if (two) piece(mid, g1, cb1, ce1);
    const int slot0 = (int)blockIdx.x - owner((i64)g0 * ku), slot1 = two ? (int)blockIdx.x - owner((i64)g1 * ku) : 0;
    float* out0 = slot0 == 0 ? yo[0] : part + ((i64)g0 * SK_SLOTS + slot0) * 32;
    float* out1 = slot1 == 0 ? yo[1] : part + ((i64)g1 * SK_SLOTS + slot1) * 32;
    constexpr int RPW = 32 / WARPS;  // a group's rows per warp: 32 g + warp + WARPS j, j < RPW

    typename T::chunk ch[U], nx[U];
    pdl_trigger();
    q8_load<T, PLANAR, U, false>(ch, w, nblk, nblk_row, ce0, 32 * g0 + warp, cb0 + lane);  // weights only: before the wait
    pdl_wait();
    if (x_q8) {
        copy_q8x(reinterpret_cast<const uint4*>(x_q8), q8x_bytes(n_in) / 16, smem);
    } else if (!(SK_DIAG & 2)) {  // only the units of x the pieces multiply: piece 1 starts its group, piece 0 ends its own
        constexpr int cu = T::chunk_elems / 16;  // units per chunk
        if (two && cu * ce1 < cu * cb0) {
            quantize_units<T::x_swizzle>(x, cu * cb1, cu * ce1, xq, xd, xs);
            quantize_units<T::x_swizzle>(x, cu * cb0, cu * ce0, xq, xd, xs);
        } else {
            quantize_units<T::x_swizzle>(x, cu * (two ? min(cb0, cb1) : cb0), cu * (two ? max(ce0, ce1) : ce0), xq, xd, xs);
        }
    }
    __syncthreads();

    // The warp's rows of both pieces in one loop (q8_rows' scheme, chunk indices absolute, so x is
    // the whole q8 x): the next U chunks, of this row, the next or the next piece's first, load
    // while the current ones are multiplied.
    const q8x<T::x_swizzle> xv{xq, xd, xs};
    int p = 0, j = 0, c = cb0 + lane;
    float acc = 0.f;
    while (true) {
        const int ce = p ? ce1 : ce0;
        int np = p, nj = j, nc = c + 32 * U;
        if (nc >= ce) {
            if (++nj == RPW) {
                nj = 0;
                ++np;
            }
            nc = (np ? cb1 : cb0) + lane;
        }
        const bool more = np == 0 || (np == 1 && two);
        if (more) {
            const int ng = np ? g1 : g0;
            q8_load<T, PLANAR, U, false>(nx, w, nblk, nblk_row, np ? ce1 : ce0, 32 * ng + warp + WARPS * nj, nc);
        }
#pragma unroll
        for (int k = 0; k < U; ++k)
            if (c + 32 * k < ce) acc += T::dot(ch[k], c + 32 * k, xv);
        if (nj != j || np != p) {  // the row is done
            acc = warp_sum(acc);
            if (lane == 0) (p ? out1 : out0)[warp + WARPS * j] = acc;
            acc = 0.f;
        }
        if (!more) break;
        p = np;
        j = nj;
        c = nc;
#pragma unroll
        for (int k = 0; k < U; ++k) ch[k] = nx[k];
    }
    const int own0 = slot0 == 0 ? g0 : -1, own1 = two && slot1 == 0 ? g1 : -1;  // finished at the end
    const int shared_g = slot0 > 0 ? g0 : -1;  // a piece not its group's first: piece 0 only
    if (shared_g >= 0 && lane == 0) {  // this warp's rows of that piece are stored: announce them, once the last piece is done
        __threadfence();
        asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(count + shared_g) : "memory");
    }
    __syncthreads();  // publishes yo
    const int g = warp == 0 ? own0 : warp == 1 ? own1 : -1;
    if (g >= 0) {  // warp p finishes the group of piece p: its other pieces are the first ones of the next blocks
        const int r = 32 * g + lane;
        const int n = owner((i64)(g + 1) * ku - 1) - owner((i64)g * ku) + 1;  // blocks holding the group
        const float nw = __ldg(nq_w + r), b = bias ? bias[r] : 0.f, rv = residual ? residual[r] : 0.f;
        float v = yo[warp][lane];
        if (n > 1) {
            const float* pg = part + (i64)g * SK_SLOTS * 32;
            if (lane == 0 && !(SK_DIAG & 1))
                while (ld_acquire(count + g) < (n - 1) * WARPS) {
                }
            __syncwarp();
            for (int s = 1; s < n; ++s) v += __ldcg(pg + 32 * s + lane);  // slot order: the same sum whoever came last
            if (lane == 0) count[g] = 0;
        }
        if (bias) v += b;
        if (residual) v += rv;
        y[r] = v;
        q8_lane_store(v * nw, r, n_out, y_swz, y_q8, lane);
        const float ss = warp_sum(v * v);
        if (lane == 0) nq_parts[g] = ss;
    }
}
