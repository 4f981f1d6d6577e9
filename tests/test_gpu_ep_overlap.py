"""The symmetric exchange's dispatch overlapped with the L1 GEMM (DGE_EP_OVERLAP=1), W ranks
emulated on one GPU.

The overlapped layer must give the same bits as the non-overlapped symmetric exchange (the same
kernels' arithmetic on the same pool order: the pull only copies rows, the GEMM only waits): every
rank's y and gradients are compared with torch.equal, over two calls on the same buffers (the
second waits for a later epoch than the arrivals of the first). The waiting GEMM is also run alone
against rows that arrive late, source block by source block (it must not read a block before its
arrival: the rows are NaN until then), and its bounded wait is checked in a subprocess.

Run like tests/test_gpu_ep_symmetric.py:
    CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 python -m pytest -q tests/test_gpu_ep_overlap.py
"""
from __future__ import annotations

import os

# Streams of the emulated ranks (and their side streams) need hardware queues of their own.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# Every kernel loaded when CUDA starts: a lazy load synchronizes the device (run_emulated_ranks).
os.environ["CUDA_MODULE_LOADING"] = "EAGER"

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.comm.emulated import emulated_ep_buffers, run_emulated_ranks  # noqa: E402

from conftest import requires_eager_loading, requires_hopper  # noqa: E402
from test_ep_all_to_all import _expected_rows, global_inputs  # noqa: E402
import test_ep_all_to_all as a2a  # noqa: E402

pytestmark = requires_hopper

H, K = 256, 4


def _seed() -> int:
    return random.randrange(2 ** 31)


def _blocks(world: int) -> int:
    """Transport CTAs a launch such that the waiting GEMMs keep about half the SMs
    (SymmetricEpBuffer.overlap_gemm_ctas: G = (SMs - 2 W blocks) / W)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, sms // (4 * world))


@pytest.fixture
def shapes(monkeypatch):
    def set_e_loc(e_loc):
        monkeypatch.setattr(a2a, "E_LOC", e_loc)
        monkeypatch.setattr(a2a, "K", K)
    return set_e_loc


def _run_layer(buffers, inputs, e_loc, poison: bool):
    xs, idxs, ws, l1, l2, dys = inputs

    def rank_step(rank):
        mine = slice(rank * e_loc, (rank + 1) * e_loc)
        if poison:
            # A freed NaN block of x_r's size on this stream: the dispatch's x_r most likely reuses
            # it, so a row read before its arrival would be NaN.
            nan = torch.full((buffers[rank].world_size * buffers[rank].max_tokens_per_rank, H), float("nan"),
                             device="cuda", dtype=torch.bfloat16)
            del nan
        leaves = [t.clone().requires_grad_(True) for t in (xs[rank], ws[rank], l1[mine], l2[mine])]
        y = dge.mega_moe_train(leaves[0], idxs[rank], *leaves[1:], group=buffers[rank].group,
                               ep_buffer=buffers[rank])
        grads = torch.autograd.grad(y, leaves, dys[rank])
        return [y.detach(), *grads]

    return run_emulated_ranks(rank_step, len(buffers))


@requires_eager_loading
@pytest.mark.parametrize("world,e_loc,inter", [(2, 2, 128), (4, 3, 256)])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "unused_slots"])
def test_layer_bit_identical_to_the_plain_symmetric_exchange(world, e_loc, inter, routing, shapes, monkeypatch):
    seed = _seed()
    shapes(e_loc)
    counts = [300, 0, 64, 171][:world]  # ragged, rank 1 has no tokens
    inputs = global_inputs(seed, world, counts, routing, torch.bfloat16, "cuda", num_local=e_loc, hidden=H,
                           inter=inter)
    cap = max(counts) + 3
    blocks = _blocks(world)

    monkeypatch.setenv("DGE_EP_OVERLAP", "0")
    plain = _run_layer(emulated_ep_buffers(world, cap, H, K, torch.bfloat16, "cuda", blocks=blocks), inputs, e_loc,
                       poison=False)

    monkeypatch.setenv("DGE_EP_OVERLAP", "1")
    buffers = emulated_ep_buffers(world, cap, H, K, torch.bfloat16, "cuda", blocks=blocks)
    xs, idxs, _, l1, _, _ = inputs
    spec = dge.plan.resolve_exchange(xs[0], idxs[0], l1[:e_loc], buffers[0].group, buffers[0])
    assert dge.plan.resolve(xs[0], l1[:e_loc], exchange=spec).ep_overlap, "the plan did not take DGE_EP_OVERLAP"
    for call in range(2):  # the second call waits for a later epoch on the same buffers
        got = _run_layer(buffers, inputs, e_loc, poison=True)
        for rank in range(world):
            for name, a, b in zip(("y", "dx", "d_topk_weights", "d_l1", "d_l2"), got[rank], plain[rank]):
                assert a.shape == b.shape, (rank, name)
                assert torch.equal(a, b), (f"seed {seed} W={world} {routing} call {call} rank {rank}: {name} differs "
                                           f"from the non-overlapped exchange")
        for rank in range(world):
            arrivals, _, epoch = buffers[rank].overlap_state()
            # Every source block arrived, at this rank's epoch of the forward's dispatch (two
            # pieces a step later in the backward, the epoch moved on by four a call).
            assert (arrivals >= 0).all() and arrivals.unique().numel() == 1, (seed, rank, arrivals)
            assert arrivals[0].item() == 4 * call + 1, (seed, rank, arrivals, epoch)


@requires_eager_loading
def test_overlapped_dispatch_pieces(shapes, monkeypatch):
    """dispatch_overlapped's x_r, idx_r, w_r, handle against the plain dispatch's and the loops'."""
    world, e_loc, cap, seed = 4, 2, 40, _seed()
    shapes(e_loc)
    counts = [33, 0, 40, 7]
    xs, idxs, ws, *_ = global_inputs(seed, world, counts, "unused_slots", torch.bfloat16, "cpu", num_local=e_loc,
                                     hidden=H)
    buffers = emulated_ep_buffers(world, cap, H, K, torch.bfloat16, "cuda", blocks=_blocks(world))

    # Copies between host and device outside the ranks' threads (run_emulated_ranks says why).
    inputs = [(x.cuda(), i.cuda(), w.cuda()) for x, i, w in zip(xs, idxs, ws)]

    def rank_step(rank):
        ex = buffers[rank].exchange(e_loc)
        x_r, idx_r, w_r, handle, pending = ex.dispatch_overlapped(*inputs[rank])
        torch.cuda.current_stream().wait_event(pending.done)
        y = ex.combine(x_r, handle)  # the next piece: the pull's consumed flags were raised
        arrivals, _, epoch = buffers[rank].overlap_state()
        return [x_r, idx_r, w_r, y, *handle, arrivals.clone(), epoch.clone()]

    # Twelve calls: more streams than torch's pool of 32 hands out before it comes round again (the
    # ranks' streams and the side streams must stay distinct queues on every call).
    for call in range(12):
        out = [[t.cpu() for t in rank_out] for rank_out in run_emulated_ranks(rank_step, world)]
        for rank in range(world):
            x_r, idx_r, w_r, y, sent, slot_rank, received, arrivals, epoch = out[rank]
            exp_x, exp_idx, exp_w = _expected_rows(rank, world, xs, idxs, ws, cap, H)
            assert torch.equal(x_r, exp_x) and torch.equal(idx_r, exp_idx) and torch.equal(w_r, exp_w), (seed, rank)
            assert torch.equal(received, (exp_idx >= 0).any(-1)), (seed, rank)
            copies = sent.sum(0, keepdim=True).T.float()
            assert torch.equal(y, (xs[rank].float() * copies).bfloat16()), (seed, rank)
            # The dispatch ran at epoch 2 call + 1 (the first piece); combine's publish moved it on by one.
            assert arrivals.tolist() == [2 * call + 1] * world and epoch.item() == 2 * call + 2, (
                seed, call, rank, arrivals, epoch)

    # fp8 rows and non-bf16 x are refused before anything launches.
    with pytest.raises(ValueError, match="bf16 rows"):
        buffers[0].exchange(e_loc, fp8_rows=True).dispatch_overlapped(xs[0].cuda(), idxs[0].cuda(), ws[0].cuda())
    with pytest.raises(ValueError, match="dtype torch.float32"):
        buffers[0].exchange(e_loc).dispatch_overlapped(xs[0].cuda().float(), idxs[0].cuda(), ws[0].cuda())


def test_emulated_grid_cap_refuses_too_many_transport_ctas():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buffers = emulated_ep_buffers(2, 8, H, K, torch.bfloat16, "cuda")  # default blocks: ceil(SMs / 4)
    with pytest.raises(ValueError, match="emulated_ep_buffers"):
        buffers[0].overlap_gemm_ctas()
    buffers = emulated_ep_buffers(2, 8, H, K, torch.bfloat16, "cuda", blocks=4)
    assert buffers[0].overlap_gemm_ctas() == (sms - 16) // 2


def _waiting_gemm_inputs(seed, world, cap, num_experts, n, routing):
    from deep_gemm_ext.routing import compute_routing_torch
    from deep_gemm_ext.testing import make_routing

    g = torch.Generator().manual_seed(seed)
    rows = world * cap
    x = torch.randn(rows, H, generator=g).to("cuda", torch.bfloat16)
    idx = make_routing(rows, num_experts, K, routing, generator=g).cuda()
    meta = compute_routing_torch(idx, num_experts, 128)
    b = (torch.randn(num_experts, n, H, generator=g) / H ** 0.5).to("cuda", torch.bfloat16)
    return x, meta, b


@requires_eager_loading
@pytest.mark.parametrize("routing", ["uniform", "unused_slots"])
def test_waiting_gemm_waits_for_each_source_block(routing):
    """The rows of source s are NaN until arrivals[s] reaches the epoch; blocks arrive one by one,
    late (a sleeping side stream). The waiting GEMM must equal the plain gathered GEMM bit for bit."""
    from deep_gemm_ext import jit_kernels as jk
    from deep_gemm_ext.comm.symmetric import overlap_report_tensor

    world, cap, num_experts, n, seed = 4, 96, 8, 512, _seed()
    x, meta, b = _waiting_gemm_inputs(seed, world, cap, num_experts, n, routing)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x_r = torch.full_like(x, float("nan"))
    arrivals = torch.full((world,), 6, dtype=torch.int64, device="cuda")  # an older epoch's arrivals
    epoch = torch.tensor([7], dtype=torch.int64, device="cuda")
    wait = jk.AwaitRows(arrivals, epoch, cap, 0, int(60e9), max(1, sms - 8), overlap_report_tensor())
    gather = jk.Gather(meta.row_to_slot, K, "cp_async")
    rows = meta.num_pool_rows

    def gemm(a, gth):
        return jk.m_grouped_bf16_gemm_nt_contiguous(a, b, meta.starts, meta.ends,
                                                    torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16),
                                                    gather=gth)

    want = gemm(x, gather)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in (0, 2, 1, 3):  # out of order: every tile must wait for its own sources
            torch.cuda._sleep(20_000_000)
            x_r[s * cap:(s + 1) * cap].copy_(x[s * cap:(s + 1) * cap])
            arrivals[s:s + 1].fill_(7)
    got = gemm(x_r, jk.Gather(meta.row_to_slot, K, "cp_async", wait))
    torch.cuda.synchronize()
    used = meta.ends[-1].item()  # rows past it are no expert's
    assert not torch.isnan(got[:used].float()).any(), f"seed {seed}: the GEMM read rows before they arrived"
    assert torch.equal(got[:used], want[:used]), f"seed {seed}: the waiting GEMM differs from the plain gathered GEMM"


def test_waiting_gemm_bad_inputs():
    from deep_gemm_ext import jit_kernels as jk
    from deep_gemm_ext.comm.symmetric import overlap_report_tensor

    x, meta, b = _waiting_gemm_inputs(1, 2, 64, 4, 256, "uniform")
    arrivals = torch.zeros(2, dtype=torch.int64, device="cuda")
    epoch = torch.ones(1, dtype=torch.int64, device="cuda")
    wait = jk.AwaitRows(arrivals, epoch, 64, 0, 10 ** 9, 100, overlap_report_tensor())
    with pytest.raises(ValueError, match="gather.mode='tma'"):
        jk.m_grouped_bf16_gemm_nt_contiguous(x, b, meta.starts, meta.ends, gather=jk.Gather(meta.row_to_slot, K,
                                                                                            "tma", wait))
    with pytest.raises(ValueError, match="W \\* capacity"):
        jk.m_grouped_bf16_gemm_nt_contiguous(x[:100], b, meta.starts, meta.ends,
                                             gather=jk.Gather(meta.row_to_slot, K, "cp_async", wait))
    with pytest.raises(ValueError, match="rank=2"):
        jk.m_grouped_bf16_gemm_nt_contiguous(x, b, meta.starts, meta.ends, gather=jk.Gather(
            meta.row_to_slot, K, "cp_async", wait._replace(rank=2)))
    with pytest.raises(ValueError, match="pinned int64"):
        jk.m_grouped_bf16_gemm_nt_contiguous(x, b, meta.starts, meta.ends, gather=jk.Gather(
            meta.row_to_slot, K, "cp_async", wait._replace(report=torch.zeros(5, dtype=torch.int64))))


_TIMEOUT_SCRIPT = textwrap.dedent("""
    import torch
    from deep_gemm_ext import jit_kernels as jk
    from deep_gemm_ext.comm.symmetric import overlap_report_tensor, overlap_timeout_report
    from deep_gemm_ext.routing import compute_routing_torch
    world, cap, top_k = 2, 64, 4
    x = torch.randn(world * cap, 256, device="cuda", dtype=torch.bfloat16)
    idx = (torch.arange(world * cap * top_k, device="cuda").view(-1, top_k) % 4)
    meta = compute_routing_torch(idx, 4, 128)
    b = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    arrivals = torch.tensor([5, 4], dtype=torch.int64, device="cuda")  # source 1 never arrives
    epoch = torch.tensor([5], dtype=torch.int64, device="cuda")
    wait = jk.AwaitRows(arrivals, epoch, cap, 1, 2 * 10 ** 9, 16, overlap_report_tensor())
    try:
        jk.m_grouped_bf16_gemm_nt_contiguous(x, b, meta.starts, meta.ends,
                                             gather=jk.Gather(meta.row_to_slot, top_k, "cp_async", wait))
        torch.cuda.synchronize()
        print("NO TIMEOUT")
    except RuntimeError as exc:
        print("CUDA ERROR", exc)
        print("REPORT", overlap_timeout_report())
""")


def test_waiting_gemm_times_out_with_a_message():
    proc = subprocess.run([sys.executable, "-c", _TIMEOUT_SCRIPT], capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert "NO TIMEOUT" not in output, output
    assert "CUDA ERROR" in output, output
    assert ("REPORT deep_gemm_ext expert-parallel overlap: rank 1's L1 GEMM timed out waiting for the rows of "
            "source rank 1: awaited epoch 5, arrivals[1] = 4") in output, output
