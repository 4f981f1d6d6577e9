"""The MoE layer of the README's contract, forward and backward, written once over a plan's parts.

    forward:   exchange.dispatch -> routing -> L1 GEMM -> SwiGLU -> L2 GEMM -> combine -> exchange.combine
    backward:  exchange.combine_backward -> L2 dgrad -> SwiGLU backward (d topk_weights = <da', act>)
               -> dW2, L1 dgrad -> combine -> dW1 -> exchange.dispatch_backward

Under the fp8 recipe the layer may make the quantized rows the fp8 GEMMs read (``plan.fp8_rows``):
the SwiGLU forward writes act in fp8 only (the L2 GEMM's operand; the backward recomputes act from
h), the SwiGLU backward also writes dh quantized for the L1 data gradient, and dy is quantized per
token before its rows are gathered for the L2 data gradient; the GEMMs then read those rows
(Fp8Rows operands) instead of quantizing pools themselves. With fp8 weight gradients (``plan.fp8_cols``)
the SwiGLU backward writes dh's and act_w's column-quantized transposes instead of their bf16 copies,
and the weight-gradient GEMMs read them (Fp8Cols operands).

Which GEMMs run (``plan.gemms``: our SM90 kernels, torch._grouped_mm, a loop over experts, DeepGEMM),
under which precision (``plan.precision``) and token exchange (``plan.tokens``) is the plan's
choice (deep_gemm_ext.plan); so is which steps run inside the GEMMs: the L1 GEMM gathering x's
rows (``gather_x``; no pool of x is built and x is saved instead), the fp8 backward's quantizers
gathering dy and x (``gather_backward``: no pools of them), GEMM outputs written in top-k slot order for the combine
(``combine_epilogue``). Where a fusion is off, the separate elementwise step of
deep_gemm_ext.elementwise runs; a pool of x built before the L1 GEMM is saved for dW1.

The backward needs only the L1 output h, the rows of x (the pool, or x itself), the routing
metadata and the weights: act is recomputed from h, and d topk_weights is ``<da', act>``.
"""
from __future__ import annotations

import torch

from . import elementwise
from .plan import Plan
from .providers import Fp8Cols, Fp8Rows, Gather, ScatterSlots
from .providers.base import fp8_cols_rows
from .routing import RoutingMeta, pool_rows

_META_TENSORS = 5  # counts, starts, ends, slot_to_row, row_to_slot


# ---------------------------------------------------------------------------------------------
# What the forward saves, as the flat tensor lists the custom ops carry:
#   saved = [x_rows, w_rows, l1_weights, l2_weights, h, *routing metadata, *exchange handle]
# x_rows is x's pool where the forward built it and keeps it (plan.saves_x_pool), else the dispatched x
# itself; w_rows the dispatched topk_weights. On one rank dispatch is the identity, so x_rows (when it is
# x) and w_rows are op inputs; under expert parallelism they are the received rows, made by the op.
# The op returns only the tensors it made ("produced"); setup_context adds the inputs back.


def produced_of(plan: Plan, saved: list[torch.Tensor]) -> list[torch.Tensor]:
    """The saved tensors the forward made (not its inputs)."""
    x_rows, w_rows, _, _, *rest = saved
    if plan.exchanges_tokens:
        return [x_rows, w_rows, *rest]
    return [x_rows, *rest] if plan.saves_x_pool else rest


def saved_of(plan: Plan, x, topk_weights, l1_weights, l2_weights, produced: list[torch.Tensor]) -> list[torch.Tensor]:
    """``saved`` from the op's inputs and what it produced (the inverse of :func:`produced_of`)."""
    if plan.exchanges_tokens:
        x_rows, w_rows, *rest = produced
        return [x_rows, w_rows, l1_weights, l2_weights, *rest]
    if not plan.saves_x_pool:
        return [x, topk_weights, l1_weights, l2_weights, *produced]
    x_pool, *rest = produced
    return [x_pool, topk_weights, l1_weights, l2_weights, *rest]


def produced_like(plan: Plan, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  l1_weights: torch.Tensor) -> list[torch.Tensor]:
    """Empty tensors shaped like what :func:`forward` produces (the custom op's fake)."""
    hidden = x.shape[1]
    top_k = topk_idx.shape[1]
    num_rows = plan.tokens.received_rows(x.shape[0])
    num_experts, two_i, _ = l1_weights.shape
    rows = pool_rows(num_rows * top_k, num_experts, plan.align)
    i32 = dict(dtype=torch.int32, device=x.device)
    pool = x.new_empty(rows, hidden, dtype=plan.dtype)
    if plan.exchanges_tokens:
        made = [pool if plan.saves_x_pool else x.new_empty(num_rows, hidden), topk_weights.new_empty(num_rows, top_k)]
    else:
        made = [pool] if plan.saves_x_pool else []
    return made + [x.new_empty(rows, two_i, dtype=plan.dtype), torch.empty(num_experts, **i32),
                   torch.empty(num_experts, **i32), torch.empty(num_experts, **i32),
                   torch.empty(num_rows * top_k, **i32), torch.empty(rows, **i32),
                   *plan.tokens.handle_like(x, topk_idx)]


def _meta(plan: Plan, tensors, num_experts: int, top_k: int) -> RoutingMeta:
    return RoutingMeta.from_tensors(tensors, num_experts=num_experts, top_k=top_k, align=plan.align)


# ---------------------------------------------------------------------------------------------
# Forward


def _combine(plan: Plan, a, w, layout: str, meta: RoutingMeta, weights, out_dtype):
    """y[t] = sum_k weights[t, k] * (a[r] @ op(w[e]))[slot_to_row[t*K + k]]: an M-grouped GEMM and the
    ordered top-k combine, through the GEMM's slot-order epilogue or a gathering combine."""
    if plan.combine_epilogue:
        o_slots = plan.gemms.m_grouped(a, w, meta, layout, recipe=plan.precision, epilogue=ScatterSlots(weights))
        return elementwise.combine_slots(o_slots, meta.slot_to_row, meta.top_k, plan.kernels)
    o = plan.gemms.m_grouped(a, w, meta, layout, recipe=plan.precision)
    return elementwise.combine_rows(o, meta.slot_to_row, weights, meta.top_k, out_dtype, plan.kernels)


def _rows_arrived(pending) -> None:
    """The overlapped dispatch's rows are all written before the stream goes on (x_r is saved for
    the backward's dW1, and the next exchange piece reuses the regions)."""
    if pending is not None:
        torch.cuda.current_stream(pending.wait.arrivals.device).wait_event(pending.done)


def forward(plan: Plan, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, *,
            assert_ids: bool = False):
    """Returns ``(y, saved)``; ``saved`` is the tensor list :func:`backward` takes. ``assert_ids``: the
    routing kernel asserts on the device that every id is in ``[-1, E)`` (plan.jit_routing, one rank)."""
    gemms, precision, cdt = plan.gemms, plan.precision, plan.dtype
    pending = None
    if plan.ep_overlap:
        # x_r's rows arrive while routing and the L1 GEMM run (the GEMM waits for each tile's
        # source ranks); everything else that reads x_r waits for the pull's event first.
        x_r, idx_r, w_r, handle, pending = plan.tokens.dispatch_overlapped(x, topk_idx, topk_weights)
    else:
        x_r, idx_r, w_r, handle = plan.tokens.dispatch(x, topk_idx, topk_weights)
    num_experts = l1_weights.shape[0]
    top_k = idx_r.shape[1]
    # Under expert parallelism the three launches: a cluster of 8 CTAs must find 8 SMs of one GPC free at
    # once, which ranks whose kernels wait on each other (emulated on one GPU) need not leave it.
    meta = elementwise.routing(idx_r, num_experts, plan.align, plan.routing_kernels, assert_ids=assert_ids,
                               single_launch=not plan.exchanges_tokens)
    if x_r.shape[0] == 0:
        _rows_arrived(pending)
        x_rows = x_r.new_zeros(meta.num_pool_rows, x_r.shape[1], dtype=cdt) if plan.saves_x_pool else x_r
        h = x_r.new_zeros(meta.num_pool_rows, l1_weights.shape[1], dtype=cdt)
        y = plan.tokens.combine(x_r.new_zeros(x_r.shape), handle)
        return y, [x_rows, w_r, l1_weights, l2_weights, h, *meta.tensors(), *handle]
    if plan.gather_x:
        a = x_r.contiguous()
        gather = Gather(meta.row_to_slot, top_k, plan.gather_x, None if pending is None else pending.wait)
        x_rows = x_r
    else:
        _rows_arrived(pending)
        gather = None
        a = elementwise.gather_rows(x_r.to(cdt), meta.row_to_slot, top_k, plan.kernels, meta.slot_to_row)
        x_rows = a  # kept for dW1
    l1 = precision.expert_weights(l1_weights, cdt)
    # h is an output of the op: rows no expert owns are zero rather than stale memory.
    h = gemms.m_grouped(a, l1, meta, "nt", recipe=precision, gather=gather, zero_unowned=True)
    del a
    _rows_arrived(pending)
    if plan.fp8_rows:
        # The L2 GEMM's operand straight from h: act's fp8 rows and scales, no bf16 act written.
        act = Fp8Rows(*elementwise.swiglu_forward_fp8(h, activation_clamp, plan.kernels))
    else:
        act = elementwise.swiglu_forward(h, activation_clamp, plan.kernels)
    y_r = _combine(plan, act, precision.expert_weights(l2_weights, cdt), "nt", meta, w_r, x.dtype)
    y = plan.tokens.combine(y_r, handle)
    return y, [x_rows, w_r, l1_weights, l2_weights, h, *meta.tensors(), *handle]


# ---------------------------------------------------------------------------------------------
# Backward


def _take_or_zero(src: torch.Tensor, index: torch.Tensor, kernels=None) -> torch.Tensor:
    """``src[index]`` where ``index >= 0``, 0 where it is -1 (index in ``[-1, len(src))``): one JIT launch
    for fp32 ``src``, else three torch ones (-1 reads an appended zero; a masked gather takes six)."""
    if kernels is not None and src.dtype == torch.float32:
        return kernels.take_or_zero(src.contiguous(), index)
    return torch.cat([src, src.new_zeros(1)])[index]


#: Widest hidden size whose fp8 backward makes dy's quantized and bf16 pools in one token-order launch
#: (``quantize_pool_rows_fp8(with_pool=True)``); wider rows take the bf16 gather and the quantizer apart.
#: GPU time per call on the H200 (CUDA graphs; docs/perf-notes.md v30), one launch against two: T 16384 x
#: H 2048 333.6 / 336.5 us, T 4096 x 2048 115.7 / 122.1 us; T 8192 x 4096 423.3 / 399.5 us, x 7168 826.7 /
#: 760.4 us.
FUSED_DY_POOLS_MAX_HIDDEN = 2048


def fused_dy_pools(hidden: int) -> bool:
    """Whether the fp8 backward makes dy's two pools in one launch at this hidden size."""
    return hidden <= FUSED_DY_POOLS_MAX_HIDDEN


def backward(plan: Plan, dy, saved: list[torch.Tensor], activation_clamp):
    """Gradients ``(dx, d topk_weights, d l1_weights, d l2_weights)`` from :func:`forward`'s ``saved``."""
    gemms, precision, cdt = plan.gemms, plan.precision, plan.dtype
    x_rows, w_rows, l1_weights, l2_weights, h, *rest = saved
    handle = rest[_META_TENSORS:]
    top_k = w_rows.shape[1]
    meta = _meta(plan, rest[:_META_TENSORS], l1_weights.shape[0], top_k)
    dy_r = plan.tokens.combine_backward(dy, handle)
    num_rows = meta.slot_to_row.shape[0] // top_k
    if num_rows == 0:  # shapes are static: no sync; also avoids zero-length contractions
        dx, d_topk = plan.tokens.dispatch_backward(torch.zeros_like(dy_r), torch.zeros_like(w_rows), handle)
        return dx, d_topk, torch.zeros_like(l1_weights), torch.zeros_like(l2_weights)
    # fp8 rows for the L2 dgrad (plan.fp8_rows): dy quantized per token into the pool's rows, the pool's
    # quantized bits from T rows of reads instead of P; with the bf16 pool (for dW2) in the same launch
    # where that measured faster (fused_dy_pools).
    dy_fp8 = None
    if plan.gather_backward:
        # The fp8 operands' quantizers read dy's rows (L2 dgrad, dW2) and x's rows (dW1) themselves: no pools.
        a_dy, gather = dy_r.to(cdt).contiguous(), Gather(meta.row_to_slot, top_k, "cp_async")
    else:
        gather = None
        fused = plan.fp8_rows and fused_dy_pools(dy_r.shape[1])
        if not fused:
            a_dy = elementwise.gather_rows(dy_r.to(cdt), meta.row_to_slot, top_k, plan.kernels, meta.slot_to_row)
        if plan.fp8_rows:
            dy_fp8 = elementwise.quantize_pool_rows_fp8(dy_r.to(cdt), meta.row_to_slot, top_k, plan.kernels,
                                                        meta.slot_to_row, with_pool=fused)
            if fused:
                *dy_fp8, a_dy = dy_fp8
    l2 = precision.expert_weights(l2_weights, cdt)
    a_l2 = a_dy if dy_fp8 is None else Fp8Rows(*dy_fp8)  # the bf16 pool stays for dW2
    dy_fp8 = None
    da = gemms.m_grouped(a_l2, l2, meta, "nn", recipe=precision, gather=gather)  # l2[e] is [H, I]: dy @ l2[e]
    del a_l2
    # The row weights only after the L2 dgrad is launched: the GPU idles until that first GEMM of the
    # backward arrives, and nothing before it reads them.
    row_weight = _take_or_zero(w_rows.reshape(-1), meta.row_to_slot, plan.kernels)
    if plan.fp8_cols:
        # fp8 weight gradients: dh's rows for the L1 data gradient and the column-quantized transposes of
        # dh and act_w for dW1 and dW2, in one pass; no bf16 dh or act_w.
        d_row_weight, *quantized = elementwise.swiglu_backward_fp8_t(
            h, da, row_weight, activation_clamp, plan.kernels, rows=fp8_cols_rows(meta.num_pool_rows))
        dh_l1, dh, act_w = Fp8Rows(*quantized[0:2]), Fp8Cols(*quantized[2:4]), Fp8Cols(*quantized[4:6])
        del quantized
    elif plan.fp8_rows:
        # The SwiGLU backward also quantizes dh for the L1 data gradient (no separate pass).
        dh, d_row_weight, act_w, *dh_rows = elementwise.swiglu_backward_fp8(h, da, row_weight, activation_clamp,
                                                                              plan.kernels)
        dh_l1 = Fp8Rows(*dh_rows)
        del dh_rows  # dh_l1 alone holds the e4m3 dh: freed after the L1 dgrad, before dW1's output
    else:
        dh, d_row_weight, act_w = elementwise.swiglu_backward(h, da, row_weight, activation_clamp, plan.kernels)
        dh_l1 = dh
    del da
    d_l2 = gemms.k_grouped(a_dy, act_w, meta, recipe=precision, gather_a=gather)  # [E, H, I]
    del a_dy, act_w
    # l1[e] is [2I, H]: dh @ l1[e], summed over each token's slots
    dx_r = _combine(plan, dh_l1, precision.expert_weights(l1_weights, cdt), "nn", meta, None, dy.dtype)
    del dh_l1
    if plan.gather_backward:
        d_l1 = gemms.k_grouped(dh, x_rows.contiguous(), meta, recipe=precision, gather_b=gather)  # [E, 2I, H]
    else:
        if not plan.saves_x_pool:
            x_rows = elementwise.gather_rows(x_rows.to(cdt).contiguous(), meta.row_to_slot, top_k, plan.kernels,
                                             meta.slot_to_row)
        d_l1 = gemms.k_grouped(dh, x_rows, meta, recipe=precision)  # [E, 2I, H]
    del dh
    d_topk = _take_or_zero(d_row_weight, meta.slot_to_row, plan.kernels).view(num_rows, top_k).to(w_rows.dtype)
    dx, d_topk = plan.tokens.dispatch_backward(dx_r, d_topk, handle)
    return dx, d_topk, d_l1.to(l1_weights.dtype), d_l2.to(l2_weights.dtype)
