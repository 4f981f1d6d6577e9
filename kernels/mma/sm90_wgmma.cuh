#pragma once
// bf16 wgmma shapes: one warpgroup computes a 64 x N fp32 tile per 16-wide K slice.

#include <cstdint>

#include <mma/sm90_desc.cuh>
#include <ptx/wgmma.cuh>

namespace dge::mma {

template <uint32_t N_, Major kMajorA, Major kMajorB>
struct WgmmaBF16 {
    static constexpr uint32_t M = 64;
    static constexpr uint32_t N = N_;
    static constexpr uint32_t K = kWgmmaK;
    // Accumulator fragment per thread of the warpgroup: 64 * N / 128.
    static constexpr uint32_t kNumAccum = M * N / 128;

    // The transpose bits select MN-major operands (valid for 16-bit types only).
    using Instruction = ptx::WgmmaBF16SS<N, kMajorA == Major::MN ? 1u : 0u, kMajorB == Major::MN ? 1u : 0u>;

    __device__ __forceinline__ static void mma(float (&d)[kNumAccum], uint64_t desc_a, uint64_t desc_b,
                                               uint32_t scale_d) {
        Instruction::mma(d, desc_a, desc_b, scale_d);
    }
};

}  // namespace dge::mma
