"""Time the SwiGLU GEMM epilogues against GEMM + elementwise kernel at a headline shape.

The L1 forward (paired GEMM, GEMM + swiglu_forward, fused nt_swiglu) and the L2 dgrad (GEMM,
GEMM + swiglu_backward, fused nn_swiglu_bwd at block_n 256 and 128) on a uniformly routed pool;
CUDA-event medians, every variant in the same run. DGE_FUSED_EPILOGUES' default follows these
numbers (docs/perf-notes.md). Correctness at this shape is tests/test_gpu_fused_epilogues.py.

    python scripts/bench_fused_epilogues.py [--workload qwen3-30b-a3b-t16384] [--clamp 7.0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg  # noqa: E402
from deep_gemm_ext.jit_kernels import swiglu  # noqa: E402
from deep_gemm_ext.routing import compute_routing_torch  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, make_routing, median_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="qwen3-30b-a3b-t16384", choices=sorted(WORKLOADS))
    parser.add_argument("--clamp", type=float, default=None)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    w, clamp = WORKLOADS[args.workload], args.clamp
    T, E, K, H, I = w.num_tokens, w.num_experts, w.top_k, w.hidden, w.intermediate
    g = torch.Generator().manual_seed(0)
    meta = compute_routing_torch(make_routing(T, E, K, "uniform", generator=g).cuda(), E, gg.GROUP_ALIGNMENT)
    rows, used = meta.num_pool_rows, int(meta.ends[-1])
    x = torch.randn(rows, H, device="cuda").bfloat16()
    dy = torch.randn(rows, H, device="cuda").bfloat16()
    l1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16()
    l2 = (torch.randn(E, H, I, device="cuda") / H ** 0.5).bfloat16()
    rw = torch.rand(rows, device="cuda") + 0.05
    s, t = meta.starts, meta.ends
    h, _ = gg.m_grouped_bf16_gemm_nt_swiglu(x, l1, s, t, clamp)
    l1_flops, l2_flops = 2.0 * used * 2 * I * H, 2.0 * used * H * I
    variants = [
        ("L1 fwd: paired GEMM only", l1_flops,
         lambda: gg.m_grouped_bf16_gemm_nt_contiguous(x, l1, s, t, paired_n=True)),
        ("L1 fwd: GEMM + swiglu_forward", l1_flops,
         lambda: swiglu.swiglu_forward(gg.m_grouped_bf16_gemm_nt_contiguous(x, l1, s, t), clamp)),
        ("L1 fwd: fused nt_swiglu", l1_flops, lambda: gg.m_grouped_bf16_gemm_nt_swiglu(x, l1, s, t, clamp)),
        ("L2 dgrad: GEMM only", l2_flops, lambda: gg.m_grouped_bf16_gemm_nn_contiguous(dy, l2, s, t)),
        ("L2 dgrad: GEMM + swiglu_backward", l2_flops,
         lambda: swiglu.swiglu_backward(h, gg.m_grouped_bf16_gemm_nn_contiguous(dy, l2, s, t), rw, clamp)),
        ("L2 dgrad: fused nn_swiglu_bwd BN256", l2_flops,
         lambda: gg.m_grouped_bf16_gemm_nn_swiglu_bwd(dy, l2, h, rw, s, t, clamp, block_n=256)),
        ("L2 dgrad: fused nn_swiglu_bwd BN128", l2_flops,
         lambda: gg.m_grouped_bf16_gemm_nn_swiglu_bwd(dy, l2, h, rw, s, t, clamp, block_n=128)),
    ]
    times = {name: median_ms(fn, args.reps) for name, _, fn in variants}
    unfused = {"L1": times["L1 fwd: GEMM + swiglu_forward"], "L2": times["L2 dgrad: GEMM + swiglu_backward"]}
    print(f"{w.name}, clamp {clamp}: pool rows {rows} (owned {used}); TFLOP/s over owned rows\n")
    print("| step | ms | TFLOP/s | x unfused |\n|---|---|---|---|")
    for name, flops, _ in variants:
        ms = times[name]
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.1f} | {unfused[name[:2]] / ms:.2f}x |")


if __name__ == "__main__":
    main()
