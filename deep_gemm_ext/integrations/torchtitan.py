"""A torchtitan ``GroupedExperts`` whose forward is :func:`deep_gemm_ext.mega_moe_train`.

``MegaGroupedExperts`` has torchtitan's parameters, by name and shape: ``w1 [E, I, H]`` (gate),
``w2 [E, H, I]`` (down), ``w3 [E, I, H]`` (up), so torchtitan checkpoints, FSDP2 / TP plans keyed by
those names and ``init_weights(init_std)`` work unchanged. Its forward takes the router's output
instead of tokens already sorted by expert: the token reorder, the gather and the scatter-add of
torchtitan's ``MoE.forward`` happen inside ``mega_moe_train``. ``l1_weights = cat(w1, w3)`` is built
on every call (a copy of the gate and up weights; README, "torchtitan").
"""
from __future__ import annotations

import torch
from torch import nn

from ..module import _positive_int, autocast_enabled, check_routed_inputs, experts_forward, local_tensor, trunc_normal_fp32_
from ..validation import validate_inputs


class MegaGroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts(dim, hidden_dim, num_experts)`` computed by our layer.

    ``forward(x [..., dim], topk_idx [..., K], topk_scores [..., K])`` returns the routed experts'
    output for each token (torchtitan adds the shared experts' output itself). With
    ``score_before_experts=True`` (torchtitan's default) each slot's expert sees its token scaled
    by the score, rounded to ``x``'s dtype as torchtitan does: ``y = sum_k expert_k(s_k * x)``; the layer
    then runs with one slot per (token, k) pair and unit weights, over a ``[T*K, dim]`` copy of
    the scaled tokens. With ``False`` the scores weight the outputs: ``y = sum_k s_k * expert_k(x)``,
    ``mega_moe_train``'s own contract, with no extra copy of the tokens.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, score_before_experts: bool = True, *,
                 activation_clamp: float | None = None, backend: str = "auto", device=None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        dim, hidden_dim, num_experts = (_positive_int(name, value) for name, value in (
            ("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts)))
        if not isinstance(score_before_experts, bool):
            raise TypeError(f"score_before_experts must be a bool, got {type(score_before_experts).__name__}")

        # An fp64 module computes in fp64 (its clamp may exceed fp32's range); the rest as bf16 calls do.
        float_dtype = torch.float64 if dtype == torch.float64 else torch.bfloat16

        def meta(*shape, dtype=float_dtype):
            return torch.empty(shape, device="meta", dtype=dtype)

        # mega_moe_train's checks of the options, once, here rather than at the first forward.
        validate_inputs(meta(0, dim), meta(0, 1, dtype=torch.int64), meta(0, 1, dtype=torch.float32),
                        meta(num_experts, 2 * hidden_dim, dim), meta(num_experts, dim, hidden_dim),
                        activation_clamp=activation_clamp, backend=backend)
        self.num_experts = num_experts
        self.score_before_experts = score_before_experts
        self.activation_clamp = None if activation_clamp is None else float(activation_clamp)
        self.backend = backend
        factory = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **factory))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))

    def init_weights(self, init_std: float) -> None:
        """torchtitan's ``GroupedExperts.init_weights``: truncated normals, std 0.02 for ``w1`` and
        ``init_std`` for ``w2`` and ``w3``; also on FSDP2-sharded (DTensor) parameters."""
        for param, std in ((self.w1, 0.02), (self.w2, init_std), (self.w3, init_std)):
            trunc_normal_fp32_(local_tensor(param), std)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_scores: torch.Tensor) -> torch.Tensor:
        check_routed_inputs(x, topk_idx, topk_scores, "topk_scores")
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        l1 = torch.cat((w1, w3), dim=1)
        options = dict(activation_clamp=self.activation_clamp, backend=self.backend)
        inputs = x if autocast_enabled(x.device.type) else x.to(l1.dtype)
        if not self.score_before_experts:
            return experts_forward(inputs, topk_idx, topk_scores, l1, w2, checked=True, **options).to(x.dtype)
        top_k, hidden = topk_idx.shape[-1], x.shape[-1]
        flat = inputs.reshape(-1, 1, hidden)
        acc = torch.promote_types(flat.dtype, torch.float32)  # torchtitan scales in fp32
        scaled = (flat.to(acc) * topk_scores.reshape(-1, top_k, 1).to(acc)).to(flat.dtype)
        slot_idx = topk_idx.reshape(-1, 1)
        ones = torch.ones(slot_idx.shape, device=x.device, dtype=torch.float32)
        per_slot = experts_forward(scaled.reshape(-1, hidden), slot_idx, ones, l1, w2, checked=True, **options)
        y = per_slot.view(-1, top_k, hidden).to(acc).sum(dim=1)
        return y.to(x.dtype).view(x.shape)

    def extra_repr(self) -> str:
        num_experts, hidden_dim, dim = self.w1.shape
        parts = [f"dim={dim}, hidden_dim={hidden_dim}, num_experts={num_experts}",
                 f"score_before_experts={self.score_before_experts}"]
        if self.activation_clamp is not None:
            parts.append(f"activation_clamp={self.activation_clamp}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)
