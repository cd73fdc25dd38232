// Speculative decoding's verify step, greedy, on the device (runtime/cuda/speculative.py): the
// target model has evaluated n tokens [t, d_1 .. d_k] (the last sampled token, then k drafts) in
// one forward pass and left one row of logits per token. spec_argmax takes each row's argmax
// (lowest index on ties, as the greedy sampler and numpy's argmax), spec_accept keeps the longest
// run of drafts that the argmax of the row before agrees with, and rolls the cache position
// back past the rejected ones, so the host reads one small array per verify step and nothing
// else (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
// with a greedy target: a draft is accepted exactly when it is the token greedy decoding emits).
#include "ops_common.cuh"
#include "argmax.cuh"

// best[r] = argmax of logits row r, r < n_rows (one block per row). logits: (n_rows, n_vocab) f32.
extern "C" __global__ void spec_argmax(const float* __restrict__ logits, int n_vocab, int* __restrict__ best) {
    pdl_trigger();
    pdl_wait();
    const float* row = logits + (long long)blockIdx.x * n_vocab;
    float v = -k4ops::inf_f32();
    int bi = NO_INDEX;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float x = row[i];
        if (bi == NO_INDEX || x > v) {
            v = x;
            bi = i;
        }
    }
    block_argmax(v, bi);
    if (threadIdx.x == 0) best[blockIdx.x] = bi;
}

// ids: (n,) the evaluated tokens [t, d_1 .. d_k], n = k + 1; best: (n,) spec_argmax's output.
// Writes out[0] = m, the accepted drafts (d_i == best[i - 1] for i = 1 .. m, the first mismatch
// ends the run), out[1 .. m] = d_1 .. d_m, out[m + 1] = best[m] (the token after the last kept
// position); and pos[0] += 1 + m: pos held the position of t, it becomes the cache length that
// keeps t and the accepted drafts. out: (n + 1,) int32. One thread.
extern "C" __global__ void spec_accept(const int* __restrict__ ids, const int* __restrict__ best, int n,
                                       int* __restrict__ out, int* pos) {
    pdl_trigger();
    pdl_wait();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int m = 0;
    while (m + 1 < n && ids[m + 1] == best[m]) {
        out[m + 1] = ids[m + 1];
        ++m;
    }
    out[0] = m;
    out[m + 1] = best[m];
    pos[0] += 1 + m;
}
