// Rotary position embedding (Su et al. 2021, RoFormer) on q and k, fused with the optional
// per-head q/k RMSNorm of qwen3 and the store of k and v into the KV cache (fp16 or q8_0 keys and
// values: KT, VT, kv_cache.cuh).
//
// Pair layouts, as llama.cpp's ggml_rope: "normal" (GGUF llama, whose q/k weights are permuted
// for it) rotates (2i, 2i+1); NeoX (qwen2, qwen3) rotates (i, i + rope_dim/2). Dimensions at or
// past rope_dim pass through. The angle of pair i at position p is p * inv_freq[i], with
// inv_freq[i] = rope_freq_base^(-2i/rope_dim) / rope_freqs[i] computed on the host in float64;
// the angle and its sine/cosine are computed in double, so large positions stay exact; the
// rotated pairs are multiplied by mscale (runtime/rope.py: YaRN's 0.1 ln(s) + 1, LongRoPE's
// attention factor; 1.0 for unscaled models), the pass-through dimensions are not.
// Launched by runtime/cuda/ops.py (Ops.rope_qk_store). In decode the attention kernel applies
// the same rotation itself (attention.cu, flag K4_FUSE_ROPE).
#include "kv_cache.cuh"

// q_src: (n_tok, n_head, D) f32 with a row stride of ld_q floats per token (a view into the
//   q | k | v product outputs); q_out: (n_tok, n_head, D) f32 contiguous, q normalized (when
//   q_norm) and rotated; may be q_src itself (ld_q = n_head * D).
// k_src, v_src: (n_tok, n_head_kv, D) f32, row strides ld_k, ld_v; read only.
// k_cache, v_cache: (n_ctx, n_head_kv, D) of KT::elem / VT::elem, this layer's slice, with k_d,
//   v_d their (n_ctx, n_head_kv, D / 32) fp16 scale planes (q8_0; null for f16); rows
//   pos0 .. pos0+n_tok-1 are written (k normalized and rotated, v as is).
// q_norm, k_norm: (D,) f32 or null. inv_freq: (rope_dim/2,) f64. pos: (1,) int32, pos0 = *pos.
// mscale: factor on the rotated pairs' cos and sin. ring: as attention.cu's (-1: position p at
//   row p; else at row p & ring, a sliding layer's ring).
// Thread mapping: one warp per row; grid.x = ceil(n_tok * (n_head + n_head_kv) / warps per block).
// Dynamic shared memory: with a q8_0 key cache, D floats per warp (the rotated key, quantized
// from there by blocks of 32); none otherwise.
template <class KT, class VT>
__global__ void rope_qk_store(const float* q_src, int ld_q, const float* __restrict__ k_src, int ld_k,
                              const float* __restrict__ v_src, int ld_v, float* q_out,
                              typename KT::elem* __restrict__ k_cache, u16* __restrict__ k_d,
                              typename VT::elem* __restrict__ v_cache, u16* __restrict__ v_d,
                              const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                              const double* __restrict__ inv_freq, const int* __restrict__ pos,
                              int n_tok, int n_head, int n_head_kv, int D, int rope_dim, int neox,
                              float eps, float mscale, int ring) {
    pdl_trigger();
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int rows_per_tok = n_head + n_head_kv;
    if (row >= n_tok * rows_per_tok) return;  // whole warp leaves together
    const int t = row / rows_per_tok, j = row % rows_per_tok;
    const int p = *pos + t;
    if (j < n_head) {
        k4ops::rope_row(q_src + (size_t)t * ld_q + (size_t)j * D, q_out + ((size_t)t * n_head + j) * D, nullptr, q_norm, eps,
                 inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
        return;
    }
    const int hk = j - n_head;
    const size_t dst = ((size_t)(p & ring) * n_head_kv + hk) * D;
    const float* kr = k_src + (size_t)t * ld_k + (size_t)hk * D;
    if constexpr (KT::SCALED) {
        extern __shared__ float rope_stage[];  // (warps, D) rotated keys
        float* ks = rope_stage + (threadIdx.x >> 5) * D;
        k4ops::rope_row(kr, ks, nullptr, k_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
        __syncwarp();
        KT::store_row(ks, D, k_cache, k_d, dst, lane);
    } else {
        k4ops::rope_row(kr, nullptr, k_cache + dst, k_norm, eps, inv_freq, (double)p, D, rope_dim, neox, lane, mscale);
    }
    VT::store_row(v_src + (size_t)t * ld_v + (size_t)hk * D, D, v_cache, v_d, dst, lane);
}
