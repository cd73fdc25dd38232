// The router's choice for one token, made by a whole thread block into shared memory: the
// softmax of the router logits, the k experts of largest probability in decreasing order (ties:
// the lower id first, as numpy's stable argsort in runtime/moe.py route), their probabilities as
// weights, divided by their sum when renorm (qwen3moe's norm_topk_prob; llama.cpp build_moe_ffn
// with softmax gating, argsort_top_k then get_rows). moe.cu moe_topk writes it out for prefill;
// the decode products (moe_gemv.cu's routed SwiGLU launch, moe_down.cu moe_down_combine) each make it
// themselves from the logits instead of reading the ids another kernel wrote: one launch fewer;
// moe_one.cu calls moe_choose_warp itself, on logits it polls.
//
// Every block that makes the choice for the same logits gets the same bits whatever its size:
// warp 0 computes the softmax in one fixed order. Up to 32 * MOE_WARP_EXPERTS experts (Qwen3's
// 128) warp 0 also makes the selection, in k rounds: each lane's best remaining probability, the
// warp's largest (redux.sync on the bits, which order non-negative floats as integers do), the
// lowest id among the lanes that hold it. More experts are selected by rank (each expert counts
// the experts ahead of it, over the whole block). Both give the order of (probability
// descending, id ascending). One barrier (two with more experts; two more with renorm).
#pragma once
#include "common.cuh"

constexpr int MOE_WARP_EXPERTS = 4;  // experts per lane of warp 0's selection (e = lane + 32 i)

struct MoeChoice {
    const int* ids;  // k expert ids (shared memory), each < n_expert
    const float* w;  // k weights (shared memory)
};

// One warp's softmax and selection for n_expert <= 32 * MOE_WARP_EXPERTS, into ids[0..k),
// w[0..k) (shared memory; lane 0 writes them). fill(p): p[i] = the logit of expert lane + 32 i
// (any value past n_expert). The softmax's arithmetic and order are those of moe_route's wider
// path (the lane's experts in increasing order, then warp_sum), kept in registers. NaN
// probabilities give in-range ids.
template <class Fill>
__device__ void moe_choose_warp(Fill fill, int n_expert, int k, int* ids, float* w) {
    const int lane = threadIdx.x & 31;
    float p[MOE_WARP_EXPERTS];
    fill(p);
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int i = 0; i < MOE_WARP_EXPERTS; ++i)
        if (lane + 32 * i < n_expert) m = fmaxf(m, p[i]);
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < MOE_WARP_EXPERTS; ++i) {
        if (lane + 32 * i < n_expert) {
            p[i] = __expf(p[i] - m);
            s += p[i];
        }
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < MOE_WARP_EXPERTS; ++i) p[i] = __fdiv_rn(p[i], s);
    unsigned taken = 0;  // bit i: expert lane + 32 i chosen
    for (int r = 0; r < k; ++r) {
        int best = -1, at = 0;  // the lane's largest remaining probability (its bits; -1: none), its first entry
#pragma unroll
        for (int i = 0; i < MOE_WARP_EXPERTS; ++i) {
            const int key = lane + 32 * i < n_expert && !((taken >> i) & 1u) ? __float_as_int(p[i]) : -1;
            if (key > best) {
                best = key;
                at = i;
            }
        }
        const int top = __reduce_max_sync(0xffffffffu, best);
        const int id = __reduce_min_sync(0xffffffffu, best == top ? lane + 32 * at : 0x7fffffff);  // none left: 0
        if (lane == (id & 31)) taken |= 1u << (id >> 5);
        if (lane == 0) {
            ids[r] = id;
            w[r] = __int_as_float(top);
        }
    }
}

// logits: (n_expert,) f32 in global or shared memory, complete before the call (after pdl_wait);
// prob: n_expert floats of shared memory (used past 32 * MOE_WARP_EXPERTS experts); 1 <= k <=
// MOE_MAX_K, k <= n_expert, k <= blockDim.x. Every thread of the block calls it; the choice is in
// shared memory when it returns. Logits with a NaN give in-range ids (a wrong choice, but no read
// outside the expert tensors).
// weights: false when only the ids are wanted (the weights are left unnormalized).
__device__ MoeChoice moe_route(const float* __restrict__ logits, int n_expert, int k, int renorm, float* prob, bool weights = true) {
    __shared__ int ids[MOE_MAX_K];
    __shared__ float w[MOE_MAX_K];
    __shared__ float total;  // the chosen weights' sum
    if (n_expert <= 32 * MOE_WARP_EXPERTS) {  // block-uniform
        if (threadIdx.x < 32) {
            auto fill = [&](float (&p)[MOE_WARP_EXPERTS]) {
#pragma unroll
                for (int i = 0; i < MOE_WARP_EXPERTS; ++i) p[i] = threadIdx.x + 32 * i < n_expert ? logits[threadIdx.x + 32 * i] : 0.f;
            };
            moe_choose_warp(fill, n_expert, k, ids, w);
        }
    } else {
        if (threadIdx.x < 32) {  // warp 0: the softmax, each lane's experts e = lane + 32 i
            const int lane = threadIdx.x;
            float m = -__int_as_float(0x7f800000);
            for (int e = lane; e < n_expert; e += 32) m = fmaxf(m, logits[e]);
            m = warp_max(m);
            float s = 0.f;
            for (int e = lane; e < n_expert; e += 32) {
                const float p = __expf(logits[e] - m);
                prob[e] = p;
                s += p;
            }
            s = warp_sum(s);
            for (int e = lane; e < n_expert; e += 32) prob[e] = __fdiv_rn(prob[e], s);  // the lane's own entries
        }
        if (threadIdx.x < k) {  // overwritten below unless NaN logits leave a rank empty
            ids[threadIdx.x] = threadIdx.x;
            w[threadIdx.x] = 0.f;
        }
        __syncthreads();
        // rank of expert e: the experts ahead of it, counted by tpe adjacent lanes (a power of two up to
        // 32: as many as the block has threads for), each over every tpe-th expert, summed by shuffles
        int tpe = 1;
        while (tpe < 32 && 2 * tpe * n_expert <= (int)blockDim.x) tpe *= 2;
        for (int base = 0; base < n_expert * tpe; base += blockDim.x) {  // warp-uniform trip count
            const int t = base + threadIdx.x, e = t / tpe;
            const float p = e < n_expert ? prob[e] : 0.f;
            int rank = 0;
            if (e < n_expert) {
#pragma unroll 4
                for (int f = t % tpe; f < n_expert; f += tpe) {
                    const float q = prob[f];
                    rank += q > p || (q == p && f < e);
                }
            }
            for (int o = 1; o < tpe; o <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
            if (e < n_expert && t % tpe == 0 && rank < k) {
                ids[rank] = e;
                w[rank] = p;
            }
        }
    }
    __syncthreads();
    if (renorm && weights) {
        if (threadIdx.x == 0) {
            float t = 0.f;
            for (int j = 0; j < k; ++j) t += w[j];
            total = t;
        }
        __syncthreads();
        if (threadIdx.x < k) w[threadIdx.x] = __fdiv_rn(w[threadIdx.x], total);
        __syncthreads();
    }
    return {ids, w};
}

// The router's logit of one expert (moe.cu moe_router, moe_one.cu's router phase): row wr (n_in
// values of a float type T) . (x * rsqrt(mean(x^2) + eps) * norm_w), float32, returned to thread 0.
// Threads below ROUTER_THREADS take values i, i + ROUTER_THREADS, ..., summing x . x and the dot
// in one pass; warp sums, then warp 0 over the warps (those past ROUTER_THREADS add zeros, which
// leave every sum's bits as they are), so any block of at least ROUTER_THREADS threads gets
// moe_router's bits. Every thread of the block calls it; it may be called again at once.
template <class T>
__device__ float router_logit(const u8* __restrict__ wr, const float* __restrict__ x, const float* __restrict__ norm_w,
                              float eps, int n_in) {
    __shared__ float part[2][32];
    float ss = 0.f, acc = 0.f;
    if (threadIdx.x < ROUTER_THREADS) {
        for (int i = threadIdx.x; i < n_in; i += ROUTER_THREADS) {
            const float xi = x[i];
            ss += xi * xi;
            acc += T::get(wr, i) * (xi * __ldg(norm_w + i));
        }
    }
    ss = warp_sum(ss);
    acc = warp_sum(acc);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        part[0][warp] = ss;
        part[1][warp] = acc;
    }
    __syncthreads();
    float v = 0.f;
    if (warp == 0) {
        const bool ok = lane < (int)(blockDim.x >> 5);
        ss = warp_sum(ok ? part[0][lane] : 0.f);
        acc = warp_sum(ok ? part[1][lane] : 0.f);
        v = acc * rsqrtf(ss / (float)n_in + eps);
    }
    __syncthreads();  // part is free for the next call
    return v;
}
