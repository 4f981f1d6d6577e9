#!/usr/bin/env python3
"""Expert parallelism with W ranks emulated on one GPU: forward+backward time of one step of all W
ranks, against the single-process layer (EP = 1) on the same tokens and experts, same process.

The W ranks share the GPU, so an emulated step does W times the per-rank work on one device: the
ratio to EP = 1 is what the symmetric exchange (publish, pull, rank-order sums, the flags) and W
smaller GEMM launches per GEMM cost on top of the same FLOPs, not a multi-GPU speed-up. The step
is timed by CUDA events on the calling stream around ``run_emulated_ranks`` (W host threads, one
stream each; the ranks' streams wait on the calling stream and it on theirs), so host launch time
that does not overlap the GPU's work is inside it. Rows: the plain symmetric exchange and
``DGE_EP_OVERLAP=1`` (the dispatch's row pull on a side stream while the L1 GEMM waits per tile).
Run with the driver settings the emulation needs:

    CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 python scripts/bench_ep.py --world 8
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.comm.emulated import emulated_ep_buffers, run_emulated_ranks  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, make_inputs, median_ms, rel_err  # noqa: E402


def _rank_inputs(x, idx, w, world):
    """The tokens split into W equal parts (rank r gets the r-th)."""
    per = x.shape[0] // world
    return [tuple(t[r * per:(r + 1) * per] for t in (x, idx, w)) for r in range(world)]


def _step(buffers, parts, l1, l2, dys, e_loc, outs):
    def rank_step(rank):
        x, idx, w = parts[rank]
        mine = slice(rank * e_loc, (rank + 1) * e_loc)
        leaves = [x, w, l1[mine], l2[mine]]
        y = dge.mega_moe_train(x, idx, *leaves[1:], group=buffers[rank].group, ep_buffer=buffers[rank])
        outs[rank] = [y, *torch.autograd.grad(y, leaves, dys[rank])]
    run_emulated_ranks(rank_step, len(buffers))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="qwen3-30b-a3b-t16384", choices=sorted(WORKLOADS))
    parser.add_argument("--world", type=int, nargs="+", default=[8])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_ep.py needs a CUDA GPU (the emulated ranks run the symmetric exchange's kernels)")
        return 1
    wl = WORKLOADS[args.workload]
    x, idx, w, l1, l2 = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                                    device="cuda", seed=0)
    dy = torch.randn(x.shape, device="cuda", dtype=x.dtype)
    flops = 3 * wl.flops_forward()

    def ep1():
        y = dge.mega_moe_train(x, idx, w, l1, l2)
        torch.autograd.grad(y, (x, w, l1, l2), dy)

    base = median_ms(ep1, reps=args.reps)
    y_ref = dge.mega_moe_train(x, idx, w, l1, l2).detach()
    rows = [("EP = 1 (single process)", base, None)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for world in args.world:
        if wl.num_tokens % world or wl.num_experts % world:
            print(f"W={world}: {wl.num_tokens} tokens or {wl.num_experts} experts do not split evenly; skipped")
            continue
        e_loc, per = wl.num_experts // world, wl.num_tokens // world
        parts = _rank_inputs(x, idx, w, world)
        dys = [dy[r * per:(r + 1) * per] for r in range(world)]
        for overlap in (False, True):
            os.environ["DGE_EP_OVERLAP"] = "1" if overlap else "0"
            blocks = max(1, sms // (4 * world)) if overlap else None
            buffers = emulated_ep_buffers(world, per, wl.hidden, wl.top_k, x.dtype, "cuda", blocks=blocks)
            outs = [None] * world
            ms = median_ms(lambda: _step(buffers, parts, l1, l2, dys, e_loc, outs), reps=args.reps)
            err = rel_err(torch.cat([o[0] for o in outs]), y_ref)  # y of every rank against EP = 1's
            label = f"emulated W={world}, symmetric exchange" + (", DGE_EP_OVERLAP=1" if overlap else "")
            rows.append((label, ms, err))
            buffers = outs = None  # the next row allocates its own
        os.environ.pop("DGE_EP_OVERLAP", None)
    print(f"\n{wl.name} fwd+bwd, {wl.num_tokens} tokens in all, medians of {args.reps} (CUDA events)\n")
    print("| configuration | ms | x EP = 1 time | TFLOP/s (all ranks) | y vs EP = 1 rel err |")
    print("|---|---|---|---|---|")
    for label, ms, err in rows:
        print(f"| {label} | {ms:.3f} | {ms / base:.3f} | {flops / ms / 1e9:.0f} | "
              f"{'-' if err is None else f'{err:.2e}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
