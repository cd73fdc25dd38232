// The RMSNorm prologue of the q8 matrix-vector products (kernels_cu/gemv.cu, gemv_batch.cu,
// moe_gemv.cu, moe_one.cu, megakernel.cu): x quantized with the norm folded in (quantize_x, Gemma's
// post-norm with it: PostNorm, post_split), or in one pass with the norm's scale left for the
// outputs (quantize_x_unscaled, folded_scale). Part of gemv_common.cuh, which includes it after
// the q8 scheme these build on (rms_scale, q8_unit, q8x_bytes); not a header of its own.
#pragma once

// Gemma's post-norm of the product before, folded into this product's prologue (post_split): the
// product's input is x + rms_scale(t) * (t * w), what norm.cu rms_norm_add writes as the new
// residual stream (it rounds x + (t * s) * w: the two differ by an ulp or so). t null: none. out:
// where block 0 writes that input (the residual stream the later adds read); xf: shared memory of
// 2 n_in floats where every block keeps x, then u = t * w.
struct PostNorm {
    const float* t;
    const float* w;
    float* out;
    float* xf;
};

// post_split: one pass over x, t and w (n_in floats each, 16-byte aligned) leaves x and u = t * w
// in post.xf and, after one block reduction, returns (s, r): s = rms_scale(t) and r = rms_scale of
// the input x + s u, its sum of squares by expansion, sum x^2 + 2 s sum x u + s^2 sum u^2, so
// neither the input nor its sum waits for s. The input's values are post_input's, read where
// they are used: the one barrier (the reduction's) publishes xf. Gemma 3 12B tg128 307.6 -> 314.4
// t/s against two passes, each with its reduction, part of it the larger shared memory's
// L1/shared split (docs/PERF.md, session 14). Every thread of the block calls it.
__device__ float2 post_split(const float* __restrict__ x, int n_in, float eps, const PostNorm& post) {
    __shared__ float4 part[32];
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);  // sums of t^2, x^2, x u, u^2
    for (int i = threadIdx.x; i < n_in / 4; i += blockDim.x) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(x) + i);
        const float4 a = __ldg(reinterpret_cast<const float4*>(post.t) + i), g = __ldg(reinterpret_cast<const float4*>(post.w) + i);
        const float4 u = make_float4(a.x * g.x, a.y * g.y, a.z * g.z, a.w * g.w);
        reinterpret_cast<float4*>(post.xf)[i] = f;
        reinterpret_cast<float4*>(post.xf + n_in)[i] = u;
        acc.x += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
        acc.y += f.x * f.x + f.y * f.y + f.z * f.z + f.w * f.w;
        acc.z += f.x * u.x + f.y * u.y + f.z * u.z + f.w * u.w;
        acc.w += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w;
    }
    acc = make_float4(warp_sum(acc.x), warp_sum(acc.y), warp_sum(acc.z), warp_sum(acc.w));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();  // also publishes xf
    const bool has = (int)(threadIdx.x & 31) < (int)(blockDim.x >> 5);
    const float4 p = has ? part[threadIdx.x & 31] : make_float4(0.f, 0.f, 0.f, 0.f);
    const float ts = rsqrtf(warp_sum(p.x) / (float)n_in + eps);
    const float ss = fmaxf(0.f, warp_sum(p.y) + 2.f * ts * warp_sum(p.z) + ts * ts * warp_sum(p.w));
    return make_float2(ts, rsqrtf(ss / (float)n_in + eps));
}

// Values 4i .. 4i + 3 of a folded post-norm's input, x + s u (post_split's xf and s).
__device__ __forceinline__ float4 post_input(const PostNorm& post, int n_in, int i, float ts) {
    const float4 f = reinterpret_cast<const float4*>(post.xf)[i], u = reinterpret_cast<const float4*>(post.xf + n_in)[i];
    return make_float4(f.x + ts * u.x, f.y + ts * u.y, f.z + ts * u.z, f.w + ts * u.w);
}

// Block 0 writes the folded post-norm's input (post_input) to post.out, the new residual stream.
__device__ __forceinline__ void post_store(const PostNorm& post, int n_in, float ts) {
    if (blockIdx.x != 0) return;
    for (int i = threadIdx.x; i < n_in / 4; i += blockDim.x) reinterpret_cast<float4*>(post.out)[i] = post_input(post, n_in, i, ts);
}

// The block's loop over units 0 .. n_units - 1 of a q8 x, one a thread (a warp-uniform trip
// count, so q8_unit's pairs meet in adjacent lanes): float4 k (0..3) of unit u from
// load(u, k, ok) (ok false: a lane past the last unit, whose values must be zeros), the unit
// quantized by q8_unit into slot u0 + u of xq, xd, xs. quantize_x, quantize_x_unscaled and
// gemv.cu's quantize_outputs differ only in load. Their loads capture by value: captured by
// reference, nvcc scheduled 34 gemv.cu instances differently (docs/PERF.md, session 50).
template <class Load>
__device__ __forceinline__ void q8_units(int n_units, int u0, int swz, u8* xq, float* xd, float* xs, Load load) {
    for (int base = 0; base < n_units; base += blockDim.x) {
        const int u = base + threadIdx.x;
        const bool ok = u < n_units;
        float v[16];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 f = load(u, k, ok);
            v[4 * k] = f.x; v[4 * k + 1] = f.y; v[4 * k + 2] = f.z; v[4 * k + 3] = f.w;
        }
        q8_unit(v, ok, u0 + u, swz, xq, xd, xs);
    }
}

// Quantize x (n_in floats, n_in a multiple of 32, 16-byte aligned) into the q8x arrays in
// shared memory; with norm_w (n_in,) non-null, x * rms_scale(x) * norm_w instead; with post.t
// non-null (and norm_w), the post-norm's input (post_split) in place of x. One thread per
// 16-value unit.
template <int SWZ>
__device__ void quantize_x(const float* __restrict__ x, int n_in, const float* __restrict__ norm_w, float eps,
                           u8* xq, float* xd, float* xs, PostNorm post = PostNorm{nullptr, nullptr, nullptr, nullptr}) {
    const bool fold = post.t != nullptr;
    const float2 ps = fold ? post_split(x, n_in, eps, post) : make_float2(0.f, norm_w ? rms_scale(x, n_in, eps) : 1.f);
    const float scale = norm_w ? ps.y : 1.f;
    if (fold) post_store(post, n_in, ps.x);
    q8_units(n_in >> 4, 0, SWZ, xq, xd, xs, [=](int u, int k, bool ok) {
        float4 f = !ok  ? make_float4(0.f, 0.f, 0.f, 0.f)
                   : fold ? post_input(post, n_in, 4 * u + k, ps.x)
                          : __ldg(reinterpret_cast<const float4*>(x) + 4 * u + k);
        if (norm_w && ok) {
            const float4 g = __ldg(reinterpret_cast<const float4*>(norm_w) + 4 * u + k);
            f = make_float4(f.x * scale * g.x, f.y * scale * g.y, f.z * scale * g.z, f.w * scale * g.w);
        }
        return f;
    });
}

// quantize_x's RMSNorm in one pass, for a product that scales its outputs instead (gemv.cu gemv_q8
// and gemv_q8_pair with norm_w and no post-norm): x * norm_w quantized into the q8x arrays, whose
// quants are those of x * s * norm_w (s = rms_scale(x) is common to every value and each output
// is linear in the units' scales; only the rounding of a unit's scale can differ), and the sum of
// x^2 over each warp's units left in the returned (WARPS,) shared array for folded_scale after
// the caller's barrier. So no block reduction stands between x's loads and the row loop
// (docs/PERF.md, sessions 41 and 47). One thread per 16-value unit.
template <int SWZ>
__device__ float* quantize_x_unscaled(const float* __restrict__ x, int n_in, const float* __restrict__ norm_w, u8* xq, float* xd,
                                      float* xs) {
    __shared__ float part[32];
    float ss = 0.f;
    q8_units(n_in >> 4, 0, SWZ, xq, xd, xs, [=, &ss](int u, int k, bool ok) {
        float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
        if (ok) {
            f = __ldg(reinterpret_cast<const float4*>(x) + 4 * u + k);
            const float4 g = __ldg(reinterpret_cast<const float4*>(norm_w) + 4 * u + k);
            ss += f.x * f.x + f.y * f.y + f.z * f.z + f.w * f.w;
            f = make_float4(f.x * g.x, f.y * g.y, f.z * g.z, f.w * g.w);
        }
        return f;
    });
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    return part;
}

// The RMSNorm's scale rsqrt(mean(x^2) + eps) from quantize_x_unscaled's parts (published by a
// barrier), in every lane of the calling warp (all must call it).
__device__ __forceinline__ float folded_scale(const float* part, int n_in, float eps) {
    const int lane = threadIdx.x & 31;
    return rsqrtf(warp_sum(lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f) / (float)n_in + eps);
}
