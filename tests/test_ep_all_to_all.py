"""Expert parallelism over the torch.distributed all-to-all exchange, in multi-process gloo groups
of 2, 3 and 4 ranks on 127.0.0.1 (nccl on GPUs where there is one per rank).

The layer on every rank is checked against an fp64 reference of the whole layer: every rank
builds all ranks' inputs from one fresh seed, the reference runs on the concatenated tokens and
weights, and each rank compares its own y, dx, d topk_weights and its local experts' weight
gradients. The four exchange pieces are checked on their own: the rows they move, adjointness,
round trips, determinism, and that rows no token was sent to are never read.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deep_gemm_ext as dge
from deep_gemm_ext import comm
from deep_gemm_ext.comm.all_to_all import (AllToAllExchange, EpBuffer, default_ep_buffer, ep_memory_bytes,
                                           exchange_from_name, resolve_group)
from deep_gemm_ext.reference import reference_forward, upcast
from deep_gemm_ext.testing import make_routing, rel_err

H, I, E_LOC, K = 32, 16, 2, 3
TIMEOUT = timedelta(seconds=60)  # a hang in a collective fails the test instead of stalling CI



# ------------------------------------------------------------------------------------------------
# Process harness: one group of processes per (world, backend) runs every scenario planned for
# it (process start-up dominates the cost); each test then reads its scenario's verdict.

SCENARIOS = {
    2: ["exchange_pieces", "layer_matches_reference", "default_buffer_and_mesh", "api_bad_inputs",
        "bad_inputs", "module_and_compile", "fp8_recipe", "fp8_dispatch", "titan_baseline"],
    3: ["exchange_pieces", "layer_matches_reference", "fp8_dispatch"],
    4: ["layer_matches_reference", "default_buffer_and_mesh"],
}
#: What the nccl variants run (on GPUs the layer computes in bf16 only).
GPU_SCENARIOS = ("layer_matches_reference", "gpu_kernels_and_cuda_graph")


def _worker(rank, world, store_path, backend, scenarios, seed, out_dir):
    torch.set_num_threads(1)
    options = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=TIMEOUT, **options)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    verdicts = {}
    try:
        for name in scenarios:
            try:
                globals()[name](rank, world, device, seed)
                verdicts[name] = None
            except BaseException:  # noqa: BLE001 -- reported by the test of this scenario
                verdicts[name] = traceback.format_exc()
                break  # the ranks may now disagree on the collectives to come
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(verdicts, f)
        dist.destroy_process_group()


_VERDICTS: dict[tuple, list[dict]] = {}


def run_scenario(world: int, scenario: str, backend: str = "gloo") -> None:
    """Fail with every failing rank's traceback unless ``scenario`` passed on all ``world`` ranks."""
    key = (world, backend)
    if key not in _VERDICTS:
        seed = random.randrange(2**31)
        scenarios = SCENARIOS[world] if backend == "gloo" else GPU_SCENARIOS
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), backend, scenarios, seed, tmp),
                         nprocs=world)
            except mp.ProcessExitedException as exc:
                # A rank killed by a signal after it wrote its verdicts died in the process group's
                # teardown (gloo's threads at exit: "terminate called without an active exception"),
                # with every scenario already decided; without a verdict file it died in a scenario.
                missing = [r for r in range(world) if not os.path.exists(os.path.join(tmp, f"rank{r}.json"))]
                if missing or exc.signal_name is None:
                    raise
                warnings.warn(f"{world} ranks ({backend}): {exc} after every rank wrote its verdicts "
                              "(a crash in the process group's teardown)")
            _VERDICTS[key] = (seed, [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)])
    seed, verdicts = _VERDICTS[key]
    not_run = "not run: an earlier scenario failed in this group of processes"
    failures = [f"rank {r}:\n{v.get(scenario, not_run)}" for r, v in enumerate(verdicts)
                if v.get(scenario, not_run) is not None]
    if failures:
        pytest.fail(f"{scenario} on {world} ranks ({backend}, seed {seed}):\n" + "\n".join(failures), pytrace=False)


# ------------------------------------------------------------------------------------------------
# Inputs every rank can rebuild: all ranks' tokens, routings and expert shards from one seed.


def _skewed_routing(num_tokens, num_experts, hot_rank, g):
    """Top-k without repeats where ``hot_rank``'s experts are 50x as likely as any other."""
    probs = torch.ones(num_tokens, num_experts, dtype=torch.float64)
    probs[:, hot_rank * E_LOC:(hot_rank + 1) * E_LOC] = 50.0
    if num_tokens == 0:
        return torch.empty(0, K, dtype=torch.int64)
    return torch.multinomial(probs, K, replacement=False, generator=g)


def global_inputs(seed, world, counts, routing, dtype, device, num_local=E_LOC, hidden=H, inter=I):
    g = torch.Generator().manual_seed(seed)
    num_experts = world * num_local
    xs, idxs, ws, dys = [], [], [], []
    for num_tokens in counts:
        xs.append(torch.randn(num_tokens, hidden, generator=g))
        if routing == "skewed":
            idxs.append(_skewed_routing(num_tokens, num_experts, 1 % world, g))
        else:
            idxs.append(make_routing(num_tokens, num_experts, K, routing, generator=g))
        w = torch.rand(num_tokens, K, generator=g) + 0.05
        ws.append(w / w.sum(-1, keepdim=True))
        dys.append(torch.randn(num_tokens, hidden, generator=g))
    l1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    l2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    cast = dict(device=device, dtype=dtype)
    w_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return ([x.to(**cast) for x in xs], [i.to(device) for i in idxs], [w.to(device, w_dtype) for w in ws],
            l1.to(**cast), l2.to(**cast), [d.to(**cast) for d in dys])


def reference_grads(xs, idxs, ws, l1, l2, dys, clamp):
    """fp64 y and gradients of sum_r <y_r, dy_r> for the whole layer, split back per rank."""
    x, w, l1_, l2_, dy = upcast(torch.cat(xs), torch.cat(ws), l1, l2, torch.cat(dys))
    for t in (x, w, l1_, l2_):
        t.requires_grad_(True)
    y = reference_forward(x, torch.cat(idxs), w, l1_, l2_, clamp)
    y.backward(dy)
    counts = [len(t) for t in xs]
    return (y.detach().split(counts), x.grad.split(counts), w.grad.split(counts), l1_.grad, l2_.grad)


# ------------------------------------------------------------------------------------------------
# The layer under test: the public API over the group.


def ep_layer(x, topk_idx, topk_weights, l1, l2, group, buffer=None, clamp=None):
    return dge.mega_moe_train(x, topk_idx, topk_weights, l1, l2, group=group, ep_buffer=buffer,
                              activation_clamp=clamp)


# ------------------------------------------------------------------------------------------------
# Scenarios (run on every rank)


def _run_layer(rank, world, device, inputs, buffer, clamp, group=None):
    group = dist.group.WORLD if group is None else group
    xs, idxs, ws, l1, l2, dys = inputs
    x, w = xs[rank].clone().requires_grad_(True), ws[rank].clone().requires_grad_(True)
    mine = slice(rank * E_LOC, (rank + 1) * E_LOC)
    l1_loc = l1[mine].clone().requires_grad_(True)
    l2_loc = l2[mine].clone().requires_grad_(True)
    y = ep_layer(x, idxs[rank], w, l1_loc, l2_loc, group, buffer, clamp)
    y.backward(dys[rank])
    return y.detach(), x.grad, w.grad, l1_loc.grad, l2_loc.grad


LAYER_CASES = [
    # (tokens per rank by rank, routing, dtype, explicit buffer, activation clamp)
    ("uneven", "uniform", torch.float64, False, None),
    ("zero_on_one_rank", "unused_slots", torch.float64, True, None),
    ("uneven", "skewed", torch.float32, True, 0.7),
    ("one_token", "one_expert", torch.float64, False, None),
    ("uneven", "empty_experts", torch.float64, True, None),
    ("uneven", "skewed", torch.bfloat16, False, None),
    ("zero_on_one_rank", "unused_slots", torch.bfloat16, True, 0.7),
]


def _counts(kind, world):
    return {"uneven": [5, 9, 2, 7][:world], "zero_on_one_rank": [6, 0, 4, 3][:world],
            "one_token": [1] * world}[kind]


def layer_matches_reference(rank, world, device, seed):
    for case, (counts, routing, dtype, explicit, clamp) in enumerate(LAYER_CASES):
        if device.type == "cuda" and dtype != torch.bfloat16:
            continue  # the GPU path computes in bf16 only
        counts = _counts(counts, world)
        inputs = global_inputs(seed + case, world, counts, routing, dtype, device)
        buffer = EpBuffer(dist.group.WORLD, max(counts) + 1, H, K, dtype) if explicit else None
        got = _run_layer(rank, world, device, inputs, buffer, clamp)
        ref_y, ref_dx, ref_dw, ref_dl1, ref_dl2 = reference_grads(*inputs, clamp)
        mine = slice(rank * E_LOC, (rank + 1) * E_LOC)
        refs = (ref_y[rank], ref_dx[rank], ref_dw[rank], ref_dl1[mine], ref_dl2[mine])
        # fp64: as the CPU fuzz; a one-token d topk_weights is a sum with cancellation, seen at 9e-12.
        tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
        for name, out, ref in zip(("y", "dx", "d_topk_weights", "d_l1", "d_l2"), got, refs):
            assert out.shape == ref.shape, (case, name, out.shape, ref.shape)
            if ref.numel():
                err = rel_err(out, ref)
                assert err <= tol, f"rank {rank} case {case} ({counts}, {routing}, {dtype}): {name} rel err {err:.3g}"
        # Two runs give the same bits (no atomics, fixed summation order).
        again = _run_layer(rank, world, device, inputs, buffer, clamp)
        for a, b in zip(got, again):
            assert torch.equal(a, b)


def _expected_rows(rank, world, xs, idxs, ws, cap, hidden=H):
    """What dispatch must deliver to ``rank``, built independently with loops."""
    rows = world * cap
    x_r = torch.zeros(rows, hidden, dtype=xs[0].dtype)
    idx_r = torch.full((rows, K), -1, dtype=torch.int32)
    w_r = torch.zeros(rows, K, dtype=ws[0].dtype)
    for src in range(world):
        for t in range(len(xs[src])):
            for k in range(K):
                e = int(idxs[src][t, k])
                if e >= 0 and e // E_LOC == rank:
                    x_r[src * cap + t] = xs[src][t]
                    idx_r[src * cap + t, k] = e - rank * E_LOC
                    w_r[src * cap + t, k] = ws[src][t, k]
    return x_r, idx_r, w_r


def _all_sum(value: torch.Tensor) -> float:
    value = value.detach().double().reshape(1).cpu()
    dist.all_reduce(value)
    return float(value)


def exchange_pieces(rank, world, device, seed):
    counts = [4, 0, 7, 3][:world]
    cap = 8
    xs, idxs, ws, *_ = global_inputs(seed, world, counts, "unused_slots", torch.float64, device)
    exchange = AllToAllExchange(dist.group.WORLD, E_LOC, cap)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    x_r, idx_r, w_r, handle = exchange.dispatch(x, idx, w)
    assert exchange.num_rows == world * cap

    # The rows, ids and weights each rank receives.
    exp_x, exp_idx, exp_w = _expected_rows(rank, world, [t.cpu() for t in xs], [t.cpu() for t in idxs],
                                           [t.cpu() for t in ws], cap)
    assert idx_r.dtype == torch.int32
    assert torch.equal(x_r.cpu(), exp_x) and torch.equal(idx_r.cpu(), exp_idx) and torch.equal(w_r.cpu(), exp_w)
    again = exchange.dispatch(x, idx, w)
    assert all(torch.equal(a, b) for a, b in zip((x_r, idx_r, w_r, *handle), (*again[:3], *again[3])))

    # Round trips: combining the dispatched rows gives x times the number of ranks each token
    # reached; d topk_weights of dispatch_backward(dw_r = w_r) is w itself on every used slot.
    reached = torch.stack([((idx >= 0) & (idx // E_LOC == d)).any(-1) for d in range(world)]).sum(0)
    assert torch.equal(exchange.combine(x_r, handle), x * reached.unsqueeze(-1).to(x.dtype))
    dx, d_topk = exchange.dispatch_backward(x_r, w_r, handle)
    assert torch.equal(d_topk, torch.where(idx >= 0, w, 0))
    assert torch.equal(dx, x * reached.unsqueeze(-1).to(x.dtype))

    # Rows no token was sent to are never read: NaN there changes nothing.
    y_r = torch.randn(world * cap, H, dtype=x.dtype, device=device)
    unsent = (idx_r < 0).all(-1)
    poisoned = y_r.masked_fill(unsent.unsqueeze(-1), float("nan"))
    assert torch.equal(exchange.combine(poisoned, handle), exchange.combine(y_r, handle))
    dw_r = torch.randn(world * cap, K, dtype=w.dtype, device=device)
    dx_p, dtopk_p = exchange.dispatch_backward(poisoned, dw_r.masked_fill(idx_r < 0, float("nan")), handle)
    dx_c, dtopk_c = exchange.dispatch_backward(y_r, dw_r, handle)
    assert torch.equal(dx_p, dx_c) and torch.equal(dtopk_p, dtopk_c)
    assert not dtopk_c.isnan().any()

    # Adjointness over the whole group: <combine(a), b> = <a, combine_backward(b)>, and the same
    # for dispatch and dispatch_backward (rows and slot weights).
    b = torch.randn_like(x)
    lhs = _all_sum((exchange.combine(y_r, handle) * b).sum())
    rhs = _all_sum((y_r * exchange.combine_backward(b, handle)).sum())
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)
    a_x = torch.randn_like(x_r)
    a_w = torch.randn_like(w_r)
    dx_a, dw_a = exchange.dispatch_backward(a_x, a_w, handle)
    lhs = _all_sum((x_r * a_x).sum() + (w_r * a_w).sum())
    rhs = _all_sum((x * dx_a).sum() + (w * dw_a).sum())
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)

    # combine_backward puts each source token's dy on the rows its dispatch filled, zero elsewhere.
    dys = [torch.randn(n, H, dtype=x.dtype, generator=torch.Generator().manual_seed(seed + 1 + s)).to(device)
           for s, n in enumerate(counts)]
    exp_dy, _, _ = _expected_rows(rank, world, [t.cpu() for t in dys], [t.cpu() for t in idxs],
                                  [t.cpu() for t in ws], cap)
    assert torch.equal(exchange.combine_backward(dys[rank], handle).cpu(), exp_dy)

    # Partial results are summed in fp32 and rounded once: 1 + 2^-8 + 2^-8 is 1 + 2^-7 in bf16,
    # where adding in bf16 would round back to 1 at each step.
    if world >= 3:
        spread = torch.tensor([[0, E_LOC, 2 * E_LOC]], device=device)  # token 0 on ranks 0, 1, 2
        _, _, _, handle_b = exchange.dispatch(torch.ones(1, H, dtype=torch.bfloat16, device=device), spread,
                                              torch.ones(1, K, device=device))
        partial = 1.0 if rank == 0 else 2.0 ** -8
        y_b = torch.full((world * cap, H), partial, dtype=torch.bfloat16, device=device)
        y = exchange.combine(y_b, handle_b)
        assert torch.equal(y, torch.full_like(y, 1 + 2.0 ** -7))


def default_buffer_and_mesh(rank, world, device, seed):
    """The default buffer's capacity is the group's largest T, grows and never shrinks; a 1-D
    DeviceMesh stands for its group and a 2-D one is refused."""
    counts = [3, 5, 0, 2][:world]
    buf = default_ep_buffer(dist.group.WORLD, counts[rank], H, K, torch.float32, device)
    assert buf.max_tokens_per_rank == max(counts)
    grown = default_ep_buffer(dist.group.WORLD, counts[rank] * 2, H, K, torch.float32, device)
    assert grown.max_tokens_per_rank == 2 * max(counts)
    kept = default_ep_buffer(dist.group.WORLD, 1, H, K, torch.float32, device)
    assert kept is grown
    assert buf.memory_bytes() == ep_memory_bytes(world, max(counts), H, K, torch.float32)
    # The plan names the exchange by a string; the same string gives the same (cached) exchange.
    exchange = comm.exchange(buf.exchange_spec(E_LOC))
    assert exchange is exchange_from_name(buf.group_name, E_LOC, max(counts))
    assert (exchange.num_local_experts, exchange.capacity, exchange.num_rows) == (E_LOC, max(counts), world * max(counts))
    assert ep_memory_bytes(world, 10, H, K, torch.bfloat16) == 2 * world * 10 * (H * 2 + K * 8)
    # fp8 rows: H e4m3 bytes and one fp32 scale per 128 sent and received, plus the dequantized bf16 rows.
    assert ep_memory_bytes(world, 10, 200, K, torch.bfloat16, fp8_rows=True) == world * 10 * (
        2 * (200 + 4 * 2 + K * 8) + 200 * 2)
    fp8_exchange = comm.exchange(buf.exchange_spec(E_LOC, fp8_rows=True))
    assert fp8_exchange.fp8_rows and not exchange.fp8_rows and fp8_exchange is not exchange
    with pytest.raises(ValueError, match=r"exchange 'all_to_all:g:2:8:int8': expected 'local' or "
                                         r"'all_to_all:<group>:<E_loc>:<capacity>:<x\|fp8>'"):
        comm.exchange("all_to_all:g:2:8:int8")

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    assert resolve_group(mesh) is mesh.get_group()
    inputs = global_inputs(seed, world, counts, "uniform", torch.float64, device)
    via_pg = _run_layer(rank, world, device, inputs, EpBuffer(dist.group.WORLD, 5, H, K, torch.float64), None)
    # The mesh's group (its own process group on some torch versions, WORLD on others) as the group.
    via_mesh = _run_layer(rank, world, device, inputs, EpBuffer(mesh, 5, H, K, torch.float64), None, group=mesh)
    for a, b in zip(via_pg, via_mesh):
        assert torch.equal(a, b)
    if world == 4:
        mesh2d = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "ep"))
        with pytest.raises(ValueError, match=r"group is a 2-D DeviceMesh \(shape \(2, 2\)\); expected a 1-D mesh"):
            EpBuffer(mesh2d, 4, H, K)
        assert resolve_group(mesh2d["ep"]).size() == 2


def bad_inputs(rank, world, device, seed):
    xs, idxs, ws, *_ = global_inputs(seed, world, [6] * world, "uniform", torch.float32, device)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    # Local errors are raised before any collective; here every rank raises them.
    with pytest.raises(ValueError, match=rf"rank {rank} passes 6 tokens but the exchange's capacity is "
                                         rf"max_tokens_per_rank=4"):
        AllToAllExchange(dist.group.WORLD, E_LOC, 4).dispatch(x, idx, w)
    # Every rank must own the same number of experts: all ranks learn who differs (capacities no
    # earlier call used: the check runs at the first call of a shape class).
    lopsided = E_LOC + (rank == 1)
    per_rank = ", ".join(f"rank {r}: {E_LOC + (r == 1)}" for r in range(world))
    with pytest.raises(ValueError, match=rf"num_local_experts differs across the expert-parallel group "
                                         rf"\({per_rank}\); every rank must pass the same value"):
        AllToAllExchange(dist.group.WORLD, lopsided, 31).dispatch(x, idx.clamp(max=world * lopsided - 1), w)
    with pytest.raises(ValueError, match=r"max_tokens_per_rank differs across the expert-parallel group"):
        AllToAllExchange(dist.group.WORLD, E_LOC, 40 + rank).dispatch(x, idx, w)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                                        "got object"):
        AllToAllExchange(object(), E_LOC, 8)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got None"):
        EpBuffer(None, 8, H, K)
    with pytest.raises(ValueError, match="max_tokens_per_rank=0 must be at least 1"):
        EpBuffer(dist.group.WORLD, 0, H, K)
    with pytest.raises(TypeError, match="max_tokens_per_rank must be an int, got float"):
        EpBuffer(dist.group.WORLD, 8.0, H, K)
    # After all that the group still works.
    x_r, *_ = AllToAllExchange(dist.group.WORLD, E_LOC, 8).dispatch(x, idx, w)
    assert x_r.shape == (world * 8, H)


def api_bad_inputs(rank, world, device, seed):
    """What mega_moe_train says about expert-parallel arguments. Each bad input is bad on every rank
    (a rank that raised alone would leave the others waiting in a collective until the timeout)."""
    xs, idxs, ws, l1, l2, _ = global_inputs(seed, world, [6] * world, "uniform", torch.float32, device)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    l1, l2 = l1[rank * E_LOC:(rank + 1) * E_LOC], l2[rank * E_LOC:(rank + 1) * E_LOC]
    group = dist.group.WORLD
    num_experts = world * E_LOC

    def call(**kw):
        args = dict(x=x, topk_idx=idx, topk_weights=w, l1_weights=l1, l2_weights=l2)
        args.update({k: v for k, v in kw.items() if k in args})
        options = {k: v for k, v in kw.items() if k not in args}
        return dge.mega_moe_train(*args.values(), **{"group": group, **options})

    bad = idx.clone()
    bad[2, 1] = num_experts
    with pytest.raises(ValueError, match=rf"topk_idx\[2, 1\] = {num_experts} is out of range; expected expert ids "
                                         rf"in \[-1, {num_experts}\)"):
        call(topk_idx=bad)
    with pytest.raises(ValueError, match=rf"rank {rank} passes 6 tokens but the exchange's capacity is "
                                         rf"max_tokens_per_rank=4"):
        call(ep_buffer=EpBuffer(group, 4, H, K, torch.float32))
    with pytest.raises(TypeError, match="ep_buffer must be a deep_gemm_ext.EpBuffer, a deep_gemm_ext.SymmetricEpBuffer or None, got int"):
        call(ep_buffer=8)
    with pytest.raises(ValueError, match="ep_buffer is given but group is None; pass the group the buffer was made for"):
        call(group=None, ep_buffer=EpBuffer(group, 8, H, K, torch.float32))
    other = dist.new_group(list(range(world)))
    with pytest.raises(ValueError, match=rf"ep_buffer was made for group '{other.group_name}' but group is "
                                         rf"'{group.group_name}'; expected the same group"):
        call(ep_buffer=EpBuffer(other, 8, H, K, torch.float32))
    with pytest.raises(ValueError, match=rf"ep_buffer has hidden={2 * H} but the inputs have hidden={H}"):
        call(ep_buffer=EpBuffer(group, 8, 2 * H, K, torch.float32))
    with pytest.raises(ValueError, match=r"ep_buffer has dtype=torch.bfloat16 but the inputs have dtype=torch.float32"):
        call(ep_buffer=EpBuffer(group, 8, H, K, torch.bfloat16))
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                                        "got object"):
        call(group=object())
    # Ranks holding different numbers of experts: every rank is told which differ, at the first call
    # of a shape class (here a capacity no call used before).
    extra = int(rank == 1)
    l1_x = torch.cat([l1, l1[:extra]]) if extra else l1
    l2_x = torch.cat([l2, l2[:extra]]) if extra else l2
    per_rank = ", ".join(f"rank {r}: {E_LOC + (r == 1)}" for r in range(world))
    with pytest.raises(ValueError, match=rf"num_local_experts differs across the expert-parallel group \({per_rank}\)"):
        call(l1_weights=l1_x, l2_weights=l2_x, ep_buffer=EpBuffer(group, 13, H, K, torch.float32))
    # The group still works after all of that.
    assert call().shape == x.shape
    # Without an ep_buffer the ranks compare on every call, in the collective that finds the capacity:
    # the same mismatch after calls that agreed raises on every rank (no hang, no dropped tokens).
    with pytest.raises(ValueError, match=rf"num_local_experts differs across the expert-parallel group \({per_rank}\)"):
        call(l1_weights=l1_x, l2_weights=l2_x)
    # Bad ids on one rank, checked on the host there: every rank raises, naming it.
    bad_one = bad if rank == 1 else idx
    with pytest.raises(ValueError, match=(rf"topk_idx\[2, 1\] = {num_experts} is out of range" if rank == 1 else
                                          r"topk_idx of rank\(s\) \[1\] holds expert ids outside")):
        call(topk_idx=bad_one)
    # topk_weights' dtype sets the width of the ids-and-weights exchange: ranks passing different ones
    # are told so, with or without a buffer (the exchange itself would abort the process).
    x64, l1_64, l2_64 = x.double(), l1.double(), l2.double()
    w_mixed = w.double() if rank == 0 else w
    per_rank = ", ".join(f"rank {r}: {torch.float64 if r == 0 else torch.float32}" for r in range(world))
    for buffer in (None, EpBuffer(group, 17, H, K, torch.float64)):
        with pytest.raises(ValueError, match=rf"topk_weights dtype differs across the expert-parallel group "
                                             rf"\({per_rank}\)"):
            call(x=x64, topk_weights=w_mixed, l1_weights=l1_64, l2_weights=l2_64, ep_buffer=buffer)
    assert call().shape == x.shape


def module_and_compile(rank, world, device, seed):
    """MegaMoE over a 1-D DeviceMesh matches the fp64 reference; torch.compile(fullgraph=True) of
    the layer with an EpBuffer is bit-equal to eager; opcheck passes on both ops."""
    from torch.distributed.device_mesh import init_device_mesh

    counts = [7, 4, 0, 5][:world]
    inputs = global_inputs(seed, world, counts, "unused_slots", torch.float64, device)
    xs, idxs, ws, l1, l2, dys = inputs
    mesh = init_device_mesh(device.type, (world,))
    moe = dge.MegaMoE(world * E_LOC, H, I, K, group=mesh, device=device, dtype=torch.float64)
    assert (moe.num_local_experts, moe.expert_offset) == (E_LOC, rank * E_LOC)
    mine = slice(rank * E_LOC, (rank + 1) * E_LOC)
    with torch.no_grad():
        moe.l1_weights.copy_(l1[mine])
        moe.l2_weights.copy_(l2[mine])
    x = xs[rank].clone().requires_grad_(True)
    y = moe(x, idxs[rank], ws[rank])
    y.backward(dys[rank])
    ref_y, ref_dx, _, ref_dl1, ref_dl2 = reference_grads(*inputs, None)
    for name, out, ref in (("y", y, ref_y[rank]), ("dx", x.grad, ref_dx[rank]),
                           ("d_l1", moe.l1_weights.grad, ref_dl1[mine]), ("d_l2", moe.l2_weights.grad, ref_dl2[mine])):
        assert out.shape == ref.shape
        if ref.numel():
            assert rel_err(out, ref) <= 1e-10, (name, rel_err(out, ref))

    buffer = EpBuffer(mesh, max(counts), H, K, torch.float64)
    group = mesh.get_group()  # the buffer's group (WORLD itself on some torch versions, not on others)

    def layer(x, idx, w, l1_, l2_):
        return dge.mega_moe_train(x, idx, w, l1_, l2_, group=group, ep_buffer=buffer)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (xs[rank], ws[rank], l1[mine], l2[mine])]
        out = fn(leaves[0], idxs[rank], *leaves[1:])
        return (out.detach(), *torch.autograd.grad(out, leaves, dys[rank]))

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    for a_, b_ in zip(eager, compiled):
        assert torch.equal(a_, b_)

    # opcheck on the arguments the layer passes to its two ops under expert parallelism: the fakes
    # size the received rows and the exchange's handle as the real ops make them.
    from test_compile import RecordOps, fresh
    from torch.library import opcheck

    with RecordOps() as recorder:
        run(layer)
    args, kwargs = recorder.calls["deep_gemm_ext::mega_moe_fwd"]
    opcheck(torch.ops.deep_gemm_ext.mega_moe_fwd.default, fresh(args, True), kwargs)
    args, kwargs = recorder.calls["deep_gemm_ext::mega_moe_bwd"]
    opcheck(torch.ops.deep_gemm_ext.mega_moe_bwd.default, fresh(args, False), kwargs)


def fp8_recipe(rank, world, device, seed):
    """recipe="fp8" over the exchange. Row quantization (x, act, dy, dh along the hidden sizes) sees
    the same rows as on one process, so y, dx and d topk_weights match the single-process fp8
    emulation up to bf16 roundings; the weight gradients' column tiles group other tokens, so those
    are held to the emulation's own error against fp64."""
    from deep_gemm_ext.recipes.fp8 import fp8_reference_layer

    hidden = inter = 128
    counts = [9, 5, 0, 6][:world]
    inputs = global_inputs(seed, world, counts, "unused_slots", torch.bfloat16, device, hidden=hidden, inter=inter)
    xs, idxs, ws, l1, l2, dys = inputs
    mine = slice(rank * E_LOC, (rank + 1) * E_LOC)
    leaves = [t.clone().requires_grad_(True) for t in (xs[rank], ws[rank], l1[mine], l2[mine])]
    y = dge.mega_moe_train(leaves[0], idxs[rank], *leaves[1:], group=dist.group.WORLD, recipe="fp8")
    got = (y.detach(), *torch.autograd.grad(y, leaves, dys[rank]))
    emulated = fp8_reference_layer(torch.cat(xs), torch.cat(idxs), torch.cat(ws), l1, l2, None, torch.cat(dys))
    exact = reference_grads(*inputs, None)
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    # x's rows travel in fp8 under this recipe (the plan's choice), in x's dtype under bf16.
    from deep_gemm_ext import plan as plan_mod

    specs = {r: plan_mod.resolve_exchange(leaves[0], idxs[rank], leaves[2], dist.group.WORLD, recipe=r)
             for r in ("fp8", "bf16")}
    assert specs["fp8"].endswith(":fp8") and specs["bf16"].endswith(":x"), specs
    assert comm.exchange(specs["fp8"]).fp8_rows and not comm.exchange(specs["bf16"]).fp8_rows
    names = ("y", "dx", "d_topk_weights", "d_l1", "d_l2")
    for i, name in enumerate(names):
        per_token = i < 3
        emu = emulated[i][lo:hi] if per_token else emulated[i][mine]
        ref = exact[i][rank] if per_token else exact[i][mine]
        if not ref.numel():
            continue
        if per_token:
            assert rel_err(got[i], emu) <= 1e-2, f"rank {rank}: {name} vs the fp8 emulation {rel_err(got[i], emu):.3g}"
        else:
            limit = 1.5 * rel_err(emu, ref) + 1e-3
            assert rel_err(got[i], ref) <= limit, f"rank {rank}: {name} {rel_err(got[i], ref):.3g} > {limit:.3g}"


def fp8_dispatch(rank, world, device, seed):
    """Dispatch with fp8 rows sends e4m3 data and fp32 1x128 scales (about half of bf16's bytes);
    the received rows, quantized again as the L1 forward does, give back the sender's data and
    scales bit for bit (ragged last tile, tiny, huge, all-zero and non-finite rows, every input
    dtype); ids and weights travel as with rows in x's dtype."""
    from deep_gemm_ext.recipes.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows

    hidden, cap = 200, 8  # two tiles a row, the second ragged (72 elements)
    counts = [5, 0, 7, 3][:world]
    g = torch.Generator().manual_seed(seed)
    idxs = [make_routing(n, world * E_LOC, K, "unused_slots", generator=g) for n in counts]
    ws = [torch.rand(n, K, generator=g) for n in counts]
    base = [torch.randn(n, hidden, generator=g, dtype=torch.float64) for n in counts]
    for x in base:  # rows of very different magnitudes, a zero row and non-finite elements
        if len(x) >= 4:
            x[0] *= 1e-30
            x[1] *= 1e4
            x[2] = 0
            x[3, 5], x[3, 150], x[3, 7] = float("inf"), float("nan"), -float("inf")
    exchange = AllToAllExchange(dist.group.WORLD, E_LOC, cap, fp8_rows=True)
    plain = AllToAllExchange(dist.group.WORLD, E_LOC, cap)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        xs = [x.to(dtype) for x in base]
        x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
        exp_x, exp_idx, exp_w = _expected_rows(rank, world, xs, idxs, ws, cap, hidden)
        x_r, idx_r, w_r, handle = exchange.dispatch(x, idx, w)
        assert x_r.dtype == dtype and x_r.shape == (world * cap, hidden)
        assert torch.equal(idx_r.cpu(), exp_idx) and torch.equal(w_r.cpu(), exp_w)
        # The received rows are the sender's 1x128 quantization, dequantized (zero where nothing was sent).
        want_q, want_s = quantize_rows(exp_x)
        torch.testing.assert_close(x_r.cpu(), dequantize_rows(want_q, want_s).to(dtype), rtol=0, atol=0,
                                   equal_nan=True)
        assert x_r.isnan().sum() == 3 * exp_x.isnan().any(-1).sum()  # Inf travels as NaN (e4m3fn has no Inf)
        # Quantizing them again, as the L1 forward does: the same e4m3 bytes and the same scales.
        got_q, got_s = quantize_rows(x_r.cpu())
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), dtype
        assert torch.equal(got_s, want_s), dtype
        # What travels: uint8 rows of e4m3 data then fp32 scale bytes, H + 4 * ceil(H / 128) a row.
        sent_rows = exchange.send_rows(x, handle[0]).cpu()
        assert sent_rows.dtype == torch.uint8 and sent_rows.shape == (world * cap, hidden + 8)
        bf16_rows = plain.send_rows(x.bfloat16(), handle[0])
        assert sent_rows.numel() <= 0.55 * bf16_rows.numel() * bf16_rows.element_size()
        q, sc = quantize_rows(x.cpu())
        for d in range(world):
            block = sent_rows.view(world, cap, -1)[d]
            for t in range(cap):
                if t < len(x) and handle[0][d, t]:
                    assert torch.equal(block[t, :hidden].view(FP8_DTYPE).view(torch.uint8), q[t].view(torch.uint8))
                    assert torch.equal(block[t, hidden:].view(torch.float32), sc[t])
                else:
                    assert not block[t].any()
        # Ids and weights are exactly those of the dispatch in x's dtype.
        plain_out = plain.dispatch(x, idx, w)
        assert torch.equal(plain_out[1], idx_r) and torch.equal(plain_out[2], w_r)
        assert all(torch.equal(a, b) for a, b in zip(plain_out[3], handle))


def titan_baseline(rank, world, device, seed):
    """baselines.ep_grouped_mm_moe (torchtitan-style EP, scripts/bench_ep_multi.py's baseline): y and
    every gradient against the fp64 reference, zero tokens on one rank and unused slots included."""
    from deep_gemm_ext.baselines import ep_grouped_mm_moe

    for case, routing in enumerate(("unused_slots", "skewed")):
        counts = _counts("zero_on_one_rank", world)
        inputs = global_inputs(seed + case, world, counts, routing, torch.float64, device)
        xs, idxs, ws, l1, l2, dys = inputs
        mine = slice(rank * E_LOC, (rank + 1) * E_LOC)
        leaves = [t.clone().requires_grad_(True) for t in (xs[rank], ws[rank], l1[mine], l2[mine])]
        y = ep_grouped_mm_moe(leaves[0], idxs[rank], leaves[1], leaves[2], leaves[3], dist.group.WORLD)
        got = (y.detach(), *torch.autograd.grad(y, leaves, dys[rank], allow_unused=True))
        ref = reference_grads(*inputs, None)
        for name, out, want in zip(("y", "dx", "d_topk_weights", "d_l1", "d_l2"), got,
                                   (ref[0][rank], ref[1][rank], ref[2][rank], ref[3][mine], ref[4][mine])):
            if out is None:
                out = torch.zeros_like(want)
            assert out.shape == want.shape, (name, out.shape, want.shape)
            if want.numel():
                assert rel_err(out, want) <= 1e-10, f"rank {rank} {routing}: {name} rel err {rel_err(out, want):.3g}"


def gpu_kernels_and_cuda_graph(rank, world, device, seed):
    """On GPUs (nccl): shapes our SM90 kernels take (H, 2I multiples of 128) against fp64, then
    forward + backward captured in one CUDA graph and replayed with new inputs and routing,
    bit-equal to eager."""
    hidden, inter, counts = 256, 128, [300, 129, 0, 77][:world]
    buffer = EpBuffer(dist.group.WORLD, 320, hidden, K, torch.bfloat16)
    mine = slice(rank * E_LOC, (rank + 1) * E_LOC)

    def inputs(seed_, routing):
        return global_inputs(seed_, world, counts, routing, torch.bfloat16, device, hidden=hidden, inter=inter)

    first = inputs(seed, "skewed")
    ref = reference_grads(*first, None)
    xs, idxs, ws, l1, l2, dys = first
    static = [t.clone().requires_grad_(t.is_floating_point())
              for t in (xs[rank], idxs[rank], ws[rank], l1[mine], l2[mine])]
    sx, sidx, sw, sl1, sl2 = static
    sdy = dys[rank].clone()

    def step():
        y = ep_layer(sx, sidx, sw, sl1, sl2, dist.group.WORLD, buffer)
        return (y, *torch.autograd.grad(y, (sx, sw, sl1, sl2), sdy))

    eager = [t.detach().clone() for t in step()]
    for name, out, want in zip(("y", "dx", "d_topk_weights", "d_l1", "d_l2"), eager,
                               (ref[0][rank], ref[1][rank], ref[2][rank], ref[3][mine], ref[4][mine])):
        if want.numel():
            err = rel_err(out, want)
            assert err <= 1e-2, f"rank {rank}: {name} rel err {err:.3g}"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: JIT compiles, allocator pools, the ranks' agreement check
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for k, routing in enumerate(("uniform", "unused_slots")):
        xs, idxs, ws, l1, l2, dys = inputs(seed + 1 + k, routing)
        with torch.no_grad():
            for dst, src in zip((*static, sdy), (xs[rank], idxs[rank], ws[rank], l1[mine], l2[mine], dys[rank])):
                dst.copy_(src)
        graph.replay()
        fresh_leaves = [t.detach().clone().requires_grad_(True) for t in (xs[rank], ws[rank], l1[mine], l2[mine])]
        y = ep_layer(fresh_leaves[0], idxs[rank], fresh_leaves[1], *fresh_leaves[2:], dist.group.WORLD, buffer)
        want = (y, *torch.autograd.grad(y, fresh_leaves, dys[rank]))
        torch.cuda.synchronize()
        for name, got, ref_ in zip(("y", "dx", "d_topk_weights", "d_l1", "d_l2"), outs, want):
            assert torch.equal(got, ref_), f"rank {rank} {routing}: replayed {name} differs from eager"


# ------------------------------------------------------------------------------------------------
# Tests


def _gpu(world):
    return pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"needs a CUDA GPU per rank ({world})")


@pytest.mark.parametrize(("world", "backend"), [
    *[pytest.param(w, "gloo", id=f"{w}-gloo") for w in (2, 3, 4)],
    *[pytest.param(w, "nccl", id=f"{w}-nccl", marks=_gpu(w)) for w in (2, 4)],
])
def test_layer_matches_fp64_reference(world, backend):
    run_scenario(world, "layer_matches_reference", backend)


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_pieces(world):
    run_scenario(world, "exchange_pieces")


@pytest.mark.parametrize("world", [2, 4])
def test_default_buffer_and_device_mesh(world):
    run_scenario(world, "default_buffer_and_mesh")


def test_exchange_bad_inputs():
    run_scenario(2, "bad_inputs")


def test_api_bad_inputs():
    run_scenario(2, "api_bad_inputs")


def test_module_and_compile():
    run_scenario(2, "module_and_compile")


def test_fp8_recipe():
    run_scenario(2, "fp8_recipe")


def test_torchtitan_style_ep_baseline():
    run_scenario(2, "titan_baseline")


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_dispatch(world):
    run_scenario(world, "fp8_dispatch")


def test_fp8_rows_requantize_exactly():
    """The identity fp8 dispatch rests on: quantize_rows(dequantize_rows(q, s)) == (q, s) bit for bit,
    held in fp32 or rounded to bf16. Each tile's amax runs over every 128th fp32 mantissa of a binade,
    scaled by powers of two from near the scale floor to 2^100 (the rest of the tile below it)."""
    from deep_gemm_ext.recipes.fp8 import dequantize_rows, quantize_rows

    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    mantissas = torch.arange(0x3F800000, 0x40000000, 128, dtype=torch.int32).view(torch.float32)
    exponents = torch.randint(-110, 100, mantissas.shape, generator=g).float()
    amax = mantissas * torch.exp2(exponents)
    rest = torch.rand(len(amax), 127, generator=g) * 2 - 1
    x = torch.cat([amax[:, None], amax[:, None] * rest], dim=1)
    for dtype in (torch.float32, torch.bfloat16):
        q, s = quantize_rows(x.to(dtype))
        back = dequantize_rows(q, s).to(dtype)
        q2, s2 = quantize_rows(back)
        assert torch.equal(s2, s), (dtype, seed, int((s2 != s).sum()))
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)), (dtype, seed)


@_gpu(2)
def test_gpu_kernels_and_cuda_graph():
    run_scenario(2, "gpu_kernels_and_cuda_graph", "nccl")


def test_ids_past_every_rank_are_unused_slots(tmp_path):
    """Ids >= W * E_loc (let through by DGE_CHECK_IDS=0 on CPU) go to no rank, and their weight
    gradient is 0, as on one rank: no piece indexes out of bounds (one-rank group, in process)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        exchange = comm.exchange(EpBuffer(dist.group.WORLD, 4, H, K, torch.float32).exchange_spec(E_LOC))
        g = torch.Generator().manual_seed(3)
        x, w = torch.randn(4, H, generator=g), torch.rand(4, K, generator=g)
        idx = torch.tensor([[0, 1, E_LOC + 3], [-1, 1, 0], [E_LOC, -1, 1], [1, 0, -1]])
        bad = (idx >= E_LOC) | (idx < 0)
        x_r, idx_r, w_r, handle = exchange.dispatch(x, idx, w)
        assert (idx_r[:4][bad] == -1).all() and (idx_r[:4][~bad] == idx[~bad]).all()
        dx, dw = exchange.dispatch_backward(torch.randn_like(x_r), torch.randn_like(w_r), handle)
        assert dx.shape == x.shape and (dw[bad] == 0).all() and (dw[~bad] != 0).all()
    finally:
        dist.destroy_process_group()
