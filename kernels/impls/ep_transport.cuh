#pragma once

// Expert-parallel token exchange over symmetric memory: every rank owns one region of a symmetric
// allocation, every rank reads the others' regions through a table of peer base pointers (NVLink
// peers, or W regions of one allocation when the ranks are emulated on one GPU).
//
// Region layout (byte offsets are kernel arguments, all multiples of 16):
//   rows     R rows of row_pitch bytes       (dispatch's x rows, y_r, dy, dx_r)
//   ids      R * K int32                     (dispatch's topk_idx)
//   weights  R * K * 8 bytes                 (dispatch's topk_weights, dispatch_backward's dw_r)
//   count    int32 tokens of this rank       (dispatch)
//   flags    u64 ready[W], consumed[W], epoch, blocks_done
//
// Every exchange piece is two launches on the rank's stream:
//   publish  wait until every peer's consumed[peer] >= epoch (they finished reading the previous
//            piece), copy this rank's data into its own region; the last CTA to finish resets
//            blocks_done, bumps epoch to e + 1 and stores e + 1 into ready[me] of every peer.
//   pull     wait until ready[s] >= epoch for every source s, read the peers' regions into a fresh
//            local output; the last CTA stores epoch into consumed[me] of every peer.
// All ranks run the pieces in the same order, so their epochs agree without any host counter, and
// nothing waits on the host (CUDA-graph capturable). Flags are read with ld.acquire.sys and
// written with st.release.sys; data is published with a system-scope fence before the flags.
//
// Waits are bounded: past timeout_ns (from %globaltimer) the waiting thread prints which rank
// waited on which flag of which peer, the awaited epoch and the value it saw, then traps.
//
// Rows are copied as 16-byte vectors, one warp per row; row lengths in bytes are multiples of 16.
// Sums over ranks run in rank order, in fp32 (fp64 for fp64) with explicit round-to-nearest adds,
// rounded once to the element type: the same bits as the same loop in torch.
#include <cuda_fp16.h>
#include <common/utils.cuh>

namespace dge {

constexpr int kEpThreads = 256;
constexpr int kEpWarps = kEpThreads / kWarpSize;

// Offsets into a rank's region (the same on every rank: the allocation is symmetric).
struct EpLayout {
    u64 rows;
    u64 ids;
    u64 weights;
    u64 count;
    u64 flags;
};

// The layout's offsets travel as four scalar arguments (the rows area starts the region).
#define DGE_EP_LAYOUT_PARAMS                                                                              \
    unsigned long long ids_offset, unsigned long long weights_offset, unsigned long long count_offset,    \
        unsigned long long flags_offset
#define DGE_EP_LAYOUT EpLayout{0, ids_offset, weights_offset, count_offset, flags_offset}

// The unsigned word of a weight's width (4: fp32, 8: fp64): weights travel as raw bits.
template <int kBytes>
struct EpWord;
template <>
struct EpWord<4> {
    using type = u32;
};
template <>
struct EpWord<8> {
    using type = u64;
};

// ---------------------------------------------------------------------------------------------
// Flags

__device__ __forceinline__ u64 ep_load_acquire(const u64* ptr) {
    u64 value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void ep_store_release(u64* ptr, u64 value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ u64 ep_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Reads of peers' data: cached in L2 only (the region changes between launches).
__device__ __forceinline__ uint4 ep_load_v4(const void* ptr) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

template <typename T>
__device__ __forceinline__ T* ep_at(long long base, u64 offset) {
    return reinterpret_cast<T*>(static_cast<unsigned long long>(base) + offset);
}

__device__ __forceinline__ u64* ep_ready(long long base, const EpLayout& layout) {
    return ep_at<u64>(base, layout.flags);
}
__device__ __forceinline__ u64* ep_consumed(long long base, const EpLayout& layout, int world) {
    return ep_at<u64>(base, layout.flags) + world;
}
__device__ __forceinline__ u64* ep_epoch(long long base, const EpLayout& layout, int world) {
    return ep_at<u64>(base, layout.flags) + 2 * world;
}
__device__ __forceinline__ u64* ep_blocks_done(long long base, const EpLayout& layout, int world) {
    return ep_at<u64>(base, layout.flags) + 2 * world + 1;
}

// Spin until *flag >= target; past timeout_ns name the rank, the flag, the peer and the values, and trap.
__device__ __noinline__ void ep_wait_flag(const u64* flag, u64 target, u64 timeout_ns, int rank, int is_ready,
                                          int peer) {
    u64 seen = ep_load_acquire(flag);
    if (seen >= target)
        return;
    const u64 start = ep_globaltimer();
    while (true) {
        __nanosleep(64);
        seen = ep_load_acquire(flag);
        if (seen >= target)
            return;
        if (ep_globaltimer() - start > timeout_ns) {
            printf("deep_gemm_ext symmetric exchange: rank %d timed out waiting on %s[%d] (peer rank %d): "
                   "awaited epoch %llu, seen %llu\n",
                   rank, is_ready ? "ready" : "consumed", peer, peer, target, seen);
            __trap();
        }
    }
}

// Thread 0 waits on flags[0..world) >= target, then the CTA goes on (the acquire loads and the
// fence order the CTA's later reads after the peers' releases).
__device__ __forceinline__ void ep_cta_wait_all(const u64* flags, int world, u64 target, u64 timeout_ns, int rank,
                                                int is_ready) {
    if (threadIdx.x == 0) {
        for (int peer = 0; peer < world; ++peer)
            ep_wait_flag(flags + peer, target, timeout_ns, rank, is_ready, peer);
        __threadfence_system();
    }
    __syncthreads();
}

// The CTA's writes are done: count it; the last CTA of the grid resets the counter and stores
// `value` (with release semantics) into flag_index of every peer (ready[me] or consumed[me]).
// Returns nothing; bump_epoch makes the last CTA also advance this rank's epoch first.
__device__ __forceinline__ void ep_cta_finish(const long long* peers, const EpLayout& layout, int world, int rank,
                                              bool bump_epoch, u64 value, bool is_ready) {
    __syncthreads();
    if (threadIdx.x != 0)
        return;
    __threadfence_system();
    const long long mine = peers[rank];
    u64* done = ep_blocks_done(mine, layout, world);
    const u64 finished = atomicAdd(done, 1ull) + 1;
    if (finished != gridDim.x)
        return;
    __threadfence_system();  // every CTA's writes (fenced before its increment) precede the flags
    *done = 0;
    if (bump_epoch)
        *ep_epoch(mine, layout, world) = value;
    __threadfence_system();
    for (int peer = 0; peer < world; ++peer) {
        u64* flags = is_ready ? ep_ready(peers[peer], layout) : ep_consumed(peers[peer], layout, world);
        ep_store_release(flags + rank, value);
    }
}

__device__ __forceinline__ void ep_copy_row(const void* src, void* dst, int vecs) {
    const uint4* s = static_cast<const uint4*>(src);
    uint4* d = static_cast<uint4*>(dst);
#pragma unroll 4
    for (int v = lane_id(); v < vecs; v += kWarpSize)
        store_v4(d + v, load_stream_v4(s + v));
}

__device__ __forceinline__ void ep_zero_row(void* dst, int vecs) {
    uint4* d = static_cast<uint4*>(dst);
    for (int v = lane_id(); v < vecs; v += kWarpSize)
        store_v4(d + v, make_uint4(0, 0, 0, 0));
}

// ---------------------------------------------------------------------------------------------
// Publish: num_rows rows of row_bytes (16-byte aligned, contiguous) into the rows area at
// row_pitch, two 4-byte-granular blobs into the ids and weights areas, and the token count.

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
ep_publish_kernel(const long long* __restrict__ peers, DGE_EP_LAYOUT_PARAMS, int world, int rank,
                  const void* __restrict__ rows, u32 num_rows, u32 row_bytes, u32 row_pitch,
                  const void* __restrict__ ids, u32 ids_bytes, const void* __restrict__ weights, u32 weight_bytes,
                  int num_tokens, unsigned long long timeout_ns) {
    grid_dependency_wait();
    const EpLayout layout = DGE_EP_LAYOUT;
    const long long mine = peers[rank];
    const u64 epoch = *ep_epoch(mine, layout, world);
    // The region is free once every peer has read this rank's previous piece.
    ep_cta_wait_all(ep_consumed(mine, layout, world), world, epoch, timeout_ns, rank, 0);

    constexpr int kWarps = kThreads / kWarpSize;
    char* dst_rows = ep_at<char>(mine, layout.rows);
    const int vecs = static_cast<int>(row_bytes / 16);
    const i64 num_warps = static_cast<i64>(gridDim.x) * kWarps;
    const i64 first_warp = static_cast<i64>(blockIdx.x) * kWarps + warp_id();
    for (i64 row = first_warp; row < num_rows; row += num_warps)
        ep_copy_row(static_cast<const char*>(rows) + row * row_bytes, dst_rows + row * row_pitch, vecs);

    const i64 thread = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x;
    const i64 num_threads = static_cast<i64>(gridDim.x) * kThreads;
    u32* dst_ids = ep_at<u32>(mine, layout.ids);
    for (i64 i = thread; i < ids_bytes / 4; i += num_threads)
        dst_ids[i] = static_cast<const u32*>(ids)[i];
    u32* dst_weights = ep_at<u32>(mine, layout.weights);
    for (i64 i = thread; i < weight_bytes / 4; i += num_threads)
        dst_weights[i] = static_cast<const u32*>(weights)[i];
    if (thread == 0)
        *ep_at<int>(mine, layout.count) = num_tokens;

    ep_cta_finish(peers, layout, world, rank, true, epoch + 1, true);
}

// ---------------------------------------------------------------------------------------------
// Pull: dispatch. Row j = s * cap + t of the output is source s's token t where one of its slots
// names an expert of this rank (ids local to this rank, weights), else a zero row, ids -1,
// weights 0 (also for t >= T_s). received[j] says which.

// One received row's routing, by one warp: the source's ids of `token` that are this rank's experts
// (first .. first + num_local_experts) as local ids, the others -1, with their weights (0 where not
// this rank's), written to idx_r / w_r at `row`; returns whether any slot is this rank's.
template <typename Weight>
__device__ __forceinline__ bool ep_row_routing(long long base, const EpLayout& layout, bool present, int token,
                                               int top_k, int first, int num_local_experts, i64 row,
                                               int* __restrict__ idx_r, void* __restrict__ w_r, int lane) {
    bool any_mine = false;
    for (int k0 = 0; k0 < top_k; k0 += kWarpSize) {
        const int k = k0 + lane;
        int local = -1;
        Weight weight = 0;
        if (present && k < top_k) {
            const i64 slot = static_cast<i64>(token) * top_k + k;
            const int id = ep_at<volatile int>(base, layout.ids)[slot];
            if (id >= first && id < first + num_local_experts) {
                local = id - first;
                weight = ep_at<volatile Weight>(base, layout.weights)[slot];
            }
        }
        if (k < top_k) {
            idx_r[row * top_k + k] = local;
            static_cast<Weight*>(w_r)[row * top_k + k] = weight;
        }
        any_mine |= __any_sync(kFullMask, local >= 0);
    }
    return any_mine;
}

// Every received row's routing (ids and weights of this rank's experts, the received mask) and,
// with kCopyRows, the row itself (zeros where none of this rank's experts takes it), after every
// source's ready flag; returns the awaited epoch. The dispatch pull copies the rows, the
// overlapped dispatch's metadata pull does not (ep_pull_rows_arrive_kernel copies them).
template <int kWeightBytes, bool kCopyRows>
__device__ __forceinline__ u64 ep_pull_routed_rows(const long long* __restrict__ peers, const EpLayout& layout,
                                                   int world, int rank, int capacity, int top_k,
                                                   int num_local_experts, u32 row_bytes, u32 row_pitch,
                                                   void* __restrict__ x_r, int* __restrict__ idx_r,
                                                   void* __restrict__ w_r, void* __restrict__ received,
                                                   unsigned long long timeout_ns) {
    using Weight = typename EpWord<kWeightBytes>::type;
    const long long mine = peers[rank];
    const u64 epoch = *ep_epoch(mine, layout, world);
    ep_cta_wait_all(ep_ready(mine, layout), world, epoch, timeout_ns, rank, 1);

    const int vecs = static_cast<int>(row_bytes / 16);
    const int lane = lane_id();
    const int first = rank * num_local_experts;
    const i64 num_rows = static_cast<i64>(world) * capacity;
    const i64 num_warps = static_cast<i64>(gridDim.x) * kEpWarps;
    for (i64 row = static_cast<i64>(blockIdx.x) * kEpWarps + warp_id(); row < num_rows; row += num_warps) {
        const int src = static_cast<int>(row / capacity);
        const int token = static_cast<int>(row % capacity);
        const long long base = peers[src];
        const bool present = token < *ep_at<volatile int>(base, layout.count);
        const bool any_mine = ep_row_routing<Weight>(base, layout, present, token, top_k, first, num_local_experts,
                                                    row, idx_r, w_r, lane);
        if constexpr (kCopyRows) {
            char* dst = static_cast<char*>(x_r) + row * row_bytes;
            if (any_mine) {
                const uint4* s = ep_at<const uint4>(base, layout.rows + static_cast<u64>(token) * row_pitch);
                for (int v = lane; v < vecs; v += kWarpSize)
                    store_v4(reinterpret_cast<uint4*>(dst) + v, ep_load_v4(s + v));
            } else {
                ep_zero_row(dst, vecs);
            }
        }
        if (lane == 0)
            static_cast<unsigned char*>(received)[row] = any_mine ? 1 : 0;
    }
    return epoch;
}

template <int kWeightBytes>
__global__ void __launch_bounds__(kEpThreads)
ep_pull_dispatch_kernel(const long long* __restrict__ peers, DGE_EP_LAYOUT_PARAMS, int world, int rank, int capacity,
                        int top_k, int num_local_experts, u32 row_bytes, u32 row_pitch, void* __restrict__ x_r,
                        int* __restrict__ idx_r, void* __restrict__ w_r, void* __restrict__ received,
                        unsigned long long timeout_ns) {
    grid_dependency_wait();
    const EpLayout layout = DGE_EP_LAYOUT;
    const u64 epoch = ep_pull_routed_rows<kWeightBytes, true>(peers, layout, world, rank, capacity, top_k,
                                                              num_local_experts, row_bytes, row_pitch, x_r, idx_r,
                                                              w_r, received, timeout_ns);
    ep_cta_finish(peers, layout, world, rank, false, epoch, false);
}

// ---------------------------------------------------------------------------------------------
// Pull: rows by mask (combine_backward). Row j = s * cap + t of the output is row t of source
// s's rows area where mask[j], else zero.

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
ep_pull_rows_kernel(const long long* __restrict__ peers, DGE_EP_LAYOUT_PARAMS, int world, int rank, int capacity,
                    u32 row_bytes, u32 row_pitch, const unsigned char* __restrict__ mask, void* __restrict__ out,
                    unsigned long long timeout_ns) {
    grid_dependency_wait();
    const EpLayout layout = DGE_EP_LAYOUT;
    const long long mine = peers[rank];
    const u64 epoch = *ep_epoch(mine, layout, world);
    ep_cta_wait_all(ep_ready(mine, layout), world, epoch, timeout_ns, rank, 1);

    constexpr int kWarps = kThreads / kWarpSize;
    const int vecs = static_cast<int>(row_bytes / 16);
    const i64 num_rows = static_cast<i64>(world) * capacity;
    const i64 num_warps = static_cast<i64>(gridDim.x) * kWarps;
    for (i64 row = static_cast<i64>(blockIdx.x) * kWarps + warp_id(); row < num_rows; row += num_warps) {
        const int src = static_cast<int>(row / capacity);
        const int token = static_cast<int>(row % capacity);
        char* dst = static_cast<char*>(out) + row * row_bytes;
        if (mask[row]) {
            const uint4* s = ep_at<const uint4>(peers[src], layout.rows + static_cast<u64>(token) * row_pitch);
            for (int v = lane_id(); v < vecs; v += kWarpSize)
                store_v4(reinterpret_cast<uint4*>(dst) + v, ep_load_v4(s + v));
        } else {
            ep_zero_row(dst, vecs);
        }
    }
    ep_cta_finish(peers, layout, world, rank, false, epoch, false);
}

// ---------------------------------------------------------------------------------------------
// Dispatch split in two for the overlap of the L1 GEMM with the pull of x's rows (DGE_EP_OVERLAP):
//   ep_pull_meta_kernel         ids, weights and the received mask (ep_pull_dispatch_kernel's
//                               metadata, the same values); reads no rows and raises no flag.
//   ep_pull_rows_arrive_kernel  the rows, as ep_pull_rows_kernel with mask = received, walking the
//                               sources in the order me, me + 1, ... (mod W); once every CTA has
//                               written its share of source s's block (a per-source CTA counter,
//                               each CTA fenced before its increment), the last one stores the
//                               epoch into arrivals[s] (release, gpu scope): the L1 GEMM's loader
//                               (loader/sm90_gemm_loaders.cuh, LoaderGatherCpAsyncAwait) waits on
//                               it. It raises the consumed flags at its end, for both launches
//                               (it is launched after ep_pull_meta_kernel has completed).
// arrivals [W] (u64 epochs in int64 storage) and counters [W] int32 are local memory of the rank
// (not the symmetric region); the counters are zero between launches (the last CTA of a source
// resets its counter).

__device__ __forceinline__ void ep_store_release_gpu(u64* ptr, u64 value) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

template <int kWeightBytes>
__global__ void __launch_bounds__(kEpThreads)
ep_pull_meta_kernel(const long long* __restrict__ peers, DGE_EP_LAYOUT_PARAMS, int world, int rank, int capacity,
                    int top_k, int num_local_experts, int* __restrict__ idx_r, void* __restrict__ w_r,
                    void* __restrict__ received, unsigned long long timeout_ns) {
    grid_dependency_wait();
    const EpLayout layout = DGE_EP_LAYOUT;
    ep_pull_routed_rows<kWeightBytes, false>(peers, layout, world, rank, capacity, top_k, num_local_experts, 0, 0,
                                             nullptr, idx_r, w_r, received, timeout_ns);
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
ep_pull_rows_arrive_kernel(const long long* __restrict__ peers, DGE_EP_LAYOUT_PARAMS, int world, int rank,
                           int capacity, u32 row_bytes, u32 row_pitch, const unsigned char* __restrict__ mask,
                           void* __restrict__ out, long long* __restrict__ arrivals,
                           int* __restrict__ counters, unsigned long long timeout_ns) {
    grid_dependency_wait();
    const EpLayout layout = DGE_EP_LAYOUT;
    const long long mine = peers[rank];
    const u64 epoch = *ep_epoch(mine, layout, world);
    ep_cta_wait_all(ep_ready(mine, layout), world, epoch, timeout_ns, rank, 1);

    constexpr int kWarps = kThreads / kWarpSize;
    const int vecs = static_cast<int>(row_bytes / 16);
    const i64 num_warps = static_cast<i64>(gridDim.x) * kWarps;
    for (int i = 0; i < world; ++i) {
        const int src = (rank + i) % world;  // this rank's own block first: its rows are local
        for (i64 token = static_cast<i64>(blockIdx.x) * kWarps + warp_id(); token < capacity; token += num_warps) {
            const i64 row = static_cast<i64>(src) * capacity + token;
            char* dst = static_cast<char*>(out) + row * row_bytes;
            if (mask[row]) {
                const uint4* s = ep_at<const uint4>(peers[src], layout.rows + static_cast<u64>(token) * row_pitch);
                for (int v = lane_id(); v < vecs; v += kWarpSize)
                    store_v4(reinterpret_cast<uint4*>(dst) + v, ep_load_v4(s + v));
            } else {
                ep_zero_row(dst, vecs);
            }
        }
        // The CTA's rows of src are written: count it; the last CTA of src publishes the arrival.
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            const int done = atomicAdd(counters + src, 1) + 1;
            if (done == static_cast<int>(gridDim.x)) {
                counters[src] = 0;
                __threadfence();  // every CTA's rows (fenced before its increment) precede the arrival
                ep_store_release_gpu(reinterpret_cast<u64*>(arrivals) + src, epoch);
            }
        }
    }
    ep_cta_finish(peers, layout, world, rank, false, epoch, false);
}

// ---------------------------------------------------------------------------------------------
// Pull: sums over ranks (combine, dispatch_backward). out[t] = sum over d = 0..W-1, in rank
// order, of row (me * cap + t) of rank d's rows area where sent[d, t], accumulated in Acc and
// rounded once. With d_topk: d_topk[t, k] = rank owner[t, k]'s weights area at (me * cap + t, k),
// 0 where owner[t, k] < 0.

template <typename T>
struct EpElem;
template <>
struct EpElem<__nv_bfloat16> {
    using Acc = float;
    static __device__ __forceinline__ float load(const __nv_bfloat16& v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct EpElem<__half> {
    using Acc = float;
    static __device__ __forceinline__ float load(const __half& v) { return __half2float(v); }
    static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};
template <>
struct EpElem<float> {
    using Acc = float;
    static __device__ __forceinline__ float load(const float& v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};
template <>
struct EpElem<double> {
    using Acc = double;
    static __device__ __forceinline__ double load(const double& v) { return v; }
    static __device__ __forceinline__ double store(double v) { return v; }
};

__device__ __forceinline__ float ep_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double ep_add(double a, double b) { return __dadd_rn(a, b); }

template <typename T, int kWeightBytes>
__global__ void __launch_bounds__(kEpThreads)
ep_pull_sum_kernel(const long long* __restrict__ peers, DGE_EP_LAYOUT_PARAMS, int world, int rank, int capacity,
                   int num_tokens, int hidden, u32 row_pitch, const unsigned char* __restrict__ sent,
                   T* __restrict__ out, const long long* __restrict__ owner, int top_k, void* __restrict__ d_topk,
                   unsigned long long timeout_ns) {
    using Acc = typename EpElem<T>::Acc;
    using Weight = typename EpWord<kWeightBytes>::type;
    constexpr int kPerVec = 16 / static_cast<int>(sizeof(T));
    grid_dependency_wait();
    const EpLayout layout = DGE_EP_LAYOUT;
    const long long mine = peers[rank];
    const u64 epoch = *ep_epoch(mine, layout, world);
    ep_cta_wait_all(ep_ready(mine, layout), world, epoch, timeout_ns, rank, 1);

    const int vecs = hidden / kPerVec;
    const int lane = lane_id();
    const i64 num_warps = static_cast<i64>(gridDim.x) * kEpWarps;
    for (i64 token = static_cast<i64>(blockIdx.x) * kEpWarps + warp_id(); token < num_tokens; token += num_warps) {
        const u64 src_row = static_cast<u64>(static_cast<i64>(rank) * capacity + token);
        for (int v = lane; v < vecs; v += kWarpSize) {
            Acc acc[kPerVec];
#pragma unroll
            for (int i = 0; i < kPerVec; ++i)
                acc[i] = Acc(0);
            for (int d = 0; d < world; ++d) {  // rank order: the same bits whatever answered first
                if (!sent[static_cast<i64>(d) * num_tokens + token])
                    continue;
                const uint4 raw = ep_load_v4(ep_at<const uint4>(peers[d], layout.rows + src_row * row_pitch) + v);
                const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int i = 0; i < kPerVec; ++i)
                    acc[i] = ep_add(acc[i], EpElem<T>::load(values[i]));
            }
            uint4 packed;
            T* result = reinterpret_cast<T*>(&packed);
#pragma unroll
            for (int i = 0; i < kPerVec; ++i)
                result[i] = EpElem<T>::store(acc[i]);
            store_v4(out + token * hidden + v * kPerVec, packed);
        }
        if (d_topk != nullptr) {
            for (int k = lane; k < top_k; k += kWarpSize) {
                const long long d = owner[token * top_k + k];
                Weight value = 0;
                if (d >= 0 && d < world)
                    value = ep_at<volatile Weight>(peers[d], layout.weights)[src_row * top_k + k];
                static_cast<Weight*>(d_topk)[token * top_k + k] = value;
            }
        }
    }
    ep_cta_finish(peers, layout, world, rank, false, epoch, false);
}

}  // namespace dge
