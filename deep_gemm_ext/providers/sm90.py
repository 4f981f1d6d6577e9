"""Our SM90 grouped GEMMs (deep_gemm_ext.jit_kernels): every epilogue and the gathering prologue in
bf16; under the fp8 recipe the blockwise-fp8 M-grouped GEMM (store and slot-scatter epilogues) on
operands quantized 1x128 by the quantization kernels (a gathered operand is quantized straight into
the pool; an :class:`Fp8Rows` operand, dh from the SwiGLU backward, is read as it is) and the weight
cache's 128x128-block copies, and weight gradients in bf16 (the plan's default under this provider)
or, with DGE_FP8_WGRAD=fp8, on the fp8 K-grouped GEMM over operands quantized 128x1 along the
tokens and transposed: dh and act_w by the SwiGLU backward kernel that also quantizes dh's rows
(:class:`Fp8Cols` operands), x and dy by one kernel each straight from the token rows."""
from __future__ import annotations

import functools

import torch

from .. import elementwise
from ..routing import TOKEN_GROUP_ALIGNMENT, RoutingMeta
from .base import Fp8Cols, Fp8Rows, GemmProvider, Gather, ScatterSlots, fp8_cols_rows

try:
    from .. import jit_kernels as _kernels
except ImportError:  # no cuda-python: the provider is never chosen (plan.jit_available is False)
    _kernels = None

# The layer's fp8 M-grouped GEMMs (the L1 and L2 forward, both data gradients): 128 x 192 tiles on the
# serial mainloop, one CTA per cluster, K compiled in where a ring of 4 divides the k-blocks or there are
# at most 16 of them (fp8_static_k_stages; else the K-argument kernel). Same bits as every other tile, mainloop and cluster choice. Measured inside the
# layer (the step's own kernel times under torch.profiler, Qwen3-30B T16384, docs/perf-notes.md v26):
# the four fp8 GEMMs 2630 us a step, against 2873 us with the 128-wide tile on the overlap mainloop that
# ran before (clusters of 2 for the slot-scatter GEMMs and the store GEMMs with N >= 1536) and 2744 us
# with that tile on one CTA. Timed alone (`scripts/gemm_bench.py --fp8-tiles`) the order of the two tiles
# changed between machines at Qwen3-30B (0.90-1.09x), the 192-wide one won at Qwen3-235B (1.04-1.14x),
# and clusters of 2 ran at 0.82-1.03x of one CTA.
_FP8_TILE = dict(mainloop="serial", block_n=192, cluster_n=1, static_k=True)


def _fp8_gemm_options(n: int, k: int, scatter: bool) -> dict:
    """The launcher's tile options for one fp8 M-grouped GEMM of the layer: N x K the weight's, ``scatter``
    whether it writes slots (the L2 forward, the L1 dgrad). The same for all of them today (_FP8_TILE)."""
    return dict(_FP8_TILE)


def _gather(g: Gather | None, src):
    """The kernels' Gather for ``g``, and the token matrix, copied when cp.async could not read it
    (16-byte chunks need a 16-byte aligned base; a fresh copy is aligned)."""
    if g is None:
        return None, src
    if g.await_rows is not None:  # rows still arriving: read in place (the launcher checks alignment)
        return _kernels.Gather(g.row_to_slot, g.top_k, g.mode, g.await_rows), src
    if src.data_ptr() % 16:
        src = src.clone()
    return _kernels.Gather(g.row_to_slot, g.top_k, g.mode), src


class Sm90Provider(GemmProvider):
    row_alignment = TOKEN_GROUP_ALIGNMENT
    recipes = ("bf16", "fp8")
    gathers = True
    takes_fp8_rows = True
    takes_fp8_cols = True
    fp8_quantizers_gather = True

    def supports(self, recipe, epilogue):
        return epilogue is ScatterSlots

    def m_grouped(self, a, w, meta: RoutingMeta, layout, *, recipe, gather=None, epilogue=None, zero_unowned=False):
        if recipe.fp8:
            return self._m_grouped_fp8(a, w, meta, layout, gather, epilogue, zero_unowned)
        k = _kernels
        if gather is not None and layout != "nt":
            raise ValueError(f"gather with layout={layout!r}: the bf16 GEMMs gather the L1 forward's A (layout 'nt') "
                             f"only; the backward reads pools")
        g, a = _gather(gather, a)
        if layout == "nt":
            gemm = functools.partial(k.m_grouped_bf16_gemm_nt_contiguous, gather=g)
        else:
            gemm = k.m_grouped_bf16_gemm_nn_contiguous
        if isinstance(epilogue, ScatterSlots):
            scatter = k.Scatter(meta.row_to_slot, meta.slot_to_row.shape[0], epilogue.weights)
            return gemm(a, w, meta.starts, meta.ends, scatter=scatter)
        if zero_unowned:
            out = a.new_empty(meta.num_pool_rows, w.shape[1] if layout == "nt" else w.shape[2])
            return _unowned_zeroed(gemm(a, w, meta.starts, meta.ends, out), meta)
        return gemm(a, w, meta.starts, meta.ends)

    def _m_grouped_fp8(self, a, w, meta: RoutingMeta, layout, gather, epilogue, zero_unowned):
        k = _kernels
        if epilogue is not None and not isinstance(epilogue, ScatterSlots):
            raise ValueError(f"epilogue={type(epilogue).__name__}: the fp8 GEMM stores or scatters to slots only")
        if isinstance(a, Fp8Rows):
            if gather is not None:
                raise ValueError("an Fp8Rows operand is the pool itself: it takes no gather")
            a_q, sa = a
        elif gather is not None:
            # The routing's own rows: its inverse map lets the gathers read each token once.
            inverse = meta.slot_to_row if gather.row_to_slot is meta.row_to_slot else None
            a_q, sa = elementwise.quantize_pool_rows_fp8(a, gather.row_to_slot, gather.top_k, k, inverse)
        else:
            a_q, sa = k.quantize_rows_fp8(a)
        # Both orientations are K-major 128x128-block copies: "nn" (a @ W[e]) is NT over W's transpose.
        b_q, sb = w.nk if layout == "nt" else w.kn
        if isinstance(epilogue, ScatterSlots):
            scatter = k.Scatter(meta.row_to_slot, meta.slot_to_row.shape[0], epilogue.weights)
            return k.m_grouped_fp8_gemm_nt_contiguous(a_q, sa, b_q, sb, meta.starts, meta.ends, scatter=scatter,
                                                    **_fp8_gemm_options(b_q.shape[1], b_q.shape[2], True))
        out = a_q.new_empty(meta.num_pool_rows, b_q.shape[1], dtype=torch.bfloat16) if zero_unowned else None
        out = k.m_grouped_fp8_gemm_nt_contiguous(a_q, sa, b_q, sb, meta.starts, meta.ends, out,
                                                 **_fp8_gemm_options(b_q.shape[1], b_q.shape[2], False))
        return _unowned_zeroed(out, meta) if zero_unowned else out

    def k_grouped(self, a, b, meta: RoutingMeta, *, recipe, gather_a=None, gather_b=None):
        if recipe.fp8 and recipe.fp8_wgrad:
            # Operands quantized 128x1 along the tokens, transposed K-major: at [M, P'], bt [N, P'], the
            # pool zero-padded to P' = P rounded up to 16 rows (16-byte rows of e4m3 for TMA).
            # An Fp8Cols operand (dh and act_w from the SwiGLU backward) is read as it is.
            k = _kernels
            rows = fp8_cols_rows(meta.num_pool_rows)
            at_q, sa = _fp8_cols("a", a, gather_a, rows)
            bt_q, sb = _fp8_cols("b", b, gather_b, rows)
            return k.k_grouped_fp8_gemm_nt_contiguous(at_q, sa, bt_q, sb, meta.starts, meta.ends)
        if gather_a is not None or gather_b is not None:
            # A K-grouped GEMM that gathers re-reads each row for every tile of its expert: 1.9-4.2x the
            # time of the GEMM on a pool (docs/perf-notes.md v39), more than the pool's gathering pass.
            raise ValueError("gather_a / gather_b: the bf16 weight gradients read pools gathered once; only the fp8 "
                             "ones (DGE_FP8_WGRAD=fp8) gather, in their quantization kernels")
        return _kernels.k_grouped_bf16_gemm_tn_contiguous(a, b, meta.starts, meta.ends)


def _fp8_cols(label: str, operand, gather: Gather | None, rows: int):
    """``operand`` as the K-grouped fp8 GEMM's transposed column-quantized ``(data, scale)``: an Fp8Cols as
    it is (checked), else quantized here (a gathered one straight from the token rows)."""
    if isinstance(operand, Fp8Cols):
        if gather is not None:
            raise ValueError(f"{label}: an Fp8Cols operand is the quantized pool itself: it takes no gather")
        data, scale = operand
        if data.dim() != 2 or data.shape[1] != rows or data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{label}: Fp8Cols data {data.dtype} {tuple(data.shape)}, expected float8_e4m3fn "
                             f"[C, {rows}] (the pool's rows rounded up to 16)")
        return data, scale
    return _kernels.quantize_cols_transposed_fp8(operand, gather=None if gather is None else gather[:2], rows=rows)


def _unowned_zeroed(out: torch.Tensor, meta: RoutingMeta) -> torch.Tensor:
    """``out`` with the rows past the last expert's block zeroed (the GEMM writes all the others):
    a kernel that reads where they start on the device, not a fill of the whole tensor. Launched after
    the GEMM (the rows are disjoint from the GEMM's), so the GEMM, which the GPU waits for, goes first."""
    return _kernels.zero_rows_past(out, meta.ends)
