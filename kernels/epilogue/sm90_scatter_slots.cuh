#pragma once
// Combine epilogue policy of the SM90 grouped GEMM core (impls/sm90_bf16_grouped_gemm.cuh): the GEMMs
// whose output is summed over each token's top-k rows (the L2 forward into y, the L1 dgrad into dx)
// write every pool row r straight into its token's top-k slot, out[row_to_slot[r]] of a slot-ordered
// [T*K, N] matrix, so the reduction that follows (combine_rows_kernel<.., kSlotOrder = true>) reads
// each token's K rows as one contiguous block, in k order, with no float atomics.
//
//   EpilogueScatterSlots<false>   out[row_to_slot[r]] = bf16(acc[r])
//   EpilogueScatterSlots<true>    out[row_to_slot[r]] = bf16(acc[r] * row_weights[r])  (the fp32 product, rounded once)
//
// The weights are in pool order (row_weights[r]: the weight of row r's slot), so a thread's two
// weights are loaded before the mainloop with its rows' slots, independent of them. Padding rows
// (row_to_slot < 0), rows past the pool and slots past out are not stored. Each 64 x 64 chunk of the
// warpgroup's slice is staged in swizzled shared memory (stmatrix), then the warpgroup stores it row
// by row: thread t moves the 16-byte column t % 8 of rows t / 8 + 16 i, so each warp writes four
// whole 128-byte row segments per instruction; a thread reads its four rows of a chunk from shared
// memory before it stores any of them, so the four loads are in flight together. Two staging buffers
// per warpgroup alternate chunk by chunk, one named-barrier sync per chunk.

#include <cstdint>
#include <cuda_bf16.h>

#include <common/sm90_utils.cuh>
#include <epilogue/sm90_store_bf16.cuh>
#include <ptx/ld_st.cuh>
#include <ptx/sync.cuh>

namespace dge::gemm {

template <bool kWeighted>
struct EpilogueScatterSlots {
    static constexpr uint32_t kNumBuffers = 2;
    static constexpr uint32_t kChunkBytes = sm90::WarpgroupChunkStore<>::kChunkBytes;
    static constexpr uint32_t kSmemBytes = kNumConsumerWarpgroups * kNumBuffers * kChunkBytes;
    static constexpr uint32_t kRowsPerThread = 4;  // 64 rows / (128 threads / 8 columns of 16 bytes)
    uint32_t buffers;
    uint32_t barrier_id;
    uint32_t thread;
    uint32_t slot = 0;  // which of the two staging buffers the next chunk uses

    __device__ EpilogueScatterSlots(uint32_t smem, uint32_t warpgroup, uint32_t thread_)
        : buffers(smem + warpgroup * kNumBuffers * kChunkBytes), barrier_id(kEpilogueBarrierBase + warpgroup),
          thread(thread_) {}

    // What the epilogue of a slice reads from global memory, loaded before the tile's mainloop (the
    // core's Prefetch hook) and first used after it, so that the loads are in flight under the wgmmas:
    // the slots of the four rows this thread stores, and the weights of its two accumulator rows.
    // Loaded after the mainloop they were the first thing every tile's epilogue waited for, with the
    // tensor cores idle (two dependent L2 round trips when the weights were read by slot). Raw slots
    // (-1 past the pool): checked where they are used.
    struct Prefetch {
        int32_t dst_slot[kRowsPerThread];
        float acc_weight[2];
    };

    // Args: out [num_slots, N] bf16 (16-byte aligned, N % 8 == 0), row_to_slot [num_rows] int32,
    // row_weights [num_rows] fp32 (read only when kWeighted), num_rows, num_slots, N.
    template <uint32_t BLOCK_N>
    __device__ __forceinline__ Prefetch prefetch(const EpilogueTile<BLOCK_N, false>& tile, __nv_bfloat16* const&,
                                                 const int* const& row_to_slot, const float* const& row_weights,
                                                 const uint32_t& num_rows, const uint32_t&, const uint32_t&) const {
        Prefetch pre;
#pragma unroll
        for (uint32_t i = 0; i < kRowsPerThread; ++i) {
            const uint32_t row = tile.row + thread / 8 + 16 * i;
            pre.dst_slot[i] = row < num_rows ? __ldg(row_to_slot + row) : -1;
        }
        // The two accumulator rows this thread holds: rows l/4 and l/4 + 8 of its warp's 16.
        const uint32_t row0 = tile.row + (thread / 32) * 16 + (thread % 32) / 4;
#pragma unroll
        for (uint32_t j = 0; j < 2; ++j) {
            const uint32_t row = row0 + 8 * j;
            pre.acc_weight[j] = kWeighted && row < num_rows ? __ldg(row_weights + row) : 1.0f;
        }
        return pre;
    }

    template <uint32_t kNumAccum, uint32_t BLOCK_N>
    __device__ __forceinline__ void operator()(const float (&acc)[kNumAccum], const EpilogueTile<BLOCK_N, false>& tile,
                                               const Prefetch& pre, __nv_bfloat16* const& out,
                                               const int* const&, const float* const&, const uint32_t&,
                                               const uint32_t& num_slots, const uint32_t& shape_n) {
        const uint32_t col16 = thread % 8;
        const Rows rows = rows_of(pre, out, num_slots, shape_n);
#pragma unroll
        for (uint32_t chunk = 0; chunk < kNumAccum / 32; ++chunk) {
            uint32_t packed[16];
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i)
                packed[i] = pack_pair(acc, chunk * 16 + i, pre.acc_weight);
            // Two buffers: the barrier after staging chunk c also orders every thread's reads of
            // chunk c - 1, so chunk c + 1 may overwrite that buffer.
            const uint32_t buf = buffers + slot * kChunkBytes;
            sm90::stage_chunk(buf, thread, packed);
            ptx::named_barrier_sync(barrier_id, 128);
            const uint32_t col = tile.cols.col(chunk) + 8 * col16;
            if (col < shape_n)
                store_rows(buf, rows, col);
            slot ^= 1;
        }
    }

    __device__ __forceinline__ void finish() {}

   private:
    struct Rows {
        __nv_bfloat16* ptr[kRowsPerThread];
        bool stored[kRowsPerThread];
    };

    // Accumulator pair i (pair 16 c + j is chunk c's pair j: row l/4 of the warp's 16, +8 when j is odd) as
    // bf16x2, times its row's weight first when kWeighted (the fp32 product, rounded once).
    template <uint32_t kNumAccum>
    __device__ __forceinline__ static uint32_t pack_pair(const float (&acc)[kNumAccum], uint32_t i,
                                                         const float (&weight)[2]) {
        float lo = acc[2 * i], hi = acc[2 * i + 1];
        if constexpr (kWeighted) {
            lo = __fmul_rn(lo, weight[i % 2]);
            hi = __fmul_rn(hi, weight[i % 2]);
        }
        return ptx::pack_bf16x2(lo, hi);
    }

    // Where this thread's four rows go: padding rows (-1) and slots past out are not stored; each stored
    // row's address is made once per slice, a chunk adds its column.
    __device__ __forceinline__ static Rows rows_of(const Prefetch& pre, __nv_bfloat16* out, uint32_t num_slots,
                                                   uint32_t shape_n) {
        Rows rows;
#pragma unroll
        for (uint32_t i = 0; i < kRowsPerThread; ++i) {
            const int32_t s = pre.dst_slot[i];
            rows.stored[i] = s >= 0 && static_cast<uint32_t>(s) < num_slots;
            rows.ptr[i] = out + static_cast<uint64_t>(rows.stored[i] ? s : 0) * shape_n;
        }
        return rows;
    }

    // This thread's four rows of a staged chunk: the four shared-memory loads first, then the stores of
    // the rows that have a slot, predicated (a load of a row that is not stored reads staged data and is
    // dropped).
    __device__ __forceinline__ void store_rows(uint32_t buf, const Rows& rows, uint32_t col) const {
        const uint32_t col16 = thread % 8;
        uint4 v[kRowsPerThread];
#pragma unroll
        for (uint32_t i = 0; i < kRowsPerThread; ++i)
            v[i] = ptx::ld_shared_v4(buf + sm90::swizzled_chunk_offset(thread / 8 + 16 * i, col16));
#pragma unroll
        for (uint32_t i = 0; i < kRowsPerThread; ++i)
            ptx::st_global_v4_if(rows.stored[i], rows.ptr[i] + col, v[i]);
    }
};

}  // namespace dge::gemm
