#pragma once
// The one Hopper grouped GEMM core of the MoE kernels.
//
//   M-grouped (forward, dgrad):  C[r, :] = A[r, :] @ op(B[e])     for pool rows r of expert e
//     A  [P, K] K-major pool;  B [E, N, K] K-major ("nt") or [E, K, N] MN-major ("nn").
//   K-grouped (weight grads):    D[e] = A_e^T @ B_e, contracting over expert e's pool rows
//     A  [P, M] and B [P, N], both MN-major; D [E, M, N].
//
// Persistent, warp-specialized skeleton: warpgroup 2 is the producer, filling a kNumStages-deep
// smem ring in tile order through the Loader policy (loader/sm90_gemm_loaders.cuh: TMA, or A's rows
// gathered by cp.async); warpgroups 0 and 1 are consumers, running the Mainloop policy
// (mma/sm90_mainloop.cuh: bf16 wgmma m64nBLOCK_Nk16 into fp32 registers) and handing the
// accumulators of its 64-row slice with the tile's coordinates to the Epilogue policy (epilogue/:
// TMA stores, slot scatter). Both consumers work on every 128 x BLOCK_N tile, 64 rows each. The
// operand element type is the traits' (kElement): bf16 with MainloopBF16, or blockwise-scaled e4m3
// with MainloopFP8 (mma/sm90_mainloop_fp8.cuh: e4m3 wgmma m64n128k32, the partial sum of each
// 128-wide k-block promoted into the fp32 accumulators with its scales); the loaders, scheduler and
// epilogues are shared. The problem itself is GemmTraits (layout/sm90_gemm.cuh); the tile order is
// the scheduler's (scheduler/sm90_grouped.cuh).
//
// Clusters (GemmTraits::kClusterN = 2 CTAs per cluster, launched with a cluster dimension of 2):
// the two CTAs take adjacent M blocks of one N block and multicast the shared B tile, each loading
// half of it into both (scheduler/sm90_grouped.cuh has the pairing, its tails and the pairs that
// cannot share). Each CTA's empty barriers count the consumer warps of both CTAs, since a producer
// may overwrite its half of B in both CTAs only once both consumers have freed the stage. Each
// output element is the same fp32 sum in the same K order as without clusters (same wgmmas on the
// same stage contents), so the results are equal bit for bit.
//
// Why the first clustered version ran at 0.4-0.66x of one CTA per cluster: the consumers' release
// of a stage to the peer was an `mbarrier.arrive.release.cluster` on the remote barrier, which
// ptxas turns into MEMBAR.ALL.CTA + MEMBAR.ALL.GPU + ERRBAR + CGAERRBAR before each arrival. Every
// consumer warp thus waited for a GPU-scope fence once per k-block, between one k-block's wgmmas
// and the next, with only one k-block of wgmmas in flight (wait_group 1): the tensor cores ran dry
// at each fence. The arrival now has the default CTA-scope release (ptx/mbarrier.cuh), one
// SYNCS.ARRIVE per warp, which is all the hand-back of a stage needs. The other suspects were
// checked and are sound: no cluster barrier but at the kernel's start and end; the CTAs of a
// cluster issue disjoint halves of the shared operand; expect_tx counts the whole stage in each
// CTA; the launcher's grid is a multiple of the cluster size, capped by the driver's count of
// co-resident clusters (jit/runtime.py: Kernel.max_active_clusters); the cluster dimension reaches
// cuLaunchKernelEx as CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION; setmaxnreg is per warpgroup and
// unaffected. The pairing itself moved from N to M: an odd N-block count (N = 768 at 256-wide
// tiles) would have left the second CTA of every M block's last pair without work, and B is the
// larger operand of the 128 x 256 tile.

#include <cstdint>
#include <type_traits>
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

// Calls f with all but the first kDrop of `args` (by reference: CUtensorMap arguments keep their
// parameter-space address).
template <uint32_t kDrop>
struct DropArgs {
    template <class F, class First, class... Rest>
    __device__ __forceinline__ static void apply(F&& f, const First&, const Rest&... rest) {
        DropArgs<kDrop - 1>::apply(f, rest...);
    }
};
template <>
struct DropArgs<0> {
    template <class F, class... Rest>
    __device__ __forceinline__ static void apply(F&& f, const Rest&... rest) {
        f(rest...);
    }
};

// An epilogue's per-slice state read before the tile's mainloop (Epilogue::Prefetch, e.g. the
// destination rows of a combine epilogue), so that its global loads are in flight under the wgmmas
// instead of after them; NoPrefetch where the epilogue defines none.
struct NoPrefetch {};
template <class E, class = void>
struct PrefetchOf {
    using Type = NoPrefetch;
    static constexpr bool kEnabled = false;
};
template <class E>
struct PrefetchOf<E, std::void_t<typename E::Prefetch>> {
    using Type = typename E::Prefetch;
    static constexpr bool kEnabled = true;
};

// The producer's loader: the constructor takes the loader's leading kernel arguments, if any
// (Loader::kNumArgs; the waiting loader's), after the thread index.
template <class Load, class Stages, class... Extra>
__device__ __forceinline__ Load make_loader(const LoaderArgs& args, const Stages& stages, uint32_t thread,
                                            const Extra&... extra) {
    if constexpr (Load::kNumArgs == 0)
        return Load(args, stages, thread);
    else
        return Load(args, stages, thread, extra...);
}

// Kernel arguments: the expert ranges and problem size, the loader's gather arguments (row map,
// top_k, token matrix and its row count; placeholders for LoaderTma), the operand maps, then the
// loader's own arguments (Loader::kNumArgs: only the waiting loader has any; never with a mainloop
// that has arguments), the mainloop's arguments (Mainloop::kNumArgs of them: none for bf16, the
// scales for fp8), then the epilogue's.
template <class Traits, template <class> class Loader, template <class, bool> class Mainloop, class Epilogue,
          class... ExtraArgs>
__global__ void __launch_bounds__(kNumThreads, 1)
sm90_grouped_gemm_kernel(const int* __restrict__ starts, const int* __restrict__ ends, uint32_t num_experts,
                         uint32_t shape_m, uint32_t shape_n, uint32_t shape_k,
                         const int* __restrict__ gather_row_to_slot, uint32_t gather_top_k,
                         const __nv_bfloat16* __restrict__ gather_x, uint32_t gather_x_rows,
                         const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                         const __grid_constant__ ExtraArgs... extra_args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using Load = Loader<Traits>;
    using MMA = Mainloop<Traits, Load::kGenericProxyWrites>;
    using Layout = SmemLayout<Traits::BLOCK_N, Traits::kNumStages, Epilogue, MMA::kSmemBytes>;
    // A mainloop with a producer part (MMA::kProducerArrivals > 0: the fp8 mainloop's scale copies)
    // runs it in the producer warpgroup's second warp, which the TMA loaders leave idle.
    static_assert(MMA::kProducerArrivals == 0 || Load::kCopyArrivals == 0,
                  "a mainloop's producer warp needs a loader that runs in the producer's first warp only");
    using Pipeline = sm90::TmaPipeline<Traits::kNumStages, kNumConsumerWarpgroups * 4, Traits::kClusterN,
                                       Load::kCopyArrivals + MMA::kProducerArrivals>;
    using Scheduler =
        sched::GroupedScheduler<Traits::kType, BLOCK_M, Traits::kBlockK, Traits::kGroupM, Traits::kClusterN,
                                Load::kOrderedM, Traits::kExpertGroups>;
    using Columns = TileColumns<Traits::BLOCK_N, Traits::kPairedN>;
    constexpr uint32_t kClusterN = Traits::kClusterN;
    static_assert(Load::kNumArgs == 0 || MMA::kNumArgs == 0, "a loader with kernel arguments takes the bf16 mainloop");
    constexpr uint32_t kLeadingArgs = Load::kNumArgs + MMA::kNumArgs;  // before the epilogue's

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
    // K compiled in: the argument has the same value (the launcher builds the configuration from it);
    // the constant lets the scheduler and the mainloop know the trip count.
    if constexpr (Traits::kShapeK != 0)
        shape_k = Traits::kShapeK;
    // M-grouped: the experts' block ranges in shared memory for every scheduler below, where they fit.
    // Not with the cp.async gathers, whose four warps run the loader on the producer's 40 registers:
    // with the staging in the kernel, those spilled.
    uint32_t expert_table = 0;
    if constexpr (Traits::kType == GroupedGemmType::MGroupedContiguous && Load::kCopyArrivals == 0) {
        const uint32_t table = smem + Layout::kExpertTableOffset;
        const bool fits = num_experts <= sched::kStagedExperts;
        const bool ok = fits && sched::stage_expert_blocks<BLOCK_M>(table, starts, ends, num_experts, threadIdx.x,
                                                                    kNumThreads);
        if (__syncthreads_and(ok))
            expert_table = table;
    }

    if (warpgroup == kNumConsumerWarpgroups) {
        // Producer warpgroup: the threads the loader names walk the tiles and fill the ring.
        ptx::setmaxnreg_dec<kProducerRegisters>();
        if (Load::runs(threadIdx.x / 32)) {
            const LoaderArgs args{shape_m, shape_n, shape_k, gather_row_to_slot, gather_top_k, gather_x,
                                  gather_x_rows, tma_a, tma_b, cta_rank};
            Load loader = make_loader<Load>(args, stages, thread_in_wg, extra_args...);
            if (loader.leader) {
                ptx::prefetch_tensormap(&tma_a);
                ptx::prefetch_tensormap(&tma_b);
            }
            Scheduler scheduler(starts, ends, num_experts, shape_m, num_n_blocks, shape_k, unit_begin, unit_stride,
                                cta_rank);
            if constexpr (Load::kOrderedM)
                scheduler.m_order = Load::m_order(extra_args...);
            scheduler.expert_table = expert_table;
            sm90::PipelineState<Traits::kNumStages> st;
            sched::GroupedTile tile;
            while (scheduler.next(tile)) {
                const Columns cols(tile.n_block, shape_n);
                loader.begin_tile(tile);
                // K compiled in: the trip count is hidden from the optimizer, so that the producer's
                // loop stays rolled (unrolled over the tile it spilled at 40 registers for some K).
                uint32_t num_k_blocks = tile.num_k_blocks;
                if constexpr (Traits::kShapeK != 0)
                    asm volatile("mov.u32 %0, %1;" : "=r"(num_k_blocks) : "r"(num_k_blocks));
                for (uint32_t kb = 0; kb < num_k_blocks; ++kb, st.advance())
                    loader.load(pipe, st, tile, cols, kb);
            }
        } else if constexpr (MMA::kProducerArrivals > 0) {
            if (threadIdx.x / 32 == kNumConsumerWarpgroups * 4 + 1) {
                // The same tiles in the same order as the loader and the consumers.
                Scheduler scheduler(starts, ends, num_experts, shape_m, num_n_blocks, shape_k, unit_begin,
                                    unit_stride, cta_rank);
                scheduler.expert_table = expert_table;
                const typename MMA::Params mainloop_params(smem + Layout::kMainloopOffset, shape_m, shape_n, shape_k,
                                                           extra_args...);
                MMA::produce(pipe, scheduler, mainloop_params, lane);
            }
        }
    } else {
        // Consumer warpgroups: the mainloop on the warpgroup's slice of a tile, then the epilogue.
        ptx::setmaxnreg_inc<kConsumerRegisters>();
        Scheduler scheduler(starts, ends, num_experts, shape_m, num_n_blocks, shape_k, unit_begin, unit_stride,
                            cta_rank);
        if constexpr (Load::kOrderedM)  // the producer's order: both walk the same tiles
            scheduler.m_order = Load::m_order(extra_args...);
        scheduler.expert_table = expert_table;
        Epilogue epilogue(smem + Layout::kEpilogueOffset, warpgroup, thread_in_wg);
        // The mainloop reads its leading kernel arguments; the epilogue gets the rest.
        const typename MMA::Params mainloop_params(smem + Layout::kMainloopOffset, shape_m, shape_n, shape_k,
                                                   extra_args...);
        sm90::PipelineState<Traits::kNumStages> st;
        sched::GroupedTile tile;
        // `during`: work the mainloop runs once while the tile's first k-block is in the tensor cores
        // (the next tile's scheduling; mainloop contract in mma/sm90_mainloop.cuh).
        auto consume = [&](const sched::GroupedTile& t, const auto& during) {
            // Zeroed rather than scale-d = 0 on the first wgmma: one definition of the accumulators
            // per tile keeps them in place across the loop, and empty K ranges store zeros.
            float acc[MMA::kNumAccum];
#pragma unroll
            for (uint32_t i = 0; i < MMA::kNumAccum; ++i)
                acc[i] = 0.0f;
            auto epi_tile = [&]() {
                const uint32_t tile_row = Traits::kType == GroupedGemmType::MGroupedContiguous
                                              ? t.m_block * BLOCK_M
                                              : t.expert * shape_m + t.m_block * BLOCK_M;
                return EpilogueTile<Traits::BLOCK_N, Traits::kPairedN>{
                    Columns(t.n_block, shape_n), tile_row + warpgroup * 64, t.m_block, t.n_block, t.expert};
            };
            // The epilogue's own arguments: the kernel's extra arguments after the leading ones.
            auto with_epilogue_args = [&](const auto& f) {
                if constexpr (kLeadingArgs == 0)
                    f(extra_args...);
                else
                    DropArgs<kLeadingArgs>::apply(f, extra_args...);
            };
            using Prefetch = PrefetchOf<Epilogue>;
            typename Prefetch::Type prefetched;
            if constexpr (Prefetch::kEnabled)
                with_epilogue_args([&](const auto&... rest) { prefetched = epilogue.prefetch(epi_tile(), rest...); });
            const uint32_t last_stage = MMA::mma(acc, pipe, st, t, mainloop_params, stages, warpgroup, lane, during);
            MMA::finish(acc, pipe, last_stage, t.num_k_blocks, lane);

            // A duplicate of the cluster partner's tile (scheduler): run for the barriers, not stored.
            if constexpr (kClusterN > 1) {
                if (!t.store)
                    return;
            }
            if constexpr (Prefetch::kEnabled)
                with_epilogue_args([&](const auto&... rest) { epilogue(acc, epi_tile(), prefetched, rest...); });
            else
                with_epilogue_args([&](const auto&... rest) { epilogue(acc, epi_tile(), rest...); });
        };
        // The next tile is found while this one's first k-block runs, not between the two tiles with
        // the tensor cores idle (the search and the index arithmetic were ~14% of a consumer's time
        // at K = 768, ncu). A tile with no k-blocks runs no wgmma: its successor is found after it.
        // Not in the fp8 kernels where the search, inlined beside two accumulator sets in flight,
        // made ptxas spill: clusters of 2, and a whole tile unrolled per start stage (K compiled in,
        // the ring not dividing its k-blocks) past 6 k-blocks (7 to 15 of them spilled 272-1276
        // bytes with the store epilogue). The K-grouped fp8 GEMM takes it since its column scales
        // are staged in shared memory (they had been 32 more registers across the loop).
        constexpr bool kUnrolledTile = Traits::kShapeK != 0 && !Traits::kStaticRing;
        constexpr bool kLookahead =
            !(Traits::kElement == ElementType::E4M3 && (kClusterN > 1 || (kUnrolledTile && Traits::kNumKBlocks > 6)));
        if constexpr (kLookahead) {
            bool have = scheduler.next(tile);
            while (have) {
                sched::GroupedTile next;
                bool have_next = false, found = false;
                consume(tile, [&]() {
                    have_next = scheduler.next(next);
                    found = true;
                });
                if (!found)
                    have_next = scheduler.next(next);
                tile = next;
                have = have_next;
            }
        } else {
            while (scheduler.next(tile))
                consume(tile, [] {});
        }
        epilogue.finish();
    }

    // Peers multicast into this CTA's smem and arrive on its barriers until their last stage.
    if constexpr (kClusterN > 1)
        ptx::cluster_sync();
#endif
}

}  // namespace dge::gemm
