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
// Optionally, state read before the tile's mainloop (the core holds it in registers across it):
//   struct Prefetch;
//   template <class Tile> Prefetch prefetch(const Tile&, const EpiArgs&...) const;
// and then operator() takes (acc, tile, const Prefetch&, EpiArgs...).
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

// Args: tma_c over C (64 x 64 boxes, 128B swizzle). kNumBuffers: the warpgroup's staging buffers
// (sm90::WarpgroupChunkStore): 2 stages chunk by chunk (every tile but one); 3 stage the whole 64 x 192
// slice of the 128 x 192 fp8 tile before its stores. Same bytes stored either way.
template <uint32_t kNumBuffers>
struct EpilogueStoreBF16Buffers {
    using Store = sm90::WarpgroupChunkStore<kNumBuffers>;
    static constexpr uint32_t kSmemBytes = kNumConsumerWarpgroups * Store::kSmemBytes;
    Store store;

    __device__ EpilogueStoreBF16Buffers(uint32_t smem, uint32_t warpgroup, uint32_t thread)
        : store(smem + warpgroup * Store::kSmemBytes, kEpilogueBarrierBase + warpgroup, thread) {}

    template <uint32_t kNumAccum, class Tile>
    __device__ __forceinline__ void operator()(const float (&acc)[kNumAccum], const Tile& tile,
                                               const CUtensorMap& tma_c) {
        if constexpr (kNumBuffers == 2) {
#pragma unroll
            for (uint32_t chunk = 0; chunk < kNumAccum / 32; ++chunk) {
                uint32_t packed[16];
#pragma unroll
                for (uint32_t i = 0; i < 16; ++i)
                    packed[i] = ptx::pack_bf16x2(acc[chunk * 32 + 2 * i], acc[chunk * 32 + 2 * i + 1]);
                store.store(packed, &tma_c, tile.cols.col(chunk), tile.row);
            }
        } else {
            auto pack = [&](uint32_t chunk, uint32_t (&packed)[16]) {
#pragma unroll
                for (uint32_t i = 0; i < 16; ++i)
                    packed[i] = ptx::pack_bf16x2(acc[chunk * 32 + 2 * i], acc[chunk * 32 + 2 * i + 1]);
            };
            store.template store_slice<kNumAccum / 32>(pack, [&](uint32_t chunk) { return tile.cols.col(chunk); },
                                                       &tma_c, tile.row);
        }
    }

    __device__ __forceinline__ void finish() { store.drain(); }
};

// The default: two staging buffers per warpgroup.
struct EpilogueStoreBF16 : EpilogueStoreBF16Buffers<2> {
    using EpilogueStoreBF16Buffers<2>::EpilogueStoreBF16Buffers;
};

}  // namespace dge::gemm
