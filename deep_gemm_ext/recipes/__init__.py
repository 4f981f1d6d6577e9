"""Precision recipes: how each GEMM's operands are represented.

    "bf16"  bf16 operands, fp32 accumulation
    "fp8"   blockwise fp8 (the DeepSeek-V3 recipe): e4m3 data with fp32 scales, 1x128 tiles along K
            for activations and gradients, 128x128 blocks for weights; run by the deep_gemm provider,
            which quantizes the operands of each GEMM
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Recipe:
    name: str
    #: Operands are blockwise fp8 (data, scale) pairs.
    fp8: bool = False

    def expert_weights(self, w: torch.Tensor, compute_dtype: torch.dtype):
        """The expert weights as the GEMMs of this recipe take them."""
        return w.to(compute_dtype)


BF16 = Recipe("bf16")
FP8 = Recipe("fp8", fp8=True)

RECIPES: dict[str, Recipe] = {r.name: r for r in (BF16, FP8)}

__all__ = ["BF16", "FP8", "RECIPES", "Recipe"]
