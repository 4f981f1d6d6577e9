"""Blockwise-FP8 M-grouped GEMM on the SM90 grouped GEMM core (kernels/impls/sm90_bf16_grouped_gemm.cuh
with the MainloopFP8 policy of kernels/mma/sm90_mainloop_fp8.cuh).

    m_grouped_fp8_gemm_nt_contiguous(a_q [P, K], sa [P, ceil(K/128)], b_q [E, N, K], sb [E, ceil(N/128), ceil(K/128)],
                                     starts, ends)  ->  out [P, N] bf16

    out[r, n] = sum over k-blocks kb of (sum_{k in kb} a_q[r, k] * b_q[e, n, k]) * sa[r, kb] * sb[e, n // 128, kb]

for every pool row r of expert e (rows [starts[e], ends[e])), in the format of deep_gemm_ext.recipes.fp8:
a_q row-quantized 1x128 along K (``quantize_rows``), b_q in 128x128 blocks (``quantize_weight_blocks``,
an ``Fp8ExpertWeights.nk`` copy for the forward or ``.kn`` for a data gradient). Each 128-wide k-block's
partial sum is accumulated by the tensor cores on its own and promoted into the fp32 accumulators with
its two scales; the result is rounded once to bf16. ``recipes.fp8.emulate_grouped_gemm_nt`` computes
the same sums in fp32 torch (the accuracy reference). Sizes need not be multiples of 128: a ragged
last k-block or N block reads zeros past the end (TMA's out-of-bounds fill), which is the
emulation's zero padding.

Only the cooperative 128 x 128 tile exists for fp8 (the second, per-k-block accumulator set
doubles the consumer's registers); ``DGE_GEMM_SCHEDULE`` does not apply. The mainloop has two
schedules of the same arithmetic (``mainloop=``, MAINLOOP_SCHEDULES): "serial" (the default) waits
for each k-block's wgmmas before promoting them, "overlap" keeps the next k-block's wgmmas in
flight during the promotion (a third 64-register accumulator set per thread).
"""
from __future__ import annotations

import torch

from .. import jit
from .sm90_bf16_grouped_gemm import (_BLOCK_M, _FP8_BLOCK_N, FP8_MAINLOOPS, GemmConfig, Scatter,
                                     _check_expert_weight, _check_inputs, _check_multiple, _check_out, _check_scatter,
                                     _check_tensor, _launch, _store_or_scatter_args)

FP8_DTYPE = torch.float8_e4m3fn
#: Elements of K (and of N for B) covered by one scale.
SCALE_BLOCK = 128


#: The fp8 mainloop's schedules (``mainloop=``): "serial" promotes each k-block after waiting for its
#: wgmmas; "overlap" issues the next k-block's wgmmas first (two partial accumulator sets), so the
#: tensor cores keep running through the promotion. Bit-identical results.
MAINLOOP_SCHEDULES = tuple(FP8_MAINLOOPS)


def _configs() -> list[GemmConfig]:
    return [GemmConfig("nt", _FP8_BLOCK_N, dtype="fp8", epilogue=epilogue, fp8_mainloop=mainloop)
            for mainloop in MAINLOOP_SCHEDULES for epilogue in ("store", "scatter", "scatter_weighted")]


@jit.register("sm90_fp8_grouped_gemm")
def configs():
    return [(c.name, c.code(), True) for c in _configs()]


def _blocks(size: int) -> int:
    return -(-size // SCALE_BLOCK)


def m_grouped_fp8_gemm_nt_contiguous(a_q: torch.Tensor, sa: torch.Tensor, b_q: torch.Tensor, sb: torch.Tensor,
                                     starts: torch.Tensor, ends: torch.Tensor, out: torch.Tensor | None = None, *,
                                     scatter: Scatter | None = None, mainloop: str = "serial") -> torch.Tensor:
    """out [P, N] bf16 with ``out[r] = dequant(a_q, sa)[r] @ dequant(b_q, sb)[e].T`` for every pool row r
    of expert e, accumulated in fp32 with the scales applied per 128-wide k-block (module docstring).

    a_q [P, K] float8_e4m3fn, sa [P, ceil(K/128)] float32, b_q [E, N, K] float8_e4m3fn,
    sb [E, ceil(N/128), ceil(K/128)] float32, starts/ends [E] int32 on the device (multiples of 128,
    as for the bf16 GEMMs); all contiguous. K must be a multiple of 16 (16-byte rows for TMA), N of 8.
    Output rows no expert owns are left unwritten. ``scatter``: out is [num_slots, N] in slot order
    and row r goes to out[row_to_slot[r]] (times the slot's weight when given), as in
    ``m_grouped_bf16_gemm_nt_contiguous``. ``mainloop``: the mainloop's schedule, "serial" or "overlap"
    (MAINLOOP_SCHEDULES), the same bits under both.
    """
    if not isinstance(mainloop, str) or mainloop not in MAINLOOP_SCHEDULES:
        raise ValueError(f"mainloop={mainloop!r}: expected one of {MAINLOOP_SCHEDULES}")
    # Types and shapes first (checkable anywhere), then devices.
    for label, t, dim, dtype in (("a_q", a_q, 2, FP8_DTYPE), ("sa", sa, 2, torch.float32), ("b_q", b_q, 3, FP8_DTYPE),
                                 ("sb", sb, 3, torch.float32), ("starts", starts, 1, torch.int32),
                                 ("ends", ends, 1, torch.int32)):
        _check_tensor(label, t, dim, dtype)
    if starts.shape != ends.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and ends {tuple(ends.shape)}: expected the same shape [E]")
    num_experts = starts.shape[0]
    rows, k = a_q.shape
    experts_b, n, k_b = b_q.shape
    _check_expert_weight("b_q", b_q, experts_b, k_b, num_experts, k, "K", "a_q", a_q)
    if tuple(sa.shape) != (rows, _blocks(k)):
        raise ValueError(f"sa: shape {tuple(sa.shape)}, expected ({rows}, {_blocks(k)}) (one scale per row of a_q "
                         f"and {SCALE_BLOCK} of K={k}, rounded up)")
    if tuple(sb.shape) != (num_experts, _blocks(n), _blocks(k)):
        raise ValueError(f"sb: shape {tuple(sb.shape)}, expected ({num_experts}, {_blocks(n)}, {_blocks(k)}) (one "
                         f"scale per {SCALE_BLOCK}x{SCALE_BLOCK} block of b_q {tuple(b_q.shape)}, rounded up)")
    _check_multiple("K", k, 16, "16-byte rows of e4m3 for TMA")
    _check_multiple("N", n, 8, "16-byte rows of the bf16 output for TMA")
    _check_inputs(a_q, b_q, 3, starts, ends, names=("a_q", "b_q"), dtype=FP8_DTYPE,
                  extra=(("sa", sa, 2, torch.float32), ("sb", sb, 3, torch.float32)))
    _check_scatter(scatter, rows, a_q.device)
    out = _check_out(out, (rows if scatter is None else scatter.num_slots, n), a_q.device)
    if rows == 0 or num_experts == 0 or n == 0:
        return out
    if k == 0:
        raise ValueError(f"a_q: shape {tuple(a_q.shape)}: K=0, expected a non-empty contraction")
    epilogue = "store" if scatter is None else "scatter" if scatter.weights is None else "scatter_weighted"
    config = GemmConfig("nt", _FP8_BLOCK_N, dtype="fp8", epilogue=epilogue, fp8_mainloop=mainloop)
    with jit.device_guard(a_q):
        b_map = jit.make_tma_2d(b_q, 64, 128, rows=num_experts * n, cols=k)
        _launch(config, a_q, b_map, _store_or_scatter_args(out, scatter, rows, n), starts, ends, rows, n, k,
                -(-rows // _BLOCK_M) * -(-n // _FP8_BLOCK_N), mainloop_args=dict(scale_a=sa, scale_b=sb))
    return out
