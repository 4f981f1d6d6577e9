#pragma once
// The one Hopper bf16 grouped GEMM core of the MoE kernels.
//
//   M-grouped (forward, dgrad):  C[r, :] = A[r, :] @ op(B[e])     for pool rows r of expert e
//     A  [P, K] K-major pool;  B [E, N, K] K-major ("nt") or [E, K, N] MN-major ("nn").
//   K-grouped (weight grads):    D[e] = A_e^T @ B_e, contracting over expert e's pool rows
//     A  [P, M] and B [P, N], both MN-major; D [E, M, N].
//
// Persistent, warp-specialized: warpgroup 2 is the producer (one thread issues the TMA loads of a
// kNumStages-deep smem ring), warpgroups 0 and 1 are consumers, each owning 64 rows of the
// 128 x BLOCK_N tile, issuing wgmma m64nBLOCK_Nk16 with fp32 accumulators in registers. The
// epilogue is a template hook that receives the accumulators with the tile's coordinates.
//
// Gathering prologue: one operand is not a pool but a token matrix x [T, C] (x for the L1 forward
// and dW1, dy for the L2 dgrad and dW2), and pool row r reads x[row_to_slot[r] / top_k]; padding
// rows (row_to_slot[r] < 0), slots past x and rows past the pool read zeros. Loaders:
//   GatherA::TmaRows  (M-grouped A) the first producer warp loads the 128 rows of each A stage as
//                     1-row TMA boxes (64 columns, 128 bytes) placed at row r * 128 of the stage:
//                     the 128B swizzle is a function of the shared memory address, so the rows land
//                     where one 128-row box would have put them; a row coordinate of -1 is out of
//                     bounds, which TMA fills with zeros (and still counts the bytes).
//   GatherA::CpAsync  (M-grouped K-major A, or K-grouped MN-major A) and kGatherB (K-grouped
//                     MN-major B): the whole producer warpgroup copies the stage with 16-byte
//                     cp.async, each thread one 32-byte sector of several rows (GatherLayout),
//                     writing each chunk at its swizzled position; each thread's copies arrive on
//                     the stage's full barrier (noinc), and the consumers fence the generic-proxy
//                     writes before wgmma reads them.
//
// kClusterN = 2 pairs CTAs on adjacent N blocks of one M block and multicasts A between them. It is
// correct but measured 0.6x of kClusterN = 1 on H200 (cause not yet found), so launchers use 1.

#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>

#include <common/sm90_utils.cuh>
#include <mma/sm90_desc.cuh>
#include <mma/sm90_wgmma.cuh>
#include <ptx/ld_st.cuh>
#include <ptx/mbarrier.cuh>
#include <ptx/sync.cuh>
#include <ptx/tma.cuh>
#include <ptx/wgmma.cuh>
#include <scheduler/sm90_grouped.cuh>

namespace dge::gemm {

using mma::Major;
using sched::GroupedGemmType;

constexpr uint32_t BLOCK_M = 128;
constexpr uint32_t BLOCK_K = 64;
constexpr uint32_t kNumConsumerWarpgroups = 2;
constexpr uint32_t kNumThreads = 128 * (kNumConsumerWarpgroups + 1);
// setmaxnreg budgets: 128 * 40 + 256 * 232 fits the 64K-register file of one CTA per SM.
constexpr uint32_t kProducerRegisters = 40;
constexpr uint32_t kConsumerRegisters = 232;
// Named barrier ids 1, 2 belong to the consumer warpgroups' epilogues (0 is __syncthreads).
constexpr uint32_t kEpilogueBarrierBase = 1;

enum class GatherA : uint32_t { None = 0, TmaRows = 1, CpAsync = 2 };

// Columns of the tile in the N space of B and of the output, in 64-wide chunks. With paired N
// tiling, chunks [0, BLOCK_N/128) are columns [n0, n0 + BLOCK_N/2) of the first half of N and the
// remaining chunks the same columns of the second half, so a SwiGLU epilogue finds the gate and
// up values of one output column in the same thread (accumulator i and i + kNumAccum/2).
template <uint32_t BLOCK_N, bool kPairedN>
struct TileColumns {
    static constexpr uint32_t kNumChunks = BLOCK_N / 64;
    uint32_t n0;
    uint32_t half_n;

    __device__ TileColumns(uint32_t n_block, uint32_t shape_n)
        : n0(n_block * (kPairedN ? BLOCK_N / 2 : BLOCK_N)), half_n(shape_n / 2) {}

    __device__ __forceinline__ uint32_t col(uint32_t chunk) const {
        if constexpr (kPairedN)
            return chunk < kNumChunks / 2 ? n0 + 64 * chunk : half_n + n0 + 64 * (chunk - kNumChunks / 2);
        else
            return n0 + 64 * chunk;
    }
};

// What an epilogue learns about the 64 x BLOCK_N slice its warpgroup holds.
template <uint32_t BLOCK_N, bool kPairedN>
struct EpilogueTile {
    TileColumns<BLOCK_N, kPairedN> cols;
    uint32_t row;           // first output row of the warpgroup's 64 rows (pool row, or e * M + m)
    uint32_t m_block;
    uint32_t n_block;
    uint32_t expert;
};

// Default epilogue: bf16 C through swizzled smem and TMA stores. Epilogue contract:
//   static constexpr uint32_t kSmemBytes;                  smem for all consumer warpgroups
//   Epilogue(uint32_t smem, uint32_t warpgroup, uint32_t thread_in_warpgroup);
//   template <uint32_t kNumAccum, class Tile> void operator()(const float (&acc)[kNumAccum],
//                                                            const Tile&, const EpiArgs&...);
//   void finish();                                         before the CTA exits
// The extra kernel arguments (EpiArgs...) are forwarded by reference, so CUtensorMap arguments
// keep their parameter-space address.
struct EpilogueStoreBF16 {
    static constexpr uint32_t kSmemBytes = kNumConsumerWarpgroups * sm90::WarpgroupChunkStore::kSmemBytes;
    sm90::WarpgroupChunkStore store;

    __device__ EpilogueStoreBF16(uint32_t smem, uint32_t warpgroup, uint32_t thread)
        : store(smem + warpgroup * sm90::WarpgroupChunkStore::kSmemBytes, kEpilogueBarrierBase + warpgroup, thread) {}

    template <uint32_t kNumAccum, class Tile>
    __device__ __forceinline__ void operator()(const float (&acc)[kNumAccum], const Tile& tile,
                                               const CUtensorMap& tma_c) {
#pragma unroll
        for (uint32_t chunk = 0; chunk < kNumAccum / 32; ++chunk) {
            uint32_t packed[16];
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i)
                packed[i] = ptx::pack_bf16x2(acc[chunk * 32 + 2 * i], acc[chunk * 32 + 2 * i + 1]);
            store.store(packed, &tma_c, tile.cols.col(chunk), tile.row);
        }
    }

    __device__ __forceinline__ void finish() { store.drain(); }
};

__device__ __forceinline__ uint32_t thread_in_wg_of(uint32_t thread) { return thread % 128; }

// Which rows and 16-byte chunks of a gathered stage each producer thread copies.
//   TmaRows (M-grouped A, one warp): lane l loads whole rows l + 32 i (i < 4).
//   CpAsync, M-grouped A (128 rows x 1 atom of 64 columns): thread t copies chunks 2 (t % 4) and
//     2 (t % 4) + 1 (one 32-byte sector) of rows t / 4 + 32 i (i < 4); a warp reads 8 whole rows.
//   CpAsync, K-grouped MN-major operand (64 pool rows x kAtoms atoms of 64 columns): a row has
//     4 kAtoms sectors; thread t copies sector t % (4 kAtoms) of rows t / (4 kAtoms) + step i.
template <bool kTmaRows, bool kKGrouped, uint32_t kAtoms>
struct GatherLayout {
    static constexpr uint32_t kSectorsPerRow = kKGrouped ? 4 * kAtoms : 4;
    static constexpr uint32_t kRowStep = kTmaRows ? 32 : 128 / kSectorsPerRow;
    static constexpr uint32_t kRows = kKGrouped ? 64 : 128;
    static constexpr uint32_t kRowsPerThread = kRows / kRowStep;
    static_assert(kRows % kRowStep == 0, "GatherLayout: rows must split evenly over the copiers");
    uint32_t first_row, sector;

    __device__ explicit GatherLayout(uint32_t thread)
        : first_row(kTmaRows ? thread % 32 : thread / kSectorsPerRow), sector(kTmaRows ? 0 : thread % kSectorsPerRow) {}
    __device__ __forceinline__ uint32_t row(uint32_t i) const { return first_row + kRowStep * i; }
    __device__ __forceinline__ uint32_t atom() const { return sector / 4; }         // 64-column atom
    __device__ __forceinline__ uint32_t chunk() const { return 2 * (sector % 4); }  // first 16-byte chunk in it
};

template <uint32_t BLOCK_N, uint32_t kNumStages, class Epilogue>
struct SmemLayout {
    static constexpr uint32_t kABytes = BLOCK_M * BLOCK_K * 2;
    static constexpr uint32_t kBBytes = BLOCK_N * BLOCK_K * 2;
    static constexpr uint32_t kStageBytes = kABytes + kBBytes;
    static constexpr uint32_t kEpilogueOffset = kNumStages * kStageBytes;
    static constexpr uint32_t kBarrierOffset = (kEpilogueOffset + Epilogue::kSmemBytes + 1023) / 1024 * 1024;
    static constexpr uint32_t kBarrierBytes = 2 * kNumStages * 8;
    // +1024: the dynamic smem base is aligned up to 1024 bytes at run time (128B swizzle atoms).
    static constexpr uint32_t kTotalBytes = kBarrierOffset + kBarrierBytes + 1024;
    static_assert(kTotalBytes <= 232448, "SmemLayout: tile, stages and epilogue exceed the 227 KiB of an SM90 CTA");
};

template <GroupedGemmType kType, Major kMajorA, Major kMajorB, uint32_t BLOCK_N, uint32_t kNumStages,
          uint32_t kClusterN, bool kPairedN, uint32_t kGroupM, GatherA kGatherA, bool kGatherB, class Epilogue,
          class... EpiArgs>
__global__ void __launch_bounds__(kNumThreads, 1)
sm90_bf16_grouped_gemm_kernel(const int* __restrict__ starts, const int* __restrict__ ends, uint32_t num_experts,
                              uint32_t shape_m, uint32_t shape_n, uint32_t shape_k,
                              const int* __restrict__ gather_row_to_slot, uint32_t gather_top_k,
                              const __nv_bfloat16* __restrict__ gather_x, uint32_t gather_x_rows,
                              const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                              const __grid_constant__ EpiArgs... epi_args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(kType != GroupedGemmType::MGroupedContiguous || kMajorA == Major::K,
                  "M-grouped GEMM: the pool A must be K-major");
    static_assert(kType != GroupedGemmType::KGroupedContiguous || (kMajorA == Major::MN && kMajorB == Major::MN),
                  "K-grouped GEMM: both operands are MN-major (rows of the pool are the contraction)");
    static_assert(!kPairedN || kType == GroupedGemmType::MGroupedContiguous, "paired N tiling is for M-grouped GEMMs");
    static_assert(BLOCK_N % 128 == 0, "BLOCK_N must be 128 or 256");
    static_assert(kClusterN == 1 || kClusterN == 2, "clusters of 1 or 2 CTAs along N");
    static_assert((kGatherA == GatherA::None && !kGatherB) || kClusterN == 1,
                  "the gathering prologue is for GEMMs without clusters");
    static_assert(!kGatherB || (kType == GroupedGemmType::KGroupedContiguous && kGatherA == GatherA::None),
                  "a gathered B is the MN-major operand of a K-grouped GEMM, and one operand is gathered at most");
    static_assert(kGatherA != GatherA::TmaRows || kType == GroupedGemmType::MGroupedContiguous,
                  "the 1-row TMA loader gathers the K-major A of M-grouped GEMMs only");
    constexpr bool kGatherTma = kGatherA == GatherA::TmaRows;
    constexpr bool kCpAsync = kGatherA == GatherA::CpAsync || kGatherB;
    constexpr bool kKGrouped = kType == GroupedGemmType::KGroupedContiguous;
    using Gather = GatherLayout<kGatherTma, kKGrouped, kGatherB ? BLOCK_N / 64 : 2>;
    const Gather gather(thread_in_wg_of(threadIdx.x));
    // Source row of a pool row: x's row, or -1 (a zero row) for padding, slots past x and rows past
    // the pool (`num_rows`: the pool's row count).
    auto gather_source = [&](uint32_t row, uint32_t num_rows) -> int32_t {
        const int slot = row < num_rows ? __ldg(gather_row_to_slot + row) : -1;
        const int src = slot >= 0 ? slot / static_cast<int>(gather_top_k) : -1;
        return src < static_cast<int>(gather_x_rows) ? src : -1;
    };

    using MMA = mma::WgmmaBF16<BLOCK_N, kMajorA, kMajorB>;
    using Layout = SmemLayout<BLOCK_N, kNumStages, Epilogue>;
    using Pipeline = sm90::TmaPipeline<kNumStages, kNumConsumerWarpgroups * 4, kClusterN,
                                       (kGatherA == GatherA::CpAsync || kGatherB) ? 128 : 0>;
    using Scheduler = sched::GroupedScheduler<kType, BLOCK_M, BLOCK_K, kGroupM, kClusterN>;
    constexpr uint32_t kNumBChunks = BLOCK_N / 64;

    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t smem = (ptx::smem_addr(smem_raw) + 1023) / 1024 * 1024;
    auto smem_a = [&](uint32_t stage) { return smem + stage * Layout::kABytes; };
    auto smem_b = [&](uint32_t stage) { return smem + kNumStages * Layout::kABytes + stage * Layout::kBBytes; };
    const Pipeline pipe(smem + Layout::kBarrierOffset);

    const uint32_t warpgroup = threadIdx.x / 128;
    const uint32_t thread_in_wg = threadIdx.x % 128;
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t cta_rank = kClusterN > 1 ? ptx::cluster_cta_rank() : 0;
    const uint32_t unit_begin = kClusterN > 1 ? ptx::cluster_id_x() : blockIdx.x;
    const uint32_t unit_stride = kClusterN > 1 ? ptx::num_clusters_x() : gridDim.x;
    const uint32_t num_n_blocks = kPairedN ? shape_n / BLOCK_N : (shape_n + BLOCK_N - 1) / BLOCK_N;

    if (threadIdx.x == 0)
        pipe.init();
    if constexpr (kClusterN > 1)
        ptx::cluster_sync();
    else
        __syncthreads();
    // Inputs may come from the previous kernel of the stream (programmatic dependent launch).
    asm volatile("griddepcontrol.wait;" ::: "memory");

    if (warpgroup == kNumConsumerWarpgroups) {
        // Producer warpgroup: one thread issues every TMA load. With a gathering prologue the whole
        // first warp (TmaRows) or the whole warpgroup (CpAsync) loads the gathered operand, and
        // thread 0 issues the TMA loads of the other one.
        ptx::setmaxnreg_dec<kProducerRegisters>();
        if (kCpAsync || (threadIdx.x / 32 == kNumConsumerWarpgroups * 4 && (kGatherTma || ptx::elect_one_sync()))) {
            const bool leader = kCpAsync ? thread_in_wg == 0 : (!kGatherTma || lane == 0);
            if (leader) {
                ptx::prefetch_tensormap(&tma_a);
                ptx::prefetch_tensormap(&tma_b);
            }
            Scheduler scheduler(starts, ends, num_experts, shape_m, num_n_blocks, shape_k, unit_begin, unit_stride,
                                cta_rank);
            sm90::PipelineState<kNumStages> st;
            sched::GroupedTile tile;
            while (scheduler.next(tile)) {
                const TileColumns<BLOCK_N, kPairedN> cols(tile.n_block, shape_n);
                // M-grouped: the tile's gathered rows are fixed for all its k-blocks.
                int32_t src_rows[Gather::kRowsPerThread];
                if constexpr (kGatherA != GatherA::None && !kKGrouped) {
#pragma unroll
                    for (uint32_t i = 0; i < Gather::kRowsPerThread; ++i)
                        src_rows[i] = gather_source(tile.m_block * BLOCK_M + gather.row(i), shape_m);
                }
                for (uint32_t kb = 0; kb < tile.num_k_blocks; ++kb, st.advance()) {
                    uint32_t full = pipe.full(st.stage);
                    const uint32_t k0 = kb * BLOCK_K;
                    if constexpr (kCpAsync) {
                        // K-grouped: this k-block's 64 pool rows (looked up before the wait).
                        if constexpr (kKGrouped) {
#pragma unroll
                            for (uint32_t i = 0; i < Gather::kRowsPerThread; ++i)
                                src_rows[i] = gather_source(tile.k_row + k0 + gather.row(i), shape_k);
                        }
                        // Every copier waits for the slot; the leader announces the TMA bytes only.
                        ptx::mbarrier_wait(pipe.empty(st.stage), st.phase ^ 1);
                        if (leader)
                            ptx::mbarrier_arrive_expect_tx(full, kGatherB ? Layout::kABytes : Layout::kBBytes);
                        const uint32_t dst = kGatherB ? smem_b(st.stage) : smem_a(st.stage);
#pragma unroll
                        for (uint32_t i = 0; i < Gather::kRowsPerThread; ++i) {
                            const uint32_t r = gather.row(i);
                            uint32_t col0, width;
                            if constexpr (!kKGrouped) {
                                col0 = k0;                                        // K-major A
                                width = shape_k;
                            } else if constexpr (kGatherB) {
                                col0 = cols.col(gather.atom());                   // MN-major B
                                width = shape_n;
                            } else {
                                col0 = tile.m_block * BLOCK_M + gather.atom() * 64;  // MN-major A
                                width = shape_m;
                            }
#pragma unroll
                            for (uint32_t c = gather.chunk(); c < gather.chunk() + 2; ++c) {
                                const uint32_t col = col0 + c * 8;  // rows are multiples of 8 columns
                                const bool live = src_rows[i] >= 0 && col < width;
                                const __nv_bfloat16* ptr =
                                    gather_x + (live ? static_cast<uint64_t>(src_rows[i]) * width + col : 0);
                                ptx::cp_async_16(dst + gather.atom() * mma::kAtomBytes + r * 128 + ((c ^ (r % 8)) << 4),
                                                 ptr, live ? 16 : 0);
                            }
                        }
                        ptx::cp_async_mbarrier_arrive_noinc(full);
                        if (!leader)
                            continue;
                    } else if (leader) {
                        full = pipe.producer_acquire(st, Layout::kStageBytes);
                    }
                    if constexpr (kGatherTma) {
                        // The leader has seen the stage freed: only then may the lanes write it.
                        __syncwarp();
#pragma unroll
                        for (uint32_t i = 0; i < Gather::kRowsPerThread; ++i)
                            ptx::tma_load_2d(smem_a(st.stage) + gather.row(i) * 128, &tma_a, full,
                                             static_cast<int32_t>(k0), src_rows[i]);
                        if (!leader)
                            continue;
                    }
                    // A: two 64-wide atoms (rows of the pool for K-major, columns of M for MN-major);
                    // in a cluster each CTA loads one atom for both.
                    auto load_a = [&](uint32_t atom, uint16_t mask) {
                        int32_t col, row;
                        if constexpr (kMajorA == Major::K) {
                            col = static_cast<int32_t>(k0);
                            row = static_cast<int32_t>(tile.m_block * BLOCK_M + atom * 64);
                        } else {
                            col = static_cast<int32_t>(tile.m_block * BLOCK_M + atom * 64);
                            row = static_cast<int32_t>(tile.k_row + k0);
                        }
                        const uint32_t dst = smem_a(st.stage) + atom * mma::kAtomBytes;
                        if constexpr (kClusterN > 1)
                            ptx::tma_load_2d_multicast(dst, &tma_a, full, col, row, mask);
                        else
                            ptx::tma_load_2d(dst, &tma_a, full, col, row);
                    };
                    if constexpr (kGatherA != GatherA::None) {
                        // loaded above
                    } else if constexpr (kClusterN > 1) {
                        load_a(cta_rank, static_cast<uint16_t>((1u << kClusterN) - 1));
                    } else {
                        load_a(0, 0);
                        load_a(1, 0);
                    }
                    if constexpr (!kGatherB) {
#pragma unroll
                        for (uint32_t j = 0; j < kNumBChunks; ++j) {
                            int32_t col, row;
                            if constexpr (kMajorB == Major::K) {
                                col = static_cast<int32_t>(k0);
                                row = static_cast<int32_t>(tile.expert * shape_n + cols.col(j));
                            } else if constexpr (kType == GroupedGemmType::MGroupedContiguous) {
                                col = static_cast<int32_t>(cols.col(j));
                                row = static_cast<int32_t>(tile.expert * shape_k + k0);
                            } else {
                                col = static_cast<int32_t>(cols.col(j));
                                row = static_cast<int32_t>(tile.k_row + k0);
                            }
                            ptx::tma_load_2d(smem_b(st.stage) + j * mma::kAtomBytes, &tma_b, full, col, row);
                        }
                    }
                }
            }
        }
    } else {
        // Consumer warpgroups: wgmma on 64 rows each, then the epilogue hook.
        ptx::setmaxnreg_inc<kConsumerRegisters>();
        Scheduler scheduler(starts, ends, num_experts, shape_m, num_n_blocks, shape_k, unit_begin, unit_stride,
                            cta_rank);
        Epilogue epilogue(smem + Layout::kEpilogueOffset, warpgroup, thread_in_wg);
        sm90::PipelineState<kNumStages> st;
        sched::GroupedTile tile;
        while (scheduler.next(tile)) {
            // Zeroed rather than scale-d = 0 on the first wgmma: one definition of the accumulators
            // per tile keeps them in place across the loop, and empty K ranges store zeros.
            float acc[MMA::kNumAccum];
#pragma unroll
            for (uint32_t i = 0; i < MMA::kNumAccum; ++i)
                acc[i] = 0.0f;
            uint32_t prev_stage = 0;
            for (uint32_t kb = 0; kb < tile.num_k_blocks; ++kb) {
                pipe.consumer_wait(st);
                if constexpr (kCpAsync)
                    ptx::fence_proxy_async_smem();  // the gathered rows were written by cp.async (generic proxy)
#pragma unroll
                for (uint32_t i = 0; i < MMA::kNumAccum; ++i)
                    ptx::fence_operand(acc[i]);
                ptx::wgmma_fence();
#pragma unroll
                for (uint32_t k = 0; k < BLOCK_K / MMA::K; ++k) {
                    const uint64_t desc_a = mma::tile_desc<kMajorA>(smem_a(st.stage), warpgroup * 64, k);
                    const uint64_t desc_b = mma::tile_desc<kMajorB>(smem_b(st.stage), 0, k);
                    MMA::mma(acc, desc_a, desc_b, 1u);
                }
                ptx::wgmma_commit_group();
#pragma unroll
                for (uint32_t i = 0; i < MMA::kNumAccum; ++i)
                    ptx::fence_operand(acc[i]);
                // Keep this k-block's wgmmas in flight; the previous one is done, free its stage.
                ptx::wgmma_wait_group<1>();
                if (kb > 0)
                    pipe.consumer_release(prev_stage, lane);
                prev_stage = st.stage;
                st.advance();
            }
            ptx::wgmma_wait_group<0>();
#pragma unroll
            for (uint32_t i = 0; i < MMA::kNumAccum; ++i)
                ptx::fence_operand(acc[i]);
            if (tile.num_k_blocks > 0)
                pipe.consumer_release(prev_stage, lane);

            const uint32_t tile_row = kType == GroupedGemmType::MGroupedContiguous
                                          ? tile.m_block * BLOCK_M
                                          : tile.expert * shape_m + tile.m_block * BLOCK_M;
            const EpilogueTile<BLOCK_N, kPairedN> epi_tile{TileColumns<BLOCK_N, kPairedN>(tile.n_block, shape_n),
                                                           tile_row + warpgroup * 64, tile.m_block, tile.n_block,
                                                           tile.expert};
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
