"""Time the SM90 grouped GEMMs of one MoE layer against torch._grouped_mm, in one process.

    python scripts/gemm_bench.py [--workload qwen3-30b-a3b-t16384] [--reps 20] [--json out.json]
    python scripts/gemm_bench.py --fp8 [--workload W ...] [--reps 20] [--json out.json]
    python scripts/gemm_bench.py --wgrad [--workload W ...] [--reps 20] [--json out.json]
    python scripts/gemm_bench.py --clusters [--workload W ...] [--reps 20] [--json out.json]
    python scripts/gemm_bench.py --cublas [--workload W ...] [--reps 20] [--json out.json]
    python scripts/gemm_bench.py --upstream [--workload W ...] [--reps 20] [--json out.json]
    python scripts/gemm_bench.py --fp8-tiles [--workload W ...] [--reps 20] [--json out.json]
    python scripts/gemm_bench.py --ceiling [--reps 10] [--json out.json]
    python scripts/gemm_bench.py --walks [--walk-list 16,8,e16,e8] [--workload W ...] [--reps 20] [--json out.json]

For each GEMM of the layer (L1/L2 forward, dgrad, wgrad) on a uniformly routed, 128-aligned pool:
median of --reps CUDA-event timings after warm-up (each of --calls back-to-back calls, so that
the launchers' host work overlaps the kernels), TFLOP/s over the pool rows the experts own, and
the ratio to torch._grouped_mm on the same operands (offs = ends). Prints a table last.

--fp8: per M-grouped GEMM of each workload (L1/L2 forward, and the dgrads on the transposed weight
copies), TFLOP/s of our blockwise-fp8 GEMM (m_grouped_fp8_gemm_nt_contiguous, operands quantized by
recipes.fp8 beforehand, not timed) under both mainloop schedules ("serial", the default, and
"overlap"), and "overlap" with K compiled in (``static_k=True``, as the layer runs it), next to our bf16
GEMM on the same random operands; the "bits" column says whether the three fp8 outputs are equal bit
for bit. A second table has the two weight-gradient GEMMs
(dW1 = dh^T x, dW2 = dy^T act): our bf16 K-grouped GEMM against the fp8 K-grouped one
(k_grouped_fp8_gemm_nt_contiguous, under both mainloops, "bits" saying whether they agree bit for bit)
without and with the two quantization passes that make its operands (quantize_cols_transposed_fp8 of each
pool), and the fp8 result's relative error against the bf16 one. --wgrad prints that table alone.

--clusters: per GEMM of each workload (default Qwen3-30B-A3B T16384 and Qwen3-235B-A22B T8192), TFLOP/s
of clusters of 1 and of 2 CTAs (the launchers' ``cluster_n``: adjacent M blocks sharing the B tile by
multicast) for the bf16 GEMMs (store epilogue, and the layer's combine epilogues) and the fp8 M-grouped
GEMMs (both mainloops), the better of two alternating rounds each, next to one dense cuBLAS bf16 GEMM of
the same M x N x K; "bits" says whether cluster 2's output equals cluster 1's bit for bit (it must: same
wgmmas in the same K order).

--cublas: per bf16 GEMM of each workload (default Qwen3-30B-A3B T16384 and Qwen3-235B-A22B T8192: the
store GEMMs, the L1 forward gathering x's rows, and the layer's two combine epilogues), TFLOP/s of ours,
the better of two rounds, next to one dense cuBLAS bf16 GEMM of the same M x N x K and the ratio of the
two; "tile" is the N tile the launcher picked.

--upstream: per GEMM of each workload (default Qwen3-30B-A3B T16384: the M-grouped GEMMs of --fp8 and the two
weight gradients of its second table), TFLOP/s of our GEMMs and of upstream DeepGEMM's SM90 GEMMs on the same
operands, in one process and timed alike: bf16 (upstream m_grouped_bf16_gemm_{nt,nn}_contiguous,
k_grouped_bf16_gemm_tn_contiguous) and blockwise fp8 (m_grouped_fp8_gemm_nt_contiguous,
k_grouped_fp8_gemm_nt_contiguous). Ours run as the layer runs them (providers.sm90: the M-grouped fp8 GEMMs
with the layer's mainloop and cluster choice). Both sides get operands quantized once beforehand (not
timed), upstream in the layouts it asks for (providers.deepgemm: m_indices, each expert's slab K-major for
its fp8 weight gradients; activation scales MN-major and TMA-aligned, get_mn_major_tma_aligned_tensor).
Upstream's K-grouped GEMMs accumulate into an fp32 result (C = D, as the provider calls them), ours write bf16.
"err" is each side's relative error against an fp64 reference on the operands as the kernels read them (bf16,
or the fp8 data times its scales), "check" whether all of them are below _UPSTREAM_MAX_REL_ERR, "bits" whether
the two M-grouped outputs are equal bit for bit (not required: different kernels). Without deep_gemm (or
without an SM90 GPU) it prints "not measured: <reason>" and exits 0.

--fp8-tiles: per M-grouped fp8 GEMM of each workload, TFLOP/s of the 128 x 128 tile (overlap mainloop;
clusters of 1 and 2) against the 128 x 192 tile (serial mainloop, the layer's on one CTA; clusters of 1 and 2),
all with K compiled in (``static_k``: where fp8_static_k_stages gives no ring, the K-argument kernel);
"bits" says whether the 192-wide outputs equal the 128-wide serial ones bit for bit on the rows the
experts own.

--walks: per workload (default DeepSeek-V3 T 8192, Qwen3-235B T 8192, Qwen3-30B T 16384), the layer's four bf16
M-grouped GEMMs as the layer runs them under each scheduler walk of --walk-list (N: fixed groups of N M blocks;
eN: groups of at most N blocks cut within each expert), alternating, the better of two rounds each, with the ratio
to the first walk, select_walk's choice ("chosen"), "=X" after a walk within experts whose tile order equals walk X's
on the workload's experts (e8 and e16 where no expert owns more than 8 blocks: their ratio is the spread of the
measurement), and whether every walk's output equals the first's bit for bit (it must: the walk orders the tiles,
it changes none).

--ceiling: what one dense 8192^3 GEMM reaches on this GPU in a burst and under sustained load, bf16
(torch.matmul, cuBLAS) and fp8 (torch._scaled_mm, e4m3 with per-tensor scales): TFLOP/s with 1, 8, 64 and
256 back-to-back calls per timed repeat (~1 ms to ~0.4 s of continuous load), with the SM clock, the board
power and the share of samples in which the power limit held the clock down (testing.GpuReadings, sampled
while the repeats run; "-" without nvidia-ml-py; the driver refreshes them every few tens of ms, so only
the rows of 64 calls and more describe their own windows). The sustained rows are the ceiling a layer that
keeps the GPU busy for a whole step can be measured against.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg  # noqa: E402
from deep_gemm_ext.jit_kernels import fp8_quant as fq  # noqa: E402
from deep_gemm_ext.jit_kernels import sm90_fp8_grouped_gemm as fg  # noqa: E402
from deep_gemm_ext.providers import deepgemm  # noqa: E402
from deep_gemm_ext.providers.base import Fp8Rows  # noqa: E402
from deep_gemm_ext.providers.sm90 import Sm90Provider  # noqa: E402
from deep_gemm_ext.recipes import RECIPES  # noqa: E402
from deep_gemm_ext.recipes import fp8 as fp8_recipe  # noqa: E402
from deep_gemm_ext.routing import compute_routing_torch  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, GpuReadings, make_routing, median_ms  # noqa: E402

#: The default workloads of --clusters and --cublas.
_TWO_WORKLOADS = ("qwen3-30b-a3b-t16384", "qwen3-235b-a22b-t8192")


def _pool(rows: int, cols: int, pad: torch.Tensor) -> torch.Tensor:
    data = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    data[pad] = 0
    return data


def _cases(w):
    """(name, dense (M, N, K), ours, torch._grouped_mm on the same operands) per GEMM of the layer, and
    the pool rows the experts own."""
    torch.manual_seed(0)
    idx = make_routing(w.num_tokens, w.num_experts, w.top_k, "uniform").cuda()
    meta = compute_routing_torch(idx, w.num_experts, gg.GROUP_ALIGNMENT)
    starts, ends = meta.starts, meta.ends
    rows = meta.num_pool_rows
    used = int(ends[-1].item())
    pad = meta.row_to_slot < 0
    E, H, I = w.num_experts, w.hidden, w.intermediate
    x, act = _pool(rows, H, pad), _pool(rows, I, pad)
    dy, dh = _pool(rows, H, pad), _pool(rows, 2 * I, pad)
    l1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    l2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).to(torch.bfloat16)
    offs = ends
    nt, nn, tn = gg.m_grouped_bf16_gemm_nt_contiguous, gg.m_grouped_bf16_gemm_nn_contiguous, \
        gg.k_grouped_bf16_gemm_tn_contiguous
    cases = [
        ("L1 fwd  nt", (used, 2 * I, H), lambda: nt(x, l1, starts, ends),
         lambda: torch._grouped_mm(x, l1.transpose(-2, -1), offs=offs)),
        ("L2 fwd  nt", (used, H, I), lambda: nt(act, l2, starts, ends),
         lambda: torch._grouped_mm(act, l2.transpose(-2, -1), offs=offs)),
        ("L1 fwd  nt paired", (used, 2 * I, H), lambda: nt(x, l1, starts, ends, paired_n=True), None),
        ("L2 dgrad nn", (used, I, H), lambda: nn(dy, l2, starts, ends),
         lambda: torch._grouped_mm(dy, l2, offs=offs)),
        ("L1 dgrad nn", (used, H, 2 * I), lambda: nn(dh, l1, starts, ends),
         lambda: torch._grouped_mm(dh, l1, offs=offs)),
        ("L1 wgrad tn", (2 * I, H, used), lambda: tn(dh, x, starts, ends),
         lambda: torch._grouped_mm(dh.t(), x, offs=offs)),
        ("L2 wgrad tn", (H, I, used), lambda: tn(dy, act, starts, ends),
         lambda: torch._grouped_mm(dy.t(), act, offs=offs)),
    ]
    return cases, used


def _grouped_table(args) -> int:
    w = WORKLOADS[args.workload[0] if args.workload else "qwen3-30b-a3b-t16384"]
    cases, used = _cases(w)
    results = []
    unpaired = None
    for name, (m, n, k), ours, baseline in cases:
        flops = 2.0 * m * n * k
        # Checked before timing: against torch._grouped_mm on the same operands (the paired tile against the
        # unpaired one), a relative error of a bf16 GEMM's rounding.
        out = ours()
        ref = baseline() if baseline is not None else unpaired
        unpaired = out if "paired" not in name and name.startswith("L1 fwd") else unpaired
        if ref is not None:
            err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
            if not err < 1e-2:  # NaN fails too
                print(f"{name}: FAILED, relative error {err:.3e} against "
                      f"{'torch._grouped_mm' if baseline is not None else 'the unpaired tile'}; not timed")
                return 1
        ms = median_ms(ours, args.reps, calls=args.calls)
        base_ms = None
        if baseline is not None:
            try:
                base_ms = median_ms(baseline, args.reps, calls=args.calls)
            except (RuntimeError, TypeError) as exc:  # a layout torch's grouped GEMM does not take
                print(f"{name}: torch._grouped_mm unavailable ({str(exc).splitlines()[0]})")
        results.append({"gemm": name, "workload": w.name, "pool_rows": used, "us": ms * 1e3,
                        "tflops": flops / ms / 1e9,
                        "torch_us": base_ms * 1e3 if base_ms else None,
                        "torch_tflops": flops / base_ms / 1e9 if base_ms else None})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"{w.name}: {used} pool rows owned by {w.num_experts} experts, {torch.cuda.get_device_name()}; "
          f"TFLOP/s of the rows computed (each expert's rows padded to a multiple of 128: "
          f"{used / (w.num_tokens * w.top_k):.3f}x the routed rows), torch._grouped_mm on the same pool")
    print(f"{'gemm':<18} | {'us':>8} | {'TFLOP/s':>7} | {'torch us':>8} | {'torch TFLOP/s':>13} | x torch")
    for r in results:
        base = (f"{r['torch_us']:8.1f} | {r['torch_tflops']:13.1f} | {r['torch_us'] / r['us']:6.2f}x"
                if r["torch_us"] else f"{'-':>8} | {'-':>13} | {'-':>7}")
        print(f"{r['gemm']:<18} | {r['us']:8.1f} | {r['tflops']:7.1f} | {base}")
    return 0


def _cublas_tflops(m: int, n: int, k: int, reps: int, cache: dict | None = None, calls: int = 1) -> float:
    """TFLOP/s of one dense bf16 cuBLAS GEMM (torch.matmul) of M x N x K on random operands, the better of
    two rounds, timed once per shape when a ``cache`` is given."""
    if cache is not None and (m, n, k) in cache:
        return cache[(m, n, k)]
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    # The better of two rounds, the statistic every table of ours takes.
    tflops = max(2.0 * m * n * k / median_ms(lambda: torch.matmul(a, b), reps, calls=calls) / 1e9 for _ in range(2))
    if cache is not None:
        cache[(m, n, k)] = tflops
    return tflops


def _fp8_cases(w, tiles: bool = False):
    """(name, dense (M, N, K), bf16 GEMM, fp8 GEMM with the serial mainloop, with the overlap mainloop, with
    the overlap mainloop and K compiled in (``static_k``, the layer's)) per M-grouped GEMM of the layer, on the
    same random operands (fp8: quantized once here, 1x128
    activations and 128x128 weight blocks), and a function giving the mask of the pool rows the
    experts own."""
    torch.manual_seed(0)
    idx = make_routing(w.num_tokens, w.num_experts, w.top_k, "uniform").cuda()
    meta = compute_routing_torch(idx, w.num_experts, gg.GROUP_ALIGNMENT)
    starts, ends = meta.starts, meta.ends
    used = int(ends[-1].item())
    pad = meta.row_to_slot < 0
    rows = meta.num_pool_rows
    E, H, I = w.num_experts, w.hidden, w.intermediate
    x, act = _pool(rows, H, pad), _pool(rows, I, pad)
    dy, dh = _pool(rows, H, pad), _pool(rows, 2 * I, pad)
    l1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    l2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).to(torch.bfloat16)
    w1, w2 = fp8_recipe.Fp8ExpertWeights.from_bf16(l1), fp8_recipe.Fp8ExpertWeights.from_bf16(l2)
    q = {name: fp8_recipe.quantize_rows(t) for name, t in (("x", x), ("act", act), ("dy", dy), ("dh", dh))}

    def fp8(a, weights, mainloop, static_k=False, block_n=128, cluster_n=1):
        return lambda: fg.m_grouped_fp8_gemm_nt_contiguous(*q[a], *weights, starts, ends, mainloop=mainloop,
                                                           static_k=static_k, block_n=block_n, cluster_n=cluster_n)

    def both(a, weights):
        if tiles:  # (serial 128, then with K compiled in: overlap 128, overlap 128 c2, serial 192, serial 192 c2)
            return (fp8(a, weights, "serial"), fp8(a, weights, "overlap", True),
                    fp8(a, weights, "overlap", True, 128, 2), fp8(a, weights, "serial", True, 192),
                    fp8(a, weights, "serial", True, 192, 2))
        return fp8(a, weights, "serial"), fp8(a, weights, "overlap"), fp8(a, weights, "overlap", True)

    def owned_rows():
        own = torch.zeros(rows, dtype=torch.bool, device="cuda")
        for s, e in zip(starts.tolist(), ends.tolist()):
            own[s:e] = True
        return own

    return [
        ("L1 fwd  nt", (used, 2 * I, H), lambda: gg.m_grouped_bf16_gemm_nt_contiguous(x, l1, starts, ends),
         *both("x", w1.nk)),
        ("L2 fwd  nt", (used, H, I), lambda: gg.m_grouped_bf16_gemm_nt_contiguous(act, l2, starts, ends),
         *both("act", w2.nk)),
        ("L2 dgrad", (used, I, H), lambda: gg.m_grouped_bf16_gemm_nn_contiguous(dy, l2, starts, ends),
         *both("dy", w2.kn)),
        ("L1 dgrad", (used, H, 2 * I), lambda: gg.m_grouped_bf16_gemm_nn_contiguous(dh, l1, starts, ends),
         *both("dh", w1.kn)),
    ], owned_rows


def _wgrad_cases(w):
    """(name, dense (M, N, K), bf16 K-grouped GEMM, fp8 K-grouped GEMM on operands quantized once
    here, the two quantization passes and that GEMM) per weight-gradient GEMM of the layer."""
    torch.manual_seed(0)
    idx = make_routing(w.num_tokens, w.num_experts, w.top_k, "uniform").cuda()
    meta = compute_routing_torch(idx, w.num_experts, gg.GROUP_ALIGNMENT)
    starts, ends = meta.starts, meta.ends
    used = int(ends[-1].item())
    pad = meta.row_to_slot < 0
    rows = meta.num_pool_rows
    H, I = w.hidden, w.intermediate
    x, act = _pool(rows, H, pad), _pool(rows, I, pad)
    dy, dh = _pool(rows, H, pad), _pool(rows, 2 * I, pad)
    cases = []
    padded = -(-rows // 16) * 16  # the K-grouped GEMM's P % 16 == 0: the layer's padding of the pool
    for name, (a, b) in (("L1 wgrad", (dh, x)), ("L2 wgrad", (dy, act))):
        qa, qb = fq.quantize_cols_transposed_fp8(a, rows=padded), fq.quantize_cols_transposed_fp8(b, rows=padded)

        def bf16(a=a, b=b):
            return gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends)

        def fp8(qa=qa, qb=qb):
            return fg.k_grouped_fp8_gemm_nt_contiguous(*qa, *qb, starts, ends, mainloop="serial")

        def fp8_overlap(qa=qa, qb=qb):
            return fg.k_grouped_fp8_gemm_nt_contiguous(*qa, *qb, starts, ends, mainloop="overlap")

        def fp8_quantized(a=a, b=b):
            return fg.k_grouped_fp8_gemm_nt_contiguous(*fq.quantize_cols_transposed_fp8(a, rows=padded),
                                                       *fq.quantize_cols_transposed_fp8(b, rows=padded), starts, ends)

        cases.append((name, (a.shape[1], b.shape[1], used), bf16, fp8, fp8_overlap, fp8_quantized))
    return cases


def _wgrad_table(args) -> list[dict]:
    results = []
    for workload in args.workload or ("qwen3-30b-a3b-t16384",):
        w = WORKLOADS[workload]
        for name, (m, n, k), bf16, fp8, fp8_overlap, fp8_quantized in _wgrad_cases(w):
            flops = 2.0 * m * n * k
            ref, got, got_overlap = bf16().float(), fp8(), fp8_overlap()
            err = float((got.float() - ref).norm() / ref.norm().clamp(min=1e-30))
            same = bool(torch.equal(got.view(torch.int16), got_overlap.view(torch.int16)))
            del got, got_overlap
            bf16_ms, fp8_ms, ovl_ms, fp8_q_ms = (median_ms(f, args.reps, calls=args.calls)
                                                 for f in (bf16, fp8, fp8_overlap, fp8_quantized))
            results.append({"workload": w.name, "gemm": name, "kind": "k_grouped", "m": m, "n": n, "k": k,
                            "bf16_us": bf16_ms * 1e3, "bf16_tflops": flops / bf16_ms / 1e9, "fp8_us": fp8_ms * 1e3,
                            "fp8_tflops": flops / fp8_ms / 1e9, "fp8_overlap_us": ovl_ms * 1e3,
                            "fp8_overlap_tflops": flops / ovl_ms / 1e9, "fp8_with_quant_us": fp8_q_ms * 1e3,
                            "fp8_overlap_bit_identical": same, "fp8_rel_err_vs_bf16": err})
        torch.cuda.empty_cache()
    print(f"Weight gradients on {torch.cuda.get_device_name()}: our bf16 K-grouped GEMM vs the fp8 K-grouped GEMM "
          "(mainloop 'serial', and 'overlap' as ovl), without and with (fp8+q) the two transposing "
          "column-quantization passes of its operands (serial)")
    print(f"{'workload':<22} | {'gemm':<8} | {'M x N x K':>20} | {'bf16 us':>8} | {'bf16':>6} | {'fp8 us':>8} | "
          f"{'fp8':>6} | {'ovl us':>8} | {'ovl':>6} | {'fp8+q us':>8} | fp8/bf16 | ovl/bf16 | fp8+q/bf16 | bits | "
          f"rel err")
    for r in results:
        shape = f"{r['m']}x{r['n']}x{r['k']}"
        print(f"{r['workload']:<22} | {r['gemm']:<8} | {shape:>20} | {r['bf16_us']:8.1f} | {r['bf16_tflops']:6.1f} | "
              f"{r['fp8_us']:8.1f} | {r['fp8_tflops']:6.1f} | {r['fp8_overlap_us']:8.1f} | "
              f"{r['fp8_overlap_tflops']:6.1f} | {r['fp8_with_quant_us']:8.1f} | "
              f"{r['bf16_us'] / r['fp8_us']:7.2f}x | {r['bf16_us'] / r['fp8_overlap_us']:7.2f}x | "
              f"{r['bf16_us'] / r['fp8_with_quant_us']:9.2f}x | "
              f"{'same' if r['fp8_overlap_bit_identical'] else 'DIFFER'} | {r['fp8_rel_err_vs_bf16']:.2e}")
    return results


def _fp8_table(args) -> int:
    results = []
    for workload in args.workload or ("qwen3-30b-a3b-t16384",):
        w = WORKLOADS[workload]
        cases, owned_rows = _fp8_cases(w)
        for name, (m, n, k), bf16, fp8, overlap, static in cases:
            flops = 2.0 * m * n * k
            # The schedules and the compiled-in K must agree bit for bit on the rows the experts own
            # (the pool's alignment gaps and its rows past the last expert are never written).
            own = owned_rows()
            ref = fp8()[own].view(torch.int16)
            same = all(torch.equal(f()[own].view(torch.int16), ref) for f in (overlap, static))
            bf16_ms, fp8_ms, overlap_ms, static_ms = (median_ms(f, args.reps, calls=args.calls)
                                                      for f in (bf16, fp8, overlap, static))
            results.append({"workload": w.name, "gemm": name, "m": m, "n": n, "k": k, "bf16_us": bf16_ms * 1e3,
                             "bf16_tflops": flops / bf16_ms / 1e9, "fp8_us": fp8_ms * 1e3,
                             "fp8_tflops": flops / fp8_ms / 1e9, "fp8_overlap_us": overlap_ms * 1e3,
                             "fp8_overlap_tflops": flops / overlap_ms / 1e9, "fp8_static_k_us": static_ms * 1e3,
                             "fp8_static_k_tflops": flops / static_ms / 1e9, "fp8_overlap_bit_identical": same})
        torch.cuda.empty_cache()
    print(f"TFLOP/s on {torch.cuda.get_device_name()}: our bf16 GEMM (nt forward, nn dgrad) and our blockwise-fp8 "
          "GEMM (nt on the transposed weight copy for the dgrads), mainloop 'serial' (fp8) and 'overlap' (ovl), "
          "and 'overlap' with K compiled in (static K, the layer's)")
    print(f"{'workload':<22} | {'gemm':<10} | {'M x N x K':>20} | {'bf16 us':>8} | {'bf16':>6} | {'fp8 us':>8} | "
          f"{'fp8':>6} | {'ovl us':>8} | {'ovl':>6} | {'stat us':>8} | {'stat':>6} | fp8/bf16 | ovl/bf16 | "
          f"stat/bf16 | ovl/fp8 | stat/ovl | bits")
    for r in results:
        shape = f"{r['m']}x{r['n']}x{r['k']}"
        print(f"{r['workload']:<22} | {r['gemm']:<10} | {shape:>20} | {r['bf16_us']:8.1f} | {r['bf16_tflops']:6.1f} | "
              f"{r['fp8_us']:8.1f} | {r['fp8_tflops']:6.1f} | {r['fp8_overlap_us']:8.1f} | "
              f"{r['fp8_overlap_tflops']:6.1f} | {r['fp8_static_k_us']:8.1f} | {r['fp8_static_k_tflops']:6.1f} | "
              f"{r['fp8_tflops'] / r['bf16_tflops']:7.2f}x | {r['fp8_overlap_tflops'] / r['bf16_tflops']:7.2f}x | "
              f"{r['fp8_static_k_tflops'] / r['bf16_tflops']:8.2f}x | "
              f"{r['fp8_overlap_tflops'] / r['fp8_tflops']:6.2f}x | "
              f"{r['fp8_static_k_tflops'] / r['fp8_overlap_tflops']:7.2f}x | "
              f"{'same' if r['fp8_overlap_bit_identical'] else 'DIFFER'}")
    print()
    wgrad = _wgrad_table(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results + wgrad, f, indent=2)  # weight-gradient rows carry "kind": "k_grouped"
    return 0 if all(r["fp8_overlap_bit_identical"] for r in results + wgrad) else 1


def _wgrad_only_table(args) -> int:
    if not torch.cuda.is_available():
        print("not measured: no CUDA GPU")
        return 0
    wgrad = _wgrad_table(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(wgrad, f, indent=2)
    return 0 if all(r["fp8_overlap_bit_identical"] for r in wgrad) else 1


def _fp8_tiles_table(args) -> int:
    results = []
    for workload in args.workload or ("qwen3-30b-a3b-t16384",):
        w = WORKLOADS[workload]
        cases, owned_rows = _fp8_cases(w, tiles=True)
        for name, (m, n, k), _, serial, overlap, overlap_c2, wide, wide_c2 in cases:
            flops = 2.0 * m * n * k
            own = owned_rows()
            ref = serial()[own].view(torch.int16)
            same = all(torch.equal(f()[own].view(torch.int16), ref) for f in (overlap, overlap_c2, wide, wide_c2))
            times = [median_ms(f, args.reps, calls=args.calls) for f in (overlap, overlap_c2, wide, wide_c2)]
            results.append({"workload": w.name, "gemm": name, "m": m, "n": n, "k": k, "kind": "fp8_tiles",
                            **{f"{key}_tflops": flops / t / 1e9 for key, t in
                               zip(("n128_overlap", "n128_overlap_c2", "n192", "n192_c2"), times)},
                            "bit_identical": same})
        torch.cuda.empty_cache()
    print(f"TFLOP/s on {torch.cuda.get_device_name()}: our blockwise-fp8 M-grouped GEMM, 128 x 128 tiles (overlap "
          "mainloop) against 128 x 192 tiles (serial mainloop), clusters of 1 and 2, K compiled in (static_k)")
    print(f"{'workload':<22} | {'gemm':<10} | {'M x N x K':>20} | {'n128':>6} | {'n128 c2':>7} | {'n192':>6} | "
          f"{'n192 c2':>7} | best192/best128 | bits")
    for r in results:
        shape = f"{r['m']}x{r['n']}x{r['k']}"
        best128 = max(r["n128_overlap_tflops"], r["n128_overlap_c2_tflops"])
        best192 = max(r["n192_tflops"], r["n192_c2_tflops"])
        print(f"{r['workload']:<22} | {r['gemm']:<10} | {shape:>20} | {r['n128_overlap_tflops']:6.1f} | "
              f"{r['n128_overlap_c2_tflops']:7.1f} | {r['n192_tflops']:6.1f} | {r['n192_c2_tflops']:7.1f} | "
              f"{best192 / best128:14.2f}x | {'same' if r['bit_identical'] else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["bit_identical"] for r in results) else 1


def _layer_operands(w):
    """Random operands of the layer's GEMMs (seed 0, uniform routing): the routing metadata, expert
    ranges and pool sizes, the x / act / dy / dh pools (padding rows zero), the two weights, and the
    weighted (combine) and unweighted slot scatters."""
    torch.manual_seed(0)
    idx = make_routing(w.num_tokens, w.num_experts, w.top_k, "uniform").cuda()
    meta = compute_routing_torch(idx, w.num_experts, gg.GROUP_ALIGNMENT)
    starts, ends = meta.starts, meta.ends
    used = int(ends[-1].item())
    pad = meta.row_to_slot < 0
    rows = meta.num_pool_rows
    E, H, I, T, K = w.num_experts, w.hidden, w.intermediate, w.num_tokens, w.top_k
    x, act = _pool(rows, H, pad), _pool(rows, I, pad)
    dy, dh = _pool(rows, H, pad), _pool(rows, 2 * I, pad)
    l1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    l2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).to(torch.bfloat16)
    weights = torch.rand(T, K, device="cuda")
    combine = gg.Scatter(meta.row_to_slot, T * K, weights)
    plain = gg.Scatter(meta.row_to_slot, T * K)
    return meta, starts, ends, used, rows, H, I, x, act, dy, dh, l1, l2, combine, plain


def _cluster_cases(w):
    """(dtype, name, dense (M, N, K), fn(cluster_n) -> output) per GEMM of the layer, and the pool rows
    the experts own."""
    (meta, starts, ends, used, rows, H, I, x, act, dy, dh, l1, l2, combine, plain) = _layer_operands(w)
    nt, nn, tn = gg.m_grouped_bf16_gemm_nt_contiguous, gg.m_grouped_bf16_gemm_nn_contiguous, \
        gg.k_grouped_bf16_gemm_tn_contiguous
    cases = [
        ("bf16", "L1 fwd  nt", (used, 2 * I, H), lambda c: nt(x, l1, starts, ends, cluster_n=c)),
        ("bf16", "L2 fwd  nt", (used, H, I), lambda c: nt(act, l2, starts, ends, cluster_n=c)),
        ("bf16", "L2 fwd  nt combine", (used, H, I),
         lambda c: nt(act, l2, starts, ends, scatter=combine, cluster_n=c)),
        ("bf16", "L2 dgrad nn", (used, I, H), lambda c: nn(dy, l2, starts, ends, cluster_n=c)),
        ("bf16", "L1 dgrad nn", (used, H, 2 * I), lambda c: nn(dh, l1, starts, ends, cluster_n=c)),
        ("bf16", "L1 dgrad nn combine", (used, H, 2 * I),
         lambda c: nn(dh, l1, starts, ends, scatter=plain, cluster_n=c)),
        ("bf16", "L1 wgrad tn", (2 * I, H, used), lambda c: tn(dh, x, starts, ends, cluster_n=c)),
        ("bf16", "L2 wgrad tn", (H, I, used), lambda c: tn(dy, act, starts, ends, cluster_n=c)),
    ]
    w1, w2 = fp8_recipe.Fp8ExpertWeights.from_bf16(l1), fp8_recipe.Fp8ExpertWeights.from_bf16(l2)
    q = {name: fp8_recipe.quantize_rows(t) for name, t in (("x", x), ("act", act), ("dy", dy), ("dh", dh))}
    for mainloop in fg.MAINLOOP_SCHEDULES:
        def fp8(a, wq, mainloop=mainloop, **kw):
            return lambda c: fg.m_grouped_fp8_gemm_nt_contiguous(*q[a], *wq, starts, ends, mainloop=mainloop,
                                                                 cluster_n=c, **kw)
        dtype = f"fp8 {mainloop}"
        cases += [
            (dtype, "L1 fwd  nt", (used, 2 * I, H), fp8("x", w1.nk)),
            (dtype, "L2 fwd  nt combine", (used, H, I), fp8("act", w2.nk, scatter=combine)),
            (dtype, "L2 dgrad", (used, I, H), fp8("dy", w2.kn)),
            (dtype, "L1 dgrad combine", (used, H, 2 * I), fp8("dh", w1.kn, scatter=plain)),
        ]
    return cases, used


def _variants_row(variants: dict, flops: float, used: int, args) -> dict:
    """One GEMM under each of ``variants`` (label -> fn() -> output): ``bit_identical``, whether every
    output equals the first's where written (pool rows below ends[-1] for a store, every slot for a
    combine under uniform routing, every expert for a K-grouped GEMM; [:used] keeps all of the latter
    two), and each label's TFLOP/s, the better median of two rounds with the variants alternating."""
    outputs = [fn() for fn in variants.values()]
    torch.cuda.synchronize()
    first = outputs[0][:used].view(torch.int16)
    row = {"bit_identical": all(torch.equal(first, o[:used].view(torch.int16)) for o in outputs[1:])}
    del outputs, first
    for _ in range(2):
        for label, fn in variants.items():
            row[label] = max(row.get(label, 0.0), flops / median_ms(fn, args.reps, calls=args.calls) / 1e9)
    return row


def _cluster_table(args) -> int:
    results = []
    for workload in args.workload or _TWO_WORKLOADS:
        w = WORKLOADS[workload]
        cublas = {}
        cases, used = _cluster_cases(w)
        for dtype, name, (m, n, k), fn in cases:
            row = {"workload": w.name, "dtype": dtype, "gemm": name, "m": m, "n": n, "k": k}
            row.update(_variants_row({f"c{c}": functools.partial(fn, c) for c in gg.CLUSTER_SIZES},
                                     2.0 * m * n * k, used, args))
            row["cublas"] = _cublas_tflops(m, n, k, args.reps, cublas, calls=args.calls)
            results.append(row)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"TFLOP/s on {torch.cuda.get_device_name()}: clusters of 1 and 2 CTAs (cluster_n; 2 = adjacent M blocks "
          "sharing B by multicast), the better of two alternating rounds each; dense cuBLAS: bf16 torch.matmul of "
          "the same M x N x K")
    print(f"{'workload':<22} | {'dtype':<11} | {'gemm':<19} | {'M x N x K':>20} | {'c1':>6} | {'c2':>6} | "
          f"c2/c1 | {'cuBLAS':>6} | bits")
    for r in results:
        shape = f"{r['m']}x{r['n']}x{r['k']}"
        print(f"{r['workload']:<22} | {r['dtype']:<11} | {r['gemm']:<19} | {shape:>20} | {r['c1']:6.1f} | "
              f"{r['c2']:6.1f} | {r['c2'] / r['c1']:4.2f}x | {r['cublas']:6.1f} | "
              f"{'same' if r['bit_identical'] else 'DIFFER'}")
    return 0 if all(r["bit_identical"] for r in results) else 1


_WALK_WORKLOADS = ("deepseek-v3-t8192", "qwen3-235b-a22b-t8192", "qwen3-30b-a3b-t16384")


def _parse_walks(text: str) -> dict:
    """--walk-list: "16,8,e16" -> {label: (group_m, expert_groups)}; N fixed groups of N M blocks, eN groups of at
    most N blocks within each expert."""
    walks = {}
    for token in text.split(","):
        size = token[1:] if token.startswith("e") else token
        if not size.isdigit() or int(size) not in gg.GROUP_M_CHOICES:
            raise ValueError(f"--walk-list: {token!r}, expected N or eN with N one of {gg.GROUP_M_CHOICES}")
        walks[token] = (int(size), token.startswith("e"))
    return walks


def _same_walks(walks: dict, starts, ends, n: int) -> dict:
    """{label: an earlier label of --walk-list} for each walk whose tile order on these expert ranges equals an
    earlier walk's (gg.walk_tiles, N blocks of the launcher's tile). Only walks within experts are compared: they
    run on clusters of 1, the case walk_tiles follows. Two such walks are the same where every expert's blocks fit in
    one group of the smaller size, e.g. e8 and e16 where no expert owns more than 8 blocks; the ratio between them
    is then the spread of the measurement, not a property of the walk."""
    starts, ends = [int(v) for v in starts.tolist()], [int(v) for v in ends.tolist()]
    n_blocks = -(-n // gg.select_tile(n).block_n)
    orders, same = {}, {}
    for label, (size, within) in walks.items():
        if not within:
            continue
        order = gg.walk_tiles(starts, ends, n_blocks, size, True)
        earlier = next((other for other, o in orders.items() if o == order), None)
        if earlier is not None:
            same[label] = earlier
        else:
            orders[label] = order
    return same


def _walk_table(args) -> int:
    """The layer's four bf16 M-grouped GEMMs (as the layer runs them: the gathering L1 forward, the combining L2
    forward and L1 dgrad, the L2 dgrad's store) under each scheduler walk, alternating, with bit identity."""
    walks = _parse_walks(args.walk_list)
    if not torch.cuda.is_available():
        print("not measured: no CUDA GPU")
        return 0
    results = []
    for workload in args.workload or _WALK_WORKLOADS:
        w = WORKLOADS[workload]
        (meta, starts, ends, used, rows, H, I, x, act, dy, dh, l1, l2, combine, plain) = _layer_operands(w)
        nt, nn = gg.m_grouped_bf16_gemm_nt_contiguous, gg.m_grouped_bf16_gemm_nn_contiguous
        tokens = torch.randn(w.num_tokens, H, device=x.device).to(torch.bfloat16)
        gather = gg.Gather(meta.row_to_slot, w.top_k)
        cases = [("L1 fwd  nt gather", 2 * I, H, lambda m, e: nt(tokens, l1, starts, ends, gather=gather, group_m=m,
                                                                  expert_groups=e)),
                 ("L2 fwd  nt combine", H, I, lambda m, e: nt(act, l2, starts, ends, scatter=combine, group_m=m,
                                                               expert_groups=e)),
                 ("L2 dgrad nn", I, H, lambda m, e: nn(dy, l2, starts, ends, group_m=m, expert_groups=e)),
                 ("L1 dgrad nn combine", H, 2 * I, lambda m, e: nn(dh, l1, starts, ends, scatter=plain, group_m=m,
                                                                   expert_groups=e))]
        for name, n, k, fn in cases:
            chosen = gg.select_walk(rows, w.num_experts, n * k * l1.element_size())
            row = {"workload": w.name, "gemm": name, "m": used, "n": n, "k": k,
                   "select_walk": ("e" if chosen[1] else "") + str(chosen[0]),
                   "same_walk_as": _same_walks(walks, starts, ends, n)}
            row.update(_variants_row({label: functools.partial(fn, *walk) for label, walk in walks.items()},
                                     2.0 * used * n * k, used, args))
            results.append(row)
        del x, act, dy, dh, l1, l2, tokens, meta, combine, plain, gather
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    labels = list(walks)
    print(f"TFLOP/s on {torch.cuda.get_device_name()}: the scheduler's walks (N: fixed groups of N M blocks, eN: "
          f"groups of at most N within each expert), the better of two alternating rounds each, ratio to {labels[0]}; "
          "'chosen': select_walk's walk; '=X': the same tile order as walk X on these experts (the ratio between "
          "the two is the measurement's spread)")
    print(f"{'workload':<22} | {'gemm':<19} | chosen | " + " | ".join(f"{label:>15}" for label in labels) + " | bits")
    for r in results:
        same = r.get("same_walk_as", {})
        cells = [f"{r[label]:6.1f} ({r[label] / r[labels[0]]:5.3f}x)" + (f" ={same[label]}" if label in same else "")
                 for label in labels]
        print(f"{r['workload']:<22} | {r['gemm']:<19} | {r['select_walk']:>6} | " + " | ".join(cells) +
              f" | {'same' if r['bit_identical'] else 'DIFFER'}")
    return 0 if all(r["bit_identical"] for r in results) else 1


def _cublas_cases(w):
    """(name, dense (M, N, K), fn() -> output, N of the GEMM's output) per bf16 GEMM of the layer."""
    (meta, starts, ends, used, rows, H, I, x, act, dy, dh, l1, l2, combine, plain) = _layer_operands(w)
    nt, nn, tn = gg.m_grouped_bf16_gemm_nt_contiguous, gg.m_grouped_bf16_gemm_nn_contiguous, \
        gg.k_grouped_bf16_gemm_tn_contiguous
    tokens = torch.randn(w.num_tokens, H, device="cuda").to(torch.bfloat16)
    gather = gg.Gather(meta.row_to_slot, w.top_k, "cp_async")
    cases = [
        ("L1 fwd  nt", (used, 2 * I, H), lambda: nt(x, l1, starts, ends), 2 * I),
        ("L1 fwd  nt gather", (used, 2 * I, H), lambda: nt(tokens, l1, starts, ends, gather=gather), 2 * I),
        ("L2 fwd  nt", (used, H, I), lambda: nt(act, l2, starts, ends), H),
        ("L2 fwd  nt combine", (used, H, I), lambda: nt(act, l2, starts, ends, scatter=combine), H),
        ("L2 dgrad nn", (used, I, H), lambda: nn(dy, l2, starts, ends), I),
        ("L1 dgrad nn", (used, H, 2 * I), lambda: nn(dh, l1, starts, ends), H),
        ("L1 dgrad nn combine", (used, H, 2 * I), lambda: nn(dh, l1, starts, ends, scatter=plain), H),
        ("L1 wgrad tn", (2 * I, H, used), lambda: tn(dh, x, starts, ends), H),
        ("L2 wgrad tn", (H, I, used), lambda: tn(dy, act, starts, ends), I),
    ]
    return cases


def _cublas_table(args) -> int:
    results = []
    for workload in args.workload or _TWO_WORKLOADS:
        w = WORKLOADS[workload]
        for name, (m, n, k), fn, out_n in _cublas_cases(w):
            row = {"workload": w.name, "gemm": name, "m": m, "n": n, "k": k, "tile": gg.select_tile(out_n).block_n}
            a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
            dense = lambda: torch.matmul(a, b)  # noqa: E731
            # The same statistic for both: two rounds each, alternating, the better of each.
            ours_ms, dense_ms = [], []
            for _ in range(2):
                ours_ms.append(median_ms(fn, args.reps, calls=args.calls))
                dense_ms.append(median_ms(dense, args.reps, calls=args.calls))
            row["ours"] = 2.0 * m * n * k / min(ours_ms) / 1e9
            row["cublas"] = 2.0 * m * n * k / min(dense_ms) / 1e9
            del a, b
            results.append(row)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"TFLOP/s on {torch.cuda.get_device_name()}: the layer's bf16 GEMMs against dense cuBLAS, bf16 "
          "torch.matmul of the same M x N x K, each the better of two rounds, the two alternating")
    print(f"{'workload':<22} | {'gemm':<19} | {'M x N x K':>20} | tile | {'ours':>6} | {'cuBLAS':>6} | ours/cuBLAS")
    for r in results:
        shape = f"{r['m']}x{r['n']}x{r['k']}"
        print(f"{r['workload']:<22} | {r['gemm']:<19} | {shape:>20} | {r['tile']:>4} | {r['ours']:6.1f} | "
              f"{r['cublas']:6.1f} | {r['ours'] / r['cublas']:10.3f}x")
    return 0


#: Largest relative error against the fp64 reference that --upstream accepts from either side's GEMMs (both
#: round to bf16, about 2e-3; upstream's K-grouped results stay fp32).
_UPSTREAM_MAX_REL_ERR = 1e-2


def _upstream_unavailable() -> str | None:
    """Why upstream DeepGEMM's SM90 GEMMs cannot be timed in this process; None if they can."""
    try:
        deepgemm.require()
    except RuntimeError as exc:
        return str(exc)
    if not torch.cuda.is_available():
        return "upstream DeepGEMM's SM90 GEMMs need a CUDA GPU, and torch sees none"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return (f"the GEMMs compared are upstream DeepGEMM's SM90 (Hopper) ones, this GPU is SM{major}{minor} "
                f"({torch.cuda.get_device_name()})")
    return None


def _m_grouped_reference(bounds, a_rows, b_nk):
    """An M-grouped GEMM's fp64 reference, one expert at a time: (output rows of expert e, ``a_rows(s, t) @
    b_nk(e).T``) for its pool rows [s, t)."""
    for e, (s, t) in enumerate(bounds):
        if t > s:
            yield slice(s, t), a_rows(s, t).double() @ b_nk(e).double().t()


def _k_grouped_reference(bounds, a_rows, b_rows):
    """A K-grouped GEMM's fp64 reference, one expert at a time: (e, ``a_rows(s, t).T @ b_rows(s, t)``)."""
    for e, (s, t) in enumerate(bounds):
        yield e, a_rows(s, t).double().t() @ b_rows(s, t).double()


def _rel_errs(outs, pieces) -> list[float]:
    """``||out - ref|| / ||ref||`` in fp64 of each of ``outs`` over the reference ``pieces`` ((index into an
    output, its fp64 values), as the two functions above give them: never the whole reference at once)."""
    num = [torch.zeros((), dtype=torch.float64, device=outs[0].device) for _ in outs]
    den = torch.zeros((), dtype=torch.float64, device=outs[0].device)
    for index, ref in pieces:
        den += ref.square().sum()
        for acc, out in zip(num, outs):
            acc += (out[index].double() - ref).square().sum()
    den = float(den)
    return [(float(n) / den) ** 0.5 if den > 0 else float(n) ** 0.5 for n in num]


def _upstream_cases(w, dg):
    """(name, dense (M, N, K), rows compared bit for bit or None, {precision: (ours, upstream, reference
    pieces)}) per GEMM of the layer, on _layer_operands' operands (those of --fp8). ``ours`` and ``upstream``
    return their output; the first call of each is the checked one (upstream's K-grouped GEMMs accumulate
    into their output, which starts at zero)."""
    (meta, starts, ends, used, rows, H, I, x, act, dy, dh, l1, l2, _, _) = _layer_operands(w)
    if meta.align % deepgemm.token_group_alignment():
        raise RuntimeError(f"the pool's expert alignment {meta.align} is not a multiple of upstream's "
                           f"contiguous-layout alignment {deepgemm.token_group_alignment()}")
    bounds = list(zip(starts.tolist(), ends.tolist()))
    ours = Sm90Provider()
    bf16, fp8 = RECIPES["bf16"], RECIPES["fp8"]
    pools = {"x": x, "act": act, "dy": dy, "dh": dh}
    w1, w2 = fp8_recipe.Fp8ExpertWeights.from_bf16(l1), fp8_recipe.Fp8ExpertWeights.from_bf16(l2)
    q = {name: fp8_recipe.quantize_rows(t) for name, t in pools.items()}
    # Upstream's SM90 fp8 GEMM reads the activation scales MN-major with TMA-aligned columns and uses scales
    # already so laid out as they are; laid out here once (a copy only where P is not a multiple of 4).
    q_up = {name: (data, dg.get_mn_major_tma_aligned_tensor(scale.t().contiguous().t()))
            for name, (data, scale) in q.items()}
    layout = deepgemm.m_indices(meta)  # each pool row's expert, -1 on padding rows

    def m_grouped(name, shape, a, weight, weight_fp8, gemm_layout):
        pool, nn = pools[a], gemm_layout == "nn"
        wq = weight_fp8.kn if nn else weight_fp8.nk
        out_bf16, out_fp8 = pool.new_empty(rows, shape[1]), pool.new_empty(rows, shape[1])
        upstream_gemm = dg.m_grouped_bf16_gemm_nn_contiguous if nn else dg.m_grouped_bf16_gemm_nt_contiguous

        def upstream_bf16():
            upstream_gemm(pool, weight, out_bf16, layout)
            return out_bf16

        def upstream_fp8():
            dg.m_grouped_fp8_gemm_nt_contiguous(q_up[a], wq, out_fp8, layout)
            return out_fp8

        def reference_bf16():
            return _m_grouped_reference(bounds, lambda s, t: pool[s:t], lambda e: weight[e].t() if nn else weight[e])

        def reference_fp8():
            (data, scale), (w_data, w_scale) = q[a], wq
            return _m_grouped_reference(
                bounds, lambda s, t: fp8_recipe.dequantize_rows(data[s:t], scale[s:t]),
                lambda e: fp8_recipe.dequantize_weight_blocks(w_data[e:e + 1], w_scale[e:e + 1])[0])

        def ours_bf16():
            return ours.m_grouped(pool, weight, meta, gemm_layout, recipe=bf16)

        def ours_fp8():
            return ours.m_grouped(Fp8Rows(*q[a]), weight_fp8, meta, gemm_layout, recipe=fp8)

        return name, shape, used, {"bf16": (ours_bf16, upstream_bf16, reference_bf16),
                                   "fp8": (ours_fp8, upstream_fp8, reference_fp8)}

    ks = [t - s for s, t in bounds]
    ks_device = torch.tensor(ks, dtype=torch.int32, device=x.device)
    padded = -(-rows // 16) * 16  # our K-grouped fp8 GEMM's P % 16 == 0, as in --fp8
    block = fp8_recipe.FP8_BLOCK

    def k_grouped(name, a_name, b_name):
        a, b = pools[a_name], pools[b_name]
        qa, qb = fq.quantize_cols_transposed_fp8(a, rows=padded), fq.quantize_cols_transposed_fp8(b, rows=padded)
        # Upstream: the experts' rows only (they end at `used`), 128x1 scales MN-major, each expert's slab K-major.
        (ca, sa), (cb, sb) = fp8_recipe.quantize_cols(a[:used]), fp8_recipe.quantize_cols(b[:used])
        ga, gb = deepgemm.group_transpose(ca, ks), deepgemm.group_transpose(cb, ks)
        d_bf16, d_fp8 = (torch.zeros(len(ks), a.shape[1], b.shape[1], device=a.device) for _ in range(2))

        def upstream_bf16():
            dg.k_grouped_bf16_gemm_tn_contiguous(a[:used], b[:used], d_bf16, ks, ks_device, d_bf16)
            return d_bf16

        def upstream_fp8():
            dg.k_grouped_fp8_gemm_nt_contiguous((ga, sa.t()), (gb, sb.t()), d_fp8, ks, ks_device, d_fp8,
                                                recipe=(1, 1, block))
            return d_fp8

        def reference_bf16():
            return _k_grouped_reference(bounds, lambda s, t: a[s:t], lambda s, t: b[s:t])

        def reference_fp8():
            return _k_grouped_reference(bounds,
                                        lambda s, t: fp8_recipe.dequantize_cols(ca[s:t], sa[s // block:t // block]),
                                        lambda s, t: fp8_recipe.dequantize_cols(cb[s:t], sb[s // block:t // block]))

        return name, (a.shape[1], b.shape[1], used), None, {
            "bf16": (lambda: gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends), upstream_bf16, reference_bf16),
            "fp8": (lambda: fg.k_grouped_fp8_gemm_nt_contiguous(*qa, *qb, starts, ends), upstream_fp8, reference_fp8)}

    return [
        m_grouped("L1 fwd  nt", (used, 2 * I, H), "x", l1, w1, "nt"),
        m_grouped("L2 fwd  nt", (used, H, I), "act", l2, w2, "nt"),
        m_grouped("L2 dgrad", (used, I, H), "dy", l2, w2, "nn"),
        m_grouped("L1 dgrad", (used, H, 2 * I), "dh", l1, w1, "nn"),
        k_grouped("L1 wgrad", "dh", "x"),
        k_grouped("L2 wgrad", "dy", "act"),
    ]


def _upstream_table(args) -> int:
    reason = _upstream_unavailable()
    if reason is not None:
        print(f"not measured: {reason}")
        return 0
    import deep_gemm as dg  # importable: checked above

    results = []
    for workload in args.workload or ("qwen3-30b-a3b-t16384",):
        w = WORKLOADS[workload]
        for name, (m, n, k), bit_rows, impls in _upstream_cases(w, dg):
            flops = 2.0 * m * n * k
            row = {"workload": w.name, "gemm": name, "m": m, "n": n, "k": k, "upstream_errors": {}}
            start = time.perf_counter()
            for precision, (ours, upstream, reference) in impls.items():
                mine = ours()
                try:
                    theirs = upstream()
                except (RuntimeError, TypeError) as exc:  # a host assertion, a JIT failure, a changed signature
                    row["upstream_errors"][precision] = str(exc).strip().splitlines()[0]
                    theirs = None
                errs = _rel_errs([mine] if theirs is None else [mine, theirs], reference())
                row[f"{precision}_rel_err"] = errs[0]
                row[f"{precision}_upstream_rel_err"] = errs[1] if theirs is not None else None
                row[f"{precision}_bit_identical"] = (
                    torch.equal(mine[:bit_rows].view(torch.int16), theirs[:bit_rows].view(torch.int16))
                    if theirs is not None and bit_rows is not None else None)
                del mine, theirs
                row[f"{precision}_tflops"] = flops / median_ms(ours, args.reps, calls=args.calls) / 1e9
                row[f"{precision}_upstream_tflops"] = (
                    flops / median_ms(upstream, args.reps, calls=args.calls) / 1e9
                    if precision not in row["upstream_errors"] else None)
            checked = [row[f"{p}_{side}rel_err"] for p in impls for side in ("", "upstream_")]
            row["check"] = not row["upstream_errors"] and all(e < _UPSTREAM_MAX_REL_ERR for e in checked)
            results.append(row)
            print(f"{w.name} {' '.join(name.split())}: checked and timed in {time.perf_counter() - start:.1f}s (the "
                  "first calls compile)", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)

    def tflops(value):
        return f"{value:6.1f}" if value is not None else f"{'fail':>6}"

    def ratio(ours, theirs):
        return f"{ours / theirs:5.2f}x" if theirs else f"{'-':>6}"

    def err_pair(r, p):
        up = r[f"{p}_upstream_rel_err"]
        return f"{r[f'{p}_rel_err']:.1e}/{up:.1e}" if up is not None else f"{r[f'{p}_rel_err']:.1e}/fail"

    def bits(r):
        same = [r[f"{p}_bit_identical"] for p in ("bf16", "fp8")]
        return "/".join("-" if s is None else "same" if s else "differ" for s in same)

    print(f"TFLOP/s on {torch.cuda.get_device_name()}: ours (the layer's GEMMs) vs upstream DeepGEMM "
          f"{getattr(dg, '__version__', '?')} (SM90) on the same operands, bf16 and blockwise fp8 (operands quantized "
          "beforehand); x up = ours / upstream; err = relative error against fp64 (ours/upstream); bits bf16/fp8")
    print(f"{'workload':<22} | {'gemm':<10} | {'M x N x K':>20} | {'bf16':>6} | {'up':>6} | {'x up':>6} | {'fp8':>6} | "
          f"{'up':>6} | {'x up':>6} | {'err bf16':>15} | {'err fp8':>15} | {'bits':>11} | check")
    for r in results:
        shape = f"{r['m']}x{r['n']}x{r['k']}"
        print(f"{r['workload']:<22} | {r['gemm']:<10} | {shape:>20} | {tflops(r['bf16_tflops'])} | "
              f"{tflops(r['bf16_upstream_tflops'])} | {ratio(r['bf16_tflops'], r['bf16_upstream_tflops'])} | "
              f"{tflops(r['fp8_tflops'])} | {tflops(r['fp8_upstream_tflops'])} | "
              f"{ratio(r['fp8_tflops'], r['fp8_upstream_tflops'])} | {err_pair(r, 'bf16'):>15} | "
              f"{err_pair(r, 'fp8'):>15} | {bits(r):>11} | {'ok' if r['check'] else 'FAIL'}")
    for r in results:
        for precision, error in r["upstream_errors"].items():
            print(f"{r['workload']} {r['gemm']} {precision}: upstream failed: {error}")
    return 0 if all(r["check"] for r in results) else 1


CEILING_CALLS = (1, 8, 64, 256)


def _ceiling_table(args) -> int:
    """Dense bf16 and fp8 GEMMs of 8192^3 at CEILING_CALLS back-to-back calls, with clock and power."""
    if not torch.cuda.is_available():
        print("not measured: no CUDA GPU")
        return 0
    n = 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm wants B column-major
    one = torch.ones((), device="cuda")
    cases = {"bf16 (torch.matmul)": lambda: a @ b,
             "fp8 (torch._scaled_mm)": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)}
    rows = []
    for name, fn in cases.items():
        for calls in CEILING_CALLS:
            with GpuReadings(period_s=0.001) as readings:
                ms = median_ms(fn, reps=args.reps, warmup=5, calls=calls, during=readings)
            rows.append(dict(gemm=name, calls=calls, ms=ms, tflops=2 * n**3 / ms / 1e9, **readings.medians()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"Dense {n}^3 GEMMs on {torch.cuda.get_device_name()}: burst (1 call a repeat) and sustained load")
    print("| GEMM | calls | ms | TFLOP/s | SM MHz | W | capped |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        def fmt(value, spec):
            return "-" if value is None else format(value, spec)
        capped = None if r["power_capped"] is None else 100 * r["power_capped"]
        print(f"| {r['gemm']} | {r['calls']} | {r['ms']:.3f} | {r['tflops']:.0f} | {fmt(r['sm_mhz'], '.0f')} "
              f"| {fmt(r['power_w'], '.0f')} | {fmt(capped, '.0f')}% |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                        help="the layer (repeatable with the tables; default qwen3-30b-a3b-t16384, with "
                             f"--clusters and --cublas {' and '.join(_TWO_WORKLOADS)})")
    parser.add_argument("--fp8", action="store_true",
                        help="our blockwise-fp8 GEMM vs our bf16 GEMM TFLOP/s per M-grouped GEMM of the layer")
    parser.add_argument("--wgrad", action="store_true",
                        help="--fp8's second table alone: the bf16 vs fp8 K-grouped weight-gradient GEMMs (both fp8 "
                             "mainloops)")
    parser.add_argument("--clusters", action="store_true",
                        help="clusters of 1 vs 2 CTAs (bf16 and fp8) vs dense cuBLAS TFLOP/s per GEMM, with bit identity")
    parser.add_argument("--cublas", action="store_true",
                        help="the layer's bf16 GEMMs (store, gathering, combine) vs dense cuBLAS TFLOP/s")
    parser.add_argument("--upstream", action="store_true",
                        help="ours vs upstream DeepGEMM's SM90 bf16 and fp8 GEMMs (when deep_gemm imports) TFLOP/s per "
                             "GEMM of the layer, with each side's error against fp64")
    parser.add_argument("--fp8-tiles", action="store_true",
                        help="128 x 128 vs 128 x 192 fp8 tiles (clusters of 1 and 2) TFLOP/s per M-grouped GEMM")
    parser.add_argument("--ceiling", action="store_true",
                        help="dense bf16 and fp8 8192^3 GEMMs in a burst and under sustained load, with the SM "
                             "clock, power and power-capped share")
    parser.add_argument("--walks", action="store_true",
                        help="the layer's four bf16 M-grouped GEMMs under each scheduler walk (--walk-list), "
                             "alternating, with bit identity and select_walk's choice")
    parser.add_argument("--walk-list", default="16,8,e16,e8",
                        help="with --walks: comma-separated N (fixed groups of N M blocks) or eN (groups within "
                             "experts), the first the yardstick (default 16,8,e16,e8)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--calls", type=int, default=5,
                        help="back-to-back calls per timed repeat (testing.median_ms): from the second on, a "
                             "call's host work overlaps the previous kernel, so the times are the kernels'; "
                             "1 adds one launcher's host time to every sample, as the tables before this option")
    parser.add_argument("--json", default=None, help="write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if (args.fp8 + args.wgrad + args.clusters + args.cublas + args.upstream + args.fp8_tiles + args.ceiling +
            args.walks > 1):
        parser.error("--fp8, --wgrad, --clusters, --cublas, --upstream, --fp8-tiles, --ceiling and --walks: one table "
                     "at a time")
    if args.walks:
        try:
            return _walk_table(args)
        except ValueError as exc:
            parser.error(str(exc))
    if args.ceiling:
        return _ceiling_table(args)
    one_table = not (args.fp8 or args.wgrad or args.clusters or args.cublas or args.upstream or args.fp8_tiles)
    if one_table and args.workload and len(args.workload) > 1:
        parser.error("--workload: one workload without --fp8, --wgrad, --clusters, --cublas, --upstream or "
                     "--fp8-tiles")
    if args.upstream:
        return _upstream_table(args)
    if args.fp8:
        return _fp8_table(args)
    if args.wgrad:
        return _wgrad_only_table(args)
    if args.fp8_tiles:
        return _fp8_tiles_table(args)
    if args.clusters:
        return _cluster_table(args)
    if args.cublas:
        return _cublas_table(args)
    return _grouped_table(args)


if __name__ == "__main__":
    raise SystemExit(main())
