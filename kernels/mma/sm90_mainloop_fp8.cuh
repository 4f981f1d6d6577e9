#pragma once
// Mainloop policy of the SM90 grouped GEMM core for blockwise-scaled fp8 (the DeepSeek-V3 recipe,
// deep_gemm_ext/recipes/fp8.py), with the contract of mma/sm90_mainloop.cuh:
//
//   out[r, n] = sum over k-blocks kb of ( sum_{k in kb} a_q[r, k] * b_q[e, n, k] ) * sa[r, kb] * sb[e, n / 128, kb]
//
// a_q [M, K] and b_q [E, N, K] are e4m3, both K-major; sa [M, ceil(K/128)] holds one fp32 scale per
// 1 x 128 tile of A, sb [E, ceil(N/128), ceil(K/128)] one per 128 x 128 block of B. A k-block of the
// ring is 128 elements of K (128 bytes per row, the same stage bytes as bf16's 64), so each stage
// is one scale block: its four wgmma m64n128k32 go into a fresh fp32 partial accumulator, which is
// then scaled by sa * sb and added into the tile's fp32 accumulator ("promotion" every 128 of K:
// the tensor cores' fp8 accumulation is not carried across k-blocks).
//
// M-grouped: the scales travel with the stage. Each stage has kStageScaleBytes of its own after the
// epilogue's buffers (SmemLayout's mainloop bytes): the 128 row scales of the tile's A block and
// the tile's one B scale of that k-block. The producer warpgroup's second warp fills them
// (produce(): 4-byte cp.async, lane l rows l + 32 i, lane 0 the B scale, then one noinc arrival
// per lane on the stage's full barrier), running up to the ring's depth ahead of the consumers
// as the TMA warp does; sa's rows are ceil(K/128) fp32 apart, not the 16-byte multiple a TMA box
// needs for most K. A consumer thread reads its two rows' scales and the B scale from the stage
// with ld.shared after the full barrier, before it frees the stage. Before, each consumer thread
// loaded them from global memory one k-block ahead: their latency, their addresses and the
// pointer registers were in the consumers' loop.
//
// Two schedules of the same arithmetic (kOverlapPromotion):
//   serial (false): issue k-block kb's wgmmas into the partial sums, wait for them (wait_group 0),
//     free the stage, promote. The tensor cores idle while the warpgroup promotes.
//   overlap (true): two partial accumulator sets alternate; k-block kb + 1's wgmmas are issued into
//     partial[(kb + 1) % 2] before kb's partial is promoted, and the wait before the promotion is
//     wait_group 1 (kb's group done, kb + 1's still running), so one k-block of wgmmas stays in
//     flight through every promotion but the last. Each stage is freed after the wait that covers
//     its wgmmas. acc 64 + 2 x 64 partial fp32 registers per thread at BLOCK_N = 128.
// K-grouped (weight gradients, Traits::kKGrouped): D[e] = A_e^T B_e with both pools quantized along
// their rows (the contraction) in 128 x 1 tiles, read transposed:
//
//   out[e][m, n] = sum over the expert's k-blocks kb of
//                  ( sum_{k in kb} at_q[m, k] * bt_q[n, k] ) * sa[m, kb] * sb[n, kb]
//
// at_q [M, P], bt_q [N, P] e4m3 K-major, sa [M, ceil(P/128)], sb [N, ceil(P/128)], kb the pool's k-block
// index (the expert's first row / 128 + j). The B scale is per output column here. Its scales are
// staged like the M-grouped ones: each stage has the 128 row scales of the tile's A block and the 128
// column scales of its B block (1 KiB), copied by the producer's second warp (8 cp.async per lane). A
// consumer thread reads its two rows' scales and its 32 columns' (2 per 8-column group of the m64n128
// fragment, adjacent: 16 8-byte loads, the same 4 addresses in the 8 lanes of a row group, so one
// wavefront each), and promotes each element with sa[row] * sb[col]. Before, each consumer thread loaded
// those 34 scales from global memory for every k-block (the 32 column scales P/128 floats apart, a
// sector each). Under the overlap schedule the K-grouped loop reads a k-block's scales after the wait
// that covers its wgmmas, just before freeing the stage, so that one set of 34 scales is live beside the
// accumulator and the two partial sets (64 + 2 x 64 registers).
//
// 128 x 192 tiles (M-grouped, serial schedule; acc 96 + partial 96 registers): a tile's columns
// [n0, n0 + 192) span two 128-column blocks of B's scales, switching after the first 128 - n0 % 128
// of them (n0 % 128 is 0 or 64), so a thread promotes each 8-column group of its fragment with the
// first or the second block's scale; past N the second block is the last one's (those columns are
// not stored).
//
// Both compute the same per-k-block partial sums (the same wgmmas on the same stages, scale-d = 0
// on the first) and promote them in k-block order with the same fmaf, so the results are equal bit
// for bit.

#include <cstdint>
#include <type_traits>

#include <common/sm90_utils.cuh>
#include <layout/sm90_gemm.cuh>
#include <mma/sm90_desc.cuh>
#include <mma/sm90_wgmma.cuh>
#include <ptx/tma.cuh>
#include <ptx/wgmma.cuh>

namespace dge::gemm {

// Kernel arguments: scale_a (const float*, [M, ceil(K/128)]), scale_b (const float*,
// [E, ceil(N/128), ceil(K/128)]).
template <class Traits, bool kGenericProxyWrites, bool kOverlapPromotion = false>
struct MainloopFP8 {
    static_assert(Traits::kElement == ElementType::E4M3, "MainloopFP8: e4m3 operands");
    static constexpr uint32_t kScaleBlock = 128;
    static_assert(Traits::kBlockK == kScaleBlock, "MainloopFP8: one k-block per scale block");
    // 192-wide tiles straddle two B scale blocks (TwoBlockScales below): M-grouped, serial schedule.
    static constexpr bool kTwoBlocksB = Traits::BLOCK_N == 192;
    static_assert(Traits::BLOCK_N == kScaleBlock ||
                      (kTwoBlocksB && !Traits::kKGrouped && !kOverlapPromotion),
                  "MainloopFP8: 128-wide tiles (one B scale block per tile and k-block), or 192-wide M-grouped "
                  "tiles on the serial schedule (two)");
    using MMA = mma::WgmmaE4M3<Traits::BLOCK_N>;
    using Stages = StageLayout<Traits::BLOCK_N, Traits::kNumStages>;
    static constexpr uint32_t kNumAccum = MMA::kNumAccum;
    static constexpr uint32_t kNumArgs = 2;
    static constexpr uint32_t kWgmmasPerBlock = Traits::kBlockK / MMA::K;
    static constexpr bool kKGrouped = Traits::kKGrouped;
    // B scales a thread applies per k-block: the tile's one weight-block scale (M-grouped), or one
    // per accumulator column (K-grouped: columns 8 j + 2 (lane % 4) + t of the tile, index 2 j + t).
    static constexpr uint32_t kNumScalesB = kKGrouped ? kNumAccum / 2 : 1;
    // A stage's scales in shared memory (file comment), 16-byte aligned: the 128 row scales, then the
    // tile's B scale (192-wide tiles: its two B scales; K-grouped: its 128 column scales).
    static constexpr uint32_t kStageScaleBytes = kKGrouped ? (BLOCK_M + Traits::BLOCK_N) * 4 : (BLOCK_M + 4) * 4;
    static constexpr uint32_t kScaleBOffset = BLOCK_M * 4;
    static constexpr uint32_t kNumBlocksB = kTwoBlocksB ? 2 : 1;
    static constexpr uint32_t kSmemBytes = Traits::kNumStages * kStageScaleBytes;
    static constexpr uint32_t kProducerArrivals = 32;
    // The overlap schedule reads the K-grouped scales late (file comment).
    static constexpr bool kLateScales = kKGrouped;

    // The low descriptor words of stage 0's A slice (the warpgroup's 64 rows) and B tile,
    // made once per tile; stage st's are these plus st times the stage's bytes / 16, a wgmma's K
    // offset adds its bytes / 16 (mma::k_major_desc_at), so the loop rebuilds no descriptor. Both
    // words are the same in every thread of a warp; taking them from lane 0 lets the compiler know
    // it and keep the descriptors' arithmetic in uniform registers, which is where wgmma reads them.
    struct DescBase {
        uint32_t a;
        uint32_t b;
        __device__ __forceinline__ DescBase(const Stages& stages, uint32_t slice)
            : a(__shfl_sync(0xffffffffu, mma::k_major_desc_lo(stages.a(0) + slice * 64 * mma::kSwizzleBytes), 0)),
              b(__shfl_sync(0xffffffffu, mma::k_major_desc_lo(stages.b(0)), 0)) {}
    };

    // The staged scales' smem addresses of a consumer thread (staged_scales below).
    struct StagedScales {
        uint32_t rows;
        uint32_t block_b;
    };

    // 192-wide tiles: the tile's two weight-block scales of a k-block (which 8-column groups take the
    // first is serial_loop's kSplit).
    struct TwoBlockScales {
        float first;
        float second;
    };
    using ScalesB = std::conditional_t<kKGrouped, float[kNumScalesB], std::conditional_t<kTwoBlocksB, TwoBlockScales, float>>;

    struct Params {
        const float* scale_a;
        const float* scale_b;
        uint32_t smem;       // the stages' scales
        uint32_t last_row;   // shape_m - 1: rows of a tile past the pool read the last row's scales
        uint32_t k_blocks;   // ceil(K / 128): scales per row of sa, per block row of sb
        uint32_t n_blocks;   // ceil(N / 128)
        uint32_t last_col;   // shape_n - 1 (K-grouped: columns of a tile past N copy the last column's scales)

        template <class... Rest>
        __device__ Params(uint32_t smem_, uint32_t shape_m, uint32_t shape_n, uint32_t shape_k, const float* sa,
                          const float* sb, const Rest&...)
            : scale_a(sa), scale_b(sb), smem(smem_), last_row(shape_m > 0 ? shape_m - 1 : 0),
              k_blocks((shape_k + kScaleBlock - 1) / kScaleBlock),
              n_blocks((shape_n + kScaleBlock - 1) / kScaleBlock), last_col(shape_n > 0 ? shape_n - 1 : 0) {}
    };

    template <class Pipe, class During>
    __device__ __forceinline__ static uint32_t mma(float (&acc)[kNumAccum], const Pipe& pipe,
                                                   sm90::PipelineState<Traits::kNumStages>& st,
                                                   const sched::GroupedTile& tile, const Params& params,
                                                   const Stages& stages, uint32_t slice, uint32_t lane,
                                                   const During& during) {
        if constexpr (kOverlapPromotion)
            return mma_overlap(acc, pipe, st, tile, params, stages, slice, lane, during);
        else
            return mma_serial(acc, pipe, st, tile, params, stages, slice, lane, during);
    }

    // The producer warpgroup's second warp: each stage's scales, for the same tiles in the same order
    // as the TMA loads, once the consumers of both CTAs have freed the stage.
    //   M-grouped: lane l copies the row scales of rows l + 32 i of the tile; lane j < kNumBlocksB the
    //     tile's j-th B scale: its block, block0 + j (192-wide tiles: past N, the last block's again;
    //     those columns are not stored).
    //   K-grouped: lane l copies the scales of the tile's rows l + 32 i (the expert's M rows, M a
    //     multiple of 128) and of its columns l + 32 i (past N: the last column's; those columns are
    //     not stored), of the pool's k-block k_row / 128 + kb.
    // 32-bit element offsets: sa and sb have fewer than 2^32 elements (the launchers check).
    template <class Pipe, class Scheduler>
    __device__ __forceinline__ static void produce(const Pipe& pipe, Scheduler& scheduler, const Params& params,
                                                   uint32_t lane) {
        sm90::PipelineState<Traits::kNumStages> st;
        sched::GroupedTile tile;
        while (scheduler.next(tile)) {
            // Few registers live across the k-blocks: the producer warpgroup runs on 40 of them.
            const uint32_t row0 = tile.m_block * BLOCK_M + lane;
            const uint32_t col0 = tile.n_block * Traits::BLOCK_N + lane;  // K-grouped
            const uint32_t kb0 = kKGrouped ? tile.k_row / kScaleBlock : 0;
            const uint32_t block = min(tile.n_block * Traits::BLOCK_N / kScaleBlock + lane, params.n_blocks - 1);
            const float* scale_b =  // M-grouped
                params.scale_b + (static_cast<uint64_t>(tile.expert) * params.n_blocks + block) * params.k_blocks;
#pragma unroll 1
            for (uint32_t kb = 0; kb < tile.num_k_blocks; ++kb, st.advance()) {
                ptx::mbarrier_wait(pipe.empty(st.stage), st.phase ^ 1);
                const uint32_t dst = params.smem + st.stage * kStageScaleBytes + lane * 4;
#pragma unroll
                for (uint32_t i = 0; i < BLOCK_M / 32; ++i) {
                    const uint32_t row = min(row0 + 32 * i, params.last_row);
                    ptx::cp_async_4(dst + 32 * i * 4, params.scale_a + (row * params.k_blocks + kb0 + kb));
                }
                if constexpr (kKGrouped) {
#pragma unroll
                    for (uint32_t i = 0; i < Traits::BLOCK_N / 32; ++i) {
                        const uint32_t col = min(col0 + 32 * i, params.last_col);
                        ptx::cp_async_4(dst + kScaleBOffset + 32 * i * 4,
                                        params.scale_b + (col * params.k_blocks + kb0 + kb));
                    }
                } else if (lane < kNumBlocksB) {
                    ptx::cp_async_4(dst + kScaleBOffset, scale_b + kb);
                }
                ptx::cp_async_mbarrier_arrive_noinc(pipe.full(st.stage));
            }
        }
    }

    // mma waited for every wgmma and freed every stage (both schedules).
    template <class Pipe>
    __device__ __forceinline__ static void finish(float (&)[kNumAccum], const Pipe&, uint32_t, uint32_t,
                                                  uint32_t) {}

private:
    // The serial schedule (file comment). 192-wide tiles: the k-loop is instantiated for each of the
    // two places where the tile's columns cross into the second weight block (kSplit: 8-column groups
    // of the fragment in the first block; n0 % 128 is 0 or 64), chosen once per tile, so the
    // promotion applies each group's scale without a select.
    template <class Pipe, class During>
    __device__ __forceinline__ static uint32_t mma_serial(float (&acc)[kNumAccum], const Pipe& pipe,
                                                          sm90::PipelineState<Traits::kNumStages>& st,
                                                          const sched::GroupedTile& tile, const Params& params,
                                                          const Stages& stages, uint32_t slice,
                                                          uint32_t lane, const During& during) {
        if constexpr (kTwoBlocksB) {
            if (tile.n_block * Traits::BLOCK_N % kScaleBlock == 0)
                return serial_loop<kScaleBlock / 8>(acc, pipe, st, tile, params, stages, slice, lane, during);
            else
                return serial_loop<kScaleBlock / 16>(acc, pipe, st, tile, params, stages, slice, lane, during);
        } else {
            return serial_loop<0>(acc, pipe, st, tile, params, stages, slice, lane, during);
        }
    }

    template <uint32_t kSplit, class Pipe, class During>
    __device__ __forceinline__ static uint32_t serial_loop(float (&acc)[kNumAccum], const Pipe& pipe,
                                                           sm90::PipelineState<Traits::kNumStages>& st,
                                                           const sched::GroupedTile& tile, const Params& params,
                                                           const Stages& stages, uint32_t slice,
                                                           uint32_t lane, const During& during) {
        const StagedScales scales = staged_scales(params, slice, lane);
        const DescBase desc(stages, slice);

        float partial[kNumAccum];
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i)
            partial[i] = 0.0f;
        float sa[2];
        ScalesB sb;

        const uint32_t num_k_blocks = tile_k_blocks(tile, st);
        uint32_t last_stage = 0;
        auto step = [&](uint32_t kb) {
            pipe.consumer_wait(st);
            if constexpr (kGenericProxyWrites)
                ptx::fence_proxy_async_smem();
            read_scales(sa, sb, scales, st.stage);
            mma::fence_accumulators(partial);
            ptx::wgmma_fence();
            issue_block(partial, desc, st.stage);
            mma::fence_accumulators(partial);
            if (kb == 0)
                during();
            ptx::wgmma_wait_group<0>();
            mma::fence_accumulators(partial);
            pipe.consumer_release(st.stage, lane);
            last_stage = st.stage;
            st.advance();
            promote<kSplit>(acc, partial, sa, sb);
        };
        if constexpr (Traits::kStaticRing) {
            // K compiled in, the ring's depth dividing the k-blocks: a loop over the tile's turns of
            // the ring, each turn unrolled, so every k-block's stage is a constant and the code holds
            // one turn whatever K is.
#pragma unroll 1
            for (uint32_t turn = 0; turn < Traits::kNumKBlocks / Traits::kNumStages; ++turn) {
#pragma unroll
                for (uint32_t j = 0; j < Traits::kNumStages; ++j)
                    step(turn * Traits::kNumStages + j);
            }
        } else if constexpr (Traits::kShapeK != 0) {
            // K compiled in, the ring's depth not dividing the k-blocks: the whole tile unrolled once
            // per stage a tile can start at.
            unrolled_from_start<0>(step, st);
        } else {
            for (uint32_t kb = 0; kb < num_k_blocks; ++kb)
                step(kb);
        }
        return last_stage;
    }

    // The tile's kNumKBlocks steps unrolled for the start stage st.stage, one of the multiples of
    // Traits::kRingStep from kStart on: in each copy the stage is a constant.
    template <uint32_t kStart, class Step>
    __device__ __forceinline__ static void unrolled_from_start(Step& step,
                                                               sm90::PipelineState<Traits::kNumStages>& st) {
        if constexpr (kStart + Traits::kRingStep < Traits::kNumStages) {
            if (st.stage != kStart) {
                unrolled_from_start<kStart + Traits::kRingStep>(step, st);
                return;
            }
        }
        st.stage = kStart;
#pragma unroll
        for (uint32_t kb = 0; kb < Traits::kNumKBlocks; ++kb)
            step(kb);
    }

    // The overlapping schedule (kOverlapPromotion; file comment). Same scale pointers, partial sums
    // and promotion as the serial one above.
    template <class Pipe, class During>
    __device__ __forceinline__ static uint32_t mma_overlap(float (&acc)[kNumAccum], const Pipe& pipe,
                                                           sm90::PipelineState<Traits::kNumStages>& st,
                                                           const sched::GroupedTile& tile, const Params& params,
                                                           const Stages& stages, uint32_t slice,
                                                           uint32_t lane, const During& during) {
        const StagedScales scales = staged_scales(params, slice, lane);
        const DescBase desc(stages, slice);

        // partial[j] holds the k-blocks kb with kb % 2 == j.
        float partial[2][kNumAccum];
#pragma unroll
        for (uint32_t j = 0; j < 2; ++j) {
#pragma unroll
            for (uint32_t i = 0; i < kNumAccum; ++i)
                partial[j][i] = 0.0f;
        }
        const uint32_t num_k_blocks = tile_k_blocks(tile, st);
        if (num_k_blocks == 0)
            return 0;
        // Every accumulator register gets its own value before the first wgmma: otherwise the
        // compiler shares one zero among acc and the partial sets and copies it out of a partial
        // register while wgmmas run, which makes ptxas serialize them.
        mma::fence_accumulators(acc);
        mma::fence_accumulators(partial[0]);
        mma::fence_accumulators(partial[1]);
        float sa[2];
        ScalesB sb;
        // k-block 0 into partial[0]. Every control-flow join below sees the same wgmmas in flight
        // (partial[0]'s group, holding k-block kb), and both exits wait for all of them: a join
        // with different groups in flight on its two sides makes ptxas serialize the wgmmas.
        uint32_t stage = issue(partial[0], pipe, st, desc);
        if constexpr (!kLateScales)
            read_scales(sa, sb, scales, stage);
        during();
        // K compiled in: the loop unrolled over the whole tile, so that every k-block's stage is a constant
        // (the overlap mainloop with K compiled in takes a static ring only); K at run time: a loop.
        constexpr uint32_t kUnroll = Traits::kShapeK != 0 ? Traits::kNumKBlocks : 1;
        uint32_t kb = 0;
#pragma unroll kUnroll
        for (; kb + 2 < num_k_blocks; kb += 2) {
            overlap_step(acc, partial[0], partial[1], pipe, st, desc, sa, sb, scales, stage, lane);
            overlap_step(acc, partial[1], partial[0], pipe, st, desc, sa, sb, scales, stage, lane);
        }
        // One or two k-blocks left, the first in flight in partial[0].
        if (kb + 1 < num_k_blocks) {
            overlap_step(acc, partial[0], partial[1], pipe, st, desc, sa, sb, scales, stage, lane);
            last_step(acc, partial[1], pipe, sa, sb, scales, stage, lane);
        } else {
            last_step(acc, partial[0], pipe, sa, sb, scales, stage, lane);
        }
        return stage;
    }

    // The tile's k-blocks: the compiled-in count (Traits::kShapeK), or the scheduler's. With a static
    // ring (Traits::kStaticRing) every tile starts at stage 0, since each consumes a multiple of the
    // ring's depth; saying so makes every k-block's stage a constant of the unrolled loop.
    __device__ __forceinline__ static uint32_t tile_k_blocks(const sched::GroupedTile& tile,
                                                             sm90::PipelineState<Traits::kNumStages>& st) {
        if constexpr (Traits::kStaticRing)
            st.stage = 0;
        if constexpr (Traits::kShapeK != 0)
            return Traits::kNumKBlocks;
        else
            return tile.num_k_blocks;
    }

    // Waits for the next stage's full barrier and issues its wgmmas into `partial` (one commit
    // group); returns the stage and advances st.
    template <class Pipe>
    __device__ __forceinline__ static uint32_t issue(float (&partial)[kNumAccum], const Pipe& pipe,
                                                     sm90::PipelineState<Traits::kNumStages>& st,
                                                     const DescBase& desc) {
        pipe.consumer_wait(st);
        if constexpr (kGenericProxyWrites)
            ptx::fence_proxy_async_smem();
        mma::fence_accumulators(partial);
        ptx::wgmma_fence();
        issue_block(partial, desc, st.stage);
        mma::fence_accumulators(partial);
        const uint32_t stage = st.stage;
        st.advance();
        return stage;
    }

    // `cur` holds a k-block in flight, read from `stage` with scales sa, sb (kLateScales: not read
    // yet): issues the next k-block into `next`, waits for cur's group only, frees its stage and
    // promotes it. Leaves `stage`, and sa and sb unless kLateScales, those of the next k-block.
    template <class Pipe>
    __device__ __forceinline__ static void overlap_step(float (&acc)[kNumAccum],
                                                        float (&cur)[kNumAccum],
                                                        float (&next)[kNumAccum], const Pipe& pipe,
                                                        sm90::PipelineState<Traits::kNumStages>& st,
                                                        const DescBase& desc, float (&sa)[2], ScalesB& sb,
                                                        const StagedScales& scales, uint32_t& stage, uint32_t lane) {
        const uint32_t next_stage = issue(next, pipe, st, desc);
        if constexpr (kLateScales) {
            // cur's scales once its wgmmas are done, from its stage before it is freed.
            ptx::wgmma_wait_group<1>();
            mma::fence_accumulators(cur);
            read_scales(sa, sb, scales, stage);
            pipe.consumer_release(stage, lane);
            promote(acc, cur, sa, sb);
        } else {
            // The next k-block's scales, read while both groups run.
            float next_sa[2];
            ScalesB next_sb;
            read_scales(next_sa, next_sb, scales, next_stage);
            ptx::wgmma_wait_group<1>();
            mma::fence_accumulators(cur);
            pipe.consumer_release(stage, lane);
            promote(acc, cur, sa, sb);
            sa[0] = next_sa[0];
            sa[1] = next_sa[1];
            sb = next_sb;
        }
        stage = next_stage;
    }

    // The tile's last k-block, in flight in `cur`: waits for every group, frees its stage, promotes.
    template <class Pipe>
    __device__ __forceinline__ static void last_step(float (&acc)[kNumAccum],
                                                     float (&cur)[kNumAccum], const Pipe& pipe,
                                                     float (&sa)[2], ScalesB& sb, const StagedScales& scales,
                                                     uint32_t stage, uint32_t lane) {
        ptx::wgmma_wait_group<0>();
        mma::fence_accumulators(cur);
        if constexpr (kLateScales)
            read_scales(sa, sb, scales, stage);
        pipe.consumer_release(stage, lane);
        promote(acc, cur, sa, sb);
    }

    // One k-block's wgmmas on `stage` into `partial`, committed as one group.
    __device__ __forceinline__ static void issue_block(float (&partial)[kNumAccum], const DescBase& desc,
                                                       uint32_t stage) {
        // The stage is warp-uniform too; said so (lane 0's), the descriptors need no per-wgmma
        // register-to-uniform moves.
        const uint32_t uniform_stage = __shfl_sync(0xffffffffu, stage, 0);
        const uint32_t lo_a = desc.a + uniform_stage * (Stages::kABytes >> 4);
        const uint32_t lo_b = desc.b + uniform_stage * (Stages::kBBytes >> 4);
#pragma unroll
        for (uint32_t k = 0; k < kWgmmasPerBlock; ++k) {
            const uint64_t desc_a = mma::k_major_desc_at(lo_a, k * MMA::K);
            const uint64_t desc_b = mma::k_major_desc_at(lo_b, k * MMA::K);
            // The first wgmma of the k-block overwrites the partial sums (scale-d = 0).
            MMA::mma(partial, desc_a, desc_b, k > 0 ? 1u : 0u);
        }
        ptx::wgmma_commit_group();
    }

    // acc += partial * sa[row] * sb (both schedules).
    __device__ __forceinline__ static void promote(float (&acc)[kNumAccum], const float (&partial)[kNumAccum],
                                                   const float (&sa)[2], const float (&sb)[kNumScalesB]) {
        // K-grouped: accumulator i is row half (i / 2) % 2, column index 2 (i / 4) + i % 2.
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i)
            acc[i] = fmaf(partial[i], sa[(i >> 1) & 1] * sb[2 * (i / 4) + (i & 1)], acc[i]);
    }
    __device__ __forceinline__ static void promote(float (&acc)[kNumAccum], const float (&partial)[kNumAccum],
                                                   const float (&sa)[2], float sb) {
        const float scale_lo = sa[0] * sb, scale_hi = sa[1] * sb;
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i)
            acc[i] = fmaf(partial[i], (i & 2) ? scale_hi : scale_lo, acc[i]);
    }

    // 192-wide tiles: accumulator i is in the fragment's 8-column group i / 4, the first kSplit groups
    // in the first weight block, the others in the second. The products are the 128-wide tile's
    // (sa[row] * sb, then fmaf).
    template <uint32_t kSplit>
    __device__ __forceinline__ static void promote(float (&acc)[kNumAccum],
                                                   const float (&partial)[kNumAccum],
                                                   const float (&sa)[2], const TwoBlockScales& sb) {
        static_assert(kSplit == 8 || kSplit == 16, "MainloopFP8: a 192-wide tile switches blocks after 64 or 128 columns");
        const float lo0 = sa[0] * sb.first, hi0 = sa[1] * sb.first;
        const float lo1 = sa[0] * sb.second, hi1 = sa[1] * sb.second;
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i) {
            const bool first = i / 4 < kSplit;
            acc[i] = fmaf(partial[i], (i & 2) ? (first ? hi0 : hi1) : (first ? lo0 : lo1), acc[i]);
        }
    }
    // One weight block per tile (128-wide tiles): kSplit is 0.
    template <uint32_t kSplit, class ScalesBArg>
    __device__ __forceinline__ static void promote(float (&acc)[kNumAccum],
                                                   const float (&partial)[kNumAccum],
                                                   const float (&sa)[2], const ScalesBArg& sb) {
        promote(acc, partial, sa, sb);
    }

    // The staged scales: smem addresses in stage 0 of this thread's first row scale and of the tile's B
    // scale (K-grouped: of its first column's, column 2 (l % 4) of the tile). wgmma m64 fragment: thread
    // (warp w, lane l) of the warpgroup holds rows 16 w + l / 4 (accumulators i with i % 4 < 2) and
    // 16 w + l / 4 + 8 (the others) of the slice, and columns 8 j + 2 (l % 4) + {0, 1} (accumulators
    // 4 j .. 4 j + 3).
    __device__ __forceinline__ static StagedScales staged_scales(const Params& params, uint32_t slice,
                                                                 uint32_t lane) {
        const uint32_t warp = (threadIdx.x % 128) / 32;
        const uint32_t first_col = kKGrouped ? 2 * (lane % 4) : 0;
        return StagedScales{params.smem + (slice * 64 + warp * 16 + lane / 4) * 4,
                            params.smem + kScaleBOffset + first_col * 4};
    }

    // A stage's scales of this thread's two rows (row and row + 8) and the tile's B scale (the same
    // address in every thread: a broadcast).
    __device__ __forceinline__ static void read_row_scales(float (&sa)[2], const StagedScales& scales,
                                                           uint32_t offset) {
        sa[0] = ptx::ld_shared_f32(scales.rows + offset);
        sa[1] = ptx::ld_shared_f32(scales.rows + offset + 8 * 4);
    }
    __device__ __forceinline__ static void read_scales(float (&sa)[2], float& sb, const StagedScales& scales,
                                                       uint32_t stage) {
        const uint32_t offset = stage * kStageScaleBytes;
        read_row_scales(sa, scales, offset);
        sb = ptx::ld_shared_f32(scales.block_b + offset);
    }
    __device__ __forceinline__ static void read_scales(float (&sa)[2], TwoBlockScales& sb,
                                                       const StagedScales& scales, uint32_t stage) {
        read_scales(sa, sb.first, scales, stage);
        sb.second = ptx::ld_shared_f32(scales.block_b + stage * kStageScaleBytes + 4);
    }
    // K-grouped: the thread's 32 column scales, sb[2 j + t] that of column 8 j + 2 (l % 4) + t, as 16
    // 8-byte loads (the 8 lanes of a row group read the same 4 addresses).
    __device__ __forceinline__ static void read_scales(float (&sa)[2], float (&sb)[kNumScalesB],
                                                       const StagedScales& scales, uint32_t stage) {
        const uint32_t offset = stage * kStageScaleBytes;
        read_row_scales(sa, scales, offset);
#pragma unroll
        for (uint32_t j = 0; j < kNumScalesB / 2; ++j) {
            const float2 v = ptx::ld_shared_f32x2(scales.block_b + offset + 8 * j * 4);
            sb[2 * j] = v.x;
            sb[2 * j + 1] = v.y;
        }
    }
};

// The overlapping schedule as a policy of the core's `template <class, bool> class Mainloop`.
template <class Traits, bool kGenericProxyWrites>
using MainloopFP8Overlap = MainloopFP8<Traits, kGenericProxyWrites, true>;

}  // namespace dge::gemm
