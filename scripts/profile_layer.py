#!/usr/bin/env python3
"""Where the time goes: CUDA kernel time per step of one forward+backward (torch.profiler).

    python scripts/profile_layer.py --impl ours --workload qwen3-30b-a3b-t16384
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.baselines import grouped_mm_moe  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, make_inputs  # noqa: E402

IMPLS = {"ours": dge.mega_moe_train, "grouped_mm": grouped_mm_moe}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=list(IMPLS), default="ours")
    p.add_argument("--workload", choices=list(WORKLOADS), default="qwen3-30b-a3b-t16384")
    p.add_argument("--rows", type=int, default=15)
    args = p.parse_args()
    wl = WORKLOADS[args.workload]
    x, idx, w, l1, l2 = make_inputs(wl.num_tokens, wl.hidden, wl.intermediate, wl.num_experts, wl.top_k,
                                    device="cuda", seed=7)
    dy = torch.randn_like(x)
    fn = IMPLS[args.impl]

    def step():
        y = fn(x, idx, w, l1, l2)
        torch.autograd.grad(y, (x, w, l1, l2), dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"{args.impl} on {args.workload}: CUDA time per kernel, one forward+backward")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
