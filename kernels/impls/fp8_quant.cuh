#pragma once

// Blockwise e4m3 quantization of bf16 tensors, bit for bit what deep_gemm_ext/recipes/fp8.py's
// torch quantizers compute on a CUDA tensor:
//   amax  = max |v| over the tile's finite elements (0 when there are none)
//   scale = max(amax, 448 * 2^-126) * fl32(1 / 448)   (torch divides a CUDA tensor by a Python
//                                                      scalar as a multiply by its fp32 reciprocal)
//   data  = rn_e4m3(rn_f32(v / scale))   (|v / scale| <= 448 up to one fp32 rounding, so the
//                                         saturation never triggers; see fp8_quotient)
//   data  = 0x7f (NaN)                   for a NaN / +Inf / -Inf element
// Tiles: 1x128 along each row (quantize_rows_kernel: plain rows, gathered pool rows, or SwiGLU
// rows; swiglu_backward_fp8_kernel: the dh of the SwiGLU backward), 128x1 down each column
// (quantize_cols_kernel; quantize_cols_t_kernel writes the transpose). A ragged last tile covers
// the remaining elements only. Every row has a multiple of 8 elements (16-byte bf16 vectors).
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
// |bf16| bits from which a value is Inf (0x7f80) or NaN (above).
constexpr u32 kBf16NonFinite = 0x7f80u;

// ---------------------------------------------------------------------------------------------
// amax on bf16 bits: |v| is the bits without the sign, and such bits compare as integers in the
// order of their values (Inf and NaN above every finite value).

// Per bf16 half of a word: the max |v| of the words, non-finite values included.
__device__ __forceinline__ u32 abs_max_bf16x8(const uint4& v) {
    constexpr u32 kAbs = 0x7fff7fffu;
    return __vmaxu2(__vmaxu2(v.x & kAbs, v.y & kAbs), __vmaxu2(v.z & kAbs, v.w & kAbs));
}

// |v| of two packed bf16, each zeroed when it is not finite.
__device__ __forceinline__ u32 finite_abs_bf16x2(u32 w) {
    const u32 a = w & 0x7fff7fffu;
    return a & __vcmpltu2(a, kBf16NonFinite * 0x10001u);
}

__device__ __forceinline__ u32 finite_abs_max_bf16x8(const uint4& v) {
    return __vmaxu2(__vmaxu2(finite_abs_bf16x2(v.x), finite_abs_bf16x2(v.y)),
                    __vmaxu2(finite_abs_bf16x2(v.z), finite_abs_bf16x2(v.w)));
}

__device__ __forceinline__ u32 max_of_halves(u32 m) { return max(m & 0xffffu, m >> 16); }

// The tile's scale from the bf16 bits of its finite amax.
__device__ __forceinline__ float fp8_scale_of(u32 amax_bits) {
    return __fmul_rn(fmaxf(__uint_as_float(amax_bits << 16), kFp8AmaxFloor), kFp8InvMax);
}

// ---------------------------------------------------------------------------------------------
// x / scale, rounded to nearest even, with the reciprocal work of a division done once per tile.
// The scale is normal (>= 2^-126) and below 2^120, so scale = b * 2^k with b in [1, 2) and 2^-k
// normal; then x / scale = (x * 2^-k) / b exactly, and the quotient of a numerator in [2^-11, 1024]
// by b is computed by the instruction sequence of div.rn.f32's fast path (approximate reciprocal,
// one Newton step, one residual correction), exact for operands in that range (div.rn falls back
// to its slow path only near the ends of the exponent range). A quotient below 2^-11 in magnitude
// rounds to a zero e4m3 in any case, so there only its sign matters, which is x's.
struct Fp8Divisor {
    float b;      // the scale's significand, in [1, 2)
    float r;      // refined reciprocal of b
    float shift;  // 2^-k: scale = b / shift
};

__device__ __forceinline__ Fp8Divisor fp8_divisor(float scale) {
    const u32 bits = __float_as_uint(scale);
    Fp8Divisor d;
    d.b = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
    d.shift = __uint_as_float((254u - (bits >> 23)) << 23);
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(d.b));
    d.r = __fmaf_rn(r0, __fmaf_rn(-d.b, r0, 1.0f), r0);
    return d;
}

// NaN for a NaN or Inf x (Inf * 2^-k / b meets Inf - Inf in the residual).
__device__ __forceinline__ float fp8_quotient(float x, const Fp8Divisor& d) {
    const float a = __fmul_rn(x, d.shift);  // exact wherever the quotient is >= 2^-11
    const float q0 = __fmul_rn(a, d.r);
    const float q = __fmaf_rn(d.r, __fmaf_rn(-d.b, q0, a), q0);
    return copysignf(q, x);  // also keeps -0 as -0
}

// Two e4m3 bytes (lo at the lower address) of one packed bf16 pair, each element divided by its
// tile's scale. A non-finite element gives a NaN byte, 0x7f or 0xff.
__device__ __forceinline__ u32 quantize_bf16x2(u32 w, const Fp8Divisor& d_lo, const Fp8Divisor& d_hi) {
    const float lo = fp8_quotient(__uint_as_float(w << 16), d_lo);
    const float hi = fp8_quotient(__uint_as_float(w & 0xffff0000u), d_hi);
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    return pair;
}

// Four e4m3 bytes with every NaN as 0x7f, the positive NaN torch's cast writes. A finite element
// never gives 0x7f / 0xff (satfinite: at most 448, 0x7e), so a byte whose low 7 bits are all ones
// is a NaN: its sign bit is cleared.
__device__ __forceinline__ u32 canonical_nan_bytes(u32 bytes) {
    const u32 nan_sign = ((bytes & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
    return bytes & ~nan_sign;
}

// Eight e4m3 bytes of one bf16x8 vector, as the two words of an 8-byte store; d[i] divides
// element i.
__device__ __forceinline__ uint2 quantize_bf16x8(const uint4& v, const Fp8Divisor (&d)[kBf16PerVec]) {
    return make_uint2(canonical_nan_bytes(quantize_bf16x2(v.x, d[0], d[1]) | (quantize_bf16x2(v.y, d[2], d[3]) << 16)),
                      canonical_nan_bytes(quantize_bf16x2(v.z, d[4], d[5]) | (quantize_bf16x2(v.w, d[6], d[7]) << 16)));
}

// ---------------------------------------------------------------------------------------------
// 1x128 tiles along the rows.

// Where quantize_rows_kernel reads a row's bf16 values.
enum class Fp8RowSource : int {
    kRows = 0,    // x [num_rows, cols]
    kGather = 1,  // x [num_tokens, cols]: row r is x[row_to_slot[r] / top_k], zeros where the slot is < 0
    kSwiglu = 2,  // h [num_rows, 2 * cols]: act = bf16(swiglu(g, u)), also stored to act when non-null
};

// The max over the 16 lanes of a half warp (all 32 lanes call it).
__device__ __forceinline__ u32 half_warp_max(u32 value) {
#pragma unroll
    for (int offset = kFp8TileLanes / 2; offset > 0; offset /= 2)
        value = max(value, __shfl_xor_sync(kFullMask, value, offset));
    return value;
}

// The scale of the 1x128 tile a half warp holds (one bf16x8 vector a lane, zeros where absent, which
// change no amax; all 32 lanes call it: the NaN / Inf test is warp-wide, and a tile without one gets the
// same amax either way).
__device__ __forceinline__ float fp8_tile_scale(const uint4& v) {
    u32 amax = half_warp_max(max_of_halves(abs_max_bf16x8(v)));
    if (__any_sync(kFullMask, amax >= kBf16NonFinite))  // a NaN / Inf in the warp's tiles: finite only
        amax = half_warp_max(max_of_halves(finite_abs_max_bf16x8(v)));
    return fp8_scale_of(amax);
}

// Half a warp per tile, one 16-byte vector per lane; each warp takes kTilesPerHalf tiles per half
// per step (their loads issued before any reduction) and warps stride over the row-major list of
// (row, tile) items, each lane stepping its (row, tile) positions without a division.
// items = num_rows * ceil(cols / 128) fits in 31 bits (the launcher splits larger tensors).
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
    const u32 row_step = warp_step / tiles_per_row, tile_step = warp_step % tiles_per_row;
    u32 row[kTilesPerHalf], tile[kTilesPerHalf];
#pragma unroll
    for (int j = 0; j < kTilesPerHalf; ++j) {
        const u32 item = warp * kItemsPerWarp + 2 * j + half;
        row[j] = item / tiles_per_row;
        tile[j] = item - row[j] * tiles_per_row;
    }
    // The loop condition is uniform across the warp (the reductions shuffle over all 32 lanes).
    for (u32 base = warp * kItemsPerWarp; base < num_items; base += warp_step) {
        uint4 v[kTilesPerHalf];
        u32 col[kTilesPerHalf];
        bool item_ok[kTilesPerHalf], lane_ok[kTilesPerHalf];
#pragma unroll
        for (int j = 0; j < kTilesPerHalf; ++j) {
            item_ok[j] = base + 2 * j + half < num_items;
            col[j] = tile[j] * kFp8Block + vec_col;
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
            const float s = fp8_tile_scale(v[j]);
            const Fp8Divisor d = fp8_divisor(s);
            const Fp8Divisor d8[kBf16PerVec] = {d, d, d, d, d, d, d, d};
            if (lane_ok[j])
                *reinterpret_cast<uint2*>(data + static_cast<i64>(row[j]) * cols + col[j]) = quantize_bf16x8(v[j], d8);
            if (item_ok[j] && vec_col == 0)
                scale[static_cast<i64>(row[j]) * tiles_per_row + tile[j]] = s;
            tile[j] += tile_step;
            row[j] += row_step;
            if (tile[j] >= tiles_per_row) {
                tile[j] -= tiles_per_row;
                ++row[j];
            }
        }
    }
}

// The dispatched pool's rows quantized in token order: a warp reads each token's row once (kTilesPerHalf
// tiles per half warp per step, loads issued before any reduction), quantizes each tile as
// quantize_rows_kernel does, and stores its e4m3 bytes and scale to the pool rows of the token's used slots
// (slot_to_row); then the rows no used slot maps to (row_to_slot < 0, or a slot of a token past num_tokens)
// get zero data and a zero scale, 32 rows a warp step. Where slot_to_row and row_to_slot are inverse over
// the used slots (routing metadata), every used row has the bits of quantizing x's row, and every other
// row the bytes gather_rows writes there. top_k <= 32 (a lane holds one slot's row). `pool` (nullable):
// the bf16 pool as well, each lane's 16-byte vector stored to the same rows (zeros on the rows no slot
// maps to): gather_rows' pool from the same read of x.
template <int kTilesPerHalf>
__global__ void __launch_bounds__(kFp8QuantThreads)
quantize_token_rows_kernel(const __nv_bfloat16* __restrict__ x, const int* __restrict__ slot_to_row,
                           const int* __restrict__ row_to_slot, unsigned char* __restrict__ data,
                           float* __restrict__ scale, __nv_bfloat16* __restrict__ pool, u32 num_tokens, u32 cols,
                           u32 top_k, u32 num_rows) {
    grid_dependency_wait();
    const u32 tiles_per_row = (cols + kFp8Block - 1) / kFp8Block;
    const int lane = lane_id();
    const u32 half = static_cast<u32>(lane) / kFp8TileLanes;
    const u32 vec_col = static_cast<u32>(lane % kFp8TileLanes) * kBf16PerVec;
    const u32 num_warps = gridDim.x * kFp8QuantWarps;
    const u32 warp = blockIdx.x * kFp8QuantWarps + warp_id();
    for (u32 token = warp; token < num_tokens; token += num_warps) {
        int slot_row = -1;
        if (static_cast<u32>(lane) < top_k) {
            const int r = slot_to_row[static_cast<i64>(token) * top_k + lane];
            slot_row = r >= 0 && static_cast<u32>(r) < num_rows ? r : -1;
        }
        const __nv_bfloat16* src = x + static_cast<i64>(token) * cols;
        for (u32 tile0 = 0; tile0 < tiles_per_row; tile0 += 2 * kTilesPerHalf) {  // uniform across the warp
            uint4 v[kTilesPerHalf];
            u32 col[kTilesPerHalf];
            bool tile_ok[kTilesPerHalf], lane_ok[kTilesPerHalf];
#pragma unroll
            for (int j = 0; j < kTilesPerHalf; ++j) {
                const u32 tile = tile0 + 2 * j + half;
                tile_ok[j] = tile < tiles_per_row;
                col[j] = tile * kFp8Block + vec_col;
                lane_ok[j] = tile_ok[j] && col[j] < cols;
                v[j] = lane_ok[j] ? load_stream_v4(src + col[j]) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < kTilesPerHalf; ++j) {
                const float s = fp8_tile_scale(v[j]);
                const Fp8Divisor d = fp8_divisor(s);
                const Fp8Divisor d8[kBf16PerVec] = {d, d, d, d, d, d, d, d};
                const uint2 bytes = quantize_bf16x8(v[j], d8);
                const u32 tile = tile0 + 2 * j + half;
                for (u32 k = 0; k < top_k; ++k) {
                    const int row = __shfl_sync(kFullMask, slot_row, k);
                    if (row < 0)
                        continue;
                    if (lane_ok[j]) {
                        *reinterpret_cast<uint2*>(data + static_cast<i64>(row) * cols + col[j]) = bytes;
                        if (pool != nullptr)
                            *reinterpret_cast<uint4*>(pool + static_cast<i64>(row) * cols + col[j]) = v[j];
                    }
                    if (tile_ok[j] && vec_col == 0)
                        scale[static_cast<i64>(row) * tiles_per_row + tile] = s;
                }
            }
        }
    }
    for (u32 base = warp * kWarpSize; base < num_rows; base += num_warps * kWarpSize) {
        const u32 r = base + lane;
        bool unmapped = false;
        if (r < num_rows) {
            const int slot = row_to_slot[r];
            unmapped = slot < 0 || static_cast<u32>(slot) / top_k >= num_tokens;
        }
        for (u32 mask = __ballot_sync(kFullMask, unmapped); mask != 0; mask &= mask - 1) {
            const i64 row = base + __ffs(static_cast<int>(mask)) - 1;
            for (u32 c = lane * kBf16PerVec; c < cols; c += kWarpSize * kBf16PerVec) {
                *reinterpret_cast<uint2*>(data + row * cols + c) = make_uint2(0, 0);
                if (pool != nullptr)
                    *reinterpret_cast<uint4*>(pool + row * cols + c) = make_uint4(0, 0, 0, 0);
            }
            for (u32 t = lane; t < tiles_per_row; t += kWarpSize)
                scale[row * tiles_per_row + t] = 0.0f;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU backward with dh also quantized 1x128 along its 2I columns (the operand of the L1 data
// gradient), from the bf16-rounded dh it stores: swiglu_backward_kernel's arithmetic (the same
// element function, lanes on the same vectors, the same dweight reduction order) and the row
// quantizer's scale rule. One warp per row; inter is a multiple of 128, so a half warp's 16 vectors
// are one whole tile of the gate half or of the up half, and no tile straddles the two.

// Quantizes one 1x128 tile held by a half warp (one bf16x8 vector a lane, zeros where !ok; all 32
// lanes call it): data at `data` (this lane's 8 bytes), the scale at `scale` (by the half's first lane).
__device__ __forceinline__ void quantize_half_warp_tile(const uint4& v, bool ok, unsigned char* data, float* scale) {
    const float s = fp8_tile_scale(v);
    const Fp8Divisor d = fp8_divisor(s);
    const Fp8Divisor d8[kBf16PerVec] = {d, d, d, d, d, d, d, d};
    if (ok) {
        *reinterpret_cast<uint2*>(data) = quantize_bf16x8(v, d8);
        if (lane_id() % kFp8TileLanes == 0)
            *scale = s;
    }
}

template <bool kClamp>
__global__ void __launch_bounds__(kFp8QuantThreads)
swiglu_backward_fp8_kernel(const __nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ da,
                           const float* __restrict__ row_weight, __nv_bfloat16* __restrict__ dh,
                           float* __restrict__ dweight, __nv_bfloat16* __restrict__ act_w,
                           unsigned char* __restrict__ dh_data, float* __restrict__ dh_scale, u32 rows, u32 cols_half,
                           float clamp) {
    grid_dependency_wait();
    const i64 num_rows = rows;
    const int inter = static_cast<int>(cols_half);
    const int vecs_per_row = inter / kBf16PerVec;  // a multiple of 16
    const int tiles_per_row = 2 * inter / kFp8Block;
    const int lane = lane_id();
    const i64 num_warps = static_cast<i64>(gridDim.x) * kFp8QuantWarps;
    for (i64 row = static_cast<i64>(blockIdx.x) * kFp8QuantWarps + warp_id(); row < num_rows; row += num_warps) {
        const float w = row_weight[row];
        const __nv_bfloat16* h_row = h + row * (2 * inter);
        const __nv_bfloat16* da_row = da + row * inter;
        unsigned char* data_row = dh_data + row * (2 * inter);
        float* scale_row = dh_scale + row * tiles_per_row;
        float partial = 0.0f;
        // Uniform trip count (the tile reductions shuffle over the warp); a lane past the row holds
        // zeros, and such lanes make up whole half warps.
        for (int base = 0; base < vecs_per_row; base += kWarpSize) {
            const int v = base + lane;
            const bool ok = v < vecs_per_row;
            const int col = v * kBf16PerVec;
            uint4 dg_bits = make_uint4(0, 0, 0, 0), du_bits = make_uint4(0, 0, 0, 0);
            if (ok) {
                float g[kBf16PerVec], u[kBf16PerVec], d[kBf16PerVec];
                float dg[kBf16PerVec], du[kBf16PerVec], aw[kBf16PerVec];
                unpack_bf16x8(load_stream_v4(h_row + col), g);
                unpack_bf16x8(load_stream_v4(h_row + inter + col), u);
                unpack_bf16x8(load_stream_v4(da_row + col), d);
#pragma unroll
                for (int i = 0; i < kBf16PerVec; ++i)
                    swiglu_backward_element<kClamp>(g[i], u[i], d[i], w, clamp, partial, dg[i], du[i], aw[i]);
                dg_bits = pack_bf16x8(dg);
                du_bits = pack_bf16x8(du);
                store_v4(dh + row * (2 * inter) + col, dg_bits);
                store_v4(dh + row * (2 * inter) + inter + col, du_bits);
                store_v4(act_w + row * inter + col, pack_bf16x8(aw));
            }
            // Vector v is in tile v / 16 of the gate half, tile (vecs_per_row + v) / 16 of the row.
            const int tile = v / kFp8TileLanes;
            quantize_half_warp_tile(dg_bits, ok, data_row + col, scale_row + tile);
            quantize_half_warp_tile(du_bits, ok, data_row + inter + col,
                                    scale_row + vecs_per_row / kFp8TileLanes + tile);
        }
        partial = warp_sum(partial);
        if (lane == 0)
            dweight[row] = partial;
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU backward for fp8 weight gradients: one pass over h and da gives dweight, dh quantized 1x128
// along its 2I columns (swiglu_backward_fp8_kernel's dh_data / dh_scale, the L1 data gradient's operand),
// and dh and act_w quantized 128x1 down their columns and written transposed (quantize_cols_t_kernel's
// bytes and scales of the bf16 dh and act_w: the K-grouped GEMMs' operands), with no bf16 dh or act_w
// written. Every output is bit for bit that of swiglu_backward_fp8_kernel followed by
// quantize_cols_t_kernel on its dh and act_w (out_rows >= rows, the rows past `rows` zeros).
//
// A CTA takes one 128-row block of the pool and walks its I columns in 128-wide chunks (I is a multiple
// of 128). Phase 1 of a chunk: half warp (w, h) of the 16 warps holds rows 2 w + h + 32 i (i < 4), lane t
// of the half the 8 columns 8 t .. 8 t + 7 of the chunk; for each row it computes the chunk's dg, du and
// w * act (the element function of every SwiGLU backward kernel), quantizes the row's gate and up tiles of
// dh (the half warp's 16 vectors are one 1x128 tile), keeps the bf16 values in shared memory and folds
// them into its column maxima. Phase 2: the column maxima reduced over the 16 half warps, then each thread
// quantizes 16 rows of one column of one of the three tiles into a 16-byte segment of the transposed
// output (8 lanes per column: 128 contiguous bytes).
//
// The inputs are staged: each thread copies its own h and da vectors of the next chunk (or of the next
// row block's first) into shared memory with cp.async as soon as it has read the current chunk's from the
// same slots, one commit group per row. A thread reads only the slots it fills, so the staging needs no
// barrier, and the copies of a chunk are in flight under the rest of the previous chunk's work. (Loaded
// into registers a row at a time, the loads of a row waited on the previous row's work: 3 loads in flight
// per thread, 1.7 TB/s.)
//
// dweight's sum keeps the one-warp-per-row kernels' order: there lane l of a row's warp adds the vectors
// l, l + 32, ... in turn, then the warp's butterfly. Here vector 16 j + t (chunk j) is added by lane t of
// the row's half warp into the partial of chunk j's parity, so that partial is the other kernels' lane
// 16 (j % 2) + t; the butterfly's first step adds lanes l and l ^ 16, i.e. this thread's two partials, and
// its other steps stay inside the half warp.
//
// Dynamic shared memory (192 KiB, one CTA per SM): the three bf16 128 x 128 result tiles, vector v of row
// r at v ^ (r / 16), so that phase 2's 8 lanes of a column, 16 rows apart each, read 8 different banks;
// then the staged inputs (h's gate and up vectors and da's), by thread and row.
constexpr int kSwigluTThreads = 512;
constexpr int kSwigluTWarps = kSwigluTThreads / kWarpSize;
constexpr int kSwigluTRowsPerThread = kFp8Block / (2 * kSwigluTWarps);  // 4
constexpr u32 kSwigluTRowStep = 2 * kSwigluTWarps;                      // rows between a thread's rows
constexpr u32 kSwigluTTileVecs = kFp8Block * kFp8TileLanes;             // uint4 per 128 x 128 bf16 tile
// Phase 2's items: 3 tiles x 128 columns x 8 segments of 16 rows.
constexpr int kSwigluTSegments = kFp8Block / 16;
constexpr int kSwigluTItemsPerThread = kFp8Block * kSwigluTSegments / kSwigluTThreads;  // per tile: 2
static_assert(kSwigluTRowsPerThread == 4 && kSwigluTItemsPerThread == 2, "512 threads on 128 x 128 tiles");

__device__ __forceinline__ uint4 finite_abs_max_v4(const uint4& m, const uint4& v) {
    return make_uint4(__vmaxu2(m.x, finite_abs_bf16x2(v.x)), __vmaxu2(m.y, finite_abs_bf16x2(v.y)),
                      __vmaxu2(m.z, finite_abs_bf16x2(v.z)), __vmaxu2(m.w, finite_abs_bf16x2(v.w)));
}

__device__ __forceinline__ uint4 max_v4(const uint4& a, const uint4& b) {
    return make_uint4(__vmaxu2(a.x, b.x), __vmaxu2(a.y, b.y), __vmaxu2(a.z, b.z), __vmaxu2(a.w, b.w));
}

__device__ __forceinline__ uint4 shfl_xor_v4(const uint4& v, int offset) {
    return make_uint4(__shfl_xor_sync(kFullMask, v.x, offset), __shfl_xor_sync(kFullMask, v.y, offset),
                      __shfl_xor_sync(kFullMask, v.z, offset), __shfl_xor_sync(kFullMask, v.w, offset));
}

// 16 bytes global -> shared, L2 only (cp.async.cg); the copies this thread issued, in commit groups. (Not
// ptx/ld_st.cuh's cp_async_16: these sources compile under NVRTC too, without <cstdint>.)
__device__ __forceinline__ void cp_async_cg_16(const void* smem_dst, const void* src) {
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's newest commit groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Scale arguments: dh_scale [rows, 2I / 128]; dht_scale [2I, ceil(out_rows / 128)], awt_scale
// [I, ceil(out_rows / 128)]. Data: dh_data [rows, 2I]; dht_data [2I, out_rows], awt_data [I, out_rows].
// The grid has at most ceil(out_rows / 128) CTAs.
template <bool kClamp>
__global__ void __launch_bounds__(kSwigluTThreads, 1)
swiglu_backward_fp8_t_kernel(const __nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ da,
                             const float* __restrict__ row_weight, float* __restrict__ dweight,
                             unsigned char* __restrict__ dh_data, float* __restrict__ dh_scale,
                             unsigned char* __restrict__ dht_data, float* __restrict__ dht_scale,
                             unsigned char* __restrict__ awt_data, float* __restrict__ awt_scale, u32 rows,
                             u32 out_rows, u32 cols_half, float clamp) {
    extern __shared__ __align__(16) uint4 smem_tiles[];  // [3][128][16] results, then [3][128][16] staged inputs
    __shared__ uint4 smem_amax[3][kSwigluTWarps][kFp8TileLanes];
    __shared__ u32 smem_col_amax[3][kFp8Block / 2];      // bf16 bits of two columns' maxima per word
    uint4* const smem_in = smem_tiles + 3 * kSwigluTTileVecs;
    grid_dependency_wait();
    const u32 inter = cols_half;
    const u32 chunks = inter / kFp8Block;
    const u32 dh_tiles = 2 * chunks;
    const u32 row_blocks = (out_rows + kFp8Block - 1) / kFp8Block;
    const int lane = lane_id();
    const u32 t = static_cast<u32>(lane) % kFp8TileLanes;
    const u32 row_in_step = 2 * static_cast<u32>(warp_id()) + static_cast<u32>(lane) / kFp8TileLanes;  // 0 .. 31
    // This thread's staging slot of input x (0: h's gate half, 1: its up half, 2: da) for its row i.
    auto in_slot = [&](u32 x, int i) {
        return smem_in + (x * kFp8Block + row_in_step + kSwigluTRowStep * i) * kFp8TileLanes + t;
    };
    // Row i's copies for chunk j of row block rb, as one commit group (empty past `rows` or with no item).
    auto stage_row = [&](bool have, u32 rb, u32 j, int i) {
        const i64 r = static_cast<i64>(rb) * kFp8Block + row_in_step + kSwigluTRowStep * i;
        if (have && r < rows) {
            const u32 col = j * kFp8Block + t * kBf16PerVec;
            const __nv_bfloat16* h_row = h + r * (2 * static_cast<i64>(inter));
            cp_async_cg_16(in_slot(0, i), h_row + col);
            cp_async_cg_16(in_slot(1, i), h_row + inter + col);
            cp_async_cg_16(in_slot(2, i), da + r * inter + col);
        }
        cp_async_commit_group();
    };
    auto load_weights = [&](u32 rb, float (&w)[kSwigluTRowsPerThread]) {
#pragma unroll
        for (int i = 0; i < kSwigluTRowsPerThread; ++i) {
            const i64 r = static_cast<i64>(rb) * kFp8Block + row_in_step + kSwigluTRowStep * i;
            w[i] = r < rows ? __ldg(row_weight + r) : 0.0f;
        }
    };

    u32 rb = blockIdx.x, j = 0;
    if (rb >= row_blocks)
        return;
#pragma unroll
    for (int i = 0; i < kSwigluTRowsPerThread; ++i)
        stage_row(true, rb, 0, i);
    float w[kSwigluTRowsPerThread], w_next[kSwigluTRowsPerThread];
    float partial[kSwigluTRowsPerThread], partial_other[kSwigluTRowsPerThread];
    load_weights(rb, w);
    for (;;) {
        const u32 row0 = rb * kFp8Block;
        if (j == 0) {
#pragma unroll
            for (int i = 0; i < kSwigluTRowsPerThread; ++i) {
                partial[i] = 0.0f;
                partial_other[i] = 0.0f;
            }
        }
        // The work item after this one: the next chunk, or the next row block's first.
        u32 next_rb = rb, next_j = j + 1;
        if (next_j == chunks) {
            next_j = 0;
            next_rb += gridDim.x;
        }
        const bool have_next = next_rb < row_blocks;
        if (have_next && next_j == 0)
            load_weights(next_rb, w_next);
        // Phase 1: the chunk's values, dh's row tiles, the bf16 tiles and this thread's column maxima.
        const u32 col = j * kFp8Block + t * kBf16PerVec;  // I-column of this lane's vector
        uint4 max_g = make_uint4(0, 0, 0, 0), max_u = max_g, max_a = max_g;
#pragma unroll
        for (int i = 0; i < kSwigluTRowsPerThread; ++i) {
            const u32 r_local = row_in_step + kSwigluTRowStep * i;
            const i64 r = row0 + r_local;
            const bool ok = r < rows;
            // One group per row, oldest first: row i's copies have landed once at most the newer
            // kSwigluTRowsPerThread - 1 groups are in flight.
            cp_async_wait_group<kSwigluTRowsPerThread - 1>();
            uint4 dg_bits = make_uint4(0, 0, 0, 0), du_bits = dg_bits, aw_bits = dg_bits;
            if (ok) {
                float g[kBf16PerVec], u[kBf16PerVec], d[kBf16PerVec];
                float dg[kBf16PerVec], du[kBf16PerVec], aw[kBf16PerVec];
                unpack_bf16x8(*in_slot(0, i), g);
                unpack_bf16x8(*in_slot(1, i), u);
                unpack_bf16x8(*in_slot(2, i), d);
#pragma unroll
                for (int e = 0; e < kBf16PerVec; ++e)
                    swiglu_backward_element<kClamp>(g[e], u[e], d[e], w[i], clamp, partial[i], dg[e], du[e], aw[e]);
                dg_bits = pack_bf16x8(dg);
                du_bits = pack_bf16x8(du);
                aw_bits = pack_bf16x8(aw);
            }
            // The slots of row i are read: they take the next item's row i.
            stage_row(have_next, next_rb, next_j, i);
            unsigned char* data_row = dh_data + r * (2 * static_cast<i64>(inter));
            float* scale_row = dh_scale + r * dh_tiles;
            quantize_half_warp_tile(dg_bits, ok, data_row + col, scale_row + j);
            quantize_half_warp_tile(du_bits, ok, data_row + inter + col, scale_row + chunks + j);
            max_g = finite_abs_max_v4(max_g, dg_bits);
            max_u = finite_abs_max_v4(max_u, du_bits);
            max_a = finite_abs_max_v4(max_a, aw_bits);
            const u32 slot = r_local * kFp8TileLanes + (t ^ (r_local / 16));
            smem_tiles[slot] = dg_bits;
            smem_tiles[kSwigluTTileVecs + slot] = du_bits;
            smem_tiles[2 * kSwigluTTileVecs + slot] = aw_bits;
        }
        // The next chunk adds into the other parity's partials.
#pragma unroll
        for (int i = 0; i < kSwigluTRowsPerThread; ++i) {
            const float keep = partial[i];
            partial[i] = partial_other[i];
            partial_other[i] = keep;
        }
        max_g = max_v4(max_g, shfl_xor_v4(max_g, kFp8TileLanes));
        max_u = max_v4(max_u, shfl_xor_v4(max_u, kFp8TileLanes));
        max_a = max_v4(max_a, shfl_xor_v4(max_a, kFp8TileLanes));
        if (lane < kFp8TileLanes) {
            smem_amax[0][warp_id()][t] = max_g;
            smem_amax[1][warp_id()][t] = max_u;
            smem_amax[2][warp_id()][t] = max_a;
        }
        __syncthreads();
        // The column maxima: thread k < 192 reduces the word of columns 2 (k % 64), +1 of tile k / 64 and
        // stores their scales (tile 0: dh's gate columns, 1: its up columns, 2: act_w's).
        if (threadIdx.x < 3 * kFp8Block / 2) {
            const u32 x = threadIdx.x / (kFp8Block / 2), pair = threadIdx.x % (kFp8Block / 2);
            const u32* words = reinterpret_cast<const u32*>(&smem_amax[x][0][0]);
            u32 m = 0;
#pragma unroll
            for (int wi = 0; wi < kSwigluTWarps; ++wi)
                m = __vmaxu2(m, words[wi * kFp8TileLanes * 4 + pair]);
            smem_col_amax[x][pair] = m;
            const i64 out_col = (x == 1 ? inter : 0) + j * kFp8Block + 2 * pair;
            float* scale = x == 2 ? awt_scale : dht_scale;
            scale[out_col * row_blocks + rb] = fp8_scale_of(m & 0xffffu);
            scale[(out_col + 1) * row_blocks + rb] = fp8_scale_of(m >> 16);
        }
        __syncthreads();
        // Phase 2: item (tile x, column c, segment s) quantizes rows 16 s .. 16 s + 15 of column c.
        const unsigned short* tiles16 = reinterpret_cast<const unsigned short*>(smem_tiles);
#pragma unroll 1
        for (int x = 0; x < 3; ++x) {
            unsigned char* out = x == 2 ? awt_data : dht_data;
#pragma unroll
            for (int q = 0; q < kSwigluTItemsPerThread; ++q) {
                const u32 item = q * kSwigluTThreads + threadIdx.x;
                const u32 s = item % kSwigluTSegments, c = item / kSwigluTSegments;
                const u32 m = smem_col_amax[x][c / 2];
                const Fp8Divisor d = fp8_divisor(fp8_scale_of(c % 2 ? m >> 16 : m & 0xffffu));
                const u32 vec = (c / kBf16PerVec) ^ s;  // rows 16 s .. 16 s + 15: r / 16 == s
                const unsigned short* src =
                    tiles16 + (static_cast<u32>(x) * kSwigluTTileVecs + 16 * s * kFp8TileLanes + vec) *
                                  kBf16PerVec + c % kBf16PerVec;
                u32 bytes[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    u32 pair[2];
#pragma unroll
                    for (int p = 0; p < 2; ++p) {
                        const u32 lo = src[(4 * k + 2 * p) * kFp8TileLanes * kBf16PerVec];
                        const u32 hi = src[(4 * k + 2 * p + 1) * kFp8TileLanes * kBf16PerVec];
                        pair[p] = quantize_bf16x2(lo | (hi << 16), d, d);
                    }
                    bytes[k] = canonical_nan_bytes(pair[0] | (pair[1] << 16));
                }
                const u32 out_row = row0 + 16 * s;
                if (out_row < out_rows) {
                    const i64 out_col = (x == 1 ? inter : 0) + j * kFp8Block + c;
                    store_v4(out + out_col * out_rows + out_row, make_uint4(bytes[0], bytes[1], bytes[2], bytes[3]));
                }
            }
        }
        if (j == chunks - 1) {
            // dweight: this thread's two partials are the other kernels' lanes t and t + 16 (first
            // butterfly step), then the half warp's butterfly.
#pragma unroll
            for (int i = 0; i < kSwigluTRowsPerThread; ++i) {
                float sum = partial[i] + partial_other[i];
#pragma unroll
                for (int offset = kFp8TileLanes / 2; offset > 0; offset /= 2)
                    sum += __shfl_xor_sync(kFullMask, sum, offset);
                const u32 r = row0 + row_in_step + kSwigluTRowStep * i;
                if (t == 0 && r < rows)
                    dweight[r] = sum;
            }
        }
        // The tiles and maxima are read: the next chunk may write them.
        __syncthreads();
        if (!have_next)
            break;
        if (next_j == 0) {
#pragma unroll
            for (int i = 0; i < kSwigluTRowsPerThread; ++i)
                w[i] = w_next[i];
        }
        rb = next_rb;
        j = next_j;
    }
}

// ---------------------------------------------------------------------------------------------
// 128x1 tiles down the columns. One CTA step covers 128 rows x kColVecs * 8 columns: thread
// (row group rg = tid / kColVecs, column vector cv = tid % kColVecs) holds kRowsPerThread rows of
// 8 columns (16 bytes each), so a warp's load covers 32 / kColVecs row segments of kColVecs * 16
// bytes. The column amaxes are reduced over the row groups of a warp by shuffles and over the
// eight warps through shared memory. CTAs stride over the blocks; blocks fit in 31 bits.

// Per column pair, the max over the CTA's row groups of m. Every thread calls it, after a barrier
// that ends the previous block's reads of smem.
template <int kColVecs>
__device__ __forceinline__ uint4 cta_column_max(uint4 m, uint4 (&smem)[kFp8QuantWarps][kColVecs], u32 cv) {
#pragma unroll
    for (int offset = kColVecs; offset < kWarpSize; offset *= 2) {
        m.x = __vmaxu2(m.x, __shfl_xor_sync(kFullMask, m.x, offset));
        m.y = __vmaxu2(m.y, __shfl_xor_sync(kFullMask, m.y, offset));
        m.z = __vmaxu2(m.z, __shfl_xor_sync(kFullMask, m.z, offset));
        m.w = __vmaxu2(m.w, __shfl_xor_sync(kFullMask, m.w, offset));
    }
    if (lane_id() < kColVecs)
        smem[warp_id()][cv] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kFp8QuantWarps; ++w) {
        const uint4 other = smem[w][cv];
        m.x = __vmaxu2(m.x, other.x);
        m.y = __vmaxu2(m.y, other.y);
        m.z = __vmaxu2(m.z, other.z);
        m.w = __vmaxu2(m.w, other.w);
    }
    return m;
}

__device__ __forceinline__ bool any_half_at_least(const uint4& m, u32 bound) {
    const u32 b2 = bound * 0x10001u;
    return (__vcmpgeu2(m.x, b2) | __vcmpgeu2(m.y, b2) | __vcmpgeu2(m.z, b2) | __vcmpgeu2(m.w, b2)) != 0;
}

// The CTA's per column pair max |v| of one 128-row block (bf16 bits): every thread's kRows vectors v
// reduced with Inf / NaN included, then, only when a NaN / Inf is in the block, again without them;
// then across the CTA's row groups (cta_column_max). The __syncthreads_or is also the barrier that
// ends the previous block's reads of smem (and of any other shared buffer the caller reuses).
template <int kRows, int kColVecs>
__device__ __forceinline__ uint4 block_column_amax(const uint4 (&v)[kRows], uint4 (&smem)[kFp8QuantWarps][kColVecs],
                                                   u32 cv) {
    uint4 m = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        m.x = __vmaxu2(m.x, v[i].x & 0x7fff7fffu);
        m.y = __vmaxu2(m.y, v[i].y & 0x7fff7fffu);
        m.z = __vmaxu2(m.z, v[i].z & 0x7fff7fffu);
        m.w = __vmaxu2(m.w, v[i].w & 0x7fff7fffu);
    }
    if (__syncthreads_or(any_half_at_least(m, kBf16NonFinite))) {
        m = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            m.x = __vmaxu2(m.x, finite_abs_bf16x2(v[i].x));
            m.y = __vmaxu2(m.y, finite_abs_bf16x2(v[i].y));
            m.z = __vmaxu2(m.z, finite_abs_bf16x2(v[i].z));
            m.w = __vmaxu2(m.w, finite_abs_bf16x2(v[i].w));
        }
    }
    return cta_column_max<kColVecs>(m, smem, cv);
}

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
    for (u32 block = blockIdx.x; block < num_blocks; block += gridDim.x) {
        const u32 rb = block / col_blocks;
        const u32 col = (block - rb * col_blocks) * kBlockCols + cv * kBf16PerVec;
        const bool col_ok = col < cols;
        const u32 row0 = rb * kFp8Block + rg * kRowsPerThread;
        // Rows of this thread that exist (0 when the column vector is past the end).
        const u32 rows_here = col_ok && row0 < num_rows ? min(static_cast<u32>(kRowsPerThread), num_rows - row0) : 0;
        const __nv_bfloat16* src = x + static_cast<i64>(row0) * cols + col;
        uint4 v[kRowsPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
            v[i] = static_cast<u32>(i) < rows_here ? load_stream_v4(src + static_cast<i64>(i) * cols)
                                                   : make_uint4(0, 0, 0, 0);
        // Per column pair: the block's max |v| (NaN / Inf excluded where present); its barrier also
        // ends the previous block's reads of smem_amax.
        const uint4 m = block_column_amax<kRowsPerThread, kColVecs>(v, smem_amax, cv);
        // Column pair p at a time (two divisors live), so the eight columns' divisors need not all
        // be held: out[i] collects row i's eight bytes.
        const u32 words[4] = {m.x, m.y, m.z, m.w};
        uint2 out[kRowsPerThread];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const Fp8Divisor d_lo = fp8_divisor(fp8_scale_of(words[p] & 0xffffu));
            const Fp8Divisor d_hi = fp8_divisor(fp8_scale_of(words[p] >> 16));
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) {
                const u32 in = p == 0 ? v[i].x : p == 1 ? v[i].y : p == 2 ? v[i].z : v[i].w;
                const u32 pair = quantize_bf16x2(in, d_lo, d_hi);
                if (p == 0)
                    out[i].x = pair;
                else if (p == 1)
                    out[i].x = canonical_nan_bytes(out[i].x | (pair << 16));
                else if (p == 2)
                    out[i].y = pair;
                else
                    out[i].y = canonical_nan_bytes(out[i].y | (pair << 16));
            }
        }
        unsigned char* dst = data + static_cast<i64>(row0) * cols + col;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
            if (static_cast<u32>(i) < rows_here)
                *reinterpret_cast<uint2*>(dst + static_cast<i64>(i) * cols) = out[i];
        if (rg == 0 && col_ok) {
            float4* scale_out = reinterpret_cast<float4*>(scale + static_cast<i64>(rb) * cols + col);
            scale_out[0] = make_float4(fp8_scale_of(m.x & 0xffffu), fp8_scale_of(m.x >> 16),
                                       fp8_scale_of(m.y & 0xffffu), fp8_scale_of(m.y >> 16));
            scale_out[1] = make_float4(fp8_scale_of(m.z & 0xffffu), fp8_scale_of(m.z >> 16),
                                       fp8_scale_of(m.w & 0xffffu), fp8_scale_of(m.w >> 16));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 128x1 tiles down the columns, written transposed (the K-major operands of the K-grouped fp8
// GEMM): x [num_rows, cols] (or the gathered pool: row r is x[row_to_slot[r] / top_k], zeros where
// the slot is < 0 or the token out of range), zero-padded to out_rows >= num_rows rows -> data
// [cols, out_rows] e4m3 and scale [cols, ceil(out_rows / 128)], i.e. quantize_cols_kernel's bytes
// and scales of the padded x, transposed.
// One CTA step covers 128 rows x 64 columns: thread (row group rg = tid / 8, column vector
// cv = tid % 8) loads rows 4 rg .. 4 rg + 3 of columns 8 cv .. 8 cv + 7 (a warp's load covers 4 row
// segments of 128 bytes); the column amaxes are reduced as in quantize_cols_kernel; each column's
// four quantized bytes go to shared memory as one word, transposed (column c's 32 words at c * 32,
// word w at w ^ (4 * (c / 8)): conflict-free word stores, 16-byte loads stay contiguous), and
// leave as 16-byte segments of the output rows (8 lanes per 128 bytes). out_rows is a multiple of
// 16, so a segment is wholly inside or past the end.
constexpr int kFp8ColsTColVecs = 8;
constexpr int kFp8ColsTRowsPerThread = kFp8Block * kFp8ColsTColVecs / kFp8QuantThreads;
constexpr u32 kFp8ColsTBlockCols = kFp8ColsTColVecs * kBf16PerVec;
static_assert(kFp8ColsTRowsPerThread == 4, "a thread's rows make one 32-bit word per column");

template <bool kGather>
__global__ void __launch_bounds__(kFp8QuantThreads)
quantize_cols_t_kernel(const __nv_bfloat16* __restrict__ x, const int* __restrict__ row_to_slot,
                       unsigned char* __restrict__ data, float* __restrict__ scale, u32 num_rows, u32 out_rows,
                       u32 cols, u32 top_k, u32 num_tokens) {
    constexpr int kWordsPerCol = kFp8Block / 4;
    __shared__ uint4 smem_amax[kFp8QuantWarps][kFp8ColsTColVecs];
    __shared__ __align__(16) u32 smem_t[kFp8ColsTBlockCols * kWordsPerCol];
    grid_dependency_wait();
    const u32 row_blocks = (out_rows + kFp8Block - 1) / kFp8Block;
    const u32 col_blocks = (cols + kFp8ColsTBlockCols - 1) / kFp8ColsTBlockCols;
    const u32 num_blocks = row_blocks * col_blocks;
    const u32 cv = threadIdx.x % kFp8ColsTColVecs;
    const u32 rg = threadIdx.x / kFp8ColsTColVecs;
    for (u32 block = blockIdx.x; block < num_blocks; block += gridDim.x) {
        const u32 rb = block / col_blocks;
        const u32 col0 = (block - rb * col_blocks) * kFp8ColsTBlockCols;
        const u32 col = col0 + cv * kBf16PerVec;
        const u32 row0 = rb * kFp8Block + rg * kFp8ColsTRowsPerThread;
        uint4 v[kFp8ColsTRowsPerThread];
#pragma unroll
        for (int i = 0; i < kFp8ColsTRowsPerThread; ++i) {
            const u32 row = row0 + i;
            v[i] = make_uint4(0, 0, 0, 0);
            if (col >= cols || row >= num_rows)
                continue;
            if constexpr (kGather) {
                const int slot = __ldg(row_to_slot + row);
                const u32 token = slot >= 0 ? static_cast<u32>(slot) / top_k : num_tokens;
                if (token < num_tokens)
                    v[i] = load_stream_v4(x + static_cast<i64>(token) * cols + col);
            } else {
                v[i] = load_stream_v4(x + static_cast<i64>(row) * cols + col);
            }
        }
        // The block's column maxima; its barrier also ends the previous block's reads of smem_amax
        // and smem_t.
        const uint4 m = block_column_amax<kFp8ColsTRowsPerThread, kFp8ColsTColVecs>(v, smem_amax, cv);
        // Column pair p: rows 0, 1 and rows 2, 3 as (lo, hi) byte pairs, regrouped by column.
        const u32 words[4] = {m.x, m.y, m.z, m.w};
        const u32 swizzled = rg ^ (4 * cv);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const Fp8Divisor d_lo = fp8_divisor(fp8_scale_of(words[p] & 0xffffu));
            const Fp8Divisor d_hi = fp8_divisor(fp8_scale_of(words[p] >> 16));
            u32 in[kFp8ColsTRowsPerThread];
#pragma unroll
            for (int i = 0; i < kFp8ColsTRowsPerThread; ++i)
                in[i] = p == 0 ? v[i].x : p == 1 ? v[i].y : p == 2 ? v[i].z : v[i].w;
            const u32 rows01 = quantize_bf16x2(in[0], d_lo, d_hi) | (quantize_bf16x2(in[1], d_lo, d_hi) << 16);
            const u32 rows23 = quantize_bf16x2(in[2], d_lo, d_hi) | (quantize_bf16x2(in[3], d_lo, d_hi) << 16);
            const u32 c = cv * kBf16PerVec + 2 * p;
            smem_t[c * kWordsPerCol + swizzled] = canonical_nan_bytes(__byte_perm(rows01, rows23, 0x6420));
            smem_t[(c + 1) * kWordsPerCol + swizzled] = canonical_nan_bytes(__byte_perm(rows01, rows23, 0x7531));
        }
        if (rg == 0) {
            // This thread's eight columns' scales (scale is [cols, row_blocks]).
            for (int k = 0; k < kBf16PerVec; ++k)
                if (col + k < cols)
                    scale[static_cast<i64>(col + k) * row_blocks + rb] =
                        fp8_scale_of(k % 2 ? words[k / 2] >> 16 : words[k / 2] & 0xffffu);
        }
        __syncthreads();
        constexpr int kSegments = kFp8Block / 16;  // 16-byte segments of an output row's 128 bytes
#pragma unroll
        for (int q = 0; q < kFp8ColsTBlockCols * kSegments / kFp8QuantThreads; ++q) {
            const u32 idx = threadIdx.x + q * kFp8QuantThreads;
            const u32 c = idx / kSegments, j = idx % kSegments;
            const u32 out_row = rb * kFp8Block + 16 * j;
            if (col0 + c < cols && out_row < out_rows) {
                const uint4 seg = *reinterpret_cast<const uint4*>(&smem_t[c * kWordsPerCol + 4 * (j ^ (c / 8))]);
                store_v4(data + static_cast<i64>(col0 + c) * out_rows + out_row, seg);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 128x128 blocks of expert weights, both K-major copies in one pass: w [E, N, K] bf16 (N and K multiples of
// 128) -> nk data [E, N, K] e4m3 with nk_scale [E, N/128, K/128], and its transpose kn data [E, K, N] with
// kn_scale [E, K/128, N/128] (a 128x128 block transposes exactly: the same bytes, the same scale), bit for
// bit recipes.fp8.quantize_weight_blocks and the transposed copies of Fp8ExpertWeights.from_bf16.
// One CTA step per block: thread (row group rg = tid / 16, column vector cv = tid % 16) loads rows
// 8 rg .. 8 rg + 7 of columns 8 cv .. 8 cv + 7 (a warp's load covers two rows of 256 bytes); the block's
// finite amax is reduced across the CTA; each row's eight bytes leave as one 8-byte store, and the
// thread's 8 x 8 bytes, transposed in registers, as eight 8-byte stores to the kn rows (16 threads write
// a kn row's 128 bytes; L2 merges their sectors).
constexpr int kFp8WeightColVecs = kFp8Block / kBf16PerVec;

// Byte j of each of four words, packed: bytes i = 0..3 of the result are byte j of words a, b, c, d.
__device__ __forceinline__ u32 gather_byte(u32 a, u32 b, u32 c, u32 d, u32 j) {
    const u32 pair = j | ((j + 4) << 4);
    return __byte_perm(__byte_perm(a, b, pair), __byte_perm(c, d, pair), 0x5410);
}

template <int kRowsPerThread>
__global__ void __launch_bounds__(kFp8QuantThreads)
quantize_weight_blocks_kernel(const __nv_bfloat16* __restrict__ w, unsigned char* __restrict__ nk,
                              float* __restrict__ nk_scale, unsigned char* __restrict__ kn,
                              float* __restrict__ kn_scale, u32 num_experts, u32 n, u32 k) {
    static_assert(kRowsPerThread == 8 && kFp8WeightColVecs * (kFp8Block / kRowsPerThread) == kFp8QuantThreads,
                  "one thread per 8 x 8 piece of a 128 x 128 block (the transpose packs 8 rows into 8 bytes)");
    __shared__ u32 smem_amax[kFp8QuantWarps];
    grid_dependency_wait();
    const u32 n_blocks = n / kFp8Block, k_blocks = k / kFp8Block;
    const u32 per_expert = n_blocks * k_blocks;
    const u32 num_blocks = num_experts * per_expert;
    const u32 cv = threadIdx.x % kFp8WeightColVecs;
    const u32 rg = threadIdx.x / kFp8WeightColVecs;
    const u32 warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    for (u32 block = blockIdx.x; block < num_blocks; block += gridDim.x) {
        const u32 e = block / per_expert;
        const u32 bn = (block - e * per_expert) / k_blocks;
        const u32 bk = block - e * per_expert - bn * k_blocks;
        const i64 row0 = static_cast<i64>(e) * n + bn * kFp8Block + rg * kRowsPerThread;
        const u32 col = bk * kFp8Block + cv * kBf16PerVec;
        uint4 v[kRowsPerThread];
        u32 m = 0;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            v[i] = load_stream_v4(w + (row0 + i) * k + col);
            m = __vmaxu2(m, finite_abs_max_bf16x8(v[i]));
        }
        m = max_of_halves(m);
#pragma unroll
        for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
            m = max(m, __shfl_xor_sync(kFullMask, m, offset));
        if (lane == 0)
            smem_amax[warp] = m;
        __syncthreads();
        u32 amax = smem_amax[0];
#pragma unroll
        for (int i = 1; i < kFp8QuantWarps; ++i)
            amax = max(amax, smem_amax[i]);
        const float scale = fp8_scale_of(amax);
        const Fp8Divisor d = fp8_divisor(scale);
        const Fp8Divisor ds[kBf16PerVec] = {d, d, d, d, d, d, d, d};
        uint2 q[kRowsPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            q[i] = quantize_bf16x8(v[i], ds);
            *reinterpret_cast<uint2*>(nk + (row0 + i) * k + col) = q[i];
        }
        // kn row bk * 128 + 8 cv + j holds this thread's column j, rows 8 rg .. 8 rg + 7 at column
        // bn * 128 + 8 rg.
        const i64 kn_row0 = static_cast<i64>(e) * k + col;
        const u32 kn_col = bn * kFp8Block + rg * kRowsPerThread;
#pragma unroll
        for (int j = 0; j < kBf16PerVec; ++j) {
            const u32 b = j % 4;
            const uint2 t = j < 4 ? make_uint2(gather_byte(q[0].x, q[1].x, q[2].x, q[3].x, b),
                                               gather_byte(q[4].x, q[5].x, q[6].x, q[7].x, b))
                                  : make_uint2(gather_byte(q[0].y, q[1].y, q[2].y, q[3].y, b),
                                               gather_byte(q[4].y, q[5].y, q[6].y, q[7].y, b));
            *reinterpret_cast<uint2*>(kn + (kn_row0 + j) * n + kn_col) = t;
        }
        if (threadIdx.x == 0) {
            nk_scale[(static_cast<i64>(e) * n_blocks + bn) * k_blocks + bk] = scale;
            kn_scale[(static_cast<i64>(e) * k_blocks + bk) * n_blocks + bn] = scale;
        }
        __syncthreads();  // smem_amax is the next block's
    }
}

}  // namespace dge
