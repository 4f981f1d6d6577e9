#pragma once

// SwiGLU on the L1 output h = [g | u] (bf16, one row per pool row), fp32 math:
//   act = silu(min(g, c)) * clamp(u, -c, c)        (c = +inf: plain SwiGLU)
// The backward also returns dweight = <da, act> per row (the top-k weight gradient) and
// act_w = w * act (the L2 wgrad operand), so h is read once for all three.
#include <common/utils.cuh>

namespace dge {

constexpr int kSwigluThreads = 256;

// NaN-propagating, like torch.clamp: a NaN input must not turn into the clamp bound.
__device__ __forceinline__ float clamp_max(float x, float c) { return x > c ? c : x; }
__device__ __forceinline__ float clamp_abs(float x, float c) { return x > c ? c : (x < -c ? -c : x); }
__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + __expf(-z)); }

// kClamp = false compiles the plain SwiGLU (c = +inf) without the clamp selects.
template <bool kClamp>
__device__ __forceinline__ float clamp_gate(float g, float c) { return kClamp ? clamp_max(g, c) : g; }
template <bool kClamp>
__device__ __forceinline__ float clamp_up(float u, float c) { return kClamp ? clamp_abs(u, c) : u; }

// One act element in fp32 (before its bf16 rounding); every forward kernel computes it with this,
// so all of them agree bit for bit.
template <bool kClamp>
__device__ __forceinline__ float swiglu_act(float g, float u, float c) {
    const float z = clamp_gate<kClamp>(g, c);
    return z * sigmoid(z) * clamp_up<kClamp>(u, c);
}

// One element of the weighted SwiGLU backward in fp32 (before the bf16 roundings): adds d * act to
// partial and gives dg, du (the gradient of w * d through act) and w * act. Every backward kernel
// computes it with this, so all of them agree bit for bit.
template <bool kClamp>
__device__ __forceinline__ void swiglu_backward_element(float g, float u, float d, float w, float c, float& partial,
                                                        float& dg, float& du, float& aw) {
    const float z = clamp_gate<kClamp>(g, c);
    const float s = sigmoid(z);
    const float silu = z * s;
    const float uc = clamp_up<kClamp>(u, c);
    const float a = silu * uc;
    partial += d * a;
    const float dw = w * d;
    // torch.clamp's gradient convention: the gradient passes at equality.
    const float dz = dw * uc * (s * (1.0f + z * (1.0f - s)));
    dg = !kClamp || g <= c ? dz : 0.0f;
    du = !kClamp || (u >= -c && u <= c) ? dw * silu : 0.0f;
    aw = w * a;
}

// Elementwise: a flat grid-stride loop over 16-byte vectors; (row, col) advance incrementally
// so the loop holds no 64-bit division.
template <bool kClamp>
__global__ void __launch_bounds__(kSwigluThreads)
swiglu_forward_kernel(const __nv_bfloat16* __restrict__ h, __nv_bfloat16* __restrict__ act, i64 num_rows,
                      int inter, float clamp) {
    grid_dependency_wait();
    const u32 vecs_per_row = static_cast<u32>(inter / kBf16PerVec);
    const u32 start = blockIdx.x * kSwigluThreads + threadIdx.x;
    const u32 stride = gridDim.x * kSwigluThreads;
    i64 row = start / vecs_per_row;
    u32 col = start % vecs_per_row;
    const i64 row_step = stride / vecs_per_row;
    const u32 col_step = stride % vecs_per_row;
    for (; row < num_rows; row += row_step) {
        const __nv_bfloat16* g_ptr = h + row * (2 * inter) + col * kBf16PerVec;
        float g[kBf16PerVec], u[kBf16PerVec], out[kBf16PerVec];
        unpack_bf16x8(load_stream_v4(g_ptr), g);
        unpack_bf16x8(load_stream_v4(g_ptr + inter), u);
#pragma unroll
        for (int i = 0; i < kBf16PerVec; ++i)
            out[i] = swiglu_act<kClamp>(g[i], u[i], clamp);
        store_v4(act + row * inter + col * kBf16PerVec, pack_bf16x8(out));
        col += col_step;
        if (col >= vecs_per_row) {
            col -= vecs_per_row;
            ++row;
        }
    }
}

// One warp per row (the dweight reduction stays inside the warp: fixed order, deterministic);
// warps stride over rows.
template <bool kClamp>
__global__ void __launch_bounds__(kSwigluThreads)
swiglu_backward_kernel(const __nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ da,
                       const float* __restrict__ row_weight, __nv_bfloat16* __restrict__ dh,
                       float* __restrict__ dweight, __nv_bfloat16* __restrict__ act_w, i64 num_rows, int inter,
                       float clamp) {
    grid_dependency_wait();
    const int vecs_per_row = inter / kBf16PerVec;
    const int lane = lane_id();
    const i64 num_warps = static_cast<i64>(gridDim.x) * (kSwigluThreads / kWarpSize);
    for (i64 row = static_cast<i64>(blockIdx.x) * (kSwigluThreads / kWarpSize) + warp_id(); row < num_rows;
         row += num_warps) {
        const float w = row_weight[row];
        const __nv_bfloat16* h_row = h + row * (2 * inter);
        const __nv_bfloat16* da_row = da + row * inter;
        float partial = 0.0f;
#pragma unroll 2
        for (int v = lane; v < vecs_per_row; v += kWarpSize) {
            const int col = v * kBf16PerVec;
            float g[kBf16PerVec], u[kBf16PerVec], d[kBf16PerVec];
            float dg[kBf16PerVec], du[kBf16PerVec], aw[kBf16PerVec];
            unpack_bf16x8(load_stream_v4(h_row + col), g);
            unpack_bf16x8(load_stream_v4(h_row + inter + col), u);
            unpack_bf16x8(load_stream_v4(da_row + col), d);
#pragma unroll
            for (int i = 0; i < kBf16PerVec; ++i)
                swiglu_backward_element<kClamp>(g[i], u[i], d[i], w, clamp, partial, dg[i], du[i], aw[i]);
            store_v4(dh + row * (2 * inter) + col, pack_bf16x8(dg));
            store_v4(dh + row * (2 * inter) + inter + col, pack_bf16x8(du));
            store_v4(act_w + row * inter + col, pack_bf16x8(aw));
        }
        partial = warp_sum(partial);
        if (lane == 0)
            dweight[row] = partial;
    }
}

}  // namespace dge
