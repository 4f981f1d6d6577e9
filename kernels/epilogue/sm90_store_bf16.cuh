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
// Or, instead of operator(), a deferred store (kDeferred = true): the core packs a slice's accumulators
// with pack() when its mainloop ends and hands the packed slice to store_part<p>() for each of its
// kDeferredParts<kNumAccum> parts, part p while k-block p of the warpgroup's next tile is in the tensor
// cores (where that tile has fewer k-blocks, or none follows, the parts left are stored at once). Both
// get the slice's Prefetch (NoPrefetch where the epilogue defines none), which the core keeps for it:
//   static constexpr bool kDeferred = true;
//   template <uint32_t kNumAccum> static constexpr uint32_t kDeferredParts;
//   template <uint32_t kNumAccum, class Tile, class Pre> void pack(const float (&acc)[kNumAccum], const Tile&,
//       const Pre&, uint32_t (&packed)[kNumAccum / 2], const EpiArgs&...);
//   template <uint32_t kPart, uint32_t kNumPacked, class Tile, class Pre> void store_part(
//       const uint32_t (&packed)[kNumPacked], const Tile&, const Pre&, const EpiArgs&...);
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
// (sm90::WarpgroupChunkStore): 2 stages chunk by chunk; 3 or 4 stage a whole 64 x 192 / 64 x 256 slice
// before its stores (64 KiB for both warpgroups at 4, so a 128 x 256 tile keeps 3 smem stages, not 4;
// the 128 x 192 fp8 tile takes 3). Same bytes stored either way.
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

// The store of EpilogueStoreBF16 deferred into the next tile's mainloop (kDeferred above): the
// accumulators are packed to bf16 pairs when a slice's mainloop ends, so they are free for the next
// tile, and the slice goes out two 64 x 64 chunks at a time, the two staging buffers per warpgroup
// holding one part each time: part p's stmatrix, syncs and TMA stores run while k-block p of the
// next tile is in the tensor cores, instead of between the two tiles with the tensor cores idle.
// Part p + 1 waits for part p's stores to have read the buffers, issued a k-block earlier; part 0
// for the previous slice's last part, a whole mainloop earlier. Same bytes stored as
// EpilogueStoreBF16: the same bf16 conversion of the same accumulators, to the same places.
struct EpilogueStoreBF16Deferred {
    using Store = sm90::WarpgroupChunkStore<2>;
    static constexpr uint32_t kSmemBytes = kNumConsumerWarpgroups * Store::kSmemBytes;
    static constexpr bool kDeferred = true;
    // Two 64-column chunks (32 accumulators each) per part.
    template <uint32_t kNumAccum>
    static constexpr uint32_t kDeferredParts = kNumAccum / 64;
    Store store;

    __device__ EpilogueStoreBF16Deferred(uint32_t smem, uint32_t warpgroup, uint32_t thread)
        : store(smem + warpgroup * Store::kSmemBytes, kEpilogueBarrierBase + warpgroup, thread) {}

    // packed[16 c + i] = bf16x2 of chunk c's accumulator pair i.
    template <uint32_t kNumAccum, class Tile, class Pre>
    __device__ __forceinline__ void pack(const float (&acc)[kNumAccum], const Tile&, const Pre&,
                                         uint32_t (&packed)[kNumAccum / 2], const CUtensorMap&) const {
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum / 2; ++i)
            packed[i] = ptx::pack_bf16x2(acc[2 * i], acc[2 * i + 1]);
    }

    template <uint32_t kPart, uint32_t kNumPacked, class Tile, class Pre>
    __device__ __forceinline__ void store_part(const uint32_t (&packed)[kNumPacked], const Tile& tile, const Pre&,
                                               const CUtensorMap& tma_c) {
        static_assert(kNumPacked % 32 == 0 && kPart < kNumPacked / 32, "store_part: two whole chunks per part");
        auto chunk_of = [&](uint32_t c, uint32_t (&out)[16]) {
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i)
                out[i] = packed[(2 * kPart + c) * 16 + i];
        };
        store.template store_slice<2>(chunk_of, [&](uint32_t c) { return tile.cols.col(2 * kPart + c); }, &tma_c,
                                      tile.row);
    }

    __device__ __forceinline__ void finish() { store.drain(); }
};

// The default: two staging buffers per warpgroup.
struct EpilogueStoreBF16 : EpilogueStoreBF16Buffers<2> {
    using EpilogueStoreBF16Buffers<2>::EpilogueStoreBF16Buffers;
};

}  // namespace dge::gemm
