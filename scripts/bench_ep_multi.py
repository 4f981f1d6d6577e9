#!/usr/bin/env python3
"""Expert parallelism over W GPUs of one node, one process a GPU: forward+backward time of one MoE
layer step, every row timed in the same processes.

    torchrun --nproc-per-node 8 scripts/bench_ep_multi.py                 # 16384 tokens a rank
    torchrun --nproc-per-node 2 scripts/bench_ep_multi.py --dry-run       # CPU, gloo, tiny shapes

Workloads (deep_gemm_ext.testing.WORKLOADS' shapes, ``--tokens`` tokens per rank, E_loc = E / W):
Qwen3-30B-A3B (E 128, K 8, H 2048, I 768) and Qwen3-235B-A22B (E 128, K 8, H 4096, I 1536); fresh
random inputs, uniform routing, every rank its own tokens and its own E_loc experts.

Rows:
- torchtitan way (``deep_gemm_ext.baselines.ep_grouped_mm_moe``): counts exchanged by an all-to-all
  and brought to the host, ``all_to_all_single`` dispatch of every routed slot's row, the local
  ``grouped_mm_moe``, ``all_to_all_single`` combine, autograd backward; eager, and with the local part
  under ``torch.compile(fullgraph=True, dynamic=False)`` (where dynamo cannot take it whole, the
  script prints a note and times ``torch.compile(dynamic=False)`` with graph breaks).
- ours: ``mega_moe_train`` over the all-to-all transport (``EpBuffer``), over the symmetric-memory
  transport (``SymmetricEpBuffer``), and symmetric with ``DGE_EP_OVERLAP=1``; bf16 and
  ``recipe="fp8"`` (the overlap applies to bf16 rows only, so it has no fp8 row).
- the local layer with the exchange stubbed: a group of one, i.e. ``mega_moe_train`` without a group
  on the rows, ids and weights this rank's dispatch receives (the same per-rank received token
  count, ``W * max_tokens_per_rank`` rows, and the same E_loc experts), bf16 and fp8.
- the exchange pieces alone, per transport (and row format): dispatch, combine, combine_backward,
  dispatch_backward called directly, in the layer's order.

Communication hidden, per EP row of ours (second table):

    fraction hidden = 1 - (t_ep - t_stub) / t_comm_alone

t_ep the row's fwd+bwd, t_stub the stubbed local layer's (same recipe), t_comm_alone the exchange
pieces of that transport timed alone. 1 means the exchange costs nothing on top of the local
layer, 0 that it costs as much as alone (serialized), below 0 that the EP step costs more than the
two apart (e.g. synchronization waits).

Every time is the median of ``--reps`` CUDA-event timings after ``--warmup`` calls
(``deep_gemm_ext.testing.median_ms``; on the CPU dry run, host wall-clock), the largest over the
ranks (the step ends when the slowest rank's does). TFLOP/s per GPU: 3 * 6 * T * K * H * I per
step (T tokens a rank). Ratios: the torchtitan eager row's time over the row's (and the compiled
row's). Before timing, on a small shape, every row's y is checked against our all-to-all layer's
y (bf16 tolerance 2e-2; fp8 1e-1); a row that fails the check or cannot run is listed as
"not measured: <reason>".

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set in this process's environment before NCCL and symmetric memory
start (deep_gemm_ext.testing.NVLINK_MULTICAST_OFF).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deep_gemm_ext.testing import NVLINK_MULTICAST_OFF  # noqa: E402

# Set explicitly, before NCCL or symmetric memory start: no NVLink multicast anywhere.
os.environ.update(NVLINK_MULTICAST_OFF)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext import baselines, comm  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, environ, make_routing, median_ms, rel_err  # noqa: E402

TITAN, TITAN_COMPILED = "torchtitan way (all_to_all_single + grouped_mm), eager", \
    "torchtitan way, local part torch.compile'd"
CHECK_TOL = {"bf16": 2e-2, "fp8": 1e-1}


class Ctx:
    def __init__(self, args):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cpu = args.dry_run
        self.device = torch.device("cpu") if self.cpu else torch.device("cuda", torch.cuda.current_device())
        self.reps, self.warmup = args.reps, args.warmup
        self.group = dist.group.WORLD
        self.notes: list[str] = []

    def log(self, text):
        if self.rank == 0:
            print(text, flush=True)


def _dims(args, world):
    """(name, tokens per rank, hidden, inter, experts, top_k) per workload."""
    if args.dry_run:
        return [("tiny (dry run)", 24, 128, 128, 2 * world, 2)]
    picked = []
    for key, label in (("qwen3-30b-a3b-t16384", "Qwen3-30B-A3B"), ("qwen3-235b-a22b-t8192", "Qwen3-235B-A22B")):
        wl = WORKLOADS[key]
        if args.workloads and label not in args.workloads:
            continue
        picked.append((f"{label} T {args.tokens}/rank W {world}", args.tokens, wl.hidden, wl.intermediate,
                       wl.num_experts, wl.top_k))
    return picked


def _inputs(ctx, tokens, hidden, inter, experts, top_k, seed):
    """This rank's tokens, routing, output gradient and its E_loc experts (fresh, seeded by rank)."""
    if experts % ctx.world:
        raise ValueError(f"{experts} experts do not split over {ctx.world} ranks")
    e_loc = experts // ctx.world
    g = torch.Generator().manual_seed(seed * 1009 + ctx.rank)
    dev = ctx.device
    gd = torch.Generator(device=dev).manual_seed(seed * 1009 + ctx.rank)
    dtype = torch.bfloat16
    x = torch.randn(tokens, hidden, device=dev, generator=gd).to(dtype)
    idx = make_routing(tokens, experts, top_k, "uniform", generator=g).to(dev)
    w = torch.rand(tokens, top_k, generator=g) + 0.05
    w = (w / w.sum(-1, keepdim=True)).to(dev)
    l1 = (torch.randn(e_loc, 2 * inter, hidden, device=dev, generator=gd) / hidden ** 0.5).to(dtype)
    l2 = (torch.randn(e_loc, hidden, inter, device=dev, generator=gd) / inter ** 0.5).to(dtype)
    dy = torch.randn(tokens, hidden, device=dev, generator=gd).to(dtype)
    return x, idx, w, l1, l2, dy


def _fwd_bwd(fn, x, idx, w, l1, l2, dy):
    leaves = [t.detach().requires_grad_(True) for t in (x, w, l1, l2)]
    y = fn(leaves[0], idx, *leaves[1:])
    torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return y.detach()


def _time(ctx, fn) -> float:
    """Median ms of fn() on this rank, then the largest over the ranks."""
    dist.barrier()
    if ctx.cpu:
        for _ in range(ctx.warmup):
            fn()
        times = []
        for _ in range(ctx.reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)
    else:
        ms = median_ms(fn, reps=ctx.reps, warmup=ctx.warmup)
    value = torch.tensor([ms], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _agree(ctx, error: str | None) -> str | None:
    """Every rank's verdict on a row: the first rank's error, if any rank had one."""
    errors = [None] * ctx.world
    dist.all_gather_object(errors, error, group=ctx.group)
    for r, e in enumerate(errors):
        if e is not None:
            return f"rank {r}: {e}"
    return None


def _compiled_local(ctx):
    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    state = {"fn": torch.compile(baselines.grouped_mm_moe, fullgraph=True, dynamic=False), "fullgraph": True}

    def local(*args):
        try:
            return state["fn"](*args)
        except Exception as exc:  # noqa: BLE001 -- dynamo could not take it whole: fall back, say so
            if not state["fullgraph"]:
                raise
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            ctx.notes.append(f"torch.compile(fullgraph=True) of the local grouped_mm_moe failed "
                             f"({type(exc).__name__}: {first}); timed torch.compile(dynamic=False) with graph breaks")
            state.update(fn=torch.compile(baselines.grouped_mm_moe, dynamic=False), fullgraph=False)
            return state["fn"](*args)

    return local


class Rows:
    """The step of every row over buffers of one shape class (``cap`` tokens a rank)."""

    def __init__(self, ctx, cap, hidden, top_k, local_compiled):
        self.ctx = ctx
        self.a2a = dge.EpBuffer(ctx.group, cap, hidden, top_k, torch.bfloat16)
        self.sym, error = None, None
        if ctx.cpu:
            error = "needs CUDA GPUs (symmetric memory and our transport kernels); CPU dry run"
        else:
            try:
                self.sym = dge.SymmetricEpBuffer(ctx.group, cap, hidden, top_k, torch.bfloat16)
            except Exception as exc:  # noqa: BLE001
                error = f"SymmetricEpBuffer failed: {type(exc).__name__}: {exc}"
        self.sym_reason = error if ctx.cpu else _agree(ctx, error)
        if self.sym_reason:
            self.sym = None
        self.local = local_compiled

    def buffer(self, transport):
        return self.a2a if transport == "all_to_all" else self.sym

    def layer(self, transport, recipe, overlap=False):
        group, buffer = self.ctx.group, self.buffer(transport)

        def fn(x, idx, w, l1, l2):
            with environ({"DGE_EP_OVERLAP": "1" if overlap else "0"}):  # read per call (deep_gemm_ext._env)
                return dge.mega_moe_train(x, idx, w, l1, l2, group=group, ep_buffer=buffer, recipe=recipe)
        return fn

    def titan(self, compiled):
        group, local = self.ctx.group, (self.local if compiled else None)
        return lambda x, idx, w, l1, l2: baselines.ep_grouped_mm_moe(x, idx, w, l1, l2, group, local_fn=local)

    def table(self):
        """(label, kind, transport, recipe, fn or None, skip reason); kind: titan / ours."""
        out = [(TITAN, "titan", None, "bf16", self.titan(False), None),
               (TITAN_COMPILED, "titan", None, "bf16", self.titan(True) if self.local else None,
                None if self.local else "--no-compile")]
        for recipe in ("bf16", "fp8"):
            out.append((f"ours, all-to-all (EpBuffer), {recipe}", "ours", "all_to_all", recipe,
                        self.layer("all_to_all", recipe), None))
            out.append((f"ours, symmetric (SymmetricEpBuffer), {recipe}", "ours", "symmetric", recipe,
                        self.layer("symmetric", recipe) if self.sym else None, self.sym_reason))
            if recipe == "bf16":
                out.append(("ours, symmetric, DGE_EP_OVERLAP=1, bf16", "ours", "symmetric", recipe,
                            self.layer("symmetric", recipe, overlap=True) if self.sym else None, self.sym_reason))
        return out


def _exchange_pieces(buffer, e_loc, x, idx, w, fp8):
    """The four exchange pieces in the layer's order, on rows of the step's shapes."""
    ex = comm.exchange(buffer.exchange_spec(e_loc, fp8_rows=fp8))

    def pieces():
        x_r, idx_r, w_r, handle = ex.dispatch(x, idx, w)
        y = ex.combine(x_r, handle)
        dy_r = ex.combine_backward(y, handle)
        return ex.dispatch_backward(dy_r, w_r, handle)
    return ex, pieces


def _try(ctx, fn):
    """fn() on every rank; the ranks' agreed error (None when every rank succeeded) and fn's value."""
    try:
        value, error = fn(), None
    except Exception as exc:  # noqa: BLE001 -- reported as the row's reason
        value, error = None, f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    return _agree(ctx, error), value


def check_rows(ctx, local_compiled, seed) -> dict[str, str | None]:
    """Every row's y on a small shape against our all-to-all layer's y: label -> reason it fails."""
    if ctx.cpu:
        tokens, hidden, inter, experts, top_k = 24, 128, 128, 2 * ctx.world, 2
    else:
        tokens, hidden, inter, experts, top_k = 256, 512, 256, 4 * ctx.world, 4
    rows = Rows(ctx, tokens, hidden, top_k, local_compiled)
    inputs = _inputs(ctx, tokens, hidden, inter, experts, top_k, seed + 7)
    reason, want = _try(ctx, lambda: _fwd_bwd(rows.layer("all_to_all", "bf16"), *inputs))
    verdicts = {}
    for label, _, _, recipe, fn, skip in rows.table():
        if skip or fn is None:
            verdicts[label] = skip or "not available"
            continue
        if reason:
            verdicts[label] = f"the reference row (ours, all-to-all, bf16) failed on the check shape: {reason}"
            continue
        error, got = _try(ctx, lambda: _fwd_bwd(fn, *inputs))
        if error is None:
            err = torch.tensor([rel_err(got, want) if want.numel() else 0.0], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            if not float(err) <= CHECK_TOL[recipe]:
                error = (f"y differs from our all-to-all layer's on the check shape (T {tokens}, H {hidden}, I {inter}, "
                         f"E {experts}, K {top_k}): rel err {float(err):.3g} > {CHECK_TOL[recipe]}")
        verdicts[label] = error
    return verdicts


def run_workload(ctx, name, tokens, hidden, inter, experts, top_k, seed, verdicts, local_compiled):
    """Rows of the main table [(label, ms or None, reason, counts_flops)] and the hidden table's rows."""
    e_loc = experts // ctx.world
    rows = Rows(ctx, tokens, hidden, top_k, local_compiled)
    x, idx, w, l1, l2, dy = _inputs(ctx, tokens, hidden, inter, experts, top_k, seed)
    out, ep = [], {}

    def measure(label, step, flops_row=True):
        reason, _ = _try(ctx, step)  # first call outside the timing: JIT compiles, torch.compile, agreement
        if reason:
            out.append((label, None, reason, flops_row))
            return None
        ms = _time(ctx, step)
        out.append((label, ms, None, flops_row))
        return ms

    for label, kind, transport, recipe, fn, skip in rows.table():
        reason = skip or verdicts.get(label)
        if reason or fn is None:
            out.append((label, None, reason or "not available", True))
            continue
        ms = measure(label, lambda fn=fn: _fwd_bwd(fn, x, idx, w, l1, l2, dy))
        if kind == "ours" and ms is not None:
            ep[label] = (transport, recipe, ms)

    # The exchange stubbed: the local layer on the rows, ids and weights this rank's dispatch receives.
    stub = {}
    for recipe in ("bf16", "fp8"):
        ex = comm.exchange(rows.a2a.exchange_spec(e_loc, fp8_rows=recipe == "fp8"))
        x_r, idx_r, w_r, _ = ex.dispatch(x, idx, w)
        dy_r = torch.randn_like(x_r)
        local = lambda x_, i_, w_, a_, b_, recipe=recipe: dge.mega_moe_train(x_, i_, w_, a_, b_, recipe=recipe)
        stub[recipe] = measure(f"local layer, exchange stubbed (group of one, {x_r.shape[0]} received rows), "
                               f"{recipe}", lambda local=local, x_r=x_r, idx_r=idx_r, w_r=w_r, dy_r=dy_r:
                               _fwd_bwd(local, x_r, idx_r, w_r, l1, l2, dy_r))

    # The exchange pieces alone, per transport and row format.
    comm_ms = {}
    for transport in ("all_to_all", "symmetric"):
        for recipe in ("bf16", "fp8"):
            label = f"exchange pieces alone ({transport}, {'fp8' if recipe == 'fp8' else 'bf16'} rows)"
            if rows.buffer(transport) is None:
                out.append((label, None, rows.sym_reason, False))
                continue
            _, pieces = _exchange_pieces(rows.buffer(transport), e_loc, x, idx, w, recipe == "fp8")
            comm_ms[(transport, recipe)] = measure(label, pieces, flops_row=False)

    hidden_rows = []
    for label, (transport, recipe, ms) in ep.items():
        t_stub, t_comm = stub.get(recipe), comm_ms.get((transport, recipe))
        frac = None if t_stub is None or not t_comm else 1 - (ms - t_stub) / t_comm
        hidden_rows.append((label, ms, t_stub, t_comm, frac))
    del rows
    return out, hidden_rows


def _fmt(value, spec, suffix=""):
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_tables(ctx, name, flops, out, hidden_rows):
    base = {label: ms for label, ms, _, _ in out}
    eager, compiled = base.get(TITAN), base.get(TITAN_COMPILED)
    ctx.log(f"\n### {name}: fwd+bwd, medians of {ctx.reps} (largest over {ctx.world} ranks)\n")
    ctx.log("| workload | row | ms | TFLOP/s per GPU | x torchtitan eager | x torchtitan compiled |")
    ctx.log("|---|---|---|---|---|---|")
    for label, ms, reason, flops_row in out:
        if ms is None:
            ctx.log(f"| {name} | {label} | not measured: {reason} | - | - | - |")
            continue
        tflops = flops / ms / 1e9 if flops_row else None
        ctx.log(f"| {name} | {label} | {ms:.3f} | {_fmt(tflops, '.0f')} | "
                f"{_fmt(eager / ms if eager and flops_row else None, '.2f', 'x')} | "
                f"{_fmt(compiled / ms if compiled and flops_row else None, '.2f', 'x')} |")
    ctx.log(f"\n#### {name}: communication hidden = 1 - (t_ep - t_stub) / t_comm_alone\n")
    ctx.log("| workload | row | t_ep ms | t_stub ms | t_comm_alone ms | fraction hidden |")
    ctx.log("|---|---|---|---|---|---|")
    for label, ms, t_stub, t_comm, frac in hidden_rows:
        ctx.log(f"| {name} | {label} | {ms:.3f} | {_fmt(t_stub, '.3f')} | {_fmt(t_comm, '.3f')} | "
                f"{_fmt(frac, '.2f')} |")


def bench(args) -> int:
    if args.dry_run:
        dist.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            print("bench_ep_multi.py needs CUDA GPUs (or --dry-run for the CPU)", file=sys.stderr)
            return 1
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    ctx = Ctx(args)
    try:
        ctx.log(f"bench_ep_multi: W = {ctx.world} ({'gloo, CPU dry run' if ctx.cpu else 'nccl'}), "
                f"multicast off: {NVLINK_MULTICAST_OFF}")
        local_compiled = None if args.no_compile else _compiled_local(ctx)
        verdicts = check_rows(ctx, local_compiled, args.seed)
        for label, reason in verdicts.items():
            if reason:
                ctx.log(f"not measured: {label}: {reason}")
        for name, tokens, hidden, inter, experts, top_k in _dims(args, ctx.world):
            out, hidden_rows = run_workload(ctx, name, tokens, hidden, inter, experts, top_k, args.seed, verdicts,
                                            local_compiled)
            print_tables(ctx, name, 3 * 6.0 * tokens * top_k * hidden * inter, out, hidden_rows)
            if not ctx.cpu:
                torch.cuda.empty_cache()
        for note in dict.fromkeys(ctx.notes):
            ctx.log(f"note: {note}")
    finally:
        dist.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    parser.add_argument("--workloads", nargs="*", choices=["Qwen3-30B-A3B", "Qwen3-235B-A22B"], default=None)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd torchtitan row")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, gloo on CPU (torchrun --nproc-per-node 2)")
    args = parser.parse_args()
    return bench(args)


if __name__ == "__main__":
    code = main()
    # Everything is printed and the process group destroyed: leave without the interpreter's teardown, in which
    # gloo's threads at times abort the process ("terminate called without an active exception") after the
    # run has finished, which torchrun would report as this rank's failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
