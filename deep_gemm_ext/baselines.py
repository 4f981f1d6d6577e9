"""Baselines on the same contract, differentiated by autograd: what users run today.

- :func:`hf_loop_moe`: Hugging Face transformers style, a Python loop over experts.
- :func:`grouped_mm_moe`: torchtitan style, tokens sorted by expert, padded groups, two
  ``torch._grouped_mm`` calls (on SM90+ bf16; a loop over experts elsewhere), autograd backward.
"""
from __future__ import annotations

import torch

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


def _grouped_linear(a, b_kn, ends):
    if a.is_cuda and a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device)[0] >= 9:
        return torch._grouped_mm(a, b_kn, offs=ends)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]).tolist()
    pieces = [a[s:t] @ b_kn[e] for e, (s, t) in enumerate(zip(starts, ends.tolist()))]
    tail = a.new_zeros(a.shape[0] - int(ends[-1]), b_kn.shape[2])
    return torch.cat(pieces + [tail])


def grouped_mm_moe(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp=None):
    """torchtitan's MoE: stable sort by expert, groups padded to 8 rows, grouped GEMMs, fp32 score
    multiply, scatter_add combine; index ops whose backwards are gathers/atomic adds, as there."""
    num_tokens, top_k = topk_idx.shape
    hidden = x.shape[1]
    meta = compute_routing_torch(topk_idx, l1_weights.shape[0], GROUPED_MM_ALIGN)
    padded_x = torch.cat([x, x.new_zeros(1, hidden)])
    src = torch.where(meta.row_to_slot >= 0, meta.row_to_slot // top_k, num_tokens).long()
    x_sorted = padded_x.index_select(0, src)
    h = _grouped_linear(x_sorted, l1_weights.transpose(1, 2), meta.ends)
    o = _grouped_linear(swiglu(h, activation_clamp), l2_weights.transpose(1, 2), meta.ends)
    # Unpermute: a zero row stands in for unused slots (rows past ends[-1] are never read).
    o = torch.cat([o, o.new_zeros(1, hidden)])
    rows = torch.where(meta.slot_to_row >= 0, meta.slot_to_row, o.shape[0] - 1).long()
    acc = torch.promote_types(x.dtype, torch.float32)
    routed = (o.index_select(0, rows).to(acc) * topk_weights.reshape(-1, 1).to(acc)).to(x.dtype)
    token = torch.arange(num_tokens * top_k, device=x.device) // top_k
    return x.new_zeros(num_tokens, hidden).scatter_add(0, token[:, None].expand(-1, hidden), routed)
