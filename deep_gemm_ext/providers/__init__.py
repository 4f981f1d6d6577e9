"""GEMM providers: the grouped GEMMs of the layer behind one interface (:mod:`.base`).

    "sm90"        our SM90 kernels (deep_gemm_ext.jit_kernels): gathering prologue, every epilogue
    "grouped_mm"  torch._grouped_mm (SM90+ bf16)
    "loop"        one matmul per expert in fp32 / fp64: the CPU reference path
    "deep_gemm"   upstream DeepGEMM's grouped GEMMs (bf16, fp8), when it is installed
"""
from .base import Fp8Cols, Fp8Rows, GemmProvider, Gather, ScatterSlots
from .deepgemm import DeepGemmProvider
from .sm90 import Sm90Provider
from .torch_ops import GroupedMmProvider, LoopProvider

PROVIDERS: dict[str, GemmProvider] = {
    "sm90": Sm90Provider(),
    "grouped_mm": GroupedMmProvider(),
    "loop": LoopProvider(),
    "deep_gemm": DeepGemmProvider(),
}

__all__ = ["PROVIDERS", "Fp8Cols", "Fp8Rows", "GemmProvider", "Gather", "ScatterSlots"]
