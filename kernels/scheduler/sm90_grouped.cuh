#pragma once
// Persistent tile scheduler over the block-aligned expert pool.
//
// M-grouped (forward, dgrad): the pool's 128-row blocks are the M tiles; expert e owns the pool
// rows [starts[e], ends[e]) (multiples of BLOCK_M), so each block maps to one expert, found by a
// binary search over `ends` (owning_expert); blocks past ends[E-1] are not scheduled and blocks
// owned by no expert are skipped. Tiles are walked in groups of kGroupM M blocks that sweep all N blocks, so the
// CTAs resident at one time share A blocks and expert weights in L2.
//
// K-grouped (weight gradients): tiles are (expert, M block, N block) of the [E, M, N] output; the
// K loop runs over the expert's pool rows, 0 blocks for an empty expert.
//
// With clusters of kClusterN CTAs along N, a scheduling unit is kClusterN adjacent N blocks of
// one M block, so the CTAs of a cluster see the same M block (and expert) in lock step.

#include <cstdint>

namespace dge::sched {

enum class GroupedGemmType : uint32_t { MGroupedContiguous = 0, KGroupedContiguous = 1 };

struct GroupedTile {
    uint32_t m_block;       // M-grouped: pool block; K-grouped: block of the expert's M
    uint32_t n_block;
    uint32_t expert;
    uint32_t num_k_blocks;
    uint32_t k_row;         // K-grouped: first pool row of the expert; 0 otherwise
};

__device__ __forceinline__ uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// The expert whose pool rows [starts[e], ends[e]) hold `row`, or num_experts when none does (rows
// past ends[E-1], or before the first row of the expert whose range ends past them). A binary
// search for the first expert whose range ends past `row` (ends is non-decreasing).
__device__ __forceinline__ uint32_t owning_expert(const int* starts, const int* ends, uint32_t num_experts,
                                                  uint32_t row) {
    uint32_t lo = 0, hi = num_experts;
    while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (static_cast<uint32_t>(__ldg(ends + mid)) > row)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo < num_experts && static_cast<uint32_t>(__ldg(starts + lo)) <= row ? lo : num_experts;
}

template <GroupedGemmType kType, uint32_t BLOCK_M, uint32_t BLOCK_K, uint32_t kGroupM, uint32_t kClusterN>
struct GroupedScheduler {
    static_assert(kGroupM > 0 && kClusterN > 0, "GroupedScheduler: kGroupM and kClusterN must be positive");

    const int* starts;
    const int* ends;
    uint32_t num_experts;
    uint32_t num_m_blocks;      // M-grouped: used pool blocks; K-grouped: blocks per expert
    uint32_t num_n_units;       // N blocks / kClusterN
    uint32_t num_tiles;         // scheduling units
    uint32_t num_k_blocks;      // M-grouped only
    uint32_t next_unit;
    uint32_t stride;
    uint32_t cta_rank;

    // num_n_blocks must be a multiple of kClusterN (checked on the host).
    __device__ GroupedScheduler(const int* starts_, const int* ends_, uint32_t num_experts_, uint32_t shape_m,
                                uint32_t num_n_blocks, uint32_t shape_k, uint32_t unit_begin,
                                uint32_t unit_stride, uint32_t cta_rank_)
        : starts(starts_), ends(ends_), num_experts(num_experts_), num_n_units(num_n_blocks / kClusterN),
          num_k_blocks(ceil_div(shape_k, BLOCK_K)), next_unit(unit_begin), stride(unit_stride), cta_rank(cta_rank_) {
        if constexpr (kType == GroupedGemmType::MGroupedContiguous) {
            const uint32_t used_rows = num_experts > 0 ? static_cast<uint32_t>(__ldg(ends + num_experts - 1)) : 0;
            num_m_blocks = ceil_div(used_rows, BLOCK_M);
            num_tiles = num_m_blocks * num_n_units;
        } else {
            num_m_blocks = shape_m / BLOCK_M;
            num_tiles = num_experts * num_m_blocks * num_n_units;
        }
    }

    __device__ __forceinline__ bool next(GroupedTile& tile) {
        while (next_unit < num_tiles) {
            const uint32_t unit = next_unit;
            next_unit += stride;
            uint32_t n_unit;
            if constexpr (kType == GroupedGemmType::MGroupedContiguous) {
                const uint32_t group_units = kGroupM * num_n_units;
                const uint32_t group = unit / group_units, in_group = unit % group_units;
                const uint32_t first_m = group * kGroupM;
                const uint32_t rows = min(kGroupM, num_m_blocks - first_m);
                tile.m_block = first_m + in_group % rows;
                n_unit = in_group / rows;
                const uint32_t row = tile.m_block * BLOCK_M;
                tile.expert = owning_expert(starts, ends, num_experts, row);
                if (tile.expert >= num_experts)
                    continue;
                tile.num_k_blocks = num_k_blocks;
                tile.k_row = 0;
            } else {
                const uint32_t per_expert = num_m_blocks * num_n_units;
                tile.expert = unit / per_expert;
                const uint32_t in_expert = unit % per_expert;
                tile.m_block = in_expert / num_n_units;
                n_unit = in_expert % num_n_units;
                const uint32_t begin = static_cast<uint32_t>(__ldg(starts + tile.expert));
                const uint32_t end = static_cast<uint32_t>(__ldg(ends + tile.expert));
                tile.k_row = begin;
                // An fp8 k-block (128) is one scale block: a last expert that ends at the pool's
                // end off a multiple of 128 gets its ragged block too (TMA reads zeros past the pool).
                if constexpr (BLOCK_K == 128)
                    tile.num_k_blocks = ceil_div(end - begin, BLOCK_K);
                else
                    tile.num_k_blocks = (end - begin) / BLOCK_K;
            }
            tile.n_block = n_unit * kClusterN + cta_rank;
            return true;
        }
        return false;
    }
};

}  // namespace dge::sched
