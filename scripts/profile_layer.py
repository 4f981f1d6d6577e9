#!/usr/bin/env python3
"""Where the time of the layer goes: its CUDA kernels and the gaps between them, and what the
``DGE_CHECK_IDS`` host sync costs a 48-layer training step.

``kernels``: one forward+backward (``--steps N``: N of them) under torch.profiler. Per kernel name
(our GEMMs by their configuration: grouping, mainloop, epilogue, N tile, stages, cluster, compiled K),
launches and device time per step;
then the whole step: kernels, their total time, the idle time between consecutive kernels (and
memcpy / memset) on each stream, and the largest gaps with the kernels around them. ``--warm-ms M`` runs
steps back to back for M ms first, without a pause before the profiled ones, so that they run at the
power-capped clock of ``bench.py``'s timed windows; ``--steps 4`` after it reads like ``bench.py --calls 4``
(the span per step is the step's time, the gaps its idle GPU).

``sync``: forward+backward of a stack of MegaMoE layers (Qwen3-30B-A3B's layer shapes, 48 layers,
4096 tokens), each with a tiny router (linear, softmax, top-k), under DGE_CHECK_IDS=1 and =0 in
alternating rounds; CUDA-event medians of the step and the difference per step and per layer. The
layers share one set of expert weights by default (48 distinct Qwen3-30B expert sets and their
gradients need about 116 GB): the kernels and host syncs per layer are the same either way.

    python scripts/profile_layer.py kernels --impl ours --workload qwen3-30b-a3b-t16384 [--recipe fp8] [--steps 3]
    python scripts/profile_layer.py kernels --workload qwen3-235b-a22b-t8192 --warm-ms 2000 --steps 4
    python scripts/profile_layer.py sync
    python scripts/profile_layer.py sync --dry-run      # 2 tiny layers, also on a CPU
    python scripts/profile_layer.py host [--workload qwen3-30b-a3b-t4096 ...]
    python scripts/profile_layer.py host --dry-run
    python scripts/profile_layer.py memory [--workload qwen3-30b-a3b-t16384] [--recipe fp8]

``host``: forward+backward of ``mega_moe_train`` per workload through the custom ops
(``DGE_EAGER_CUSTOM_OP=1``) and through the eager ``autograd.Function`` (the default), in
alternating rounds: medians of the step (CUDA events, each step starting on an idle GPU) and of the
host's time in the forward call and in the backward call.

``launches``: the host's and the GPU's clocks at every JIT launch of one forward+backward that starts
on an idle GPU (median over ``--steps`` steps): a CUDA event recorded just before each launch reads
when the stream reached it, so where the GPU's step between two launches equals the host's, the GPU
waited for the host (the kernels in between had finished); where it is longer, the host was ahead.

    python scripts/profile_layer.py launches [--workload qwen3-30b-a3b-t4096] [--recipe fp8]

``memory``: the caching allocator's trace of one forward+backward per recipe (after three warm-up
steps), replayed to the step's peak: the allocated bytes before the step, the peak, and the largest
blocks alive at the peak with where the package allocated them.

Each ends with a short markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext import _env  # noqa: E402
from deep_gemm_ext.baselines import grouped_mm_moe  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, environ, make_inputs  # noqa: E402

IMPLS = {"ours": dge.mega_moe_train, "grouped_mm": grouped_mm_moe}
#: Chrome-trace categories of device activity that occupies a stream.
DEVICE_CATEGORIES = {"kernel": "", "gpu_memcpy": "[memcpy] ", "gpu_memset": "[memset] "}


# ---------------------------------------------------------------------------------------------
# kernels


def _check_ids_label() -> str:
    """DGE_CHECK_IDS as the layer reads it: 1, 0, or unset (the default: a device-side check on GPUs)."""
    flag = _env.check_ids()
    return "unset" if flag is None else str(int(flag))


def device_activities(trace: dict) -> list[dict]:
    """(name, stream, start us, duration us) of every kernel, memcpy and memset in a chrome trace."""
    acts = []
    for ev in trace.get("traceEvents", []):
        prefix = DEVICE_CATEGORIES.get(str(ev.get("cat", "")).lower())
        if prefix is None or ev.get("ph") != "X":
            continue
        acts.append(dict(name=prefix + ev["name"], stream=ev.get("args", {}).get("stream", ev.get("tid")),
                         ts=float(ev["ts"]), dur=float(ev.get("dur", 0.0))))
    return acts


#: The kernel of ``torch.cuda._sleep``: ``kernels --warm-ms`` launches one between the warm-up and the
#: profiled steps.
MARKER_KERNEL = "spin_kernel"


def after_marker(acts: list[dict], marker: str) -> list[dict]:
    """The activities that start once the last activity whose name contains ``marker`` has ended (on a
    GPU that ran ahead of the host, the warm-up's last kernels are still in the trace before it)."""
    marks = [a for a in acts if marker in a["name"]]
    if not marks:
        raise ValueError(f"no activity named like {marker!r} in the trace: the profiled steps cannot be told "
                         f"from the warm-up")
    end = max(a["ts"] + a["dur"] for a in marks)
    return [a for a in acts if a["ts"] >= end and marker not in a["name"]]


def summarize(acts: list[dict], top_gaps: int = 5) -> dict:
    """Per-name counts and times, and per stream the idle gaps between consecutive activities
    (overlapping ones count no gap)."""
    per_name = defaultdict(lambda: [0, 0.0])
    for a in acts:
        per_name[a["name"]][0] += 1
        per_name[a["name"]][1] += a["dur"]
    gaps = []
    by_stream = defaultdict(list)
    for a in acts:
        by_stream[a["stream"]].append(a)
    for stream_acts in by_stream.values():
        stream_acts.sort(key=lambda a: a["ts"])
        busy_until, last = None, None
        for a in stream_acts:
            if busy_until is not None and a["ts"] > busy_until:
                gaps.append((a["ts"] - busy_until, last["name"], a["name"]))
            if busy_until is None or a["ts"] + a["dur"] > busy_until:
                busy_until, last = a["ts"] + a["dur"], a
    span = (max(a["ts"] + a["dur"] for a in acts) - min(a["ts"] for a in acts)) if acts else 0.0
    kernels = [a for a in acts if not a["name"].startswith("[")]
    return dict(
        per_name=sorted(((n, c, t) for n, (c, t) in per_name.items()), key=lambda r: -r[2]),
        kernels=len(kernels), kernel_us=sum(a["dur"] for a in kernels),
        activities=len(acts), busy_us=sum(a["dur"] for a in acts),
        gaps=len(gaps), gap_us=sum(g[0] for g in gaps), span_us=span, streams=len(by_stream),
        largest_gaps=sorted(gaps, reverse=True)[:top_gaps])


def _short(name: str, width: int = 90) -> str:
    name = name.replace("|", "/")
    return name if len(name) <= width else name[:width - 3] + "..."


_GEMM_TYPES = {"0": "M-grouped", "1": "K-grouped"}


def gemm_label(name: str) -> str | None:
    """A short label for a kernel of our SM90 GEMM core (its demangled name is too long to tell two
    configurations apart once cut): grouping, mainloop, epilogue, N tile, stages, CTAs per cluster and
    the compiled-in K (K0: a kernel argument), e.g. "GEMM M-grouped MainloopFP8 EpilogueScatterSlots
    n192 s4 c1 K1536"; None for any other kernel."""
    start = name.find("sm90_grouped_gemm_kernel<")
    traits = name.find("GemmTraits<", start)
    if start < 0 or traits < 0:
        return None
    end = name.find(">", traits)
    args = [a.strip().split(")")[-1].rstrip("u") for a in name[traits + len("GemmTraits<"):end].split(",")]
    if len(args) < 6:
        return None
    policies = [p.split("<")[0] for p in re.findall(r"dge::gemm::((?:Loader|Mainloop|Epilogue)\w*)", name[end:])]
    mainloop = next((p for p in policies if p.startswith("Mainloop")), "?")
    epilogue = next((p for p in policies if p.startswith("Epilogue")), "?")
    k = args[9] if len(args) > 9 else "0"
    return (f"GEMM {_GEMM_TYPES.get(args[0], args[0])} {mainloop} {epilogue} n{args[3]} s{args[4]} c{args[5]} "
            f"K{k}")


def print_kernel_report(title: str, s: dict, rows: int, steps: int = 1) -> None:
    """The per-name table (launches and time per step, over ``steps`` profiled steps; our GEMMs by
    their configuration, gemm_label), the largest gaps and the totals of all the steps."""
    print(f"\n{title}")
    print("\n| kernel | launches per step | us per step | mean us |\n|---|---|---|---|")
    for name, count, total in s["per_name"][:rows]:
        print(f"| {gemm_label(name) or _short(name)} | {count / steps:g} | {total / steps:.1f} | {total / count:.1f} |")
    if len(s["per_name"]) > rows:
        rest = s["per_name"][rows:]
        print(f"| ({len(rest)} more names) | {sum(r[1] for r in rest) / steps:g} | "
              f"{sum(r[2] for r in rest) / steps:.1f} | |")
    print("\n| largest gap us | after | before |\n|---|---|---|")
    for gap, before, after in s["largest_gaps"]:
        print(f"| {gap:.1f} | {gemm_label(before) or _short(before, 60)} | {gemm_label(after) or _short(after, 60)} |")
    if steps > 1:
        print(f"\nTotals over the {steps} steps:")
    print("\n| kernels | kernel us | memcpy/memset | gaps | gap us | span us | streams |\n|---|---|---|---|---|---|---|")
    print(f"| {s['kernels']} | {s['kernel_us']:.1f} | {s['activities'] - s['kernels']} | {s['gaps']} "
          f"| {s['gap_us']:.1f} | {s['span_us']:.1f} | {s['streams']} |")


def cmd_kernels(args) -> int:
    from torch.profiler import ProfilerActivity, profile

    if args.steps < 1:
        print(f"--steps {args.steps}: expected at least 1", file=sys.stderr)
        return 2
    if not args.warm_ms >= 0:
        print(f"--warm-ms {args.warm_ms}: expected a number >= 0", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("profile_layer.py kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    wl = WORKLOADS[args.workload]
    x, idx, w, l1, l2 = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                                    device="cuda", seed=7)
    dy = torch.randn_like(x)
    fn = IMPLS[args.impl]
    if args.recipe != "bf16" and args.impl != "ours":
        print(f"--recipe {args.recipe}: only --impl ours has recipes", file=sys.stderr)
        return 2
    kwargs = {"recipe": args.recipe} if args.impl == "ours" else {}

    def step():
        y = fn(x, idx, w, l1, l2, **kwargs)
        torch.autograd.grad(y, (x, w, l1, l2), dy)

    for _ in range(3):  # JIT builds and allocator warm-up stay out of the profile
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU op tracing: it would widen the gaps
        if args.warm_ms > 0:
            # Steps back to back until the board's power limit holds the clock, as in bench.py's timed
            # windows (docs/perf-notes.md v33), inside the profile so that the GPU never idles before the
            # profiled steps; a marker kernel between them, and only what runs after it is reported.
            # The host waits for the step before last, so the time is the GPU's, not a queue's.
            done = []
            warm_until = time.perf_counter() + args.warm_ms / 1e3
            while time.perf_counter() < warm_until:
                step()
                done.append(torch.cuda.Event())
                done[-1].record()
                if len(done) > 2:
                    done.pop(0).synchronize()
            torch.cuda._sleep(1000)
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if args.trace:
            Path(args.trace).write_text(path.read_text())
    acts = device_activities(trace)
    if args.warm_ms > 0:
        acts = after_marker(acts, MARKER_KERNEL)
    s = summarize(acts)
    steps = "one forward+backward" if args.steps == 1 else f"{args.steps} forward+backward steps"
    if args.warm_ms > 0:
        steps += f" after {args.warm_ms:g} ms of steps back to back"
    print_kernel_report(f"{args.impl} ({args.recipe}) on {args.workload} (DGE_CHECK_IDS={_check_ids_label()}): "
                        f"{steps}", s, args.rows, args.steps)
    return 0


# ---------------------------------------------------------------------------------------------
# sync


class RoutedStack(nn.Module):
    """``layers`` residual MoE layers, each routed by its own tiny linear router (softmax, top-k,
    renormalised weights) and computed by a MegaMoE (one shared, or one per layer)."""

    def __init__(self, layers, hidden, inter, experts, top_k, distinct, device, dtype):
        super().__init__()
        self.top_k = top_k
        self.routers = nn.ModuleList(nn.Linear(hidden, experts, bias=False, device=device, dtype=dtype)
                                     for _ in range(layers))
        count = layers if distinct else 1
        self.experts = nn.ModuleList(dge.MegaMoE(experts, hidden, inter, top_k, device=device, dtype=dtype)
                                     for _ in range(count))
        for m in self.experts:
            m.reset_parameters(init_std=0.02 / layers ** 0.5)

    def forward(self, x):
        for i, router in enumerate(self.routers):
            probs = router(x).float().softmax(-1)
            weights, idx = probs.topk(self.top_k, dim=-1)
            x = x + self.experts[i % len(self.experts)](x, idx, weights / weights.sum(-1, keepdim=True))
        return x


def cmd_sync(args) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        print("profile_layer.py sync needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    if args.dry_run:
        args.layers, args.tokens, args.hidden, args.intermediate, args.experts, args.top_k = 2, 32, 64, 32, 8, 2
        args.rounds, args.steps = 1, 2
    torch.manual_seed(0)
    model = RoutedStack(args.layers, args.hidden, args.intermediate, args.experts, args.top_k,
                        args.distinct_weights, device, torch.bfloat16)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)

    def step():
        loss = model(x).float().square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    def timed() -> float:
        if device == "cpu":
            start = time.perf_counter()
            step()
            return 1e3 * (time.perf_counter() - start)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    saved = os.environ.get("DGE_CHECK_IDS")
    times = {"1": [], "0": []}
    try:
        for _ in range(args.warmup):
            step()
        for r in range(args.rounds):  # alternating blocks of steps, so drift hits both settings alike
            for value in (("1", "0") if r % 2 == 0 else ("0", "1")):
                os.environ["DGE_CHECK_IDS"] = value
                step()  # the first step after a switch is not timed
                times[value] += [timed() for _ in range(args.steps)]
    finally:
        if saved is None:
            os.environ.pop("DGE_CHECK_IDS", None)
        else:
            os.environ["DGE_CHECK_IDS"] = saved
    med = {k: statistics.median(v) for k, v in times.items()}
    diff = med["1"] - med["0"]
    print(f"\n{args.layers} MegaMoE layers ({'distinct' if args.distinct_weights else 'shared'} expert weights), "
          f"T={args.tokens} H={args.hidden} I={args.intermediate} E={args.experts} K={args.top_k}, bf16, "
          f"forward+backward on {device}; {len(times['1'])} steps per setting "
          f"({'CUDA events' if device == 'cuda' else 'wall clock'})\n")
    print("| DGE_CHECK_IDS | median step ms | min ms | max ms |\n|---|---|---|---|")
    for k in ("1", "0"):
        print(f"| {k} | {med[k]:.3f} | {min(times[k]):.3f} | {max(times[k]):.3f} |")
    print("\n| check costs per step ms | per layer us | share of the step |\n|---|---|---|")
    print(f"| {diff:.3f} | {1e3 * diff / args.layers:.1f} | {100 * diff / med['1']:.1f}% |")
    return 0


# ---------------------------------------------------------------------------------------------
# memory


def replay_peak(events: list[dict]) -> tuple[int, int, list[dict]]:
    """Replay a caching-allocator trace (``torch.cuda.memory._snapshot()["device_traces"][d]``): the peak
    of the bytes allocated since the trace began (allocs less ``free_requested``), the index of the
    event that reached it, and the blocks alive then (the trace's alloc events)."""
    alive: dict[int, dict] = {}
    current = best = 0
    best_index, best_alive = -1, []
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            current += event["size"]
            if current > best:
                best, best_index, best_alive = current, i, list(alive.values())
        elif event["action"] == "free_requested" and event["addr"] in alive:
            current -= alive.pop(event["addr"])["size"]
    return best, best_index, best_alive


def _alloc_site(event: dict, package: str = "deep_gemm_ext", depth: int = 3) -> str:
    frames = [f for f in event.get("frames", []) if package in f["filename"]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:depth]) or "-"


def _step_memory(wl, recipe: str) -> tuple[int, int, list[dict]]:
    """(bytes allocated before the step, the step's peak, the blocks alive at the peak)."""
    x, idx, w, l1, l2 = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                                    device="cuda", seed=7)
    dy = torch.randn_like(x)

    def step():
        y = dge.mega_moe_train(x, idx, w, l1, l2, recipe=recipe)
        torch.autograd.grad(y, (x, w, l1, l2), dy)

    for _ in range(3):  # JIT loads, the weight cache and the allocator's pools stay out of it
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    _, _, alive = replay_peak(snapshot["device_traces"][torch.cuda.current_device()])
    return base, torch.cuda.max_memory_allocated(), alive


def cmd_memory(args) -> int:
    if not torch.cuda.is_available():
        print("profile_layer.py memory needs a CUDA GPU", file=sys.stderr)
        return 2
    wl = WORKLOADS[args.workload]
    results = {}
    for recipe in args.recipe or ["bf16", "fp8"]:
        results[recipe] = _step_memory(wl, recipe)
        torch.cuda.empty_cache()
    print(f"\n{args.workload}: blocks alive at the peak of one forward+backward (caching allocator trace)\n")
    print("| recipe | base GiB | peak GiB | step GiB | block MiB | allocated at |\n|---|---|---|---|---|---|")
    for recipe, (base, peak, alive) in results.items():
        for i, block in enumerate(sorted(alive, key=lambda e: -e["size"])[:args.rows]):
            head = (f"| {recipe} | {base / 2**30:.3f} | {peak / 2**30:.3f} | {(peak - base) / 2**30:.3f} " if i == 0
                    else "| | | | ")
            print(f"{head}| {block['size'] / 2**20:.1f} | {_alloc_site(block)} |")
    return 0


# ---------------------------------------------------------------------------------------------
# host


_BACK_TO_BACK = 4


def _back_to_back_ms(x, idx, w, l1, l2, dy, device, sync, recipe: str) -> float:
    """ms per step of _BACK_TO_BACK steps in a row (each step's host work overlapping the previous
    one's kernels, as in a training loop): against the idle-start step, what the host exposes."""
    sync()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(_BACK_TO_BACK):
        torch.autograd.grad(dge.mega_moe_train(x, idx, w, l1, l2, recipe=recipe), (x, w, l1, l2), dy)
    if device == "cuda":
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / _BACK_TO_BACK
    return 1e3 * (time.perf_counter() - t0) / _BACK_TO_BACK


def _host_step(x, idx, w, l1, l2, dy, device, sync, recipe: str = "bf16") -> tuple[float, float, float]:
    """(step ms, host ms in the forward call, host ms in the backward call) of one step that starts on
    an idle GPU, as a step after a synchronize does."""
    sync()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    y = dge.mega_moe_train(x, idx, w, l1, l2, recipe=recipe)
    t1 = time.perf_counter()
    torch.autograd.grad(y, (x, w, l1, l2), dy)
    t2 = time.perf_counter()
    if device == "cuda":
        end.record()
        end.synchronize()
        step_ms = start.elapsed_time(end)
    else:
        step_ms = 1e3 * (t2 - t0)
    return step_ms, 1e3 * (t1 - t0), 1e3 * (t2 - t1)


def cmd_host(args) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        print("profile_layer.py host needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    shapes = ([("dry-run", 64, 128, 128, 8, 2)] if args.dry_run else  # 128: fp8 blocks
              [(n, WORKLOADS[n].num_tokens, WORKLOADS[n].hidden, WORKLOADS[n].intermediate, WORKLOADS[n].num_experts,
                WORKLOADS[n].top_k) for n in (args.workload or ["qwen3-30b-a3b-t4096"])])
    rounds, steps = (1, 2) if args.dry_run else (args.rounds, args.steps)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for name, T, H, I, E, K in shapes:
        x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, device=device, dtype=dtype, seed=7)
        dy = torch.randn_like(x)
        samples = {"1": [], "0": []}
        runs = {"1": [], "0": []}
        for r in range(rounds):  # alternating blocks, so drift hits both settings alike
            for value in (("1", "0") if r % 2 == 0 else ("0", "1")):
                with environ({"DGE_EAGER_CUSTOM_OP": value}):
                    for _ in range(2):  # not timed: the first steps after a switch
                        torch.autograd.grad(dge.mega_moe_train(x, idx, w, l1, l2, recipe=args.recipe),
                                            (x, w, l1, l2), dy)
                    samples[value] += [_host_step(x, idx, w, l1, l2, dy, device, sync, args.recipe)
                                       for _ in range(steps)]
                    runs[value] += [_back_to_back_ms(x, idx, w, l1, l2, dy, device, sync, args.recipe)
                                    for _ in range(max(1, steps // _BACK_TO_BACK))]
        for value in ("1", "0"):
            cols = list(zip(*samples[value]))
            rows.append((name, value, statistics.median(cols[0]), statistics.median(runs[value]),
                         *(statistics.median(c) for c in cols[1:])))
    print(f"\nforward+backward of mega_moe_train (recipe={args.recipe}) on {device}, {rounds * steps} steps per "
          f"setting ({'CUDA events' if device == 'cuda' else 'wall clock'} for the steps, the host's clock for the "
          f"calls); idle start: each step after a synchronize, as scripts/bench.py times it; back to back: "
          f"{_BACK_TO_BACK} steps in a row per sample\n")
    print("| workload | path | step ms, idle start | step ms, back to back | host forward ms | host backward ms |\n"
          "|---|---|---|---|---|---|")
    for name, value, step_ms, run_ms, fwd_ms, bwd_ms in rows:
        path = "custom ops (DGE_EAGER_CUSTOM_OP=1)" if value == "1" else "autograd.Function (default)"
        print(f"| {name} | {path} | {step_ms:.3f} | {run_ms:.3f} | {fwd_ms:.3f} | {bwd_ms:.3f} |")
    return 0


def _launch_timeline(x, idx, w, l1, l2, dy, recipe: str):
    """[(name, host µs, GPU µs)] of one step from an idle GPU: every JIT launch, the
    forward's return and the backward's end, both clocks relative to the call."""
    from deep_gemm_ext.jit import runtime

    marks = []

    def mark(name):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, time.perf_counter_ns(), event))

    original = runtime.Kernel.launch_bytes

    def launch_bytes(self, *a, **k):
        mark(self.name)
        return original(self, *a, **k)

    torch.cuda.synchronize()
    runtime.Kernel.launch_bytes = launch_bytes
    try:
        mark("call")
        y = dge.mega_moe_train(x, idx, w, l1, l2, recipe=recipe)
        mark("forward returned")
        torch.autograd.grad(y, (x, w, l1, l2), dy)
        mark("backward returned")
    finally:
        runtime.Kernel.launch_bytes = original
    torch.cuda.synchronize()
    _, h0, e0 = marks[0]
    return [(name, (h - h0) / 1e3, e0.elapsed_time(e) * 1e3) for name, h, e in marks]


def cmd_launches(args) -> int:
    if not torch.cuda.is_available():
        print("profile_layer.py launches needs a CUDA GPU", file=sys.stderr)
        return 2
    wl = WORKLOADS[args.workload]
    x, idx, w, l1, l2 = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                                    device="cuda", dtype=torch.bfloat16, seed=7)
    dy = torch.randn_like(x)
    for _ in range(3):
        torch.autograd.grad(dge.mega_moe_train(x, idx, w, l1, l2, recipe=args.recipe), (x, w, l1, l2), dy)
    steps = [_launch_timeline(x, idx, w, l1, l2, dy, args.recipe) for _ in range(args.steps)]
    names = [[m[0] for m in s] for s in steps]
    if any(n != names[0] for n in names):
        print("the steps launched different sequences; the first step's is listed", file=sys.stderr)
        steps = steps[:1]
    print(f"\n{args.workload} recipe={args.recipe}: every JIT launch of one forward+backward from an idle GPU, "
          f"median of {len(steps)} steps; µs since the call on the host's clock and on the GPU's (an event just "
          f"before the launch); a GPU step no longer than the host's: the GPU waited for the host\n")
    print("| # | launch | host µs | GPU µs | host step | GPU step |\n|---|---|---|---|---|---|")
    prev_h = prev_g = 0.0
    for i, name in enumerate(names[0]):
        h = statistics.median(s[i][1] for s in steps)
        g = statistics.median(s[i][2] for s in steps)
        print(f"| {i} | {name} | {h:.0f} | {g:.0f} | {h - prev_h:.0f} | {g - prev_g:.0f} |")
        prev_h, prev_g = h, g
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels", help="kernels and gaps of one forward+backward")
    k.add_argument("--impl", choices=list(IMPLS), default="ours")
    k.add_argument("--workload", choices=list(WORKLOADS), default="qwen3-30b-a3b-t16384")
    k.add_argument("--recipe", choices=["bf16", "fp8"], default="bf16", help="the layer's recipe (--impl ours)")
    k.add_argument("--rows", type=int, default=25, help="kernel names listed (by total time)")
    k.add_argument("--trace", default=None, help="also save the chrome trace here")
    k.add_argument("--steps", type=int, default=1, help="forward+backward steps profiled (the table is per step)")
    k.add_argument("--warm-ms", type=float, default=0.0,
                   help="before the profile, steps back to back for this long (wall-clock ms): a profile "
                        "at the power-capped clock, whose gaps and span compare with bench.py's back-to-back rows")
    s = sub.add_parser("sync", help="DGE_CHECK_IDS=1 vs 0 on a stack of routed layers")
    s.add_argument("--layers", type=int, default=48)
    s.add_argument("--tokens", type=int, default=4096)
    wl = WORKLOADS["qwen3-30b-a3b-t4096"]
    s.add_argument("--hidden", type=int, default=wl.hidden)
    s.add_argument("--intermediate", type=int, default=wl.intermediate)
    s.add_argument("--experts", type=int, default=wl.num_experts)
    s.add_argument("--top-k", type=int, default=wl.top_k)
    s.add_argument("--distinct-weights", action="store_true", help="one expert set per layer (about 116 GB)")
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--rounds", type=int, default=4, help="alternations between the two settings")
    s.add_argument("--steps", type=int, default=5, help="timed steps per setting per round")
    s.add_argument("--dry-run", action="store_true", help="2 tiny layers, 1 round: checks the script, also on a CPU")
    h = sub.add_parser("host", help="step and host time, custom ops vs the eager autograd.Function")
    h.add_argument("--workload", action="append", choices=list(WORKLOADS),
                   help="repeatable; default qwen3-30b-a3b-t4096")
    h.add_argument("--rounds", type=int, default=4, help="alternations between the two paths")
    h.add_argument("--steps", type=int, default=10, help="timed steps per path per round")
    h.add_argument("--recipe", choices=["bf16", "fp8"], default="bf16", help="the layer's recipe")
    h.add_argument("--dry-run", action="store_true", help="a tiny layer, 1 round: checks the script, also on a CPU")
    m = sub.add_parser("memory", help="what is alive at the peak of one forward+backward")
    m.add_argument("--workload", choices=list(WORKLOADS), default="qwen3-30b-a3b-t16384")
    m.add_argument("--recipe", action="append", choices=["bf16", "fp8"], help="repeatable; default both")
    m.add_argument("--rows", type=int, default=12, help="largest blocks listed per recipe")
    la = sub.add_parser("launches", help="host and GPU clocks at every launch of one step from an idle GPU")
    la.add_argument("--workload", choices=list(WORKLOADS), default="qwen3-30b-a3b-t4096")
    la.add_argument("--recipe", choices=["bf16", "fp8"], default="bf16", help="the layer's recipe")
    la.add_argument("--steps", type=int, default=5, help="steps recorded (the table is their median)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("kernels", "sync", "host", "memory", "launches", "-h", "--help"):
        argv = ["kernels", *argv]  # the command line before the sync measurement existed
    args = p.parse_args(argv)
    return {"kernels": cmd_kernels, "sync": cmd_sync, "host": cmd_host, "memory": cmd_memory,
            "launches": cmd_launches}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
