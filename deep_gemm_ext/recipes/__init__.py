"""Precision recipes: how each GEMM's operands are represented.

    "bf16"  bf16 operands, fp32 accumulation
    "fp8"   blockwise fp8 (the DeepSeek-V3 recipe, :mod:`.fp8`): e4m3 data with fp32 scales, 1x128
            tiles along K for activations and gradients, 128x128 blocks for weights (quantized once
            per weight version, :data:`.fp8.WEIGHT_CACHE`); weight-gradient operands 128x1 along
            the tokens, or bf16 (``fp8_wgrad``). Run by the deep_gemm provider, or emulated in torch
            (dequantize, fp32 math) by the torch providers
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import FP8_BLOCK, WEIGHT_CACHE


@dataclass(frozen=True)
class Recipe:
    name: str
    #: Operands are blockwise fp8 (data, scale) pairs.
    fp8: bool = False
    #: Rows per expert group the operands need: fp8 weight-gradient operands are quantized in tiles
    #: of 128 pool rows, and a tile must not span two experts.
    row_alignment: int = 1
    #: fp8: weight-gradient operands column-quantized (True) or rounded to bf16 (False).
    fp8_wgrad: bool = True

    def expert_weights(self, w: torch.Tensor, compute_dtype: torch.dtype):
        """The expert weights as the GEMMs of this recipe take them: fp8 ones are
        :class:`.fp8.Fp8ExpertWeights` from the weight cache."""
        return WEIGHT_CACHE.get(w) if self.fp8 else w.to(compute_dtype)


BF16 = Recipe("bf16")
FP8 = Recipe("fp8", fp8=True, row_alignment=FP8_BLOCK)

RECIPES: dict[str, Recipe] = {r.name: r for r in (BF16, FP8)}

__all__ = ["BF16", "FP8", "RECIPES", "Recipe"]
