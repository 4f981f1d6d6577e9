#pragma once
// d_row_weight of the fused L2 dgrad (epilogue/sm90_swiglu.cuh, EpilogueSwigluBackward): the sum of
// the per-tile partials <da', act> of each pool row, in column-tile order.

#include <cstdint>

#include <scheduler/sm90_grouped.cuh>

namespace dge::gemm {

// d_row_weight[r] = partials[r, 0] + partials[r, 1] + ... (in that order) for the pool rows an expert
// owns, 0 for the others (whose partials no tile wrote). A template so that only the source that
// instantiates it emits it (each JIT source holds exactly one kernel).
template <uint32_t kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
swiglu_row_weight_grad_kernel(const float* __restrict__ partials, const int* __restrict__ starts,
                              const int* __restrict__ ends, uint32_t num_experts, uint32_t num_rows,
                              uint32_t num_parts, float* __restrict__ d_row_weight) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (uint32_t row = blockIdx.x * blockDim.x + threadIdx.x; row < num_rows; row += gridDim.x * blockDim.x) {
        float sum = 0.0f;
        if (sched::owning_expert(starts, ends, num_experts, row) < num_experts) {
            for (uint32_t j = 0; j < num_parts; ++j)
                sum += partials[static_cast<uint64_t>(row) * num_parts + j];
        }
        d_row_weight[row] = sum;
    }
}

}  // namespace dge::gemm
