"""Expert parallelism over real ranks: one process per GPU, an NCCL process group of W = 2, 4 or 8
GPUs of one node, both transports (the all-to-all over ``EpBuffer`` and our symmetric-memory
exchange over ``SymmetricEpBuffer``, the latter also with ``DGE_EP_OVERLAP=1`` in the workers'
environment).

What every rank checks (inputs from one fresh seed, printed in every failure; the fp64 reference of
the whole layer over all ranks' tokens, built by tests/test_ep_all_to_all.py's helpers):

- ``a2a_vs_reference`` / ``symmetric_vs_reference``: y, dx, d topk_weights and the local experts'
  dW1, dW2 of every rank within 1e-2 (relative, bf16) of the reference, finite, NaN-poisoned
  allocator before each run; routings uniform, skewed (rank 1's experts 50x as likely), unused slots
  (-1); ragged token counts with rank 1 at 0 tokens. In the overlap group the plan is asserted to
  take the overlapped dispatch (so the overlapped path is what runs).
- ``symmetric_equals_a2a``: the symmetric transport's five outputs ``torch.equal`` to the
  all-to-all's on the same inputs. That equality is what README ("Expert parallelism over NVLink")
  and comm/symmetric.py promise: the same received layout (block s = rank s's tokens at row t) and
  rank-order sums in fp32 rounded once, "so the same bits"; DGE_EP_OVERLAP=1 promises the same bits
  as without. A second symmetric run repeats bit for bit.
- ``fp8_symmetric_equals_a2a``: ``recipe="fp8"`` (x's rows travel as e4m3 + 1x128 scales on both
  transports, through the same quantize / dequantize functions): the transports ``torch.equal``, and
  each output within the recipe's error (1.1x / 1.5x the single-process fp8 emulation's error
  against fp64, + 1e-3).
- ``symmetric_cuda_graph``: a CUDA-graph-captured fwd+bwd on the symmetric transport (warmed up
  eagerly, captured, replayed twice with fresh inputs and routings copied into the captured
  tensors): every output ``torch.equal`` to an eager step on the same inputs.

Robustness: the ranks run in spawned processes, each writing its verdicts to a file after every
scenario (as tests/test_ep_all_to_all.py's run_scenario does); the ranks agree after each scenario
whether all passed and stop together at the first failure; the whole group has a deadline
(``GROUP_DEADLINE_S``) after which it is killed and the test fails with what the files hold; and
``DGE_EP_TIMEOUT_S=30`` in the workers makes a hung symmetric wait a trap with a message (a warm-up
step, which also JIT-compiles every kernel used, runs under a longer wait bound first).

NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` are set in the workers' environment explicitly (the symmetric buffer's
``torch.distributed._symmetric_memory`` allocation would otherwise map a multicast object where the
driver offers one; our exchange never uses it).

Run on a machine with W GPUs (skipped with a reason where there are fewer):

    python3 -m pytest -q tests/test_gpu_ep_multi.py
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deep_gemm_ext as dge
from deep_gemm_ext import _env
from deep_gemm_ext.testing import NVLINK_MULTICAST_OFF, environ, rel_err

from conftest import requires_hopper
import test_ep_all_to_all as a2a
from test_ep_all_to_all import global_inputs, reference_grads

H, I, K = 256, 128, 4
CAP = 320                                    # max_tokens_per_rank of every buffer
COUNTS = [300, 0, 64, 171, 97, 250, 5, 133]  # tokens by rank: ragged, rank 1 has none
ROUTINGS = ("uniform", "skewed", "unused_slots")
NAMES = ("y", "dx", "d_topk_weights", "d_l1", "d_l2")
WORLDS = (2, 4, 8)
#: Seconds the whole process group may take (start-up, JIT compiles on a cold cache, every scenario).
GROUP_DEADLINE_S = 540
#: The process group's timeout: a collective one rank never joins fails after this.
PG_TIMEOUT = timedelta(seconds=180)
#: The workers' symmetric-exchange wait bound, and the longer one of the warm-up step (peers may
#: still be compiling a kernel the first time).
EP_TIMEOUT_S, WARMUP_EP_TIMEOUT_S = "30", "300"

SCENARIOS = ("warm_up", "a2a_vs_reference", "symmetric_vs_reference", "symmetric_equals_a2a",
             "fp8_symmetric_equals_a2a", "symmetric_cuda_graph")


def _e_loc(world: int) -> int:
    return {2: 3, 4: 2, 8: 2}[world]


def _counts(world: int) -> list[int]:
    return COUNTS[:world]


# ------------------------------------------------------------------------------------------------
# Per process state: buffers made once per process (making a symmetric one is a collective), and
# each (transport, case)'s outputs, so the comparisons reuse the runs checked against the reference.

_BUFFERS: dict = {}
_OUTPUTS: dict = {}


def _buffer(transport: str):
    if transport not in _BUFFERS:
        cls = dge.EpBuffer if transport == "all_to_all" else dge.SymmetricEpBuffer
        _BUFFERS[transport] = cls(dist.group.WORLD, CAP, H, K, torch.bfloat16)
    return _BUFFERS[transport]


def _inputs(seed, world, routing, device):
    return global_inputs(seed, world, _counts(world), routing, torch.bfloat16, device, num_local=_e_loc(world),
                         hidden=H, inter=I)


def _layer_step(rank, world, inputs, buffer, recipe="bf16"):
    xs, idxs, ws, l1, l2, dys = inputs
    e_loc = _e_loc(world)
    mine = slice(rank * e_loc, (rank + 1) * e_loc)
    leaves = [t.clone().requires_grad_(True) for t in (xs[rank], ws[rank], l1[mine], l2[mine])]
    y = dge.mega_moe_train(leaves[0], idxs[rank], *leaves[1:], group=dist.group.WORLD, ep_buffer=buffer,
                           recipe=recipe)
    grads = torch.autograd.grad(y, leaves, dys[rank])
    return [y.detach(), *grads]


def _outputs(rank, world, device, seed, transport, case, recipe="bf16", again=False):
    """The layer's five outputs on this rank for ROUTINGS[case] (or the fp8 case), poisoned allocator."""
    key = (transport, case, recipe, again)
    if key not in _OUTPUTS:
        from conftest import poison_cached_memory

        routing = ROUTINGS[case] if recipe == "bf16" else "unused_slots"
        inputs = _inputs(seed + case, world, routing, device)
        poison_cached_memory(reserve_bytes=1 << 30)
        _OUTPUTS[key] = _layer_step(rank, world, inputs, _buffer(transport), recipe)
        torch.cuda.synchronize()
    return _OUTPUTS[key]


def _check_against_reference(rank, world, device, seed, transport):
    e_loc = _e_loc(world)
    mine = slice(rank * e_loc, (rank + 1) * e_loc)
    for case, routing in enumerate(ROUTINGS):
        inputs = _inputs(seed + case, world, routing, device)
        if transport == "symmetric" and _env.ep_overlap():
            xs, idxs, _, l1, _, _ = inputs
            spec = dge.plan.resolve_exchange(xs[rank], idxs[rank], l1[mine], dist.group.WORLD, _buffer(transport))
            plan = dge.plan.resolve(xs[rank], l1[mine], exchange=spec)
            assert plan.ep_overlap, f"DGE_EP_OVERLAP=1 but the plan does not overlap the dispatch: {plan}"
        got = _outputs(rank, world, device, seed, transport, case)
        ref = reference_grads(*inputs, None)
        refs = (ref[0][rank], ref[1][rank], ref[2][rank], ref[3][mine], ref[4][mine])
        for name, out, want in zip(NAMES, got, refs):
            where = f"seed {seed} W={world} {transport} {routing} rank {rank}: {name}"
            assert out.shape == want.shape, f"{where} shape {tuple(out.shape)} != {tuple(want.shape)}"
            assert torch.isfinite(out).all(), f"{where} has non-finite values"
            if want.numel():
                err = rel_err(out, want)
                assert err <= 1e-2, f"{where} rel err {err:.3g} against fp64"


# ------------------------------------------------------------------------------------------------
# Scenarios (run on every rank, in SCENARIOS' order)


def warm_up(rank, world, device, seed):
    """One step of every transport and recipe under a long wait bound: the JIT compiles (the ranks
    may reach a kernel's first launch seconds apart on a cold cache) and the agreement checks."""
    os.environ["DGE_EP_TIMEOUT_S"] = WARMUP_EP_TIMEOUT_S
    try:
        inputs = _inputs(seed + 100, world, "uniform", device)
        for transport in ("all_to_all", "symmetric"):
            for recipe in ("bf16", "fp8"):
                _layer_step(rank, world, inputs, _buffer(transport), recipe)
        torch.cuda.synchronize()
    finally:
        os.environ["DGE_EP_TIMEOUT_S"] = EP_TIMEOUT_S
    dist.barrier()


def a2a_vs_reference(rank, world, device, seed):
    _check_against_reference(rank, world, device, seed, "all_to_all")


def symmetric_vs_reference(rank, world, device, seed):
    _check_against_reference(rank, world, device, seed, "symmetric")


def symmetric_equals_a2a(rank, world, device, seed):
    for case, routing in enumerate(ROUTINGS):
        a = _outputs(rank, world, device, seed, "all_to_all", case)
        s = _outputs(rank, world, device, seed, "symmetric", case)
        s2 = _outputs(rank, world, device, seed, "symmetric", case, again=True)
        for name, x, y, z in zip(NAMES, a, s, s2):
            where = f"seed {seed} W={world} {routing} rank {rank}: {name}"
            assert torch.equal(x, y), (f"{where}: symmetric differs from all-to-all in "
                                       f"{int((x != y).sum())} of {x.numel()} elements")
            assert torch.equal(y, z), f"{where}: a second symmetric run differs"


def fp8_symmetric_equals_a2a(rank, world, device, seed):
    from deep_gemm_ext.recipes.fp8 import fp8_reference_layer

    case = len(ROUTINGS)
    a = _outputs(rank, world, device, seed, "all_to_all", case, "fp8")
    s = _outputs(rank, world, device, seed, "symmetric", case, "fp8")
    for name, x, y in zip(NAMES, a, s):
        assert torch.equal(x, y), f"seed {seed} W={world} fp8 rank {rank}: {name} symmetric differs from all-to-all"
    inputs = _inputs(seed + case, world, "unused_slots", device)
    xs, idxs, ws, l1, l2, dys = inputs
    counts = _counts(world)
    emulated = fp8_reference_layer(torch.cat(xs), torch.cat(idxs), torch.cat(ws), l1, l2, None, torch.cat(dys))
    exact = reference_grads(*inputs, None)
    e_loc = _e_loc(world)
    mine = slice(rank * e_loc, (rank + 1) * e_loc)
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    for i, name in enumerate(NAMES):
        ref = exact[i][rank] if i < 3 else exact[i][mine]
        if not ref.numel():
            continue
        emu = emulated[i][lo:hi] if i < 3 else emulated[i][mine]
        limit = (1.1 if i < 3 else 1.5) * rel_err(emu, ref) + 1e-3
        err = rel_err(s[i], ref)
        assert torch.isfinite(s[i]).all() and err <= limit, (
            f"seed {seed} W={world} fp8 rank {rank}: {name} error {err:.4g} against fp64, limit {limit:.4g}")


def symmetric_cuda_graph(rank, world, device, seed):
    buffer = _buffer("symmetric")
    e_loc = _e_loc(world)
    mine = slice(rank * e_loc, (rank + 1) * e_loc)
    xs, idxs, ws, l1, l2, dys = _inputs(seed + 200, world, "skewed", device)
    static = [t.clone().requires_grad_(t.is_floating_point())
              for t in (xs[rank], idxs[rank], ws[rank], l1[mine], l2[mine])]
    sx, sidx, sw, sl1, sl2 = static
    sdy = dys[rank].clone()

    def step():
        y = dge.mega_moe_train(sx, sidx, sw, sl1, sl2, group=dist.group.WORLD, ep_buffer=buffer)
        return (y, *torch.autograd.grad(y, (sx, sw, sl1, sl2), sdy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: allocator pools, kernels loaded
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for k, routing in enumerate(("uniform", "unused_slots")):
        xs, idxs, ws, l1, l2, dys = _inputs(seed + 201 + k, world, routing, device)
        with torch.no_grad():
            for dst, src in zip((*static, sdy), (xs[rank], idxs[rank], ws[rank], l1[mine], l2[mine], dys[rank])):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in outs]
        want = _layer_step(rank, world, (xs, idxs, ws, l1, l2, dys), buffer)
        torch.cuda.synchronize()
        for name, a, b in zip(NAMES, got, want):
            where = f"seed {seed} W={world} replay {k + 1} ({routing}) rank {rank}: {name}"
            assert torch.isfinite(a).all(), f"{where} not finite"
            assert torch.equal(a, b), f"{where}: replayed differs from eager"


# ------------------------------------------------------------------------------------------------
# Process harness


def _write_verdicts(out_dir, rank, verdicts):
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(verdicts, f)
    os.replace(path + ".tmp", path)


def _worker(rank, world, store_path, out_dir, seed):
    # The shared input builders read top_k and E_loc from their module (this process's copy only).
    a2a.K, a2a.E_LOC = K, _e_loc(world)
    torch.set_num_threads(1)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=PG_TIMEOUT, device_id=device)
    verdicts = {}
    try:
        for name in SCENARIOS:
            failed = False
            try:
                globals()[name](rank, world, device, seed)
                verdicts[name] = None
            except BaseException:  # noqa: BLE001 -- reported by the test of this scenario
                verdicts[name] = traceback.format_exc()
                from deep_gemm_ext.comm.symmetric import overlap_timeout_report

                report = overlap_timeout_report()
                if report:
                    verdicts[name] += "\n" + report
                failed = True
            _write_verdicts(out_dir, rank, verdicts)
            # Every rank stops at the first failure of any rank (later collectives would not meet).
            flag = torch.tensor([int(failed)], device=device)
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except BaseException:  # noqa: BLE001
                break
            if int(flag):
                break
    finally:
        _write_verdicts(out_dir, rank, verdicts)
        _BUFFERS.clear()
        _OUTPUTS.clear()
        dist.destroy_process_group()


def worker_env(overlap: bool) -> dict:
    """The workers' environment: multicast off (explicitly), a short symmetric wait bound, the overlap flag."""
    return {**NVLINK_MULTICAST_OFF, "DGE_EP_TIMEOUT_S": EP_TIMEOUT_S, "DGE_EP_OVERLAP": "1" if overlap else "0"}


def run_group(world: int, env: dict, deadline_s: float = GROUP_DEADLINE_S) -> tuple[int, list[dict], str]:
    """Spawn ``world`` ranks running SCENARIOS; returns (seed, each rank's verdicts, what went wrong
    with the processes themselves: a deadline, a crash; '' when they ended normally)."""
    seed = random.randrange(2**31)
    with tempfile.TemporaryDirectory() as tmp:
        with environ(env):
            ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, seed), nprocs=world,
                                     join=False, start_method="spawn")
        start, problem = time.monotonic(), ""
        while True:
            try:
                if ctx.join(timeout=5):
                    break
            except Exception as exc:  # noqa: BLE001 -- a rank died (signal, exit code); the others are killed
                problem = f"a rank's process failed: {type(exc).__name__}: {exc}"
                break
            if time.monotonic() - start > deadline_s:
                problem = f"the group ran past its deadline of {deadline_s:.0f} s and was killed"
                break
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
        verdicts = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            verdicts.append(json.load(open(path)) if os.path.exists(path) else {})
    return seed, verdicts, problem


_GROUPS: dict = {}


def check_scenario(world: int, overlap: bool, scenario: str) -> None:
    key = (world, overlap)
    if key not in _GROUPS:
        _GROUPS[key] = run_group(world, worker_env(overlap))
    seed, verdicts, problem = _GROUPS[key]
    label = f"{scenario} on {world} GPUs ({'DGE_EP_OVERLAP=1' if overlap else 'plain'}, seed {seed})"
    failures = []
    for r, v in enumerate(verdicts):
        if scenario in v:
            if v[scenario] is not None:
                failures.append(f"rank {r}:\n{v[scenario]}")
        else:
            done = [name for name in SCENARIOS if name in v]
            failed = [f"{name}:\n{v[name]}" for name in done if v[name] is not None]
            failures.append(f"rank {r}: no verdict (scenarios with one: {done or 'none'})"
                            + ("; it failed earlier in " + "\n".join(failed) if failed else ""))
    if failures:
        pytest.fail(f"{label}: {problem}\n" + "\n".join(failures), pytrace=False)


# ------------------------------------------------------------------------------------------------
# Tests


def _gpus(world):
    have = torch.cuda.device_count()
    return [requires_hopper,
            pytest.mark.skipif(have < world, reason=f"needs {world} CUDA GPUs, one process each (this machine has "
                                                    f"{have})")]


WORLD_PARAMS = [pytest.param(w, marks=_gpus(w), id=f"W{w}") for w in WORLDS]
OVERLAP_PARAMS = [pytest.param(False, id="plain"), pytest.param(True, id="overlap")]


#: The scenarios each group of worker processes runs, by test id: both transports against fp64, the
#: symmetric one bit for bit the all-to-all (bf16, fp8), a CUDA-graph-captured symmetric step.
CHECKS = {
    "all_to_all_matches_fp64_reference": "a2a_vs_reference",
    "symmetric_matches_fp64_reference": "symmetric_vs_reference",
    "symmetric_bit_for_bit_the_all_to_all": "symmetric_equals_a2a",
    "fp8_symmetric_bit_for_bit_the_all_to_all": "fp8_symmetric_equals_a2a",
    "symmetric_cuda_graph_step_equals_eager": "symmetric_cuda_graph",
}


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("overlap", OVERLAP_PARAMS)
@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_real_ranks(world, overlap, check):
    check_scenario(world, overlap, CHECKS[check])


def test_worker_environment_keeps_multicast_off():
    """CPU-checkable part of the harness: the workers' environment turns NVLink multicast off in
    NCCL, torch symmetric memory and NVSHMEM, bounds symmetric waits, and sets the overlap flag."""
    for overlap in (False, True):
        env = worker_env(overlap)
        assert env["NCCL_NVLS_ENABLE"] == "0"
        assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert env["NVSHMEM_DISABLE_NVLS"] == "1"
        assert float(env["DGE_EP_TIMEOUT_S"]) <= 60
        assert env["DGE_EP_OVERLAP"] == ("1" if overlap else "0")
