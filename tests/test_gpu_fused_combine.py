"""The combine epilogue of the SM90 grouped GEMM core.

The L2 forward GEMM (weighted) and the L1 dgrad GEMM (unweighted) write pool row r into its token's
top-k slot row_to_slot[r] of a [T*K, N] output, and combine_slots sums each token's K contiguous
rows in k order (kernels/epilogue/sm90_scatter_slots.cuh).

GPU (Hopper), with NaN-poisoned outputs on uniform / skewed / empty-expert / one-expert /
unused-slot routings:
- unweighted scatter == the pool-order GEMM indexed by slot_to_row, bit for bit; unused slots and
  padding rows are never written;
- weighted scatter == bf16(fp32 product * weight) within one rounding of the pool GEMM times w,
  and near the fp32 reference;
- combine_slots == combine_rows of the pool, bit for bit (weighted and unweighted);
- slots past num_slots and rows past the pool are dropped, never stored out of bounds;
- the layer with DGE_FUSED_COMBINE on / off: dx and the weight gradients bit-identical, y within
  one bf16 rounding.
CPU: argument checks, environment flags, configurations.
"""
from __future__ import annotations

import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext import plan
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_inputs, make_routing

from conftest import requires_hopper

ROUTINGS = ["uniform", "zipf", "empty_experts", "one_expert", "unused_slots"]


# -- CPU ----------------------------------------------------------------------------------------------------


def test_env_flag(monkeypatch):
    from deep_gemm_ext import _env
    monkeypatch.delenv("DGE_FUSED_COMBINE", raising=False)
    assert _env.fused_combine()
    monkeypatch.setenv("DGE_FUSED_COMBINE", "0")
    assert not _env.fused_combine()
    monkeypatch.setenv("DGE_FUSED_COMBINE", "sometimes")
    with pytest.raises(ValueError, match="DGE_FUSED_COMBINE='sometimes'"):
        _env.fused_combine()


def test_combine_configs_exist():
    names = [c[0] for c in gg.configs()]
    for name in ("nt_n256_s4_scatter_weighted", "nt_n128_s6_scatter_weighted", "nn_n256_s4_scatter",
                 "nn_n128_s6_scatter"):
        assert f"sm90_bf16_grouped_gemm_{name}" in names
    code = gg.GemmConfig("nt", 256, epilogue="scatter_weighted").code()
    assert "EpilogueScatterSlots<true>" in code and "epilogue/sm90_scatter_slots.cuh" in code
    from deep_gemm_ext.jit_kernels import gather_combine
    names = [c[0] for c in gather_combine.configs()]
    assert "combine_slots_unweighted" in names and "combine_slots_weighted" in names


def test_scatter_rejects_paired_n():
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    b = torch.zeros(2, 256, 64, dtype=torch.bfloat16)
    se = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="scatter with paired_n=True"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, se, se, paired_n=True,
                                             scatter=gg.Scatter(torch.zeros(128, dtype=torch.int32), 4))


# -- GPU ----------------------------------------------------------------------------------------------------


def _routed(num_tokens, num_experts, top_k, routing, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    idx = make_routing(num_tokens, num_experts, top_k, routing, generator=g).cuda()
    meta = compute_routing_torch(idx, num_experts, gg.GROUP_ALIGNMENT)
    pool = torch.randn(meta.num_pool_rows, hidden, generator=g).cuda().to(torch.bfloat16)
    pool[meta.row_to_slot < 0] = 0  # padding rows of a pool are zero
    weights = torch.rand(num_tokens, top_k, generator=g).cuda()
    return pool, meta, weights


def _nan(rows, cols):
    return torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device="cuda")


def _weights(layout, num_experts, n, k):
    shape = (num_experts, n, k) if layout == "nt" else (num_experts, k, n)
    return (torch.randn(*shape, device="cuda") / k ** 0.5).to(torch.bfloat16)


@requires_hopper
@pytest.mark.parametrize("layout", ["nt", "nn"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("num_tokens,k,n", [(777, 1024, 1536), (300, 512, 384), (1, 128, 264)])
def test_scatter_matches_pool_gemm(layout, routing, num_tokens, k, n):
    from deep_gemm_ext import jit_kernels as jk
    num_experts, top_k = 16, 4
    pool, meta, weights = _routed(num_tokens, num_experts, top_k, routing, k, seed=num_tokens + n)
    b = _weights(layout, num_experts, n, k)
    gemm = gg.m_grouped_bf16_gemm_nt_contiguous if layout == "nt" else gg.m_grouped_bf16_gemm_nn_contiguous
    num_slots = num_tokens * top_k
    want = gemm(pool, b, meta.starts, meta.ends, _nan(meta.num_pool_rows, n))
    used = meta.slot_to_row >= 0
    rows = meta.slot_to_row.clamp(min=0).long()

    got = gemm(pool, b, meta.starts, meta.ends, _nan(num_slots, n), scatter=gg.Scatter(meta.row_to_slot, num_slots))
    assert torch.isnan(got[~used].float()).all(), "unused slots were written"
    assert not torch.isnan(got[used].float()).any(), "used slots left unwritten"
    assert torch.equal(got[used], want[rows[used]]), "scatter differs from the pool GEMM"

    wflat = weights.reshape(-1)
    got_w = gemm(pool, b, meta.starts, meta.ends, _nan(num_slots, n),
                 scatter=gg.Scatter(meta.row_to_slot, num_slots, weights))
    assert torch.isnan(got_w[~used].float()).all()
    # The same weights in pool order (NaN on padding rows, which are never stored): the same bits.
    real = meta.row_to_slot >= 0
    row_weights = torch.where(real, wflat[meta.row_to_slot.clamp(min=0).long()], float("nan"))
    got_r = gemm(pool, b, meta.starts, meta.ends, _nan(num_slots, n),
                 scatter=gg.Scatter(meta.row_to_slot, num_slots, row_weights=row_weights))
    assert torch.equal(got_r[used], got_w[used]) and torch.isnan(got_r[~used].float()).all()
    # bf16(acc * w) against bf16(acc) * w: one bf16 rounding apart (2^-8 relative), plus tiny values.
    scaled = want[rows[used]].float() * wflat[used, None]
    assert torch.allclose(got_w[used].float(), scaled, rtol=2 ** -7, atol=1e-6)
    # and near the fp32 product
    ref = torch.zeros(num_slots, n, device="cuda")
    for e, (s, t) in enumerate(zip(meta.starts.tolist(), meta.ends.tolist())):
        if t > s:
            w_e = b[e].float().T if layout == "nt" else b[e].float()
            ref_rows = pool[s:t].float() @ w_e
            slots = meta.row_to_slot[s:t].long()
            keep = slots >= 0
            ref[slots[keep]] = ref_rows[keep] * wflat[slots[keep], None]
    if used.any():
        err = ((got_w[used].double() - ref[used].double()).norm() / ref[used].double().norm().clamp_min(1e-30)).item()
        assert err < 5e-3
    # combine_slots of the unweighted slots == combine_rows of the pool (bit for bit), either weighting.
    for w in (None, weights):
        a = jk.combine_slots(got, meta.slot_to_row, top_k, w)
        bb = jk.combine_rows(want, meta.slot_to_row, w, top_k)
        assert torch.equal(a, bb), f"combine_slots differs from combine_rows (weights={w is not None})"


@requires_hopper
def test_scatter_drops_out_of_range_slots_and_rows():
    """Slots past num_slots and ends past the pool are dropped: nothing is stored out of bounds."""
    num_experts, top_k, k, n = 2, 2, 256, 256
    pool = torch.randn(256, k, device="cuda").to(torch.bfloat16)
    b = (torch.randn(num_experts, n, k, device="cuda") / 16).to(torch.bfloat16)
    row_to_slot = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    row_to_slot[0] = 3
    row_to_slot[1] = 10  # past the 8 slots
    row_to_slot[128] = 5
    starts = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    ends = torch.tensor([128, 384], dtype=torch.int32, device="cuda")  # past the 256-row pool
    guard = _nan(8 + 64, n)  # 64 poisoned rows after the output catch stray stores
    out = guard[:8]
    written = torch.zeros(8 + 64, dtype=torch.bool, device="cuda")
    written[[3, 5]] = True
    # Slot-order weights are put in pool order on the device, where the slot past num_slots reads no weight.
    weights = torch.tensor([0.5, 2.0, 0.25, 4.0, 1.0, 8.0, 0.125, 3.0], device="cuda")
    for w in (None, weights):
        guard.copy_(_nan(8 + 64, n))
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, starts, ends, out, scatter=gg.Scatter(row_to_slot, 8, w))
        torch.cuda.synchronize()
        scale = (1.0, 1.0) if w is None else (4.0, 8.0)
        assert torch.allclose(out[3].float(), scale[0] * (pool[0].float() @ b[0].float().T), rtol=2e-2, atol=2e-2)
        assert torch.allclose(out[5].float(), scale[1] * (pool[128].float() @ b[1].float().T), rtol=2e-2, atol=2e-2)
        assert torch.isnan(guard[~written].float()).all(), "a row outside the mapped slots was written"


@requires_hopper
def test_scatter_argument_checks():
    pool = torch.zeros(128, 64, dtype=torch.bfloat16, device="cuda")
    b = torch.zeros(2, 128, 64, dtype=torch.bfloat16, device="cuda")
    se = torch.zeros(2, dtype=torch.int32, device="cuda")
    r2s = torch.zeros(128, dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="scatter: expected jit_kernels.Scatter"):
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, se, se, scatter=(r2s, 4))
    with pytest.raises(ValueError, match=r"scatter.row_to_slot: shape \(64,\), expected \(128,\)"):
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, se, se, scatter=gg.Scatter(r2s[:64], 4))
    with pytest.raises(ValueError, match="scatter.num_slots=-1"):
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, se, se, scatter=gg.Scatter(r2s, -1))
    with pytest.raises(ValueError, match="scatter.weights: expected a float32 tensor of num_slots=4"):
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, se, se, scatter=gg.Scatter(r2s, 4, torch.ones(3, device="cuda")))
    with pytest.raises(ValueError, match=r"scatter.row_weights: expected a float32 tensor of one per pool row, 128"):
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, se, se, scatter=gg.Scatter(r2s, 4, row_weights=torch.ones(
            4, device="cuda")))
    with pytest.raises(ValueError, match=r"scatter.row_weights: expected a float32"):
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, se, se, scatter=gg.Scatter(r2s, 4, row_weights=torch.ones(
            128, device="cuda", dtype=torch.float64)))
    with pytest.raises(ValueError, match="weights and row_weights both given"):
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, se, se, scatter=gg.Scatter(
            r2s, 4, torch.ones(4, device="cuda"), torch.ones(128, device="cuda")))
    with pytest.raises(ValueError, match=r"out: shape \(128, 128\), expected \(4, 128\)"):
        gg.m_grouped_bf16_gemm_nt_contiguous(pool, b, se, se, torch.empty(128, 128, dtype=torch.bfloat16,
                                                                          device="cuda"), scatter=gg.Scatter(r2s, 4))
    from deep_gemm_ext import jit_kernels as jk
    with pytest.raises(ValueError, match=r"o_slots: shape \(128, 64\), expected 8 rows"):
        jk.combine_slots(pool, torch.zeros(8, dtype=torch.int32, device="cuda"), 2)


def _layer(env, monkeypatch, *, num_tokens=300, routing="empty_experts", clamp=None, seed=11):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    x, idx, w, l1, l2 = make_inputs(num_tokens, 512, 256, 8, 4, routing=routing, device="cuda", seed=seed)
    # The variable must switch the combine epilogue, or the comparison below is of a path with itself.
    assert plan.resolve(x, l1).combine_epilogue == (env.get("DGE_FUSED_COMBINE", "1") != "0"), env
    dy = torch.randn(num_tokens, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, l1, l2)]
    y = dge.mega_moe_train(leaves[0], idx, leaves[1], leaves[2], leaves[3], activation_clamp=clamp)
    y.backward(dy.to(torch.bfloat16))
    return (y.detach(), *[t.grad for t in leaves])


@requires_hopper
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("fused_gather", ["0", "cp_async"])
@pytest.mark.parametrize("clamp", [None, 4.0])
def test_layer_fused_combine(routing, fused_gather, clamp, monkeypatch):
    base = {"DGE_FUSED_GATHER": fused_gather}
    off = _layer({**base, "DGE_FUSED_COMBINE": "0"}, monkeypatch, routing=routing, clamp=clamp)
    on = _layer({**base, "DGE_FUSED_COMBINE": "1"}, monkeypatch, routing=routing, clamp=clamp)
    for name, a, b in zip(("dx", "dw", "dl1", "dl2"), off[1:], on[1:]):
        assert torch.equal(a, b), f"{name}: DGE_FUSED_COMBINE=1 differs from 0"
    # y: w * bf16(acc) summed vs bf16(w * acc) summed, each term within one bf16 rounding.
    assert not torch.isnan(on[0].float()).any()
    diff = (on[0].double() - off[0].double()).norm() / off[0].double().norm().clamp_min(1e-30)
    assert diff.item() < 5e-3
