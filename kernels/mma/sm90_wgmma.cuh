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
    static_assert(N == 128 || N == 256, "WgmmaBF16: N must be 128 or 256");

    // The transpose bits select MN-major operands (valid for 16-bit types only).
    static constexpr uint32_t kTransA = kMajorA == Major::MN ? 1 : 0;
    static constexpr uint32_t kTransB = kMajorB == Major::MN ? 1 : 0;

    __device__ __forceinline__ static void mma(float (&d)[kNumAccum], uint64_t desc_a, uint64_t desc_b,
                                               uint32_t scale_d) {
        if constexpr (N == 128)
            ptx::wgmma_m64n128k16_bf16_ss<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
        else
            ptx::wgmma_m64n256k16_bf16_ss<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
    }
};

}  // namespace dge::mma
