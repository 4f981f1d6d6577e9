"""What a user gets for every bad input, and for the unusual inputs that are not errors.

README.md (Bad inputs) mirrors the two lists below: ``ERRORS`` (the exception type and exact message)
and ``ACCEPTED`` (the test that pins the behaviour). ``test_doc_matches_behaviour`` parses the doc
and fails when a row, an exception type or a message drifts; ``python tests/test_bad_inputs.py``
prints the error table as the code behaves today, to paste into the doc.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # run as a script to print the doc's table: import from this checkout
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import pytest  # noqa: E402
import torch  # noqa: E402

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.reference import reference_forward  # noqa: E402
from deep_gemm_ext.routing import compute_routing_torch, pool_rows  # noqa: E402
from deep_gemm_ext.testing import make_inputs, rel_err  # noqa: E402

from conftest import requires_cuda  # noqa: E402
from fuzz_utils import NONFINITE_SCENARIOS, check_nonfinite  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "README.md"
REPO = Path(__file__).resolve().parents[1]

T, H, I, E, K = 8, 16, 8, 4, 2


def base_args(device="cpu", dtype=None) -> dict:
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, requires_grad=False, seed=0, device=device,
                                    **({} if dtype is None else {"dtype": dtype}))
    return dict(x=x, topk_idx=idx, topk_weights=w, l1_weights=l1, l2_weights=l2)


def call(args: dict, **kwargs):
    return dge.mega_moe_train(args["x"], args["topk_idx"], args["topk_weights"], args["l1_weights"],
                              args["l2_weights"], **kwargs)


def strided(shape, dtype, device="cpu"):
    """A non-contiguous tensor of ``shape``: every other element of the last dim of a wider buffer."""
    *lead, last = shape
    return torch.zeros(*lead, 2 * last, dtype=dtype, device=device)[..., ::2]


@dataclass(frozen=True)
class BadInput:
    id: str
    what: str  # the bad input, in words (the doc's second column)
    run: Callable[[dict], object]  # given base_args(), makes the call that must raise
    exc: type
    gpu: bool = False  # only reachable on a CUDA device
    message: str | None = None  # a GPU row's message, where it can be known without a GPU
    prefix: bool = False  # the message goes on with details of the machine; the doc holds its start


def _with(**over):
    def run(a):
        return call({**a, **{k: v(a) if callable(v) else v for k, v in over.items()}})
    return run


def _kw(**kwargs):
    return lambda a: call(a, **kwargs)


ERRORS = [
    BadInput("x-not-a-tensor", "x is a list", _with(x=[[1.0]]), TypeError),
    BadInput("x-dtype", "x is float16", _with(x=lambda a: a["x"].half()), TypeError),
    BadInput("x-dtype-gpu", "x is float32 on a GPU (the GPU path is bf16 only)",
             _with(x=lambda a: a["x"].float(), l1_weights=lambda a: a["l1_weights"].float(),
                   l2_weights=lambda a: a["l2_weights"].float()), TypeError, gpu=True,
             message="x has dtype torch.float32; expected one of (torch.bfloat16,) on cuda"),
    BadInput("x-rank", "x is 3-D", _with(x=lambda a: a["x"][None]), ValueError),
    BadInput("x-tokens", "x has fewer rows than topk_idx", _with(x=lambda a: a["x"][:5]), ValueError),
    BadInput("x-hidden", "x's hidden size differs from the weights'", _with(x=lambda a: a["x"][:, :8]), ValueError),
    BadInput("x-noncontiguous", "x is a transposed view", _with(x=lambda a: a["x"].t().contiguous().t()), ValueError),
    BadInput("hidden-zero", "hidden size 0",
             _with(x=lambda a: a["x"][:, :0], l1_weights=lambda a: a["l1_weights"][:, :, :0].contiguous(),
                   l2_weights=lambda a: a["l2_weights"][:, :0].contiguous()), ValueError),
    BadInput("topk-idx-dtype", "topk_idx is float32", _with(topk_idx=lambda a: a["topk_idx"].float()), TypeError),
    BadInput("topk-idx-rank", "topk_idx is 1-D", _with(topk_idx=lambda a: a["topk_idx"][:, 0]), ValueError),
    BadInput("topk-idx-noncontiguous", "topk_idx is a transposed view",
             _with(topk_idx=lambda a: a["topk_idx"].t().contiguous().t()), ValueError),
    BadInput("top-k-zero", "topk_idx and topk_weights have no columns",
             _with(topk_idx=lambda a: a["topk_idx"][:, :0], topk_weights=lambda a: a["topk_weights"][:, :0]),
             ValueError),
    BadInput("expert-id-too-large", "an expert id >= E",
             _with(topk_idx=lambda a: torch.full((T, K), E, device=a["x"].device)), ValueError),
    BadInput("expert-id-below-minus-one", "an expert id < -1",
             _with(topk_idx=lambda a: torch.full((T, K), -2, device=a["x"].device)), ValueError),
    BadInput("topk-weights-dtype", "topk_weights is bf16",
             _with(topk_weights=lambda a: a["topk_weights"].bfloat16()), TypeError),
    BadInput("topk-weights-shape", "topk_weights has fewer columns than topk_idx",
             _with(topk_weights=lambda a: a["topk_weights"][:, :1].contiguous()), ValueError),
    BadInput("topk-weights-noncontiguous", "topk_weights is a strided view",
             _with(topk_weights=lambda a: strided((T, K), torch.float32, a["x"].device)), ValueError),
    BadInput("l1-dtype", "l1_weights is float32 while x is bf16",
             _with(l1_weights=lambda a: a["l1_weights"].float()), TypeError),
    BadInput("l1-rank", "l1_weights is 2-D", _with(l1_weights=lambda a: a["l1_weights"][0]), ValueError),
    BadInput("l1-odd-rows", "l1_weights has an odd number of rows (not [gate; up])",
             _with(l1_weights=lambda a: a["l1_weights"][:, :15].contiguous()), ValueError),
    BadInput("l1-gate-only", "l1_weights is [E, I, H] (the gate rows only, not [gate; up])",
             _with(l1_weights=lambda a: a["l1_weights"][:, :I].contiguous()), ValueError),
    BadInput("l1-no-experts", "zero experts",
             _with(l1_weights=lambda a: a["l1_weights"][:0], l2_weights=lambda a: a["l2_weights"][:0]), ValueError),
    BadInput("l1-noncontiguous", "l1_weights is a strided view",
             _with(l1_weights=lambda a: strided((E, 2 * I, H), torch.bfloat16, a["x"].device)), ValueError),
    BadInput("l2-dtype", "l2_weights is float32 while x is bf16",
             _with(l2_weights=lambda a: a["l2_weights"].float()), TypeError),
    BadInput("l2-transposed", "l2_weights is [E, I, H] instead of [E, H, I]",
             _with(l2_weights=lambda a: a["l2_weights"].transpose(1, 2).contiguous()), ValueError),
    BadInput("l2-experts", "l2_weights has fewer experts than l1_weights",
             _with(l2_weights=lambda a: a["l2_weights"][:3]), ValueError),
    BadInput("l2-noncontiguous", "l2_weights is a strided view",
             _with(l2_weights=lambda a: strided((E, H, I), torch.bfloat16, a["x"].device)), ValueError),
    BadInput("device-mixed", "topk_idx on another device than x",
             _with(topk_idx=torch.empty(T, K, dtype=torch.int64, device="meta")), ValueError),
    BadInput("device-mixed-gpu", "x on the GPU, topk_idx on the CPU",
             _with(topk_idx=lambda a: a["topk_idx"].cpu()), ValueError, gpu=True,
             message="topk_idx is on cpu but x is on cuda:0; all inputs must share one device"),
    BadInput("hidden-not-multiple-of-8", "hidden = 20 on the GPU",
             _with(x=lambda a: torch.randn(T, 20, device=a["x"].device).bfloat16(),
                   l1_weights=lambda a: torch.randn(E, 2 * I, 20, device=a["x"].device).bfloat16(),
                   l2_weights=lambda a: torch.randn(E, 20, I, device=a["x"].device).bfloat16()),
             ValueError, gpu=True, message=dge.unsupported_shape_reason(20, I, device_type="cuda")),
    BadInput("intermediate-not-multiple-of-8", "intermediate = 12 on the GPU",
             _with(l1_weights=lambda a: torch.randn(E, 24, H, device=a["x"].device).bfloat16(),
                   l2_weights=lambda a: torch.randn(E, H, 12, device=a["x"].device).bfloat16()),
             ValueError, gpu=True, message=dge.unsupported_shape_reason(H, 12, device_type="cuda")),
    BadInput("recipe-unsupported", "recipe='mxfp8'", _kw(recipe="mxfp8"), ValueError),
    BadInput("recipe-fp8-shape", "recipe='fp8' with hidden = 16", _kw(recipe="fp8"), ValueError),
    BadInput("backend-unsupported", "backend='cutlass'", _kw(backend="cutlass"), ValueError),
    BadInput("backend-deep-gemm-cpu", "backend='deep_gemm' with CPU tensors", _kw(backend="deep_gemm"), ValueError),
    BadInput("backend-deep-gemm-missing", "backend='deep_gemm' on a GPU where DeepGEMM is not installed",
             _kw(backend="deep_gemm"), RuntimeError, gpu=True, message="DeepGEMM is not importable in this process (",
             prefix=True),
    BadInput("clamp-negative", "activation_clamp=-1.0", _kw(activation_clamp=-1.0), ValueError),
    BadInput("clamp-zero", "activation_clamp=0.0", _kw(activation_clamp=0.0), ValueError),
    BadInput("clamp-nan", "activation_clamp=nan", _kw(activation_clamp=math.nan), ValueError),
    BadInput("clamp-inf", "activation_clamp=inf", _kw(activation_clamp=math.inf), ValueError),
    BadInput("clamp-type", "activation_clamp='7' (a string)", _kw(activation_clamp="7"), TypeError),
    BadInput("clamp-bool", "activation_clamp=True", _kw(activation_clamp=True), TypeError),
    BadInput("group-not-a-group", "group=object() (no size())", _kw(group=object()), TypeError),
]
ERROR_IDS = [e.id for e in ERRORS]


def raised(bad: BadInput, device="cpu") -> BaseException:
    with pytest.raises(bad.exc) as info:
        bad.run(base_args(device))
    return info.value


# ---------------------------------------------------------------------------------------------
# The doc: | `id` | what | `Exception` | `message` | rows, in two tables.

_ROW_RE = re.compile(r"^\|\s*`([a-z0-9-]+)`\s*\|(.*)\|\s*$")


def doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = _ROW_RE.match(line)
        if m:
            assert m.group(1) not in rows, f"README.md (Bad inputs): row `{m.group(1)}` appears twice"
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def _unquote(cell: str) -> str:
    return cell[1:-1] if cell.startswith("`") and cell.endswith("`") else cell


def render_error_row(bad: BadInput, message: str) -> str:
    return f"| `{bad.id}` | {bad.what} | `{bad.exc.__name__}` | `{message}` |"


def expected_message(bad: BadInput) -> str:
    """What the doc records: the raised message on CPU, the known message of a GPU row."""
    return bad.message if bad.gpu else str(raised(bad))


def _doc_message(bad: BadInput, message: str) -> str:
    return message + "…" if bad.prefix else message


def test_doc_matches_behaviour():
    rows = doc_rows()
    documented = set(rows)
    expected = set(ERROR_IDS) | set(ACCEPTED)
    assert documented == expected, (f"README.md (Bad inputs) rows without a test: {sorted(documented - expected)}; "
                                    f"tests without a row: {sorted(expected - documented)}")
    for bad in ERRORS:
        cells = rows[bad.id]
        assert _unquote(cells[1]) == bad.exc.__name__, (bad.id, cells[1])
        message = _doc_message(bad, expected_message(bad))
        assert _unquote(cells[2]) == message, f"{bad.id}: doc says {cells[2]!r}, the code says {message!r}"
    for row_id, test in ACCEPTED.items():
        assert f"`{test}`" in rows[row_id][-1], f"{row_id}: the doc row must name its test `{test}`"
        assert callable(globals().get(test)), f"{row_id}: no test function {test}"


@pytest.mark.parametrize("bad", [e for e in ERRORS if not e.gpu], ids=lambda e: e.id)
def test_error(bad):
    err = raised(bad)
    assert str(err), bad.id


@requires_cuda
# backend-deep-gemm-cpu is about CPU tensors: on CUDA tensors it is the backend-deep-gemm-missing row.
@pytest.mark.parametrize("bad", [e for e in ERRORS if e.id != "backend-deep-gemm-cpu"], ids=lambda e: e.id)
def test_error_on_gpu(bad, monkeypatch):
    # The host check of expert ids is opt-in on the GPU (by default a device-side assertion does it).
    monkeypatch.setenv("DGE_CHECK_IDS", "1")
    if bad.id == "backend-deep-gemm-missing":
        from deep_gemm_ext.providers import deepgemm
        if deepgemm.is_available():
            pytest.skip("DeepGEMM is installed here")
    err = raised(bad, "cuda")
    if bad.gpu:
        assert str(err).startswith(bad.message) if bad.prefix else str(err) == bad.message, str(err)


# ---------------------------------------------------------------------------------------------
# Unusual inputs that are not errors. Each doc row names the test that pins its behaviour.


def _run(x, idx, w, l1, l2, clamp=None, dy=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, l1, l2)]
    y = dge.mega_moe_train(leaves[0], idx, leaves[1], leaves[2], leaves[3], activation_clamp=clamp)
    dy = torch.randn_like(y) if dy is None else dy
    grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return y.detach(), [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)], dy


def _reference(x, idx, w, l1, l2, dy, clamp=None):
    leaves = [t.detach().double().requires_grad_() for t in (x, w, l1, l2)]
    y = reference_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], clamp)
    if not y.requires_grad:
        return y, [torch.zeros_like(t) for t in leaves]
    return y.detach(), torch.autograd.grad(y, leaves, dy.double())


def _assert_matches_reference(x, idx, w, l1, l2, clamp=None, tol=1e-5):
    y, grads, dy = _run(x, idx, w, l1, l2, clamp)
    y_ref, g_ref = _reference(x, idx, w, l1, l2, dy, clamp)
    for name, out, ref in zip(("y", "dx", "dtopk_w", "dl1", "dl2"), (y, *grads), (y_ref, *g_ref)):
        assert out.shape == ref.shape, name
        assert rel_err(out, ref) <= tol if ref.norm() > 0 else float(out.abs().sum()) == 0, name


def test_zero_tokens():
    x, idx, w, l1, l2 = make_inputs(0, H, I, E, K, dtype=torch.float32, requires_grad=False)
    y, grads, _ = _run(x, idx, w, l1, l2)
    assert y.shape == (0, H)
    assert all(float(g.abs().sum()) == 0 for g in grads)


def test_unused_slots_contribute_nothing():
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing="unused_slots", dtype=torch.float32,
                                    requires_grad=False, seed=3)
    idx[0] = -1  # one token with no expert at all: y = 0 and dx = 0 there
    w[idx < 0] = math.nan  # weights of unused slots are never read
    y, grads, _ = _run(x, idx, w, l1, l2)
    assert y[0].abs().max() == 0 and grads[0][0].abs().max() == 0
    assert all(bool(t.isfinite().all()) for t in (y, *grads))
    assert bool((grads[1][idx < 0] == 0).all())
    w = torch.where(idx < 0, 0.0, w)
    _assert_matches_reference(x, idx, w, l1, l2)


def test_duplicate_experts_in_a_token():
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, dtype=torch.float32, requires_grad=False, seed=4)
    idx[:, 1] = idx[:, 0]  # each token sends both slots to one expert: the two contributions add up
    _assert_matches_reference(x, idx, w, l1, l2)


def test_top_k_larger_than_experts():
    x, idx, w, l1, l2 = make_inputs(T, H, I, 2, 5, dtype=torch.float32, requires_grad=False, seed=5)
    assert bool((idx == -1).any())
    _assert_matches_reference(x, idx, w, l1, l2)


def test_int32_expert_ids():
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing="unused_slots", dtype=torch.float32,
                                    requires_grad=False, seed=6)
    y64, _, _ = _run(x, idx, w, l1, l2)
    y32, _, _ = _run(x, idx.int(), w, l1, l2)
    assert torch.equal(y64, y32)


def test_group_of_one_rank(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        a = base_args()
        assert torch.equal(call(a, group=dist.group.WORLD), call(a))
    finally:
        dist.destroy_process_group()


def test_unchecked_ids_are_unused_slots(monkeypatch):
    """DGE_CHECK_IDS=0 skips the host check; on CPU such ids then act as unused slots, as the
    routing's second line of defence treats them (on a GPU a device-side assertion fires instead)."""
    monkeypatch.setenv("DGE_CHECK_IDS", "0")
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, dtype=torch.float32, requires_grad=False, seed=7)
    bad = idx.clone()
    bad[1, 0], bad[2, 1] = E + 3, -5
    y_bad = dge.mega_moe_train(x, bad, w, l1, l2)
    y_unused = dge.mega_moe_train(x, torch.where((bad >= E) | (bad < -1), -1, bad), w, l1, l2)
    assert torch.equal(y_bad, y_unused)


def test_views_at_storage_offsets():
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, dtype=torch.float32, requires_grad=False, seed=8)
    big = torch.zeros(3 * l1.numel(), dtype=l1.dtype)
    l1_view = big[l1.numel():2 * l1.numel()].view(l1.shape).copy_(l1)  # contiguous, offset storage
    assert l1_view.storage_offset() > 0
    assert torch.equal(dge.mega_moe_train(x, idx, w, l1_view, l2), dge.mega_moe_train(x, idx, w, l1, l2))


def test_noncontiguous_grad_output():
    """y.sum().backward() hands the backward an expanded (stride 0) gradient."""
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, dtype=torch.float32, seed=9)
    dge.mega_moe_train(x, idx, w, l1, l2).sum().backward()
    grads = [t.grad.clone() for t in (x, w, l1, l2)]
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, l1, l2)]
    y = dge.mega_moe_train(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    again = torch.autograd.grad(y, leaves, torch.ones_like(y))
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


# Capacity: the pool has a static size from shapes, so no routing can overflow it.


def _check_pool(idx: torch.Tensor, num_experts: int, align: int) -> int:
    """Every used slot has its own row inside the pool; returns the rows used (incl. padding)."""
    m = compute_routing_torch(idx, num_experts, align)
    rows = pool_rows(idx.numel(), num_experts, align)
    assert m.row_to_slot.shape[0] == rows
    used = int(m.ends[-1])
    assert used <= rows
    real = m.slot_to_row[m.slot_to_row >= 0].long()
    assert real.numel() == int((idx >= 0).sum())
    assert real.unique().numel() == real.numel() and (real.numel() == 0 or int(real.max()) < used)
    assert torch.equal(m.row_to_slot[real].long(), (m.slot_to_row >= 0).nonzero().flatten())
    return used


@pytest.mark.parametrize("align", [1, 8, 16, 128])
def test_pool_capacity_worst_cases(align):
    """pool_rows = T*K + E*(align-1) bounds sum_e round_up(count_e, align) for any counts."""
    num_tokens, top_k, num_experts = 300, 8, 16
    for e in (0, 7, num_experts - 1):  # every slot of every token on one expert
        flood = torch.full((num_tokens, top_k), e)
        assert _check_pool(flood, num_experts, align) == -(-num_tokens * top_k // align) * align
    # Every expert non-empty with count = 1 (mod align): each wastes align - 1 rows, the bound is met.
    per_expert = 1 + align * ((num_tokens * top_k // num_experts - 1) // align)
    ids = torch.arange(num_experts).repeat_interleave(per_expert)
    ids = torch.cat([ids, torch.full((num_tokens * top_k - ids.numel(),), -1)]).view(num_tokens, top_k)
    assert _check_pool(ids, num_experts, align) == pool_rows(int((ids >= 0).sum()), num_experts, align)
    g = torch.Generator().manual_seed(align)
    for _ in range(50):
        counts_hint = torch.randint(1, 50, (num_experts,), generator=g).double()
        ids = torch.multinomial(counts_hint, num_tokens * top_k, replacement=True, generator=g)
        ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
        _check_pool(ids.view(num_tokens, top_k), num_experts, align)


def test_pool_capacity_through_the_layer():
    x, idx, w, l1, l2 = make_inputs(40, H, I, E, 6, dtype=torch.float32, requires_grad=False, seed=10)
    _assert_matches_reference(x, torch.full_like(idx, E - 1), w, l1, l2)


# Non-finite values propagate exactly as in the reference: nothing masks them, nothing raises.


@pytest.mark.parametrize("clamp", [None, 50.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", NONFINITE_SCENARIOS)
def test_nonfinite_inputs_propagate_like_the_reference(scenario, dtype, clamp):
    problems = check_nonfinite(scenario, "cpu", dtype=dtype, clamp=clamp, shape=(37, 24, 16, 6, 3))
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# GPU-only behaviour that must not take the process down: run in a child process.


def _child(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    import os
    prog = "import sys, torch\nsys.path.insert(0, %r)\n" % str(REPO) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


_GPU_ARGS = """
import deep_gemm_ext as dge
from deep_gemm_ext.testing import make_inputs
x, idx, w, l1, l2 = make_inputs(64, 128, 64, 8, 4, device="cuda", seed=0, requires_grad=False)
"""


@requires_cuda
@pytest.mark.parametrize("check_ids", ["", "0"], ids=["default", "off"])
def test_gpu_unchecked_out_of_range_id_asserts_on_device(check_ids):
    """By default on a GPU, with DGE_CHECK_IDS=0, or inside CUDA graph capture: a bad id trips a
    device-side assertion (no host sync)."""
    r = _child(_GPU_ARGS + """
idx[3, 1] = 8
dge.mega_moe_train(x, idx, w, l1, l2)
torch.cuda.synchronize()
print("NO ERROR")
""", env={"DGE_CHECK_IDS": check_ids})
    assert "NO ERROR" not in r.stdout, "an out-of-range id went through without any error"
    assert "device-side assert" in r.stderr or "topk_idx holds ids outside" in r.stderr, r.stderr[-2000:]


@requires_cuda
def test_gpu_device_side_id_check_names_the_slot():
    """The routing kernel's check (the default on a GPU) prints which flattened slot holds which id."""
    r = _child(_GPU_ARGS + """
idx[5, 2] = -7
dge.mega_moe_train(x, idx, w, l1, l2)
torch.cuda.synchronize()
print("NO ERROR")
""", env={"DGE_CHECK_IDS": ""})
    assert "NO ERROR" not in r.stdout, "an out-of-range id went through without any error"
    assert "topk_idx holds ids outside [-1, 8): topk_idx.view(-1)[22] = -7" in r.stdout + r.stderr, \
        (r.stdout[-2000:], r.stderr[-2000:])


@requires_cuda
@pytest.mark.parametrize("launches", [1, 3])
def test_gpu_routing_kernels_assert_on_bad_ids(launches):
    """Both routing launch modes' device-side check: the flattened slot and its id, then the assertion."""
    r = _child(f"""
from deep_gemm_ext.jit_kernels import routing_metadata
idx = torch.randint(0, 8, (300, 4), device="cuda")
idx[250, 3] = 9
routing_metadata(idx, 8, 128, assert_ids=True, launches={launches})
torch.cuda.synchronize()
print("NO ERROR")
""")
    assert "NO ERROR" not in r.stdout, "an out-of-range id went through without any error"
    assert "topk_idx holds ids outside [-1, 8): topk_idx.view(-1)[1003] = 9" in r.stdout + r.stderr, \
        (r.stdout[-2000:], r.stderr[-2000:])


@requires_cuda
def test_gpu_misaligned_input_fails_cleanly_or_computes():
    """A contiguous view at a 2-byte offset (not 16-byte aligned): the layer must either compute the
    right answer or raise a Python exception that leaves the CUDA context usable; never a sticky
    CUDA error (misaligned address) that kills the process."""
    r = _child(_GPU_ARGS + """
from deep_gemm_ext.reference import reference_forward
buf = torch.empty(x.numel() + 8, dtype=x.dtype, device="cuda")
xm = buf[1:1 + x.numel()].view(x.shape).copy_(x)
assert xm.data_ptr() % 16 and xm.is_contiguous()
try:
    y = dge.mega_moe_train(xm, idx, w, l1, l2)
    torch.cuda.synchronize()
    ref = reference_forward(x.double(), idx, w.double(), l1.double(), l2.double())
    err = float((y.double() - ref).norm() / ref.norm())
    print("COMPUTED", err)
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
torch.ones(4, device="cuda").sum().item()  # the context must still work
print("CONTEXT OK")
""")
    assert "CONTEXT OK" in r.stdout, f"the CUDA context did not survive:\n{r.stdout}\n{r.stderr[-3000:]}"
    if "COMPUTED" in r.stdout:
        assert float(r.stdout.split("COMPUTED")[1].split()[0]) < 2e-2, r.stdout


@requires_cuda
def test_gpu_large_top_k_and_many_experts():
    """At the JIT kernels' limits (top_k = 32, 4096 experts) the layer computes correctly; past them
    it either computes correctly (torch path) or raises a ValueError naming the limit, never a
    launch failure."""
    for T_, E_, K_, limit in ((16, 40, 32, None), (16, 4096, 2, None), (16, 40, 33, "top_k=33"),
                              (16, 4097, 2, "num_experts=4097")):
        x, idx, w, l1, l2 = make_inputs(T_, 8, 8, E_, K_, device="cuda", seed=1, requires_grad=False)
        try:
            y = dge.mega_moe_train(x, idx, w, l1, l2)
        except ValueError as exc:
            assert limit is not None and limit in str(exc), exc
            continue
        ref = reference_forward(x.double(), idx, w.double(), l1.double(), l2.double())
        assert rel_err(y, ref) < 2e-2, (T_, E_, K_)


def render_error_table() -> str:
    lines = []
    for bad in ERRORS:
        lines.append(render_error_row(bad, _doc_message(bad, expected_message(bad))))
    return "\n".join(lines)


#: Doc row id -> the test that pins the behaviour.
ACCEPTED = {
    "tokens-zero": "test_zero_tokens",
    "unused-slots": "test_unused_slots_contribute_nothing",
    "duplicate-experts": "test_duplicate_experts_in_a_token",
    "top-k-above-experts": "test_top_k_larger_than_experts",
    "int32-ids": "test_int32_expert_ids",
    "group-of-one": "test_group_of_one_rank",
    "ids-unchecked": "test_unchecked_ids_are_unused_slots",
    "ids-unchecked-gpu": "test_gpu_unchecked_out_of_range_id_asserts_on_device",
    "storage-offsets": "test_views_at_storage_offsets",
    "misaligned-gpu": "test_gpu_misaligned_input_fails_cleanly_or_computes",
    "grad-noncontiguous": "test_noncontiguous_grad_output",
    "capacity": "test_pool_capacity_worst_cases",
    "jit-limits-gpu": "test_gpu_large_top_k_and_many_experts",
    "nonfinite": "test_nonfinite_inputs_propagate_like_the_reference",
}


if __name__ == "__main__":
    print(render_error_table())
