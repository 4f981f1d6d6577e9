#pragma once
// Persistent tile scheduler over the block-aligned expert pool.
//
// M-grouped (forward, dgrad): the pool's 128-row blocks are the M tiles; expert e owns the pool
// rows [starts[e], ends[e]) (multiples of BLOCK_M), so each block maps to one expert, found by a
// binary search over the ranges (owning_expert_staged on the kernel's shared-memory copy of them, or
// owning_expert on `ends` in global memory); blocks past ends[E-1] are not scheduled and blocks
// owned by no expert are skipped. Tiles are walked in groups of kGroupM M blocks that sweep all N blocks, so the
// CTAs resident at one time share A blocks and expert weights in L2. With kExpertGroups (no clusters, no M
// order) a group never crosses an expert: each expert's blocks are cut into groups of kGroupM from its first
// block, the last one shorter. Then an expert with fewer blocks than kGroupM is one group, whose tiles of
// one weight block run side by side, and no expert's weights are read by two groups far apart in time
// (with groups of fixed size, an expert that straddles two of them is).
//
// K-grouped (weight gradients): tiles are (expert, M block, N block) of the [E, M, N] output; the
// K loop runs over the expert's pool rows, 0 blocks for an empty expert.
//
// Clusters of kClusterSize = 2 CTAs: a scheduling unit is a pair of adjacent M blocks (2p, 2p + 1)
// at one N block; CTA r of the cluster takes M block 2p + r. The pair shares the B tile (the same
// expert weight block, or for K-grouped GEMMs the same expert's B rows), which the loader then
// multicasts: each CTA loads one half of B into both CTAs (GroupedTile::multicast). Pairing along
// M (not N) keeps any N-block count (N = 768 at 256-wide tiles is 3 blocks) and multicasts the
// larger operand of a 128 x 256 tile (B, 32 KiB per k-block, against A's 16 KiB). The two CTAs
// share their smem rings' empty barriers, so they must consume the same sequence of k-blocks: a
// CTA whose M block does not exist (past the last block, a block no expert owns, past an expert's
// M in K-grouped GEMMs) runs a duplicate of its partner's tile with GroupedTile::store = false
// (loads, wgmmas, no epilogue), and a pair of two different experts loads without multicast
// (M-grouped: the pair straddles an expert boundary). Both CTAs derive all of this from the unit,
// so they agree without communicating.

#include <cstdint>

#include <ptx/ld_st.cuh>

namespace dge::sched {

enum class GroupedGemmType : uint32_t { MGroupedContiguous = 0, KGroupedContiguous = 1 };

struct GroupedTile {
    uint32_t m_block;       // M-grouped: pool block; K-grouped: block of the expert's M
    uint32_t n_block;
    uint32_t expert;
    uint32_t num_k_blocks;
    uint32_t k_row;         // K-grouped: first pool row of the expert; 0 otherwise
    bool multicast;         // clusters: the pair shares B (each CTA loads half of it into both)
    bool store;             // false: a duplicate of the partner's tile, run for the barriers only
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

// The experts' block ranges staged in shared memory for owning_expert_staged (M-grouped GEMMs, at most
// kStagedExperts experts): entry e is (ceil(starts[e] / BLOCK_M) << 16) | ceil(ends[e] / BLOCK_M), both
// below 2^16, so that for a block m, ends[e] > m * BLOCK_M exactly when the low half is > m and
// starts[e] <= m * BLOCK_M exactly when the high half is <= m (x <= m and ceil(x) <= m agree for an
// integer m, as x > m and ceil(x) > m do): the same expert as owning_expert's, aligned ranges or not.
// Why: every tile of every warp that walks the tiles starts with this search, 8 dependent loads for 128
// experts; from shared memory they are short and do not depend on what L1 still holds.
constexpr uint32_t kStagedExperts = 256;
constexpr uint32_t kStagedExpertBytes = kStagedExperts * 4;

template <uint32_t BLOCK_M>
__device__ __forceinline__ bool stage_expert_blocks(uint32_t table, const int* starts, const int* ends,
                                                    uint32_t num_experts, uint32_t thread, uint32_t num_threads) {
    bool ok = true;
    for (uint32_t e = thread; e < num_experts; e += num_threads) {
        const int s = __ldg(starts + e), t = __ldg(ends + e);
        constexpr int kMaxRow = 65535 * static_cast<int>(BLOCK_M);
        if (s < 0 || t < 0 || s > kMaxRow || t > kMaxRow) {
            ok = false;
            continue;
        }
        const uint32_t entry =
            (ceil_div(static_cast<uint32_t>(s), BLOCK_M) << 16) | ceil_div(static_cast<uint32_t>(t), BLOCK_M);
        ptx::st_shared_u32(table + 4 * e, entry);
    }
    return ok;
}

__device__ __forceinline__ uint32_t owning_expert_staged(uint32_t table, uint32_t num_experts, uint32_t m_block) {
    auto entry = [&](uint32_t e) { return ptx::ld_shared_u32(table + 4 * e); };
    uint32_t lo = 0, hi = num_experts;
    while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if ((entry(mid) & 0xffffu) > m_block)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo < num_experts && (entry(lo) >> 16) <= m_block ? lo : num_experts;
}

// kOrderedM (M-grouped, no clusters): the M blocks are walked in the order m_order[0 .. num_m_blocks)
// (a permutation of the used blocks, set by the kernel after construction) instead of 0, 1, ...: the
// L1 GEMM overlapped with the expert-parallel dispatch walks them in the order their rows arrive.
template <GroupedGemmType kType, uint32_t BLOCK_M, uint32_t BLOCK_K, uint32_t kGroupM, uint32_t kClusterSize,
          bool kOrderedM = false, bool kExpertGroups = false>
struct GroupedScheduler {
    static_assert(!kOrderedM || (kType == GroupedGemmType::MGroupedContiguous && kClusterSize == 1),
                  "GroupedScheduler: an M order is for M-grouped GEMMs without clusters");
    static_assert(!kExpertGroups ||
                      (kType == GroupedGemmType::MGroupedContiguous && kClusterSize == 1 && !kOrderedM),
                  "GroupedScheduler: groups within experts are for M-grouped GEMMs without clusters or an M order");
    static_assert(kGroupM > 0, "GroupedScheduler: kGroupM must be positive");
    static_assert(kClusterSize == 1 || kClusterSize == 2, "GroupedScheduler: clusters of 1 or 2 CTAs");
    // M blocks per unit and per scheduling group (M-grouped: kGroupM blocks, rounded up to pairs).
    static constexpr uint32_t kUnitM = kClusterSize;
    static constexpr uint32_t kGroupUnits = (kGroupM + kUnitM - 1) / kUnitM;

    const int* starts;
    const int* ends;
    uint32_t num_experts;
    uint32_t num_m_blocks;      // M-grouped: used pool blocks; K-grouped: blocks per expert
    uint32_t num_m_units;       // M blocks / kClusterSize, rounded up
    uint32_t num_n_blocks;
    uint32_t num_tiles;         // scheduling units
    uint32_t num_k_blocks;      // M-grouped only
    uint32_t next_unit;
    uint32_t stride;
    uint32_t cta_rank;
    const int* m_order = nullptr;  // kOrderedM only
    // M-grouped: the smem address of the staged expert ranges (stage_expert_blocks), 0 when they are
    // not staged; set by the kernel after construction.
    uint32_t expert_table = 0;

    __device__ GroupedScheduler(const int* starts_, const int* ends_, uint32_t num_experts_, uint32_t shape_m,
                                uint32_t num_n_blocks_, uint32_t shape_k, uint32_t unit_begin,
                                uint32_t unit_stride, uint32_t cta_rank_)
        : starts(starts_), ends(ends_), num_experts(num_experts_), num_n_blocks(num_n_blocks_),
          num_k_blocks(ceil_div(shape_k, BLOCK_K)), next_unit(unit_begin), stride(unit_stride), cta_rank(cta_rank_) {
        if constexpr (kType == GroupedGemmType::MGroupedContiguous) {
            const uint32_t used_rows = num_experts > 0 ? static_cast<uint32_t>(__ldg(ends + num_experts - 1)) : 0;
            num_m_blocks = ceil_div(used_rows, BLOCK_M);
            // m_order holds one entry per block of the pool: ends past the pool (not checked on the host,
            // which would sync) must not walk past it.
            if constexpr (kOrderedM)
                num_m_blocks = min(num_m_blocks, ceil_div(shape_m, BLOCK_M));
            num_m_units = ceil_div(num_m_blocks, kUnitM);
            num_tiles = num_m_units * num_n_blocks;
        } else {
            num_m_blocks = shape_m / BLOCK_M;
            num_m_units = ceil_div(num_m_blocks, kUnitM);
            num_tiles = num_experts * num_m_units * num_n_blocks;
        }
    }

    __device__ __forceinline__ uint32_t expert_of(uint32_t m_block) const {
        return expert_table != 0 ? owning_expert_staged(expert_table, num_experts, m_block)
                                 : owning_expert(starts, ends, num_experts, m_block * BLOCK_M);
    }

    // The blocks [first, last) of expert e (M-grouped).
    __device__ __forceinline__ void expert_blocks(uint32_t e, uint32_t& first, uint32_t& last) const {
        if (expert_table != 0) {
            const uint32_t entry = ptx::ld_shared_u32(expert_table + 4 * e);
            first = entry >> 16;
            last = entry & 0xffffu;
        } else {
            first = ceil_div(static_cast<uint32_t>(__ldg(starts + e)), BLOCK_M);
            last = ceil_div(static_cast<uint32_t>(__ldg(ends + e)), BLOCK_M);
        }
    }

    __device__ __forceinline__ bool next(GroupedTile& tile) {
        while (next_unit < num_tiles) {
            const uint32_t unit = next_unit;
            next_unit += stride;
            tile.multicast = false;
            tile.store = true;
            if constexpr (kExpertGroups) {
                // Unit u is a tile of block u / N's group, as with fixed groups: the units of blocks
                // [c, c + rows) are [c N, (c + rows) N), walked M block first.
                const uint32_t block = unit / num_n_blocks;
                tile.expert = expert_of(block);
                if (tile.expert >= num_experts)
                    continue;
                uint32_t first, last;
                expert_blocks(tile.expert, first, last);
                const uint32_t group_first = first + (block - first) / kGroupM * kGroupM;
                const uint32_t rows = min(kGroupM, last - group_first);
                const uint32_t in_group = unit - group_first * num_n_blocks;
                tile.m_block = group_first + in_group % rows;
                tile.n_block = in_group / rows;
                tile.num_k_blocks = num_k_blocks;
                tile.k_row = 0;
            } else if constexpr (kType == GroupedGemmType::MGroupedContiguous) {
                const uint32_t group_units = kGroupUnits * num_n_blocks;
                const uint32_t group = unit / group_units, in_group = unit % group_units;
                const uint32_t first_u = group * kGroupUnits;
                const uint32_t rows = min(kGroupUnits, num_m_units - first_u);
                const uint32_t m_unit = first_u + in_group % rows;
                tile.n_block = in_group / rows;
                if constexpr (kClusterSize == 1) {
                    if constexpr (kOrderedM)
                        tile.m_block = static_cast<uint32_t>(__ldg(m_order + m_unit));
                    else
                        tile.m_block = m_unit;
                    tile.expert = expert_of(tile.m_block);
                    if (tile.expert >= num_experts)
                        continue;
                } else {
                    const uint32_t m0 = m_unit * 2, m1 = m0 + 1;
                    const uint32_t e0 = expert_of(m0);
                    const uint32_t e1 =
                        m1 < num_m_blocks ? expert_of(m1) : num_experts;
                    if (e0 >= num_experts && e1 >= num_experts)
                        continue;
                    const uint32_t mine = cta_rank == 0 ? e0 : e1;
                    if (mine < num_experts) {
                        tile.m_block = m0 + cta_rank;
                        tile.expert = mine;
                    } else {  // the partner's tile, not stored
                        tile.m_block = m0 + (cta_rank ^ 1);
                        tile.expert = cta_rank == 0 ? e1 : e0;
                        tile.store = false;
                    }
                    tile.multicast = e0 == e1;
                }
                tile.num_k_blocks = num_k_blocks;
                tile.k_row = 0;
            } else {
                const uint32_t per_expert = num_m_units * num_n_blocks;
                tile.expert = unit / per_expert;
                const uint32_t in_expert = unit % per_expert;
                const uint32_t m_unit = in_expert / num_n_blocks;
                tile.n_block = in_expert % num_n_blocks;
                tile.m_block = m_unit * kUnitM + cta_rank;
                if constexpr (kClusterSize > 1) {
                    tile.multicast = m_unit * kUnitM + 1 < num_m_blocks;
                    if (tile.m_block >= num_m_blocks) {  // the partner's tile, not stored
                        tile.m_block = m_unit * kUnitM;
                        tile.store = false;
                    }
                }
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
            return true;
        }
        return false;
    }
};

}  // namespace dge::sched
