"""Build a small MoE layer, run forward and backward, print which path ran and the gradient norms.

    python -m deep_gemm_ext.demo [--tokens 4096]
"""
from __future__ import annotations

import argparse

import torch

import deep_gemm_ext as dge
from deep_gemm_ext import plan
from deep_gemm_ext.reference import reference_forward
from deep_gemm_ext.testing import make_inputs, rel_err


def describe_path(x: torch.Tensor, l1_weights: torch.Tensor) -> str:
    if not x.is_cuda:
        return "CPU reference path (fp32 math, loop over experts): no CUDA GPU found"
    return f"GPU path on {torch.cuda.get_device_name()}: {plan.resolve(x, l1_weights).describe()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--clamp", type=float, default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)  # dy too: the printed norms are the same on every run (README)
    # Qwen3-30B-A3B-like layer on a GPU, a small one on CPU.
    T, H, I, E, K = (4096, 2048, 768, 128, 8) if device == "cuda" else (256, 256, 128, 16, 4)
    T = args.tokens if args.tokens is not None else T
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing="zipf", device=device, seed=0)
    print(f"path: {describe_path(x, l1)}")
    print(f"layer: T={T} H={H} I={I} E={E} K={K} clamp={args.clamp}")
    y = dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=args.clamp)
    dy = torch.randn_like(y)
    y.backward(dy)
    for name, t in (("y", y), ("dx", x.grad), ("d topk_weights", w.grad), ("d l1_weights", l1.grad),
                    ("d l2_weights", l2.grad)):
        print(f"  {name:15s} shape {str(tuple(t.shape)):18s} norm {t.float().norm().item():.4f}")
    leaves = [t.detach().double() for t in (x, w, l1, l2)]
    ref = reference_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], args.clamp)
    print(f"forward error vs fp64 reference: {rel_err(y, ref):.2e}")


if __name__ == "__main__":
    main()
