#pragma once
// Mainloop policy of the SM90 grouped GEMM core (impls/sm90_bf16_grouped_gemm.cuh): how one
// consumer warpgroup turns the k-blocks of a tile, as they arrive in the smem ring, into fp32
// accumulators.
//
// Mainloop contract (Traits: layout/sm90_gemm.cuh's GemmTraits):
//   static constexpr uint32_t kNumAccum;     accumulators per thread of one 64-row slice
//   static constexpr uint32_t kNumArgs;      kernel arguments the mainloop reads: the first kNumArgs
//                                            after the core's (the epilogue gets the rest)
//   static constexpr uint32_t kSmemBytes;    shared memory of its own (SmemLayout's mainloop bytes)
//   static constexpr uint32_t kProducerArrivals;  arrivals of its producer warp on each full barrier
//                                            (0: none; else the kernel runs produce() below in the
//                                            producer warpgroup's second warp)
//   struct Params;                           what it keeps of them, built once per consumer thread:
//       Params(uint32_t smem, uint32_t shape_m, uint32_t shape_n, uint32_t shape_k, const Args&... args)
//       from its smem bytes' address, the problem size and the kernel's trailing arguments
//       (mainloop's, then epilogue's)
//   template <class Pipe, class Scheduler> static void produce(const Pipe&, Scheduler&, const Params&,
//       uint32_t lane);                      (kProducerArrivals > 0 only) fills its part of each stage
//                                            for the scheduler's tiles, arriving on the full barriers
//   template <class Pipe, class During> static uint32_t mma(float (&acc)[kNumAccum],
//       const Pipe&, PipelineState&, const GroupedTile&, const Params&, const StageLayout&,
//       uint32_t slice, uint32_t lane, const During& during);
//     adds the tile's num_k_blocks k-blocks for the 64-row slice `slice` (the warpgroup's) of the A
//     stages into acc (zeroed by the caller), waiting on each stage's full barrier and freeing each
//     stage once its wgmmas are done (the last one may stay held for finish), returns the last
//     stage; calls during() once, after the first k-block's wgmmas are issued and before it waits
//     for them (not at all when there are no k-blocks);
//   template <class Pipe> static void finish(float (&acc)[kNumAccum],
//       const Pipe&, uint32_t last_stage, uint32_t num_k_blocks, uint32_t lane);
//     waits for wgmmas still in flight and frees the stage mma left held, if any.
// MainloopBF16 is below; MainloopFP8 (blockwise-scaled e4m3, per-128-K promotion) is in
// mma/sm90_mainloop_fp8.cuh.

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
    static constexpr uint32_t kNumArgs = 0;
    static constexpr uint32_t kSmemBytes = 0;
    static constexpr uint32_t kProducerArrivals = 0;
    static_assert(Traits::kElement == ElementType::BF16, "MainloopBF16: bf16 operands");

    struct Params {
        template <class... Args>
        __device__ Params(uint32_t, uint32_t, uint32_t, uint32_t, const Args&...) {}
    };

    template <class Pipe, class During>
    __device__ __forceinline__ static uint32_t mma(float (&acc)[kNumAccum], const Pipe& pipe,
                                                   sm90::PipelineState<Traits::kNumStages>& st,
                                                   const sched::GroupedTile& tile, const Params&,
                                                   const Stages& stages, uint32_t slice, uint32_t lane,
                                                   const During& during) {
        const uint32_t num_k_blocks = tile.num_k_blocks;
        uint32_t prev_stage = 0;
        for (uint32_t kb = 0; kb < num_k_blocks; ++kb) {
            pipe.consumer_wait(st);
            if constexpr (kGenericProxyWrites)
                ptx::fence_proxy_async_smem();  // the gathered rows were written by cp.async (generic proxy)
            mma::fence_accumulators(acc);
            ptx::wgmma_fence();
#pragma unroll
            for (uint32_t k = 0; k < BLOCK_K / MMA::K; ++k) {
                const uint64_t desc_a = mma::tile_desc<Traits::kMajorA>(stages.a(st.stage), slice * 64, k);
                const uint64_t desc_b = mma::tile_desc<Traits::kMajorB>(stages.b(st.stage), 0, k);
                MMA::mma(acc, desc_a, desc_b, 1u);
            }
            ptx::wgmma_commit_group();
            mma::fence_accumulators(acc);
            if (kb == 0)
                during();
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
    __device__ __forceinline__ static void finish(float (&acc)[kNumAccum], const Pipe& pipe,
                                                  uint32_t last_stage, uint32_t num_k_blocks, uint32_t lane) {
        ptx::wgmma_wait_group<0>();
        mma::fence_accumulators(acc);
        if (num_k_blocks > 0)
            pipe.consumer_release(last_stage, lane);
    }
};

}  // namespace dge::gemm
