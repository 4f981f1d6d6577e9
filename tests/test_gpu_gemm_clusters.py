"""Clusters of 2 CTAs in the SM90 grouped GEMM core (GemmConfig.cluster_n = 2): adjacent M blocks of one
N block share the B tile by TMA multicast. Every output must equal the cluster-1 output bit for bit (the
same wgmmas on the same stage contents in the same K order), and the cluster-1 output is checked against
an fp64 reference (bf16) or the fp8 emulation, so that two equally broken paths cannot pass.

The cases aim at the pairing's tails (kernels/scheduler/sm90_grouped.cuh): N-block counts that are odd
(N = 768 and 384), ragged N and K, an odd number of M blocks (the last pair's second CTA runs its
partner's tile unstored), pairs that straddle two experts (no multicast), blocks no expert owns next
to owned ones, empty experts, one expert, one token and no rows; K-grouped GEMMs with an odd number of
M blocks per expert and experts without rows. Outputs are NaN-poisoned: rows no expert owns must stay
NaN, every other element must be written.

CPU: the knob's checks, the configs' names and sources, the registered cluster configs, and the
compile for sm_90a (0 spills, HGMMA / QGMMA, multicast TMA loads in SASS, no GPU-scope fence in the
consumers' stage release).
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

from deep_gemm_ext import jit
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.jit_kernels import sm90_fp8_grouped_gemm as fg
from deep_gemm_ext.recipes import fp8 as recipe
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_routing

from conftest import requires_compiler, requires_hopper
from gpu_utils import (assert_close_where_owned, assert_same_bits, case_seed, k_grouped_case, k_grouped_reference,
                       m_grouped_case, m_grouped_reference, nan_bf16, ragged_pool, routed_pool, scatter_case)

_CUOBJDUMP = shutil.which("cuobjdump") or (
    "/usr/local/cuda/bin/cuobjdump" if shutil.which("/usr/local/cuda/bin/cuobjdump") else None)


# -- CPU ----------------------------------------------------------------------------------------------------


def test_cluster_knob_names_and_sources():
    c1, c2 = gg.GemmConfig("nt", 256), gg.GemmConfig("nt", 256, cluster_n=2)
    assert c2.name == c1.name + "_c2"
    assert "256, 4, 2, false, 16>" in c2.code() and "256, 4, 1, false, 16>" in c1.code()
    assert c2.code() == c1.code().replace("256, 4, 1, false", "256, 4, 2, false")
    f1 = gg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop="overlap", epilogue="scatter")
    f2 = dataclasses.replace(f1, cluster_n=2)
    assert f2.name == "sm90_fp8_grouped_gemm_nt_n128_s5_scatter_overlap_c2"
    assert f2.code() == f1.code().replace("128, 5, 1, false", "128, 5, 2, false")


@pytest.mark.parametrize("kwargs", [dict(cluster_n=3), dict(cluster_n=0), dict(cluster_n=True),
                                    dict(cluster_n=2, gather_a="cp_async"),
                                    dict(cluster_n=2, paired_n=True)])
def test_cluster_config_rejects(kwargs):
    with pytest.raises(ValueError, match="cluster_n"):
        gg.GemmConfig("nt", 256, **kwargs)


def test_cluster_launcher_checks_come_first():
    a, b = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(1, 256, 64, dtype=torch.bfloat16)
    s, e = torch.zeros(1, dtype=torch.int32), torch.full((1,), 128, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cluster_n=4: expected one of \(1, 2\)"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, s, e, cluster_n=4)
    with pytest.raises(ValueError, match="cluster_n=2 with paired_n=True"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, s, e, paired_n=True, cluster_n=2)
    g = gg.Gather(torch.zeros(128, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="cluster_n=2 with gather="):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, s, e, gather=g, cluster_n=2)
    q = torch.zeros(128, 128).to(fg.FP8_DTYPE)
    with pytest.raises(ValueError, match="cluster_n='2'"):
        fg.m_grouped_fp8_gemm_nt_contiguous(q, torch.ones(128, 1), q[None], torch.ones(1, 1, 1), s, e,
                                            cluster_n="2")


def test_cluster_configs_are_registered():
    names = {c.name for items in jit.registered_configs().values() for c in items}
    for layout in ("nt", "nn", "tn"):
        assert f"sm90_bf16_grouped_gemm_{layout}_n256_s4_c2" in names
    assert "sm90_bf16_grouped_gemm_nt_n256_s4_scatter_weighted_c2" in names
    assert "sm90_bf16_grouped_gemm_nn_n256_s4_scatter_c2" in names
    for mainloop in ("", "_overlap"):
        for epilogue in ("", "_scatter", "_scatter_weighted"):
            assert f"sm90_fp8_grouped_gemm_nt_n128_s5{epilogue}{mainloop}_c2" in names


_CLUSTER_CONFIGS = [c for c in gg._all_configs() if c.cluster_n == 2] + [c for c in fg._configs() if c.cluster_n == 2]


@requires_compiler
@pytest.mark.parametrize("config", _CLUSTER_CONFIGS, ids=[c.name for c in _CLUSTER_CONFIGS])
def test_cluster_configs_compile(config):
    kernel = config.kernel()
    usage = kernel.resources()
    assert usage and all(u.spill_bytes == 0 for u in usage), f"{config.name}: {usage}"
    assert config.smem_bytes() == dataclasses.replace(config, cluster_n=1).smem_bytes()
    log = (kernel.entry.path / "ptxas.log").read_text()
    assert "wgmma.mma_async instructions are serialized" not in log, f"{config.name}: {log[-2000:]}"
    if _CUOBJDUMP is None:
        pytest.skip("cuobjdump not installed: compile checked, SASS not")
    sass = subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout
    mma = f"QGMMA.64x{config.block_n}x32.F32.E4M3.E4M3" if config.dtype == "fp8" else "HGMMA.64x256x16.F32.BF16"
    assert mma in sass, config.name
    # Half of B per CTA by multicast, the rest (A, B of pairs that do not share) by plain loads.
    assert "UTMALDG.2D.MULTICAST" in sass and re.search(r"UTMALDG\.2D \[", sass), config.name
    # The consumers' remote stage release is a plain SYNCS.ARRIVE: the only GPU-scope fences are the
    # two cluster barriers at the kernel's start and end.
    assert "SYNCS.ARRIVE.TRANS64.RED" in sass, config.name
    assert sass.count("MEMBAR.ALL.GPU") == 2, f"{config.name}: {sass.count('MEMBAR.ALL.GPU')} GPU-scope fences"


# -- GPU ----------------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _same_bits(c1: torch.Tensor, c2: torch.Tensor, what: str) -> None:
    assert_same_bits(c1, c2, what, "cluster 2 differs from cluster 1")


_M_POOLS = [("hand", 0), ("uniform", 777), ("zipf", 600), ("empty_experts", 500), ("one_expert", 300),
            ("uniform", 1)]
# (N, K): odd N-block counts at 256-wide tiles (768) and 128-wide ones (384), ragged N, ragged K.
_M_SHAPES = [(768, 512), (1024, 256), (384, 320), (200, 136)]


def _pool(kind: str, tokens: int, seed: int):
    """"hand": every tail of the pairing over 11 used blocks (gpu_utils.ragged_pool): pairs (0,1) e0; (2,3)
    e1; (4,5) e1 and a block no expert owns (the second CTA runs its partner's tile unstored); (6,7) e3;
    (8,9) e3 | e4 (straddling: no multicast); (10, -) e5 and no block (past ends[-1]); expert 2 empty; one
    pool block past ends[-1]."""
    if kind == "hand":
        return ragged_pool()
    return routed_pool(tokens, 16, 4, kind, seed)


@requires_hopper
@pytest.mark.parametrize("kind,tokens", _M_POOLS)
@pytest.mark.parametrize("n,k", _M_SHAPES)
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_bf16_m_grouped_clusters(kind, tokens, n, k, layout):
    c = m_grouped_case(kind, tokens, n, k, layout, _pool)
    c1 = c.fn(c.a, c.b, c.starts, c.ends, nan_bf16(c.rows, n))
    c2 = c.fn(c.a, c.b, c.starts, c.ends, nan_bf16(c.rows, n), cluster_n=2)
    _same_bits(c1, c2, c.what)
    assert_close_where_owned(c2, m_grouped_reference(c.a, c.w_of, c.starts, c.ends, n), c.what)


@requires_hopper
@pytest.mark.parametrize("kind,tokens", _M_POOLS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_bf16_scatter_clusters(kind, tokens, weighted, layout):
    if kind == "hand":
        pytest.skip("the scatter epilogues take a routed pool (row_to_slot)")
    seed = case_seed(kind, tokens, weighted, layout)
    n = 768
    c = scatter_case(kind, tokens, n, 512, layout, weighted, seed)
    meta = c.meta
    what = f"{layout} scatter weighted={weighted} {kind} T={tokens} seed={seed}"
    c1 = c.fn(c.a, c.b, meta.starts, meta.ends, nan_bf16(c.slots, n), scatter=c.scatter)
    c2 = c.fn(c.a, c.b, meta.starts, meta.ends, nan_bf16(c.slots, n), scatter=c.scatter, cluster_n=2)
    _same_bits(c1, c2, what)
    store = c.fn(c.a, c.b, meta.starts, meta.ends, nan_bf16(c.rows, n))
    assert_close_where_owned(c2, c.reference(), what)
    if not weighted:  # the unweighted scatter moves the stored rows unchanged
        live = meta.slot_to_row >= 0
        assert torch.equal(_bits(c2[live]), _bits(store[meta.slot_to_row[live].long()])), what


@requires_hopper
@pytest.mark.parametrize("kind,tokens", [("uniform", 777), ("empty_experts", 500), ("one_expert", 300),
                                         ("uniform", 1)])
@pytest.mark.parametrize("m,n", [(384, 768), (256, 1024), (640, 200)])
def test_bf16_k_grouped_clusters(kind, tokens, m, n):
    """M = 384 and 640: an odd number of M blocks per expert (the last pair's second CTA duplicates)."""
    c = k_grouped_case(kind, tokens, m, n)
    starts, ends, a, b, what = c.starts, c.ends, c.a, c.b, c.what
    c1 = gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends, nan_bf16(16, m, n))
    c2 = gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends, nan_bf16(16, m, n), cluster_n=2)
    _same_bits(c1, c2, what)
    ref = k_grouped_reference(a, b, starts, ends)
    assert not torch.isnan(c2.float()).any(), f"{what}: elements left unwritten"
    err = ((c2.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < 1e-2, f"{what}: rel error {err:.2e}"


def _fp8_operands(rows: int, k: int, e: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, k, generator=g).cuda()
    w = torch.randn(e, n, k, generator=g).cuda()
    a_q, sa = recipe.quantize_rows(a)
    b_q, sb = recipe.quantize_weight_blocks(w)
    return a_q.contiguous(), sa.contiguous(), b_q.contiguous(), sb.contiguous()


@requires_hopper
@pytest.mark.parametrize("kind,tokens", _M_POOLS)
@pytest.mark.parametrize("n,k", [(768, 512), (384, 272), (200, 144), (2048, 768)])
@pytest.mark.parametrize("mainloop", fg.MAINLOOP_SCHEDULES)
def test_fp8_m_grouped_clusters(kind, tokens, n, k, mainloop):
    seed = case_seed(kind, tokens, n, k, mainloop)
    starts, ends, rows = _pool(kind, tokens, seed)
    a_q, sa, b_q, sb = _fp8_operands(rows, k, starts.shape[0], n, seed)
    what = f"fp8 {mainloop} {kind} T={tokens} N={n} K={k} seed={seed}"
    run = fg.m_grouped_fp8_gemm_nt_contiguous
    c1 = run(a_q, sa, b_q, sb, starts, ends, nan_bf16(rows, n), mainloop=mainloop)
    c2 = run(a_q, sa, b_q, sb, starts, ends, nan_bf16(rows, n), mainloop=mainloop, cluster_n=2)
    _same_bits(c1, c2, what)
    emu = recipe.emulate_grouped_gemm_nt(a_q, sa, b_q, sb, starts, ends)
    ref = torch.full((rows, n), float("nan"), dtype=torch.float64, device="cuda")
    for s, t in zip(starts.tolist(), ends.tolist()):
        ref[s:t] = emu[s:t].double()
    assert_close_where_owned(c2, ref, what, tol=2e-2)


@requires_hopper
@pytest.mark.parametrize("kind,tokens", [("uniform", 777), ("zipf", 600), ("empty_experts", 500)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mainloop", fg.MAINLOOP_SCHEDULES)
def test_fp8_scatter_clusters(kind, tokens, weighted, mainloop):
    seed = case_seed(kind, tokens, weighted, mainloop)
    g = torch.Generator().manual_seed(seed)
    idx = make_routing(tokens, 16, 4, kind, generator=g).cuda()
    meta = compute_routing_torch(idx, 16, gg.GROUP_ALIGNMENT)
    rows, n, k, slots = meta.num_pool_rows, 384, 512, tokens * 4
    a_q, sa, b_q, sb = _fp8_operands(rows, k, 16, n, seed)
    weights = torch.rand(tokens, 4, generator=g).cuda() if weighted else None
    scatter = gg.Scatter(meta.row_to_slot, slots, weights)
    what = f"fp8 {mainloop} scatter weighted={weighted} {kind} T={tokens} seed={seed}"
    run = fg.m_grouped_fp8_gemm_nt_contiguous
    c1 = run(a_q, sa, b_q, sb, meta.starts, meta.ends, nan_bf16(slots, n), scatter=scatter, mainloop=mainloop)
    c2 = run(a_q, sa, b_q, sb, meta.starts, meta.ends, nan_bf16(slots, n), scatter=scatter, mainloop=mainloop,
             cluster_n=2)
    _same_bits(c1, c2, what)
    live = meta.slot_to_row >= 0
    assert not torch.isnan(c2[live].float()).any(), f"{what}: live slots left unwritten"
    assert torch.isnan(c2[~live].float()).all(), f"{what}: unused slots written"


@requires_hopper
def test_clusters_without_rows():
    starts = torch.zeros(4, dtype=torch.int32, device="cuda")
    a = torch.zeros(0, 256, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4, 768, 256, device="cuda").to(torch.bfloat16)
    assert gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, starts, cluster_n=2).shape == (0, 768)
    # Rows in the pool, none owned by an expert: nothing written.
    a = torch.randn(256, 256, device="cuda").to(torch.bfloat16)
    out = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, starts, nan_bf16(256, 768), cluster_n=2)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()


@requires_hopper
def test_cluster_grid_is_whole_clusters(monkeypatch, capfd):
    monkeypatch.setenv("DGE_PRINT_CONFIGS", "1")
    starts, ends, rows = routed_pool(777, 16, 4, "uniform", 3)
    a = torch.randn(rows, 256, device="cuda").to(torch.bfloat16)
    b = torch.randn(16, 768, 256, device="cuda").to(torch.bfloat16)
    gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, cluster_n=2)
    err = capfd.readouterr().err
    grid = int(re.search(r"_c2: .* grid=(\d+) cluster=2", err).group(1))
    assert grid % 2 == 0 and 2 <= grid <= jit.num_sms(torch.device("cuda"))
