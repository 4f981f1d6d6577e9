#pragma once
// SM90 building blocks shared by warp-specialized kernels: the TMA -> wgmma stage pipeline and the
// warpgroup's swizzled staging of bf16 output chunks for TMA stores.

#include <cstdint>
#include <cuda.h>

#include <ptx/ld_st.cuh>
#include <ptx/mbarrier.cuh>
#include <ptx/sync.cuh>
#include <ptx/tma.cuh>

namespace dge::sm90 {

// Position in a ring of kNumStages smem stages; the phase bit flips each time the ring wraps.
template <uint32_t kNumStages>
struct PipelineState {
    uint32_t stage = 0;
    uint32_t phase = 0;

    __device__ __forceinline__ void advance() {
        stage = stage + 1 == kNumStages ? 0 : stage + 1;
        phase ^= stage == 0 ? 1 : 0;
    }

    // `n` advances at once (a consumer skipping the k-blocks of a tile it does not own).
    __device__ __forceinline__ void advance(uint32_t n) {
        const uint32_t total = stage + n;
        phase ^= (total / kNumStages) & 1;
        stage = total % kNumStages;
    }
};

// Producer/consumer ring over kNumStages smem stages: "full" barriers complete when the TMA bytes
// of a stage have landed, "empty" barriers when every consumer warp of every CTA of the cluster
// (the multicast loads write into all of them) is done reading it.
template <uint32_t kNumStages, uint32_t kNumConsumerWarps, uint32_t kClusterSize, uint32_t kExtraProducerArrivals = 0>
struct TmaPipeline {
    static constexpr uint32_t kSmemBytes = 2 * kNumStages * sizeof(uint64_t);
    uint32_t full_bars;     // smem address of full[0]; 8 bytes per barrier
    uint32_t empty_bars;

    __device__ explicit TmaPipeline(uint32_t bars) : full_bars(bars), empty_bars(bars + kNumStages * 8) {}

    __device__ __forceinline__ uint32_t full(uint32_t stage) const { return full_bars + stage * 8; }
    __device__ __forceinline__ uint32_t empty(uint32_t stage) const { return empty_bars + stage * 8; }

    // One thread, before the CTA-wide (or cluster-wide) sync that publishes the barriers.
    __device__ void init() const {
        for (uint32_t s = 0; s < kNumStages; ++s) {
            // The producer's arrive.expect_tx, plus any cp.async (noinc) arrivals of the stage.
            ptx::mbarrier_init(full(s), 1 + kExtraProducerArrivals);
            ptx::mbarrier_init(empty(s), kNumConsumerWarps * kClusterSize);
        }
        ptx::fence_barrier_init();
    }

    // Producer: wait for the slot to be free, then announce the bytes its loads will deliver.
    // Returns the full barrier the loads must complete on. A fresh barrier passes the wait on
    // parity 1, so the first lap over the ring does not block.
    __device__ __forceinline__ uint32_t producer_acquire(const PipelineState<kNumStages>& st, uint32_t bytes) const {
        ptx::mbarrier_wait(empty(st.stage), st.phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(full(st.stage), bytes);
        return full(st.stage);
    }

    __device__ __forceinline__ void consumer_wait(const PipelineState<kNumStages>& st) const {
        ptx::mbarrier_wait(full(st.stage), st.phase);
    }

    // Every consumer warp calls this once its wgmmas reading `stage` have completed.
    __device__ __forceinline__ void consumer_release(uint32_t stage, uint32_t lane) const {
        if constexpr (kClusterSize == 1) {
            if (lane == 0)
                ptx::mbarrier_arrive(empty(stage));
        } else {
            if (lane < kClusterSize)
                ptx::mbarrier_arrive_cluster(empty(stage), lane);
        }
    }
};

// Chunk byte offset of 16-byte column `col16` (0..7) of `row` in a 64 x 64 bf16 chunk of 128-byte
// rows with the 128B swizzle (the layout TMA reads and writes with CU_TENSOR_MAP_SWIZZLE_128B).
__device__ __forceinline__ uint32_t swizzled_chunk_offset(uint32_t row, uint32_t col16) {
    return row * 128 + ((col16 ^ (row % 8)) << 4);
}

// A warpgroup writes its 64 x 64 bf16 chunk into `buf` (1024-byte aligned, 8 KiB) with stmatrix:
// `packed[i]` = bf16x2 of accumulator pair i (wgmma layout: pairs 2c and 2c+1 are rows l/4 and
// l/4+8 of warp w's 16 rows, columns 8c + 2(l%4)); row r of the chunk lands at
// swizzled_chunk_offset(r, .).
__device__ __forceinline__ void stage_chunk(uint32_t buf, uint32_t thread, const uint32_t (&packed)[16]) {
    const uint32_t lane = thread % 32, warp = thread / 32;
    const uint32_t matrix = lane / 8, r = lane % 8;
    const uint32_t smem_row = warp * 16 + (matrix & 1) * 8 + r;
#pragma unroll
    for (uint32_t s = 0; s < 4; ++s) {
        const uint32_t col16 = 2 * s + (matrix >> 1);
        ptx::stmatrix_x4(buf + swizzled_chunk_offset(smem_row, col16), packed[4 * s], packed[4 * s + 1],
                         packed[4 * s + 2], packed[4 * s + 3]);
    }
}

// A warpgroup's 64-row slice of an output tile goes out in 64 x 64 bf16 chunks: stmatrix into one
// of kNumBuffers 8 KiB 128B-swizzled buffers, then one thread issues the TMA store, so the next
// chunk (or the next tile's mainloop) overlaps the store of this one.
//
//   kNumBuffers = 2  store(): chunk c waits for the store of chunk c - 2 to finish reading its
//                    buffer, inside the tile when the slice has more than two chunks (BLOCK_N 256);
//                    two named-barrier syncs per chunk.
//   kNumBuffers = 3  store_slice(): the whole 64 x 192 slice (the 192-wide fp8 tile) staged at once, so the chunks of a tile
//                    never wait on each other; only the first thing the next tile's epilogue does,
//                    waiting for this tile's stores to have read their buffers, waits at all, and
//                    those stores had a whole mainloop to finish. Two named-barrier syncs per tile:
//                    buffers free (thread 0's wait, published), then slice staged (every thread's
//                    stmatrix and proxy fence, before thread 0's TMA stores).
template <uint32_t kNumBuffers = 2>
class WarpgroupChunkStore {
public:
    static_assert(kNumBuffers == 2 || kNumBuffers == 3, "WarpgroupChunkStore: 2 or 3 staging buffers");
    static constexpr uint32_t kChunkBytes = 64 * 64 * 2;
    static constexpr uint32_t kBuffers = kNumBuffers;
    static constexpr uint32_t kSmemBytes = kNumBuffers * kChunkBytes;

    // `buffers`: 1024-byte aligned smem address owned by this warpgroup; `barrier_id`: a named
    // barrier reserved for it; `thread`: index in the warpgroup.
    __device__ WarpgroupChunkStore(uint32_t buffers, uint32_t barrier_id, uint32_t thread)
        : buffers_(buffers), barrier_id_(barrier_id), thread_(thread) {}

    // `packed[i]` = bf16x2 of accumulator pair i of the chunk (wgmma layout: pairs 2c and 2c+1 are
    // rows l/4 and l/4+8 of the warp's 16 rows, columns 8c + 2(l%4)).
    __device__ __forceinline__ void store(const uint32_t (&packed)[16], const CUtensorMap* map, uint32_t col,
                                          uint32_t row) {
        const uint32_t buf = buffers_ + slot_ * kChunkBytes;
        if (thread_ == 0)
            ptx::bulk_wait_group_read<kNumBuffers - 1>();  // the store that last read this buffer is done with it
        ptx::named_barrier_sync(barrier_id_, 128);
        stage_chunk(buf, thread_, packed);
        ptx::fence_proxy_async_smem();
        ptx::named_barrier_sync(barrier_id_, 128);
        if (thread_ == 0) {
            ptx::tma_store_2d(map, buf, static_cast<int32_t>(col), static_cast<int32_t>(row));
            ptx::bulk_commit_group();
        }
        if constexpr (kNumBuffers == 2)
            slot_ ^= 1;
        else
            slot_ = slot_ + 1 == kNumBuffers ? 0 : slot_ + 1;
    }

    // The kNumChunks (<= kNumBuffers) chunks of one slice, chunk c into buffer c: `pack(c, packed)`
    // fills chunk c's bf16x2 pairs, `col_of(c)` is its first output column; every chunk goes to
    // `row` of `map`. One bulk group per slice.
    template <uint32_t kNumChunks, class Pack, class ColOf>
    __device__ __forceinline__ void store_slice(const Pack& pack, const ColOf& col_of, const CUtensorMap* map,
                                                uint32_t row) {
        static_assert(kNumChunks <= kNumBuffers, "store_slice: one buffer per chunk of the slice");
        if (thread_ == 0)
            ptx::bulk_wait_group_read<0>();  // the previous slice's stores are done reading every buffer
        ptx::named_barrier_sync(barrier_id_, 128);
#pragma unroll
        for (uint32_t c = 0; c < kNumChunks; ++c) {
            uint32_t packed[16];
            pack(c, packed);
            stage_chunk(buffers_ + c * kChunkBytes, thread_, packed);
        }
        ptx::fence_proxy_async_smem();
        ptx::named_barrier_sync(barrier_id_, 128);
        if (thread_ == 0) {
#pragma unroll
            for (uint32_t c = 0; c < kNumChunks; ++c)
                ptx::tma_store_2d(map, buffers_ + c * kChunkBytes, static_cast<int32_t>(col_of(c)),
                                  static_cast<int32_t>(row));
            ptx::bulk_commit_group();
        }
    }

    // Outstanding stores must finish before the CTA exits (they read its shared memory).
    __device__ __forceinline__ void drain() const {
        if (thread_ == 0)
            ptx::bulk_wait_group<0>();
    }

private:
    uint32_t buffers_;
    uint32_t barrier_id_;
    uint32_t thread_;
    uint32_t slot_ = 0;
};

}  // namespace dge::sm90
