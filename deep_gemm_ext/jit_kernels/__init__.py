"""Host side of the JIT kernels: input checks, template rendering and launches, one module per
kernel family (named like the header it instantiates). Each module registers its configurations
with ``@jit.register`` for ``python -m deep_gemm_ext.jit build --all``."""
import functools

import torch

from ..jit import select_compiler
from .fp8_quant import (quantize_cols_fp8, quantize_cols_transposed_fp8, quantize_pool_rows_fp8, quantize_rows_fp8,
                        swiglu_backward_fp8, swiglu_backward_fp8_t, swiglu_forward_fp8)
from .gather_combine import MAX_TOP_K, combine_rows, combine_slots, gather_rows, take_or_zero, zero_rows_past
from .routing import routing_metadata
from .sm90_bf16_grouped_gemm import (GATHER_MODES, AwaitRows, Gather, Scatter, k_grouped_bf16_gemm_tn_contiguous,
                                     m_grouped_bf16_gemm_nn_contiguous, m_grouped_bf16_gemm_nt_contiguous)
from .sm90_fp8_grouped_gemm import k_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_contiguous
from .swiglu import swiglu_backward, swiglu_forward


@functools.lru_cache(maxsize=None)
def available(device_index: int) -> bool:
    """True when the kernels can run on this device: an SM90 GPU (they are built for sm_90a) and a
    CUDA compiler (nvcc or NVRTC) to build them."""
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    try:
        select_compiler()
    except RuntimeError:
        return False
    return True


__all__ = ["AwaitRows", "GATHER_MODES", "Gather", "MAX_TOP_K", "Scatter", "available", "combine_rows", "combine_slots",
           "gather_rows",
           "k_grouped_bf16_gemm_tn_contiguous", "k_grouped_fp8_gemm_nt_contiguous",
           "m_grouped_bf16_gemm_nn_contiguous", "m_grouped_bf16_gemm_nt_contiguous",
           "m_grouped_fp8_gemm_nt_contiguous", "quantize_cols_fp8", "quantize_cols_transposed_fp8", "quantize_pool_rows_fp8",
           "quantize_rows_fp8",
           "routing_metadata", "swiglu_backward", "swiglu_backward_fp8", "swiglu_backward_fp8_t", "swiglu_forward",
           "swiglu_forward_fp8", "take_or_zero", "zero_rows_past"]
