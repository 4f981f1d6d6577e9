"""Grouped GEMMs in torch: ``torch._grouped_mm`` (SM90+ bf16) and a loop over experts (anywhere)."""
from __future__ import annotations

import torch

from ..routing import RoutingMeta
from .base import GemmProvider


class GroupedMmProvider(GemmProvider):
    """``torch._grouped_mm``: groups end at ``meta.ends`` (16-row aligned for its k-grouped starts)."""

    row_alignment = 16

    def supports(self, recipe, epilogue, facts):
        return False

    def m_grouped(self, a, w, meta: RoutingMeta, layout, *, recipe, gather=None, epilogue=None, zero_unowned=False):
        out = torch._grouped_mm(a, w.transpose(1, 2) if layout == "nt" else w, offs=meta.ends)
        if zero_unowned:
            owned = torch.arange(out.shape[0], device=out.device) < meta.ends[-1:]
            out = torch.where(owned[:, None], out, 0)
        return out

    def k_grouped(self, a, b, meta: RoutingMeta, *, recipe, gather_a=None, gather_b=None):
        # Empty groups come out as zeros on SM90 (k-grouped with K = 0).
        return torch._grouped_mm(a.t(), b, offs=meta.ends)


class LoopProvider(GemmProvider):
    """One matmul per expert, in fp32 (fp64 for fp64 inputs): the CPU reference path. Reads the
    expert ranges on the host."""

    row_alignment = 1

    def compute_dtype(self, x_dtype):
        return torch.float64 if x_dtype == torch.float64 else torch.float32

    def m_grouped(self, a, w, meta: RoutingMeta, layout, *, recipe, gather=None, epilogue=None, zero_unowned=False):
        b_kn = w.transpose(1, 2) if layout == "nt" else w
        out = a.new_zeros(a.shape[0], b_kn.shape[2])
        for e, (start, end) in enumerate(zip(meta.starts.tolist(), meta.ends.tolist())):
            if end > start:
                out[start:end] = a[start:end] @ b_kn[e].to(a.dtype)
        return out

    def k_grouped(self, a, b, meta: RoutingMeta, *, recipe, gather_a=None, gather_b=None):
        out = a.new_zeros(meta.num_experts, a.shape[1], b.shape[1])
        for e, (start, end) in enumerate(zip(meta.starts.tolist(), meta.ends.tolist())):
            if end > start:
                out[e] = a[start:end].t() @ b[start:end]
        return out
