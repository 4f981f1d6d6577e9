"""Helpers for GPU tests: fp64 reference gradients, one layer call with its gradients, grouped-GEMM
references and checks, the pools and seeds of the GEMM variant tests, and where cuobjdump is."""
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace

import torch

from deep_gemm_ext.reference import reference_forward
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_routing


def reference_grads(x, idx, w, l1, l2, clamp, dy):
    """fp64 reference y and (dx, dtopk_w, dl1, dl2) on upcast inputs."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, l1, l2)]
    y = reference_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], clamp)
    if not y.requires_grad:  # every slot unused
        return y.detach(), tuple(torch.zeros_like(t) for t in leaves)
    return y.detach(), torch.autograd.grad(y, leaves, dy.double())


def run_layer(fn, x, idx, w, l1, l2, clamp, dy):
    y = fn(x, idx, w, l1, l2, clamp)
    grads = torch.autograd.grad(y, (x, w, l1, l2), dy)
    return y.detach(), grads


def m_grouped_reference(a: torch.Tensor, w_of, starts, ends, n: int) -> torch.Tensor:
    """fp64 rows [s, t) of expert e = a[s:t] @ w_of(e), NaN on the rows no expert owns."""
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.float64, device=a.device)
    for e, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
        if t > s:
            out[s:t] = a[s:t].double() @ w_of(e).double()
    return out


def assert_close_where_owned(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-2) -> None:
    """NaN rows of ref (no expert) must be NaN in got (left unwritten), the others written and within tol."""
    unwritten = torch.isnan(ref)
    assert torch.isnan(got[unwritten].float()).all(), f"{what}: rows no expert owns were written"
    g, r = got[~unwritten].double(), ref[~unwritten]
    assert not torch.isnan(g).any(), f"{what}: elements left unwritten"
    if r.numel():
        err = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < tol, f"{what}: rel error {err:.2e}"


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, in /usr/local/cuda/bin, or from the nvidia-cuda-cuobjdump wheel; None without one."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel
        for root in nvidia.__path__:
            for candidate in sorted(Path(root).glob("*/bin/cuobjdump")):
                return str(candidate)
    except ImportError:
        pass
    return "/usr/local/cuda/bin/cuobjdump" if shutil.which("/usr/local/cuda/bin/cuobjdump") else None


def case_seed(*key) -> int:
    """A seed per test case, the same in every process (printed in the failure messages)."""
    return zlib.crc32(repr(key).encode()) % 10_000


def nan_bf16(*shape) -> torch.Tensor:
    """A NaN-poisoned bf16 output on the GPU."""
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def assert_same_bits(base: torch.Tensor, other: torch.Tensor, what: str, differs: str) -> None:
    """``other`` equal to ``base`` bit for bit; ``differs`` names the two in the message (e.g. "cluster 2
    differs from cluster 1")."""
    torch.cuda.synchronize()

    def bits(t):
        return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)

    diff = (bits(base) != bits(other)).nonzero()
    assert diff.numel() == 0, f"{what}: {differs} at {diff.shape[0]} elements, first {diff[:4].tolist()}"


def ragged_pool():
    """starts / ends of six experts on the GPU and the pool's rows: ragged expert sizes, expert 2 empty, one
    pool block past ends[-1]."""
    starts = torch.tensor([0, 256, 640, 768, 1152, 1280], dtype=torch.int32)
    ends = torch.tensor([256, 640, 640, 1152, 1280, 1408], dtype=torch.int32)
    return starts.cuda(), ends.cuda(), 1408 + 128


def routed_pool(num_tokens: int, num_experts: int, top_k: int, routing: str, seed: int):
    """starts / ends and the pool's rows of a routing of kind ``routing`` (testing.make_routing)."""
    from deep_gemm_ext.jit_kernels.sm90_bf16_grouped_gemm import GROUP_ALIGNMENT

    g = torch.Generator().manual_seed(seed)
    idx = make_routing(num_tokens, num_experts, top_k, routing, generator=g).cuda()
    meta = compute_routing_torch(idx, num_experts, GROUP_ALIGNMENT)
    return meta.starts, meta.ends, meta.num_pool_rows


def m_grouped_case(kind: str, tokens: int, n: int, k: int, layout: str, pool) -> SimpleNamespace:
    """Random operands of one M-grouped bf16 GEMM test case (the seed from the case's key): the pool
    ``pool(kind, tokens, seed)`` -> (starts, ends, rows), a [rows, K], the weight b ([E, N, K] for "nt",
    [E, K, N] for "nn", K rounded up to whole 64-deep k-blocks there), the launcher ``fn``, ``w_of(e)`` for
    m_grouped_reference, and ``what`` for the messages."""
    from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg

    seed = case_seed(kind, tokens, n, k, layout)
    starts, ends, rows = pool(kind, tokens, seed)
    if layout == "nn" and k % 64:
        k += 64 - k % 64  # [E, K, N] weights are read in whole 64-deep k-blocks
    g = torch.Generator().manual_seed(seed)
    num_experts = starts.shape[0]
    a = torch.randn(rows, k, generator=g).cuda().to(torch.bfloat16)
    shape = (num_experts, n, k) if layout == "nt" else (num_experts, k, n)
    b = (torch.randn(*shape, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
    fn = gg.m_grouped_bf16_gemm_nt_contiguous if layout == "nt" else gg.m_grouped_bf16_gemm_nn_contiguous
    w_of = (lambda e: b[e].T) if layout == "nt" else (lambda e: b[e])
    return SimpleNamespace(a=a, b=b, starts=starts, ends=ends, rows=rows, n=n, fn=fn, w_of=w_of,
                           what=f"{layout} {kind} T={tokens} N={n} K={k} seed={seed}")


def scatter_case(kind: str, tokens: int, n: int, k: int, layout: str, weighted: bool, seed: int,
                 num_experts: int = 16, top_k: int = 4) -> SimpleNamespace:
    """Random operands of one combine-epilogue test case (routing ``kind`` of ``tokens`` tokens): the routing
    ``meta``, a [rows, K], the weight b, the top-k weights (or None), the launcher ``fn``, its ``scatter``,
    the slot count, and ``reference()``: the fp64 slot-order output (NaN where no row writes)."""
    from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg

    g = torch.Generator().manual_seed(seed)
    idx = make_routing(tokens, num_experts, top_k, kind, generator=g).cuda()
    meta = compute_routing_torch(idx, num_experts, gg.GROUP_ALIGNMENT)
    rows, slots = meta.num_pool_rows, tokens * top_k
    a = torch.randn(rows, k, generator=g).cuda().to(torch.bfloat16)
    shape = (num_experts, n, k) if layout == "nt" else (num_experts, k, n)
    b = (torch.randn(*shape, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
    weights = torch.rand(tokens, top_k, generator=g).cuda() if weighted else None
    fn = gg.m_grouped_bf16_gemm_nt_contiguous if layout == "nt" else gg.m_grouped_bf16_gemm_nn_contiguous
    w_of = (lambda e: b[e].T) if layout == "nt" else (lambda e: b[e])

    def reference() -> torch.Tensor:
        live = meta.slot_to_row >= 0
        ref = torch.full((slots, n), float("nan"), dtype=torch.float64, device="cuda")
        pool_ref = m_grouped_reference(a, w_of, meta.starts, meta.ends, n)
        ref[live] = pool_ref[meta.slot_to_row[live].long()] * (
            weights.reshape(-1)[live].double()[:, None] if weighted else 1.0)
        return ref

    return SimpleNamespace(meta=meta, a=a, b=b, weights=weights, fn=fn, rows=rows, slots=slots,
                           scatter=gg.Scatter(meta.row_to_slot, slots, weights), reference=reference)


def k_grouped_reference(a: torch.Tensor, b: torch.Tensor, starts, ends) -> torch.Tensor:
    """fp64 out[e] = a[s:t].T @ b[s:t] over each expert's pool rows [s, t) (zeros without rows)."""
    ref = torch.zeros(starts.shape[0], a.shape[1], b.shape[1], dtype=torch.float64, device=a.device)
    for e, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
        ref[e] = a[s:t].double().T @ b[s:t].double()
    return ref


def k_grouped_case(kind: str, tokens: int, m: int, n: int) -> SimpleNamespace:
    """Random pools of one K-grouped bf16 GEMM test case (16 experts, top-4 routing ``kind``; the seed from
    the case's key): starts / ends, a [rows, M], b [rows, N], and ``what`` for the messages."""
    seed = case_seed(kind, tokens, m, n)
    starts, ends, rows = routed_pool(tokens, 16, 4, kind, seed)
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, m, generator=g).cuda().to(torch.bfloat16)
    b = torch.randn(rows, n, generator=g).cuda().to(torch.bfloat16)
    return SimpleNamespace(starts=starts, ends=ends, a=a, b=b, what=f"tn {kind} T={tokens} M={m} N={n} seed={seed}")


def gather_case(seed: int, n: int, k: int, tokens: int = 600, experts: int = 16, top_k: int = 4) -> SimpleNamespace:
    """Random operands of one gathering L1-forward test case (zipf routing): the routing ``meta``, the tokens
    x [T, K], the weight b [E, N, K], the pool of x's rows that the GEMM gathers (zero padding rows) and its
    rows."""
    from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg

    g = torch.Generator().manual_seed(seed)
    idx = make_routing(tokens, experts, top_k, "zipf", generator=g).cuda()
    meta = compute_routing_torch(idx, experts, gg.GROUP_ALIGNMENT)
    rows = meta.num_pool_rows
    x = torch.randn(tokens, k, generator=g).cuda().to(torch.bfloat16)
    b = (torch.randn(experts, n, k, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
    pool = torch.zeros(rows, k, dtype=torch.bfloat16, device="cuda")
    live = meta.row_to_slot >= 0
    pool[live] = x[meta.row_to_slot[live].long() // top_k]
    return SimpleNamespace(meta=meta, x=x, b=b, pool=pool, rows=rows, top_k=top_k)
