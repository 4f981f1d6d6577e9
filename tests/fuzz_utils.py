"""Seeded fuzz cases and the checks shared by the CPU and GPU fuzz / reliability tests.

A case is a pure function of ``(seed, device_type)``: sizes, routing, clamp, index dtype and the
layout of the inputs, so ``draw_case(seed, ...)`` reproduces any reported failure. Inputs come from
``deep_gemm_ext.testing.make_inputs`` (the one generator), mutated for the routings it does not
draw (every slot on one expert, every slot unused, repeated experts within a token).

Error measure (docs/architecture.md, protocol): ``||out - ref|| / ||ref||`` against the fp64 reference on upcast
inputs, with three refinements that keep small cases meaningful:

- ``d topk_weights[t, k] = <dy[t], o[t, k]>`` is a dot product that can cancel to nearly zero, so
  its error is divided by ``max(||ref||, ||scale||)`` where ``scale[t, k]`` is the cancellation-free
  size of that dot product (the norm of its terms). Without it a single near-zero entry (T = 1)
  turns any rounding into a huge relative error.
- The comparison with the grouped_mm baseline allows ``1.05 x`` its error plus a statistical slack
  ``slack_sigmas * 2^-8 / sqrt(n_eff)`` (6 sigmas on the GPU), where ``n_eff`` counts the independent rounding events
  behind the output (distinct (token, expert) pairs times the contraction width). Large outputs get
  the bare 1.05x; an output made of a handful of numbers is judged by the absolute bound alone.
- With ``activation_clamp`` set, elements of ``h`` within one bf16 rounding of ``+-c`` flip the
  clamp's gradient mask against the fp64 reference (h is stored in bf16), a jump of
  O(1) in those elements of dh. dx and d l1 then carry errors of several percent in every bf16
  implementation (the baseline sees the same flips), so for them the absolute bound is only a sanity
  bound and the baseline comparison is what judges.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

import deep_gemm_ext as dge
from deep_gemm_ext.baselines import grouped_mm_moe
from deep_gemm_ext.reference import reference_forward, swiglu
from deep_gemm_ext.testing import ROUTINGS, make_inputs, rel_err

from conftest import poison_cached_memory

NAMES = ("y", "dx", "dtopk_w", "dl1", "dl2")
#: Routings on top of testing.ROUTINGS: all T*K slots on one expert (the pool's worst case),
#: every slot unused, and experts drawn with replacement (a token may hit one expert twice).
EXTRA_ROUTINGS = ("flood_all", "all_unused", "duplicates")
FUZZ_ROUTINGS = ROUTINGS + EXTRA_ROUTINGS
CLAMPS = (0.25, 0.5, 1.0, 3.0)
BF16_HALF_ULP = 2.0 ** -8


@dataclass(frozen=True)
class Limits:
    max_tokens: int
    max_hidden: int
    max_inter: int
    max_experts: int
    max_top_k: int
    dim_multiple: int  # hidden / intermediate granularity (8 on the GPU path)
    max_work: int  # cap on T*K*H*I so every case stays quick
    max_weights: int  # cap on E*3*I*H: the weights are drawn on the host


GPU_LIMITS = Limits(2048, 1024, 1024, 64, 8, 8, 1 << 30, 1 << 25)
CPU_LIMITS = Limits(64, 64, 64, 16, 6, 1, 1 << 22, 1 << 22)


@dataclass(frozen=True)
class FuzzCase:
    seed: int
    num_tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    routing: str
    clamp: float | None
    dtype: torch.dtype
    idx_dtype: torch.dtype
    offset_views: bool  # inputs are contiguous views at 16-byte aligned storage offsets
    dy_layout: str  # "dense" or "transposed" (a non-contiguous gradient)

    def __str__(self) -> str:
        return (f"seed={self.seed} T={self.num_tokens} H={self.hidden} I={self.intermediate} "
                f"E={self.num_experts} K={self.top_k} routing={self.routing} clamp={self.clamp} "
                f"dtype={str(self.dtype)[6:]} idx={str(self.idx_dtype)[6:]} offsets={self.offset_views} "
                f"dy={self.dy_layout}")


def _dim(rng: random.Random, limit: int, multiple: int, tile: int) -> int:
    """A hidden / intermediate size: often a multiple of ``tile`` (what our SM90 GEMMs take) or 64,
    otherwise any legal multiple, log-uniform so small sizes come up as often as large ones."""
    roll = rng.random()
    for step, chance in ((tile, 0.45), (64, 0.15)):
        if roll < chance and limit >= step and step % multiple == 0:
            return step * rng.randint(1, limit // step)
        roll -= chance
    units = limit // multiple
    return multiple * max(1, min(units, int(math.exp(rng.uniform(0, math.log(units + 1))))))


def draw_case(seed: int, device_type: str = "cuda", limits: Limits | None = None) -> FuzzCase:
    """The case of ``seed``: sizes legal for ``device_type``'s path, routing, clamp and layout."""
    rng = random.Random(f"dge-fuzz-{device_type}-{seed}")
    lim = limits or (GPU_LIMITS if device_type == "cuda" else CPU_LIMITS)
    routing = rng.choice(FUZZ_ROUTINGS)
    num_experts = rng.choice([1, 2, 3, 4, 8, lim.max_experts, rng.randint(1, lim.max_experts)])
    if routing == "empty_experts":
        num_experts = max(num_experts, 2)  # with one expert, "every third expert empty" leaves none
    top_k = rng.randint(1, lim.max_top_k)  # may exceed num_experts: the extra slots stay unused
    # Multiples of 128 select our SM90 GEMMs; other sizes torch's.
    hidden = _dim(rng, lim.max_hidden, lim.dim_multiple, 128)
    inter = _dim(rng, lim.max_inter, lim.dim_multiple, 128)
    roll = rng.random()
    if roll < 0.04:
        num_tokens = 0
    elif roll < 0.10:
        num_tokens = 1
    elif roll < 0.25 and lim.max_tokens >= 128:
        num_tokens = 128 * rng.randint(1, lim.max_tokens // 128)
    else:
        num_tokens = rng.randint(2, lim.max_tokens)
    num_tokens = min(num_tokens, max(1, lim.max_work // (top_k * hidden * inter))) if num_tokens else 0
    num_experts = max(2 if routing == "empty_experts" else 1,
                      min(num_experts, lim.max_weights // (3 * inter * hidden)))
    if device_type == "cuda":
        dtype = torch.bfloat16
    else:
        dtype = rng.choices([torch.bfloat16, torch.float32, torch.float64], weights=[5, 3, 2])[0]
    return FuzzCase(
        seed=seed, num_tokens=num_tokens, hidden=hidden, intermediate=inter, num_experts=num_experts,
        top_k=top_k, routing=routing, clamp=rng.choice([None, None, None, *CLAMPS]), dtype=dtype,
        idx_dtype=rng.choice([torch.int64, torch.int64, torch.int32]),
        offset_views=rng.random() < 0.25, dy_layout=rng.choices(["dense", "transposed"], weights=[4, 1])[0])


def _routing_override(case: FuzzCase, idx: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    T, K, E = case.num_tokens, case.top_k, case.num_experts
    if case.routing == "flood_all":
        return torch.full((T, K), (case.seed * 7) % E, dtype=torch.int64)
    if case.routing == "all_unused":
        return torch.full((T, K), -1, dtype=torch.int64)
    if case.routing == "duplicates":
        return torch.randint(0, E, (T, K), generator=g)
    return idx


def _as_offset_view(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The same values as a contiguous view into a larger buffer, at a 16-byte aligned offset."""
    per16 = 16 // t.element_size()
    offset = per16 * int(torch.randint(1, 5, (1,), generator=g))
    buf = torch.empty(offset + t.numel() + per16, dtype=t.dtype, device=t.device)
    view = buf[offset:offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def make_case_inputs(case: FuzzCase, device) -> tuple[torch.Tensor, ...]:
    """(x, topk_idx, topk_weights, l1, l2, dy); x, topk_weights, l1, l2 are leaves requiring grad."""
    T, H, I, E, K = case.num_tokens, case.hidden, case.intermediate, case.num_experts, case.top_k
    base = case.routing if case.routing in ROUTINGS else "uniform"
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing=base, dtype=case.dtype, seed=case.seed,
                                    requires_grad=False)
    g = torch.Generator().manual_seed(case.seed + 1_000_003)
    idx = _routing_override(case, idx, g).to(case.idx_dtype)
    dy = torch.randn(T, H, generator=g).to(case.dtype)
    tensors = [t.to(device) for t in (x, idx, w, l1, l2)]
    if case.offset_views:
        tensors = [_as_offset_view(t, g) for t in tensors]
    for i in (0, 2, 3, 4):
        tensors[i].requires_grad_(True)
    dy = dy.to(device)
    if case.dy_layout == "transposed":
        dy = dy.t().contiguous().t()
    return (*tensors, dy)


def run_layer(fn, x, idx, w, l1, l2, clamp, dy):
    """y and (dx, d topk_weights, d l1, d l2) of ``fn``; an input the graph does not use gets zeros."""
    leaves = (x, w, l1, l2)
    y = fn(x, idx, w, l1, l2, clamp)
    if not y.requires_grad:
        return y.detach(), tuple(torch.zeros_like(t) for t in leaves)
    grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return y.detach(), tuple(torch.zeros_like(t) if d is None else d for t, d in zip(leaves, grads))


def ours(x, idx, w, l1, l2, clamp):
    return dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp)


def reference_outputs(x, idx, w, l1, l2, clamp, dy):
    """fp64 reference ``(y, (dx, dtopk_w, dl1, dl2), dtopk_scale)`` on upcast inputs.

    ``dtopk_scale[t, k] = ||da'[t, k] * act[t, k]||``: the size of the terms of the dot product
    ``d topk_weights[t, k] = <da', act>`` before they cancel (0 for unused slots).
    """
    leaves = [t.detach().double().requires_grad_() for t in (x, w, l1, l2)]
    y = reference_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], clamp)
    if y.requires_grad:
        grads = torch.autograd.grad(y, leaves, dy.double())
    else:  # every slot unused
        grads = tuple(torch.zeros_like(t) for t in leaves)
    xd, l1d, l2d, dyd = (t.detach().double() for t in (x, l1, l2, dy))
    num_tokens, top_k = idx.shape
    flat = idx.reshape(-1).long()
    scale = torch.zeros(num_tokens * top_k, dtype=torch.float64, device=x.device)
    for e in torch.unique(flat[flat >= 0]).tolist():
        slots = (flat == e).nonzero().flatten()
        tokens = slots // top_k
        act = swiglu(xd[tokens] @ l1d[e].t(), clamp)
        scale[slots] = ((dyd[tokens] @ l2d[e]) * act).norm(dim=1)
    return y.detach(), tuple(grads), scale.view(num_tokens, top_k)


def effective_counts(idx: torch.Tensor, hidden: int, inter: int) -> dict[str, int]:
    """Independent rounding events behind each output: distinct (token, expert) pairs times the
    width they are computed over, capped by the output's size."""
    used = idx >= 0
    tokens = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)
    width = int(idx.max()) + 1 if idx.numel() else 1
    pairs = int(torch.unique(tokens[used].long() * width + idx[used].long()).numel())
    experts = int(torch.unique(idx[used]).numel())
    rows = int(used.any(1).sum())
    return dict(y=min(rows * hidden, pairs * inter), dx=min(rows * hidden, pairs * 2 * inter), dtopk_w=pairs,
                dl1=min(experts * 2 * inter * hidden, pairs * 2 * inter),
                dl2=min(experts * hidden * inter, pairs * inter))


# ---------------------------------------------------------------------------------------------
# Criteria (docs/architecture.md, "Correctness and timing protocol").


@dataclass(frozen=True)
class Criteria:
    max_rel_err: float
    baseline_factor: float | None = None  # None: no baseline comparison
    slack_sigmas: float = 0.0
    clamp_mask_max_rel_err: float | None = None  # bound for dx / d l1 under a clamp (see module doc)


#: The GPU (bf16) path: within bf16 tolerance of fp64 and no worse than 1.05x grouped_mm's error.
GPU_CRITERIA = Criteria(max_rel_err=2e-2, baseline_factor=1.05, slack_sigmas=6.0, clamp_mask_max_rel_err=0.75)


def cpu_criteria(out_dtype: torch.dtype) -> Criteria:
    """The CPU path computes in fp32 (fp64 for fp64 inputs) and rounds once to the output dtype:
    its error is that one rounding (<= 2^-8 relative in bf16) plus fp32 arithmetic; the clamp
    masks are evaluated in fp32, which cannot flip against fp64 except at exact ties."""
    if out_dtype == torch.float64:
        return Criteria(max_rel_err=1e-10)
    if out_dtype == torch.float32:
        return Criteria(max_rel_err=2e-5)
    return Criteria(max_rel_err=BF16_HALF_ULP + 2e-5)


@dataclass
class Row:
    name: str
    err: float
    base: float | None = None  # the baseline's error, where compared
    allowed: float | None = None  # the largest err the baseline comparison allows
    n_eff: int = 0


@dataclass
class CaseResult:
    case: FuzzCase
    rows: list = field(default_factory=list)
    failures: list = field(default_factory=list)

    def usage(self) -> tuple[float, str]:
        """(max over outputs of err / allowed, that output): how close the case came to failing the
        baseline comparison; 1.0 is the limit."""
        return max(((r.err / r.allowed, r.name) for r in self.rows if r.allowed), default=(0.0, "-"))

    def big_ratio(self, min_n_eff: int = 4096) -> tuple[float, str]:
        """(max err / baseline err over outputs with at least ``min_n_eff`` rounding events, output)."""
        return max(((r.err / r.base, r.name) for r in self.rows if r.base and r.n_eff >= min_n_eff),
                   default=(0.0, "-"))

    @property
    def max_err(self) -> float:
        return max((r.err for r in self.rows), default=0.0)


def _error(out, ref, floor: float = 0.0) -> float:
    diff = (out.detach().double() - ref.detach().double()).norm().item()
    denom = max(ref.detach().double().norm().item(), floor)
    return diff / denom if denom > 0 else diff


def check_outputs(case: FuzzCase, outs, refs, bases, dtopk_scale, n_eff, criteria_of) -> CaseResult:
    """Judge ours (and compare with the baseline's error) against the fp64 reference, output by output."""
    result = CaseResult(case)
    for name, out, ref, base in zip(NAMES, outs, refs, bases):
        crit = criteria_of(out.dtype)
        if out.isnan().any():
            result.failures.append(f"{name}: NaN in the output (unwritten rows?)")
            continue
        if not out.isfinite().all():
            result.failures.append(f"{name}: Inf in the output")
            continue
        if ref.numel() == 0 or float(ref.abs().max()) == 0:
            if out.numel() and float(out.abs().max()) != 0:
                result.failures.append(f"{name}: the reference is all zeros, ours has max |.| "
                                       f"{float(out.abs().max()):.3e}")
            result.rows.append(Row(name, 0.0))
            continue
        floor = dtopk_scale.norm().item() if name == "dtopk_w" else 0.0
        err = _error(out, ref, floor)
        compare = base is not None and crit.baseline_factor is not None
        e_base = _error(base, ref, floor) if compare else None
        row = Row(name, err, e_base, n_eff=n_eff[name])
        result.rows.append(row)
        bound = crit.max_rel_err
        if case.clamp is not None and name in ("dx", "dl1") and crit.clamp_mask_max_rel_err is not None:
            bound = crit.clamp_mask_max_rel_err
        if not err < bound:
            result.failures.append(f"{name}: rel err {err:.3e} >= {bound:.1e}")
        if compare:
            slack = crit.slack_sigmas * BF16_HALF_ULP / math.sqrt(max(n_eff[name], 1))
            row.allowed = crit.baseline_factor * e_base + slack
            if not err <= row.allowed:
                result.failures.append(f"{name}: rel err {err:.3e} > {crit.baseline_factor} x grouped_mm's "
                                       f"{e_base:.3e} + {slack:.1e} (n_eff {n_eff[name]})")
    return result


def check_interface(x, w, l1, l2, y, grads) -> list[str]:
    """Shapes, dtypes and devices of y and the gradients match the inputs they belong to."""
    problems = []
    for name, out, like in zip(NAMES, (y, *grads), (x, x, w, l1, l2)):
        if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
            problems.append(f"{name}: {tuple(out.shape)} {out.dtype} {out.device}, expected "
                            f"{tuple(like.shape)} {like.dtype} {like.device}")
    return problems


def check_case(case: FuzzCase, device, criteria_of=None, with_baseline: bool | None = None) -> CaseResult:
    """Run ours (and, on the GPU, the grouped_mm baseline) on the case; judge against fp64."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    criteria_of = criteria_of or ((lambda dtype: GPU_CRITERIA) if on_gpu else cpu_criteria)
    with_baseline = on_gpu if with_baseline is None else with_baseline
    x, idx, w, l1, l2, dy = make_case_inputs(case, device)
    y_ref, g_ref, dtopk_scale = reference_outputs(x, idx, w, l1, l2, case.clamp, dy)
    if on_gpu:
        poison_cached_memory()
    y, grads = run_layer(ours, x, idx, w, l1, l2, case.clamp, dy)
    base = (None,) * 5
    if with_baseline and case.num_tokens:  # T = 0: empty outputs, nothing to compare
        if on_gpu:
            poison_cached_memory()
        yb, gb = run_layer(grouped_mm_moe, x, idx, w, l1, l2, case.clamp, dy)
        base = (yb, *gb)
    n_eff = effective_counts(idx, case.hidden, case.intermediate)
    result = check_outputs(case, (y, *grads), (y_ref, *g_ref), base, dtopk_scale, n_eff, criteria_of)
    result.failures[:0] = check_interface(x, w, l1, l2, y, grads)
    return result


def summary_line(results: list[CaseResult], seconds: float | None = None) -> str:
    """One line: cases, failures, the closest call against the baseline, the worst ratio on large
    outputs and the largest error, each with the seed that reproduces it."""
    failed = [r.case.seed for r in results if r.failures]
    usage = max(((*r.usage(), r.case.seed) for r in results), default=(0.0, "-", None))
    ratio = max(((*r.big_ratio(), r.case.seed) for r in results), default=(0.0, "-", None))
    worst = max(results, key=lambda r: r.max_err)
    timing = f" in {seconds:.1f} s" if seconds is not None else ""
    return (f"fuzz: {len(results)} cases{timing}, {len(failed)} failed{' ' + str(failed[:20]) if failed else ''}; "
            f"closest to the 1.05x-baseline limit {usage[0]:.3f} of allowed ({usage[1]}, seed {usage[2]}); "
            f"max err/baseline ratio {ratio[0]:.3f} ({ratio[1]}, seed {ratio[2]}, n_eff >= 4096); "
            f"max rel err {worst.max_err:.3e} (seed {worst.case.seed})")


def failure_report(results: list[CaseResult]) -> str:
    lines = []
    for r in results:
        if r.failures:
            lines.append(f"[{r.case}]")
            lines += [f"    {f}" for f in r.failures]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Non-finite inputs: ours must put NaN / Inf exactly where the fp64 reference does.

#: (scenario, whether the reference output has non-finite values at all)
NONFINITE_SCENARIOS = (
    "x_nan", "x_inf", "x_nan_unrouted_token", "l1_gate_nan", "l1_gate_inf", "l1_up_inf", "l2_nan",
    "weights_nan_empty_expert", "topk_w_nan", "topk_w_inf", "topk_w_nan_unused_slot", "dy_nan", "dy_inf",
)
_ALL_FINITE = {"x_nan_unrouted_token", "weights_nan_empty_expert", "topk_w_nan_unused_slot"}


def nonfinite_inputs(scenario: str, device, dtype, shape, seed: int = 0):
    """Moderate random inputs (no bf16 overflow anywhere) with one non-finite value planted.

    Token 0 routes nowhere, tokens 1 and 2 use expert 0 in slot 0, expert E-1 receives nothing,
    and a quarter of the other slots are unused.
    """
    T, H, I, E, K = shape
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing="unused_slots", dtype=dtype, seed=seed,
                                    requires_grad=False)
    idx[idx == E - 1] = -1
    idx[0] = -1
    idx[1:3, 0] = 0
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    nan, inf = math.nan, math.inf
    if scenario == "x_nan":
        x[1, 3] = nan
    elif scenario == "x_inf":
        x[2, 5] = inf
    elif scenario == "x_nan_unrouted_token":
        x[0] = nan
    elif scenario == "l1_gate_nan":
        l1[0, 2, 4] = nan
    elif scenario == "l1_gate_inf":
        l1[0, 1, 0] = inf
    elif scenario == "l1_up_inf":
        l1[0, I + 1, 0] = inf
    elif scenario == "l2_nan":
        l2[0, 5 % H, 1] = nan
    elif scenario == "weights_nan_empty_expert":
        l1[E - 1] = nan
        l2[E - 1, 0, 0] = inf
    elif scenario == "topk_w_nan":
        w[1, 0] = nan
    elif scenario == "topk_w_inf":
        w[2, 0] = inf
    elif scenario == "topk_w_nan_unused_slot":
        w[idx < 0] = nan
    elif scenario == "dy_nan":
        dy[1, 2] = nan
    elif scenario == "dy_inf":
        dy[2, 0] = -inf
    else:
        raise ValueError(f"scenario={scenario!r}; expected one of {NONFINITE_SCENARIOS}")
    tensors = [t.to(device) for t in (x, idx, w, l1, l2, dy)]
    for i in (0, 2, 3, 4):
        tensors[i].requires_grad_(True)
    return tensors


def nonfinite_mismatch(name: str, out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Where ours and the reference disagree on which elements are non-finite (NaN or Inf)."""
    bad_out, bad_ref = ~out.detach().isfinite(), ~ref.detach().isfinite()
    if torch.equal(bad_out, bad_ref):
        return None
    extra = (bad_out & ~bad_ref).nonzero()
    missing = (bad_ref & ~bad_out).nonzero()
    return (f"{name}: {len(extra)} non-finite where the reference is finite (first {extra[:3].tolist()}), "
            f"{len(missing)} finite where the reference is not (first {missing[:3].tolist()})")


def check_nonfinite(scenario: str, device, dtype=torch.bfloat16, clamp=None, shape=(37, 128, 64, 6, 3)) -> list[str]:
    """Problems (empty when none): an exception, a different NaN/Inf pattern, or finite elements
    that drifted from the reference."""
    x, idx, w, l1, l2, dy = nonfinite_inputs(scenario, device, dtype, shape)
    y_ref, g_ref, _ = reference_outputs(x, idx, w, l1, l2, clamp, dy)
    expect_finite = scenario in _ALL_FINITE
    if expect_finite != all(bool(t.isfinite().all()) for t in (y_ref, *g_ref)):
        return [f"{scenario}: the reference is {'not ' if expect_finite else ''}all finite; the scenario is wrong"]
    if torch.device(device).type == "cuda":
        poison_cached_memory()
    try:
        y, grads = run_layer(ours, x, idx, w, l1, l2, clamp, dy)
    except Exception as exc:  # the contract: non-finite values never raise
        return [f"{scenario}: raised {type(exc).__name__}: {exc}"]
    problems = []
    tol = GPU_CRITERIA.max_rel_err if torch.device(device).type == "cuda" else cpu_criteria(dtype).max_rel_err
    for name, out, ref in zip(NAMES, (y, *grads), (y_ref, *g_ref)):
        mismatch = nonfinite_mismatch(name, out, ref)
        if mismatch:
            problems.append(f"{scenario}: {mismatch}")
            continue
        finite = ref.isfinite()
        if finite.any() and float(ref[finite].abs().max()) > 0:
            err = rel_err(out[finite], ref[finite])
            if not err < tol:
                problems.append(f"{scenario}: {name}: finite elements have rel err {err:.3e} >= {tol:.1e}")
    return problems


# ---------------------------------------------------------------------------------------------
# Bitwise comparison and poisoned memory.


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN payloads included), so NaN == NaN here."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().contiguous().view(as_int), b.detach().contiguous().view(as_int))
