#pragma once
// Epilogue policies of the SM90 grouped GEMM core (impls/sm90_bf16_grouped_gemm.cuh): what an
// epilogue is given, and the default one (bf16 C through swizzled smem and TMA stores).
//
// Epilogue contract:
//   static constexpr uint32_t kSmemBytes;                  smem for all consumer warpgroups
//   Epilogue(uint32_t smem, uint32_t warpgroup, uint32_t thread_in_warpgroup);
//   template <uint32_t kNumAccum, class Tile> void operator()(const float (&acc)[kNumAccum],
//                                                            const Tile&, const EpiArgs&...);
//   void finish();                                         before the CTA exits
// operator() is called once per 64-row slice a warpgroup holds (fp32 accumulators in the wgmma
// fragment layout) and may use the warpgroup's named barrier kEpilogueBarrierBase + warpgroup.
// The extra kernel arguments (EpiArgs...) are forwarded by reference, so CUtensorMap arguments
// keep their parameter-space address.

#include <cstdint>
#include <cuda.h>

#include <common/sm90_utils.cuh>
#include <layout/sm90_gemm.cuh>
#include <ptx/ld_st.cuh>

namespace dge::gemm {

// What an epilogue learns about the 64 x BLOCK_N slice its warpgroup holds.
template <uint32_t BLOCK_N, bool kPairedN>
struct EpilogueTile {
    TileColumns<BLOCK_N, kPairedN> cols;
    uint32_t row;           // first output row of the warpgroup's 64 rows (pool row, or e * M + m)
    uint32_t m_block;
    uint32_t n_block;
    uint32_t expert;
};

// Args: tma_c over C (64 x 64 boxes, 128B swizzle).
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

}  // namespace dge::gemm
