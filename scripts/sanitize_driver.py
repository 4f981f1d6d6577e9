#!/usr/bin/env python3
"""A small workload for compute-sanitizer: every kernel path of the layer at tiny shapes.

    python scripts/sanitize_driver.py [--part all|layer|kernels]

``layer``: mega_moe_train forward + backward on both GEMM engines (our SM90 GEMMs at two sizes,
torch._grouped_mm) over the routing edge cases: T = 0, 1, not a multiple of
128; empty experts, unused (-1) slots, every slot on one expert, every slot unused; clamp on and
off; int32 and int64 ids. ``kernels``: each JIT kernel wrapper of deep_gemm_ext.jit_kernels called
directly, including inputs the layer never produces (ids outside [-1, E), rows past the pool, the
largest top_k and expert count) that the kernels must survive without an out-of-bounds access.
Wrappers that do not exist in this checkout are reported as skipped.

Prints one line per case and a table; exits 1 when a case raised, 2 without a GPU. Memory errors
themselves are compute-sanitizer's to report (scripts/sanitize.sh).
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.routing import compute_routing_torch  # noqa: E402
from deep_gemm_ext.testing import make_inputs  # noqa: E402

RESULTS: list[tuple[str, str, str]] = []  # (case, status, detail)
INITCHECK = False  # set by --initcheck


def record(name: str, fn) -> None:
    try:
        detail = fn() or ""
        RESULTS.append((name, "ok", detail))
    except _Skip as skip:
        RESULTS.append((name, "skipped", str(skip)))
    except Exception as exc:  # reported in the table; the exit code carries it
        RESULTS.append((name, "ERROR", f"{type(exc).__name__}: {exc}"))
        traceback.print_exc()
    print(f"{RESULTS[-1][1]:8s} {name} {RESULTS[-1][2]}", flush=True)


class _Skip(Exception):
    pass


def _finite(*tensors: torch.Tensor) -> str:
    torch.cuda.synchronize()
    bad = [i for i, t in enumerate(tensors) if not bool(t.isfinite().all())]
    if bad:
        raise RuntimeError(f"non-finite values in outputs {bad} from finite inputs")
    return ""


# ---------------------------------------------------------------------------------------------
# The layer.


def _routing(T, E, K, kind):
    if kind == "flood_all":
        return torch.full((T, K), E // 2)
    if kind == "all_unused":
        return torch.full((T, K), -1)
    return None


def layer_case(T, H, I, E, K, kind, clamp, idx_dtype, seed=0):
    base = kind if kind in ("uniform", "zipf", "one_expert", "empty_experts", "unused_slots") else "uniform"
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing=base, device="cuda", seed=seed)
    override = _routing(T, E, K, kind)
    if override is not None:
        idx = override.to("cuda")
    idx = idx.to(idx_dtype)
    y = dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, l1, l2), dy, allow_unused=True) if y.requires_grad else ()
    return _finite(y, *[g for g in grads if g is not None])


LAYER_SHAPES = {  # (H, I): which GEMMs the layer picks
    "sm90-i128": (128, 128),
    "sm90": (128, 64),
    "grouped_mm": (72, 40),
}
LAYER_CASES = [  # (T, E, K, routing, clamp, idx dtype)
    (77, 8, 4, "uniform", None, torch.int64),
    (77, 8, 4, "empty_experts", 0.5, torch.int32),
    (130, 8, 4, "unused_slots", None, torch.int64),
    (1, 8, 4, "zipf", 0.5, torch.int64),
    (64, 8, 3, "flood_all", None, torch.int32),
    (9, 8, 2, "all_unused", None, torch.int64),
    (0, 8, 2, "uniform", None, torch.int64),
]


def run_layer_cases():
    for shape, (H, I) in LAYER_SHAPES.items():
        for T, E, K, kind, clamp, idx_dtype in LAYER_CASES:
            name = f"layer {shape} T={T} E={E} K={K} {kind} clamp={clamp} {str(idx_dtype)[6:]}"
            record(name, lambda: layer_case(T, H, I, E, K, kind, clamp, idx_dtype))


# ---------------------------------------------------------------------------------------------
# The JIT kernel wrappers, called directly.


def _jit():
    try:
        from deep_gemm_ext import jit_kernels
    except ImportError as exc:
        raise _Skip(f"deep_gemm_ext.jit_kernels does not import: {exc}")
    if hasattr(jit_kernels, "available") and not jit_kernels.available(torch.cuda.current_device()):
        raise _Skip("JIT kernels unavailable on this device")
    return jit_kernels


def _wrapper(name: str):
    module = _jit()
    if not hasattr(module, name):
        raise _Skip(f"jit_kernels.{name} does not exist")
    return getattr(module, name)


def _ids(T, K, E, seed=0, bad=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, E, (T, K), generator=g)
    if bad and idx.numel() >= 2:  # the routing must treat these as unused, never index with them
        idx.view(-1)[0] = E + 5
        idx.view(-1)[-1] = -7
    return idx.cuda()


def k_routing(T, K, E, align, idx_dtype, bad=False):
    routing_metadata = _wrapper("routing_metadata")
    idx = _ids(T, K, E, bad=bad).to(idx_dtype)
    meta = routing_metadata(idx, E, align)
    clean = torch.where((idx >= E) | (idx < -1), -1, idx)
    want = compute_routing_torch(clean, E, align)
    for a, b in zip(meta.tensors(), want.tensors()):
        if not torch.equal(a, b):
            raise RuntimeError("routing_metadata differs from compute_routing_torch")
    return f"pool rows {meta.num_pool_rows}"


def k_gather(T, H, K, dtype, extra_bad_rows=False):
    gather_rows = _wrapper("gather_rows")
    idx = _ids(T, K, 8)
    meta = compute_routing_torch(idx, 8, 16)
    row_to_slot = meta.row_to_slot.clone()
    if extra_bad_rows and row_to_slot.numel():
        row_to_slot[-1] = T * K + 3  # a slot past the last token: must read as a zero row
    x = torch.randn(T, H, device="cuda").to(dtype)
    pool = gather_rows(x, row_to_slot, K)
    torch.cuda.synchronize()
    return f"pool {tuple(pool.shape)}"


def k_combine(T, H, K, weighted, extra_bad_rows=False):
    combine_rows = _wrapper("combine_rows")
    idx = _ids(T, K, 8)
    meta = compute_routing_torch(idx, 8, 16)
    slot_to_row = meta.slot_to_row.clone()
    rows = meta.num_pool_rows
    if extra_bad_rows and slot_to_row.numel():
        slot_to_row[0] = rows + 7  # a row past the pool: must be skipped like an unused slot
    o = torch.randn(rows, H, device="cuda").bfloat16()
    w = torch.rand(T, K, device="cuda") if weighted else None
    y = combine_rows(o, slot_to_row, w, K)
    return _finite(y)


def k_swiglu(P, I, clamp):
    fwd, bwd = _wrapper("swiglu_forward"), _wrapper("swiglu_backward")
    h = torch.randn(P, 2 * I, device="cuda").bfloat16()
    act = fwd(h, clamp)
    da = torch.randn(P, I, device="cuda").bfloat16()
    row_weight = torch.rand(P, device="cuda")
    return _finite(act, *bwd(h, da, row_weight, clamp))


def _gemm_meta(T, E, K, empty_expert=True):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, E, (T, K), generator=g)
    if empty_expert:
        idx[idx == E - 1] = -1
    align = getattr(_jit(), "GROUP_ALIGNMENT", None) or dge.TOKEN_GROUP_ALIGNMENT
    return compute_routing_torch(idx.cuda(), E, align)


def k_gemm_nt(H, N):
    fn = _wrapper("m_grouped_bf16_gemm_nt_contiguous")
    meta = _gemm_meta(77, 4, 3)
    a = torch.randn(meta.num_pool_rows, H, device="cuda").bfloat16()
    b = torch.randn(4, N, H, device="cuda").bfloat16()
    fn(a, b, meta.starts, meta.ends)
    torch.cuda.synchronize()


def k_gemm_nt_gather(H, N):
    """The gathering prologue, with a slot past the tokens and ends past the pool (zero rows)."""
    jk = _jit()
    fn = _wrapper("m_grouped_bf16_gemm_nt_contiguous")
    T, K = 77, 3
    meta = _gemm_meta(T, 4, K)
    row_to_slot = meta.row_to_slot.clone()
    row_to_slot[0] = T * K + 5
    ends = meta.ends.clone()
    ends[-1] = meta.num_pool_rows + 128
    x = torch.randn(T, H, device="cuda").bfloat16()
    b = torch.randn(4, N, H, device="cuda").bfloat16()
    fn(x, b, meta.starts, ends, gather=jk.Gather(row_to_slot, K))
    torch.cuda.synchronize()


def k_gemm_nn(H, N):
    fn = _wrapper("m_grouped_bf16_gemm_nn_contiguous")
    meta = _gemm_meta(77, 4, 3)
    a = torch.randn(meta.num_pool_rows, H, device="cuda").bfloat16()
    b = torch.randn(4, H, N, device="cuda").bfloat16()
    fn(a, b, meta.starts, meta.ends)
    torch.cuda.synchronize()


def k_gemm_wgrad(M, N):
    fn = _wrapper("k_grouped_bf16_gemm_tn_contiguous")
    meta = _gemm_meta(77, 4, 3)
    a = torch.randn(meta.num_pool_rows, M, device="cuda").bfloat16()
    b = torch.randn(meta.num_pool_rows, N, device="cuda").bfloat16()
    out = fn(a, b, meta.starts, meta.ends)
    # initcheck does not see TMA bulk stores as writes (see tma_store_probe): a host-side read of
    # this output would be reported there although every element is written (NaN-poison tests).
    return "" if INITCHECK else _finite(out)


def tma_store_probe():
    """A GEMM output that TMA stores cover completely (no padding rows, no empty expert), then read
    by a torch kernel. Under initcheck this shows whether the tool tracks TMA bulk stores."""
    fn = _wrapper("m_grouped_bf16_gemm_nt_contiguous")
    E, rows = 2, 256
    starts = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    ends = torch.tensor([128, 256], dtype=torch.int32, device="cuda")
    a = torch.randn(rows, 128, device="cuda").bfloat16()
    b = torch.randn(E, 128, 128, device="cuda").bfloat16()
    out = torch.empty(rows, 128, device="cuda", dtype=torch.bfloat16)
    fn(a, b, starts, ends, out)
    want = torch.cat([a[:128].float() @ b[0].float().T, a[128:].float() @ b[1].float().T])
    err = (out.float() - want).abs().max().item()
    if not err < 1.0:
        raise RuntimeError(f"probe GEMM wrong: max abs err {err}")
    return f"max abs err {err:.3g}"


def run_kernel_cases():
    routings = [(0, 4, 8, 16, torch.int64, False), (1, 4, 8, 128, torch.int32, False),
                (300, 8, 64, 16, torch.int64, True), (300, 8, 1, 128, torch.int32, True),
                (40, 2, 4096, 16, torch.int64, False), (5000, 8, 16, 128, torch.int64, True)]
    for T, K, E, align, idx_dtype, bad in routings:
        record(f"routing_metadata T={T} K={K} E={E} align={align} {str(idx_dtype)[6:]} bad_ids={bad}",
               lambda: k_routing(T, K, E, align, idx_dtype, bad))
    for T, H, K, dtype, bad in [(0, 8, 2, torch.bfloat16, False), (1, 72, 4, torch.bfloat16, True),
                                (77, 128, 3, torch.bfloat16, True), (77, 32, 3, torch.float8_e4m3fn, True)]:
        record(f"gather_rows T={T} H={H} K={K} {str(dtype)[6:]} bad_rows={bad}", lambda: k_gather(T, H, K, dtype, bad))
    for T, H, K, weighted, bad in [(1, 8, 1, True, False), (77, 72, 5, True, True), (77, 128, 32, False, True),
                                   (0, 8, 2, True, False)]:
        record(f"combine_rows T={T} H={H} K={K} weighted={weighted} bad_rows={bad}",
               lambda: k_combine(T, H, K, weighted, bad))
    for P, I, clamp in [(0, 8, None), (1, 8, 0.5), (37, 24, None), (37, 40, 0.5), (300, 128, None)]:
        record(f"swiglu fwd+bwd P={P} I={I} clamp={clamp}", lambda: k_swiglu(P, I, clamp))
    for H, N in [(128, 128), (128, 256), (256, 384)]:
        record(f"m_grouped nt H={H} N={N}", lambda: k_gemm_nt(H, N))
        record(f"m_grouped nt gather H={H} N={N}", lambda: k_gemm_nt_gather(H, N))
        record(f"m_grouped nn K={H} N={N}", lambda: k_gemm_nn(H, N))
        record(f"k_grouped tn M={N} N={H}", lambda: k_gemm_wgrad(N, H))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "layer", "kernels", "tma-store-probe"), default="all")
    parser.add_argument("--initcheck", action="store_true",
                        help="no host-side reads of TMA-stored GEMM outputs (initcheck does not track TMA stores)")
    args = parser.parse_args()
    global INITCHECK
    INITCHECK = args.initcheck
    if not torch.cuda.is_available():
        print("sanitize_driver: no CUDA device", file=sys.stderr)
        return 2
    if args.part == "tma-store-probe":
        record("tma store probe: torch reads a fully TMA-stored GEMM output", tma_store_probe)
        return 1 if RESULTS[-1][1] == "ERROR" else 0
    if args.part in ("all", "kernels"):
        run_kernel_cases()
    if args.part in ("all", "layer"):
        run_layer_cases()
    torch.cuda.synchronize()
    counts = {s: sum(1 for _, status, _ in RESULTS if status == s) for s in ("ok", "skipped", "ERROR")}
    print(f"sanitize_driver: {len(RESULTS)} cases: {counts['ok']} ok, {counts['skipped']} skipped, "
          f"{counts['ERROR']} raised")
    return 1 if counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
