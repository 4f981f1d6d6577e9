#pragma once

// Routing metadata in three launches, no host synchronisation, deterministic:
//   1. histogram: CTA c counts the experts of its chunk of slots     -> chunk_counts[e][c]
//   2. scan:      one warp per expert turns its column into exclusive chunk offsets, and counts[e]
//   3. scatter:   every CTA rebuilds the aligned expert starts from counts (E is small), ranks
//                 its slots within each expert in slot order, writes both maps and the padding.
// Ranking in slot order (chunk, then warp, then lane) reproduces the stable sort of the torch
// reference bit for bit. Ids outside [0, E) are unused slots: counted nowhere, mapped to -1.
#include <common/utils.cuh>

namespace dge {

constexpr int kRoutingThreads = 256;
constexpr int kRoutingWarps = kRoutingThreads / kWarpSize;

template <typename IdxT>
__device__ __forceinline__ int routed_expert(const IdxT* __restrict__ topk_idx, int slot, int end, int num_experts) {
    if (slot >= end)
        return -1;
    const IdxT id = topk_idx[slot];
    return (id >= 0 && id < static_cast<IdxT>(num_experts)) ? static_cast<int>(id) : -1;
}

// The device-side check of the ids (the layer's default on a GPU, where the host check would cost a
// sync): an id outside [-1, E) fails the kernel with a device-side assertion, after printing which
// slot of the flattened topk_idx holds what. The routing's outputs stay in bounds either way.
template <typename IdxT>
__device__ __noinline__ void routing_bad_id(int slot, IdxT id, int num_experts) {
    printf("deep_gemm_ext: topk_idx holds ids outside [-1, %d): topk_idx.view(-1)[%d] = %lld\n", num_experts, slot,
           static_cast<long long>(id));
    assert(!"topk_idx holds ids outside [-1, num_experts)");
}

// Slots are read 32 consecutive ids per warp step (one 128-byte line for int32): ranking must
// follow slot order across lanes, which rules out several ids per lane. ``assert_ids``: the check
// above (the ids are read here anyway; the other two launches need not repeat it).
template <typename IdxT>
__global__ void __launch_bounds__(kRoutingThreads)
moe_routing_histogram_kernel(const IdxT* __restrict__ topk_idx, int num_slots, int num_experts, int chunk,
                             int* __restrict__ chunk_counts, int assert_ids) {
    extern __shared__ int smem_counts[];  // [num_experts]
    grid_dependency_wait();
    for (int e = threadIdx.x; e < num_experts; e += kRoutingThreads)
        smem_counts[e] = 0;
    __syncthreads();

    const int begin = blockIdx.x * chunk;
    const int end = min(begin + chunk, num_slots);
    for (int base = begin + warp_id() * kWarpSize; base < end; base += kRoutingThreads) {
        const int slot = base + lane_id();
        if (assert_ids && slot < end) {
            const IdxT id = topk_idx[slot];
            if (id < static_cast<IdxT>(-1) || id >= static_cast<IdxT>(num_experts))
                routing_bad_id(slot, id, num_experts);
        }
        const int expert = routed_expert(topk_idx, slot, end, num_experts);
        // One shared atomic per distinct expert in the warp: all-on-one-expert stays cheap.
        const u32 peers = __match_any_sync(kFullMask, expert);
        if (expert >= 0 && (peers & lanemask_lt()) == 0)
            atomicAdd(&smem_counts[expert], __popc(peers));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += kRoutingThreads)
        chunk_counts[e * gridDim.x + blockIdx.x] = smem_counts[e];
}

// One warp per expert column; kWarpsPerBlock experts per CTA.
template <int kWarpsPerBlock>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize)
moe_routing_scan_kernel(int* __restrict__ chunk_counts, int num_chunks, int num_experts, int* __restrict__ counts) {
    grid_dependency_wait();
    const int expert = blockIdx.x * kWarpsPerBlock + warp_id();
    if (expert >= num_experts)
        return;
    int* column = chunk_counts + static_cast<i64>(expert) * num_chunks;
    int carry = 0;
    for (int base = 0; base < num_chunks; base += kWarpSize) {
        const int c = base + lane_id();
        const int value = c < num_chunks ? column[c] : 0;
        const int inclusive = warp_inclusive_scan(value);
        if (c < num_chunks)
            column[c] = carry + inclusive - value;
        carry += __shfl_sync(kFullMask, inclusive, kWarpSize - 1);
    }
    if (lane_id() == 0)
        counts[expert] = carry;
}

// Dynamic shared memory: (kRoutingWarps + 1) * num_experts + kRoutingWarps ints.
template <typename IdxT>
__global__ void __launch_bounds__(kRoutingThreads)
moe_routing_scatter_kernel(const IdxT* __restrict__ topk_idx, int num_slots, int num_experts, int align, int chunk,
                           int num_pool_rows, const int* __restrict__ chunk_offsets, const int* __restrict__ counts,
                           int* __restrict__ starts, int* __restrict__ ends, int* __restrict__ slot_to_row,
                           int* __restrict__ row_to_slot) {
    extern __shared__ int smem[];
    int* warp_rows = smem;                                     // [kRoutingWarps][num_experts]
    int* expert_start = smem + kRoutingWarps * num_experts;   // [num_experts]
    int* warp_totals = expert_start + num_experts;            // [kRoutingWarps]
    grid_dependency_wait();

    // 1. Aligned expert starts: block-wide exclusive scan of round_up(counts, align).
    const int per_thread = (num_experts + kRoutingThreads - 1) / kRoutingThreads;
    const int first = threadIdx.x * per_thread;
    const int last = min(first + per_thread, num_experts);
    int local = 0;
    for (int e = first; e < last; ++e)
        local += (counts[e] + align - 1) / align * align;
    const int inclusive = warp_inclusive_scan(local);
    if (lane_id() == kWarpSize - 1)
        warp_totals[warp_id()] = inclusive;
    __syncthreads();
    int offset = inclusive - local;
    for (int w = 0; w < warp_id(); ++w)
        offset += warp_totals[w];
    for (int e = first; e < last; ++e) {
        const int padded = (counts[e] + align - 1) / align * align;
        expert_start[e] = offset;
        if (blockIdx.x == 0) {
            starts[e] = offset;
            ends[e] = offset + padded;
        }
        offset += padded;
    }
    for (int i = threadIdx.x; i < kRoutingWarps * num_experts; i += kRoutingThreads)
        warp_rows[i] = 0;
    __syncthreads();

    // 2. Per-warp histogram of this CTA's chunk; each warp owns a contiguous sub-chunk.
    const int sub_chunk = chunk / kRoutingWarps;
    const int chunk_begin = blockIdx.x * chunk;
    const int begin = chunk_begin + warp_id() * sub_chunk;
    const int end = min(begin + sub_chunk, num_slots);
    int* my_rows = warp_rows + warp_id() * num_experts;
    for (int base = begin; base < end; base += kWarpSize) {
        const int expert = routed_expert(topk_idx, base + lane_id(), end, num_experts);
        const u32 peers = __match_any_sync(kFullMask, expert);
        if (expert >= 0 && (peers & lanemask_lt()) == 0)
            my_rows[expert] += __popc(peers);
        // The next step's leader for this expert may be another lane: order the read-modify-writes.
        __syncwarp();
    }
    __syncthreads();

    // 3. First pool row of each (warp, expert): start + earlier chunks + earlier warps of this chunk.
    for (int e = threadIdx.x; e < num_experts; e += kRoutingThreads) {
        int row = expert_start[e] + chunk_offsets[static_cast<i64>(e) * gridDim.x + blockIdx.x];
        for (int w = 0; w < kRoutingWarps; ++w) {
            const int n = warp_rows[w * num_experts + e];
            warp_rows[w * num_experts + e] = row;
            row += n;
        }
    }
    __syncthreads();

    // 4. Scatter in slot order: rank among equal experts of the warp step = lanes below with the same id.
    for (int base = begin; base < end; base += kWarpSize) {
        const int slot = base + lane_id();
        const int expert = routed_expert(topk_idx, slot, end, num_experts);
        const u32 peers = __match_any_sync(kFullMask, expert);
        const int rank = __popc(peers & lanemask_lt());
        if (expert >= 0) {
            const int row = my_rows[expert] + rank;
            slot_to_row[slot] = row;
            row_to_slot[row] = slot;
        } else if (slot < end) {
            slot_to_row[slot] = -1;
        }
        __syncwarp();
        if (expert >= 0 && rank == 0)
            my_rows[expert] += __popc(peers);
        __syncwarp();
    }

    // 5. Padding rows (-1): each expert's tail, then everything past the last expert.
    for (int e = blockIdx.x; e < num_experts; e += gridDim.x) {
        const int pad_begin = expert_start[e] + counts[e];
        const int pad_end = expert_start[e] + (counts[e] + align - 1) / align * align;
        for (int row = pad_begin + threadIdx.x; row < pad_end; row += kRoutingThreads)
            row_to_slot[row] = -1;
    }
    const int used_rows = expert_start[num_experts - 1] + (counts[num_experts - 1] + align - 1) / align * align;
    for (int row = used_rows + blockIdx.x * kRoutingThreads + threadIdx.x; row < num_pool_rows;
         row += gridDim.x * kRoutingThreads)
        row_to_slot[row] = -1;
}

}  // namespace dge
