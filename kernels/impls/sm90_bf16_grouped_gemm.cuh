#pragma once
// The one Hopper grouped GEMM core of the MoE kernels.
//
//   M-grouped (forward, dgrad):  C[r, :] = A[r, :] @ op(B[e])     for pool rows r of expert e
//     A  [P, K] K-major pool;  B [E, N, K] K-major ("nt") or [E, K, N] MN-major ("nn").
//   K-grouped (weight grads):    D[e] = A_e^T @ B_e, contracting over expert e's pool rows
//     A  [P, M] and B [P, N], both MN-major; D [E, M, N].
//
// Persistent, warp-specialized skeleton: warpgroup 2 is the producer, filling a kNumStages-deep
// smem ring through the Loader policy (loader/sm90_gemm_loaders.cuh: TMA, gathered TMA rows or a
// cp.async gather); warpgroups 0 and 1 are consumers, each owning 64 rows of the 128 x BLOCK_N
// tile, running the Mainloop policy (mma/sm90_mainloop.cuh: bf16 wgmma m64nBLOCK_Nk16 into fp32
// registers) and handing the accumulators with the tile's coordinates to the Epilogue policy
// (epilogue/: TMA stores, slot scatter, SwiGLU). The problem itself is GemmTraits
// (layout/sm90_gemm.cuh); the tile order is the scheduler's (scheduler/sm90_grouped.cuh).
//
// kClusterN = 2 pairs CTAs on adjacent N blocks of one M block and multicasts A between them. It is
// correct but measured 0.6x of kClusterN = 1 on H200 (cause not yet found), so launchers use 1.

#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>

#include <common/sm90_utils.cuh>
#include <epilogue/sm90_store_bf16.cuh>
#include <layout/sm90_gemm.cuh>
#include <loader/sm90_gemm_loaders.cuh>
#include <mma/sm90_mainloop.cuh>
#include <ptx/mbarrier.cuh>
#include <ptx/sync.cuh>
#include <ptx/tma.cuh>
#include <scheduler/sm90_grouped.cuh>

namespace dge::gemm {

// Kernel arguments: the expert ranges and problem size, the loader's gather arguments (row map,
// top_k, token matrix and its row count; placeholders for LoaderTma), the operand maps, then the
// epilogue's arguments.
template <class Traits, template <class> class Loader, template <class, bool> class Mainloop, class Epilogue,
          class... EpiArgs>
__global__ void __launch_bounds__(kNumThreads, 1)
sm90_grouped_gemm_kernel(const int* __restrict__ starts, const int* __restrict__ ends, uint32_t num_experts,
                         uint32_t shape_m, uint32_t shape_n, uint32_t shape_k,
                         const int* __restrict__ gather_row_to_slot, uint32_t gather_top_k,
                         const __nv_bfloat16* __restrict__ gather_x, uint32_t gather_x_rows,
                         const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                         const __grid_constant__ EpiArgs... epi_args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using Load = Loader<Traits>;
    using MMA = Mainloop<Traits, Load::kGenericProxyWrites>;
    using Layout = SmemLayout<Traits::BLOCK_N, Traits::kNumStages, Epilogue>;
    using Pipeline = sm90::TmaPipeline<Traits::kNumStages, kNumConsumerWarpgroups * 4, Traits::kClusterN,
                                       Load::kCopyArrivals>;
    using Scheduler = sched::GroupedScheduler<Traits::kType, BLOCK_M, BLOCK_K, Traits::kGroupM, Traits::kClusterN>;
    using Columns = TileColumns<Traits::BLOCK_N, Traits::kPairedN>;
    constexpr uint32_t kClusterN = Traits::kClusterN;

    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t smem = (ptx::smem_addr(smem_raw) + 1023) / 1024 * 1024;
    const typename Layout::Stages stages{smem};
    const Pipeline pipe(smem + Layout::kBarrierOffset);

    const uint32_t warpgroup = threadIdx.x / 128;
    const uint32_t thread_in_wg = threadIdx.x % 128;
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t cta_rank = kClusterN > 1 ? ptx::cluster_cta_rank() : 0;
    const uint32_t unit_begin = kClusterN > 1 ? ptx::cluster_id_x() : blockIdx.x;
    const uint32_t unit_stride = kClusterN > 1 ? ptx::num_clusters_x() : gridDim.x;
    const uint32_t num_n_blocks =
        Traits::kPairedN ? shape_n / Traits::BLOCK_N : (shape_n + Traits::BLOCK_N - 1) / Traits::BLOCK_N;

    if (threadIdx.x == 0)
        pipe.init();
    if constexpr (kClusterN > 1)
        ptx::cluster_sync();
    else
        __syncthreads();
    // Inputs may come from the previous kernel of the stream (programmatic dependent launch).
    asm volatile("griddepcontrol.wait;" ::: "memory");

    if (warpgroup == kNumConsumerWarpgroups) {
        // Producer warpgroup: the threads the loader names walk the tiles and fill the ring.
        ptx::setmaxnreg_dec<kProducerRegisters>();
        if (Load::runs(threadIdx.x / 32)) {
            const LoaderArgs args{shape_m, shape_n, shape_k, gather_row_to_slot, gather_top_k, gather_x,
                                  gather_x_rows, tma_a, tma_b, cta_rank};
            Load loader(args, stages, thread_in_wg);
            if (loader.leader) {
                ptx::prefetch_tensormap(&tma_a);
                ptx::prefetch_tensormap(&tma_b);
            }
            Scheduler scheduler(starts, ends, num_experts, shape_m, num_n_blocks, shape_k, unit_begin, unit_stride,
                                cta_rank);
            sm90::PipelineState<Traits::kNumStages> st;
            sched::GroupedTile tile;
            while (scheduler.next(tile)) {
                const Columns cols(tile.n_block, shape_n);
                loader.begin_tile(tile);
                for (uint32_t kb = 0; kb < tile.num_k_blocks; ++kb, st.advance())
                    loader.load(pipe, st, tile, cols, kb);
            }
        }
    } else {
        // Consumer warpgroups: the mainloop on 64 rows each, then the epilogue.
        ptx::setmaxnreg_inc<kConsumerRegisters>();
        Scheduler scheduler(starts, ends, num_experts, shape_m, num_n_blocks, shape_k, unit_begin, unit_stride,
                            cta_rank);
        Epilogue epilogue(smem + Layout::kEpilogueOffset, warpgroup, thread_in_wg);
        sm90::PipelineState<Traits::kNumStages> st;
        sched::GroupedTile tile;
        while (scheduler.next(tile)) {
            // Zeroed rather than scale-d = 0 on the first wgmma: one definition of the accumulators
            // per tile keeps them in place across the loop, and empty K ranges store zeros.
            float acc[MMA::kNumAccum];
#pragma unroll
            for (uint32_t i = 0; i < MMA::kNumAccum; ++i)
                acc[i] = 0.0f;
            const uint32_t last_stage =
                MMA::mma(acc, pipe, st, tile.num_k_blocks, stages, warpgroup, lane);
            MMA::finish(acc, pipe, last_stage, tile.num_k_blocks, lane);

            const uint32_t tile_row = Traits::kType == GroupedGemmType::MGroupedContiguous
                                          ? tile.m_block * BLOCK_M
                                          : tile.expert * shape_m + tile.m_block * BLOCK_M;
            const EpilogueTile<Traits::BLOCK_N, Traits::kPairedN> epi_tile{Columns(tile.n_block, shape_n),
                                                                           tile_row + warpgroup * 64, tile.m_block,
                                                                           tile.n_block, tile.expert};
            epilogue(acc, epi_tile, epi_args...);
        }
        epilogue.finish();
    }

    // Peers multicast into this CTA's smem and arrive on its barriers until their last stage.
    if constexpr (kClusterN > 1)
        ptx::cluster_sync();
#endif
}

}  // namespace dge::gemm
