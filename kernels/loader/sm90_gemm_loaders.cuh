#pragma once
// Loader policies of the SM90 grouped GEMM core (impls/sm90_bf16_grouped_gemm.cuh): how the
// producer warpgroup fills a stage of the smem ring with the A and B blocks of a k-block.
//
// Loader contract (Traits: layout/sm90_gemm.cuh's GemmTraits):
//   static constexpr uint32_t kCopyArrivals;      arrivals on each full barrier besides the leader's
//                                                 arrive.expect_tx (TmaPipeline's extra arrivals)
//   static constexpr bool kGenericProxyWrites;    stages are written by generic-proxy stores, so the
//                                                 mainloop fences them before wgmma reads them
//   static bool runs(uint32_t warp);              which producer threads (warp: of the CTA) load
//   Loader(const LoaderArgs&, const Stages&, uint32_t thread_in_warpgroup);
//   bool leader;                                  the thread that issues the TMA loads
//   static constexpr uint32_t kNumArgs;           leading kernel arguments (after the core's) the
//                                                 loader reads: its constructor takes them after the
//                                                 thread index (LoaderGatherCpAsyncAwait's; 0 else)
//   static constexpr bool kOrderedM;              the scheduler walks the M blocks in the order
//                                                 Loader::m_order(kernel arguments...) gives (false
//                                                 but for LoaderGatherCpAsyncAwait)
//   void begin_tile(const GroupedTile&);          per-tile state (e.g. gathered source rows)
//   void load(const Pipe&, const PipelineState&, const GroupedTile&, const Columns&, uint32_t kb);
//     waits for the stage to be free and fills it; every thread that runs() calls it.
//
//   LoaderTma             both operands by TMA boxes of 64 rows x 128 bytes (64 x 64 bf16, 64 x 128
//                         e4m3; one thread; B multicast in clusters). K-grouped e4m3 reads the
//                         transposed pools At [M, P], Bt [N, P] K-major from the expert's first row.
//   LoaderGatherCpAsync   (M-grouped K-major A: the L1 forward): the whole producer warpgroup
//                         copies A's block with 16-byte cp.async, each thread two chunks of four
//                         rows (GatherLayout), issued so that each cp.async instruction of a warp
//                         reads whole 32-byte sectors, writing each chunk at its swizzled position;
//                         each thread's copies arrive on the stage's full barrier (noinc). B is a
//                         TMA load. (The K-grouped weight gradients read pools: a gather there
//                         re-read each row for every tile of its expert, docs/perf-notes.md v39.)
//   LoaderGatherCpAsyncAwait  LoaderGatherCpAsync of the M-grouped A whose token rows are still
//                         being written by the expert-parallel dispatch (DGE_EP_OVERLAP): before a
//                         tile's loads each producer warp waits until the source ranks of its rows
//                         have arrived (see the struct).
// Gathering loaders read A from a token matrix x [T, K] (x for the L1 forward): pool row r reads
// x[row_to_slot[r] / top_k]; padding rows (row_to_slot[r] < 0), slots past x and rows past the pool
// read zeros.

#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>

#include <common/sm90_utils.cuh>
#include <layout/sm90_gemm.cuh>
#include <mma/sm90_desc.cuh>
#include <ptx/ld_st.cuh>
#include <ptx/mbarrier.cuh>
#include <ptx/sync.cuh>
#include <ptx/tma.cuh>
#include <scheduler/sm90_grouped.cuh>

namespace dge::gemm {

// The kernel arguments a loader reads. The row map, top_k and the token matrix are the gathering
// loaders' (unused by LoaderTma).
struct LoaderArgs {
    uint32_t shape_m, shape_n, shape_k;
    const int* row_to_slot;
    uint32_t top_k;
    const __nv_bfloat16* x;
    uint32_t x_rows;
    const CUtensorMap& tma_a;
    const CUtensorMap& tma_b;
    uint32_t cta_rank;

    // Source row of a pool row: x's row, or -1 (a zero row) for padding, slots past x and rows past
    // the pool (`num_rows`: the pool's row count).
    __device__ __forceinline__ int32_t gather_source(uint32_t row, uint32_t num_rows) const {
        const int slot = row < num_rows ? __ldg(row_to_slot + row) : -1;
        const int src = slot >= 0 ? slot / static_cast<int>(top_k) : -1;
        return src < static_cast<int>(x_rows) ? src : -1;
    }
};

// The TMA loads of the operands that are not gathered, issued by the loader's leader.
template <class Traits>
struct TmaOperands {
    using Stages = StageLayout<Traits::BLOCK_N, Traits::kNumStages>;
    using Columns = TileColumns<Traits::BLOCK_N, Traits::kPairedN>;

    // A: two 64-wide atoms (rows of the pool for K-major, columns of M for MN-major), each CTA its own.
    __device__ __forceinline__ static void load_a(const LoaderArgs& args, const Stages& stages, uint32_t stage,
                                                  const sched::GroupedTile& tile, uint32_t k0, uint32_t full) {
        auto load_atom = [&](uint32_t atom) {
            int32_t col, row;
            if constexpr (Traits::kMajorA == Major::K && Traits::kKGrouped) {
                // At [M, P]: the expert's M block, K from its first pool row.
                col = static_cast<int32_t>(tile.k_row + k0);
                row = static_cast<int32_t>(tile.m_block * BLOCK_M + atom * 64);
            } else if constexpr (Traits::kMajorA == Major::K) {
                col = static_cast<int32_t>(k0);
                row = static_cast<int32_t>(tile.m_block * BLOCK_M + atom * 64);
            } else {
                col = static_cast<int32_t>(tile.m_block * BLOCK_M + atom * 64);
                row = static_cast<int32_t>(tile.k_row + k0);
            }
            ptx::tma_load_2d(stages.a(stage) + atom * mma::kAtomBytes, &args.tma_a, full, col, row);
        };
        load_atom(0);
        load_atom(1);
    }

    // B: BLOCK_N / 64 atoms of the tile's columns. In a cluster whose pair shares B (tile.multicast,
    // scheduler/sm90_grouped.cuh), CTA r loads atoms [r h, r h + h), h = BLOCK_N / 128 (an odd atom
    // count, BLOCK_N = 192: the atoms j with j % 2 == r), into the same smem offset of both CTAs,
    // completing on each CTA's full barrier of the stage: every CTA still receives the whole stage
    // (its expect_tx bytes are the same either way).
    __device__ __forceinline__ static void load_b(const LoaderArgs& args, const Stages& stages, uint32_t stage,
                                                  const sched::GroupedTile& tile, const Columns& cols, uint32_t k0,
                                                  uint32_t full) {
        constexpr uint32_t kHalf = Traits::kNumBChunks / 2;
        constexpr bool kEvenAtoms = Traits::kNumBChunks % 2 == 0;
        const bool multicast = Traits::kClusterN > 1 && tile.multicast;
#pragma unroll
        for (uint32_t j = 0; j < Traits::kNumBChunks; ++j) {
            if constexpr (Traits::kClusterN > 1) {
                if (multicast && (kEvenAtoms ? j / kHalf : j % 2) != args.cta_rank)
                    continue;
            }
            int32_t col, row;
            if constexpr (Traits::kMajorB == Major::K && Traits::kKGrouped) {
                // Bt [N, P]: one matrix for all experts, K from the expert's first pool row.
                col = static_cast<int32_t>(tile.k_row + k0);
                row = static_cast<int32_t>(cols.col(j));
            } else if constexpr (Traits::kMajorB == Major::K) {
                col = static_cast<int32_t>(k0);
                row = static_cast<int32_t>(tile.expert * args.shape_n + cols.col(j));
            } else if constexpr (Traits::kType == GroupedGemmType::MGroupedContiguous) {
                col = static_cast<int32_t>(cols.col(j));
                row = static_cast<int32_t>(tile.expert * args.shape_k + k0);
            } else {
                col = static_cast<int32_t>(cols.col(j));
                row = static_cast<int32_t>(tile.k_row + k0);
            }
            const uint32_t dst = stages.b(stage) + j * mma::kAtomBytes;
            if constexpr (Traits::kClusterN > 1) {
                if (multicast) {
                    ptx::tma_load_2d_multicast(dst, &args.tma_b, full, col, row,
                                               static_cast<uint16_t>((1u << Traits::kClusterN) - 1));
                    continue;
                }
            }
            ptx::tma_load_2d(dst, &args.tma_b, full, col, row);
        }
    }
};

template <class Traits>
struct LoaderTma {
    using Stages = StageLayout<Traits::BLOCK_N, Traits::kNumStages>;
    using Columns = TileColumns<Traits::BLOCK_N, Traits::kPairedN>;
    static constexpr uint32_t kNumArgs = 0;
    static constexpr bool kOrderedM = false;
    static constexpr uint32_t kCopyArrivals = 0;
    static constexpr bool kGenericProxyWrites = false;

    const LoaderArgs& args;
    const Stages& stages;
    const bool leader = true;

    __device__ static bool runs(uint32_t warp) {
        return warp == kNumConsumerWarpgroups * 4 && ptx::elect_one_sync();
    }
    __device__ LoaderTma(const LoaderArgs& args_, const Stages& stages_, uint32_t) : args(args_), stages(stages_) {}
    __device__ __forceinline__ void begin_tile(const sched::GroupedTile&) {}

    template <class Pipe>
    __device__ __forceinline__ void load(const Pipe& pipe, const sm90::PipelineState<Traits::kNumStages>& st,
                                         const sched::GroupedTile& tile, const Columns& cols, uint32_t kb) {
        uint32_t full = pipe.full(st.stage);
        const uint32_t k0 = kb * Traits::kBlockK;
        full = pipe.producer_acquire(st, Stages::kStageBytes);
        TmaOperands<Traits>::load_a(args, stages, st.stage, tile, k0, full);
        TmaOperands<Traits>::load_b(args, stages, st.stage, tile, cols, k0, full);
    }
};

// Which rows and 16-byte chunks of A's gathered block (128 rows x 64 columns: 128 bytes, four
// 32-byte sectors a row) each producer thread copies: thread t owns sector q = t % 4 of rows
// t / 4 + 32 i (i < 4); a warp reads 8 whole rows.
// A thread copies two 16-byte chunks per row, as two instructions: chunk q + 4 ((r + j) % 2) in
// instruction j (sector_chunk), not the two halves 2q, 2q + 1 of one sector. So the 4 threads of a
// row read chunks 0-3 or 4-7 in each instruction: whole 32-byte sectors, one L2 request per sector
// (the two halves, one per instruction, would cost two; measured 0.83-0.87x the time of the L1
// forward's gather, docs/perf-notes.md v38). Every chunk is still copied once to the same place, and
// the 8 lanes of a quarter warp (two rows) write 8 different 16-byte bank groups of the swizzled stage.
struct GatherLayout {
    static constexpr uint32_t kSectorsPerRow = 4;
    static constexpr uint32_t kRowStep = 128 / kSectorsPerRow;
    static constexpr uint32_t kRows = 128;
    static constexpr uint32_t kRowsPerThread = kRows / kRowStep;
    // A thread's rows share their parity, so its two chunks are the same for all of them.
    static_assert(kRowStep % 2 == 0, "GatherLayout: a thread's rows must have one parity");
    uint32_t first_row, sector;

    __device__ explicit GatherLayout(uint32_t thread)
        : first_row(thread / kSectorsPerRow), sector(thread % kSectorsPerRow) {}
    __device__ __forceinline__ uint32_t row(uint32_t i) const { return first_row + kRowStep * i; }
    // The j-th (0, 1) 16-byte chunk this thread copies of each of its rows r:
    // q + 4 ((r + j) % 2), where r % 2 == first_row % 2.
    __device__ __forceinline__ uint32_t sector_chunk(uint32_t j) const {
        return sector + 4 * ((first_row + j) & 1);
    }
};

template <class Traits>
struct LoaderGatherCpAsync {
    static_assert(Traits::kClusterN == 1, "the gathering loaders are for GEMMs without clusters");
    static_assert(!Traits::kKGrouped, "the gathering loaders gather the A of M-grouped GEMMs");
    static_assert(Traits::kElement == ElementType::BF16, "the gathering loaders read bf16 token rows");
    static_assert(BLOCK_M == GatherLayout::kRows, "GatherLayout: one row of A's block per pool row");
    using Stages = StageLayout<Traits::BLOCK_N, Traits::kNumStages>;
    using Columns = TileColumns<Traits::BLOCK_N, Traits::kPairedN>;
    using Gather = GatherLayout;
    static constexpr uint32_t kNumArgs = 0;
    static constexpr bool kOrderedM = false;
    static constexpr uint32_t kCopyArrivals = 128;
    static constexpr bool kGenericProxyWrites = true;

    const LoaderArgs& args;
    const Stages& stages;
    const Gather gather;
    const bool leader;
    // The tile's gathered rows, fixed for all its k-blocks.
    int32_t src_rows[Gather::kRowsPerThread];

    __device__ static bool runs(uint32_t) { return true; }
    __device__ LoaderGatherCpAsync(const LoaderArgs& args_, const Stages& stages_, uint32_t thread)
        : args(args_), stages(stages_), gather(thread), leader(thread == 0) {}

    __device__ __forceinline__ void begin_tile(const sched::GroupedTile& tile) {
#pragma unroll
        for (uint32_t i = 0; i < Gather::kRowsPerThread; ++i)
            src_rows[i] = args.gather_source(tile.m_block * BLOCK_M + gather.row(i), args.shape_m);
    }

    template <class Pipe>
    __device__ __forceinline__ void load(const Pipe& pipe, const sm90::PipelineState<Traits::kNumStages>& st,
                                         const sched::GroupedTile& tile, const Columns& cols, uint32_t kb) {
        const uint32_t full = pipe.full(st.stage);
        const uint32_t k0 = kb * BLOCK_K;
        // Every copier waits for the slot; the leader announces the TMA bytes only.
        ptx::mbarrier_wait(pipe.empty(st.stage), st.phase ^ 1);
        if (leader)
            ptx::mbarrier_arrive_expect_tx(full, Stages::kBBytes);
        const uint32_t dst = stages.a(st.stage);
#pragma unroll
        for (uint32_t i = 0; i < Gather::kRowsPerThread; ++i) {
            const uint32_t r = gather.row(i);
#pragma unroll
            for (uint32_t j = 0; j < 2; ++j) {
                const uint32_t c = gather.sector_chunk(j);
                const uint32_t col = k0 + c * 8;  // rows are multiples of 8 columns
                const bool live = src_rows[i] >= 0 && col < args.shape_k;
                const __nv_bfloat16* ptr =
                    args.x + (live ? static_cast<uint64_t>(src_rows[i]) * args.shape_k + col : 0);
                ptx::cp_async_16(dst + r * 128 + ((c ^ (r % 8)) << 4), ptr, live ? 16 : 0);
            }
        }
        ptx::cp_async_mbarrier_arrive_noinc(full);
        if (leader)
            TmaOperands<Traits>::load_b(args, stages, st.stage, tile, cols, k0, full);
    }
};

// LoaderGatherCpAsync of the M-grouped K-major A over rows that the expert-parallel dispatch is
// still writing (kernels/impls/ep_transport.cuh, ep_pull_rows_arrive_kernel). x is the dispatched
// x_r [W * cap, K]: token row j is source rank j / cap's token j % cap, and the pull stores the
// piece's epoch into arrivals[s] (release, gpu scope) once source s's block is complete.
// begin_tile looks up the tile's rows as LoaderGatherCpAsync does, then each producer warp
// reduces the source ranks of its rows to [lo, hi] (an expert's pool rows are in slot order, so a
// tile's sources are a contiguous range; a superset is waited for otherwise) and its lane 0 spins
// until arrivals[s] >= epoch for s in [lo, hi] (acquire loads, gpu scope); __syncwarp orders the
// warp's cp.async reads after them. One waiter per warp: the warps need no barrier between them,
// and each waits only for its own rows. The wait is bounded: past timeout_ns (%globaltimer) it
// writes the rank, the source, the awaited epoch and the value seen into `report` (pinned host
// memory: it stays readable by the host after the trap; comm/symmetric.py prints it) and traps.
// Not printf: a function call anywhere in a kernel makes ptxas serialize every wgmma of it
// (C7510, "wgmma pipeline crossing function boundary"), and vprintf is a call.
// Kernel arguments (kNumArgs, after the core's): arrivals [W] (u64 in int64 storage), the epoch (a
// pointer to this rank's epoch in its region, read once: the GEMM runs between the dispatch's
// pull and the next piece's publish, so it is stable), cap, timeout_ns, rank, report (the address of
// a pinned host int64 [5]: set flag, rank, source, awaited epoch, seen; under unified addressing a
// pinned host pointer is valid in kernels), m_order [ceil(P / 128)] int32: the M blocks in the
// order their rows arrive (kOrderedM: the scheduler walks them so, or every CTA would soon wait at a
// tile of a late source, since each expert's rows run through all sources in slot order).
template <class Traits>
struct LoaderGatherCpAsyncAwait : LoaderGatherCpAsync<Traits> {
    using Base = LoaderGatherCpAsync<Traits>;
    using typename Base::Stages;
    static_assert(!Traits::kKGrouped, "the waiting loader gathers the A of M-grouped GEMMs (the L1 forward)");
    static constexpr uint32_t kNumArgs = 7;
    static constexpr bool kOrderedM = true;

    const unsigned long long* arrivals;
    unsigned long long epoch;
    uint32_t capacity;
    unsigned long long timeout_ns;
    int rank;
    volatile long long* report;
    uint32_t lane;

    template <class... Rest>
    __device__ LoaderGatherCpAsyncAwait(const LoaderArgs& args_, const Stages& stages_, uint32_t thread,
                                        const long long* arrivals_, const long long* epoch_, uint32_t capacity_,
                                        unsigned long long timeout_ns_, int rank_, unsigned long long report_,
                                        const int*, const Rest&...)
        : Base(args_, stages_, thread), arrivals(reinterpret_cast<const unsigned long long*>(arrivals_)),
          epoch(*reinterpret_cast<const volatile unsigned long long*>(epoch_)), capacity(capacity_),
          timeout_ns(timeout_ns_), rank(rank_), report(reinterpret_cast<volatile long long*>(report_)),
          lane(thread % 32) {}

    template <class... Rest>
    __device__ __forceinline__ static const int* m_order(const long long*, const long long*, uint32_t,
                                                         unsigned long long, int, unsigned long long, const int* order,
                                                         const Rest&...) {
        return order;
    }

    __device__ __forceinline__ static unsigned long long load_acquire(const unsigned long long* ptr) {
        unsigned long long value;
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
        return value;
    }
    __device__ __forceinline__ static unsigned long long globaltimer() {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
    }

    __device__ __forceinline__ void await_source(uint32_t source) const {
        unsigned long long seen = load_acquire(arrivals + source);
        if (seen >= epoch)
            return;
        const unsigned long long start = globaltimer();
        while (true) {
            __nanosleep(128);
            seen = load_acquire(arrivals + source);
            if (seen >= epoch)
                return;
            if (globaltimer() - start > timeout_ns) {
                report[1] = rank;
                report[2] = static_cast<long long>(source);
                report[3] = static_cast<long long>(epoch);
                report[4] = static_cast<long long>(seen);
                __threadfence_system();
                report[0] = 1;
                __threadfence_system();
                __trap();
            }
        }
    }

    __device__ __forceinline__ void begin_tile(const sched::GroupedTile& tile) {
        Base::begin_tile(tile);
        uint32_t lo = 0xffffffffu, hi = 0;
#pragma unroll
        for (uint32_t i = 0; i < Base::Gather::kRowsPerThread; ++i) {
            if (this->src_rows[i] >= 0) {
                const uint32_t source = static_cast<uint32_t>(this->src_rows[i]) / capacity;
                lo = min(lo, source);
                hi = max(hi, source);
            }
        }
        lo = __reduce_min_sync(0xffffffffu, lo);
        hi = __reduce_max_sync(0xffffffffu, hi);
        if (lane == 0) {
            for (uint32_t source = lo; source <= hi; ++source)  // empty (lo > hi) for all-padding rows
                await_source(source);
        }
        __syncwarp();
    }
};

}  // namespace dge::gemm
