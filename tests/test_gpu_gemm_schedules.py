"""The ping-pong consumer schedule of the SM90 grouped GEMMs (DGE_GEMM_SCHEDULE=pingpong) against the
cooperative one at the same 128-wide N tile: every output bit-identical (each element is the same fp32
sum in the same K order), on the layer's GEMMs with their gathers, scatters and SwiGLU epilogues, on
NaN-poisoned outputs, over routing edge cases. Each output is also checked against an fp64 reference,
so that two equally broken schedules cannot pass.

CPU: the schedule knob, the config rules and the ping-pong configs' compile (with nvcc).
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from deep_gemm_ext import _env
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_routing

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not _HOPPER, reason="needs an SM90 (Hopper) GPU")

# Small layer shapes (H, I) of the Qwen3 MoE kind; I = 384 also gives N tiles that pad.
_H, _I, _E, _K = 512, 384, 16, 4
_ROUTINGS = [(777, "uniform"), (600, "zipf"), (500, "empty_experts"), (300, "one_expert"), (1, "uniform"),
             (0, "uniform")]


# -- CPU ----------------------------------------------------------------------------------------------------


def test_schedule_knob(monkeypatch):
    monkeypatch.delenv("DGE_GEMM_SCHEDULE", raising=False)
    assert _env.gemm_schedule() == "cooperative"
    monkeypatch.setenv("DGE_GEMM_SCHEDULE", " PingPong ")
    assert _env.gemm_schedule() == "pingpong"
    monkeypatch.setenv("DGE_GEMM_SCHEDULE", "stream-k")
    with pytest.raises(ValueError, match="DGE_GEMM_SCHEDULE='stream-k': expected one of"):
        _env.gemm_schedule()


def test_schedule_reaches_the_provider_through_the_plan(monkeypatch):
    """DGE_GEMM_SCHEDULE is read by the plan (once per call) and handed to the SM90 provider; the
    launchers take it as an argument and read no environment."""
    from deep_gemm_ext import plan as plan_mod
    from deep_gemm_ext.providers import PROVIDERS

    x, l1 = torch.zeros(4, 64), torch.zeros(2, 64, 64)
    for value, expected in ((None, "cooperative"), ("pingpong", "pingpong")):
        if value is None:
            monkeypatch.delenv("DGE_GEMM_SCHEDULE", raising=False)
        else:
            monkeypatch.setenv("DGE_GEMM_SCHEDULE", value)
        p = plan_mod.resolve(x, l1)
        assert p.gemm_schedule == expected
        assert plan_mod.Plan.decode(p.encode()) == p
        sm90 = dataclasses.replace(p, provider="sm90").gemms
        assert sm90.schedule == expected
        assert sm90 is PROVIDERS["sm90"].configured(gemm_schedule=expected)
    with pytest.raises(ValueError, match="schedule='stream_k': expected one of"):
        gg.m_grouped_bf16_gemm_nt_contiguous(torch.zeros(4, 64), torch.zeros(2, 64, 64), torch.zeros(2),
                                             torch.zeros(2), schedule="stream_k")


def test_pingpong_configs():
    assert gg.select_tile(1536, schedule="pingpong") == gg.Tile(128, 6)
    assert gg.select_tile(1536, schedule="pingpong", divides=True).block_n == 128
    with pytest.raises(ValueError, match="block_n=256 with schedule='pingpong'"):
        gg.GemmConfig("nt", 256, schedule="pingpong")
    with pytest.raises(ValueError, match="schedule='stream_k'"):
        gg.GemmConfig("nt", 128, schedule="stream_k")
    config = gg.GemmConfig("nt", 128, paired_n=True, epilogue="swiglu_fwd", schedule="pingpong")
    assert config.name.endswith("_pingpong") and "dge::gemm::Schedule::Pingpong>" in config.code()
    assert "Schedule::" not in gg.GemmConfig("nt", 128).code()
    # Every registered 128-wide or paired cooperative config has its ping-pong twin.
    names = {c.name for c in gg._all_configs()}
    for c in gg._all_configs():
        if c.schedule == "cooperative" and (c.block_n == 128 or c.paired_n):
            twin = gg.GemmConfig(c.layout, 128, c.paired_n, c.epilogue, c.clamp, c.gather_a, c.gather_b, "pingpong")
            assert twin.name in names, twin.name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_pingpong_configs_compile_without_spills():
    for config in gg._all_configs():
        if config.schedule != "pingpong":
            continue
        kernel = config.kernel()
        usage = kernel.resources()
        assert usage and all(u.spill_bytes == 0 for u in usage), f"{config.name}: {usage}"
        assert config.smem_bytes() == gg.GemmConfig("nt", 128).smem_bytes(), config.name


# -- GPU ----------------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (NaN-safe equality)."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _run_both(monkeypatch, fn):
    """fn(schedule) under the cooperative schedule held to 128-wide tiles, then under the ping-pong one."""
    monkeypatch.setitem(gg.TILES, "cooperative", (gg.Tile(128, 6),))
    outs = {}
    for schedule in ("cooperative", "pingpong"):
        outs[schedule] = fn(schedule)
        torch.cuda.synchronize()
    return outs["cooperative"], outs["pingpong"]


def _assert_identical(coop, ping, label: str) -> None:
    for i, (c, p) in enumerate(zip(coop, ping)):
        assert torch.equal(_bits(c), _bits(p)), f"{label}[{i}]: ping-pong differs from cooperative"


def _nan(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


class _Layer:
    """Routed inputs of one small MoE layer: x, dy, h, act, the pools built from them, weights."""

    def __init__(self, num_tokens: int, routing: str, seed: int):
        g = torch.Generator().manual_seed(seed)
        idx = make_routing(num_tokens, _E, _K, routing, generator=g).cuda()
        self.meta = compute_routing_torch(idx, _E, gg.GROUP_ALIGNMENT)
        self.rows = self.meta.num_pool_rows
        self.starts, self.ends = self.meta.starts, self.meta.ends
        self.src = torch.where(self.meta.row_to_slot >= 0, self.meta.row_to_slot // _K, -1)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).cuda().to(torch.bfloat16)

        live = self.src >= 0
        self.x, self.dy = randn(num_tokens, _H), randn(num_tokens, _H)
        self.x_pool, self.dy_pool = self.pool(self.x), self.pool(self.dy)
        # Pool-level operands (h = [g | u], act): random real rows, zero padding rows.
        self.h, self.act = randn(self.rows, 2 * _I), randn(self.rows, _I)
        self.h[~live] = 0
        self.act[~live] = 0
        self.l1 = randn(_E, 2 * _I, _H, scale=_H ** -0.5)
        self.l2 = randn(_E, _H, _I, scale=_I ** -0.5)
        self.weights = torch.rand(num_tokens, _K, generator=g).cuda()
        self.row_weight = torch.zeros(self.rows, device="cuda")
        self.row_weight[live] = self.weights.reshape(-1)[self.meta.row_to_slot[live].long()]

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """Pool row r = tokens[row_to_slot[r] // K] (zero rows for padding)."""
        out = torch.zeros(self.rows, tokens.shape[1], dtype=tokens.dtype, device="cuda")
        live = self.src >= 0
        out[live] = tokens[self.src[live]]
        return out

    def gather(self, mode: str = "cp_async") -> gg.Gather:
        return gg.Gather(self.meta.row_to_slot, _K, mode)

    def m_ref(self, a_pool: torch.Tensor, weight_of) -> torch.Tensor:
        """fp64 M-grouped reference for the rows experts own (NaN elsewhere)."""
        out = torch.full((self.rows, weight_of(0).shape[1]), float("nan"), dtype=torch.float64, device="cuda")
        for e, (s, t) in enumerate(zip(self.starts.tolist(), self.ends.tolist())):
            if t > s:
                out[s:t] = a_pool[s:t].double() @ weight_of(e).double()
        return out


def _close(got: torch.Tensor, ref: torch.Tensor, label: str, tol: float = 2e-2) -> None:
    """Rows the reference marks NaN must stay NaN (unwritten); the others match it."""
    unwritten = torch.isnan(ref)
    assert torch.isnan(got[unwritten].float()).all(), f"{label}: rows no expert owns were written"
    g, r = got[~unwritten].double(), ref[~unwritten]
    assert not torch.isnan(g).any(), f"{label}: unwritten rows"
    if r.numel():
        err = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < tol, f"{label}: rel error {err:.2e}"


@needs_hopper
@pytest.mark.parametrize("num_tokens,routing", _ROUTINGS)
def test_m_grouped_gemms(monkeypatch, num_tokens, routing):
    L = _Layer(num_tokens, routing, seed=num_tokens + 7)
    nt, nn = gg.m_grouped_bf16_gemm_nt_contiguous, gg.m_grouped_bf16_gemm_nn_contiguous
    cases = {
        "L1 fwd nt": (lambda sch: nt(L.x_pool, L.l1, L.starts, L.ends, _nan(L.rows, 2 * _I), schedule=sch),
                      L.m_ref(L.x_pool, lambda e: L.l1[e].T)),
        "L1 fwd nt paired": (lambda sch: nt(L.x_pool, L.l1, L.starts, L.ends, _nan(L.rows, 2 * _I), paired_n=True,
                                            schedule=sch),
                             L.m_ref(L.x_pool, lambda e: L.l1[e].T)),
        "L2 fwd nt": (lambda sch: nt(L.act, L.l2, L.starts, L.ends, _nan(L.rows, _H), schedule=sch),
                      L.m_ref(L.act, lambda e: L.l2[e].T)),
        "L2 dgrad nn": (lambda sch: nn(L.dy_pool, L.l2, L.starts, L.ends, _nan(L.rows, _I), schedule=sch),
                        L.m_ref(L.dy_pool, lambda e: L.l2[e])),
        "L1 dgrad nn": (lambda sch: nn(L.h, L.l1, L.starts, L.ends, _nan(L.rows, _H), schedule=sch),
                        L.m_ref(L.h, lambda e: L.l1[e])),
    }
    for mode in gg.GATHER_MODES:
        cases[f"L1 fwd nt gather {mode}"] = (
            lambda sch, mode=mode: nt(L.x, L.l1, L.starts, L.ends, _nan(L.rows, 2 * _I), gather=L.gather(mode),
                                      schedule=sch),
            L.m_ref(L.x_pool, lambda e: L.l1[e].T))
    cases["L2 dgrad nn gather"] = (
        lambda sch: nn(L.dy, L.l2, L.starts, L.ends, _nan(L.rows, _I), gather=L.gather(), schedule=sch),
        L.m_ref(L.dy_pool, lambda e: L.l2[e]))
    for label, (fn, ref) in cases.items():
        coop, ping = _run_both(monkeypatch, lambda sch: (fn(sch),))
        _assert_identical(coop, ping, f"{label} T={num_tokens} {routing}")
        _close(ping[0], ref, f"{label} T={num_tokens} {routing}")


@needs_hopper
@pytest.mark.parametrize("num_tokens,routing", _ROUTINGS)
def test_scatter_epilogues(monkeypatch, num_tokens, routing):
    L = _Layer(num_tokens, routing, seed=num_tokens + 11)
    slots = num_tokens * _K
    weighted = gg.Scatter(L.meta.row_to_slot, slots, L.weights)
    plain = gg.Scatter(L.meta.row_to_slot, slots)
    for label, fn, ref, w in [
        ("L2 fwd scatter weighted",
         lambda sch: gg.m_grouped_bf16_gemm_nt_contiguous(L.act, L.l2, L.starts, L.ends, _nan(slots, _H),
                                                          scatter=weighted, schedule=sch),
         L.m_ref(L.act, lambda e: L.l2[e].T), L.weights.reshape(-1)),
        ("L1 dgrad scatter",
         lambda sch: gg.m_grouped_bf16_gemm_nn_contiguous(L.h, L.l1, L.starts, L.ends, _nan(slots, _H),
                                                          scatter=plain, schedule=sch),
         L.m_ref(L.h, lambda e: L.l1[e]), None),
    ]:
        coop, ping = _run_both(monkeypatch, lambda sch: (fn(sch),))
        _assert_identical(coop, ping, f"{label} T={num_tokens} {routing}")
        # Reference in slot order: slot s holds pool row slot_to_row[s] (times its weight); unused slots NaN.
        ref_slots = torch.full((slots, _H), float("nan"), dtype=torch.float64, device="cuda")
        live = L.meta.slot_to_row >= 0
        rows = L.meta.slot_to_row[live].long()
        ref_slots[live] = ref[rows] * (w[live].double()[:, None] if w is not None else 1.0)
        _close(ping[0], ref_slots, f"{label} T={num_tokens} {routing}")


@needs_hopper
@pytest.mark.parametrize("num_tokens,routing", _ROUTINGS)
def test_k_grouped_gemms(monkeypatch, num_tokens, routing):
    L = _Layer(num_tokens, routing, seed=num_tokens + 13)
    dh = L.h  # stands for the [P, 2I] gradient pool

    def ref(a_pool, b_pool):
        out = torch.zeros(_E, a_pool.shape[1], b_pool.shape[1], dtype=torch.float64, device="cuda")
        for e, (s, t) in enumerate(zip(L.starts.tolist(), L.ends.tolist())):
            out[e] = a_pool[s:t].double().T @ b_pool[s:t].double()
        return out

    tn = gg.k_grouped_bf16_gemm_tn_contiguous
    cases = [
        ("dW1 tn", lambda sch: tn(dh, L.x_pool, L.starts, L.ends, _nan(_E, 2 * _I, _H), schedule=sch),
         ref(dh, L.x_pool)),
        ("dW1 tn gather_b", lambda sch: tn(dh, L.x, L.starts, L.ends, _nan(_E, 2 * _I, _H), gather_b=L.gather(),
                                           schedule=sch),
         ref(dh, L.x_pool)),
        ("dW2 tn gather_a", lambda sch: tn(L.dy, L.act, L.starts, L.ends, _nan(_E, _H, _I), gather_a=L.gather(),
                                           schedule=sch),
         ref(L.dy_pool, L.act)),
    ]
    for label, fn, expected in cases:
        coop, ping = _run_both(monkeypatch, lambda sch: (fn(sch),))
        _assert_identical(coop, ping, f"{label} T={num_tokens} {routing}")
        _close(ping[0], expected, f"{label} T={num_tokens} {routing}")


def _swiglu_dh(h: torch.Tensor, dact: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """[dg | du] of act = silu(min(g, c)) * clamp(u, -c, c) for the gradient dact (NaN rows stay NaN)."""
    g, u = h.double().chunk(2, dim=-1)
    z, uc = (g.clamp(max=clamp), u.clamp(-clamp, clamp)) if clamp is not None else (g, u)
    s = torch.sigmoid(z)
    dg, du = dact * uc * s * (1 + z * (1 - s)), dact * z * s
    if clamp is not None:
        dg, du = dg.where(g <= clamp, 0.0), du.where((u >= -clamp) & (u <= clamp), 0.0)
    return torch.cat([dg, du], dim=-1)


def _silu_act(h: torch.Tensor, clamp: float | None) -> torch.Tensor:
    g, u = h.double().chunk(2, dim=-1)
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return g * torch.sigmoid(g) * u


@needs_hopper
@pytest.mark.parametrize("num_tokens,routing", _ROUTINGS)
@pytest.mark.parametrize("clamp", [None, 7.0])
def test_swiglu_epilogues(monkeypatch, num_tokens, routing, clamp):
    L = _Layer(num_tokens, routing, seed=num_tokens + 17)
    h_ref = L.m_ref(L.x_pool, lambda e: L.l1[e].T)
    for gather in (None, "tma", "cp_async"):
        def forward(schedule, gather=gather):
            x = L.x if gather else L.x_pool
            return gg.m_grouped_bf16_gemm_nt_swiglu(x, L.l1, L.starts, L.ends, clamp, h_out=_nan(L.rows, 2 * _I),
                                                    act_out=_nan(L.rows, _I),
                                                    gather=L.gather(gather) if gather else None, schedule=schedule)

        coop, ping = _run_both(monkeypatch, forward)
        label = f"swiglu fwd gather={gather} clamp={clamp} T={num_tokens} {routing}"
        _assert_identical(coop, ping, label)
        _close(ping[0], h_ref, label + " h")
        _close(ping[1], _silu_act(ping[0], clamp), label + " act")  # from the rounded h, NaN on unwritten rows

    da_ref = L.m_ref(L.dy_pool, lambda e: L.l2[e])
    for gather in (None, "cp_async"):
        def backward(schedule, gather=gather):
            dy = L.dy if gather else L.dy_pool
            return gg.m_grouped_bf16_gemm_nn_swiglu_bwd(
                dy, L.l2, L.h, L.row_weight, L.starts, L.ends, clamp, dh_out=_nan(L.rows, 2 * _I),
                act_w_out=_nan(L.rows, _I), d_row_weight_out=_nan(L.rows, dtype=torch.float32),
                gather=L.gather(gather) if gather else None, schedule=schedule)

        coop, ping = _run_both(monkeypatch, backward)
        label = f"swiglu bwd gather={gather} clamp={clamp} T={num_tokens} {routing}"
        _assert_identical(coop, ping, label)
        owned = ~torch.isnan(da_ref[:, 0])
        act = _silu_act(L.h, clamp)
        ref_drw = torch.where(owned, (da_ref.nan_to_num() * act).sum(-1), torch.zeros((), device="cuda",
                                                                                   dtype=torch.float64))
        _close(ping[1].double(), ref_drw, label + " d_row_weight", tol=3e-2)
        ref_act_w = (act * L.row_weight.double()[:, None]).where(owned[:, None], float("nan"))
        _close(ping[2], ref_act_w, label + " act_w")
        _close(ping[0], _swiglu_dh(L.h, da_ref * L.row_weight.double()[:, None], clamp), label + " dh")


@needs_hopper
def test_pingpong_print_configs(monkeypatch, capfd):
    L = _Layer(300, "uniform", seed=1)
    monkeypatch.setenv("DGE_PRINT_CONFIGS", "1")
    gg.m_grouped_bf16_gemm_nt_contiguous(L.x_pool, L.l1, L.starts, L.ends, schedule="pingpong")
    assert "sm90_bf16_grouped_gemm_nt_n128_s6_pingpong: M=" in capfd.readouterr().err
