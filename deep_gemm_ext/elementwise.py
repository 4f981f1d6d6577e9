"""The layer's steps between GEMMs: routing, gather, combine, SwiGLU forward and backward.

Each takes ``kernels``, the JIT kernel module (deep_gemm_ext.jit_kernels) when the plan runs them
there (``Plan.kernels`` / ``Plan.routing_kernels``), or None for the torch implementation, which
computes in fp32 (fp64 for fp64 inputs) and is the definition the kernels are tested against.
"""
from __future__ import annotations

import torch

from .reference import swiglu
from .routing import RoutingMeta, compute_routing_torch


def routing(topk_idx: torch.Tensor, num_experts: int, align: int, kernels=None, *,
            assert_ids: bool = False, single_launch: bool = True) -> RoutingMeta:
    """``assert_ids`` (the JIT kernels only): ids outside ``[-1, num_experts)`` fail the routing kernel with
    a device-side assertion. ``single_launch=False``: the JIT kernels' three launches even where the
    one-launch cluster kernel applies (same bits)."""
    if kernels is not None:
        return kernels.routing_metadata(topk_idx, num_experts, align, assert_ids=assert_ids,
                                        launches=None if single_launch else 3)
    if assert_ids:
        raise ValueError("routing(assert_ids=True) needs the JIT routing kernels")
    return compute_routing_torch(topk_idx, num_experts, align)


def gather_rows(x: torch.Tensor, row_to_slot: torch.Tensor, top_k: int, kernels=None,
                slot_to_row: torch.Tensor | None = None) -> torch.Tensor:
    """Pool row r = x[row_to_slot[r] // top_k]; zero rows where row_to_slot[r] < 0 (padding).
    ``slot_to_row``: the routing's inverse map; the kernels then read each of x's rows once (token order)."""
    if kernels is not None:
        return kernels.gather_rows(x, row_to_slot, top_k, slot_to_row=_token_order(slot_to_row, top_k, kernels))
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    src = torch.where(row_to_slot >= 0, row_to_slot // top_k, x.shape[0])
    return padded.index_select(0, src.long())


def combine_rows(o: torch.Tensor, slot_to_row: torch.Tensor, weights: torch.Tensor | None, top_k: int,
                 out_dtype: torch.dtype, kernels=None) -> torch.Tensor:
    """y[t] = sum_k w[t, k] * o[slot_to_row[t*K + k]] accumulated in fp32 in k order; -1 rows skipped."""
    if kernels is not None and out_dtype == o.dtype:
        return kernels.combine_rows(o, slot_to_row, weights, top_k)
    acc_dtype = torch.float64 if o.dtype == torch.float64 else torch.float32
    num_tokens = slot_to_row.shape[0] // top_k
    rows = slot_to_row.view(num_tokens, top_k).long()
    valid = rows >= 0
    safe_rows = torch.where(valid, rows, 0)
    y = torch.zeros(num_tokens, o.shape[1], dtype=acc_dtype, device=o.device)
    for j in range(top_k):
        contrib = o.index_select(0, safe_rows[:, j]).to(acc_dtype)
        scale = valid[:, j].to(acc_dtype) if weights is None else torch.where(
            valid[:, j], weights[:, j].to(acc_dtype), 0)
        # where() rather than a multiply so that an unused slot cannot turn into NaN * 0.
        y += torch.where(valid[:, j, None], contrib * scale[:, None], 0)
    return y.to(out_dtype)


def combine_slots(o_slots: torch.Tensor, slot_to_row: torch.Tensor, top_k: int, kernels) -> torch.Tensor:
    """y[t] = sum_k o_slots[t*K + k] over the used slots, in k order (the output of a ScatterSlots
    epilogue). Only with the JIT kernels: the plan enables that epilogue only where they run."""
    return kernels.combine_slots(o_slots, slot_to_row, top_k)


def swiglu_forward(h: torch.Tensor, activation_clamp: float | None, kernels=None) -> torch.Tensor:
    if kernels is not None:
        return kernels.swiglu_forward(h, activation_clamp)
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    return swiglu(h.to(acc), activation_clamp).to(h.dtype)


def quantize_pool_rows_fp8(x: torch.Tensor, row_to_slot: torch.Tensor, top_k: int, kernels,
                           slot_to_row: torch.Tensor | None = None, with_pool: bool = False):
    """The pool of ``x``'s rows quantized 1x128, ``(data [P, H] e4m3, scale [P, H/128] fp32)``: each token
    quantized once, then its rows gathered (padding rows: data and scale zero; ``slot_to_row``: in token
    order, as :func:`gather_rows`). ``with_pool``: also the bf16 pool :func:`gather_rows` makes,
    ``(data, scale, pool)``, in the same launch where the token order serves."""
    return kernels.quantize_pool_rows_fp8(x, row_to_slot, top_k, slot_to_row=_token_order(slot_to_row, top_k, kernels),
                                          with_pool=with_pool)


def _token_order(slot_to_row: torch.Tensor | None, top_k: int, kernels) -> torch.Tensor | None:
    """The inverse map the kernels' token-order gather takes (it serves top_k <= kernels.MAX_TOP_K), or
    None for the row walk; both give the same pool."""
    return slot_to_row if slot_to_row is not None and top_k <= kernels.MAX_TOP_K else None


def swiglu_forward_fp8(h: torch.Tensor, activation_clamp: float | None, kernels):
    """:func:`swiglu_forward` on the JIT kernel that quantizes act 1x128 along I as it goes (the fp8
    recipe's L2 forward operand), writing no bf16 act: ``(act_data, act_scale)``."""
    return kernels.swiglu_forward_fp8(h, activation_clamp)


def swiglu_backward_fp8(h: torch.Tensor, da: torch.Tensor, row_weight: torch.Tensor,
                        activation_clamp: float | None, kernels):
    """:func:`swiglu_backward` on the JIT kernel that also quantizes dh 1x128 along 2I (the fp8
    recipe's L1 data-gradient operand): ``(dh, d_row_weight, act_w, dh_data, dh_scale)``."""
    return kernels.swiglu_backward_fp8(h, da, row_weight, activation_clamp)


def swiglu_backward_fp8_t(h: torch.Tensor, da: torch.Tensor, row_weight: torch.Tensor,
                          activation_clamp: float | None, kernels, rows: int):
    """The SwiGLU backward of fp8 weight gradients on the JIT kernel: d_row_weight and dh's 1x128 rows as
    :func:`swiglu_backward_fp8`, and instead of the bf16 dh and act_w their 128x1 column-quantized
    transposes with ``rows`` rows (the K-grouped fp8 GEMMs' operands):
    ``(d_row_weight, dh_data, dh_scale, dht_data, dht_scale, act_wt_data, act_wt_scale)``."""
    return kernels.swiglu_backward_fp8_t(h, da, row_weight, activation_clamp, rows=rows)


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, row_weight: torch.Tensor, activation_clamp: float | None,
                    kernels=None):
    """SwiGLU backward of ``w * da`` per pool row, plus ``<da, act>`` and ``w * act``.

    Returns ``(dh, d_row_weight, act_w)``: dh [P, 2I], d_row_weight [P] (fp32), act_w [P, I].
    """
    if kernels is not None:
        return kernels.swiglu_backward(h, da, row_weight, activation_clamp)
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    gate, up = h.to(acc).chunk(2, dim=-1)
    da = da.to(acc)
    w = row_weight.to(acc)[:, None]
    if activation_clamp is not None:
        gate_mask = gate <= activation_clamp
        up_mask = (up >= -activation_clamp) & (up <= activation_clamp)
        gate = torch.clamp(gate, max=activation_clamp)
        up = torch.clamp(up, min=-activation_clamp, max=activation_clamp)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    act = silu * up
    d_row_weight = (da * act).sum(-1)
    d = da * w
    dgate = d * up * (sig * (1 + gate * (1 - sig)))
    dup = d * silu
    if activation_clamp is not None:
        dgate = torch.where(gate_mask, dgate, 0)
        dup = torch.where(up_mask, dup, 0)
    dh = torch.cat([dgate, dup], dim=-1).to(h.dtype)
    return dh, d_row_weight.to(torch.float32 if acc == torch.float32 else acc), (act * w).to(h.dtype)
