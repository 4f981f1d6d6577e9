#!/usr/bin/env python3
"""MoE layer benchmark: forward and forward+backward medians from CUDA events.

Every implementation runs on the same fresh random inputs in the same process; ratios are against
the torchtitan-style grouped_mm baseline measured in this run. TFLOP/s counts 6·T·K·H·I per forward
and three times that for forward+backward. Writes a markdown table (stdout), JSON records and a PNG.

    python scripts/bench.py --json benchmarks/results/h200.json --png benchmarks/results/h200.png
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.baselines import grouped_mm_moe, hf_loop_moe  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, make_inputs, median_ms  # noqa: E402


def _ours(backend="auto", recipe="bf16"):
    def run(x, idx, w, l1, l2):
        return dge.mega_moe_train(x, idx, w, l1, l2, recipe=recipe, backend=backend)
    return run


@contextlib.contextmanager
def _environ(env):
    """Set env vars for a whole forward+backward measurement (the knobs are read at call time)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def implementations(with_loop: bool, all_variants: bool = False):
    """(impl, backend, recipe) -> callable; impl "ours" is this package."""
    impls = {}
    if with_loop:
        impls[("loop", "torch", "bf16")] = lambda x, idx, w, l1, l2: hf_loop_moe(x, idx, w, l1, l2)
    impls[("grouped_mm", "torch", "bf16")] = lambda x, idx, w, l1, l2: grouped_mm_moe(x, idx, w, l1, l2)
    impls[("ours", "auto", "bf16")] = _ours()
    # The same kernels with SwiGLU forward / backward fused into the GEMM epilogues (opt-in).
    impls[("ours", "auto+fused-swiglu", "bf16")] = _ours()
    # The L1 GEMM reading a gathered pool of x (DGE_FUSED_GATHER=0) instead of gathering x itself,
    # and gathering x with 1-row TMA boxes rather than cp.async.
    impls[("ours", "auto+pool-gather", "bf16")] = _ours()
    # The L2 forward and L1 dgrad GEMMs writing the pool, then a gathering combine (DGE_FUSED_COMBINE=0),
    # instead of their combine epilogues writing top-k slot order.
    impls[("ours", "auto+pool-combine", "bf16")] = _ours()
    if all_variants:
        impls[("ours", "auto+gather-tma", "bf16")] = _ours()
        # The backward's GEMMs gathering dy's and x's rows too (DGE_FUSED_GATHER_BACKWARD=1).
        impls[("ours", "auto+gather-backward", "bf16")] = _ours()
    impls[("ours", "torch", "bf16")] = _ours("torch")
    try:
        from deep_gemm_ext import plan
        from deep_gemm_ext.providers import deepgemm
        if deepgemm.is_available():
            for recipe in plan.BACKEND_RECIPES["deep_gemm"]:
                impls[("ours", "deep_gemm", recipe)] = _ours("deep_gemm", recipe)
    except ImportError:
        pass
    return impls


def bench_one(fn, inputs, reps):
    x, idx, w, l1, l2 = inputs
    dy = torch.randn_like(x)
    with torch.no_grad():
        fwd = median_ms(lambda: fn(x, idx, w, l1, l2), reps)

    def fwd_bwd():
        y = fn(x, idx, w, l1, l2)
        torch.autograd.grad(y, (x, w, l1, l2), dy)

    fwdbwd = median_ms(fwd_bwd, reps)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    # What the layer keeps between forward and backward (y and its saved tensors): per layer, this
    # is what a training step holds until the backward reaches it.
    before = torch.cuda.memory_allocated()
    y = fn(x, idx, w, l1, l2)
    torch.cuda.synchronize()
    saved = (torch.cuda.memory_allocated() - before) / 2**30
    del y
    return fwd, fwdbwd, peak, saved


def git_commit() -> str:
    """DGE_COMMIT when set (a copy of the tree without its git history), else git's HEAD."""
    if os.environ.get("DGE_COMMIT"):
        return os.environ["DGE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def draw_png(records, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not found: no chart written to {path}")
        return
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    label = lambda r: f"{r['impl']} ({r['backend']}, {r['recipe']})" if r["impl"] != "grouped_mm" else r["impl"]  # noqa: E731
    impls = list(dict.fromkeys(label(r) for r in records))
    fig, ax = plt.subplots(figsize=(2 + 2.2 * len(workloads), 4))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        vals = []
        for wl in workloads:
            match = [r for r in records if r["workload"] == wl and label(r) == impl]
            vals.append(match[0]["tflops"] if match else 0)
        ax.bar([i + j * width for i in range(len(workloads))], vals, width, label=impl)
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=10, fontsize=8)
    ax.set_ylabel("forward+backward TFLOP/s")
    ax.set_title(f"MoE layer, {records[0]['gpu']}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--loop", action="store_true", help="also time the HF-style loop (slow)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--all-variants", action="store_true",
                   help="also time the variants measured slower before (1-row TMA gather, gathering backward)")
    p.add_argument("--json", default=None, help="write records here")
    p.add_argument("--png", default=None, help="draw a bar chart here")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="redraw --png from saved records, no GPU")
    args = p.parse_args()
    if args.plot_only:
        draw_png(json.loads(Path(args.plot_only).read_text()), args.png)
        return
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")

    gpu = torch.cuda.get_device_name()
    commit, date = git_commit(), datetime.date.today().isoformat()
    impls = implementations(args.loop, args.all_variants)
    records = []
    for wl_name in args.workloads:
        wl = WORKLOADS[wl_name]
        inputs = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                             device="cuda", seed=1234)
        rows = {}
        for (impl, backend, recipe), fn in impls.items():
            with _environ({"DGE_FUSED_EPILOGUES": "1" if "fused-swiglu" in backend else "0",
                           "DGE_FUSED_GATHER": ("0" if "pool-gather" in backend else
                                                "tma" if "gather-tma" in backend else "cp_async"),
                           "DGE_FUSED_GATHER_BACKWARD": "1" if "gather-backward" in backend else "0",
                           "DGE_FUSED_COMBINE": "0" if "pool-combine" in backend else "1"}):
                fwd, fwdbwd, peak, saved = bench_one(fn, inputs, args.reps)
            rows[(impl, backend, recipe)] = dict(workload=wl_name, impl=impl, backend=backend,
                              recipe=recipe, fwd_ms=round(fwd, 4),
                              fwdbwd_ms=round(fwdbwd, 4),
                              tflops=round(3 * wl.flops_forward() / fwdbwd / 1e9, 1),
                              peak_gib=round(peak, 3), saved_gib=round(saved, 3), gpu=gpu, commit=commit,
                              date=date)
        base = rows[("grouped_mm", "torch", "bf16")]["fwdbwd_ms"]
        for r in rows.values():
            r["ratio_vs_grouped_mm"] = round(base / r["fwdbwd_ms"], 3)
            records.append(r)
            print(f"{wl_name}: {r['impl']} ({r['backend']}, {r['recipe']}) {r['fwdbwd_ms']:.3f} ms "
                  f"{r['ratio_vs_grouped_mm']:.2f}x", flush=True)
        if args.json:  # after every workload, so a cut-short run keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
        del inputs
        torch.cuda.empty_cache()

    print("| workload | impl | backend | recipe | fwd ms | fwd+bwd ms | TFLOP/s | x grouped_mm | peak GiB "
          "| saved GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['workload']} | {r['impl']} | {r['backend']} | {r['recipe']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
              f"{r['tflops']:.0f} | {r['ratio_vs_grouped_mm']:.2f}x | {r['peak_gib']:.2f} | {r['saved_gib']:.2f} |")
    if args.png:
        draw_png(records, args.png)


if __name__ == "__main__":
    main()
