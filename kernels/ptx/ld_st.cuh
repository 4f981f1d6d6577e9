#pragma once
// Shared-memory stores with warp-cooperative layouts.

#include <cstdint>

namespace dge::ptx {

// Four 8x8 b16 matrices: lane l supplies the row address of matrix l/8, row l%8; register i of
// every lane holds two b16 of matrix i in the mma accumulator layout (row l/4, cols 2*(l%4)+{0,1}).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

}  // namespace dge::ptx
