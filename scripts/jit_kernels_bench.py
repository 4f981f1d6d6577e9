"""Time the JIT kernels against their torch equivalents at Qwen3-30B-A3B T 16384 shapes.

CUDA events around each call, L2 flushed before every timed call, median of the repeats; fresh
random inputs. Also the layer's row gathers with plain and with evict-first pool stores
(``gather_rows(stream_stores=)``), the SwiGLU backward of fp8 weight gradients in one pass against
its two-pass form (``swiglu_backward_fp8_t`` against ``swiglu_backward_fp8`` + ``quantize_cols_transposed_fp8`` of
dh and act_w, with a bits check), and the host cost of a warm launch (perf_counter over 2000
launches). Prints markdown tables; ratios are measured in the same run.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deep_gemm_ext import jit  # noqa: E402
from deep_gemm_ext.jit_kernels import (combine_rows, gather_rows, quantize_cols_fp8,  # noqa: E402
                                       quantize_cols_transposed_fp8, quantize_rows_fp8, routing_metadata, swiglu,
                                       swiglu_backward, swiglu_backward_fp8, swiglu_backward_fp8_t, swiglu_forward,
                                       swiglu_forward_fp8)
from deep_gemm_ext.recipes import fp8  # noqa: E402
from deep_gemm_ext.routing import compute_routing_torch, pool_rows  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, make_routing, median_ms  # noqa: E402



def time_us(fn, repeats: int) -> float:
    """Median device time of ``fn()`` in microseconds, with a cold L2 each time."""
    return median_ms(fn, repeats, warmup=1, flush_l2=True) * 1e3


# torch equivalents (what the unfused layer would run)

def swiglu_forward_torch(h):
    g, u = h.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).bfloat16()


def swiglu_backward_torch(h, da, w):
    g, u = h.float().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    silu = g * s
    act = silu * u
    da32 = da.float()
    dweight = (da32 * act).sum(-1)
    d = w[:, None] * da32
    dh = torch.cat([d * u * s * (1 + g * (1 - s)), d * silu], dim=-1).bfloat16()
    return dh, dweight, (w[:, None] * act).bfloat16()


def gather_torch(x, row_to_slot, top_k):
    src = (row_to_slot.long() // top_k).clamp(min=0)
    return torch.where((row_to_slot >= 0)[:, None], x[src], 0)


def combine_torch(o, slot_to_row, weights, top_k):
    rows = slot_to_row.long()
    picked = o[rows.clamp(min=0)].view(-1, top_k, o.shape[1]).float()
    w = torch.where(rows.view(-1, top_k) >= 0, weights, 0)
    return (picked * w[..., None]).sum(1).bfloat16()


def launch_overhead_us(launch, count: int = 2000, batch: int = 500) -> float:
    """Host time per call. A spinning kernel keeps the GPU busy while each batch is issued, so the
    launches only queue (a batch stays under the driver's queue depth) and GPU time never leaks in."""
    for _ in range(100):
        launch()
    torch.cuda.synchronize()
    elapsed = 0.0
    for _ in range(count // batch):
        torch.cuda._sleep(20_000_000)
        start = time.perf_counter()
        for _ in range(batch):
            launch()
        elapsed += time.perf_counter() - start
        torch.cuda.synchronize()
    return elapsed / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="qwen3-30b-a3b-t16384", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    w = WORKLOADS[args.workload]
    T, K, E, H, I = w.num_tokens, w.top_k, w.num_experts, w.hidden, w.intermediate
    P = pool_rows(T * K, E, 128)
    dev = "cuda"

    topk_idx = make_routing(T, E, K, "uniform").to(dev)
    meta = compute_routing_torch(topk_idx, E, 128)
    ours = routing_metadata(topk_idx, E, 128)
    routing_ok = all(torch.equal(a, b) for a, b in zip(ours.tensors(), meta.tensors()))
    x = torch.randn(T, H, device=dev).bfloat16()
    weights = torch.rand(T, K, device=dev)
    h = (torch.randn(P, 2 * I, device=dev) * 2).bfloat16()
    da = torch.randn(P, I, device=dev).bfloat16()
    row_w = torch.rand(P, device=dev)
    o = torch.randn(P, H, device=dev).bfloat16()

    gb = 1e-9
    rows = [
        ("routing metadata", lambda: routing_metadata(topk_idx, E, 128),
         lambda: compute_routing_torch(topk_idx, E, 128), (T * K * 8 + T * K * 4 + P * 4) * gb),
        ("swiglu forward", lambda: swiglu_forward(h), lambda: swiglu_forward_torch(h), P * I * 6 * gb),
        ("swiglu backward", lambda: swiglu_backward(h, da, row_w), lambda: swiglu_backward_torch(h, da, row_w),
         P * (I * 12 + 8) * gb),
        ("gather rows", lambda: gather_rows(x, meta.row_to_slot, K), lambda: gather_torch(x, meta.row_to_slot, K),
         (T * K * H * 2 + P * H * 2 + P * 4) * gb),
        ("combine rows", lambda: combine_rows(o, meta.slot_to_row, weights, K),
         lambda: combine_torch(o, meta.slot_to_row, weights, K), (T * K * H * 2 + T * H * 2 + T * K * 8) * gb),
    ]
    # Blockwise fp8 (torch: recipes.fp8's quantizers): bf16 read, e4m3 + one fp32 scale per 128 written.
    for m, k in ((131072, 2048), (131072, 768)):
        xq = torch.randn(m, k, device=dev).bfloat16()
        rows.append((f"fp8 quantize rows [{m}, {k}]", lambda xq=xq: quantize_rows_fp8(xq),
                     lambda xq=xq: fp8.quantize_rows(xq), (m * k * 3 + m * fp8.num_blocks(k) * 4) * gb))
    xc = torch.randn(131072, 2048, device=dev).bfloat16()
    rows.append(("fp8 quantize cols [131072, 2048]", lambda: quantize_cols_fp8(xc), lambda: fp8.quantize_cols(xc),
                 (131072 * 2048 * 3 + 1024 * 2048 * 4) * gb))
    rows.append((f"fp8 quantize gathered pool [{P}, {H}]", lambda: quantize_rows_fp8(x, gather=(meta.row_to_slot, K)),
                 lambda: fp8.quantize_rows(gather_torch(x, meta.row_to_slot, K)),
                 (T * K * H * 2 + P * H + P * fp8.num_blocks(H) * 4 + P * 4) * gb))
    rows.append((f"fp8 swiglu forward + quantize [{P}, {2 * I}]", lambda: swiglu_forward_fp8(h),
                 lambda: fp8.quantize_rows(swiglu_forward(h)), (P * I * 5 + P * fp8.num_blocks(I) * 4) * gb))
    results = []
    for name, ours_fn, torch_fn, gigabytes in rows:
        ours_us = time_us(ours_fn, args.repeats)
        torch_us = time_us(torch_fn, args.repeats)
        results.append((name, ours_us, torch_us, gigabytes))

    # The layer's gathers with plain and with evict-first (st.global.cs) pool stores, the L2 flushed
    # first: the bf16 pools of the backward, the per-token e4m3 rows and fp32 scales of the fp8 recipe.
    xq, xs_scale = quantize_rows_fp8(x)
    gathers = [(f"bf16 rows [{T}, {H}] -> [{P}, {H}]", x), (f"e4m3 rows [{T}, {H}] -> [{P}, {H}]", xq),
               (f"fp32 scales [{T}, {xs_scale.shape[1]}] -> [{P}, {xs_scale.shape[1]}]", xs_scale)]
    store_rows = []
    for name, src in gathers:
        plain = gather_rows(src, meta.row_to_slot, K)
        streamed = gather_rows(src, meta.row_to_slot, K, stream_stores=True)
        same = torch.equal(plain.view(torch.uint8), streamed.view(torch.uint8))
        plain_us = time_us(lambda src=src: gather_rows(src, meta.row_to_slot, K), args.repeats)
        cs_us = time_us(lambda src=src: gather_rows(src, meta.row_to_slot, K, stream_stores=True), args.repeats)
        token = gather_rows(src, meta.row_to_slot, K, slot_to_row=meta.slot_to_row)
        same = same and torch.equal(plain.view(torch.uint8), token.view(torch.uint8))
        token_us = time_us(lambda src=src: gather_rows(src, meta.row_to_slot, K, slot_to_row=meta.slot_to_row),
                           args.repeats)
        store_rows.append((name, plain_us, cs_us, token_us, plain.numel() * plain.element_size() * gb, same))

    # fp8 weight gradients' SwiGLU backward: one pass (dh's rows, dh^T and act_w^T column-quantized) against
    # the bf16 dh and act_w written and then quantized apart.
    rows_t = -(-P // 16) * 16

    def swiglu_t_separate():
        dh, dweight, act_w, dh_data, dh_scale = swiglu_backward_fp8(h, da, row_w)
        return (dweight, dh_data, dh_scale, *quantize_cols_transposed_fp8(dh, rows=rows_t),
                *quantize_cols_transposed_fp8(act_w, rows=rows_t))

    fused_t = swiglu_backward_fp8_t(h, da, row_w, rows=rows_t)
    swiglu_t_same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                        for a, b in zip(fused_t, swiglu_t_separate()))
    swiglu_t_us = (time_us(lambda: swiglu_backward_fp8_t(h, da, row_w, rows=rows_t), args.repeats),
                   time_us(swiglu_t_separate, args.repeats))
    swiglu_t_gb = (P * 3 * I * 2 + P * 2 * I + rows_t * 3 * I) * gb  # h, da read; dh rows, dh^T, act_w^T written

    tiny_kernel = jit.build(*swiglu._FORWARD[False])
    h1 = torch.randn(1, 16, device=dev).bfloat16()
    a1 = torch.empty(1, 8, device=dev, dtype=torch.bfloat16)
    tiny_args = (h1, a1, ctypes.c_int64(1), ctypes.c_int32(8), ctypes.c_float(math.inf))
    raw_us = launch_overhead_us(lambda: tiny_kernel.launch((1, 1, 1), (256, 1, 1), tiny_args))
    wrapper_us = launch_overhead_us(lambda: swiglu_forward(h1))
    torch_op_us = launch_overhead_us(lambda: h1.add_(0))

    print(f"\n### JIT kernels vs torch, {w.name}: T={T} K={K} E={E} H={H} I={I} P={P} "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})\n")
    print("| kernel | ours us | torch us | torch/ours | ours GB/s |")
    print("|---|---|---|---|---|")
    for name, ours_us, torch_us, gigabytes in results:
        print(f"| {name} | {ours_us:.1f} | {torch_us:.1f} | {torch_us / ours_us:.2f}x | "
              f"{gigabytes / (ours_us * 1e-6):.0f} |")
    print("\n| gather (L2 flushed) | plain stores us | evict-first us | token order us | plain / best "
          "| pool GB/s written (best) | same bytes |")
    print("|---|---|---|---|---|---|---|")
    for name, plain_us, cs_us, token_us, pool_gb, same in store_rows:
        best = min(cs_us, token_us)
        print(f"| {name} | {plain_us:.1f} | {cs_us:.1f} | {token_us:.1f} | {plain_us / best:.2f}x "
              f"| {pool_gb / (best * 1e-6):.0f} | {same} |")
    print(f"\n| fp8 weight gradients' SwiGLU backward [{P}, {2 * I}] | one pass us | two passes us | two / one "
          f"| one pass GB/s | same bits |")
    print("|---|---|---|---|---|---|")
    print(f"| swiglu_backward_fp8_t vs swiglu_backward_fp8 + 2 quantize_cols_transposed_fp8 | {swiglu_t_us[0]:.1f} "
          f"| {swiglu_t_us[1]:.1f} | {swiglu_t_us[1] / swiglu_t_us[0]:.2f}x "
          f"| {swiglu_t_gb / (swiglu_t_us[0] * 1e-6):.0f} | {swiglu_t_same} |")
    print(f"\nrouting bit-identical to compute_routing_torch: {routing_ok}")
    xs = torch.randn(4096, 2048, device=dev).bfloat16()
    fp8_ok = all(torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8_DTYPE else a.view(torch.int32),
                             b.view(torch.uint8) if b.dtype == fp8.FP8_DTYPE else b.view(torch.int32))
                 for got, ref in ((quantize_rows_fp8(xs), fp8.quantize_rows(xs)),
                                  (quantize_cols_fp8(xs), fp8.quantize_cols(xs))) for a, b in zip(got, ref))
    print(f"fp8 quantizers bit-identical to recipes.fp8 (rows, cols at [4096, 2048]): {fp8_ok}")
    print("\n| host time per warm launch (2000 launches) | us |")
    print("|---|---|")
    print(f"| Kernel.launch (tiny kernel, 5 args) | {raw_us:.2f} |")
    print(f"| swiglu_forward wrapper (checks + alloc + build lookup + launch) | {wrapper_us:.2f} |")
    print(f"| torch h.add_(0) (reference) | {torch_op_us:.2f} |")


if __name__ == "__main__":
    main()
