"""Baselines on the same contract, differentiated by autograd: what users run today.

- :func:`hf_loop_moe`: Hugging Face transformers style, a Python loop over experts.
- :func:`grouped_mm_moe`: torchtitan style, tokens sorted by expert, padded groups, two
  ``torch._grouped_mm`` calls (on SM90+ bf16; a loop over experts elsewhere), autograd backward.
- :func:`ep_grouped_mm_moe`: torchtitan's expert parallelism around :func:`grouped_mm_moe`: the
  tokens-per-expert counts exchanged by one all-to-all (a host sync for the splits), every routed
  slot's row sent to its expert's rank by ``all_to_all_single`` with those splits, the local
  experts' grouped GEMMs on the received rows, the results sent back the same way, scores applied
  and summed at the source; autograd through both all-to-alls.
- :func:`liger_fused_moe`: Liger-Kernel's ``LigerFusedMoEFunction`` (Triton kernels and its own
  backward) when ``liger_kernel`` is installed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .reference import swiglu
from .routing import compute_routing_torch

#: torchtitan pads every expert's token group to this many rows for bf16 grouped GEMMs.
GROUPED_MM_ALIGN = 8


def hf_loop_moe(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp=None):
    num_tokens, top_k = topk_idx.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    y = torch.zeros(num_tokens, x.shape[1], dtype=acc, device=x.device)
    # One mask per expert, like transformers' Qwen3MoeSparseMoeBlock (host syncs included).
    hit = torch.nn.functional.one_hot(topk_idx.clamp(min=0).long(), l1_weights.shape[0])
    hit = hit * (topk_idx >= 0)[..., None]
    hit = hit.permute(2, 1, 0)  # [E, K, T]
    for e in (hit.sum((1, 2)) > 0).nonzero().flatten().tolist():
        slot, token = torch.where(hit[e])
        h = x[token] @ l1_weights[e].t()
        o = swiglu(h, activation_clamp) @ l2_weights[e].t()
        y = y.index_add(0, token, o.to(acc) * topk_weights[token, slot, None].to(acc))
    return y.to(x.dtype)


@torch.compiler.assume_constant_result
def _has_grouped_mm(device_index: int) -> bool:
    """SM90 or newer; a constant to torch.compile, so the baseline compiles as one graph."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _grouped_linear(a, b_kn, ends):
    if a.is_cuda and a.dtype == torch.bfloat16 and _has_grouped_mm(a.device.index):
        return torch._grouped_mm(a, b_kn, offs=ends)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]).tolist()
    pieces = [a[s:t] @ b_kn[e] for e, (s, t) in enumerate(zip(starts, ends.tolist()))]
    tail = a.new_zeros(a.shape[0] - int(ends[-1]), b_kn.shape[2])
    return torch.cat(pieces + [tail])


def grouped_mm_moe(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp=None):
    """torchtitan's MoE (``score_before_experts=False``), op for op: histc + stable argsort, gather
    the routed tokens, permute into 8-row-padded expert groups, separate gate / up / down grouped
    GEMMs, unpermute with ``index_copy_``, fp32 score multiply, ``scatter_add`` combine; autograd
    does the backward. Unused slots (id -1), which torchtitan has no notion of, sort last and get a
    zero score and a zero row."""
    num_tokens, top_k = topk_idx.shape
    num_experts, two_i, hidden = l1_weights.shape
    inter = two_i // 2
    if num_tokens == 0:
        return x * 0
    flat = topk_idx.reshape(-1)
    keys = torch.where(flat >= 0, flat, num_experts)
    order = torch.argsort(keys, stable=True)
    scores_sorted = torch.where(keys[order] < num_experts, topk_weights.reshape(-1)[order], 0)
    token_sorted = (order // top_k)[:, None].expand(-1, hidden)
    routed_input = torch.gather(x, 0, token_sorted)
    # generate_permute_indices: pool row -> position in the sorted list (or a zero row).
    meta = compute_routing_torch(topk_idx, num_experts, GROUPED_MM_ALIGN)
    rank_of_slot = torch.empty_like(order)
    rank_of_slot[order] = torch.arange(order.numel(), device=x.device)
    permuted = torch.where(meta.row_to_slot >= 0, rank_of_slot[meta.row_to_slot.clamp(min=0).long()],
                           order.numel())
    padded = torch.cat([routed_input, routed_input.new_zeros(1, hidden)])
    pool = torch.index_select(padded, 0, permuted)
    w1, w3 = l1_weights[:, :inter], l1_weights[:, inter:]
    gate = _grouped_linear(pool, w1.transpose(-2, -1), meta.ends)
    up = _grouped_linear(pool, w3.transpose(-2, -1), meta.ends)
    if activation_clamp is not None:
        gate = torch.clamp(gate, max=activation_clamp)
        up = torch.clamp(up, min=-activation_clamp, max=activation_clamp)
    out = _grouped_linear(torch.nn.functional.silu(gate) * up, l2_weights.transpose(-2, -1), meta.ends)
    unpermuted = out.new_zeros(order.numel() + 1, hidden).index_copy(0, permuted, out)[:-1]
    acc = torch.promote_types(x.dtype, torch.float32)
    routed_output = (unpermuted.to(acc) * scores_sorted.reshape(-1, 1).to(acc)).to(x.dtype)
    return torch.zeros_like(x).scatter_add(0, token_sorted, routed_output)


class _AllToAllSingle(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty(sum(output_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty(sum(input_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


def ep_grouped_mm_moe(x, topk_idx, topk_weights, l1_local, l2_local, group, activation_clamp=None,
                      local_fn=None):
    """torchtitan-style expert parallelism over ``group`` (W ranks; rank r owns the global experts
    ``[r * E_loc, (r + 1) * E_loc)``, ``l1_local`` / ``l2_local`` are those, ``topk_idx`` holds global
    ids, -1 for an unused slot), on our contract: y for this rank's tokens, differentiable w.r.t. x,
    topk_weights and the local weights.

    Dispatch: the slots sorted by expert (stable), the per-expert counts exchanged by an equal-split
    ``all_to_all_single`` and brought to the host (the splits), each routed slot's row of x gathered
    and sent to its expert's rank. The received rows come grouped by source rank, then local expert;
    ``local_fn`` (default :func:`grouped_mm_moe`; pass a compiled one to compile the local part) runs
    them with one slot each, score 1. Combine: the rows go back by the reverse exchange, are scaled
    by their scores in fp32 (``score_before_experts=False``) and ``scatter_add``-ed into y."""
    if local_fn is None:
        local_fn = grouped_mm_moe
    world = group.size()
    num_local, _, hidden = l1_local.shape
    num_experts = world * num_local
    num_tokens, top_k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    keys = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(keys, stable=True)
    per_expert = torch.bincount(keys, minlength=num_experts + 1)[:num_experts]
    received_per_expert = torch.empty_like(per_expert)
    dist.all_to_all_single(received_per_expert, per_expert, group=group)  # [source, local expert]
    received_per_expert = received_per_expert.view(world, num_local)
    splits = torch.stack([per_expert.view(world, num_local).sum(1), received_per_expert.sum(1)]).tolist()
    input_splits, output_splits = splits
    routed = order[:sum(input_splits)]
    token = routed // top_k
    received = _AllToAllSingle.apply(x[token], output_splits, input_splits, group)
    local_ids = torch.repeat_interleave(torch.arange(num_local, device=x.device).repeat(world),
                                        received_per_expert.reshape(-1))
    ones = torch.ones(received.shape[0], 1, dtype=torch.float32, device=x.device)
    out = local_fn(received, local_ids[:, None], ones, l1_local, l2_local, activation_clamp)
    back = _AllToAllSingle.apply(out, input_splits, output_splits, group)
    acc = torch.promote_types(x.dtype, torch.float32)
    scores = topk_weights.reshape(-1)[routed]
    contrib = (back.to(acc) * scores[:, None].to(acc)).to(x.dtype)
    return torch.zeros_like(x).scatter_add(0, token[:, None].expand(-1, hidden), contrib)


def liger_unavailable_reason() -> str | None:
    """Why :func:`liger_fused_moe` cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "Liger-Kernel's fused MoE is Triton code and needs a CUDA GPU"
    try:
        from liger_kernel.ops import LigerFusedMoEFunction  # noqa: F401
    except Exception as exc:  # ImportError, or Triton failing to initialise
        return f"liger_kernel is not importable ({type(exc).__name__}: {exc})"
    return None


def liger_inputs(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp=None):
    """Our contract as ``LigerFusedMoEFunction.apply``'s arguments (liger-kernel 0.8.5):
    ``(x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], top_k_index [T, K] int32,
    top_k_weights [T, K])``. Its weight layouts are ours (gate rows first, then up), so only the
    ids change dtype; call this once, outside any timed region (the id check syncs)."""
    if activation_clamp is not None:
        raise ValueError(f"activation_clamp={activation_clamp!r}: Liger's fused MoE has no clamp; expected None")
    if topk_idx.numel() and int(topk_idx.min()) < 0:
        raise ValueError(f"topk_idx has unused slots (min id {int(topk_idx.min())}); Liger's fused MoE "
                         f"expects every id in [0, {l1_weights.shape[0]})")
    return (x.contiguous(), l1_weights.contiguous(), l2_weights.contiguous(),
            topk_idx.to(torch.int32).contiguous(), topk_weights.contiguous())


def liger_fused_moe(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp=None):
    """Liger-Kernel's ``LigerFusedMoEFunction`` (Triton grouped GEMMs, own backward) on our contract."""
    from liger_kernel.ops import LigerFusedMoEFunction
    return LigerFusedMoEFunction.apply(*liger_inputs(x, topk_idx, topk_weights, l1_weights, l2_weights,
                                                     activation_clamp))
