#pragma once
// wgmma shared-memory matrix descriptors for operand tiles written by TMA with 128-byte swizzle.
//
// Every operand tile is stored as 8 KiB atoms of 64 rows of 128 bytes (64 x 64 bf16, or 64 x 128
// e4m3 for the K-major fp8 operands), swizzled in 1024-byte groups of 8 rows, exactly what one
// 64-row TMA box of 128-byte rows with SWIZZLE_128B produces (bf16 below):
//   K-major  (K contiguous): atom j holds MN rows [64j, 64j+64), all 64 K of the stage; the atoms
//            stack along MN, so the tile is simply MN rows of 128 bytes.
//   MN-major (MN contiguous): atom j holds MN columns [64j, 64j+64); its 64 rows are the K of the
//            stage.

#include <cstdint>

namespace dge::mma {

enum class Major : uint32_t { K = 0, MN = 1 };

constexpr uint32_t kSwizzleBytes = 128;
constexpr uint32_t kAtomElems = 64;                       // bf16 per 128-byte row
constexpr uint32_t kAtomBytes = kAtomElems * kAtomElems * 2;  // one 64 x 64 bf16 atom
constexpr uint32_t kWgmmaK = 16;

// Descriptor fields (PTX ISA, "Matrix Descriptor Format"): start address, leading- and stride-
// dimension byte offsets (all >> 4), swizzle mode in bits 62-63 (1 = 128B).
__device__ __forceinline__ uint64_t make_smem_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4)
         | (static_cast<uint64_t>(lbo >> 4) << 16)
         | (static_cast<uint64_t>(sbo >> 4) << 32)
         | (1ull << 62);
}

// The descriptor of a K-major operand (rows of 128 bytes, any element type; LBO unused, SBO 1024) in
// two parts, for loops that advance it: the low word (start address and LBO) of the operand at shared
// address `addr`, and the high word (SBO, 128B swizzle), which is the same for every K-major operand.
// An operand `bytes` further on (a multiple of 16) has low word k_major_desc_lo(addr) + bytes / 16 as
// long as addr + bytes stays inside the 256 KiB the 14-bit start field covers, which every
// shared-memory address of an SM90 CTA does: the add never carries into LBO.
constexpr uint32_t kKMajorDescHi = (1024u >> 4) | (1u << 30);

__device__ __forceinline__ uint32_t k_major_desc_lo(uint32_t addr) {
    return ((addr & 0x3FFFF) >> 4) | ((16u >> 4) << 16);
}

// The operand at MN offset mn0 (a multiple of 8) of a tile at tile_addr, k_bytes (a multiple of 32) into
// each row: make_smem_desc(tile_addr + mn0 * 128 + k_bytes, 16, 1024)
//        == k_major_desc_at(k_major_desc_lo(tile_addr), mn0 * 128 + k_bytes).
__device__ __forceinline__ uint64_t k_major_desc_at(uint32_t lo, uint32_t bytes) {
    return (static_cast<uint64_t>(kKMajorDescHi) << 32) | (lo + (bytes >> 4));
}

// Descriptor of the wgmma operand that starts at MN offset `mn0` (a multiple of 8 for K-major,
// of 64 for MN-major) of a tile at `tile_addr`, for the k-th 16-wide K slice of the stage.
template <Major kMajor>
__device__ __forceinline__ uint64_t tile_desc(uint32_t tile_addr, uint32_t mn0, uint32_t k) {
    if constexpr (kMajor == Major::K) {
        // 8-row core groups are 1024 bytes apart (SBO); K advances inside the 128-byte swizzled
        // row, which the hardware resolves from the address bits. LBO is unused for this layout.
        return make_smem_desc(tile_addr + mn0 * kSwizzleBytes + k * kWgmmaK * 2, 16, 1024);
    } else {
        // LBO: next 64-wide MN atom; SBO: next group of 8 K rows; a K slice of 16 is 16 rows.
        return make_smem_desc(tile_addr + (mn0 / kAtomElems) * kAtomBytes + k * kWgmmaK * kSwizzleBytes,
                              kAtomBytes, 1024);
    }
}

}  // namespace dge::mma
