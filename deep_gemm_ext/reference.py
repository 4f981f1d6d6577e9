"""The MoE layer's contract (README, "The contract") in plain torch: the one place where the math is written out.

Everything here is differentiable with ordinary autograd and runs on any device and dtype; tests
run it in float64 on upcast inputs as the ground truth for every implementation.

For every token ``t`` and slot ``k`` with ``e = topk_idx[t, k] >= 0``::

    h    = l1_weights[e] @ x[t]                 # [2I], rows [0, I) gate, [I, 2I) up
    act  = silu(min(g, c)) * clamp(u, -c, c)    # c = activation_clamp, or +inf
    o    = l2_weights[e] @ act                  # [H]
    y[t] = sum_k topk_weights[t, k] * o

Expert parallelism: rank ``r`` of ``W`` owns experts ``[r * E_loc, (r + 1) * E_loc)``; each rank
passes its own tokens and gets ``y`` for them. :func:`reference_forward_ep` states that.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(h: torch.Tensor, activation_clamp: float | None = None) -> torch.Tensor:
    """``silu(min(g, c)) * clamp(u, -c, c)`` over the last dim split in halves (gate, up)."""
    gate, up = h.chunk(2, dim=-1)
    if activation_clamp is not None:
        gate = torch.clamp(gate, max=activation_clamp)
        up = torch.clamp(up, min=-activation_clamp, max=activation_clamp)
    return F.silu(gate) * up


def reference_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: torch.Tensor,
    l2_weights: torch.Tensor,
    activation_clamp: float | None = None,
    *,
    expert_offset: int = 0,
) -> torch.Tensor:
    """``y`` for the experts ``[expert_offset, expert_offset + E_loc)`` held in the weights.

    Computes in the dtype of ``x`` (upcast the inputs for a float64 reference). Slots whose id
    is -1 or belongs to another rank's experts contribute nothing.
    """
    if topk_idx.dim() != 2 or topk_weights.shape != topk_idx.shape or x.dim() != 2 or x.shape[0] != topk_idx.shape[0]:
        raise ValueError(f"x {tuple(x.shape)}, topk_idx {tuple(topk_idx.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}: expected x [T, H] and topk_idx, topk_weights [T, K]")
    if topk_idx.is_floating_point() or topk_idx.is_complex():
        raise TypeError(f"topk_idx has dtype {topk_idx.dtype}; expected an integer dtype")
    num_tokens, top_k = topk_idx.shape
    num_local = l1_weights.shape[0]
    dtype = x.dtype
    y = torch.zeros(num_tokens, l2_weights.shape[1], dtype=dtype, device=x.device)
    flat_ids = topk_idx.reshape(-1).long() - expert_offset
    flat_w = topk_weights.reshape(-1).to(dtype)
    token_of_slot = torch.arange(num_tokens * top_k, device=x.device) // top_k
    for e in range(num_local):
        slots = (flat_ids == e).nonzero().flatten()
        if slots.numel() == 0:
            continue
        tokens = token_of_slot[slots]
        h = x[tokens] @ l1_weights[e].to(dtype).t()
        o = swiglu(h, activation_clamp) @ l2_weights[e].to(dtype).t()
        y = y.index_add(0, tokens, o * flat_w[slots, None])
    return y


def reference_forward_ep(xs, topk_idxs, topk_weights, l1_shards, l2_shards, activation_clamp=None):
    """Expert-parallel semantics over ``W`` ranks, as lists indexed by rank.

    Every rank's tokens may route to any global expert; rank ``r`` owns shard ``r`` of the
    weights. Returns the list of per-rank ``y``: the sum over all ranks' expert shards.
    """
    num_local = l1_shards[0].shape[0]
    return [
        sum(
            reference_forward(x, idx, w, l1, l2, activation_clamp, expert_offset=r * num_local)
            for r, (l1, l2) in enumerate(zip(l1_shards, l2_shards))
        )
        for x, idx, w in zip(xs, topk_idxs, topk_weights)
    ]


def upcast(*tensors: torch.Tensor, dtype=torch.float64):
    """Detached float64 copies (integer tensors pass through) for building a reference."""
    return tuple(t.detach().to(dtype) if t.is_floating_point() else t for t in tensors)
