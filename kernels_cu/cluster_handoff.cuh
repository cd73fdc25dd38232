// Partial sums handed between the blocks of a thread-block cluster without a cluster-wide barrier
// (gemv_mma_staged.cu CL = 2): the writer stores into the reader's shared memory with st.async,
// each store counted on the reader's mbarrier (complete_tx), which the reader waits on; the reader
// gives its buffer back by arriving on the writer's mbarrier. PTX ISA: "st.async", "mbarrier".
#pragma once
#include "gemv_common.cuh"

__device__ __forceinline__ void mbar_init(unsigned long long* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((u32)__cvta_generic_to_shared(bar)), "r"(count) : "memory");
}

// This thread's arrival on bar (this block's), which also expects `bytes` of complete_tx.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((u32)__cvta_generic_to_shared(bar)), "r"(bytes)
                 : "memory");
}

// Until the phase of bar (this block's) with this parity has completed; acquire at cluster scope,
// so the peers' stores and releases that completed it are visible.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"((u32)__cvta_generic_to_shared(bar)), "r"(parity) : "memory");
}

// An arrival on the mbarrier at shared::cluster address bar (a peer's), releasing this thread's
// earlier memory operations at cluster scope.
__device__ __forceinline__ void mbar_arrive_remote(u32 bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}

// v stored at shared::cluster address dst (a peer's), its 16 bytes counted on the peer's mbarrier
// at shared::cluster address bar.
__device__ __forceinline__ void st_async_v4(u32 dst, const float (&v)[4], u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
                 "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(bar) : "memory");
}
