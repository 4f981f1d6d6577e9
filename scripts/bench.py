#!/usr/bin/env python3
"""MoE layer benchmark: forward and forward+backward medians from CUDA events.

Every implementation runs on the same fresh random inputs in the same process; ratios are against
the torchtitan-style grouped_mm baseline measured in this run, eager and under
torch.compile(fullgraph=True, dynamic=False). Liger-Kernel's LigerFusedMoEFunction is a row when
liger_kernel is importable. Before its first timing every row is checked against the fp64 reference
on a small shape (y and the four gradients within 2e-2, 1e-1 for fp8); a row that fails the check, cannot compile or
cannot run is printed as "not measured" with the reason. The first calls of each row (JIT kernels,
torch.compile, Triton autotuning) run outside the timed repeats.

TFLOP/s counts 6·T·K·H·I per forward and three times that for forward+backward. SM MHz and W are the
medians of NVML's SM clock and instantaneous board power sampled every 2 ms while the forward+backward
repeats run, and "capped" the share of those samples in which the board's power limit held the clock down ("-"
without nvidia-ml-py). The driver updates these readings every few tens of milliseconds, so they
describe a row only when its timed windows are that long or longer (--calls 16 at the headline shapes);
at one call of a few milliseconds a window can read the load before it. "J" is the energy of one
forward+backward, that median power times the median time: where a row is capped all the time, its time is
about its energy over the board's limit, so a change that saves no energy cannot make it faster there
(docs/perf-notes.md v33, v41). Writes JSON records
and a PNG (PNG needs matplotlib) and ends with a markdown table on stdout.

    python scripts/bench.py --json benchmarks/results/h200.json --png benchmarks/results/h200.png
    python scripts/bench.py --dry-run      # tiny shape, also on a CPU: checks the script end to end
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext import _env  # noqa: E402
from deep_gemm_ext.baselines import grouped_mm_moe, hf_loop_moe, liger_inputs, liger_unavailable_reason  # noqa: E402
from deep_gemm_ext.recipes import WEIGHT_CACHE  # noqa: E402
from deep_gemm_ext.testing import (WORKLOADS, GpuReadings, Workload, environ, host_median_ms,  # noqa: E402
                                   make_inputs, median_ms, rel_err)


def _ours(backend="auto", recipe="bf16"):
    def run(x, idx, w, l1, l2):
        return dge.mega_moe_train(x, idx, w, l1, l2, recipe=recipe, backend=backend)
    return run


def _ours_requantized(recipe="fp8"):
    """``_ours`` after an optimizer step before every call: each call's weights are a new version, so the fp8
    recipe quantizes them once in the call (as a training step without gradient accumulation does), instead of
    reading the copies cached by an earlier call."""
    from deep_gemm_ext.recipes import fp8

    def run(x, idx, w, l1, l2):
        fp8._optimizer_steps += 1  # what torch.optim's step hook does: every cached copy is stale
        return dge.mega_moe_train(x, idx, w, l1, l2, recipe=recipe)
    return run


def _variant_env(backend: str) -> dict[str, str]:
    """The DGE_* knobs a row's backend name selects (the defaults for every other row)."""
    return {"DGE_FP8_WEIGHT_KERNEL": "1" if "weight-kernel" in backend else "0",
            "DGE_FUSED_GATHER": "0" if "pool-gather" in backend else "cp_async",
            # Unset: the plan's default, gathering in the fp8 weight gradients' quantizers, pools elsewhere.
            "DGE_FUSED_GATHER_BACKWARD": "",
            "DGE_FP8_WGRAD": "fp8" if "fp8-wgrad" in backend else "",
            "DGE_FUSED_COMBINE": "0" if "pool-combine" in backend else "1"}


BASE = ("grouped_mm", "torch", "bf16")
COMPILED = ("grouped_mm", "torch.compile", "bf16")
LIGER = ("liger", "triton", "bf16")


@dataclass
class Impl:
    fn: Callable
    #: inputs -> the arguments ``fn`` takes, run once per workload outside the timed region
    prepare: Callable = lambda *inputs: inputs  # noqa: E731
    #: printed with the table (e.g. how torch.compile ended up compiling it)
    notes: list = field(default_factory=list)


def _compile_setup() -> None:
    """Every shape and grad mode is a separate dynamo cache entry (dynamic=False): give room for all
    of them, and make hitting the limit an error rather than a silent fall back to eager."""
    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64), ("fail_on_recompile_limit_hit", True)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)


def compiled_grouped_mm() -> Impl:
    """grouped_mm_moe under torch.compile(fullgraph=True, dynamic=False); where dynamo cannot take the
    forward in one graph, the same with graph breaks, and a note saying why."""
    _compile_setup()
    impl = Impl(None)
    compiled = {"fn": torch.compile(grouped_mm_moe, fullgraph=True, dynamic=False), "fullgraph": True}

    def run(*args):
        try:
            return compiled["fn"](*args)
        except Exception as exc:
            if not compiled["fullgraph"]:
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            impl.notes.append(f"torch.compile(fullgraph=True) failed ({type(exc).__name__}: {first}); "
                              f"timed torch.compile(dynamic=False) with graph breaks")
            compiled.update(fn=torch.compile(grouped_mm_moe, dynamic=False), fullgraph=False)
            return compiled["fn"](*args)

    impl.fn = run
    return impl


def implementations(with_loop: bool, compiled: bool = True,
                    skips: dict | None = None) -> dict:
    """(impl, backend, recipe) -> Impl; impl "ours" is this package. Baselines that cannot run here
    get an entry in ``skips`` (key -> reason) instead."""
    skips = {} if skips is None else skips
    impls = {}
    if with_loop:
        impls[("loop", "torch", "bf16")] = Impl(hf_loop_moe)
    impls[BASE] = Impl(grouped_mm_moe)
    if compiled:
        impls[COMPILED] = compiled_grouped_mm()
    impls[("ours", "auto", "bf16")] = Impl(_ours())
    # Blockwise fp8 (DeepSeek-V3 recipe) on our SM90 kernels; the weights' fp8 copies cached from the first call
    # (quantized once per weight version: a step of gradient accumulation, or inference).
    impls[("ours", "auto", "fp8")] = Impl(_ours(recipe="fp8"))
    # The same with the weights quantized in every call, as in a training step that ends with an optimizer
    # step: by the torch quantizer (the default), and by the one-pass JIT kernel (DGE_FP8_WEIGHT_KERNEL=1).
    impls[("ours", "auto+requant", "fp8")] = Impl(_ours_requantized())
    impls[("ours", "auto+requant+weight-kernel", "fp8")] = Impl(_ours_requantized())
    # With fp8 weight gradients on our fp8 K-grouped GEMM (DGE_FP8_WGRAD=fp8; the backward's
    # quantization kernels then gather dy's and x's rows: the plan's default for that mode).
    impls[("ours", "auto+fp8-wgrad", "fp8")] = Impl(_ours(recipe="fp8"))
    # The L1 GEMM reading a gathered pool of x, saved for dW1 (DGE_FUSED_GATHER=0), instead of
    # gathering x itself.
    impls[("ours", "auto+pool-gather", "bf16")] = Impl(_ours())
    # The L2 forward and L1 dgrad GEMMs writing the pool, then a gathering combine (DGE_FUSED_COMBINE=0),
    # instead of their combine epilogues writing top-k slot order.
    impls[("ours", "auto+pool-combine", "bf16")] = Impl(_ours())
    impls[("ours", "torch", "bf16")] = Impl(_ours("torch"))
    try:
        from deep_gemm_ext import plan
        from deep_gemm_ext.providers import deepgemm
        if deepgemm.is_available():
            for recipe in plan.BACKEND_RECIPES["deep_gemm"]:
                impls[("ours", "deep_gemm", recipe)] = Impl(_ours("deep_gemm", recipe))
    except ImportError:
        pass
    # Last: its first call autotunes its Triton kernels (minutes on a fresh machine), so a run cut
    # short by a time limit has timed every other row first.
    reason = liger_unavailable_reason()
    if reason is None:
        from liger_kernel.ops import LigerFusedMoEFunction
        impls[LIGER] = Impl(LigerFusedMoEFunction.apply, prepare=liger_inputs)
    else:
        skips[LIGER] = reason
    return impls


#: The shape every implementation is checked on against the fp64 reference before it is timed.
CHECK = Workload("check", 512, 256, 128, 16, 4)
#: What --dry-run times: small enough for a CPU, multiples of 128 so a GPU takes its fast paths.
DRY_RUN = Workload("dry-run", 64, 128, 128, 4, 2)
#: Largest relative error against the fp64 reference per recipe: the bf16 tolerance of the protocol in
#: docs/architecture.md, and
#: for fp8 operands the bound tests/test_backend_deepgemm.py holds the deep_gemm backend to.
CHECK_MAX_REL_ERR = {"bf16": 2e-2, "fp8": 1e-1}
OUTPUTS = ("y", "dx", "dtopk_w", "dl1", "dl2")


def check_errors(impl: Impl, device: str, wl: Workload = CHECK,
                 emulate_fp8: bool = False) -> tuple[dict[str, float], dict[str, float] | None]:
    """Relative error of y and the four gradients against the fp64 reference on ``wl``'s shape; with
    ``emulate_fp8`` also the error of the fp8 recipe's fp32 emulation on the same inputs (with the weight
    gradients the plan takes), which the protocol bounds an fp8 row by."""
    x, idx, w, l1, l2 = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                                    device=device, seed=99)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(100)).to(device, x.dtype)
    y = impl.fn(*impl.prepare(x, idx, w, l1, l2))
    grads = torch.autograd.grad(y, (x, w, l1, l2), dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, l1, l2)]
    y_ref = dge.reference_forward(leaves[0], idx, *leaves[1:])
    refs = (y_ref, *torch.autograd.grad(y_ref, leaves, dy.double()))
    errors = {name: rel_err(out, ref) for name, out, ref in zip(OUTPUTS, (y, *grads), refs)}
    if not emulate_fp8:
        return errors, None
    from deep_gemm_ext import plan
    from deep_gemm_ext.recipes import fp8

    wgrad = plan.resolve(x, l1, recipe="fp8").fp8_wgrad
    emulated = fp8.fp8_reference_layer(*(t.detach() for t in (x, idx, w, l1, l2)), None, dy, wgrad=wgrad)
    return errors, {name: rel_err(out, ref) for name, out, ref in zip(OUTPUTS, emulated, refs)}


def error_bounds(recipe: str, backend: str, emulated: dict[str, float] | None) -> dict[str, float]:
    """Per output, the largest error a row may have to be timed: bf16 rows the fixed bound; fp8 rows
    1.02x (+1e-3) of the emulation's error (the protocol), upstream DeepGEMM's 1.1x (+2e-3), which its
    backend test holds it to (its own quantizers)."""
    if recipe != "fp8" or emulated is None:
        bound = CHECK_MAX_REL_ERR.get(recipe, CHECK_MAX_REL_ERR["bf16"])
        return {name: bound for name in OUTPUTS}
    factor, slack = (1.1, 2e-3) if backend == "deep_gemm" else (1.02, 1e-3)
    return {name: factor * emulated[name] + slack for name in OUTPUTS}


def bench_one(impl: Impl, inputs, reps, device="cuda", calls: int = 1):
    """(forward ms, forward+backward ms, peak GiB, saved GiB, readings); memory and readings are None off
    the GPU. ``readings``: ``testing.GpuReadings.medians()`` of the forward+backward repeats (SM clock,
    power, power-capped share, sampled while they run; Nones without NVML).
    ``calls``: back-to-back calls per timed repeat (``testing.median_ms``), the same for every row."""
    x, idx, w, l1, l2 = inputs
    # No row inherits another's fp8 weight copies (an fp8 row's stay cached on the weights): each row's
    # memory is its own, an fp8 row's with the cache it builds in its first call below.
    WEIGHT_CACHE.clear()
    args = impl.prepare(*inputs)
    dy = torch.randn_like(x)
    readings = GpuReadings() if device == "cuda" else None
    timer = (lambda fn, reps, during=None: median_ms(fn, reps, calls=calls, during=during)) if device == "cuda" \
        else (lambda fn, reps, during=None: host_median_ms(fn, reps))

    def fwd_bwd():
        y = impl.fn(*args)
        torch.autograd.grad(y, (x, w, l1, l2), dy)

    # Outside the timed repeats: the first calls compile (JIT kernels, torch.compile, Triton autotune).
    with torch.no_grad():
        impl.fn(*args)
    fwd_bwd()
    with torch.no_grad():
        fwd = timer(lambda: impl.fn(*args), reps)
    try:
        fwdbwd = timer(fwd_bwd, reps, readings)
    finally:
        if readings is not None:
            readings.close()
    if device != "cuda":
        return fwd, fwdbwd, None, None, None
    read = readings.medians()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    # What the layer keeps between forward and backward (y and its saved tensors): per layer, this
    # is what a training step holds until the backward reaches it.
    before = torch.cuda.memory_allocated()
    y = impl.fn(*args)
    torch.cuda.synchronize()
    saved = (torch.cuda.memory_allocated() - before) / 2**30
    del y
    return fwd, fwdbwd, peak, saved, read


def git_commit() -> str:
    """DGE_COMMIT when set (a copy of the tree without its git history), else git's HEAD."""
    if _env.commit_label():
        return _env.commit_label()
    try:
        where = Path(__file__).parent
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=where, text=True,
                                         stderr=subprocess.DEVNULL).strip()
        # Tracked files changed since that commit: the record says so rather than naming a tree it did not run.
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=where,
                               stderr=subprocess.DEVNULL).returncode != 0
        return commit + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def label(r) -> str:
    return "grouped_mm" if (r["impl"], r["backend"]) == BASE[:2] else f"{r['impl']} ({r['backend']}, {r['recipe']})"


def draw_png(records, path):
    records = [r for r in records if "skipped" not in r]
    if not records:
        print(f"no measured rows: no chart written to {path}")
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not found: no chart written to {path}")
        return
    workloads = list(dict.fromkeys(r["workload"] for r in records))
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


def _readings_record(read, fwdbwd_ms: float) -> dict:
    """The record's fields of ``GpuReadings.medians()`` (all None off the GPU or without NVML), and
    ``energy_j``: the median power times the forward+backward's median time, in joules."""
    read = read or {}
    def rounded(key, digits):
        return None if read.get(key) is None else round(read[key], digits)
    power = read.get("power_w")
    return dict(sm_mhz=rounded("sm_mhz", 0), power_w=rounded("power_w", 1),
                power_capped=rounded("power_capped", 3),
                energy_j=None if power is None else round(power * fwdbwd_ms / 1e3, 4))


def _ratio(base, r) -> float | None:
    return round(base["fwdbwd_ms"] / r["fwdbwd_ms"], 3) if base else None


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_table(records) -> None:
    print("| workload | impl | backend | recipe | fwd ms | fwd+bwd ms | TFLOP/s | x grouped_mm "
          "| x compiled grouped_mm | peak GiB | saved GiB | SM MHz | W | capped | J |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if "skipped" in r:
            continue
        print(f"| {r['workload']} | {r['impl']} | {r['backend']} | {r['recipe']} | {r['fwd_ms']:.3f} "
              f"| {r['fwdbwd_ms']:.3f} | {r['tflops']:.0f} | {_fmt(r['ratio_vs_grouped_mm'], '.2f', 'x')} "
              f"| {_fmt(r['ratio_vs_compiled_grouped_mm'], '.2f', 'x')} | {_fmt(r['peak_gib'], '.2f')} "
              f"| {_fmt(r['saved_gib'], '.2f')} | {_fmt(r.get('sm_mhz'), '.0f')} | {_fmt(r.get('power_w'), '.0f')} "
              f"| {_fmt(None if r.get('power_capped') is None else 100 * r['power_capped'], '.0f', '%')} "
              f"| {_fmt(r.get('energy_j'), '.2f')} |")


def run_workload(wl: Workload, impls: dict, checked: dict, reps: int, device: str, meta: dict,
                 check: Workload = CHECK, calls: int = 1, on_row=None) -> list:
    """Records of every implementation on ``wl`` (a ``skipped`` record with the reason where one
    could not be checked or timed), ratios against this run's two grouped_mm rows. ``on_row(rows)``,
    where given, gets the workload's records so far after each row, so a run stopped by a time limit
    keeps every row it finished."""
    inputs = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                         device=device, seed=1234)
    torch._dynamo.reset()  # a fresh cache per workload: the dynamo cache limit counts shapes
    rows = {}
    for key, impl in impls.items():
        impl_name, backend, recipe = key
        record = dict(workload=wl.name, impl=impl_name, backend=backend, recipe=recipe, **meta)
        try:
            with environ(_variant_env(backend)):
                if key not in checked:  # once per implementation, before its first timing
                    checked[key] = check_errors(impl, device, check, emulate_fp8=recipe == "fp8")
                errors, emulated = checked[key]
                worst = max(errors.values())
                bounds = error_bounds(recipe, backend, emulated)
                if not all(errors[name] <= bounds[name] for name in OUTPUTS):  # NaN fails too
                    raise RuntimeError("disagrees with the fp64 reference on the check shape: " + ", ".join(
                        f"{k} {v:.2e} (bound {bounds[k]:.2e})" for k, v in errors.items()))
                fwd, fwdbwd, peak, saved, read = bench_one(impl, inputs, reps, device, calls)
        except Exception as exc:  # reported in the output and the records, never dropped silently
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            rows[key] = dict(record, skipped="; ".join([*impl.notes, f"{type(exc).__name__}: {first}"]))
            print(f"{wl.name}: {label(record)} skipped: {rows[key]['skipped']}", flush=True)
            if on_row is not None:
                on_row(list(rows.values()))
            continue
        rows[key] = dict(record, fwd_ms=round(fwd, 4), fwdbwd_ms=round(fwdbwd, 4),
                         tflops=round(3 * wl.flops_forward() / fwdbwd / 1e9, 1),
                         peak_gib=None if peak is None else round(peak, 3),
                         saved_gib=None if saved is None else round(saved, 3),
                         **_readings_record(read, fwdbwd),
                         check_max_rel_err=float(f"{worst:.3e}"), notes=list(impl.notes))
        # As soon as it is measured: a run cut short still shows the rows it timed, with their ratios to the
        # baselines measured before them (the grouped_mm rows come first).
        r = rows[key]
        for field, base in (("ratio_vs_grouped_mm", BASE), ("ratio_vs_compiled_grouped_mm", COMPILED)):
            done = rows.get(base)
            r[field] = _ratio(done if done and "skipped" not in done else None, r)
        print(f"{wl.name}: {label(record)} timed: fwd {fwd:.3f} ms, fwd+bwd {fwdbwd:.3f} ms, {r['tflops']:.0f} "
              f"TFLOP/s, {_fmt(r['ratio_vs_grouped_mm'], '.2f', 'x')} grouped_mm, "
              f"{_fmt(r['ratio_vs_compiled_grouped_mm'], '.2f', 'x')} compiled, peak {_fmt(r['peak_gib'], '.2f')} GiB",
              flush=True)
        if on_row is not None:
            on_row(list(rows.values()))
    measured = {k: r for k, r in rows.items() if "skipped" not in r}
    for r in measured.values():
        r["ratio_vs_grouped_mm"] = _ratio(measured.get(BASE), r)
        r["ratio_vs_compiled_grouped_mm"] = _ratio(measured.get(COMPILED), r)
        print(f"{wl.name}: {label(r)} {r['fwdbwd_ms']:.3f} ms {_fmt(r['ratio_vs_grouped_mm'], '.2f', 'x')} "
              f"(check max rel err {r['check_max_rel_err']:.1e})", flush=True)
    return list(rows.values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--loop", action="store_true", help="also time the HF-style loop (slow)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--calls", type=int, default=1,
                   help="back-to-back calls per timed repeat, every row alike: 1 (default) times each call "
                        "from an idle GPU, its host work before the first kernel included; more time the "
                        "steady state of a training loop, where a call's host work overlaps the previous "
                        "call's kernels")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd grouped_mm row")
    p.add_argument("--rows", nargs="*", default=None, metavar="IMPL:BACKEND:RECIPE",
                   help="time only the rows whose impl:backend:recipe matches one of these exactly (the eager "
                        "and, unless --no-compile, the compiled grouped_mm baselines always run), e.g. "
                        "ours:auto:bf16 ours:auto:fp8 liger:triton:bf16")
    p.add_argument("--dry-run", action="store_true",
                   help=f"only the tiny {DRY_RUN.name!r} shape, 2 repeats, on the CPU when there is no GPU: "
                        f"checks the script end to end")
    p.add_argument("--json", default=None, help="write records here")
    p.add_argument("--png", default=None, help="draw a bar chart here")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="redraw --png from saved records, no GPU")
    args = p.parse_args(argv)
    if args.plot_only:
        draw_png(json.loads(Path(args.plot_only).read_text()), args.png)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.dry_run:
        sys.exit("bench.py needs a CUDA GPU (or --dry-run)")
    workloads = [DRY_RUN] if args.dry_run else [WORKLOADS[name] for name in args.workloads]
    reps = 2 if args.dry_run else args.reps

    if args.calls < 1:
        sys.exit(f"--calls {args.calls}: expected >= 1")
    meta = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu", commit=git_commit(),
                date=datetime.date.today().isoformat(), calls=args.calls, reps=reps, torch=torch.__version__,
                cuda=torch.version.cuda, timer="cuda-events" if device == "cuda" else "host",
                check_shape=dataclasses.astuple(DRY_RUN if args.dry_run else CHECK)[1:])
    skips = {}
    impls = implementations(args.loop, compiled=not args.no_compile, skips=skips)
    if args.rows is not None:
        known = {":".join(key) for key in impls} | {":".join(key) for key in skips}
        unknown = sorted(set(args.rows) - known)
        if unknown:
            sys.exit(f"--rows: {unknown} match no row; expected some of {sorted(known)}")
        # The two grouped_mm baselines always run (the compiled one unless --no-compile): every ratio is to them.
        impls = {key: impl for key, impl in impls.items() if key in (BASE, COMPILED) or ":".join(key) in args.rows}
        skips = {key: reason for key, reason in skips.items() if ":".join(key) in args.rows}
    for key, reason in skips.items():
        print(f"{label(dict(impl=key[0], backend=key[1], recipe=key[2]))} skipped: {reason}", flush=True)
    records, checked = [], {}
    def write_json(rows):
        if args.json:  # after every row, so a run cut short keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(records + rows, indent=1) + "\n")

    for wl in workloads:
        records += run_workload(wl, impls, checked, reps, device, meta, DRY_RUN if args.dry_run else CHECK,
                                args.calls, on_row=write_json)
        write_json([])
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.png:
        draw_png(records, args.png)

    print()
    for key, reason in skips.items():
        print(f"- not measured: {label(dict(impl=key[0], backend=key[1], recipe=key[2]))}: {reason}")
    for r in records:
        if "skipped" in r:
            print(f"- not measured: {r['workload']} {label(r)}: {r['skipped']}")
    for note in dict.fromkeys(n for r in records for n in r.get("notes", [])):
        print(f"- note: {note}")
    timer = "CUDA-event" if device == "cuda" else "host-timer (no GPU)"
    print(f"\n{timer} medians of {reps} repeats, {args.calls} back-to-back call(s) per repeat, every row alike.")
    print_table(records)


if __name__ == "__main__":
    main()
