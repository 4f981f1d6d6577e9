#pragma once
// Problem description and shared-memory layout of the SM90 grouped GEMM core
// (impls/sm90_bf16_grouped_gemm.cuh): the compile-time traits every policy (loader, mainloop,
// epilogue) is written against, the N columns of a tile, and where stages, epilogue buffers and
// barriers live in shared memory.

#include <cstdint>

#include <mma/sm90_desc.cuh>
#include <scheduler/sm90_grouped.cuh>

namespace dge::gemm {

using mma::Major;
using sched::GroupedGemmType;

constexpr uint32_t BLOCK_M = 128;
// K elements of a bf16 k-block; a k-block of any operand type is one 128-byte swizzled row per
// M / N row of the stage (GemmTraits::kBlockK elements).
constexpr uint32_t BLOCK_K = 64;
constexpr uint32_t kNumConsumerWarpgroups = 2;
constexpr uint32_t kNumThreads = 128 * (kNumConsumerWarpgroups + 1);
// setmaxnreg budgets: 128 * 40 + 256 * 232 fits the 64K-register file of one CTA per SM.
constexpr uint32_t kProducerRegisters = 40;
constexpr uint32_t kConsumerRegisters = 232;
// Named barrier ids 1, 2 belong to the consumer warpgroups' epilogues (0 is __syncthreads).
constexpr uint32_t kEpilogueBarrierBase = 1;

// Operand element type of the A and B stages:
//   BF16  bf16 x bf16, k-blocks of 64 (MainloopBF16);
//   E4M3  e4m3 x e4m3 with fp32 block scales, k-blocks of 128 = one scale block (MainloopFP8).
enum class ElementType : uint32_t { BF16 = 0, E4M3 = 1 };

__host__ __device__ constexpr uint32_t constexpr_gcd(uint32_t a, uint32_t b) {
    return b == 0 ? a : constexpr_gcd(b, a % b);
}

// One GEMM of the core: grouping, operand majors, the 128 x BLOCK_N tile, the smem ring depth,
// CTAs per cluster (kClusterN: 1, or 2 on adjacent M blocks sharing B by multicast), paired N
// tiling (below), the scheduler's M-block group, the operand element type, K when it is
// compiled in (kShapeK, 0: a kernel argument), and whether the scheduler's groups stay within one
// expert (kExpertGroups, sched::GroupedScheduler). Both consumer warpgroups work on every tile,
// warpgroup w on its rows [64 w, 64 w + 64).
template <GroupedGemmType kType_, Major kMajorA_, Major kMajorB_, uint32_t BLOCK_N_, uint32_t kNumStages_,
          uint32_t kClusterN_, bool kPairedN_, uint32_t kGroupM_, ElementType kElement_ = ElementType::BF16,
          uint32_t kShapeK_ = 0, bool kExpertGroups_ = false>
struct GemmTraits {
    static constexpr GroupedGemmType kType = kType_;
    static constexpr Major kMajorA = kMajorA_;
    static constexpr Major kMajorB = kMajorB_;
    static constexpr uint32_t BLOCK_N = BLOCK_N_;
    static constexpr uint32_t kNumStages = kNumStages_;
    static constexpr uint32_t kClusterN = kClusterN_;
    static constexpr bool kPairedN = kPairedN_;
    static constexpr uint32_t kGroupM = kGroupM_;
    static constexpr bool kExpertGroups = kExpertGroups_;
    static constexpr ElementType kElement = kElement_;
    // K elements per k-block (one stage): 128 bytes of each operand row.
    static constexpr uint32_t kBlockK = kElement == ElementType::BF16 ? BLOCK_K : 128;
    static constexpr bool kKGrouped = kType == GroupedGemmType::KGroupedContiguous;
    // K compiled in (M-grouped fp8): every tile has the same kNumKBlocks k-blocks. Where they are a
    // multiple of the ring's depth, every tile starts at stage 0 (kStaticRing) and each k-block's stage,
    // barriers and smem offsets are constants of the unrolled loop. Where they are not, a tile starts at
    // a multiple of kRingStep = gcd(k-blocks, depth), and the serial mainloop unrolls the whole tile once
    // per such start (at most kMaxUnrolledKBlocks k-blocks), so the stages are constants again in each copy.
    static constexpr uint32_t kShapeK = kShapeK_;
    static constexpr uint32_t kNumKBlocks = (kShapeK + kBlockK - 1) / kBlockK;
    static constexpr bool kStaticRing = kShapeK > 0 && kNumKBlocks % kNumStages == 0;
    static constexpr uint32_t kRingStep = kShapeK > 0 ? constexpr_gcd(kNumKBlocks, kNumStages) : 1;
    static constexpr uint32_t kMaxUnrolledKBlocks = 16;
    static constexpr uint32_t kNumBChunks = BLOCK_N / 64;

    static_assert(kType != GroupedGemmType::MGroupedContiguous || kMajorA == Major::K,
                  "M-grouped GEMM: the pool A must be K-major");
    // bf16 reads the pools A [P, M], B [P, N] as they are (MN-major); e4m3 reads their transposes
    // At [M, P], Bt [N, P] (K-major, the only major of e4m3 wgmma).
    static_assert(kType != GroupedGemmType::KGroupedContiguous ||
                      (kElement == ElementType::BF16 ? kMajorA == Major::MN && kMajorB == Major::MN
                                                     : kMajorA == Major::K && kMajorB == Major::K),
                  "K-grouped GEMM: bf16 operands MN-major (rows of the pool are the contraction), e4m3 operands "
                  "K-major (the transposed pools)");
    static_assert(!kPairedN || kType == GroupedGemmType::MGroupedContiguous, "paired N tiling is for M-grouped GEMMs");
    static_assert(kShapeK == 0 || (kElement == ElementType::E4M3 && kType == GroupedGemmType::MGroupedContiguous),
                  "K is compiled into the M-grouped fp8 GEMMs only");
    static_assert(kShapeK == 0 || kStaticRing || (BLOCK_N == 192 && kNumKBlocks <= kMaxUnrolledKBlocks),
                  "K compiled in: the ring's depth must divide the k-blocks, or the 192-wide tile's serial loop "
                  "unrolls the tile once per start stage (at most kMaxUnrolledKBlocks k-blocks)");
    static_assert(BLOCK_N == 128 || BLOCK_N == 256 || (BLOCK_N == 192 && kElement == ElementType::E4M3),
                  "BLOCK_N must be 128 or 256 (e4m3: 128 or 192)");
    static_assert(kClusterN == 1 || kClusterN == 2, "clusters of 1 or 2 CTAs");
    // fp8: wgmma reads e4m3 operands K-major only; the per-k-block partial sums double the
    // accumulator registers: BLOCK_N = 128, or 192 for the M-grouped GEMM (96 + 96 accumulators; the
    // K-grouped one's per-column B scales would not fit beside them).
    static_assert(kElement == ElementType::BF16 ||
                      (kMajorA == Major::K && kMajorB == Major::K && !kPairedN &&
                       (BLOCK_N == 128 || (BLOCK_N == 192 && !kKGrouped))),
                  "e4m3 GEMMs: both operands K-major (M-grouped NT, or K-grouped on the transposed pools), "
                  "128 x 128 tiles (M-grouped also 128 x 192) without paired N");
};

// Columns of the tile in the N space of B and of the output, in 64-wide chunks. With paired N
// tiling, chunks [0, BLOCK_N/128) are columns [n0, n0 + BLOCK_N/2) of the first half of N and the
// remaining chunks the same columns of the second half: columns j and N/2 + j (the gate and up
// columns of the L1 output [g | u]) are in the same thread (accumulator i and i + kNumAccum/2).
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

// The smem ring: kNumStages A stages (128 rows of 128 bytes: 64 bf16 or 128 e4m3 of K), then
// kNumStages B stages (BLOCK_N rows of 128 bytes), each a stack of 8 KiB 128B-swizzled atoms
// (mma/sm90_desc.cuh), from the 1024-aligned `base`. The sizes are the same for both element types.
template <uint32_t BLOCK_N, uint32_t kNumStages>
struct StageLayout {
    static constexpr uint32_t kABytes = BLOCK_M * mma::kSwizzleBytes;
    static constexpr uint32_t kBBytes = BLOCK_N * mma::kSwizzleBytes;
    static constexpr uint32_t kStageBytes = kABytes + kBBytes;
    static constexpr uint32_t kBytes = kNumStages * kStageBytes;
    uint32_t base;

    __device__ __forceinline__ uint32_t a(uint32_t stage) const { return base + stage * kABytes; }
    __device__ __forceinline__ uint32_t b(uint32_t stage) const { return base + kNumStages * kABytes + stage * kBBytes; }
};

// Dynamic shared memory: the stages, the epilogue's buffers, the mainloop's own bytes (kMainloopBytes:
// the fp8 mainloop's staged scales, Mainloop::kSmemBytes), then the pipeline barriers and the
// scheduler's expert table. This is the one
// definition of the launch's byte count: the JIT source exports kTotalBytes (DGE_EXPORT_SMEM_BYTES)
// and the host reads it from the cubin.
template <uint32_t BLOCK_N, uint32_t kNumStages, class Epilogue, uint32_t kMainloopBytes = 0>
struct SmemLayout {
    using Stages = StageLayout<BLOCK_N, kNumStages>;
    static constexpr uint32_t kEpilogueOffset = Stages::kBytes;
    static constexpr uint32_t kMainloopOffset = (kEpilogueOffset + Epilogue::kSmemBytes + 127) / 128 * 128;
    static constexpr uint32_t kBarrierOffset = (kMainloopOffset + kMainloopBytes + 1023) / 1024 * 1024;
    static constexpr uint32_t kBarrierBytes = 2 * kNumStages * 8;
    // The experts' block ranges the M-grouped scheduler searches (sched::stage_expert_blocks).
    static constexpr uint32_t kExpertTableOffset = kBarrierOffset + kBarrierBytes;
    // +1024: the dynamic smem base is aligned up to 1024 bytes at run time (128B swizzle atoms).
    static constexpr uint32_t kTotalBytes = kExpertTableOffset + sched::kStagedExpertBytes + 1024;
    static_assert(kTotalBytes <= 232448, "SmemLayout: tile, stages and epilogue exceed the 227 KiB of an SM90 CTA");
};

}  // namespace dge::gemm

// The launch's dynamic smem bytes as a symbol of the cubin (jit.Kernel.exported_u32 reads it without
// a GPU), so that no host code repeats the layout arithmetic.
#define DGE_EXPORT_SMEM_BYTES(bytes) extern "C" __constant__ const uint32_t dge_dynamic_smem_bytes = (bytes);
