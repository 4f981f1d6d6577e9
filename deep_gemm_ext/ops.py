"""``torch.library`` custom ops for the MoE layer, with fake impls and a registered autograd.

``deep_gemm_ext::mega_moe_fwd`` returns ``y`` plus what backward needs (the dispatched pool of x,
or an empty placeholder where the L1 GEMM gathers x itself, the L1 output h, the routing metadata); ``deep_gemm_ext::mega_moe_bwd`` turns them into the four
gradients. Both are opaque to ``torch.compile`` (one node each) and free of host syncs on the GPU
path, so they can be captured in CUDA graphs.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import unfused
from .routing import RoutingMeta, pool_rows
from .validation import check_alignment, check_expert_ids

_LIB = "deep_gemm_ext"


def _engine(x: torch.Tensor, l1_weights: torch.Tensor, backend: str) -> str:
    num_experts, two_i, hidden = l1_weights.shape
    return unfused.gemm_engine(x, hidden, two_i // 2, backend, num_experts)


@torch.library.custom_op(f"{_LIB}::mega_moe_fwd", mutates_args=())
def mega_moe_fwd(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: torch.Tensor,
    l2_weights: torch.Tensor,
    activation_clamp: Optional[float],
    backend: str,
    recipe: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    num_experts = l1_weights.shape[0]
    check_alignment(x=x, topk_idx=topk_idx, topk_weights=topk_weights, l1_weights=l1_weights,
                    l2_weights=l2_weights)
    check_expert_ids(topk_idx, num_experts)
    y, x_pool, h, meta = unfused.moe_forward(x, topk_idx, topk_weights, l1_weights, l2_weights,
                                             activation_clamp, _engine(x, l1_weights, backend), recipe)
    return (y, x_pool, h, *meta.tensors())


@mega_moe_fwd.register_fake
def _(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, backend, recipe):
    num_tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    num_experts, two_i, _ = l1_weights.shape
    engine = _engine(x, l1_weights, backend)
    rows = pool_rows(num_tokens * top_k, num_experts, unfused.ROUTING_ALIGN[engine])
    cdt = unfused.compute_dtype(x, engine)
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty(num_tokens, hidden),
        x.new_empty(0 if unfused.fused_gather(engine) else rows, hidden, dtype=cdt),
        x.new_empty(rows, two_i, dtype=cdt),
        torch.empty(num_experts, **i32),
        torch.empty(num_experts, **i32),
        torch.empty(num_experts, **i32),
        torch.empty(num_tokens * top_k, **i32),
        torch.empty(rows, **i32),
    )


@torch.library.custom_op(f"{_LIB}::mega_moe_bwd", mutates_args=())
def mega_moe_bwd(
    dy: torch.Tensor,
    x_pool: torch.Tensor,
    h: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: torch.Tensor,
    l2_weights: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    slot_to_row: torch.Tensor,
    row_to_slot: torch.Tensor,
    activation_clamp: Optional[float],
    backend: str,
    recipe: str,
    x_pool_is_x: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    top_k = topk_weights.shape[1]
    engine = _engine(dy, l1_weights, backend)
    meta = RoutingMeta(counts, starts, ends, slot_to_row, row_to_slot, num_experts=l1_weights.shape[0],
                       top_k=top_k, align=unfused.ROUTING_ALIGN[engine])
    return unfused.moe_backward(dy.contiguous(), x_pool, h, meta, topk_weights, l1_weights, l2_weights,
                                activation_clamp, engine, recipe, x_pool_is_x)


@mega_moe_bwd.register_fake
def _(dy, x_pool, h, topk_weights, l1_weights, l2_weights, counts, starts, ends, slot_to_row,
      row_to_slot, activation_clamp, backend, recipe, x_pool_is_x):
    return (torch.empty_like(dy), torch.empty_like(topk_weights), torch.empty_like(l1_weights),
            torch.empty_like(l2_weights))


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, backend, recipe = inputs
    _, x_pool, h, *meta = output
    ctx.mark_non_differentiable(x_pool, h, *meta)
    # The saved pool, h and metadata get no gradient: do not let autograd fill zeros for them
    # (two [P, H]-sized memsets per backward).
    ctx.set_materialize_grads(False)
    ctx.activation_clamp = activation_clamp
    ctx.backend = backend
    ctx.recipe = recipe
    # Where the L1 GEMM gathered x itself there is no pool: x is saved (the caller holds it anyway)
    # and the backward gathers the pool for dW1.
    ctx.x_pool_is_x = unfused.fused_gather(_engine(x, l1_weights, backend))
    ctx.save_for_backward(x if ctx.x_pool_is_x else x_pool, h, topk_weights, l1_weights, l2_weights, *meta)


def _backward(ctx, dy, *unused_grads):
    if dy is None:
        return (None,) * 8
    x_pool, h, topk_weights, l1_weights, l2_weights, *meta = ctx.saved_tensors
    dx, d_topk, d_l1, d_l2 = torch.ops.deep_gemm_ext.mega_moe_bwd(
        dy, x_pool, h, topk_weights, l1_weights, l2_weights, *meta, ctx.activation_clamp, ctx.backend,
        ctx.recipe, ctx.x_pool_is_x)
    return dx, None, d_topk, d_l1, d_l2, None, None, None


mega_moe_fwd.register_autograd(_backward, setup_context=_setup_context)
