#pragma once

// Small device helpers shared by the elementwise / routing kernels. No <cstdint>: the same
// sources must compile under NVRTC, which ships no C++ standard library.
#include <cuda_bf16.h>

namespace dge {

using u32 = unsigned int;
using i64 = long long;
using u64 = unsigned long long;

constexpr int kWarpSize = 32;
constexpr u32 kFullMask = 0xffffffffu;

// 16 bytes = 8 bf16: the unit of every vectorised global load / store.
constexpr int kBf16PerVec = 8;

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }

__device__ __forceinline__ u32 lanemask_lt() {
    u32 mask;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
    return mask;
}

// Under programmatic dependent launch, wait for the previous kernel's writes before reading them;
// a no-op when the kernel was launched without the attribute.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Read-only, not reused by this kernel: keep it out of L1.
__device__ __forceinline__ uint4 load_stream_v4(const void* ptr) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ void store_v4(void* ptr, const uint4& v) { *reinterpret_cast<uint4*>(ptr) = v; }

// Written once and not read again by this kernel: st.global.cs (evict-first in L1 and L2), so a
// stream of such stores does not push out lines the kernel reads again (a gather's source rows).
__device__ __forceinline__ void store_stream_v4(void* ptr, const uint4& v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&out)[kBf16PerVec]) {
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
        out[2 * i] = pair.x;
        out[2 * i + 1] = pair.y;
    }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&in)[kBf16PerVec]) {
    u32 words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
        words[i] = *reinterpret_cast<const u32*>(&pair);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
}

// Butterfly sum: every lane gets the total, in an order fixed by the lane layout (deterministic).
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
        value += __shfl_xor_sync(kFullMask, value, offset);
    return value;
}

__device__ __forceinline__ int warp_inclusive_scan(int value) {
    const int lane = lane_id();
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
        const int other = __shfl_up_sync(kFullMask, value, offset);
        if (lane >= offset)
            value += other;
    }
    return value;
}

}  // namespace dge
