#!/usr/bin/env python3
"""The layer with GEMM options that its plan does not take, timed against the default in one process.

A GEMM option can lose when its GEMM is timed alone, at a short burst's clock, and still pay inside the
layer, where the board's power limit holds the clock down for the whole step (docs/perf-notes.md v33,
v41): there a step's time is about its energy over the limit, so what moves it is energy, not latency
hidden. This script runs ``mega_moe_train`` forward+backward with the bf16 GEMM launchers given extra
options, on the same inputs, the variants alternating over several rounds:

    default   the layer as it is
    pool      x gathered into a pool first (DGE_FUSED_GATHER=0), the L1 forward read by TMA
    c2        every bf16 GEMM that takes it on clusters of 2 CTAs (B multicast; not the gathering L1 forward)
    c2+pool   both: then the L1 forward is on clusters of 2 as well

Per variant: the median time, its ratio to the default, NVML's SM clock, power and capped share while
the samples ran, the energy of one step (power x time), whether y and the four gradients equal the
default's bit for bit (they must), and the GEMM kernels it launched that the default did not.

    python scripts/layer_variants.py --workloads qwen3-30b-a3b-t16384 qwen3-235b-a22b-t8192
    python scripts/layer_variants.py --dry-run     # tiny shape, also on a CPU: the script end to end
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.testing import (WORKLOADS, GpuReadings, Workload, environ, host_median_ms,  # noqa: E402
                                   make_inputs, median_ms)

#: (environment, options given to every bf16 GEMM launch that takes them) per variant.
VARIANTS = {
    "default": ({}, {}),
    "pool": ({"DGE_FUSED_GATHER": "0"}, {}),
    "c2": ({}, dict(cluster_n=2)),
    "c2+pool": ({"DGE_FUSED_GATHER": "0"}, dict(cluster_n=2)),
}
LAUNCHERS = ("m_grouped_bf16_gemm_nt_contiguous", "m_grouped_bf16_gemm_nn_contiguous",
             "k_grouped_bf16_gemm_tn_contiguous")
DRY_RUN = Workload("dry-run", 64, 128, 128, 4, 2)


@contextlib.contextmanager
def variant(name: str, launched: list | None = None):
    """Within: the layer runs as variant ``name``; ``launched`` collects the bf16 GEMM configs it runs.
    Off the GPU (no JIT kernels) only the environment changes."""
    env, options = VARIANTS[name]
    try:
        from deep_gemm_ext import jit_kernels as kernels
        from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
    except ImportError:  # no cuda-python: the layer never reaches these launchers
        kernels = gg = None
    saved = {} if kernels is None else {n: getattr(kernels, n) for n in LAUNCHERS}
    launch = None if gg is None else gg._launch

    def with_options(fn):
        def run(*args, **kwargs):
            # Clusters take neither a gather nor paired tiles (the launchers refuse them): those keep theirs.
            if kwargs.get("gather") is None and not kwargs.get("paired_n", False):
                kwargs = {**kwargs, **options}
            return fn(*args, **kwargs)
        return run

    def spy(config, *args, **kwargs):
        launched.append(config.name)
        return launch(config, *args, **kwargs)

    try:
        for n, fn in saved.items():
            setattr(kernels, n, with_options(fn) if options else fn)
        if launched is not None and gg is not None:
            gg._launch = spy
        with environ(env):
            yield
    finally:
        for n, fn in saved.items():
            setattr(kernels, n, fn)
        if gg is not None:
            gg._launch = launch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def run_workload(wl: Workload, names, reps: int, calls: int, rounds: int, device: str) -> list[dict]:
    x, idx, w, l1, l2 = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                                    device=device)
    dy = torch.randn_like(x)

    def step():
        y = dge.mega_moe_train(x, idx, w, l1, l2)
        return (y, *torch.autograd.grad(y, (x, w, l1, l2), dy))

    with variant("default"):
        ref = step()
    default_kernels: set = set()
    rows = {}
    for name in names:  # first calls (JIT) outside the timing; bits and kernels
        launched: list = []
        with variant(name, launched):
            out = step()
        if name == "default":
            default_kernels = set(launched)
        rows[name] = dict(workload=wl.name, variant=name, samples=[],
                          same_bits=all(torch.equal(_bits(a), _bits(b)) for a, b in zip(out, ref)),
                          kernels=sorted(set(launched) - default_kernels))
        del out
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            readings = GpuReadings() if device == "cuda" else None
            try:
                with variant(name):
                    ms = (median_ms(step, reps, calls=calls, during=readings) if device == "cuda"
                          else host_median_ms(step, reps))
            finally:
                if readings is not None:
                    readings.close()
            rows[name]["samples"].append((ms, readings.medians() if readings is not None else {}))
    flops = 3 * wl.flops_forward()
    base = statistics.median(s[0] for s in rows["default"]["samples"]) if "default" in rows else None
    for row in rows.values():
        row["ms"] = statistics.median(s[0] for s in row["samples"])
        row["tflops"] = flops / row["ms"] / 1e9
        row["x_default"] = base / row["ms"] if base else None
        for key in ("sm_mhz", "power_w", "power_capped"):
            values = [s[1][key] for s in row["samples"] if s[1].get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["energy_j"] = row["power_w"] * row["ms"] / 1e3 if row["power_w"] is not None else None
    return list(rows.values())


def _fmt(value, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def print_table(rows, calls: int, reps: int, rounds: int) -> None:
    print(f"\nforward+backward, {calls} back-to-back calls a sample, median of {reps} samples per round, "
          f"median of {rounds} alternating rounds")
    print("| workload | variant | ms (rounds) | TFLOP/s | x default | SM MHz | W | capped | J | bits | kernels not in "
          "the default |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        each = " / ".join(f"{s[0]:.3f}" for s in r["samples"])
        capped = "-" if r["power_capped"] is None else f"{100 * r['power_capped']:.0f}%"
        kernels = ", ".join(k.replace("sm90_bf16_grouped_gemm_", "") for k in r["kernels"]) or "-"
        print(f"| {r['workload']} | {r['variant']} | {r['ms']:.3f} ({each}) | {r['tflops']:.0f} "
              f"| {_fmt(r['x_default'], '.3f')}x | {_fmt(r['sm_mhz'], '.0f')} | {_fmt(r['power_w'], '.0f')} "
              f"| {capped} | {_fmt(r['energy_j'], '.2f')} | {'same' if r['same_bits'] else 'DIFFER'} "
              f"| {kernels} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="*", choices=sorted(WORKLOADS), default=["qwen3-30b-a3b-t16384"])
    p.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--calls", type=int, default=8, help="back-to-back steps per timed sample")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dry-run", action="store_true", help="the tiny shape, 1 call, on the CPU without a GPU")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        p.error("no CUDA device: only --dry-run runs on the CPU")
    names = ["default"] + [n for n in args.variants if n != "default"]
    workloads = [DRY_RUN] if args.dry_run else [WORKLOADS[n] for n in args.workloads]
    calls = 1 if args.dry_run else args.calls
    rows = []
    for wl in workloads:
        rows += run_workload(wl, names, args.reps, calls, args.rounds, device)
        print_table([r for r in rows if r["workload"] == wl.name], calls, args.reps, args.rounds)
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
