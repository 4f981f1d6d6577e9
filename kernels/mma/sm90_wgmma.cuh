#pragma once
// wgmma shapes: one warpgroup computes a 64 x N fp32 tile per K slice (16 bf16 or 32 e4m3 elements,
// 32 bytes of each operand row either way).

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

// e4m3 x e4m3 -> fp32, both operands K-major (fp8 wgmma cannot transpose).
template <uint32_t N_>
struct WgmmaE4M3 {
    static constexpr uint32_t M = 64;
    static constexpr uint32_t N = N_;
    static constexpr uint32_t K = 32;
    static constexpr uint32_t kNumAccum = M * N / 128;

    using Instruction = ptx::WgmmaE4M3SS<N>;

    __device__ __forceinline__ static void mma(float (&d)[kNumAccum], uint64_t desc_a, uint64_t desc_b,
                                               uint32_t scale_d) {
        Instruction::mma(d, desc_a, desc_b, scale_d);
    }
};

// Every accumulator register of a warpgroup's 64-row slice fenced, so the compiler neither reads nor
// moves them while wgmmas in flight may write them.
template <uint32_t kNumAccum>
__device__ __forceinline__ void fence_accumulators(float (&acc)[kNumAccum]) {
#pragma unroll
    for (uint32_t i = 0; i < kNumAccum; ++i)
        ptx::fence_operand(acc[i]);
}

}  // namespace dge::mma
