"""Grouped GEMMs in torch: ``torch._grouped_mm`` (SM90+ bf16) and a loop over experts (anywhere).

Both run the fp8 recipe as its torch emulation (deep_gemm_ext.recipes.fp8: the operands quantized
as the kernels quantize them, dequantized, fp32 matmuls per expert).
"""
from __future__ import annotations

import torch

from ..recipes import fp8
from ..routing import RoutingMeta
from .base import GemmProvider


class GroupedMmProvider(GemmProvider):
    """``torch._grouped_mm``: groups end at ``meta.ends`` (16-row aligned for its k-grouped starts)."""

    row_alignment = 16
    recipes = ("bf16", "fp8")

    def supports(self, recipe, epilogue):
        return False

    def m_grouped(self, a, w, meta: RoutingMeta, layout, *, recipe, gather=None, epilogue=None, zero_unowned=False):
        if recipe.fp8:
            return fp8.emulated_m_grouped(a, w, meta.starts, meta.ends, layout)
        out = torch._grouped_mm(a, w.transpose(1, 2) if layout == "nt" else w, offs=meta.ends)
        if zero_unowned:
            owned = torch.arange(out.shape[0], device=out.device) < meta.ends[-1:]
            out = torch.where(owned[:, None], out, 0)
        return out

    def k_grouped(self, a, b, meta: RoutingMeta, *, recipe, gather_a=None, gather_b=None):
        if recipe.fp8:
            return fp8.emulated_k_grouped(a, b, meta.starts, meta.ends, recipe.fp8_wgrad)
        # Empty groups come out as zeros on SM90 (k-grouped with K = 0).
        return torch._grouped_mm(a.t(), b, offs=meta.ends)


class LoopProvider(GemmProvider):
    """One matmul per expert, in fp32 (fp64 for fp64 inputs): the CPU reference path. Reads the
    expert ranges on the host."""

    row_alignment = 1
    recipes = ("bf16", "fp8")

    def compute_dtype(self, x_dtype):
        return torch.float64 if x_dtype == torch.float64 else torch.float32

    def m_grouped(self, a, w, meta: RoutingMeta, layout, *, recipe, gather=None, epilogue=None, zero_unowned=False):
        if recipe.fp8:
            return fp8.emulated_m_grouped(a, w, meta.starts, meta.ends, layout)
        b_kn = w.transpose(1, 2) if layout == "nt" else w
        out = a.new_zeros(a.shape[0], b_kn.shape[2])
        for e, (start, end) in enumerate(zip(meta.starts.tolist(), meta.ends.tolist())):
            if end > start:
                out[start:end] = a[start:end] @ b_kn[e].to(a.dtype)
        return out

    def k_grouped(self, a, b, meta: RoutingMeta, *, recipe, gather_a=None, gather_b=None):
        if recipe.fp8:
            return fp8.emulated_k_grouped(a, b, meta.starts, meta.ends, recipe.fp8_wgrad)
        out = a.new_zeros(meta.num_experts, a.shape[1], b.shape[1])
        for e, (start, end) in enumerate(zip(meta.starts.tolist(), meta.ends.tolist())):
            if end > start:
                out[e] = a[start:end].t() @ b[start:end]
        return out
