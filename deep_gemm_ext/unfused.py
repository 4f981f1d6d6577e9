"""The unfused MoE layer: routing, gather, grouped GEMMs, SwiGLU and combine as separate steps.

One composition serves every engine (``gemm_engine``):
- on CPU (and on GPUs without a bf16 grouped GEMM) it is the reference path of
  ``mega_moe_train``, computing in fp32 (fp64 for fp64 inputs) with a loop over experts;
- on SM90 it runs our JIT grouped GEMMs over the 128-row-aligned pool ("sm90"), or
  ``torch._grouped_mm`` ("grouped_mm"), or upstream DeepGEMM's ("deep_gemm"), with the elementwise
  steps in JIT kernels when they are available and no host synchronisation. On "sm90" some steps
  run inside the GEMMs instead: the L1 forward gathers x's rows (fused_gather), the L2 forward and
  the L1 dgrad write top-k slot order for the combine (fused_combine), and, opt-in, SwiGLU forward
  / backward run in GEMM epilogues (fused_swiglu).

The backward is written by hand (design.md §2): it needs only the dispatched pool of x, the L1
output h and the routing metadata, and gets ``d topk_weights`` as ``<da', act>`` without the L2
output.
"""
from __future__ import annotations

import functools

import torch

from . import _env
from .reference import swiglu
from .routing import RoutingMeta, compute_routing_torch

# ---------------------------------------------------------------------------------------------
# Which implementation runs each step.


@functools.lru_cache(maxsize=None)
def _jit_kernels_for(device_index: int):
    try:
        from . import jit_kernels
    except ImportError:
        return None
    return jit_kernels if jit_kernels.available(device_index) else None


def jit_kernels(t: torch.Tensor):
    """The JIT kernel module when it serves this tensor's device, else None (torch ops run)."""
    if not (t.is_cuda and t.dtype in (torch.bfloat16, torch.int32, torch.int64) and _env.use_jit_kernels()):
        return None
    return _jit_kernels_for(t.device.index if t.device.index is not None else torch.cuda.current_device())


def sm90_gemm_supported(hidden: int, intermediate: int) -> bool:
    """Shapes our SM90 grouped GEMMs take: 128-row weight-gradient tiles over H and 2I, and 64-deep
    K blocks of the dgrad GEMMs (K = H and K = 2I)."""
    return hidden % 128 == 0 and (2 * intermediate) % 128 == 0


#: torch._grouped_mm refuses more groups than this.
GROUPED_MM_MAX_GROUPS = 1024


def gemm_engine(x: torch.Tensor, hidden: int, intermediate: int, backend: str = "auto",
                num_experts: int = 1) -> str:
    """Who runs the grouped GEMMs: ``"sm90"`` (our JIT kernels), ``"grouped_mm"`` (torch),
    ``"deep_gemm"`` (upstream DeepGEMM, see backends/deepgemm.py) or ``"loop"`` (a loop over
    experts in fp32/fp64: the CPU reference path)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return "loop"
    if backend == "deep_gemm":
        return "deep_gemm"
    major, minor = torch.cuda.get_device_capability(x.device)
    if (backend == "auto" and (major, minor) == (9, 0) and sm90_gemm_supported(hidden, intermediate)
            and jit_kernels(x) is not None):
        return "sm90"
    return "grouped_mm" if major >= 9 and num_experts <= GROUPED_MM_MAX_GROUPS else "loop"


def compute_dtype(x: torch.Tensor, engine: str) -> torch.dtype:
    """dtype of the pool, h and the GEMMs: bf16 on the GPU engines, fp32/fp64 on the loop."""
    if engine != "loop":
        return torch.bfloat16
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def fused_swiglu(engine: str, intermediate: int, t: torch.Tensor) -> bool:
    """SwiGLU forward / backward run in the epilogues of the L1 forward / L2 dgrad GEMMs."""
    return (engine == "sm90" and _env.fused_epilogues()
            and jit_kernels(t).swiglu_epilogue_supported(intermediate))


def fused_gather(engine: str) -> bool:
    """The L1 forward GEMM gathers x's rows itself (its gathering prologue): the forward builds no
    dispatched pool of x, and the layer saves x; the backward gathers the pool for dW1 only."""
    return engine == "sm90" and _env.fused_gather() is not None


def fused_combine(engine: str, out_dtype: torch.dtype) -> bool:
    """The L2 forward and L1 dgrad GEMMs write their rows into top-k slot order (combine epilogue),
    reduced per token by combine_slots."""
    return engine == "sm90" and out_dtype == torch.bfloat16 and _env.fused_combine()


#: Rows per expert group: our kernels' M tile; torch._grouped_mm's 16-byte k-grouped starts.
ROUTING_ALIGN = {"sm90": 128, "grouped_mm": 16, "deep_gemm": 128, "loop": 1}


# ---------------------------------------------------------------------------------------------
# Steps. Each has a torch implementation; the elementwise ones dispatch to JIT kernels on GPU.


def routing(topk_idx: torch.Tensor, num_experts: int, align: int) -> RoutingMeta:
    k = jit_kernels(topk_idx)
    if k is not None:
        return k.routing_metadata(topk_idx, num_experts, align)
    return compute_routing_torch(topk_idx, num_experts, align)


def gather_rows(x: torch.Tensor, row_to_slot: torch.Tensor, top_k: int) -> torch.Tensor:
    """Pool row r = x[row_to_slot[r] // top_k]; zero rows where row_to_slot[r] < 0 (padding)."""
    k = jit_kernels(x)
    if k is not None:
        return k.gather_rows(x, row_to_slot, top_k)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    src = torch.where(row_to_slot >= 0, row_to_slot // top_k, x.shape[0])
    return padded.index_select(0, src.long())


def combine_rows(o: torch.Tensor, slot_to_row: torch.Tensor, weights: torch.Tensor | None,
                 top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y[t] = sum_k w[t, k] * o[slot_to_row[t*K + k]] accumulated in fp32 in k order; -1 rows skipped."""
    k = jit_kernels(o)
    if k is not None and out_dtype == o.dtype:
        return k.combine_rows(o, slot_to_row, weights, top_k)
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


def gemm_combine(a: torch.Tensor, w: torch.Tensor, layout: str, meta: RoutingMeta, weights: torch.Tensor | None,
                 engine: str, out_dtype: torch.dtype) -> torch.Tensor:
    """y[t] = sum_k weights[t, k] * (a[r] @ op(w[e]))[slot_to_row[t*K + k]]: an M-grouped GEMM over the
    pool (``layout`` "nt": op(w[e]) = w[e].T, "nn": w[e]) and the ordered top-k combine.

    With ``fused_combine`` the GEMM's combine epilogue writes each row (times its weight) into its
    slot of a [T*K, N] buffer and combine_slots sums each token's K contiguous rows in k order;
    otherwise the GEMM writes the pool and combine_rows gathers it."""
    if fused_combine(engine, out_dtype):
        k = jit_kernels(a)
        scatter = k.Scatter(meta.row_to_slot, meta.slot_to_row.shape[0], weights)
        gemm = k.m_grouped_bf16_gemm_nt_contiguous if layout == "nt" else k.m_grouped_bf16_gemm_nn_contiguous
        o_slots = gemm(a, w, meta.starts, meta.ends, scatter=scatter)
        return k.combine_slots(o_slots, meta.slot_to_row, meta.top_k)
    o = grouped_mm_nt(a, w, meta, engine) if layout == "nt" else grouped_mm_nn(a, w, meta, engine)
    return combine_rows(o, meta.slot_to_row, weights, meta.top_k, out_dtype)


def swiglu_forward(h: torch.Tensor, activation_clamp: float | None) -> torch.Tensor:
    k = jit_kernels(h)
    if k is not None:
        return k.swiglu_forward(h, activation_clamp)
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    return swiglu(h.to(acc), activation_clamp).to(h.dtype)


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, row_weight: torch.Tensor,
                    activation_clamp: float | None):
    """SwiGLU backward of ``w * da`` per pool row, plus ``<da, act>`` and ``w * act``.

    Returns ``(dh, d_row_weight, act_w)``: dh [P, 2I], d_row_weight [P] (fp32), act_w [P, I].
    """
    k = jit_kernels(h)
    if k is not None:
        return k.swiglu_backward(h, da, row_weight, activation_clamp)
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


def grouped_mm_nt(a: torch.Tensor, w: torch.Tensor, meta: RoutingMeta, engine: str,
                  zero_unowned: bool = False) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ w[e].T for a [P, K] pool and weights w [E, N, K].

    Rows no expert owns (past ``meta.ends[-1]``) are left unwritten, since nothing reads them,
    unless ``zero_unowned`` (for tensors the op returns, which must be fully defined).
    """
    if engine == "sm90":
        out = a.new_zeros(a.shape[0], w.shape[1]) if zero_unowned else None
        return jit_kernels(a).m_grouped_bf16_gemm_nt_contiguous(a, w, meta.starts, meta.ends, out)
    out = _grouped_mm_torch(a, w.transpose(1, 2), meta, engine)
    if zero_unowned and engine == "grouped_mm":
        owned = torch.arange(out.shape[0], device=out.device) < meta.ends[-1:]
        out = torch.where(owned[:, None], out, 0)
    return out


def grouped_mm_nn(a: torch.Tensor, w: torch.Tensor, meta: RoutingMeta, engine: str) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ w[e] for a [P, K] pool and weights w [E, K, N]."""
    if engine == "sm90":
        return jit_kernels(a).m_grouped_bf16_gemm_nn_contiguous(a, w, meta.starts, meta.ends)
    return _grouped_mm_torch(a, w, meta, engine)


def _grouped_mm_torch(a, b_kn, meta, engine):
    if engine == "grouped_mm":
        return torch._grouped_mm(a, b_kn, offs=meta.ends)
    out = a.new_zeros(a.shape[0], b_kn.shape[2])
    for e, (start, end) in enumerate(zip(meta.starts.tolist(), meta.ends.tolist())):
        if end > start:
            out[start:end] = a[start:end] @ b_kn[e].to(a.dtype)
    return out


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, meta: RoutingMeta, engine: str) -> torch.Tensor:
    """dW[e] = a[rows of e]^T @ b[rows of e]: [E, a.shape[1], b.shape[1]], zero for empty experts."""
    if engine == "sm90":
        return jit_kernels(a).k_grouped_bf16_gemm_tn_contiguous(a, b, meta.starts, meta.ends)
    if engine == "grouped_mm":
        # Empty groups come out as zeros on SM90 (k-grouped with K = 0).
        return torch._grouped_mm(a.t(), b, offs=meta.ends)
    out = a.new_zeros(meta.num_experts, a.shape[1], b.shape[1])
    for e, (start, end) in enumerate(zip(meta.starts.tolist(), meta.ends.tolist())):
        if end > start:
            out[e] = a[start:end].t() @ b[start:end]
    return out


# ---------------------------------------------------------------------------------------------
# The layer.


def moe_forward(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, engine,
                recipe="bf16"):
    """Returns ``(y, x_pool, h, meta)``; ``x_pool``, ``h`` and ``meta`` are what backward needs.

    Where ``fused_gather(engine)``, ``x_pool`` is an empty [0, H] placeholder: the L1 GEMM read x's
    rows itself, and the backward rebuilds the pool from x."""
    num_experts = l1_weights.shape[0]
    top_k = topk_idx.shape[1]
    cdt = compute_dtype(x, engine)
    meta = routing(topk_idx, num_experts, ROUTING_ALIGN[engine])
    from_x = fused_gather(engine)
    if x.shape[0] == 0:
        x_pool = x.new_zeros(0 if from_x else meta.num_pool_rows, x.shape[1], dtype=cdt)
        h = x.new_zeros(meta.num_pool_rows, l1_weights.shape[1], dtype=cdt)
        return x.new_zeros(x.shape), x_pool, h, meta
    if from_x:
        k = jit_kernels(x)
        gather = k.Gather(meta.row_to_slot, top_k, _env.fused_gather())
        rows = meta.num_pool_rows
        x_pool = x.new_empty(0, x.shape[1], dtype=cdt)
        xc = x.contiguous()
        # h is an output of the op: rows no expert owns are zero rather than stale memory.
        h_out = x.new_zeros(rows, l1_weights.shape[1], dtype=cdt)
        l1 = l1_weights.to(cdt)
        if fused_swiglu(engine, l2_weights.shape[2], x):
            h, act = k.m_grouped_bf16_gemm_nt_swiglu(xc, l1, meta.starts, meta.ends, activation_clamp,
                                                     h_out=h_out, gather=gather)
        else:
            h = k.m_grouped_bf16_gemm_nt_contiguous(xc, l1, meta.starts, meta.ends, h_out, gather=gather)
            act = swiglu_forward(h, activation_clamp)
        y = gemm_combine(act, l2_weights.to(cdt), "nt", meta, topk_weights, engine, x.dtype)
        return y, x_pool, h, meta
    x_pool = gather_rows(x.to(cdt), meta.row_to_slot, top_k)
    if engine == "deep_gemm":
        from .backends import deepgemm

        o, h = deepgemm.deepgemm_forward(x_pool, meta, l1_weights, l2_weights, activation_clamp, recipe)
        y = combine_rows(o, meta.slot_to_row, topk_weights, top_k, x.dtype)
        return y, x_pool, h, meta
    if fused_swiglu(engine, l2_weights.shape[2], x_pool):
        # h is an output of the op: rows no expert owns are zero rather than stale memory.
        h, act = jit_kernels(x_pool).m_grouped_bf16_gemm_nt_swiglu(
            x_pool, l1_weights, meta.starts, meta.ends, activation_clamp,
            h_out=x_pool.new_zeros(x_pool.shape[0], l1_weights.shape[1]))
    else:
        h = grouped_mm_nt(x_pool, l1_weights.to(cdt), meta, engine, zero_unowned=True)
        act = swiglu_forward(h, activation_clamp)
    y = gemm_combine(act, l2_weights.to(cdt), "nt", meta, topk_weights, engine, x.dtype)
    return y, x_pool, h, meta


def moe_backward(dy, x_pool, h, meta: RoutingMeta, topk_weights, l1_weights, l2_weights,
                 activation_clamp, engine, recipe="bf16", x_pool_is_x=False):
    """Gradients ``(dx, d topk_weights, d l1_weights, d l2_weights)`` from the saved tensors.

    ``x_pool_is_x``: ``x_pool`` is x [T, H] (the forward gathered in its L1 GEMM); the pool is
    gathered here for dW1, or, with DGE_FUSED_GATHER_BACKWARD on SM90, the backward's GEMMs gather
    dy's and x's rows themselves."""
    top_k = meta.top_k
    cdt = x_pool.dtype
    num_tokens = meta.slot_to_row.shape[0] // top_k
    if num_tokens == 0:  # shapes are static: no sync; also avoids zero-length contractions
        return (torch.zeros_like(dy), torch.zeros_like(topk_weights), torch.zeros_like(l1_weights),
                torch.zeros_like(l2_weights))
    flat_w = topk_weights.reshape(-1)
    row_weight = torch.where(meta.row_to_slot >= 0, flat_w[meta.row_to_slot.clamp(min=0).long()], 0)
    if x_pool_is_x and engine == "sm90" and _env.fused_gather_backward():
        # The forward gathered x in its L1 GEMM; the backward's GEMMs gather too: dy's rows in the
        # L2 dgrad (A) and in dW2 (A), x's rows in dW1 (B). No pool of dy or x is built.
        return _moe_backward_gathering(dy.to(cdt).contiguous(), x_pool.contiguous(), h, meta, row_weight,
                                       topk_weights, l1_weights, l2_weights, activation_clamp, engine)
    dy_pool = gather_rows(dy.to(cdt), meta.row_to_slot, top_k)
    if engine == "deep_gemm":
        from .backends import deepgemm

        dx_pool, d_row_weight, d_l1, d_l2 = deepgemm.deepgemm_backward(
            dy_pool, x_pool, h, meta, row_weight, l1_weights, l2_weights, activation_clamp, recipe)
        del dy_pool
        dx = combine_rows(dx_pool, meta.slot_to_row, None, top_k, dy.dtype)
        return _finish_backward(dx, d_row_weight, d_l1, d_l2, meta, topk_weights, l1_weights, l2_weights)
    if fused_swiglu(engine, l2_weights.shape[2], h):
        # da' = dy @ l2[e] stays in fp32 registers; the epilogue writes dh, act_w, <da', act>.
        dh, d_row_weight, act_w = jit_kernels(h).m_grouped_bf16_gemm_nn_swiglu_bwd(
            dy_pool, l2_weights, h, row_weight, meta.starts, meta.ends, activation_clamp)
    else:
        da = grouped_mm_nn(dy_pool, l2_weights.to(cdt), meta, engine)  # l2[e] is [H, I]: dy @ l2[e]
        dh, d_row_weight, act_w = swiglu_backward(h, da, row_weight, activation_clamp)
        del da
    d_l2 = grouped_wgrad(dy_pool, act_w, meta, engine)  # [E, H, I]
    del dy_pool, act_w
    dx = gemm_combine(dh, l1_weights.to(cdt), "nn", meta, None, engine, dy.dtype)  # l1[e] is [2I, H]: dh @ l1[e]
    if x_pool_is_x:
        x_pool = gather_rows(x_pool.contiguous(), meta.row_to_slot, top_k)
    d_l1 = grouped_wgrad(dh, x_pool, meta, engine)  # [E, 2I, H]
    del dh
    return _finish_backward(dx, d_row_weight, d_l1, d_l2, meta, topk_weights, l1_weights, l2_weights)


def _finish_backward(dx, d_row_weight, d_l1, d_l2, meta, topk_weights, l1_weights, l2_weights):
    """d topk_weights from the per-row <da', act>; the gradients in the parameters' dtypes."""
    top_k = meta.top_k
    num_tokens = meta.slot_to_row.shape[0] // top_k
    d_topk = torch.where(meta.slot_to_row >= 0, d_row_weight[meta.slot_to_row.clamp(min=0).long()], 0)
    d_topk = d_topk.view(num_tokens, top_k).to(topk_weights.dtype)
    return dx, d_topk, d_l1.to(l1_weights.dtype), d_l2.to(l2_weights.dtype)


def _moe_backward_gathering(dy, x, h, meta, row_weight, topk_weights, l1_weights, l2_weights, activation_clamp,
                            engine):
    """The SM90 backward whose GEMMs read dy's and x's rows through row_to_slot (cp.async loader)."""
    k = jit_kernels(h)
    gather = k.Gather(meta.row_to_slot, meta.top_k, "cp_async")
    if dy.data_ptr() % 16:  # cp.async reads 16-byte chunks: a fresh copy is aligned
        dy = dy.clone()
    l2 = l2_weights.to(h.dtype)
    if fused_swiglu(engine, l2_weights.shape[2], h):
        dh, d_row_weight, act_w = k.m_grouped_bf16_gemm_nn_swiglu_bwd(
            dy, l2, h, row_weight, meta.starts, meta.ends, activation_clamp, gather=gather)
    else:
        da = k.m_grouped_bf16_gemm_nn_contiguous(dy, l2, meta.starts, meta.ends, gather=gather)
        dh, d_row_weight, act_w = swiglu_backward(h, da, row_weight, activation_clamp)
        del da
    d_l2 = k.k_grouped_bf16_gemm_tn_contiguous(dy, act_w, meta.starts, meta.ends, gather_a=gather)  # [E, H, I]
    del act_w
    dx = gemm_combine(dh, l1_weights.to(h.dtype), "nn", meta, None, engine, dy.dtype)  # l1[e] is [2I, H]
    d_l1 = k.k_grouped_bf16_gemm_tn_contiguous(dh, x, meta.starts, meta.ends, gather_b=gather)  # [E, 2I, H]
    del dh
    return _finish_backward(dx, d_row_weight, d_l1, d_l2, meta, topk_weights, l1_weights, l2_weights)
