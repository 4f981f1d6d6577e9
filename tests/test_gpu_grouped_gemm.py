"""SM90 bf16 grouped GEMM core (kernels/impls/sm90_bf16_grouped_gemm.cuh) against torch.

CPU: argument checks, rendered configs (and their compile, where nvcc is installed).
GPU (Hopper): every layout on routed pools (uniform, skewed, empty experts, one expert, no tokens)
against an fp32 torch reference, with NaN-poisoned outputs.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from deep_gemm_ext import jit
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_routing

from conftest import requires_hopper
from gpu_utils import assert_close_where_owned, m_grouped_reference, nan_bf16, routed_pool, scatter_case



# -- CPU ----------------------------------------------------------------------------------------------------


def test_rejects_wrong_dtype_and_device():
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    b = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    starts = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="a: dtype torch.float32"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a.float(), b, starts, starts)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, starts)
    with pytest.raises(ValueError, match="expected 3 dimensions"):
        gg.m_grouped_bf16_gemm_nn_contiguous(a, b[0], starts, starts)
    with pytest.raises(TypeError, match="b: dtype torch.float16"):
        gg.k_grouped_bf16_gemm_tn_contiguous(a, a.half(), starts, starts)


def test_configs_render_one_kernel_each():
    configs = gg.configs()
    names = [c[0] for c in configs]
    assert len(names) == len(set(names))
    for name, code, is_gemm in configs:
        assert is_gemm and code.count("sm90_grouped_gemm_kernel<") == 1, name
        assert code.count("DGE_EXPORT_SMEM_BYTES(") == 1, name


def test_template_argument_types_follow_the_declared_epilogue_args():
    # The rendered pack is the declared list: the launch tuple is packed from the same list.
    for config in gg._all_configs():
        declared = config.args[len(gg.CORE_ARGS):]
        assert f"dge::gemm::MainloopBF16, Epilogue, {jit.render_types(declared)}>);" in config.code(), config.name


def test_pack_args_checks_every_declared_type():
    import ctypes
    args = gg.GemmConfig("nt", 256, epilogue="scatter").args[len(gg.CORE_ARGS):]
    out = torch.zeros(4, 8, dtype=torch.bfloat16)
    slots = torch.zeros(4, dtype=torch.int32)
    packed = jit.pack_args("k", args, out=out, row_to_slot=slots, weights=None, num_rows=4, num_slots=4, out_cols=8)
    assert packed[0] is out and packed[1] is slots and packed[2].value == 0
    assert [type(v) for v in packed[3:]] == [ctypes.c_uint32] * 3 and packed[5].value == 8
    with pytest.raises(TypeError, match=r"'out' \(__nv_bfloat16\*\): expected a torch.bfloat16 tensor, got a torch.float32"):
        jit.pack_args("k", args, out=out.float(), row_to_slot=slots, weights=None, num_rows=4, num_slots=4, out_cols=8)
    with pytest.raises(TypeError, match=r"'num_rows' \(uint32_t\): expected an int in \[0, 2\*\*32\), got -1"):
        jit.pack_args("k", args, out=out, row_to_slot=slots, weights=None, num_rows=-1, num_slots=4, out_cols=8)
    with pytest.raises(TypeError, match=r"missing \['out_cols'\], unexpected \['n'\]"):
        jit.pack_args("k", args, out=out, row_to_slot=slots, weights=None, num_rows=4, num_slots=4, n=8)
    with pytest.raises(TypeError, match=r"'row_to_slot' \(const int\*\): expected a torch.int32 tensor, got NoneType"):
        jit.pack_args("k", args, out=out, row_to_slot=None, weights=None, num_rows=4, num_slots=4, out_cols=8)
    with pytest.raises(ValueError, match="ctype='int64_t'"):
        jit.render_types((jit.KernelArg("x", "int64_t"),))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_smem_is_read_from_the_kernel():
    # SmemLayout<BLOCK_N, stages, EpilogueStoreBF16>::kTotalBytes, as exported by the kernel source.
    assert gg.GemmConfig("nt", 256).smem_bytes() == 231488
    assert gg.GemmConfig("nt", 128).smem_bytes() == 231520


def test_block_n_choice():
    assert gg.select_tile(1536).block_n == 256
    assert gg.select_tile(384).block_n == 128
    assert gg.select_tile(768).block_n == 256
    assert gg.select_tile(100).block_n == 128
    assert gg.select_tile(640, divides=True).block_n == 128
    assert gg.select_tile(512, divides=True).block_n == 256
    with pytest.raises(ValueError, match=r"N=200: no tile of \[256, 128\] divides it"):
        gg.select_tile(200, divides=True)
    assert gg.TILES == (gg.Tile(256, 4), gg.Tile(128, 6))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_configs_compile_without_spills():
    for name, code, _ in gg.configs():
        kernel = jit.build(name, code)
        usage = kernel.resources()
        assert usage and all(u.spill_bytes == 0 for u in usage), f"{name}: {usage}"


# -- GPU ----------------------------------------------------------------------------------------------------


def _pool(num_tokens: int, num_experts: int, top_k: int, routing: str, cols: int, seed: int):
    """A routed pool [P, cols] bf16: real rows random, padding rows zero; starts/ends int32."""
    g = torch.Generator().manual_seed(seed)
    idx = make_routing(num_tokens, num_experts, top_k, routing, generator=g).cuda()
    meta = compute_routing_torch(idx, num_experts, gg.GROUP_ALIGNMENT)
    rows = meta.num_pool_rows
    data = torch.randn(rows, cols, generator=g).cuda().to(torch.bfloat16)
    data[meta.row_to_slot < 0] = 0
    return data, meta.starts, meta.ends


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _check_m_grouped(out, ref_fn, a, starts, ends):
    ends_h, starts_h = ends.tolist(), starts.tolist()
    used = ends_h[-1] if ends_h else 0
    assert torch.isnan(out[used:].float()).all(), "rows past the last expert were written"
    for e, (s, t) in enumerate(zip(starts_h, ends_h)):
        if t > s:
            ref = ref_fn(e, a[s:t].float())
            got = out[s:t]
            assert not torch.isnan(got.float()).any(), f"expert {e}: unwritten rows"
            err = _rel_err(got, ref)
            assert err < 5e-3, f"expert {e}: rel error {err:.2e}"


@requires_hopper
@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts", "one_expert"])
@pytest.mark.parametrize("n,k", [(1536, 2048), (1000, 1000), (384, 256)])
def test_nt(routing, n, k):
    a, starts, ends = _pool(777, 16, 4, routing, k, seed=n + k)
    b = (torch.randn(16, n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, out)
    _check_m_grouped(out, lambda e, ae: ae @ b[e].float().T, a, starts, ends)


@requires_hopper
@pytest.mark.parametrize("num_experts", [1, 255, 256, 257, 600])
def test_nt_expert_ranges_with_gaps(num_experts):
    # The scheduler finds each 128-row block's expert in the ranges staged in shared memory (up to
    # sched::kStagedExperts = 256 experts) or in global memory (more): the same tiles either way. Ranges
    # of 0-3 blocks with unowned blocks between some of them: those rows and the rows past the last
    # range stay unwritten.
    g = torch.Generator().manual_seed(num_experts)
    blocks = torch.randint(0, 4, (num_experts,), generator=g)
    gaps = torch.randint(0, 2, (num_experts,), generator=g) * (torch.rand(num_experts, generator=g) < 0.3)
    starts_h, ends_h, row = [], [], 0
    for e in range(num_experts):
        row += 128 * int(gaps[e])
        starts_h.append(row)
        row += 128 * int(blocks[e])
        ends_h.append(row)
    rows, n, k = row + 256, 192, 256
    a = torch.randn(rows, k, generator=g).cuda().to(torch.bfloat16)
    b = (torch.randn(num_experts, n, k, generator=g) / k ** 0.5).cuda().to(torch.bfloat16)
    starts = torch.tensor(starts_h, dtype=torch.int32, device="cuda")
    ends = torch.tensor(ends_h, dtype=torch.int32, device="cuda")
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, out)
    owned = torch.zeros(rows, dtype=torch.bool)
    for e, (s, t) in enumerate(zip(starts_h, ends_h)):
        if t > s:
            owned[s:t] = True
            err = _rel_err(out[s:t], a[s:t].float() @ b[e].float().T)
            assert err < 5e-3, f"expert {e}: rel error {err:.2e}"
    assert torch.isnan(out[~owned.cuda()].float()).all(), "rows no expert owns were written"


@requires_hopper
def test_nt_paired_matches_plain():
    a, starts, ends = _pool(2048, 8, 8, "uniform", 512, seed=3)
    b = (torch.randn(8, 1536, 512, device="cuda") / 512 ** 0.5).to(torch.bfloat16)
    plain = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends)
    paired = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, paired_n=True)
    used = ends[-1].item()
    assert torch.equal(plain[:used], paired[:used])


@requires_hopper
def test_nt_many_tiles_per_cta():
    # A long pool with a short K: each persistent CTA runs many tiles with a one-k-block mainloop between
    # epilogues, so a slice's first chunks reuse staging buffers that the previous tile's stores may still
    # be reading. The store epilogue and the weighted combine epilogue, against fp64.
    starts, ends, rows = routed_pool(16384, 8, 2, "uniform", 41)
    g = torch.Generator().manual_seed(41)
    n, k = 2048, 64
    a = torch.randn(rows, k, generator=g).cuda().to(torch.bfloat16)
    b = (torch.randn(8, n, k, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
    out = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, nan_bf16(rows, n))
    assert_close_where_owned(out, m_grouped_reference(a, lambda e: b[e].T, starts, ends, n), "many tiles, store")
    c = scatter_case("uniform", 16384, n, k, "nt", True, 42, num_experts=8, top_k=2)
    out = c.fn(c.a, c.b, c.meta.starts, c.meta.ends, nan_bf16(c.slots, n), scatter=c.scatter)
    assert_close_where_owned(out, c.reference(), "many tiles, combine")


@requires_hopper
@pytest.mark.parametrize("routing", ["uniform", "empty_experts"])
@pytest.mark.parametrize("n,k", [(768, 2048), (2048, 1536), (200, 128)])
def test_nn(routing, n, k):
    a, starts, ends = _pool(999, 12, 4, routing, k, seed=n * 3 + k)
    b = (torch.randn(12, k, n, device="cuda") / k ** 0.5).to(torch.bfloat16)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gg.m_grouped_bf16_gemm_nn_contiguous(a, b, starts, ends, out)
    _check_m_grouped(out, lambda e, ae: ae @ b[e].float(), a, starts, ends)


@requires_hopper
@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts"])
@pytest.mark.parametrize("m,n", [(1536, 2048), (256, 384)])
def test_tn(routing, m, n):
    a, starts, ends = _pool(1500, 10, 4, routing, m, seed=m + n)
    g = torch.Generator().manual_seed(m * n)
    b = torch.randn(a.shape[0], n, generator=g).cuda().to(torch.bfloat16)
    out = torch.full((10, m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends, out)
    for e, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
        if t == s:
            assert (out[e] == 0).all(), f"expert {e} without rows: expected zeros"
        else:
            err = _rel_err(out[e], a[s:t].float().T @ b[s:t].float())
            assert err < 5e-3, f"expert {e}: rel error {err:.2e}"


@requires_hopper
def test_print_configs_knob(monkeypatch, capfd):
    a, starts, ends = _pool(300, 4, 2, "uniform", 256, seed=5)
    b = torch.randn(4, 384, 256, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv("DGE_PRINT_CONFIGS", "1")
    gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends)
    err = capfd.readouterr().err
    assert "sm90_bf16_grouped_gemm_nt_n128_s6: M=" in err and "N=384 K=256 block_n=128 stages=6" in err
    assert f"smem={gg.GemmConfig('nt', 128).smem_bytes()}" in err
    monkeypatch.setenv("DGE_PRINT_CONFIGS", "0")
    gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends)
    assert "sm90_bf16_grouped_gemm" not in capfd.readouterr().err


@requires_hopper
def test_no_tokens_writes_nothing():
    a, starts, ends = _pool(0, 8, 4, "uniform", 256, seed=0)
    b = torch.randn(8, 256, 256, device="cuda").to(torch.bfloat16)
    out = torch.full((a.shape[0], 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, out)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()


@requires_hopper
def test_shape_errors():
    a = torch.zeros(256, 100, dtype=torch.bfloat16, device="cuda")
    b = torch.zeros(2, 64, 100, dtype=torch.bfloat16, device="cuda")
    se = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="K=100: expected a multiple of 8"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, se, se)
    with pytest.raises(ValueError, match="expected 2 like starts/ends|contracts over"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a[:, :64].contiguous(), b[:1, :, :64].contiguous(), se, se)
    with pytest.raises(ValueError, match="M=100: expected a multiple of 128"):
        gg.k_grouped_bf16_gemm_tn_contiguous(a, a, se, se)
