#pragma once

// Dispatch and combine on one GPU, by routing metadata:
//   gather:  pool[r] = x[row_to_slot[r] / top_k], zeros for padding rows (row_to_slot < 0)
//   combine: y[t]    = sum_{k = 0..K-1} w[t, k] * o[slot_to_row[t*K + k]], skipping unused slots
//            (or o[t*K + k] when o is already in slot order)
// One warp per row, 16-byte vectors across the hidden dimension. The combine sums in k order
// with explicit round-to-nearest mul/add (no FMA contraction): deterministic, and bit-equal to
// the same loop in torch. Out-of-range indices read as empty rows, never out of bounds.
#include <common/utils.cuh>

namespace dge {

constexpr int kGatherCombineThreads = 256;
constexpr int kGatherCombineWarps = kGatherCombineThreads / kWarpSize;

// Rows are copied as raw 16-byte vectors: one kernel per element size serves bf16 and fp8 pools (and
// fp32 scale rows). Each source row is read top_k times, the pool written once: kStreamStores writes
// the pool with evict-first stores so the source rows can stay in L2 between their reads.
template <int kElemBytes, bool kStreamStores = false>
__global__ void __launch_bounds__(kGatherCombineThreads)
gather_rows_kernel(const void* __restrict__ x, const int* __restrict__ row_to_slot, void* __restrict__ pool,
                   i64 num_rows, int hidden, int top_k, int num_tokens) {
    grid_dependency_wait();
    const int vecs_per_row = hidden * kElemBytes / 16;
    const i64 row_bytes = static_cast<i64>(hidden) * kElemBytes;
    const i64 num_warps = static_cast<i64>(gridDim.x) * kGatherCombineWarps;
    for (i64 row = static_cast<i64>(blockIdx.x) * kGatherCombineWarps + warp_id(); row < num_rows;
         row += num_warps) {
        const int slot = row_to_slot[row];
        const int token = slot >= 0 ? slot / top_k : -1;
        const uint4* src = token < num_tokens && token >= 0
                               ? reinterpret_cast<const uint4*>(static_cast<const char*>(x) + token * row_bytes)
                               : nullptr;
        uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(pool) + row * row_bytes);
#pragma unroll 4
        for (int v = lane_id(); v < vecs_per_row; v += kWarpSize) {
            const uint4 value = src != nullptr ? load_stream_v4(src + v) : make_uint4(0, 0, 0, 0);
            if constexpr (kStreamStores)
                store_stream_v4(dst + v, value);
            else
                store_v4(dst + v, value);
        }
    }
}

// The same pool in token order: a warp reads each token's row once (in chunks of 4 vectors a lane) and
// stores it to the pool rows of the token's used slots (slot_to_row), so each source row comes from
// memory once instead of top_k times; then the rows no used slot maps to (row_to_slot < 0, or a slot of
// a token past num_tokens) are zeroed, 32 rows a warp step. Where slot_to_row and row_to_slot are
// inverse maps over the used slots (routing metadata), every pool row gets gather_rows_kernel's bytes.
// top_k <= 32 (a lane holds one slot's row). Plain stores: with each source row read once there is
// nothing for evict-first stores to keep in L2 (they measured 0.97x here).
template <int kElemBytes>
__global__ void __launch_bounds__(kGatherCombineThreads)
scatter_token_rows_kernel(const void* __restrict__ x, const int* __restrict__ slot_to_row,
                          const int* __restrict__ row_to_slot, void* __restrict__ pool, i64 num_tokens, int hidden,
                          int top_k, i64 num_rows) {
    grid_dependency_wait();
    constexpr int kChunk = 4;
    const int vecs_per_row = hidden * kElemBytes / 16;
    const i64 row_bytes = static_cast<i64>(hidden) * kElemBytes;
    const i64 num_warps = static_cast<i64>(gridDim.x) * kGatherCombineWarps;
    const i64 warp = static_cast<i64>(blockIdx.x) * kGatherCombineWarps + warp_id();
    const int lane = lane_id();
    for (i64 token = warp; token < num_tokens; token += num_warps) {
        int slot_row = -1;
        if (lane < top_k) {
            const int r = slot_to_row[token * top_k + lane];
            slot_row = r >= 0 && r < num_rows ? r : -1;
        }
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(x) + token * row_bytes);
        for (int v0 = 0; v0 < vecs_per_row; v0 += kChunk * kWarpSize) {
            uint4 values[kChunk];
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                const int v = v0 + j * kWarpSize + lane;
                values[j] = v < vecs_per_row ? load_stream_v4(src + v) : make_uint4(0, 0, 0, 0);
            }
            for (int k = 0; k < top_k; ++k) {
                const int row = __shfl_sync(0xffffffffu, slot_row, k);
                if (row < 0)
                    continue;
                uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(pool) + row * row_bytes);
#pragma unroll
                for (int j = 0; j < kChunk; ++j) {
                    const int v = v0 + j * kWarpSize + lane;
                    if (v < vecs_per_row)
                        store_v4(dst + v, values[j]);
                }
            }
        }
    }
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (i64 base = warp * kWarpSize; base < num_rows; base += num_warps * kWarpSize) {
        const i64 r = base + lane;
        bool unmapped = false;
        if (r < num_rows) {
            const int slot = row_to_slot[r];
            unmapped = slot < 0 || slot / top_k >= num_tokens;
        }
        for (unsigned mask = __ballot_sync(0xffffffffu, unmapped); mask != 0; mask &= mask - 1) {
            const int i = __ffs(static_cast<int>(mask)) - 1;
            uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(pool) + (base + i) * row_bytes);
            for (int v = lane; v < vecs_per_row; v += kWarpSize)
                store_v4(dst + v, zero);
        }
    }
}

// top_k <= 32: the token's rows and weights are staged in shared memory, read as broadcasts.
// kWeighted = false: all weights are one (the multiply is exact, so it is simply skipped).
// kSlotOrder: o is already in slot order ([T*K, H], written by a GEMM's combine epilogue), so the
// slot t*K + k is read from row t*K + k of o when slot_to_row marks it used (>= 0), and unused
// slots, which nothing wrote, are skipped.
template <bool kWeighted, bool kSlotOrder>
__global__ void __launch_bounds__(kGatherCombineThreads)
combine_rows_kernel(const __nv_bfloat16* __restrict__ o, const int* __restrict__ slot_to_row,
                    const float* __restrict__ weights, __nv_bfloat16* __restrict__ y, i64 num_tokens, int hidden,
                    int top_k, int num_pool_rows) {
    __shared__ int smem_rows[kGatherCombineWarps][kWarpSize];
    __shared__ float smem_weights[kGatherCombineWarps][kWarpSize];
    grid_dependency_wait();
    const int vecs_per_row = hidden / kBf16PerVec;
    const int lane = lane_id();
    int* rows_of_token = smem_rows[warp_id()];
    float* weights_of_token = smem_weights[warp_id()];
    const i64 num_warps = static_cast<i64>(gridDim.x) * kGatherCombineWarps;
    for (i64 token = static_cast<i64>(blockIdx.x) * kGatherCombineWarps + warp_id(); token < num_tokens;
         token += num_warps) {
        if (lane < top_k) {
            const int row = slot_to_row[token * top_k + lane];
            // Slot order: o has one row per slot (num_pool_rows = T*K), and the pool row only says "used".
            const bool used = row >= 0 && (kSlotOrder || row < num_pool_rows);
            rows_of_token[lane] = !used ? -1 : kSlotOrder ? static_cast<int>(token * top_k + lane) : row;
            weights_of_token[lane] = kWeighted ? weights[token * top_k + lane] : 1.0f;
        }
        __syncwarp();
        for (int v = lane; v < vecs_per_row; v += kWarpSize) {
            float acc[kBf16PerVec];
#pragma unroll
            for (int i = 0; i < kBf16PerVec; ++i)
                acc[i] = 0.0f;
            // Loads of four slots are issued before their (ordered) accumulation.
            for (int k0 = 0; k0 < top_k; k0 += 4) {
                uint4 values[4];
                int rows[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    rows[j] = k0 + j < top_k ? rows_of_token[k0 + j] : -1;
                    values[j] = rows[j] >= 0 ? load_stream_v4(o + static_cast<i64>(rows[j]) * hidden + v * kBf16PerVec)
                                             : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (rows[j] < 0)
                        continue;
                    const float w = weights_of_token[k0 + j];
                    float value[kBf16PerVec];
                    unpack_bf16x8(values[j], value);
#pragma unroll
                    for (int i = 0; i < kBf16PerVec; ++i)
                        acc[i] = __fadd_rn(acc[i], kWeighted ? __fmul_rn(w, value[i]) : value[i]);
                }
            }
            store_v4(y + token * hidden + v * kBf16PerVec, pack_bf16x8(acc));
        }
        __syncwarp();
    }
}

// The rows of an M-grouped GEMM's output that no expert owns, [ends[E-1], num_rows), set to zero:
// the GEMM writes every row of [0, ends[E-1]) (padding rows included), so only this tail needs a
// value, and its start is read here on the device (no host sync). Vec-wide stores, grid-stride (a
// template, as every kernel of a header must be, so only the instantiated ones land in a module).
template <typename Vec>
__global__ void __launch_bounds__(kGatherCombineThreads)
zero_rows_past_kernel(void* __restrict__ out, const int* __restrict__ ends, int num_ends, i64 num_rows,
                      int row_vecs) {
    grid_dependency_wait();
    const i64 last = num_ends > 0 ? static_cast<i64>(ends[num_ends - 1]) : 0;
    const i64 first_row = last < 0 ? 0 : last > num_rows ? num_rows : last;
    const i64 end = num_rows * row_vecs;
    const i64 step = static_cast<i64>(gridDim.x) * blockDim.x;
    Vec* dst = static_cast<Vec*>(out);
    for (i64 v = first_row * row_vecs + static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; v < end; v += step)
        dst[v] = Vec{};
}

// out[i] = src[index[i]] where 0 <= index[i] < src_len, else 0: the per-row top-k weights of the pool (index
// row_to_slot) and d topk_weights in slot order (index slot_to_row) in one launch each.
template <typename T>
__global__ void __launch_bounds__(kGatherCombineThreads)
take_or_zero_kernel(const T* __restrict__ src, i64 src_len, const int* __restrict__ index, T* __restrict__ out,
                    i64 n) {
    grid_dependency_wait();
    const i64 step = static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
        const int j = index[i];
        out[i] = j >= 0 && j < src_len ? src[j] : T(0);
    }
}

}  // namespace dge
