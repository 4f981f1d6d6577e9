"""SwiGLU epilogues of the SM90 grouped GEMM (kernels/epilogue/sm90_swiglu.cuh) against the
unfused composition: the grouped GEMM, then deep_gemm_ext.elementwise.swiglu_forward / swiglu_backward in fp32
torch, and an fp64 reference of both.

CPU: argument checks, supported shapes, rendered configs (and, with nvcc, their compile: no spills, wgmma).
GPU (Hopper): routed pools (uniform, Zipf, empty experts, one expert, no tokens) with NaN-poisoned outputs;
then the Qwen3-30B-A3B shape. The timings of fused against GEMM + elementwise kernel are
scripts/bench_fused_epilogues.py.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from deep_gemm_ext import elementwise
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import WORKLOADS, make_routing, rel_err

from conftest import IS_HOPPER, requires_hopper

NAN = float("nan")


# -- CPU ----------------------------------------------------------------------------------------------------


def test_supported_intermediate():
    assert gg.swiglu_epilogue_supported(768) and gg.swiglu_epilogue_supported(128)
    assert gg.swiglu_epilogue_supported(1536) and gg.swiglu_epilogue_supported(2048)
    assert not gg.swiglu_epilogue_supported(0)
    assert not gg.swiglu_epilogue_supported(64)
    assert not gg.swiglu_epilogue_supported(700)


def test_rejects_wrong_dtype_and_device():
    x = torch.zeros(128, 64, dtype=torch.bfloat16)
    l1 = torch.zeros(2, 256, 64, dtype=torch.bfloat16)
    se = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="x_pool: dtype torch.float32"):
        gg.m_grouped_bf16_gemm_nt_swiglu(x.float(), l1, se, se)
    with pytest.raises(ValueError, match="x_pool: on cpu, expected a CUDA tensor"):
        gg.m_grouped_bf16_gemm_nt_swiglu(x, l1, se, se)
    l2 = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    h = torch.zeros(128, 256, dtype=torch.bfloat16)
    w = torch.zeros(128, dtype=torch.float32)
    with pytest.raises(TypeError, match="row_weight: dtype torch.bfloat16"):
        gg.m_grouped_bf16_gemm_nn_swiglu_bwd(x, l2, h, w.bfloat16(), se, se)
    with pytest.raises(TypeError, match="h: dtype torch.float32"):
        gg.m_grouped_bf16_gemm_nn_swiglu_bwd(x, l2, h.float(), w, se, se)
    with pytest.raises(ValueError, match="dy_pool: on cpu"):
        gg.m_grouped_bf16_gemm_nn_swiglu_bwd(x, l2, h, w, se, se)


def test_fused_configs_render():
    names = [c[0] for c in gg.configs()]
    for clamp in ("", "_clamp"):
        assert f"sm90_bf16_grouped_gemm_nt_n256_s4_paired_swiglu_fwd{clamp}" in names
        assert f"sm90_bf16_grouped_gemm_nn_n256_s4_swiglu_bwd{clamp}" in names
        assert f"sm90_bf16_grouped_gemm_nn_n128_s6_swiglu_bwd{clamp}" in names
    code = gg.GemmConfig("nn", 256, epilogue="swiglu_bwd", clamp=True).code()
    assert "EpilogueSwigluBackward<true>" in code and "epilogue/sm90_swiglu.cuh" in code
    (_, code, is_gemm), = gg.row_weight_grad_configs()
    assert not is_gemm and code.count("swiglu_row_weight_grad_kernel<") == 1


def _fused_configs():
    return [c for c in gg.configs() if "swiglu" in c[0]] + gg.row_weight_grad_configs()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("config", _fused_configs(), ids=lambda c: c[0])
def test_fused_configs_compile(config):
    from deep_gemm_ext.jit import compile_cached
    name, code, is_gemm = config
    entry = compile_cached(name, code, want_ptx=is_gemm)
    usage = entry.resources()
    assert usage and all(u.spill_bytes == 0 for u in usage), f"{name}: {usage}"
    if is_gemm:
        assert "wgmma.mma_async" in entry.ptx_path.read_text(), f"{name}: no wgmma in the PTX"


# -- GPU: inputs and references -----------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def prebuilt():
    """On a Hopper GPU, compile every kernel these tests launch in parallel once (the tests then hit the cache)."""
    if not IS_HOPPER:
        return
    from concurrent.futures import ThreadPoolExecutor

    from deep_gemm_ext import jit
    from deep_gemm_ext.jit_kernels import swiglu
    configs = [c[:2] for c in gg.configs() + gg.row_weight_grad_configs() + swiglu.configs()]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda c: jit.build(*c), configs))


class Layer:
    """A routed layer on the GPU: pools of x and dy (padding rows zero), weights, per-row top-k weights."""

    def __init__(self, num_tokens, num_experts, top_k, hidden, inter, routing, seed):
        g = torch.Generator().manual_seed(seed)
        idx = make_routing(num_tokens, num_experts, top_k, routing, generator=g).cuda()
        meta = compute_routing_torch(idx, num_experts, gg.GROUP_ALIGNMENT)
        slot = meta.row_to_slot.long()
        real = slot >= 0
        token = torch.where(real, slot // top_k, 0)
        x = torch.randn(max(num_tokens, 1), hidden, generator=g).cuda()
        dy = torch.randn(max(num_tokens, 1), hidden, generator=g).cuda()
        topk_w = (torch.rand(max(num_tokens, 1) * top_k, generator=g) + 0.05).cuda()
        self.x_pool = torch.where(real[:, None], x[token], 0).to(torch.bfloat16)
        self.dy_pool = torch.where(real[:, None], dy[token], 0).to(torch.bfloat16)
        self.row_weight = torch.where(real, topk_w[slot.clamp(min=0)], 0).float().contiguous()
        self.l1 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).cuda().to(torch.bfloat16)
        self.l2 = (torch.randn(num_experts, hidden, inter, generator=g) / hidden ** 0.5).cuda().to(torch.bfloat16)
        self.starts, self.ends = meta.starts, meta.ends
        self.ranges = [(s, t) for s, t in zip(meta.starts.tolist(), meta.ends.tolist()) if t > s]
        self.rows = meta.num_pool_rows
        self.used = meta.ends[-1].item() if num_experts else 0
        self.owned = torch.zeros(self.rows, dtype=torch.bool, device="cuda")
        for s, t in self.ranges:
            self.owned[s:t] = True
        self.inter = inter

    def per_expert(self, a: torch.Tensor, fn) -> torch.Tensor:
        """out[rows of e] = fn(e, a[rows of e]); rows no expert owns are 0."""
        out = None
        for e, (s, t) in enumerate(zip(self.starts.tolist(), self.ends.tolist())):
            if t > s:
                block = fn(e, a[s:t])
                if out is None:
                    out = block.new_zeros(self.rows, block.shape[1])
                out[s:t] = block
        return out if out is not None else a.new_zeros(self.rows, 0)

    def h64(self) -> torch.Tensor:
        return self.per_expert(self.x_pool.double(), lambda e, a: a @ self.l1[e].double().T)

    def da64(self) -> torch.Tensor:
        return self.per_expert(self.dy_pool.double(), lambda e, a: a @ self.l2[e].double())


def _check_written(label: str, out: torch.Tensor, layer: Layer) -> None:
    """Every owned row written (no NaN left from the poison), rows past the last expert untouched."""
    owned = out[layer.owned].float()
    bad = torch.isnan(owned).any(-1) if owned.dim() > 1 else torch.isnan(owned)
    assert not bad.any(), f"{label}: {int(bad.sum())} owned rows hold NaN (unwritten?)"
    tail = out[layer.used:].float()
    assert torch.isnan(tail).all(), f"{label}: rows past ends[-1]={layer.used} were written"


def _assert_close_bf16(label: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one bf16 rounding of ref (relative 2^-7 covers one ulp at any magnitude)."""
    diff = (got.double() - ref.double()).abs()
    bound = ref.double().abs() * 2.0 ** -7 + 1e-6
    bad = diff > bound
    assert not bad.any(), (f"{label}: {int(bad.sum())} of {bad.numel()} elements beyond one bf16 ulp; worst "
                           f"|diff| {diff.max().item():.3e} at {divmod(int(diff.argmax()), got.shape[-1])}")


def _assert_no_worse(label: str, fused_err: float, unfused_err: float, bound: float) -> None:
    print(f"  {label:<14} rel err vs fp64: fused {fused_err:.3e}  unfused {unfused_err:.3e}")
    assert fused_err <= 1.05 * unfused_err + 1e-7, f"{label}: fused {fused_err:.3e} > 1.05 x unfused {unfused_err:.3e}"
    assert fused_err < bound, f"{label}: fused rel err {fused_err:.3e} >= {bound:.0e}"


def _swiglu_jit():
    from deep_gemm_ext.jit_kernels import swiglu
    return swiglu


# -- GPU: forward ---------------------------------------------------------------------------------------------


def _check_forward(layer: Layer, clamp, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.full((layer.rows, 2 * layer.inter), NAN, dtype=torch.bfloat16, device="cuda")
    act = torch.full((layer.rows, layer.inter), NAN, dtype=torch.bfloat16, device="cuda")
    gg.m_grouped_bf16_gemm_nt_swiglu(layer.x_pool, layer.l1, layer.starts, layer.ends, clamp, h_out=h, act_out=act)
    torch.cuda.synchronize()
    _check_written("h", h, layer)
    _check_written("act", act, layer)
    own = layer.owned

    # h: the same accumulators as the plain GEMM through the same paired tiles, rounded the same way.
    plain = gg.m_grouped_bf16_gemm_nt_contiguous(layer.x_pool, layer.l1, layer.starts, layer.ends, paired_n=True)
    assert torch.equal(h[own], plain[own]), "h differs from the plain paired GEMM"
    # act: bit-identical to the JIT elementwise kernel on the same h.
    act_jit = _swiglu_jit().swiglu_forward(h[own].contiguous(), clamp)
    mismatch = (act[own] != act_jit).sum().item()
    assert mismatch == 0, f"act differs from swiglu_forward_kernel(h) in {mismatch} elements"

    # The unfused composition in fp32 torch, and both against fp64.
    act_unfused = elementwise.swiglu_forward(plain[own], clamp)
    _assert_close_bf16("act vs unfused", act[own], act_unfused)
    from deep_gemm_ext.reference import swiglu
    act64 = swiglu(layer.h64()[own], clamp)
    _assert_no_worse("act", rel_err(act[own], act64), rel_err(act_unfused, act64), 1e-2)
    return h, act


@requires_hopper
@pytest.mark.parametrize("clamp", [None, 1.5])
@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts", "one_expert"])
@pytest.mark.parametrize("hidden,inter", [(512, 384), (256, 768)])
def test_forward_swiglu(routing, clamp, hidden, inter, monkeypatch):
    layer = Layer(777, 16, 4, hidden, inter, routing, seed=hidden + inter)
    _check_forward(layer, clamp, monkeypatch)


# -- GPU: backward --------------------------------------------------------------------------------------------


def _poison_next(shape, dtype) -> None:
    """A freed NaN block of this size in torch's cache: the launcher's next allocation of it reuses it."""
    torch.full(shape, NAN, dtype=dtype, device="cuda")


def _run_backward(layer: Layer, h, clamp, block_n=None):
    outs = (torch.full((layer.rows, 2 * layer.inter), NAN, dtype=torch.bfloat16, device="cuda"),
            torch.full((layer.rows, layer.inter), NAN, dtype=torch.bfloat16, device="cuda"),
            torch.full((layer.rows,), NAN, dtype=torch.float32, device="cuda"))
    parts = layer.inter // (block_n or (256 if layer.inter % 256 == 0 else 128))
    _poison_next((layer.rows, parts), torch.float32)  # the partials buffer
    dh, dw, act_w = gg.m_grouped_bf16_gemm_nn_swiglu_bwd(
        layer.dy_pool, layer.l2, h, layer.row_weight, layer.starts, layer.ends, clamp, block_n=block_n,
        dh_out=outs[0], act_w_out=outs[1], d_row_weight_out=outs[2])
    assert dh is outs[0] and act_w is outs[1] and dw is outs[2]
    torch.cuda.synchronize()
    return dh, dw, act_w


def _check_backward(layer: Layer, h, clamp, monkeypatch, block_n=None) -> None:
    dh, dw, act_w = _run_backward(layer, h, clamp, block_n)
    _check_written("dh", dh, layer)
    _check_written("act_w", act_w, layer)
    assert not torch.isnan(dw).any(), f"d_row_weight: {int(torch.isnan(dw).sum())} NaN (unwritten rows?)"
    assert (dw[~layer.owned] == 0).all(), "d_row_weight: rows no expert owns must be 0"
    own = layer.owned
    w = layer.row_weight

    # Deterministic: a second run is bit-identical.
    again = _run_backward(layer, h, clamp, block_n)
    for label, a, b in zip(("dh", "d_row_weight", "act_w"), (dh, dw, act_w), again):
        assert torch.equal(a[own], b[own]), f"{label}: two runs differ"

    # act_w does not depend on da: bit-identical to the JIT elementwise kernel.
    da_bf16 = gg.m_grouped_bf16_gemm_nn_contiguous(layer.dy_pool, layer.l2, layer.starts, layer.ends)
    _, _, act_w_jit = _swiglu_jit().swiglu_backward(h[own].contiguous(), da_bf16[own].contiguous(), w[own], clamp)
    mismatch = (act_w[own] != act_w_jit).sum().item()
    assert mismatch == 0, f"act_w differs from swiglu_backward_kernel in {mismatch} elements"

    # Unfused composition: bf16 GEMM output, then the fp32 torch SwiGLU backward.
    dh_u, dw_u, act_w_u = elementwise.swiglu_backward(h[own], da_bf16[own], w[own], clamp)
    _assert_close_bf16("act_w vs unfused", act_w[own], act_w_u)
    assert rel_err(dh[own], dh_u) < 1e-2, f"dh vs unfused: rel err {rel_err(dh[own], dh_u):.3e}"
    # fp64 reference from the same bf16 h.
    dh64, dw64, _ = elementwise.swiglu_backward(h[own].double(), layer.da64()[own], w[own].double(), clamp)
    _assert_no_worse("dh", rel_err(dh[own], dh64), rel_err(dh_u, dh64), 1e-2)
    _assert_no_worse("d_row_weight", rel_err(dw[own], dw64), rel_err(dw_u, dw64), 1e-4)


@requires_hopper
@pytest.mark.parametrize("clamp", [None, 1.5])
@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts", "one_expert"])
@pytest.mark.parametrize("hidden,inter", [(512, 384), (256, 768)])
def test_backward_swiglu(routing, clamp, hidden, inter, monkeypatch):
    layer = Layer(777, 16, 4, hidden, inter, routing, seed=3 * hidden + inter)
    h = gg.m_grouped_bf16_gemm_nt_contiguous(layer.x_pool, layer.l1, layer.starts, layer.ends)
    _check_backward(layer, h, clamp, monkeypatch)


@requires_hopper
@pytest.mark.parametrize("clamp", [None, 1.5])
def test_backward_swiglu_block_n_128(clamp, monkeypatch):
    layer = Layer(1000, 8, 4, 256, 768, "zipf", seed=11)
    h = gg.m_grouped_bf16_gemm_nt_contiguous(layer.x_pool, layer.l1, layer.starts, layer.ends)
    _check_backward(layer, h, clamp, monkeypatch, block_n=128)


@requires_hopper
@pytest.mark.parametrize("num_tokens", [0, 1])
def test_no_or_one_token(num_tokens, monkeypatch):
    layer = Layer(num_tokens, 8, 4, 256, 256, "uniform", seed=5)
    h, _ = _check_forward(layer, None, monkeypatch) if layer.ranges else (None, None)
    if h is None:  # no expert owns a row: nothing is written, d_row_weight is all zero
        h = torch.zeros(layer.rows, 512, dtype=torch.bfloat16, device="cuda")
        fwd = gg.m_grouped_bf16_gemm_nt_swiglu(layer.x_pool, layer.l1, layer.starts, layer.ends,
                                               h_out=torch.full_like(h, NAN),
                                               act_out=torch.full_like(h[:, :256], NAN))
        assert all(torch.isnan(t.float()).all() for t in fwd), "no owned rows, yet the forward wrote"
        dh, dw, act_w = _run_backward(layer, h, None)
        assert torch.isnan(dh.float()).all() and torch.isnan(act_w.float()).all()
        assert (dw == 0).all()
    else:
        _check_backward(layer, h, None, monkeypatch)


@requires_hopper
def test_shape_errors():
    x = torch.zeros(256, 128, dtype=torch.bfloat16, device="cuda")
    se = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="2I=192, expected a positive multiple of 256"):
        gg.m_grouped_bf16_gemm_nt_swiglu(x, torch.zeros(2, 192, 128, dtype=torch.bfloat16, device="cuda"), se, se)
    l2 = torch.zeros(2, 128, 192, dtype=torch.bfloat16, device="cuda")
    h = torch.zeros(256, 384, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(256, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="I=192, expected a positive multiple of 128"):
        gg.m_grouped_bf16_gemm_nn_swiglu_bwd(x, l2, h, w, se, se)
    l2 = torch.zeros(2, 128, 384, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"h: shape \(256, 384\), expected \(256, 768\)"):
        gg.m_grouped_bf16_gemm_nn_swiglu_bwd(x, l2, h, w, se, se)
    h = torch.zeros(256, 768, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="block_n=256: expected 128 or 256 dividing I=384"):
        gg.m_grouped_bf16_gemm_nn_swiglu_bwd(x, l2, h, w, se, se, block_n=256)
    with pytest.raises(ValueError, match="clamp=-1.0"):
        gg.m_grouped_bf16_gemm_nn_swiglu_bwd(x, l2, h, w, se, se, -1.0)


# -- GPU: Qwen3-30B-A3B shape ----------------------------------------------------------------------------


@requires_hopper
@pytest.mark.parametrize("clamp", [None, 7.0])
def test_qwen3_30b_shape_matches_unfused(clamp):
    w = WORKLOADS["qwen3-30b-a3b-t16384"]
    layer = Layer(w.num_tokens, w.num_experts, w.top_k, w.hidden, w.intermediate, "uniform", seed=0)
    x, dy, l1, l2, rw, s, t = (layer.x_pool, layer.dy_pool, layer.l1, layer.l2, layer.row_weight, layer.starts,
                               layer.ends)
    swiglu = _swiglu_jit()

    # Against the unfused GPU composition, every owned row.
    h, act = gg.m_grouped_bf16_gemm_nt_swiglu(x, l1, s, t, clamp)
    plain = gg.m_grouped_bf16_gemm_nt_contiguous(x, l1, s, t, paired_n=True)
    own = layer.owned
    assert torch.equal(h[own], plain[own]), "h differs from the plain paired GEMM"
    assert torch.equal(act[own], swiglu.swiglu_forward(h[own].contiguous(), clamp)), "act differs from the JIT kernel"
    da = gg.m_grouped_bf16_gemm_nn_contiguous(dy, l2, s, t)
    ref = swiglu.swiglu_backward(h[own].contiguous(), da[own].contiguous(), rw[own], clamp)
    for block_n in (256, 128):
        got = gg.m_grouped_bf16_gemm_nn_swiglu_bwd(dy, l2, h, rw, s, t, clamp, block_n=block_n)
        errs = [rel_err(g[own], r) for g, r in zip(got, ref)]
        print(f"\n  block_n {block_n}: rel diff vs unfused  dh {errs[0]:.2e}  d_row_weight {errs[1]:.2e}  "
              f"act_w {errs[2]:.2e}")
        assert errs[0] < 1e-2 and errs[1] < 1e-2 and errs[2] == 0, f"block_n {block_n}: {errs}"
