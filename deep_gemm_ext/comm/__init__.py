"""Token exchange: how tokens reach the experts that own them, and results come back.

An exchange has four pieces the layer calls (design.md §5); none of them is differentiated by
autograd, the layer's backward calls the adjoints itself:

    dispatch(x, topk_idx, topk_weights) -> (x_r, idx_r, w_r, handle)   tokens to their experts' ranks
    combine(y_r, handle) -> y                                           partial results back, summed
    combine_backward(dy, handle) -> dy_r                                the adjoint of combine
    dispatch_backward(dx_r, dw_r, handle) -> (dx, d topk_weights)       the adjoint of dispatch

``handle`` is a list of tensors (saved for the backward like any other tensor of the layer).
``"local"``: every expert is on this rank; the pieces are the identity.
"""
from __future__ import annotations

import torch


class LocalExchange:
    """All experts on this rank: tokens stay where they are."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        return x, topk_idx, topk_weights, []

    def combine(self, y_r: torch.Tensor, handle: list) -> torch.Tensor:
        return y_r

    def combine_backward(self, dy: torch.Tensor, handle: list) -> torch.Tensor:
        return dy

    def dispatch_backward(self, dx_r: torch.Tensor, dw_r: torch.Tensor, handle: list):
        return dx_r, dw_r


EXCHANGES = {"local": LocalExchange()}

__all__ = ["EXCHANGES", "LocalExchange"]
