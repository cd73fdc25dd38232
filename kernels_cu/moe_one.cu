// Decode's whole mixture-of-experts feed-forward of one token in one launch (runtime/cuda/moe_one.py,
// K4_MOE_ONE): what moe.cu moe_router, moe_gemv.cu's routed SwiGLU launch and moe_down.cu
// moe_down_combine do in three, with the same bits. Three phases, handing over through global
// memory instead of across kernel boundaries, each block waiting for exactly what it needs:
//  1. the router: block b computes the logits of experts b, b + G, ... (G blocks; moe_route.cuh
//     router_logit, moe_router's arithmetic; the rows fetched into L1 before the wait for x),
//     each written as a tagged word (the launch's 32-bit tag above the float's bits, stored and
//     polled whole, relaxed at GPU scope);
//  2. gate and up: in every block warp 0 polls the n_expert logits and makes the router's choice
//     (moe_route.cuh moe_choose_warp; the weights' division by their sum waits for phase 3) while
//     the other warps normalize and quantize x (quantize_x's bits, quantize_x_past_warp0; past
//     32 * MOE_WARP_EXPERTS experts the whole block does one, then the other, moe_route), then its
//     warps take the outputs R = b + G w, stepping by G WARPS, of the k
//     chosen experts' SwiGLU rows flattened (slot R / n_ff, row R % n_ff), each as moe_gemv_q8
//     computes it (gemv_common.cuh q8_rows: gate row then up row), into h (k, n_ff); then the
//     block announces it (*arrived += 1, red.release after a block barrier);
//  3. down: each warp loads its first row's weights (the experts are known since phase 2): with
//     EARLY or TD::expert_planar before its block's arrival goes out, else after it (raw Q6_K,
//     K4_PLANAR_EXPERTS=0: its loads shift their two words at once, so a warp stalls until they
//     arrive, which held the arrival back ~3 µs; planar Q6_K's do not),
//     thread 0 polls *arrived until every block of the launch has arrived (ld.acquire; one
//     poller a block on one word, where a flag per block polled by 132 threads of every block
//     cost 0.45 µs a layer more: docs/PERF.md session 30), every block quantizes the k rows of h
//     read through L2 (quantize_k_rows' bits) and its warps take rows b + G w, stepping by
//     G WARPS, as moe_down_combine does (moe_down.cuh DownRows).
// The logits are polled as words (1 KB a block), h behind the arrivals: polling h's 6,144 tagged
// words in every block took 6.5 MB of L2 reads a round, slower than the barrier it replaced.
//
// The tag: *count (64-bit, zero at first) counts the blocks that finished a launch; a launch reads
// it after its wait (every earlier launch complete) and tags with count / G + 1, which no word
// left by an earlier launch carries. *arrived (64-bit, zero at first) gains G a launch as count
// does, so the launch's blocks have all arrived once it reaches tag * G (no block finishes before
// every block has arrived, so count is G (tag - 1) when read). All blocks must be resident at
// once, as each waits for every other: one block per multiprocessor (the launcher's grid).
// Programmatic dependent launch as the products: trigger, then wait for x.
// Dynamic shared memory: max(q8x_bytes(n_embd), k q8x_bytes(n_ff)) + 8 n_expert bytes.
#define K4_WIDE_RAW_Q6_K 1
#include "gemv_common.cuh"
#include "moe_down.cuh"
#include "moe_route.cuh"

using u64 = unsigned long long;

__device__ __forceinline__ void st_tagged(u64* p, u32 tag, float v) {
    const u64 w = ((u64)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

// The float of *p once it carries tag (another block of the grid writes it).
__device__ __forceinline__ float ld_tagged(const u64* p, u32 tag) {
    u64 w;
    for (;;) {
        asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
        if ((u32)(w >> 32) == tag) return __uint_as_float((u32)w);
        __nanosleep(32);
    }
}

// l[i] = the float of words[lane + 32 i] once it carries tag, for lane + 32 i < n (else 0): the
// lane's N loads in flight together, polled again until all carry it.
template <int N>
__device__ __forceinline__ void poll_tagged(const u64* words, int n, u32 tag, float (&l)[N]) {
    const int lane = threadIdx.x & 31;
    u64 w[N];
    for (;;) {
        bool ready = true;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            w[i] = (u64)tag << 32;
            if (lane + 32 * i < n) asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w[i]) : "l"(words + lane + 32 * i) : "memory");
        }
#pragma unroll
        for (int i = 0; i < N; ++i) ready &= (u32)(w[i] >> 32) == tag;
        if (ready) break;
        __nanosleep(32);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) l[i] = lane + 32 * i < n ? __uint_as_float((u32)w[i]) : 0.f;
}

// quantize_x's bits with norm_w (the block's: the sum of squares in the order of its blockDim.x
// threads, gemv_common.cuh rms_scale), made by warps 1.. alone while warp 0 routes: warp 1 also
// takes warp 0's share (its partial sum, its units). Named barrier 1 over the blockDim.x - 32
// threads; blockDim.x at most 1,024.
template <int SWZ>
__device__ void quantize_x_past_warp0(const float* __restrict__ x, int n_in, const float* __restrict__ norm_w, float eps,
                                      u8* xq, float* xd, float* xs) {
    __shared__ float part[32];
    const int nt = blockDim.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int vw = warp == 1 ? 0 : warp; vw <= warp; ++vw) {  // the thread's place in the whole block
        float ss = 0.f;
        for (int i = 32 * vw + lane; i < n_in / 4; i += nt) {
            const float4 f = __ldg(x4 + i);
            ss += f.x * f.x + f.y * f.y + f.z * f.z + f.w * f.w;
        }
        ss = warp_sum(ss);
        if (lane == 0) part[vw] = ss;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(nt - 32) : "memory");
    const float scale = rsqrtf(warp_sum(lane < (nt >> 5) ? part[lane] : 0.f) / (float)n_in + eps);
    const int n_units = n_in >> 4;
    for (int vw = warp == 1 ? 0 : warp; vw <= warp; ++vw) {
        for (int base = 0; base < n_units; base += nt) {  // warp-uniform trip count
            const int u = base + 32 * vw + lane;
            const bool ok = u < n_units;
            float v[16];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float4 f = ok ? __ldg(x4 + 4 * u + q) : make_float4(0.f, 0.f, 0.f, 0.f);
                if (ok) {
                    const float4 g = __ldg(reinterpret_cast<const float4*>(norm_w) + 4 * u + q);
                    f = make_float4(f.x * scale * g.x, f.y * scale * g.y, f.z * scale * g.z, f.w * scale * g.w);
                }
                v[4 * q] = f.x; v[4 * q + 1] = f.y; v[4 * q + 2] = f.z; v[4 * q + 3] = f.w;
            }
            q8_unit(v, ok, u, SWZ, xq, xd, xs);
        }
    }
}

template <class TG, class TD, int WARPS, int U, bool PF, int DU, bool EARLY>
__global__ void __launch_bounds__(WARPS * 32, 1)
moe_one(const u8* __restrict__ router,   // (n_expert, n_embd) f32 (type_f32)
        const u8* __restrict__ w_gate,   // (n_expert, n_ff, n_embd) in TG's blocks, expert by expert
        const u8* __restrict__ w_up,     // likewise
        i64 gate_bytes,                  // bytes of one gate (or up) expert
        const u8* __restrict__ w_down,   // (n_expert, n_embd, n_ff) in TD's blocks, expert by expert
        i64 down_bytes,
        const float* x,                  // (n_embd,) the residual stream
        const float* __restrict__ norm_w, float eps,  // ffn_norm (n_embd,)
        u64* words,                      // (n_expert,) tagged logits
        u64* arrived,                    // (1,) the blocks whose SwiGLU rows are in h
        float* h,                        // (k, n_ff) the SwiGLU rows
        u64* count,                      // (1,) the blocks that finished a launch
        float* y,                        // (n_embd,) x + the experts' weighted sum (may alias x)
        int n_expert, int k, int renorm, int n_embd, int n_ff) {
    static_assert(WARPS >= 2, "warp 0 routes while the others quantize x");
    extern __shared__ uint4 smem[];
    __shared__ u32 tag_s;
    __shared__ float wsum;
    u8* base = reinterpret_cast<u8*>(smem);
    const int xb = q8x_bytes(n_ff), x_area = max(q8x_bytes(n_embd), k * xb);
    float* prob = reinterpret_cast<float*>(base + x_area);
    float* lg = prob + n_expert;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = gridDim.x;
    for (int e = blockIdx.x; e < n_expert; e += G)  // the block's router rows into L1 while the product before ends
        for (int i = 32 * threadIdx.x; i < n_embd; i += 32 * blockDim.x)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(router + ((i64)e * n_embd + i) * type_f32::elem_bytes));
    prefetch_l1_floats(norm_w, n_embd);  // ffn_norm's weights too
    pdl_trigger();
    pdl_wait();
    if (threadIdx.x == 0) {
        u64 n;
        asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(n) : "l"(count) : "memory");
        tag_s = (u32)(n / (u64)G) + 1u;
    }

    // 1. the router's logits (thread 0 tags them; the barrier after the loop publishes tag_s to the
    // block), x normalized and quantized
    for (int e = blockIdx.x; e < n_expert; e += G) {
        const float v = router_logit<type_f32>(router + (i64)e * n_embd * type_f32::elem_bytes, x, norm_w, eps, n_embd);
        if (threadIdx.x == 0) st_tagged(words + e, tag_s, v);
    }
    __syncthreads();
    const u32 tag = tag_s;
    u8* xq = base;
    float* xd = reinterpret_cast<float*>(xq + q8x_bytes_q(n_embd));
    float* xs = xd + q8x_d_floats(n_embd);
    __shared__ int ids_w[MOE_MAX_K];
    __shared__ float w_w[MOE_MAX_K];
    MoeChoice c{ids_w, w_w};  // the ids; the weights unnormalized
    if (n_expert <= 32 * MOE_WARP_EXPERTS) {  // warp 0 polls the logits and chooses while the others quantize x
        if (warp == 0)
            moe_choose_warp([&](float (&l)[MOE_WARP_EXPERTS]) { poll_tagged<MOE_WARP_EXPERTS>(words, n_expert, tag, l); }, n_expert, k,
                            ids_w, w_w);
        else
            quantize_x_past_warp0<TG::x_swizzle>(x, n_embd, norm_w, eps, xq, xd, xs);
        __syncthreads();
    } else {
        quantize_x<TG::x_swizzle>(x, n_embd, norm_w, eps, xq, xd, xs);
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) lg[e] = ld_tagged(words + e, tag);
        __syncthreads();
        c = moe_route(lg, n_expert, k, renorm, prob, false);
    }

    // 2. gate and up of the k chosen experts
    {
        constexpr int cpb = TG::block_elems / TG::chunk_elems;
        const int n_chunks = n_embd / TG::chunk_elems, nblk_row = n_embd / TG::block_elems;
        const i64 nblk = (i64)n_ff * nblk_row;  // blocks of one expert (read by the planar layout)
        auto load = [&](typename TG::chunk (&dst)[U], int R, int c0) {  // chunks past n_chunks: the up row's
            const int slot = R / n_ff, r = R - slot * n_ff;
            const i64 e_off = (i64)c.ids[slot] * gate_bytes;
#pragma unroll
            for (int i = 0; i < U; ++i) {
                const int ci = c0 + 32 * i;
                const bool up = ci >= n_chunks;
                const int cr = up ? ci - n_chunks : ci;
                if (ci < 2 * n_chunks) dst[i] = TG::template load<TG::expert_planar>((up ? w_up : w_gate) + e_off, nblk, (i64)r * nblk_row + cr / cpb, cr % cpb);
            }
        };
        typename TG::chunk ch[U];
        q8_rows<TG, U, PF, true>(n_chunks, blockIdx.x + G * warp, k * n_ff, G * WARPS, lane, ch, false, q8x<TG::x_swizzle>{xq, xd, xs},
                                 load, [&](int R, float acc, float acc_up) { h[R] = glu_act<false>(acc, acc_up); });
    }

    // 3. down, the weighted sum and the residual
    const DownRows<TD, DU> d(w_down, down_bytes, c.ids, k, n_embd, n_ff, lane);
    typename TD::chunk dch[DU];
    const int row = blockIdx.x + G * warp;
    constexpr bool early = EARLY || TD::expert_planar;
    if (early && row < n_embd) d.load(dch, row, d.sub);  // the weights stream while the other blocks finish
    __syncthreads();  // the block's rows are in h; every warp is done with x's q8 before h's overwrites it
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(arrived) : "memory");
    if (!early && row < n_embd) d.load(dch, row, d.sub);
    if (renorm && threadIdx.x == 0) {  // the weights divided by their sum as moe_route divides them, off phase 2's path
        float t = 0.f;
        for (int j = 0; j < k; ++j) t += c.w[j];
        wsum = t;
    }
    if (threadIdx.x == 0) {
        for (;;) {
            u64 n;
            asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(n) : "l"(arrived) : "memory");
            if (n >= (u64)tag * (u64)G) break;
            __nanosleep(32);  // (spinning without it slowed the step when 132 threads a block polled: 629 against 640 t/s)
        }
    }
    __syncthreads();  // every block's rows acquired, for the whole block
    quantize_k_rows<true>(h, k, n_ff, TD::x_swizzle, base, xb);
    __syncthreads();
    u8* hq = base + d.j * xb;
    float* hd = reinterpret_cast<float*>(hq + q8x_bytes_q(n_ff));
    const float wj = renorm ? __fdiv_rn(c.w[d.j], wsum) : c.w[d.j];
    d.rows(dch, row, G * WARPS, n_embd, q8x<TD::x_swizzle>{hq, hd, hd + q8x_d_floats(n_ff)}, wj, x, y, lane);
    if (threadIdx.x == 0) atomicAdd(count, 1ull);
}
