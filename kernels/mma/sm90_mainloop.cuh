#pragma once
// Mainloop policy of the SM90 grouped GEMM core (impls/sm90_bf16_grouped_gemm.cuh): how one
// consumer warpgroup turns the k-blocks of a tile, as they arrive in the smem ring, into fp32
// accumulators.
//
// Mainloop contract (Traits: layout/sm90_gemm.cuh's GemmTraits):
//   static constexpr uint32_t kNumAccum;     accumulators per thread of one 64-row slice
//   template <class Pipe> static uint32_t mma(float (&acc)[kNumAccum], const Pipe&, PipelineState&,
//       uint32_t num_k_blocks, const StageLayout&, uint32_t slice, uint32_t lane);
//     issues the tile's k-blocks for the 64-row slice `slice` of the A stages (waiting on each stage's
//     full barrier, freeing each stage once its wgmmas are done except the last), returns the
//     last stage;
//   template <class Pipe> static void finish(float (&acc)[kNumAccum], const Pipe&, uint32_t last_stage,
//       uint32_t num_k_blocks, uint32_t lane);   waits for the last wgmmas and frees their stage.
// An fp8 mainloop (QGMMA, per-128-K promotion, scale loads) is another policy with this contract.

#include <cstdint>

#include <common/sm90_utils.cuh>
#include <layout/sm90_gemm.cuh>
#include <mma/sm90_desc.cuh>
#include <mma/sm90_wgmma.cuh>
#include <ptx/tma.cuh>
#include <ptx/wgmma.cuh>

namespace dge::gemm {

// bf16 x bf16 -> fp32 with wgmma m64nBLOCK_Nk16 from the 128B-swizzled stages. kGenericProxyWrites:
// the loader wrote the stage with ordinary stores (cp.async), which wgmma's async proxy must be
// fenced against.
template <class Traits, bool kGenericProxyWrites>
struct MainloopBF16 {
    using MMA = mma::WgmmaBF16<Traits::BLOCK_N, Traits::kMajorA, Traits::kMajorB>;
    using Stages = StageLayout<Traits::BLOCK_N, Traits::kNumStages>;
    static constexpr uint32_t kNumAccum = MMA::kNumAccum;

    template <class Pipe>
    __device__ __forceinline__ static uint32_t mma(float (&acc)[kNumAccum], const Pipe& pipe,
                                                   sm90::PipelineState<Traits::kNumStages>& st,
                                                   uint32_t num_k_blocks, const Stages& stages, uint32_t slice,
                                                   uint32_t lane) {
        uint32_t prev_stage = 0;
        for (uint32_t kb = 0; kb < num_k_blocks; ++kb) {
            pipe.consumer_wait(st);
            if constexpr (kGenericProxyWrites)
                ptx::fence_proxy_async_smem();  // the gathered rows were written by cp.async (generic proxy)
#pragma unroll
            for (uint32_t i = 0; i < kNumAccum; ++i)
                ptx::fence_operand(acc[i]);
            ptx::wgmma_fence();
#pragma unroll
            for (uint32_t k = 0; k < BLOCK_K / MMA::K; ++k) {
                const uint64_t desc_a = mma::tile_desc<Traits::kMajorA>(stages.a(st.stage), slice * 64, k);
                const uint64_t desc_b = mma::tile_desc<Traits::kMajorB>(stages.b(st.stage), 0, k);
                MMA::mma(acc, desc_a, desc_b, 1u);
            }
            ptx::wgmma_commit_group();
#pragma unroll
            for (uint32_t i = 0; i < kNumAccum; ++i)
                ptx::fence_operand(acc[i]);
            // Keep this k-block's wgmmas in flight; the previous one is done, free its stage.
            ptx::wgmma_wait_group<1>();
            if (kb > 0)
                pipe.consumer_release(prev_stage, lane);
            prev_stage = st.stage;
            st.advance();
        }
        return prev_stage;
    }

    template <class Pipe>
    __device__ __forceinline__ static void finish(float (&acc)[kNumAccum], const Pipe& pipe, uint32_t last_stage,
                                                  uint32_t num_k_blocks, uint32_t lane) {
        ptx::wgmma_wait_group<0>();
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i)
            ptx::fence_operand(acc[i]);
        if (num_k_blocks > 0)
            pipe.consumer_release(last_stage, lane);
    }
};

}  // namespace dge::gemm
