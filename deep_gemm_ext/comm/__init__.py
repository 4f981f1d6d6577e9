"""Token exchange: how tokens reach the experts that own them, and results come back.

An exchange has four pieces the layer calls (README, "Expert parallelism"); none of them is differentiated by
autograd, the layer's backward calls the adjoints itself:

    dispatch(x, topk_idx, topk_weights) -> (x_r, idx_r, w_r, handle)   tokens to their experts' ranks
    combine(y_r, handle) -> y                                           partial results back, summed
    combine_backward(dy, handle) -> dy_r                                the adjoint of combine
    dispatch_backward(dx_r, dw_r, handle) -> (dx, d topk_weights)       the adjoint of dispatch

``handle`` is a list of tensors (saved for the backward like any other tensor of the layer).
A plan names its exchange by a string (:func:`exchange`):

- ``"local"``: every expert is on this rank; the pieces are the identity.
- ``"all_to_all:<group name>:<E_loc>:<max_tokens_per_rank>:<rows>"``: expert parallelism over a
  torch.distributed group (:mod:`deep_gemm_ext.comm.all_to_all`); dispatch sends x's rows in x's
  dtype (``rows`` "x") or in the fp8 recipe's e4m3 with 1x128 scales ("fp8").
- ``"symmetric:<buffer id>:<E_loc>:<max_tokens_per_rank>:<rows>"``: expert parallelism over NVLink
  symmetric memory, moved by our CUDA kernels (:mod:`deep_gemm_ext.comm.symmetric`); the buffer
  (a live SymmetricEpBuffer, by id) names the group; the same received layout and the same bits
  as the all-to-all.

Besides the four pieces an exchange tells the layer the sizes it produces (for the custom ops'
fake implementations): ``received_rows(T)``, ``handle_like(x, topk_idx)`` and
``num_experts(E_loc)``, the range of the ids in ``topk_idx``.
"""
from __future__ import annotations

import torch

from .all_to_all import exchange_from_name
from .symmetric import exchange_from_spec


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

    def received_rows(self, num_tokens: int) -> int:
        return num_tokens

    def handle_like(self, x: torch.Tensor, topk_idx: torch.Tensor) -> list[torch.Tensor]:
        return []

    def num_experts(self, num_local_experts: int) -> int:
        return num_local_experts


_LOCAL = LocalExchange()


def exchange(spec: str):
    """The exchange a plan names (see the module docstring)."""
    if spec == "local":
        return _LOCAL
    kind, _, args = spec.partition(":")
    if kind == "all_to_all":
        parts = args.rsplit(":", 3)
        if len(parts) == 4 and parts[3] in ("x", "fp8"):
            group_name, num_local, capacity, rows = parts
            return exchange_from_name(group_name, int(num_local), int(capacity), rows == "fp8")
    if kind == "symmetric":
        parts = args.split(":")
        if len(parts) == 4 and parts[3] in ("x", "fp8") and all(p.isdigit() for p in parts[:3]):
            buffer_id, num_local, capacity, rows = parts
            return exchange_from_spec(int(buffer_id), int(num_local), int(capacity), rows == "fp8")
    raise ValueError(f"exchange {spec!r}: expected 'local' or 'all_to_all:<group>:<E_loc>:<capacity>:<x|fp8>' "
                     f"or 'symmetric:<buffer id>:<E_loc>:<capacity>:<x|fp8>'")


__all__ = ["LocalExchange", "exchange"]
