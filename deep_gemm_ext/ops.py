"""``torch.library`` custom ops for the MoE layer, with fake impls and a registered autograd.

``deep_gemm_ext::mega_moe_fwd`` returns ``y`` and the tensors it made for the backward (a list:
the pool or nothing where the L1 GEMM gathers x, h, the routing metadata, the exchange's handle);
``deep_gemm_ext::mega_moe_bwd`` takes the saved list and returns the four gradients. Both take the
call's plan as a string (deep_gemm_ext.plan), so adding a saved tensor or a plan field changes no
schema. Both are opaque to ``torch.compile`` (one node each) and free of host syncs on the GPU path
(but the optional id check), so they can be captured in CUDA graphs.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import layer
from .plan import Plan
from .validation import check_alignment, check_expert_ids

_LIB = "deep_gemm_ext"


@torch.library.custom_op(f"{_LIB}::mega_moe_fwd", mutates_args=())
def mega_moe_fwd(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: torch.Tensor,
    l2_weights: torch.Tensor,
    activation_clamp: Optional[float],
    plan: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    p = Plan.decode(plan)
    check_alignment(x=x, topk_idx=topk_idx, topk_weights=topk_weights, l1_weights=l1_weights,
                    l2_weights=l2_weights)
    check_expert_ids(topk_idx, p.tokens.num_experts(l1_weights.shape[0]), host_check=p.check_ids)
    y, saved = layer.forward(p, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp)
    return y, layer.produced_of(p, saved)


@mega_moe_fwd.register_fake
def _(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, plan):
    return x.new_empty(x.shape), layer.produced_like(Plan.decode(plan), x, topk_idx, topk_weights, l1_weights)


@torch.library.custom_op(f"{_LIB}::mega_moe_bwd", mutates_args=())
def mega_moe_bwd(
    dy: torch.Tensor,
    saved: list[torch.Tensor],
    activation_clamp: Optional[float],
    plan: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.backward(Plan.decode(plan), dy.contiguous(), list(saved), activation_clamp)


@mega_moe_bwd.register_fake
def _(dy, saved, activation_clamp, plan):
    _, w_rows, l1_weights, l2_weights, *_ = saved  # w_rows: the dispatched weights, [R, K]
    # dx is computed from dy.contiguous(): contiguous whatever dy's strides.
    return (dy.new_empty(dy.shape), w_rows.new_empty(dy.shape[0], w_rows.shape[1]), torch.empty_like(l1_weights),
            torch.empty_like(l2_weights))


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, plan = inputs
    _, produced = output
    ctx.mark_non_differentiable(*produced)
    # The saved tensors get no gradient: do not let autograd fill zeros for them (two [P, H]-sized
    # memsets per backward).
    ctx.set_materialize_grads(False)
    ctx.activation_clamp = activation_clamp
    ctx.plan = plan
    ctx.save_for_backward(*layer.saved_of(Plan.decode(plan), x, topk_weights, l1_weights, l2_weights, produced))


def _backward(ctx, dy, *unused_grads):
    if dy is None:
        return (None,) * 7
    dx, d_topk, d_l1, d_l2 = torch.ops.deep_gemm_ext.mega_moe_bwd(dy, list(ctx.saved_tensors), ctx.activation_clamp,
                                                                  ctx.plan)
    return dx, None, d_topk, d_l1, d_l2, None, None


mega_moe_fwd.register_autograd(_backward, setup_context=_setup_context)
