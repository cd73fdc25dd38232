// On-device token sampling, the algorithm of runtime/sampling.py (llama.cpp's default chain):
// repeat penalty -> top-k -> top-p (softmax at temperature 1) -> min-p -> temperature -> draw
// with the counter-based uniform(seed, step) (splitmix64). temperature <= 0 is greedy (argmax,
// first index on ties). Logits never leave the device: the chosen id goes to the decode state
// and the penalty ring, from where the host copies 4 bytes.
//
// Candidates: top-k is found by an MSB-first radix select over order-preserving float keys,
// ties at the k-th value resolved to the lowest ids (numpy's stable argsort), then the
// candidates are bitonic-sorted by (logit desc, id asc). At most SAMPLE_CAP candidates are kept:
// when top_k is off or larger than SAMPLE_CAP, top-p, min-p and the draw see the SAMPLE_CAP most
// probable tokens, with top-p's normalization still taken over the whole top-k set. The host
// sampler differs only when the kept set would exceed SAMPLE_CAP tokens.
// Launched by runtime/cuda/ops.py (Ops.sample): sample_argmax_partial (unless the output head
// wrote the argmax partials) and sample_finish, in that order on one stream. The logits are
// read through plain loads everywhere: sample_finish penalizes them in place first.
// SAMPLE_THREADS (threads per block), SAMPLE_CAP, SAMPLER_PARAM_WORDS and the ST_* words of the
// decode state come from runtime/cuda/constants.py (constants.cuh).
#include "ops_common.cuh"
#include "argmax.cuh"  // NO_INDEX, beats, warp_argmax, block_argmax

// Sampling parameters, 64 bytes, written by the host once per generate() call
// (runtime/cuda/ops.py pack_sampler_params).
struct SamplerParams {
    double temperature, top_p, min_p, repeat_penalty;
    long long top_k;             // <= 0: off
    long long repeat_last_n;
    unsigned long long seed_mix; // (seed * 0x100000001B3) mod 2^64
    long long reserved;
};
static_assert(sizeof(SamplerParams) == 8 * SAMPLER_PARAM_WORDS, "SamplerParams: runtime/cuda/constants.py has another size");

// Decode state, STATE_WORDS int32 words: ST_TOK the token the next decode step evaluates, ST_POS
// its position (= n_past), ST_RING tokens pushed into the penalty ring so far, ST_DRAW draws made
// so far (the RNG step).

// Order-preserving map float -> uint32 (larger float, larger key), and its inverse.
__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// splitmix64 (Steele, Lea, Flood 2014) of x, top 53 bits as a double in [0, 1);
// runtime/sampling.py uniform(seed, step) with x = seed_mix + step.
__device__ __forceinline__ double uniform01(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

// Inclusive prefix sum over the block in thread order; wsum: (32,) shared scratch.
__device__ __forceinline__ double block_scan(double v, double* wsum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 1; off < 32; off <<= 1) {
        const double o = __shfl_up_sync(k4ops::FULL_MASK, v, off);
        if (lane >= off) v += o;
    }
    __syncthreads();
    if (lane == 31) wsum[warp] = v;
    __syncthreads();
    double before = 0.0;
    for (int w = 0; w < warp; ++w) before += wsum[w];
    return v + before;
}

struct Selected {
    unsigned key;  // key of the K-th largest value
    int need;      // how many elements equal to it belong to the top K
    int n_eq;      // how many elements equal it
};

// The K-th largest of x[0..n) (1 <= K <= n), by radix select on order_key, 8 bits per pass.
// hist: (256,) shared; sel: (3,) shared. Every thread of the block calls it.
__device__ Selected radix_select(const float* x, int n, int K, unsigned* hist, int* sel) {
    const int tid = threadIdx.x, bd = blockDim.x, lane = tid & 31;
    unsigned prefix = 0, mask = 0;
    int rem = K, n_eq = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += bd) hist[i] = 0;
        __syncthreads();
        const int n_round = (n + bd - 1) / bd * bd;
        for (int i = tid; i < n_round; i += bd) {
            int digit = 256;
            if (i < n) {
                const unsigned k = order_key(x[i]);
                if ((k & mask) == prefix) digit = (k >> shift) & 255;
            }
            const unsigned peers = __match_any_sync(k4ops::FULL_MASK, digit);
            if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], (unsigned)__popc(peers));
        }
        __syncthreads();
        if (tid < 32) {  // lane l owns bins 255-8l down to 248-8l
            unsigned cnt[8], tot = 0;
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                cnt[u] = hist[255 - 8 * lane - u];
                tot += cnt[u];
            }
            unsigned incl = tot;
            for (int off = 1; off < 32; off <<= 1) {
                const unsigned o = __shfl_up_sync(k4ops::FULL_MASK, incl, off);
                if (lane >= off) incl += o;
            }
            const unsigned excl = incl - tot;
            if (excl < (unsigned)rem && (unsigned)rem <= incl) {
                unsigned run = excl;
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    if (run + cnt[u] >= (unsigned)rem) {
                        sel[0] = 255 - 8 * lane - u;
                        sel[1] = rem - (int)run;
                        sel[2] = (int)cnt[u];
                        break;
                    }
                    run += cnt[u];
                }
            }
        }
        __syncthreads();
        prefix |= (unsigned)sel[0] << shift;
        mask |= 255u << shift;
        rem = sel[1];
        n_eq = sel[2];
    }
    return {prefix, rem, n_eq};
}

// Apply the repeat penalty in place to each distinct id among the last repeat_last_n ring
// entries: a positive logit is divided by the penalty, a negative one multiplied (float32,
// correctly rounded, as numpy does). logits: (n_vocab,) f32. seen: (n_vocab,) int32, all zero
// on entry and on exit. ring: (ring_cap,) int32. Every thread of one block calls it; the threads
// stride over the window, and the block sees the penalized logits after it. Returns whether it
// changed anything (the penalty is not 1 and the window not empty).
__device__ bool apply_penalty(float* logits, int* seen, const int* __restrict__ ring, const int* state, int ring_cap,
                              const SamplerParams* __restrict__ sp) {
    const double penalty = sp->repeat_penalty;
    const int count = state[ST_RING];
    const int L = (int)min((long long)count, sp->repeat_last_n);
    if (penalty == 1.0 || L <= 0) return false;  // the same for every thread
    const float pf = (float)penalty;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        const int id = ring[(count - 1 - j) % ring_cap];
        if (atomicExch(&seen[id], 1) == 0) {
            const float v = logits[id];
            logits[id] = v > 0.0f ? __fdiv_rn(v, pf) : __fmul_rn(v, pf);
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < L; j += blockDim.x) seen[ring[(count - 1 - j) % ring_cap]] = 0;
    __syncthreads();
    return true;
}

// Per-block argmax of logits (n,) f32 into part_val/part_idx (gridDim.x,), lowest index on ties.
// Thread mapping: grid-stride over the logits.
extern "C" __global__ void sample_argmax_partial(const float* __restrict__ logits, int n, float* __restrict__ part_val,
                                                 int* __restrict__ part_idx) {
    pdl_trigger();
    pdl_wait();
    float best = -k4ops::inf_f32();
    int bi = NO_INDEX;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = logits[i];
        if (bi == NO_INDEX || v > best) {
            best = v;
            bi = i;
        }
    }
    block_argmax(best, bi);
    if (threadIdx.x == 0) {
        part_val[blockIdx.x] = best;
        part_idx[blockIdx.x] = bi;
    }
}

// The chain after the penalty for temperature > 0; returns the drawn id (every thread).
__device__ int draw_token(const float* x, int n, const SamplerParams* __restrict__ sp, int draw) {
    __shared__ unsigned hist[256];
    __shared__ int sel[3];
    __shared__ float cv[SAMPLE_CAP];
    __shared__ int ci[SAMPLE_CAP];
    __shared__ int wcnt[32];
    __shared__ double wsum[32];
    __shared__ int n_c;
    __shared__ double total;
    const int tid = threadIdx.x, bd = blockDim.x, lane = tid & 31, warp = tid >> 5, n_warps = bd >> 5;

    const int K = (sp->top_k > 0 && sp->top_k < n) ? (int)sp->top_k : n;
    const int Kc = min(K, SAMPLE_CAP);
    const Selected top = radix_select(x, n, Kc, hist, sel);

    // Gather the candidates: all keys above the threshold, then `need` ties, lowest ids first.
    if (tid == 0) n_c = 0;
    __syncthreads();
    const bool all_ties = top.need == top.n_eq;
    for (int i = tid; i < n; i += bd) {
        const unsigned k = order_key(x[i]);
        if (k > top.key || (all_ties && k == top.key)) {
            const int slot = atomicAdd(&n_c, 1);
            cv[slot] = x[i];
            ci[slot] = i;
        }
    }
    __syncthreads();
    if (!all_ties) {
        const int first_slot = Kc - top.need;
        int taken = 0;
        for (int base = 0; base < n && taken < top.need; base += bd) {
            const int i = base + tid;
            const bool is_tie = i < n && order_key(x[i]) == top.key;
            const unsigned ballot = __ballot_sync(k4ops::FULL_MASK, is_tie);
            if (lane == 0) wcnt[warp] = __popc(ballot);
            __syncthreads();
            int before = 0, round_total = 0;
            for (int w = 0; w < n_warps; ++w) {
                before += w < warp ? wcnt[w] : 0;
                round_total += wcnt[w];
            }
            const int r = taken + before + __popc(ballot & ((1u << lane) - 1u));
            if (is_tie && r < top.need) {
                cv[first_slot + r] = x[i];
                ci[first_slot + r] = i;
            }
            taken += round_total;
            __syncthreads();
        }
    }

    // Bitonic sort of the candidates by (logit desc, id asc), padded to a power of two.
    int S = 1;
    while (S < Kc) S <<= 1;
    if (tid >= Kc && tid < S) {
        cv[tid] = -k4ops::inf_f32();
        ci[tid] = NO_INDEX;
    }
    for (int size = 2; size <= S; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            const int j = tid ^ stride;
            if (tid < S && j > tid) {
                const float vi = cv[tid], vj = cv[j];
                const int ii = ci[tid], ij = ci[j];
                const bool j_first = vj > vi || (vj == vi && ij < ii);
                if (j_first == ((tid & size) == 0)) {
                    cv[tid] = vj;
                    cv[j] = vi;
                    ci[tid] = ij;
                    ci[j] = ii;
                }
            }
        }
    }
    __syncthreads();

    // Softmax normalizer over the whole top-k set, as the host sampler's p /= p.sum().
    const double v0 = cv[0];
    double z;
    if (K == Kc) {
        z = k4ops::block_sum(tid < Kc ? exp((double)cv[tid] - v0) : 0.0);
    } else if (K == n) {
        double e = 0.0;
        for (int i = tid; i < n; i += bd) e += exp((double)x[i] - v0);
        z = k4ops::block_sum(e);
    } else {
        const Selected kth = radix_select(x, n, K, hist, sel);
        double e = 0.0;
        for (int i = tid; i < n; i += bd) {
            if (order_key(x[i]) > kth.key) e += exp((double)x[i] - v0);
        }
        z = k4ops::block_sum(e) + kth.need * exp((double)key_value(kth.key) - v0);
    }
    const double p = tid < Kc ? exp((double)cv[tid] - v0) / z : 0.0;

    int keep = Kc;
    if (sp->top_p < 1.0) {
        const double cum = block_scan(p, wsum);
        const int first = k4ops::block_min(tid < Kc && cum >= sp->top_p ? tid : NO_INDEX);
        if (first != NO_INDEX) keep = first + 1;
    }
    if (sp->min_p > 0.0) {
        const double floor_p = sp->min_p * (1.0 / z);
        const int first_below = k4ops::block_min(tid < keep && p < floor_p ? tid : NO_INDEX);
        keep = max(min(keep, first_below), 1);
    }

    const double w = tid < keep ? exp(((double)cv[tid] - v0) / sp->temperature) : 0.0;
    const double cdf = block_scan(w, wsum);
    if (tid == keep - 1) total = cdf;
    __syncthreads();
    const double u = uniform01(sp->seed_mix + (unsigned long long)draw) * total;
    const int idx = k4ops::block_min(tid < keep && cdf > u ? tid : NO_INDEX);
    return ci[idx == NO_INDEX ? keep - 1 : idx];
}

// Apply the repeat penalty (apply_penalty), pick the token (greedy from the argmax partials, else
// draw_token), then update the decode state: push the token into the ring, make it the next
// step's input, count the draw, and when `advance` is set (a decode step, whose input token is
// now cached) increment the position. The partials (sample_argmax_partial's, or the output
// head's: gemv.cu AM, K4_HEAD_ARGMAX) predate the penalty: where it changed logits, greedy takes
// the argmax of the logits themselves. logits: (n,) f32, penalized in place. seen: (n,) int32
// zeros. part_val/part_idx: (n_part,) argmax partials (any number). state: (4,) int32. ring:
// (ring_cap,) int32. One block of SAMPLE_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_finish(float* logits, int n, int* seen, const float* __restrict__ part_val, const int* __restrict__ part_idx, int n_part,
              int* state, int* ring, int ring_cap, const SamplerParams* __restrict__ sp, int advance) {
    pdl_trigger();
    pdl_wait();
    const int tid = threadIdx.x;
    const bool penalized = apply_penalty(logits, seen, ring, state, ring_cap, sp);
    const int draw = state[ST_DRAW];
    int token;
    if (sp->temperature <= 0.0) {
        float v = -k4ops::inf_f32();
        token = NO_INDEX;
        for (int i = tid; i < n_part; i += blockDim.x)
            if (beats(part_val[i], part_idx[i], v, token)) {
                v = part_val[i];
                token = part_idx[i];
            }
        if (penalized) {
            v = -k4ops::inf_f32();
            token = NO_INDEX;
            for (int i = tid; i < n; i += blockDim.x)
                if (beats(logits[i], i, v, token)) {
                    v = logits[i];
                    token = i;
                }
        }
        block_argmax(v, token);
    } else {
        token = draw_token(logits, n, sp, draw);
    }
    __syncthreads();
    if (tid == 0) {
        const int count = state[ST_RING];
        ring[count % ring_cap] = token;
        state[ST_RING] = count + 1;
        state[ST_TOK] = token;
        state[ST_DRAW] = draw + 1;
        if (advance) state[ST_POS] += 1;
    }
}
