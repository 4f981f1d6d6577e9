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

The fp8 tiles are 128 x 128 and 128 x 192 (FP8_BLOCK_NS: the second, per-k-block accumulator set
doubles the consumer's registers). The mainloop has two
schedules of the same arithmetic (``mainloop=``, MAINLOOP_SCHEDULES): "serial" (the default) waits
for each k-block's wgmmas before promoting them, "overlap" keeps the next k-block's wgmmas in
flight during the promotion (a third 64-register accumulator set per thread).

The weight gradient of the recipe, K-grouped over the pool rows:

    k_grouped_fp8_gemm_nt_contiguous(at_q [M, P], sa [M, ceil(P/128)], bt_q [N, P], sb [N, ceil(P/128)],
                                     starts, ends)  ->  out [E, M, N] bf16

    out[e][m, n] = sum over k-blocks kb of expert e of (sum_{k in kb} at_q[m, k] * bt_q[n, k]) * sa[m, kb] * sb[n, kb]

i.e. ``D[e] = A_e^T @ B_e`` for pools A [P, M], B [P, N] quantized along their rows in 128 x 1 tiles
(``quantize_cols``), given transposed: ``at_q, sa = quantize_rows(A.T)`` equals ``quantize_cols(A)``
with data and scales transposed, bit for bit. The kernel reads them K-major (e4m3 wgmma's only
major), each expert's k-blocks starting at its first pool row; ``recipes.fp8.emulate_grouped_gemm_tn``
is the fp32 reference. Both mainloop schedules (``mainloop=``); the scales of both operands are staged
in shared memory per stage by the producer, a consumer thread reading its 2 row and 32 column scales.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import jit
from .sm90_bf16_grouped_gemm import (_BLOCK_M, _FP8_BLOCK_N, FP8_BLOCK_NS, FP8_MAINLOOPS, GemmConfig, Scatter,
                                     _check_cluster, _check_expert_weight, _check_inputs,
                                     _check_multiple, _check_out, _check_scatter, _check_tensor, _launch,
                                     _store_or_scatter_args, cached_config, checked, checks_key,
                                     _check_walk, fp8_static_k_stages, resolve_walk)

FP8_DTYPE = torch.float8_e4m3fn
#: Elements of K (and of N for B) covered by one scale.
SCALE_BLOCK = 128


#: The fp8 mainloop's schedules (``mainloop=``): "serial" promotes each k-block after waiting for its
#: wgmmas; "overlap" issues the next k-block's wgmmas first (two partial accumulator sets), so the
#: tensor cores keep running through the promotion. Bit-identical results.
MAINLOOP_SCHEDULES = tuple(FP8_MAINLOOPS)


def _configs() -> list[GemmConfig]:
    # Clusters of 1, then of 2 (adjacent M blocks sharing the B tile by multicast); 128-wide tiles under
    # both mainloops, 192-wide ones under the serial one.
    return [GemmConfig("nt", block_n, dtype="fp8", epilogue=epilogue, fp8_mainloop=mainloop, cluster_n=cluster)
            for block_n in FP8_BLOCK_NS for cluster in (1, 2)
            for mainloop in (MAINLOOP_SCHEDULES if block_n == _FP8_BLOCK_N else ("serial",))
            for epilogue in ("store", "scatter", "scatter_weighted")]


#: The K-grouped weight-gradient GEMM's configurations, one per mainloop schedule, and the default one.
K_GROUPED_CONFIGS = {mainloop: GemmConfig("k_nt", _FP8_BLOCK_N, dtype="fp8", fp8_mainloop=mainloop)
                     for mainloop in MAINLOOP_SCHEDULES}
K_GROUPED_MAINLOOP = "serial"
K_GROUPED_CONFIG = K_GROUPED_CONFIGS[K_GROUPED_MAINLOOP]


@jit.register("sm90_fp8_grouped_gemm")
def configs():
    return [(c.name, c.code(), True) for c in _configs()]


@jit.register("sm90_fp8_k_grouped_gemm")
def k_grouped_configs():
    return [(c.name, c.code(), True) for c in K_GROUPED_CONFIGS.values()]


def _check_scale_offsets(label: str, scale: torch.Tensor) -> None:
    """The kernels address scales with 32-bit element offsets."""
    if scale.numel() >= 2 ** 32:
        raise ValueError(f"{label}: {scale.numel()} scales, expected fewer than 2**32 (the kernel's 32-bit scale "
                         f"offsets)")


def _blocks(size: int) -> int:
    return -(-size // SCALE_BLOCK)


#: (K-argument configuration, K) -> the configuration that runs (static_k=True).
_STATIC_K_CONFIGS: dict = {}


def _static_k_config(config: GemmConfig, k: int) -> GemmConfig:
    """``config`` with K compiled in, where fp8_static_k_stages gives it a ring and the kernel (built here
    on first use) does not spill: an unrolled loop that spills would run slower than the K-argument
    kernel, which is then the one returned. Where kernels may not load now (``jit.no_loads``: emulated
    ranks whose kernels wait on each other) and the K-compiled one is not loaded yet, the K-argument
    kernel (registered, so loaded beforehand) runs this call: the same bits."""
    key = (config, k)
    chosen = _STATIC_K_CONFIGS.get(key)
    if chosen is None:
        chosen = config
        if fp8_static_k_stages(k, config.block_n) is not None:
            static = dataclasses.replace(config, shape_k=k)
            if all(u.spill_bytes == 0 for u in static.kernel().resources()):
                chosen = static
        _STATIC_K_CONFIGS[key] = chosen
    if chosen is not config and not jit.loads_allowed() and not chosen.kernel().loaded:
        return config
    return chosen


def m_grouped_fp8_gemm_nt_contiguous(a_q: torch.Tensor, sa: torch.Tensor, b_q: torch.Tensor, sb: torch.Tensor,
                                     starts: torch.Tensor, ends: torch.Tensor, out: torch.Tensor | None = None, *,
                                     scatter: Scatter | None = None, mainloop: str = "serial",
                                     cluster_n: int = 1, static_k: bool = False,
                                     block_n: int = _FP8_BLOCK_N, group_m: int | None = None,
                                     expert_groups: bool | None = None) -> torch.Tensor:
    """out [P, N] bf16 with ``out[r] = dequant(a_q, sa)[r] @ dequant(b_q, sb)[e].T`` for every pool row r
    of expert e, accumulated in fp32 with the scales applied per 128-wide k-block (module docstring).

    a_q [P, K] float8_e4m3fn, sa [P, ceil(K/128)] float32, b_q [E, N, K] float8_e4m3fn,
    sb [E, ceil(N/128), ceil(K/128)] float32, starts/ends [E] int32 on the device (multiples of 128,
    as for the bf16 GEMMs); all contiguous. K must be a multiple of 16 (16-byte rows for TMA), N of 8.
    Output rows no expert owns are left unwritten. ``scatter``: out is [num_slots, N] in slot order
    and row r goes to out[row_to_slot[r]] (times the slot's weight when given), as in
    ``m_grouped_bf16_gemm_nt_contiguous``. ``mainloop``: the mainloop's schedule, "serial" or "overlap"
    (MAINLOOP_SCHEDULES), the same bits under both. ``cluster_n``: CTAs per cluster (1 or 2: adjacent
    M blocks share the B tile by multicast), the same bits under both. ``static_k``: run a kernel
    with this K compiled in (built on first use for each K), where ``sm90_bf16_grouped_gemm.fp8_static_k_stages``
    gives it a ring (a depth of FP8_STATIC_K_STAGES divides its k-blocks, or, for the 192-wide tile, there
    are at most FP8_STATIC_K_UNROLLED_BLOCKS of them) and it compiles without spills (else the
    K-argument kernel); the same bits. ``block_n``: the N tile,
    FP8_BLOCK_NS (192: serial mainloop only; each output element's k-block partial sums and promotion
    are those of the 128-wide tile). ``group_m``, ``expert_groups``: the scheduler's walk, as for the bf16
    GEMMs (same bits).
    """
    key = checks_key("fp8 m", a_q, sa, b_q, sb, starts, ends, out, scatter, mainloop, cluster_n, static_k, block_n,
                     group_m, expert_groups)
    rows, n, k, num_experts, config = checked(key, lambda: _m_grouped_checks(
        a_q, sa, b_q, sb, starts, ends, out, scatter, mainloop, cluster_n, static_k, block_n, group_m,
        expert_groups))
    if out is None:
        out = torch.empty((rows if scatter is None else scatter.num_slots, n), dtype=torch.bfloat16,
                          device=a_q.device)
    if config is None:  # nothing to compute
        return out
    with jit.device_guard(a_q):
        b_map = jit.make_tma_2d(b_q, 64, 128, rows=num_experts * n, cols=k)
        _launch(config, a_q, b_map, _store_or_scatter_args(out, scatter, rows, n), starts, ends, rows, n, k,
                -(-rows // _BLOCK_M) * -(-n // block_n), mainloop_args=dict(scale_a=sa, scale_b=sb))
    return out


def _m_grouped_checks(a_q, sa, b_q, sb, starts, ends, out, scatter, mainloop, cluster_n, static_k, block_n,
                      group_m=None, expert_groups=None):
    """Every check of :func:`m_grouped_fp8_gemm_nt_contiguous` that its key settles;
    ``(rows, N, K, E, config)``, config None when there is nothing to compute."""
    if not isinstance(mainloop, str) or mainloop not in MAINLOOP_SCHEDULES:
        raise ValueError(f"mainloop={mainloop!r}: expected one of {MAINLOOP_SCHEDULES}")
    if isinstance(block_n, bool) or block_n not in FP8_BLOCK_NS:
        raise ValueError(f"block_n={block_n!r}: expected one of {FP8_BLOCK_NS}")
    if block_n != _FP8_BLOCK_N and mainloop != "serial":
        raise ValueError(f"block_n={block_n} with mainloop={mainloop!r}: the {block_n}-wide tile runs the serial "
                         f"mainloop only (two partial sums of its slice do not fit the registers)")
    _check_cluster(cluster_n)
    _check_walk(group_m, expert_groups, cluster_n=cluster_n)
    if not isinstance(static_k, bool):
        raise ValueError(f"static_k={static_k!r}: expected a bool")
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
    _check_scale_offsets("sa", sa)
    _check_multiple("K", k, 16, "16-byte rows of e4m3 for TMA")
    _check_multiple("N", n, 8, "16-byte rows of the bf16 output for TMA")
    _check_inputs(a_q, b_q, 3, starts, ends, names=("a_q", "b_q"), dtype=FP8_DTYPE,
                  extra=(("sa", sa, 2, torch.float32), ("sb", sb, 3, torch.float32)))
    _check_scatter(scatter, rows, a_q.device)
    if out is not None:
        _check_out(out, (rows if scatter is None else scatter.num_slots, n), a_q.device)
    if rows == 0 or num_experts == 0 or n == 0:
        return rows, n, k, num_experts, None
    if k == 0:
        raise ValueError(f"a_q: shape {tuple(a_q.shape)}: K=0, expected a non-empty contraction")
    epilogue = "store" if scatter is None else "scatter_weighted" if scatter.weighted else "scatter"
    group_m, expert_groups = resolve_walk(group_m, expert_groups, rows, num_experts, n * k * b_q.element_size(),
                                          cluster_n=cluster_n)
    config = cached_config("nt", block_n, dtype="fp8", epilogue=epilogue, fp8_mainloop=mainloop,
                           cluster_n=cluster_n, group_m=group_m, expert_groups=expert_groups)
    if static_k:
        config = _static_k_config(config, k)
    return rows, n, k, num_experts, config


def k_grouped_fp8_gemm_nt_contiguous(at_q: torch.Tensor, sa: torch.Tensor, bt_q: torch.Tensor, sb: torch.Tensor,
                                     starts: torch.Tensor, ends: torch.Tensor,
                                     out: torch.Tensor | None = None, *,
                                     mainloop: str = K_GROUPED_MAINLOOP) -> torch.Tensor:
    """out [E, M, N] bf16 with ``out[e] = dequant(at_q, sa)[:, s:t] @ dequant(bt_q, sb)[:, s:t].T`` over
    expert e's pool rows [s, t), accumulated in fp32 with the scales applied per 128-row k-block
    (module docstring); experts without rows get zeros.

    at_q [M, P] float8_e4m3fn, sa [M, ceil(P/128)] float32, bt_q [N, P] float8_e4m3fn,
    sb [N, ceil(P/128)] float32 (the transposed pools, ``quantize_rows(A.T)``, ``quantize_rows(B.T)``),
    starts/ends [E] int32 on the device; all contiguous. Every expert's rows start on a multiple of
    128 and end on one or at P (the routed pool's alignment; not checked on the host, which would
    synchronise). M must be a multiple of 128 (output tiles do not cross experts), N of 8, P of 16
    (16-byte rows of e4m3 for TMA). ``mainloop``: "serial" or "overlap" (MAINLOOP_SCHEDULES), same bits.
    """
    if mainloop not in K_GROUPED_CONFIGS:
        raise ValueError(f"mainloop={mainloop!r}, expected one of {MAINLOOP_SCHEDULES}")
    for label, t, dim, dtype in (("at_q", at_q, 2, FP8_DTYPE), ("sa", sa, 2, torch.float32),
                                 ("bt_q", bt_q, 2, FP8_DTYPE), ("sb", sb, 2, torch.float32),
                                 ("starts", starts, 1, torch.int32), ("ends", ends, 1, torch.int32)):
        _check_tensor(label, t, dim, dtype)
    if starts.shape != ends.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and ends {tuple(ends.shape)}: expected the same shape [E]")
    num_experts = starts.shape[0]
    m, rows = at_q.shape
    n, rows_b = bt_q.shape
    if rows_b != rows:
        raise ValueError(f"bt_q: shape {tuple(bt_q.shape)} contracts over {rows_b} pool rows, expected P={rows} of "
                         f"at_q {tuple(at_q.shape)}")
    for label, scale, size in (("sa", sa, m), ("sb", sb, n)):
        if tuple(scale.shape) != (size, _blocks(rows)):
            raise ValueError(f"{label}: shape {tuple(scale.shape)}, expected ({size}, {_blocks(rows)}) (one scale per "
                             f"row and {SCALE_BLOCK} pool rows of P={rows}, rounded up)")
    _check_multiple("M", m, _BLOCK_M, "output tiles of 128 rows must not cross experts")
    _check_multiple("N", n, 8, "16-byte rows of the bf16 output for TMA")
    _check_multiple("P", rows, 16, "16-byte rows of e4m3 for TMA")
    _check_scale_offsets("sa", sa)
    _check_scale_offsets("sb", sb)
    _check_inputs(at_q, bt_q, 2, starts, ends, names=("at_q", "bt_q"), dtype=FP8_DTYPE,
                  extra=(("sa", sa, 2, torch.float32), ("sb", sb, 2, torch.float32)))
    out = _check_out(out, (num_experts, m, n), at_q.device)
    if num_experts == 0 or m == 0 or n == 0:
        return out
    if rows == 0:
        return out.zero_()
    config = K_GROUPED_CONFIGS[mainloop]
    with jit.device_guard(at_q):
        b_map = jit.make_tma_2d(bt_q, 64, 128)
        c_map = jit.make_tma_2d(out, 64, 64, rows=num_experts * m, cols=n)
        _launch(config, at_q, b_map, dict(tma_c=c_map), starts, ends, m, n, rows,
                num_experts * (m // _BLOCK_M) * -(-n // _FP8_BLOCK_N), mainloop_args=dict(scale_a=sa, scale_b=sb))
    return out
