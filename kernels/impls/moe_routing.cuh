#pragma once

// Routing metadata, no host synchronisation, deterministic. In one launch (the default where it fits):
//   moe_routing_cluster_kernel: one cluster of kRoutingClusterCtas CTAs, each counting its chunk of slots
//   per warp in shared memory; after a cluster barrier every CTA reads its peers' counts (distributed
//   shared memory), so it has the totals and its own chunk's offsets, and scatters as below.
// In three launches (any number of experts and slots):
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

// The lanes of the warp whose expert equals this lane's (unused slots, -1, match each other), from one
// ballot per bit of the key expert + 1 in [0, num_experts]: the mask __match_any_sync returns, bit for
// bit, at a cost that does not grow with the number of distinct experts in the warp (match.any's does:
// with ~28 distinct experts in 32 random slots it set the pace of a routing on 8 SMs).
__device__ __forceinline__ int routing_key_bits(int num_experts) {
    return kWarpSize - __clz(num_experts);
}

__device__ __forceinline__ u32 routing_peers(int expert, int key_bits) {
    const u32 key = static_cast<u32>(expert + 1);
    u32 peers = kFullMask;
    for (int b = 0; b < key_bits; ++b) {
        const bool bit = (key >> b) & 1u;
        const u32 ones = __ballot_sync(kFullMask, bit);
        peers &= bit ? ones : ~ones;
    }
    return peers;
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
        const u32 peers = routing_peers(expert, routing_key_bits(num_experts));
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

// The aligned expert starts (block-wide exclusive scan of round_up(counts, align)) into expert_start;
// CTA `writer` also stores starts / ends. warp_totals: kWarps ints of scratch.
template <int kThreads>
__device__ __forceinline__ void routing_expert_starts(const int* counts, int num_experts, int align, bool writer,
                                                      int* expert_start, int* warp_totals, int* __restrict__ starts,
                                                      int* __restrict__ ends) {
    const int per_thread = (num_experts + kThreads - 1) / kThreads;
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
        if (writer) {
            starts[e] = offset;
            ends[e] = offset + padded;
        }
        offset += padded;
    }
}

// Ids are loaded kRoutingBatch warp steps at a time (independent loads in flight) before they are ranked
// one warp step after another: the ranking's warp-synchronous steps would otherwise wait out one load
// latency each.
constexpr int kRoutingBatch = 8;

// Walks a warp's slots [begin, end) in slot order, one warp step (32 slots) at a time, calling
// step(slot, expert, peers) with the lanes of the step that share this lane's expert; all 32 lanes take
// every step (end is uniform across the warp).
template <typename IdxT, typename Step>
__device__ __forceinline__ void routing_warp_steps(const IdxT* __restrict__ topk_idx, int begin, int end,
                                                   int num_experts, Step&& step) {
    const int key_bits = routing_key_bits(num_experts);
    for (int base = begin; base < end; base += kRoutingBatch * kWarpSize) {
        int experts[kRoutingBatch];
#pragma unroll
        for (int j = 0; j < kRoutingBatch; ++j)
            experts[j] = routed_expert(topk_idx, base + j * kWarpSize + lane_id(), end, num_experts);
#pragma unroll
        for (int j = 0; j < kRoutingBatch; ++j) {
            if (base + j * kWarpSize >= end)
                break;
            step(base + j * kWarpSize + lane_id(), experts[j], routing_peers(experts[j], key_bits));
        }
    }
}

// Per-warp counts of each warp's contiguous sub-chunk [begin, end) into my_rows[num_experts].
template <typename IdxT>
__device__ __forceinline__ void routing_warp_counts(const IdxT* __restrict__ topk_idx, int begin, int end,
                                                    int num_experts, int* my_rows) {
    routing_warp_steps(topk_idx, begin, end, num_experts, [&](int, int expert, u32 peers) {
        if (expert >= 0 && (peers & lanemask_lt()) == 0)
            my_rows[expert] += __popc(peers);
        // The next step's leader for this expert may be another lane: order the read-modify-writes.
        __syncwarp();
    });
}

// From the per-warp counts to the scatter and the padding rows: warp_rows[kWarps][E] holds each warp's
// counts; row = expert_start[e] + chunk_offset[e] (the slots of expert e in earlier chunks) + earlier
// warps. `part` of `parts` strides the padding rows over the CTAs.
template <typename IdxT, int kWarps>
__device__ __forceinline__ void routing_scatter_rows(const IdxT* __restrict__ topk_idx, int begin, int end,
                                                     int num_experts, int align, int num_pool_rows,
                                                     const int* counts, const int* expert_start,
                                                     const int* chunk_offset, int chunk_offset_stride, int* warp_rows,
                                                     int part, int parts, int* __restrict__ slot_to_row,
                                                     int* __restrict__ row_to_slot) {
    constexpr int kThreads = kWarps * kWarpSize;
    // First pool row of each (warp, expert): start + earlier chunks + earlier warps of this chunk.
    for (int e = threadIdx.x; e < num_experts; e += kThreads) {
        int row = expert_start[e] + chunk_offset[static_cast<i64>(e) * chunk_offset_stride];
        for (int w = 0; w < kWarps; ++w) {
            const int n = warp_rows[w * num_experts + e];
            warp_rows[w * num_experts + e] = row;
            row += n;
        }
    }
    __syncthreads();

    // Scatter in slot order: rank among equal experts of the warp step = lanes below with the same id.
    int* my_rows = warp_rows + warp_id() * num_experts;
    routing_warp_steps(topk_idx, begin, end, num_experts, [&](int slot, int expert, u32 peers) {
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
    });

    // Padding rows (-1): each expert's tail, then everything past the last expert.
    for (int e = part; e < num_experts; e += parts) {
        const int pad_begin = expert_start[e] + counts[e];
        const int pad_end = expert_start[e] + (counts[e] + align - 1) / align * align;
        for (int row = pad_begin + threadIdx.x; row < pad_end; row += kThreads)
            row_to_slot[row] = -1;
    }
    const int used_rows = expert_start[num_experts - 1] + (counts[num_experts - 1] + align - 1) / align * align;
    for (int row = used_rows + part * kThreads + threadIdx.x; row < num_pool_rows; row += parts * kThreads)
        row_to_slot[row] = -1;
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

    routing_expert_starts<kRoutingThreads>(counts, num_experts, align, blockIdx.x == 0, expert_start, warp_totals,
                                           starts, ends);
    for (int i = threadIdx.x; i < kRoutingWarps * num_experts; i += kRoutingThreads)
        warp_rows[i] = 0;
    __syncthreads();

    // Per-warp histogram of this CTA's chunk; each warp owns a contiguous sub-chunk.
    const int sub_chunk = chunk / kRoutingWarps;
    const int begin = blockIdx.x * chunk + warp_id() * sub_chunk;
    const int end = min(begin + sub_chunk, num_slots);
    routing_warp_counts(topk_idx, begin, end, num_experts, warp_rows + warp_id() * num_experts);
    __syncthreads();

    routing_scatter_rows<IdxT, kRoutingWarps>(topk_idx, begin, end, num_experts, align, num_pool_rows, counts,
                                              expert_start, chunk_offsets + blockIdx.x, gridDim.x, warp_rows,
                                              blockIdx.x, gridDim.x, slot_to_row, row_to_slot);
}

// -- one launch: a cluster of CTAs sharing their counts through distributed shared memory --------------

constexpr int kRoutingClusterCtas = 8;
constexpr int kRoutingClusterThreads = 1024;
constexpr int kRoutingClusterWarps = kRoutingClusterThreads / kWarpSize;

// `value` at the same shared-memory address in CTA `cta_rank` of the cluster.
__device__ __forceinline__ int load_peer_shared(const int* local, u32 cta_rank) {
    const u32 address = static_cast<u32>(__cvta_generic_to_shared(local));
    int value;
    asm volatile("{\n\t.reg .u32 remote;\n\tmapa.shared::cluster.u32 remote, %1, %2;\n\t"
                 "ld.shared::cluster.s32 %0, [remote];\n\t}"
                 : "=r"(value) : "r"(address), "r"(cta_rank) : "memory");
    return value;
}

// Dynamic shared memory: (kRoutingClusterWarps + 4) * num_experts + kRoutingClusterWarps ints. Launched as
// one cluster of kRoutingClusterCtas CTAs; `chunk` slots per CTA, a multiple of kRoutingClusterThreads.
template <typename IdxT>
__global__ void __launch_bounds__(kRoutingClusterThreads)
moe_routing_cluster_kernel(const IdxT* __restrict__ topk_idx, int num_slots, int num_experts, int align, int chunk,
                           int num_pool_rows, int* __restrict__ counts, int* __restrict__ starts,
                           int* __restrict__ ends, int* __restrict__ slot_to_row, int* __restrict__ row_to_slot,
                           int assert_ids) {
    constexpr int kWarps = kRoutingClusterWarps;
    extern __shared__ int smem[];
    int* warp_rows = smem;                                  // [kWarps][num_experts]
    int* chunk_counts = warp_rows + kWarps * num_experts;   // [num_experts]: this CTA's, read by its peers
    int* total = chunk_counts + num_experts;                // [num_experts]
    int* chunk_offset = total + num_experts;                // [num_experts]: earlier CTAs' slots per expert
    int* expert_start = chunk_offset + num_experts;         // [num_experts]
    int* warp_totals = expert_start + num_experts;          // [kWarps]
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    grid_dependency_wait();

    for (int i = threadIdx.x; i < kWarps * num_experts; i += kRoutingClusterThreads)
        warp_rows[i] = 0;
    __syncthreads();

    const int sub_chunk = chunk / kWarps;
    const int begin = static_cast<int>(rank) * chunk + warp_id() * sub_chunk;
    const int end = min(begin + sub_chunk, num_slots);
    if (assert_ids) {
        for (int base = begin; base < end; base += kRoutingBatch * kWarpSize) {
            IdxT ids[kRoutingBatch];
#pragma unroll
            for (int j = 0; j < kRoutingBatch; ++j) {
                const int slot = base + j * kWarpSize + lane_id();
                ids[j] = slot < end ? topk_idx[slot] : static_cast<IdxT>(-1);
            }
#pragma unroll
            for (int j = 0; j < kRoutingBatch; ++j)
                if (ids[j] < static_cast<IdxT>(-1) || ids[j] >= static_cast<IdxT>(num_experts))
                    routing_bad_id(base + j * kWarpSize + lane_id(), ids[j], num_experts);
        }
    }
    routing_warp_counts(topk_idx, begin, end, num_experts, warp_rows + warp_id() * num_experts);
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += kRoutingClusterThreads) {
        int n = 0;
        for (int w = 0; w < kWarps; ++w)
            n += warp_rows[w * num_experts + e];
        chunk_counts[e] = n;
    }
    // Every CTA's chunk_counts written and visible to the cluster.
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    for (int e = threadIdx.x; e < num_experts; e += kRoutingClusterThreads) {
        int before = 0, all = 0;
#pragma unroll
        for (u32 r = 0; r < kRoutingClusterCtas; ++r) {
            const int n = load_peer_shared(chunk_counts + e, r);
            before += r < rank ? n : 0;
            all += n;
        }
        total[e] = all;
        chunk_offset[e] = before;
        if (rank == 0)
            counts[e] = all;
    }
    // Done reading the peers' counts (each CTA waits for this before it exits, so none leaves while a
    // peer still reads its shared memory).
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    __syncthreads();

    routing_expert_starts<kRoutingClusterThreads>(total, num_experts, align, rank == 0, expert_start, warp_totals,
                                                  starts, ends);
    __syncthreads();
    routing_scatter_rows<IdxT, kWarps>(topk_idx, begin, end, num_experts, align, num_pool_rows, total, expert_start,
                                       chunk_offset, 1, warp_rows, static_cast<int>(rank), kRoutingClusterCtas,
                                       slot_to_row, row_to_slot);
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

}  // namespace dge
