"""The deferred store and combine epilogues of the SM90 grouped GEMM core (GemmConfig.deferred_store, the
launchers' ``deferred_store=``, DGE_DEFERRED_STORE): a slice's accumulators are packed to bf16 (the
combine's times their weights) when its mainloop ends and its stores go out two chunks at a time while
the next tile's first k-blocks are in the tensor cores. Every output must equal the inline epilogue's bit
for bit (the same bf16 rounding of the same accumulators, to the same places), and the inline output is
checked against an fp64 reference,
so that two equally broken paths cannot pass. Each GPU test checks which kernel ran (the launcher's
config names), so that a silent fallback to the default kernel cannot pass either.

The bookkeeping has edges the cases aim at: a tile with one k-block (K = 64: part 1 of the previous slice
has no k-block to ride on and goes out after the mainloop), tiles without k-blocks (K-grouped experts
without rows: the previous slice goes out whole), the last tile of a CTA (stored after the loop), many
tiles per CTA with a short K, 128-wide tiles (one part), ragged N and K, the L1 forward's gathering
loader, the combine epilogues (weighted and not, with unused slots), and no rows at all. Outputs are NaN-poisoned: rows no expert owns must stay NaN, every other
element must be written.

CPU: the knob's checks and messages, the configs' names and sources, the registered configs, the compile
for sm_90a (0 spills, no serialized wgmma, the stores inside the k-loop in SASS).
"""
from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext import _env, jit
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.testing import make_inputs

from conftest import requires_compiler, requires_hopper
from gpu_utils import (assert_close_where_owned, assert_same_bits, case_seed, find_cuobjdump, gather_case,
                       k_grouped_case, k_grouped_reference, m_grouped_case, m_grouped_reference, nan_bf16,
                       ragged_pool, routed_pool, scatter_case)


_CUOBJDUMP = find_cuobjdump()


# -- CPU ----------------------------------------------------------------------------------------------------


def test_deferred_config_names_and_sources():
    plain, deferred = gg.GemmConfig("nt", 256), gg.GemmConfig("nt", 256, deferred_store=True)
    assert deferred.name == "sm90_bf16_grouped_gemm_nt_n256_s4_deferred" and deferred.stages == plain.stages
    assert plain.name == "sm90_bf16_grouped_gemm_nt_n256_s4"  # the default's name (and cubin) unchanged
    assert deferred.code() == plain.code().replace("EpilogueStoreBF16;", "EpilogueStoreBF16Deferred;")
    assert gg.GemmConfig("tn", 128, deferred_store=True).name == "sm90_bf16_grouped_gemm_tn_n128_s6_deferred"
    assert gg.GemmConfig("nt", 256, gather_a="cp_async", deferred_store=True).name.endswith(
        "_s4_gather_cpasync_deferred")
    for layout, epilogue, cpp in (("nt", "scatter_weighted", "EpilogueScatterSlotsDeferred<true>"),
                                  ("nn", "scatter", "EpilogueScatterSlotsDeferred<false>")):
        c = gg.GemmConfig(layout, 256, epilogue=epilogue, deferred_store=True)
        assert c.name == f"sm90_bf16_grouped_gemm_{layout}_n256_s4_{epilogue}_deferred"
        assert f"using Epilogue = dge::gemm::{cpp};" in c.code()


@pytest.mark.parametrize("kwargs,wrong", [
    (dict(layout="nt", block_n=128, dtype="fp8"), "dtype"),
    (dict(layout="nt", block_n=256, epilogue_buffers=4), "epilogue_buffers"),
    (dict(layout="nn", block_n=256, epilogue="scatter", epilogue_buffers=4), "epilogue_buffers"),
    (dict(layout="tn", block_n=256, cluster_n=2), "cluster_n"),
])
def test_deferred_config_rejects_combinations(kwargs, wrong):
    with pytest.raises(ValueError, match=rf"deferred_store=True takes .*got .*'{wrong}'"):
        gg.GemmConfig(**kwargs, deferred_store=True)


@pytest.mark.parametrize("bad", [1, 0, "1", None])
def test_deferred_config_rejects_non_bools(bad):
    with pytest.raises(ValueError, match=re.escape(f"deferred_store={bad!r}, expected a bool")):
        gg.GemmConfig("nt", 256, deferred_store=bad)


def test_deferred_launcher_checks_come_first():
    """The knob is checked before the tensors' devices (CPU tensors here)."""
    a, b = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(1, 256, 64, dtype=torch.bfloat16)
    s, e = torch.zeros(1, dtype=torch.int32), torch.full((1,), 128, dtype=torch.int32)
    nt, nn, tn = (gg.m_grouped_bf16_gemm_nt_contiguous, gg.m_grouped_bf16_gemm_nn_contiguous,
                  gg.k_grouped_bf16_gemm_tn_contiguous)
    bt = b.transpose(1, 2).contiguous()
    for bad in (1, "yes", None):
        msg = re.escape(f"deferred_store={bad!r}: expected a bool")
        with pytest.raises(ValueError, match=msg):
            nt(a, b, s, e, deferred_store=bad)
        with pytest.raises(ValueError, match=msg):
            nn(a, bt, s, e, deferred_store=bad)
        with pytest.raises(ValueError, match=msg):
            tn(a, a, s, e, deferred_store=bad)
    for call, label in ((lambda: nn(a, bt, s, e, epilogue_buffers=4, deferred_store=True), "epilogue_buffers=4"),
                        (lambda: tn(a, a, s, e, cluster_n=2, deferred_store=True), "cluster_n=2")):
        with pytest.raises(ValueError, match=re.escape(f"deferred_store=True with {label}")):
            call()
    # On CPU tensors a valid value gets as far as the device check.
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        nt(a, b, s, e, deferred_store=True)


def test_deferred_knob(monkeypatch):
    monkeypatch.delenv("DGE_DEFERRED_STORE", raising=False)
    assert _env.deferred_store() is False
    monkeypatch.setenv("DGE_DEFERRED_STORE", "1")
    assert _env.deferred_store() is True
    monkeypatch.setenv("DGE_DEFERRED_STORE", "0")
    assert _env.deferred_store() is False


_DEFERRED_CONFIGS = [c for c in gg._all_configs() if c.deferred_store]


def test_deferred_configs_are_registered():
    names = {c.name for items in jit.registered_configs().values() for c in items}
    for layout in ("nt", "nn", "tn"):
        for width, stages in ((256, 4), (128, 6)):
            assert f"sm90_bf16_grouped_gemm_{layout}_n{width}_s{stages}_deferred" in names
    assert "sm90_bf16_grouped_gemm_nt_n256_s4_gather_cpasync_deferred" in names
    for width, stages in ((256, 4), (128, 6)):
        assert f"sm90_bf16_grouped_gemm_nt_n{width}_s{stages}_scatter_weighted_deferred" in names
        assert f"sm90_bf16_grouped_gemm_nn_n{width}_s{stages}_scatter_deferred" in names
    assert len(_DEFERRED_CONFIGS) == 12


def _sass(kernel) -> str:
    return subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout


@requires_compiler
@pytest.mark.parametrize("config", _DEFERRED_CONFIGS, ids=[c.name for c in _DEFERRED_CONFIGS])
def test_deferred_configs_compile(config):
    kernel = config.kernel()
    usage = kernel.resources()
    assert usage and all(u.spill_bytes == 0 for u in usage), f"{config.name}: {usage}"
    default = dataclasses.replace(config, deferred_store=False)
    assert config.smem_bytes() == default.smem_bytes()
    log = (kernel.entry.path / "ptxas.log").read_text()
    assert "wgmma.mma_async instructions are serialized" not in log, f"{config.name}: {log[-2000:]}"
    if _CUOBJDUMP is None:
        pytest.skip("cuobjdump not installed: compile checked, SASS not")
    sass = _sass(kernel)
    hgmma = f"HGMMA.64x{config.block_n}x16.F32.BF16"
    assert hgmma in sass, config.name
    # The stores ride on the k-loop: between a k-block's last HGMMA and the wait for it
    # (WARPGROUP.DEPBAR.LE gsb0, 0x1) the SASS has the parts' stmatrix and TMA stores.
    lines = sass.splitlines()
    last_hgmma = max(i for i, line in enumerate(lines) if hgmma in line)
    wait = next(i for i in range(last_hgmma, len(lines)) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in lines[i])
    inside = "\n".join(lines[last_hgmma:wait])
    store = "UTMASTG" if config.epilogue == "store" else "STG.E.128"
    assert store in inside, f"{config.name}: no store between the k-block and its wait"
    # The combine epilogue stages its first part when it packs the slice (its 128-wide slice is one part).
    if config.epilogue == "store" or config.block_n == 256:
        assert "STSM" in inside, f"{config.name}: no staging between the k-block and its wait"


# -- GPU ----------------------------------------------------------------------------------------------------


def _same_bits(plain: torch.Tensor, deferred: torch.Tensor, what: str) -> None:
    assert_same_bits(plain, deferred, what, "the deferred store differs from the inline one")


def _check_ran(names: list[str], what: str) -> None:
    assert len(names) == 2, f"{what}: launches {names}"
    assert not names[0].endswith("_deferred"), f"{what}: the default run launched {names[0]}"
    assert names[1] == names[0] + "_deferred", f"{what}: the deferred run launched {names[1]}"


def _pool(kind: str, tokens: int, seed: int):
    return ragged_pool() if kind == "hand" else routed_pool(tokens, 16, 4, kind, seed)


_M_POOLS = [("hand", 0), ("uniform", 777), ("zipf", 600), ("empty_experts", 500), ("one_expert", 300),
            ("uniform", 1)]
# (N, K): 256-wide tiles (768, 1024; ragged 200, 1000), 128-wide ones (384, 640: one part a slice),
# one k-block (K = 64), ragged K (136, 320).
_M_SHAPES = [(768, 512), (1024, 64), (200, 136), (1000, 320), (384, 320), (640, 64)]


@requires_hopper
@pytest.mark.parametrize("kind,tokens", _M_POOLS)
@pytest.mark.parametrize("n,k", _M_SHAPES)
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_m_grouped_deferred(kind, tokens, n, k, layout, launched):
    c = m_grouped_case(kind, tokens, n, k, layout, _pool)
    plain = c.fn(c.a, c.b, c.starts, c.ends, nan_bf16(c.rows, n))
    deferred = c.fn(c.a, c.b, c.starts, c.ends, nan_bf16(c.rows, n), deferred_store=True)
    _check_ran(launched, c.what)
    _same_bits(plain, deferred, c.what)
    assert_close_where_owned(plain, m_grouped_reference(c.a, c.w_of, c.starts, c.ends, n), c.what)


@requires_hopper
@pytest.mark.parametrize("kind,tokens", [("uniform", 777), ("empty_experts", 500), ("one_expert", 300),
                                         ("uniform", 1), ("uniform", 8)])
@pytest.mark.parametrize("m,n", [(384, 768), (256, 1000), (640, 200), (128, 384)])
def test_k_grouped_deferred(kind, tokens, m, n, launched):
    """Experts without rows are tiles without k-blocks (zeros stored; the previous slice goes out whole
    before them); few tokens give tiles of one k-block."""
    c = k_grouped_case(kind, tokens, m, n)
    starts, ends, a, b, what = c.starts, c.ends, c.a, c.b, c.what
    plain = gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends, nan_bf16(16, m, n))
    deferred = gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends, nan_bf16(16, m, n), deferred_store=True)
    _check_ran(launched, what)
    _same_bits(plain, deferred, what)
    ref = k_grouped_reference(a, b, starts, ends)
    assert not torch.isnan(deferred.float()).any(), f"{what}: elements left unwritten"
    empty = (ends == starts).nonzero().flatten().tolist()
    assert all((deferred[e].float() == 0).all() for e in empty), f"{what}: experts without rows not zero"
    err = ((plain.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < 1e-2, f"{what}: rel error {err:.2e}"


@requires_hopper
@pytest.mark.parametrize("n", [1536, 384])
def test_deferred_with_gather(n, launched):
    """The L1 forward's gathering loader (cp.async, generic-proxy writes) under the deferred store."""
    seed = case_seed("gather", n)
    c = gather_case(seed, n, 320)
    meta, rows, x, b, pool, top_k = c.meta, c.rows, c.x, c.b, c.pool, c.top_k
    gather = gg.Gather(meta.row_to_slot, top_k, "cp_async")
    what = f"gather N={n} seed={seed}"
    run = gg.m_grouped_bf16_gemm_nt_contiguous
    plain = run(x, b, meta.starts, meta.ends, nan_bf16(rows, n), gather=gather)
    deferred = run(x, b, meta.starts, meta.ends, nan_bf16(rows, n), gather=gather, deferred_store=True)
    _check_ran(launched, what)
    _same_bits(plain, deferred, what)
    assert_close_where_owned(deferred, m_grouped_reference(pool, lambda e: b[e].T, meta.starts, meta.ends, n),
                             what)


@requires_hopper
@pytest.mark.parametrize("kind,tokens", [("uniform", 777), ("zipf", 600), ("empty_experts", 500),
                                         ("one_expert", 300), ("uniform", 1), ("unused_slots", 400)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("layout,n,k", [("nt", 768, 512), ("nn", 1000, 64), ("nt", 384, 320), ("nn", 2048, 128)])
def test_scatter_deferred(kind, tokens, weighted, layout, n, k, launched):
    """The combine epilogues deferred: every slot written as by the inline epilogue, bit for bit; 128-wide
    tiles (N = 384: one part), one k-block (K = 64: part 1 goes out after the next mainloop)."""
    seed = case_seed(kind, tokens, weighted, layout, n, k)
    c = scatter_case(kind, tokens, n, k, layout, weighted, seed)
    what = f"{layout} scatter weighted={weighted} {kind} T={tokens} N={n} K={k} seed={seed}"
    plain = c.fn(c.a, c.b, c.meta.starts, c.meta.ends, nan_bf16(c.slots, n), scatter=c.scatter)
    deferred = c.fn(c.a, c.b, c.meta.starts, c.meta.ends, nan_bf16(c.slots, n), scatter=c.scatter,
                    deferred_store=True)
    _check_ran(launched, what)
    _same_bits(plain, deferred, what)
    assert_close_where_owned(deferred, c.reference(), what)


@requires_hopper
def test_deferred_without_rows(launched):
    starts = torch.zeros(4, dtype=torch.int32, device="cuda")
    a = torch.zeros(0, 256, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4, 768, 256, device="cuda").to(torch.bfloat16)
    assert gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, starts, deferred_store=True).shape == (0, 768)
    assert launched == []
    # Rows in the pool, none owned by an expert: nothing written.
    a = torch.randn(256, 256, device="cuda").to(torch.bfloat16)
    out = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, starts, nan_bf16(256, 768), deferred_store=True)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()


@requires_hopper
@pytest.mark.parametrize("k", [64, 128])
def test_deferred_many_tiles_per_cta(k, launched):
    """Many tiles per persistent CTA with one or two k-blocks each: every slice's parts ride on the next
    tile's only k-blocks, or go out after its mainloop."""
    seed = case_seed("many", k)
    starts, ends, rows = routed_pool(16384, 8, 2, "uniform", seed)
    g = torch.Generator().manual_seed(seed)
    n = 2048
    a = torch.randn(rows, k, generator=g).cuda().to(torch.bfloat16)
    b = (torch.randn(8, n, k, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
    what = f"many tiles K={k} seed={seed}"
    plain = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, nan_bf16(rows, n))
    deferred = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, nan_bf16(rows, n), deferred_store=True)
    _check_ran(launched, what)
    _same_bits(plain, deferred, what)
    assert_close_where_owned(plain, m_grouped_reference(a, lambda e: b[e].T, starts, ends, n), what)


def _layer(deferred: str, routing: str, fused_gather: str, monkeypatch, num_tokens=300, seed=11):
    monkeypatch.setenv("DGE_DEFERRED_STORE", deferred)
    monkeypatch.setenv("DGE_FUSED_GATHER", fused_gather)
    x, idx, w, l1, l2 = make_inputs(num_tokens, 512, 256, 8, 4, routing=routing, device="cuda", seed=seed)
    dy = torch.randn(num_tokens, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, l1, l2)]
    y = dge.mega_moe_train(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    y.backward(dy.to(torch.bfloat16))
    return (y.detach(), *[t.grad for t in leaves])


@requires_hopper
@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts", "one_expert", "unused_slots"])
@pytest.mark.parametrize("fused_gather", ["0", "cp_async"])
def test_layer_deferred_store(routing, fused_gather, monkeypatch, launched):
    """The layer under DGE_DEFERRED_STORE=1: y and the four gradients equal the default's bit for bit, and
    all six GEMMs (the store and the combine epilogues) ran the deferred kernels."""
    off = _layer("0", routing, fused_gather, monkeypatch)
    ran_off = list(launched)
    launched.clear()
    on = _layer("1", routing, fused_gather, monkeypatch)
    for name, a, b in zip(("y", "dx", "dw", "dl1", "dl2"), off, on):
        assert torch.equal(a, b), f"{name}: DGE_DEFERRED_STORE=1 differs from 0 ({routing}, gather {fused_gather})"
    assert not any(n.endswith("_deferred") for n in ran_off), ran_off
    deferred = [n for n in launched if n.endswith("_deferred")]
    assert len(deferred) == 6, f"expected the six GEMMs deferred, ran {launched}"
