"""The gathering prologue of the SM90 grouped GEMM core: the L1 forward reads x's rows through
row_to_slot (the backward's bf16 GEMMs read pools gathered once).

GPU (Hopper): the gathered GEMM is bit-identical to gathering the pool first (gather_rows) and
running the plain GEMM, on uniform / skewed / empty-expert /
one-expert / unused-slot routings, with NaN-poisoned outputs; slots past the tokens and pool rows
past the pool read zeros (never out of bounds); the layer with DGE_FUSED_GATHER on and off gives
bit-identical y and gradients, and saves x instead of the pool when on. CPU: argument checks, and a
model of the loader's chunks (whole 32-byte sectors per instruction, no bank conflicts).
"""
from __future__ import annotations

import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_inputs, make_routing

from conftest import requires_hopper



def test_gather_argument_checks():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    b = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    se = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="gather: expected jit_kernels.Gather"):
        gg.m_grouped_bf16_gemm_nt_contiguous(x, b, se, se, gather=(se, 2))
    with pytest.raises(TypeError, match="gather.row_to_slot: dtype torch.int64"):
        gg.m_grouped_bf16_gemm_nt_contiguous(x, b, se, se, gather=gg.Gather(se.long(), 2))
    with pytest.raises(ValueError, match="gather.top_k=0"):
        gg.m_grouped_bf16_gemm_nt_contiguous(x, b, se, se, gather=gg.Gather(se, 0))
    with pytest.raises(ValueError, match="gather.mode='ldg'"):
        gg.m_grouped_bf16_gemm_nt_contiguous(x, b, se, se, gather=gg.Gather(se, 2, "ldg"))


def test_fused_gather_env(monkeypatch):
    from deep_gemm_ext import _env
    for value, want in (("0", None), ("1", "cp_async"), ("cp_async", "cp_async"), ("off", None)):
        monkeypatch.setenv("DGE_FUSED_GATHER", value)
        assert _env.fused_gather() == want
    monkeypatch.delenv("DGE_FUSED_GATHER")
    assert _env.fused_gather() == "cp_async"
    for bad in ("maybe", "tma", "sectors", "pass"):  # the last three: loaders and modes that were removed
        monkeypatch.setenv("DGE_FUSED_GATHER", bad)
        with pytest.raises(ValueError, match=f"DGE_FUSED_GATHER='{bad}'"):
            _env.fused_gather()


def test_only_the_l1_forward_gathers():
    """The bf16 GEMMs gather the L1 forward's A ("nt") only: no gathering L2 dgrad or weight-gradient
    kernel exists, and the provider refuses to be asked for one (the plan never does)."""
    import types
    from deep_gemm_ext.providers.base import Gather
    from deep_gemm_ext.providers.sm90 import Sm90Provider
    for layout in ("nn", "tn"):
        with pytest.raises(ValueError, match=f"gather_a='cp_async' with layout='{layout}', expected layout='nt'"):
            gg.GemmConfig(layout, 256, gather_a="cp_async")
    a = torch.zeros(128, 128, dtype=torch.bfloat16)
    se = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError):
        gg.k_grouped_bf16_gemm_tn_contiguous(a, a, se, se, gather_a=gg.Gather(se, 2))
    with pytest.raises(TypeError):
        gg.m_grouped_bf16_gemm_nn_contiguous(a, a[None], se, se, gather=gg.Gather(se, 2))
    bf16 = types.SimpleNamespace(fp8=False, fp8_wgrad=False)
    g = Gather(se, 2)
    for side in ("gather_a", "gather_b"):
        with pytest.raises(ValueError, match="the bf16 weight gradients read pools gathered once"):
            Sm90Provider().k_grouped(a, a, None, recipe=bf16, **{side: g})
    with pytest.raises(ValueError, match="gather with layout='nn'"):
        Sm90Provider().m_grouped(a, a[None], None, "nn", recipe=bf16, gather=g)


@pytest.mark.parametrize("whole_sectors", [False, True])
def test_cp_async_gather_layout(whole_sectors):
    """A model of GatherLayout's chunks (kernels/loader/sm90_gemm_loaders.cuh), as the loader issues them
    (whole_sectors, sector_chunk): every 16-byte chunk of the stage copied once, to its swizzled place;
    each instruction of a warp reads only whole 32-byte sectors and each quarter warp writes 8 different
    16-byte bank groups. The model's contrast (whole_sectors False: chunks 2q, 2q + 1, the loader's
    layout before) reads half sectors in each instruction, which the model must tell apart. The GPU
    tests check the bits."""
    per_row, rows = 4, 128
    step = 128 // per_row
    copied = {}
    for j in range(2):  # the thread's two chunks, as two instructions
        for warp in range(4):
            reads, quarters = {}, {}
            for lane in range(32):
                t = 32 * warp + lane
                q = t % per_row
                for i in range(rows // step):
                    r = t // per_row + step * i
                    c = q + 4 * ((r + j) & 1) if whole_sectors else 2 * q + j
                    key = (r, c)
                    assert key not in copied, f"chunk {key} copied twice"
                    copied[key] = r * 128 + ((c ^ (r % 8)) << 4)
                    reads.setdefault((i, r, c // 2), set()).add(c % 2)
                    quarters.setdefault((i, lane // 8), []).append((copied[key] % 128) // 16)
            halves = [len(v) for v in reads.values()]
            assert all(h == 2 for h in halves) == whole_sectors, "sectors read whole exactly with whole_sectors"
            for slots in quarters.values():
                assert len(set(slots)) == 8, f"bank groups {slots} written twice in a quarter warp"
    assert len(copied) == rows * 8


def test_gather_configs_exist():
    names = [c[0] for c in gg.configs()]
    assert "sm90_bf16_grouped_gemm_nt_n256_s4_gather_cpasync" in names
    assert not any("_nn_" in n and "gather" in n for n in names), "the L2 dgrad reads a pool"
    assert not any("_tn_" in n and "gather" in n for n in names), "the weight gradients read pools"
    assert not any(n.endswith(("_gather", "_gather_sectors")) for n in names), "removed loaders"


def _routed(num_tokens, num_experts, top_k, routing, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    idx = make_routing(num_tokens, num_experts, top_k, routing, generator=g).cuda()
    meta = compute_routing_torch(idx, num_experts, gg.GROUP_ALIGNMENT)
    x = torch.randn(num_tokens, hidden, generator=g).cuda().to(torch.bfloat16)
    return x, meta


def _nan(rows, cols):
    return torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device="cuda")


@requires_hopper
@pytest.mark.parametrize("mode", gg.GATHER_MODES)
@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts", "one_expert", "unused_slots"])
@pytest.mark.parametrize("num_tokens,hidden,n", [(777, 2048, 1536), (300, 1000, 384), (1, 128, 256)])
def test_gather_nt_bit_identical(mode, routing, num_tokens, hidden, n):
    from deep_gemm_ext import jit_kernels as jk
    num_experts, top_k = 16, 4
    x, meta = _routed(num_tokens, num_experts, top_k, routing, hidden, seed=num_tokens + n)
    b = (torch.randn(num_experts, n, hidden, device="cuda") / hidden ** 0.5).to(torch.bfloat16)
    rows = meta.num_pool_rows
    x_pool = jk.gather_rows(x, meta.row_to_slot, top_k)
    want = gg.m_grouped_bf16_gemm_nt_contiguous(x_pool, b, meta.starts, meta.ends, _nan(rows, n))
    got = gg.m_grouped_bf16_gemm_nt_contiguous(x, b, meta.starts, meta.ends, _nan(rows, n),
                                               gather=gg.Gather(meta.row_to_slot, top_k, mode))
    used = meta.ends[-1].item()
    assert torch.isnan(got[used:].float()).all(), "rows past the last expert were written"
    assert not torch.isnan(got[:used].float()).any(), "owned rows left unwritten"
    assert torch.equal(got[:used], want[:used]), "gathered GEMM differs from gather + GEMM"
    # And against fp32 torch: padding rows are zero rows of the pool.
    ref = torch.zeros(used, n, device="cuda")
    for e, (s, t) in enumerate(zip(meta.starts.tolist(), meta.ends.tolist())):
        if t > s:
            ref[s:t] = x_pool[s:t].float() @ b[e].float().T
    err = ((got[:used].double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert err < 5e-3


@requires_hopper
@pytest.mark.parametrize("mode", gg.GATHER_MODES)
def test_gather_out_of_range_slots_and_rows_read_zeros(mode):
    """Slots past the tokens, and ends past the pool, read zero rows: no out-of-bounds access."""
    num_experts, top_k, hidden, n = 2, 2, 256, 256
    x = torch.randn(5, hidden, device="cuda").to(torch.bfloat16)
    b = (torch.randn(num_experts, n, hidden, device="cuda") / 16).to(torch.bfloat16)
    row_to_slot = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    row_to_slot[0] = 3          # token 1
    row_to_slot[1] = 10 * top_k  # token 10 of 5: outside x
    row_to_slot[128] = 9         # token 4
    starts = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    ends = torch.tensor([128, 384], dtype=torch.int32, device="cuda")  # past the 256-row pool
    out = gg.m_grouped_bf16_gemm_nt_contiguous(x, b, starts, ends, _nan(256, n),
                                               gather=gg.Gather(row_to_slot, top_k, mode))
    torch.cuda.synchronize()
    ref0 = (x[1].float() @ b[0].float().T)
    ref1 = (x[4].float() @ b[1].float().T)
    assert torch.allclose(out[0].float(), ref0, rtol=2e-2, atol=2e-2)
    assert torch.allclose(out[128].float(), ref1, rtol=2e-2, atol=2e-2)
    assert (out[1] == 0).all() and (out[2:128] == 0).all() and (out[129:] == 0).all()


@requires_hopper
@pytest.mark.parametrize("clamp", [None, 4.0])
def test_layer_fused_gather_bit_identical(clamp, monkeypatch):
    x, idx, w, l1, l2 = make_inputs(300, 512, 256, 8, 4, routing="empty_experts", device="cuda", seed=11)
    dy = torch.randn(300, 512, device="cuda").to(torch.bfloat16)
    results = {}
    for flag in ("0", "cp_async"):
        monkeypatch.setenv("DGE_FUSED_GATHER", flag)
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, l1, l2)]
        y = dge.mega_moe_train(leaves[0], idx, leaves[1], leaves[2], leaves[3], activation_clamp=clamp)
        y.backward(dy)
        results[flag] = (y.detach(), *[t.grad for t in leaves])
    for name, a, b in zip(("y", "dx", "dw", "dl1", "dl2"), results["0"], results["cp_async"]):
        assert a is not None and b is not None, name
        assert torch.equal(a, b), f"{name}: DGE_FUSED_GATHER=cp_async differs from 0"


@requires_hopper
def test_layer_fused_gather_saves_x_not_pool(monkeypatch):
    monkeypatch.setenv("DGE_FUSED_GATHER", "cp_async")
    from deep_gemm_ext import plan
    x, idx, w, l1, l2 = make_inputs(256, 512, 256, 8, 4, device="cuda", seed=2)
    _, made = torch.ops.deep_gemm_ext.mega_moe_fwd(x, idx, w, l1, l2, None, plan.resolve_encoded(x, l1))
    # Made by the forward: h and 5 routing tensors; with a pool of x first, 7.
    assert len(made) == 6 and made[0].shape == (made[-1].shape[0], 2 * 256), "the forward must not build the pool of x"
    monkeypatch.setenv("DGE_FUSED_GATHER", "0")
    _, made = torch.ops.deep_gemm_ext.mega_moe_fwd(x, idx, w, l1, l2, None, plan.resolve_encoded(x, l1))
    assert len(made) == 7 and made[0].shape == (made[-1].shape[0], 512), "without the fused gather the pool is saved"


@requires_hopper
@pytest.mark.parametrize("backward", [None, "1"])
def test_layer_default_gathers_forward_only(backward, monkeypatch):
    """Default: the L1 forward gathers x itself; the bf16 backward builds the pools of dy and x (also
    under DGE_FUSED_GATHER_BACKWARD=1, which applies to fp8 weight gradients only)."""
    from deep_gemm_ext import elementwise
    monkeypatch.delenv("DGE_FUSED_GATHER", raising=False)
    if backward is None:
        monkeypatch.delenv("DGE_FUSED_GATHER_BACKWARD", raising=False)
    else:
        monkeypatch.setenv("DGE_FUSED_GATHER_BACKWARD", backward)
    x, idx, w, l1, l2 = make_inputs(512, 512, 256, 8, 4, device="cuda", seed=4)
    calls = []
    real = elementwise.gather_rows
    monkeypatch.setattr(elementwise, "gather_rows", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    y = dge.mega_moe_train(x, idx, w, l1, l2)
    assert calls == [], "the forward built a pool of x"
    y.backward(torch.randn_like(y))
    assert len(calls) == 2, calls
