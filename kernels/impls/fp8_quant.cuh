#pragma once

// Blockwise e4m3 quantization of bf16 tensors, bit for bit what deep_gemm_ext/recipes/fp8.py's
// torch quantizers compute on a CUDA tensor:
//   amax  = max |v| over the tile's finite elements (0 when there are none)
//   scale = max(amax, 448 * 2^-126) * fl32(1 / 448)   (torch divides a CUDA tensor by a Python
//                                                      scalar as a multiply by its fp32 reciprocal)
//   data  = rn_e4m3(v / scale)    (IEEE fp32 division, round to nearest even; |v / scale| <= 448
//                                  up to one fp32 rounding, so saturation never triggers)
//   data  = 0x7f (NaN)            for a NaN / +Inf / -Inf element
// Tiles: 1x128 along each row (quantize_rows_kernel: plain rows, gathered pool rows, or SwiGLU
// rows), 128x1 down each column (quantize_cols_kernel). A ragged last tile covers the remaining
// elements only. Every row has a multiple of 8 elements (16-byte bf16 vectors).
#include <common/utils.cuh>
#include <impls/swiglu.cuh>

namespace dge {

constexpr int kFp8Block = 128;
constexpr int kFp8QuantThreads = 256;
constexpr int kFp8QuantWarps = kFp8QuantThreads / kWarpSize;
// Lanes per 1x128 tile: one 16-byte vector (8 bf16) each, so a warp holds two tiles.
constexpr int kFp8TileLanes = kFp8Block / kBf16PerVec;
// The scale rule's constants: the amax floor 448 * 2^-126 and the fp32 reciprocal of 448.
constexpr float kFp8AmaxFloor = 0x1.cp-118f;
constexpr float kFp8InvMax = 1.0f / 448.0f;
static_assert(kFp8AmaxFloor == 448.0f * 0x1p-126f, "amax floor is 448 * 2^-126");
static_assert(kFp8InvMax == 0x1.24924ap-9f, "fl32(1/448) is 0x3b124925");
// e4m3fn NaN, as torch's cast writes a positive NaN.
constexpr u32 kFp8NaN = 0x7fu;

// |v| of two packed bf16, each zeroed when it is not finite (exponent all ones: Inf or NaN). The
// results compare as integers in the order of their values.
__device__ __forceinline__ u32 finite_abs_bf16x2(u32 w) {
    const u32 a = w & 0x7fff7fffu;
    return a & __vcmpltu2(a, 0x7f807f80u);
}

__device__ __forceinline__ u32 finite_abs_max_bf16x8(const uint4& v) {
    const u32 m = __vmaxu2(__vmaxu2(finite_abs_bf16x2(v.x), finite_abs_bf16x2(v.y)),
                           __vmaxu2(finite_abs_bf16x2(v.z), finite_abs_bf16x2(v.w)));
    return max(m & 0xffffu, m >> 16);
}

// The tile's scale from the bf16 bits of its finite amax.
__device__ __forceinline__ float fp8_scale_of(u32 amax_bits) {
    return __fmul_rn(fmaxf(__uint_as_float(amax_bits << 16), kFp8AmaxFloor), kFp8InvMax);
}

// Two e4m3 bytes (lo at the lower address) of one packed bf16 pair, each element divided by its
// tile's scale.
__device__ __forceinline__ u32 quantize_bf16x2(u32 w, float scale_lo, float scale_hi) {
    const u32 lo_bits = w & 0xffffu, hi_bits = w >> 16;
    const bool lo_finite = (lo_bits & 0x7fffu) < 0x7f80u, hi_finite = (hi_bits & 0x7fffu) < 0x7f80u;
    const float lo = lo_finite ? __fdiv_rn(__uint_as_float(lo_bits << 16), scale_lo) : 0.0f;
    const float hi = hi_finite ? __fdiv_rn(__uint_as_float(hi_bits << 16), scale_hi) : 0.0f;
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    // A non-finite element was converted as +0 (byte 0x00): OR-ing in 0x7f makes it the NaN.
    return static_cast<u32>(pair) | (lo_finite ? 0u : kFp8NaN) | (hi_finite ? 0u : kFp8NaN << 8);
}

// Eight e4m3 bytes of one bf16x8 vector, as the two words of an 8-byte store; s[i] is element i's
// scale.
__device__ __forceinline__ uint2 quantize_bf16x8(const uint4& v, const float (&s)[kBf16PerVec]) {
    return make_uint2(quantize_bf16x2(v.x, s[0], s[1]) | (quantize_bf16x2(v.y, s[2], s[3]) << 16),
                      quantize_bf16x2(v.z, s[4], s[5]) | (quantize_bf16x2(v.w, s[6], s[7]) << 16));
}

// Where quantize_rows_kernel reads a row's bf16 values.
enum class Fp8RowSource : int {
    kRows = 0,    // x [num_rows, cols]
    kGather = 1,  // x [num_tokens, cols]: row r is x[row_to_slot[r] / top_k], zeros where the slot is < 0
    kSwiglu = 2,  // h [num_rows, 2 * cols]: act = bf16(swiglu(g, u)), also stored to act when non-null
};

// 1x128 tiles along the rows. Half a warp per tile, one 16-byte vector per lane; each warp takes
// kTilesPerHalf tiles per half per step (their loads issued before any reduction) and warps
// stride over the row-major list of (row, tile) items. items = num_rows * ceil(cols / 128) fits
// in 31 bits (the launcher splits larger tensors).
template <Fp8RowSource kSource, bool kClamp, int kTilesPerHalf>
__global__ void __launch_bounds__(kFp8QuantThreads)
quantize_rows_kernel(const __nv_bfloat16* __restrict__ x, const int* __restrict__ row_to_slot,
                     unsigned char* __restrict__ data, float* __restrict__ scale, __nv_bfloat16* __restrict__ act,
                     u32 num_rows, u32 cols, u32 top_k, u32 num_tokens, float clamp) {
    grid_dependency_wait();
    constexpr u32 kItemsPerWarp = 2 * kTilesPerHalf;
    const u32 tiles_per_row = (cols + kFp8Block - 1) / kFp8Block;
    const u32 num_items = num_rows * tiles_per_row;
    const int lane = lane_id();
    const u32 half = static_cast<u32>(lane) / kFp8TileLanes;
    const u32 vec_col = static_cast<u32>(lane % kFp8TileLanes) * kBf16PerVec;
    const u32 warp = blockIdx.x * kFp8QuantWarps + warp_id();
    const u32 warp_step = gridDim.x * kFp8QuantWarps * kItemsPerWarp;
    // The loop condition is uniform across the warp (the reductions shuffle over all 32 lanes).
    for (u32 base = warp * kItemsPerWarp; base < num_items; base += warp_step) {
        uint4 v[kTilesPerHalf];
        u32 row[kTilesPerHalf], col[kTilesPerHalf];
        bool item_ok[kTilesPerHalf], lane_ok[kTilesPerHalf];
#pragma unroll
        for (int j = 0; j < kTilesPerHalf; ++j) {
            const u32 item = base + 2 * j + half;
            item_ok[j] = item < num_items;
            row[j] = item_ok[j] ? item / tiles_per_row : 0;
            col[j] = (item - row[j] * tiles_per_row) * kFp8Block + vec_col;
            lane_ok[j] = item_ok[j] && col[j] < cols;
            v[j] = make_uint4(0, 0, 0, 0);
            if (!lane_ok[j])
                continue;
            if constexpr (kSource == Fp8RowSource::kRows) {
                v[j] = load_stream_v4(x + static_cast<i64>(row[j]) * cols + col[j]);
            } else if constexpr (kSource == Fp8RowSource::kGather) {
                const int slot = __ldg(row_to_slot + row[j]);
                const u32 token = slot >= 0 ? static_cast<u32>(slot) / top_k : num_tokens;
                if (token < num_tokens)
                    v[j] = load_stream_v4(x + static_cast<i64>(token) * cols + col[j]);
            } else {
                const __nv_bfloat16* g_ptr = x + static_cast<i64>(row[j]) * (2 * static_cast<i64>(cols)) + col[j];
                float g[kBf16PerVec], u[kBf16PerVec], a[kBf16PerVec];
                unpack_bf16x8(load_stream_v4(g_ptr), g);
                unpack_bf16x8(load_stream_v4(g_ptr + cols), u);
#pragma unroll
                for (int i = 0; i < kBf16PerVec; ++i)
                    a[i] = swiglu_act<kClamp>(g[i], u[i], clamp);
                v[j] = pack_bf16x8(a);  // the tile is quantized from the bf16-rounded act
                if (act != nullptr)
                    store_v4(act + static_cast<i64>(row[j]) * cols + col[j], v[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < kTilesPerHalf; ++j) {
            u32 amax = finite_abs_max_bf16x8(v[j]);  // zero vectors (absent lanes) change no amax
#pragma unroll
            for (int offset = kFp8TileLanes / 2; offset > 0; offset /= 2)
                amax = max(amax, __shfl_xor_sync(kFullMask, amax, offset));
            const float s = fp8_scale_of(amax);
            const i64 tile = static_cast<i64>(row[j]) * tiles_per_row + col[j] / kFp8Block;
            const float s8[kBf16PerVec] = {s, s, s, s, s, s, s, s};
            if (lane_ok[j])
                *reinterpret_cast<uint2*>(data + static_cast<i64>(row[j]) * cols + col[j]) = quantize_bf16x8(v[j], s8);
            if (item_ok[j] && vec_col == 0)
                scale[tile] = s;
        }
    }
}

// 128x1 tiles down the columns. One CTA step covers 128 rows x kColVecs * 8 columns: thread
// (row group rg = tid / kColVecs, column vector cv = tid % kColVecs) holds kRowsPerThread rows of
// 8 columns (16 bytes each), so a warp's load covers 32 / kColVecs row segments of kColVecs * 16
// bytes. The column amaxes are reduced over the row groups of a warp by shuffles and over the
// eight warps through shared memory. CTAs stride over the blocks; blocks fit in 31 bits.
template <int kRowsPerThread>
__global__ void __launch_bounds__(kFp8QuantThreads)
quantize_cols_kernel(const __nv_bfloat16* __restrict__ x, unsigned char* __restrict__ data,
                     float* __restrict__ scale, u32 num_rows, u32 cols) {
    constexpr int kColVecs = kFp8QuantThreads * kRowsPerThread / kFp8Block;
    static_assert(kFp8Block % kRowsPerThread == 0 && kColVecs >= 1 && kColVecs <= kWarpSize &&
                      kWarpSize % kColVecs == 0, "a warp holds whole row groups");
    constexpr u32 kBlockCols = kColVecs * kBf16PerVec;
    __shared__ uint4 smem_amax[kFp8QuantWarps][kColVecs];
    grid_dependency_wait();
    const u32 row_blocks = (num_rows + kFp8Block - 1) / kFp8Block;
    const u32 col_blocks = (cols + kBlockCols - 1) / kBlockCols;
    const u32 num_blocks = row_blocks * col_blocks;
    const u32 cv = threadIdx.x % kColVecs;
    const u32 rg = threadIdx.x / kColVecs;
    const int warp = warp_id();
    for (u32 block = blockIdx.x; block < num_blocks; block += gridDim.x) {
        const u32 rb = block / col_blocks;
        const u32 col = (block - rb * col_blocks) * kBlockCols + cv * kBf16PerVec;
        const bool col_ok = col < cols;
        const u32 row0 = rb * kFp8Block + rg * kRowsPerThread;
        uint4 v[kRowsPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
            v[i] = col_ok && row0 + i < num_rows ? load_stream_v4(x + static_cast<i64>(row0 + i) * cols + col)
                                                 : make_uint4(0, 0, 0, 0);
        uint4 m = make_uint4(0, 0, 0, 0);  // per column pair: max of the finite |v| (bf16 bits)
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            m.x = __vmaxu2(m.x, finite_abs_bf16x2(v[i].x));
            m.y = __vmaxu2(m.y, finite_abs_bf16x2(v[i].y));
            m.z = __vmaxu2(m.z, finite_abs_bf16x2(v[i].z));
            m.w = __vmaxu2(m.w, finite_abs_bf16x2(v[i].w));
        }
        // The warp's other row groups hold the same columns kColVecs lanes apart.
#pragma unroll
        for (int offset = kColVecs; offset < kWarpSize; offset *= 2) {
            m.x = __vmaxu2(m.x, __shfl_xor_sync(kFullMask, m.x, offset));
            m.y = __vmaxu2(m.y, __shfl_xor_sync(kFullMask, m.y, offset));
            m.z = __vmaxu2(m.z, __shfl_xor_sync(kFullMask, m.z, offset));
            m.w = __vmaxu2(m.w, __shfl_xor_sync(kFullMask, m.w, offset));
        }
        if (lane_id() < kColVecs)
            smem_amax[warp][cv] = m;
        __syncthreads();
#pragma unroll
        for (int w = 0; w < kFp8QuantWarps; ++w) {
            const uint4 other = smem_amax[w][cv];
            m.x = __vmaxu2(m.x, other.x);
            m.y = __vmaxu2(m.y, other.y);
            m.z = __vmaxu2(m.z, other.z);
            m.w = __vmaxu2(m.w, other.w);
        }
        const u32 words[4] = {m.x, m.y, m.z, m.w};
        float s[kBf16PerVec];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s[2 * i] = fp8_scale_of(words[i] & 0xffffu);
            s[2 * i + 1] = fp8_scale_of(words[i] >> 16);
        }
        if (col_ok) {
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) {
                if (row0 + i >= num_rows)
                    break;
                *reinterpret_cast<uint2*>(data + static_cast<i64>(row0 + i) * cols + col) = quantize_bf16x8(v[i], s);
            }
            if (rg == 0) {
                float4* dst = reinterpret_cast<float4*>(scale + static_cast<i64>(rb) * cols + col);
                dst[0] = make_float4(s[0], s[1], s[2], s[3]);
                dst[1] = make_float4(s[4], s[5], s[6], s[7]);
            }
        }
        __syncthreads();  // smem_amax is rewritten by the next block
    }
}

}  // namespace dge
