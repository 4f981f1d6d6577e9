#pragma once
// Mainloop policy of the SM90 grouped GEMM core for blockwise-scaled fp8 (the DeepSeek-V3 recipe,
// deep_gemm_ext/recipes/fp8.py), with the contract of mma/sm90_mainloop.cuh:
//
//   out[r, n] = sum over k-blocks kb of ( sum_{k in kb} a_q[r, k] * b_q[e, n, k] ) * sa[r, kb] * sb[e, n / 128, kb]
//
// a_q [M, K] and b_q [E, N, K] are e4m3, both K-major; sa [M, ceil(K/128)] holds one fp32 scale per
// 1 x 128 tile of A, sb [E, ceil(N/128), ceil(K/128)] one per 128 x 128 block of B. A k-block of the
// ring is 128 elements of K (128 bytes per row, the same stage bytes as bf16's 64), so each stage
// is one scale block: its four wgmma m64n128k32 go into a fresh fp32 partial accumulator, which is
// then scaled by sa * sb and added into the tile's fp32 accumulator ("promotion" every 128 of K:
// the tensor cores' fp8 accumulation is not carried across k-blocks).
//
// Scales come from global memory (ld.global.nc), not through the smem ring: sa's rows are
// ceil(K/128) fp32 apart, which is not the 16-byte multiple a TMA map needs for most K, and a
// thread needs only three values per k-block (sa of its two accumulator rows, and the tile's one
// sb, a broadcast load), so they are loaded one k-block ahead, while the wgmmas of the current
// one run.

#include <cstdint>

#include <common/sm90_utils.cuh>
#include <layout/sm90_gemm.cuh>
#include <mma/sm90_desc.cuh>
#include <mma/sm90_wgmma.cuh>
#include <ptx/tma.cuh>
#include <ptx/wgmma.cuh>

namespace dge::gemm {

// Kernel arguments: scale_a (const float*, [M, ceil(K/128)]), scale_b (const float*,
// [E, ceil(N/128), ceil(K/128)]).
template <class Traits, bool kGenericProxyWrites>
struct MainloopFP8 {
    static_assert(Traits::kElement == ElementType::E4M3, "MainloopFP8: e4m3 operands");
    static constexpr uint32_t kScaleBlock = 128;
    static_assert(Traits::kBlockK == kScaleBlock, "MainloopFP8: one k-block per scale block");
    static_assert(Traits::BLOCK_N == kScaleBlock, "MainloopFP8: one B scale block per tile and k-block");
    using MMA = mma::WgmmaE4M3<Traits::BLOCK_N>;
    using Stages = StageLayout<Traits::BLOCK_N, Traits::kNumStages>;
    static constexpr uint32_t kNumAccum = MMA::kNumAccum;
    static constexpr uint32_t kNumArgs = 2;
    static constexpr uint32_t kWgmmasPerBlock = Traits::kBlockK / MMA::K;

    struct Params {
        const float* scale_a;
        const float* scale_b;
        uint32_t last_row;   // shape_m - 1: rows of a tile past the pool read the last row's scales
        uint32_t k_blocks;   // ceil(K / 128): scales per row of sa, per block row of sb
        uint32_t n_blocks;   // ceil(N / 128)

        template <class... Rest>
        __device__ Params(uint32_t shape_m, uint32_t shape_n, uint32_t shape_k, const float* sa, const float* sb,
                          const Rest&...)
            : scale_a(sa), scale_b(sb), last_row(shape_m > 0 ? shape_m - 1 : 0),
              k_blocks((shape_k + kScaleBlock - 1) / kScaleBlock), n_blocks((shape_n + kScaleBlock - 1) / kScaleBlock) {}
    };

    template <uint32_t kSlices, class Pipe>
    __device__ __forceinline__ static uint32_t mma(float (&acc)[kSlices][kNumAccum], const Pipe& pipe,
                                                   sm90::PipelineState<Traits::kNumStages>& st,
                                                   const sched::GroupedTile& tile, const Params& params,
                                                   const Stages& stages, uint32_t first_slice, uint32_t lane) {
        // wgmma m64 fragment: thread (warp w, lane l) of the warpgroup holds rows 16 w + l / 4
        // (accumulators i with i % 4 < 2) and 16 w + l / 4 + 8 (the others) of each 64-row slice.
        const uint32_t warp = (threadIdx.x % 128) / 32;
        const float* sa_ptr[kSlices][2];
#pragma unroll
        for (uint32_t s = 0; s < kSlices; ++s) {
#pragma unroll
            for (uint32_t h = 0; h < 2; ++h) {
                const uint32_t row = tile.m_block * BLOCK_M + (first_slice + s) * 64 + warp * 16 + lane / 4 + 8 * h;
                sa_ptr[s][h] = params.scale_a + static_cast<uint64_t>(min(row, params.last_row)) * params.k_blocks;
            }
        }
        const float* sb_ptr =
            params.scale_b + (static_cast<uint64_t>(tile.expert) * params.n_blocks + tile.n_block) * params.k_blocks;

        float partial[kSlices][kNumAccum];
#pragma unroll
        for (uint32_t s = 0; s < kSlices; ++s) {
#pragma unroll
            for (uint32_t i = 0; i < kNumAccum; ++i)
                partial[s][i] = 0.0f;
        }
        float sa[kSlices][2], sb = 0.0f;
        if (tile.num_k_blocks > 0)
            load_scales(sa, sb, sa_ptr, sb_ptr, 0);

        uint32_t last_stage = 0;
        for (uint32_t kb = 0; kb < tile.num_k_blocks; ++kb) {
            pipe.consumer_wait(st);
            if constexpr (kGenericProxyWrites)
                ptx::fence_proxy_async_smem();
            mma::fence_accumulators(partial);
            ptx::wgmma_fence();
#pragma unroll
            for (uint32_t k = 0; k < kWgmmasPerBlock; ++k) {
#pragma unroll
                for (uint32_t s = 0; s < kSlices; ++s) {
                    const uint64_t desc_a = mma::k_major_desc(stages.a(st.stage), (first_slice + s) * 64, k * MMA::K);
                    const uint64_t desc_b = mma::k_major_desc(stages.b(st.stage), 0, k * MMA::K);
                    // The first wgmma of the k-block overwrites the partial sums (scale-d = 0).
                    MMA::mma(partial[s], desc_a, desc_b, k > 0 ? 1u : 0u);
                }
            }
            ptx::wgmma_commit_group();
            mma::fence_accumulators(partial);
            // The next k-block's scales load while this one's wgmmas run.
            float next_sa[kSlices][2], next_sb;
            load_scales(next_sa, next_sb, sa_ptr, sb_ptr, kb + 1 < tile.num_k_blocks ? kb + 1 : kb);
            ptx::wgmma_wait_group<0>();
            mma::fence_accumulators(partial);
            pipe.consumer_release(st.stage, lane);
            last_stage = st.stage;
            st.advance();
            // Promotion: acc += partial * sa[row] * sb.
#pragma unroll
            for (uint32_t s = 0; s < kSlices; ++s) {
                const float scale_lo = sa[s][0] * sb, scale_hi = sa[s][1] * sb;
#pragma unroll
                for (uint32_t i = 0; i < kNumAccum; ++i)
                    acc[s][i] = fmaf(partial[s][i], (i & 2) ? scale_hi : scale_lo, acc[s][i]);
            }
#pragma unroll
            for (uint32_t s = 0; s < kSlices; ++s) {
                sa[s][0] = next_sa[s][0];
                sa[s][1] = next_sa[s][1];
            }
            sb = next_sb;
        }
        return last_stage;
    }

    // mma waited for every wgmma and freed every stage.
    template <uint32_t kSlices, class Pipe>
    __device__ __forceinline__ static void finish(float (&)[kSlices][kNumAccum], const Pipe&, uint32_t, uint32_t,
                                                  uint32_t) {}

private:
    template <uint32_t kSlices>
    __device__ __forceinline__ static void load_scales(float (&sa)[kSlices][2], float& sb,
                                                       const float* (&sa_ptr)[kSlices][2], const float* sb_ptr,
                                                       uint32_t kb) {
#pragma unroll
        for (uint32_t s = 0; s < kSlices; ++s) {
            sa[s][0] = __ldg(sa_ptr[s][0] + kb);
            sa[s][1] = __ldg(sa_ptr[s][1] + kb);
        }
        sb = __ldg(sb_ptr + kb);
    }
};

}  // namespace dge::gemm
