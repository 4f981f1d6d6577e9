#pragma once
// mbarrier wrappers (PTX ISA "Parallel synchronization: mbarrier"). All addresses are 32-bit
// shared-window addresses so the caller converts once, not at every wait.

#include <cstdint>

namespace dge::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(arrive_count) : "memory");
}

// Makes initialised barriers visible to the async proxy (TMA) and to peer CTAs of the cluster.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// Arrive on the barrier at the same smem offset in CTA `cta_rank` of the cluster, with the
// default (release at CTA scope) semantics. This is for a consumer handing a stage back: what it
// orders is the completion of its wgmma reads of the stage (wgmma.wait_group has already retired
// them), not data that the peer must see, so no cluster-scope release is needed. Written as
// `mbarrier.arrive.release.cluster`, ptxas emits MEMBAR.ALL.CTA + MEMBAR.ALL.GPU + ERRBAR +
// CGAERRBAR before every arrival: a GPU-wide memory fence per consumer warp per k-block, which
// stalls the warp between its wgmma batches (the slowdown of the first clustered GEMMs). This form
// compiles to the single SYNCS.ARRIVE.TRANS64.RED of the remote arrival.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar, uint32_t cta_rank) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" :: "r"(bar), "r"(cta_rank) : "memory");
}

// One arrival that also announces `bytes` of TMA traffic landing on this barrier's phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}

// try_wait suspends in hardware for a while before returning false, so a plain loop does not
// hammer the barrier. Test builds define DGE_HANG_TRAP_CYCLES to turn a lost arrival (a hang)
// into a trap (the launch fails with an illegal-instruction error) after that many SM cycles.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#ifdef DGE_HANG_TRAP_CYCLES
    if (mbarrier_try_wait(bar, parity))
        return;
    const long long start = clock64();
    while (!mbarrier_try_wait(bar, parity)) {
        if (clock64() - start > static_cast<long long>(DGE_HANG_TRAP_CYCLES))
            __trap();
    }
#else
    while (!mbarrier_try_wait(bar, parity)) {
    }
#endif
}

}  // namespace dge::ptx
