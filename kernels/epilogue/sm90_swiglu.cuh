#pragma once
// SwiGLU epilogue policies of the SM90 grouped GEMM core (impls/sm90_bf16_grouped_gemm.cuh), so that
// the elementwise pass of each direction reads no GEMM output back from memory:
//
//   EpilogueSwigluForward   L1 forward, paired N tiles: h = bf16(acc) and act = SwiGLU(h) from the
//                           rounded h, the same fp32 math as swiglu_forward_kernel (bit-identical act).
//   EpilogueSwigluBackward  L2 dgrad: acc = da' (fp32, unweighted); loads h, writes dh = SwiGLU
//                           backward of w * da', act_w = w * act and per-row partial <da', act> of
//                           the tile's columns into partials [P, I / BLOCK_N].
// impls/sm90_swiglu_row_weight_grad.cuh then sums the partials into d_row_weight.
//
// The element math is swiglu.cuh's (clamp_gate, clamp_up, sigmoid), written in the same expression
// order as its kernels.

#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>

#include <common/sm90_utils.cuh>
#include <epilogue/sm90_store_bf16.cuh>
#include <impls/swiglu.cuh>
#include <ptx/ld_st.cuh>

namespace dge::gemm {

// The two bf16 of a packed pair (low half = first column), exactly as stored.
__device__ __forceinline__ float bf16x2_lo(uint32_t packed) { return __uint_as_float(packed << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t packed) { return __uint_as_float(packed & 0xffff0000u); }

// Accumulator pair p (0..15) of a 64-column chunk: row warp*16 + lane/4 (+8 for odd p), columns
// 8*(p/2) + 2*(lane%4) + {0, 1} of the chunk (the wgmma fp32 fragment layout).
__device__ __forceinline__ uint32_t chunk_pair_col(uint32_t pair, uint32_t lane) {
    return 8 * (pair / 2) + 2 * (lane % 4);
}

// L1 forward with SwiGLU. Args: tma_h over h [P, 2I], tma_act over act [P, I] (64 x 64 boxes,
// 128B swizzle), the clamp c (unused when !kClamp). Paired N tiles: accumulator i is gate column
// n0 + (column of i) and accumulator i + kNumAccum/2 the up column I + the same.
template <bool kClamp>
struct EpilogueSwigluForward {
    static constexpr uint32_t kSmemBytes = kNumConsumerWarpgroups * sm90::WarpgroupChunkStore<>::kSmemBytes;
    sm90::WarpgroupChunkStore<> store;

    __device__ EpilogueSwigluForward(uint32_t smem, uint32_t warpgroup, uint32_t thread)
        : store(smem + warpgroup * sm90::WarpgroupChunkStore<>::kSmemBytes, kEpilogueBarrierBase + warpgroup, thread) {}

    template <uint32_t kNumAccum, uint32_t BLOCK_N>
    __device__ __forceinline__ void operator()(const float (&acc)[kNumAccum], const EpilogueTile<BLOCK_N, true>& tile,
                                               const CUtensorMap& tma_h, const CUtensorMap& tma_act,
                                               const float& clamp) {
        constexpr uint32_t kHalf = kNumAccum / 2;
        constexpr uint32_t kUpChunk = BLOCK_N / 128;  // first chunk of the up half
#pragma unroll
        for (uint32_t chunk = 0; chunk < kHalf / 32; ++chunk) {
            uint32_t gate[16], up[16], act[16];
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i) {
                gate[i] = ptx::pack_bf16x2(acc[chunk * 32 + 2 * i], acc[chunk * 32 + 2 * i + 1]);
                up[i] = ptx::pack_bf16x2(acc[kHalf + chunk * 32 + 2 * i], acc[kHalf + chunk * 32 + 2 * i + 1]);
            }
            store.store(gate, &tma_h, tile.cols.col(chunk), tile.row);
            store.store(up, &tma_h, tile.cols.col(kUpChunk + chunk), tile.row);
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i)
                act[i] = ptx::pack_bf16x2(swiglu_act(bf16x2_lo(gate[i]), bf16x2_lo(up[i]), clamp),
                                          swiglu_act(bf16x2_hi(gate[i]), bf16x2_hi(up[i]), clamp));
            store.store(act, &tma_act, tile.cols.n0 + 64 * chunk, tile.row);
        }
    }

    __device__ __forceinline__ void finish() { store.drain(); }

private:
    // swiglu_forward_kernel's expression: (z * sigmoid(z)) * clamp_up(u).
    __device__ __forceinline__ static float swiglu_act(float g, float u, float clamp) {
        const float z = clamp_gate<kClamp>(g, clamp);
        return z * sigmoid(z) * clamp_up<kClamp>(u, clamp);
    }
};

// L2 dgrad with the SwiGLU backward. The GEMM's N is I; args: tma_dh over dh [P, 2I], tma_act_w over
// act_w [P, I] (64 x 64 boxes, 128B swizzle), h [P, 2I] bf16, row_weight [P] fp32, partials
// [P, I / BLOCK_N] fp32, the clamp c (unused when !kClamp) and I (a multiple of BLOCK_N).
template <bool kClamp>
struct EpilogueSwigluBackward {
    static constexpr uint32_t kSmemBytes = kNumConsumerWarpgroups * sm90::WarpgroupChunkStore<>::kSmemBytes;
    sm90::WarpgroupChunkStore<> store;
    uint32_t thread;

    __device__ EpilogueSwigluBackward(uint32_t smem, uint32_t warpgroup, uint32_t thread_)
        : store(smem + warpgroup * sm90::WarpgroupChunkStore<>::kSmemBytes, kEpilogueBarrierBase + warpgroup, thread_),
          thread(thread_) {}

    template <uint32_t kNumAccum, uint32_t BLOCK_N>
    __device__ __forceinline__ void operator()(const float (&acc)[kNumAccum], const EpilogueTile<BLOCK_N, false>& tile,
                                               const CUtensorMap& tma_dh, const CUtensorMap& tma_act_w,
                                               const __nv_bfloat16* const& h, const float* const& row_weight,
                                               float* const& partials, const float& clamp, const uint32_t& inter) {
        constexpr uint32_t kNumChunks = kNumAccum / 32;
        const uint32_t lane = thread % 32;
        const uint32_t row0 = tile.row + (thread / 32) * 16 + lane / 4;  // and row0 + 8
        const uint64_t h_stride = 2ull * inter;

        // The whole h slice of the warpgroup (64 rows x BLOCK_N gate + up columns) heads for L2 now,
        // so the chunk loads below wait on L2 rather than DRAM. Thread t: row t/2, gate or up.
        {
            const __nv_bfloat16* line =
                h + (tile.row + thread / 2) * h_stride + (thread % 2) * inter + tile.cols.col(0);
#pragma unroll
            for (uint32_t j = 0; j < BLOCK_N / 64; ++j)
                asm volatile("prefetch.global.L2 [%0];" :: "l"(line + 64 * j));
        }
        const float w[2] = {__ldg(row_weight + row0), __ldg(row_weight + row0 + 8)};

        // h pairs of a chunk in the accumulator layout: gate[p], up[p] for accumulators 2p, 2p+1.
        auto load_chunk = [&](uint32_t chunk, uint32_t (&gate)[16], uint32_t (&up)[16]) {
#pragma unroll
            for (uint32_t p = 0; p < 16; ++p) {
                const uint32_t* src = reinterpret_cast<const uint32_t*>(
                    h + (row0 + 8 * (p % 2)) * h_stride + tile.cols.col(chunk) + chunk_pair_col(p, lane));
                gate[p] = __ldg(src);
                up[p] = __ldg(src + inter / 2);
            }
        };

        // h in registers ahead of its use: at BLOCK_N 128 the whole slice is loaded up front; at 256 the
        // accumulators leave room for one chunk more, so chunk c + 1 is in flight while chunk c is stored.
        constexpr uint32_t kPreload = BLOCK_N == 128 ? kNumChunks : 1;
        constexpr uint32_t kRing = kPreload < kNumChunks ? kPreload + 1 : kNumChunks;
        uint32_t h_gate[kRing][16], h_up[kRing][16];
#pragma unroll
        for (uint32_t chunk = 0; chunk < kPreload; ++chunk)
            load_chunk(chunk, h_gate[chunk], h_up[chunk]);
        float partial[2] = {0.0f, 0.0f};
#pragma unroll
        for (uint32_t chunk = 0; chunk < kNumChunks; ++chunk) {
            const uint32_t buf = chunk % kRing;
            uint32_t dgate[16], dup[16], act_w[16];
#pragma unroll
            for (uint32_t p = 0; p < 16; ++p) {
                float dg[2], du[2], aw[2];
                const float g[2] = {bf16x2_lo(h_gate[buf][p]), bf16x2_hi(h_gate[buf][p])};
                const float u[2] = {bf16x2_lo(h_up[buf][p]), bf16x2_hi(h_up[buf][p])};
#pragma unroll
                for (uint32_t k = 0; k < 2; ++k)
                    element(g[k], u[k], acc[chunk * 32 + 2 * p + k], w[p % 2], clamp, partial[p % 2], dg[k], du[k],
                            aw[k]);
                dgate[p] = ptx::pack_bf16x2(dg[0], dg[1]);
                dup[p] = ptx::pack_bf16x2(du[0], du[1]);
                act_w[p] = ptx::pack_bf16x2(aw[0], aw[1]);
            }
            if (chunk + kPreload < kNumChunks)
                load_chunk(chunk + kPreload, h_gate[(chunk + kPreload) % kRing], h_up[(chunk + kPreload) % kRing]);
            const uint32_t col = tile.cols.col(chunk);
            store.store(dgate, &tma_dh, col, tile.row);
            store.store(dup, &tma_dh, inter + col, tile.row);
            store.store(act_w, &tma_act_w, col, tile.row);
        }

        // A row's BLOCK_N tile columns live in the 4 lanes of a quad: butterfly over the quad (fixed
        // order), then the quad's first lane writes the row's partial.
#pragma unroll
        for (uint32_t k = 0; k < 2; ++k) {
            partial[k] += __shfl_xor_sync(0xffffffffu, partial[k], 1);
            partial[k] += __shfl_xor_sync(0xffffffffu, partial[k], 2);
        }
        if (lane % 4 == 0) {
            const uint32_t num_parts = inter / BLOCK_N;
            partials[static_cast<uint64_t>(row0) * num_parts + tile.n_block] = partial[0];
            partials[static_cast<uint64_t>(row0 + 8) * num_parts + tile.n_block] = partial[1];
        }
    }

    __device__ __forceinline__ void finish() { store.drain(); }

private:
    // swiglu_backward_kernel's expressions with da = d (fp32 here); the clamp masks use the
    // unclamped g, u and pass at equality (torch.clamp's gradient).
    __device__ __forceinline__ static void element(float g, float u, float d, float w, float clamp, float& partial,
                                                   float& dg, float& du, float& aw) {
        const float z = clamp_gate<kClamp>(g, clamp);
        const float s = sigmoid(z);
        const float silu = z * s;
        const float uc = clamp_up<kClamp>(u, clamp);
        const float a = silu * uc;
        partial += d * a;
        const float dw = w * d;
        const float dz = dw * uc * (s * (1.0f + z * (1.0f - s)));
        dg = !kClamp || g <= clamp ? dz : 0.0f;
        du = !kClamp || (u >= -clamp && u <= clamp) ? dw * silu : 0.0f;
        aw = w * a;
    }
};

}  // namespace dge::gemm
