"""Four epilogue staging buffers per consumer warpgroup in the SM90 grouped GEMM core
(GemmConfig.epilogue_buffers = 4): the store and combine epilogues stage a whole 64 x 256 slice before its
stores, on 3 smem stages instead of 4. Every output must equal the 2-buffer output bit for bit (the same
accumulators rounded and stored the same way), and the 2-buffer output is checked against an fp64
reference, so that two equally broken paths cannot pass. Each GPU test also checks which kernel ran (the
launcher's config names), so that a silent fallback to the default kernel cannot pass either.

Cases: routed pools (uniform, zipf, empty experts, one expert, one token) and a hand-made pool with an
empty expert and a block past ends[-1]; N a multiple of 256 and not (200, 1000: the last tile ragged), K
ragged (136, 320); the combine epilogues (weighted and not); K-grouped GEMMs with experts without rows;
paired N tiles, the gathering loaders and clusters of 2 under 4 buffers; N that picks a 128-wide tile
(the default kernel, by design); no rows. Outputs are NaN-poisoned: rows no expert owns must stay NaN,
every other element must be written.

CPU: the knob's checks and messages, the configs' names, stages and sources, the registered configs, the
compile for sm_90a (0 spills, HGMMA 64x256x16, the exported smem within 227 KiB, two named-barrier syncs
per tile in SASS), and that 4 buffers with 4 stages do not fit (SmemLayout's static_assert).
"""
from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
import torch

from deep_gemm_ext import jit
from deep_gemm_ext.jit import compiler
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg

from conftest import requires_compiler, requires_hopper
from gpu_utils import (assert_close_where_owned, assert_same_bits, case_seed, find_cuobjdump, gather_case,
                       k_grouped_case, k_grouped_reference, m_grouped_case, m_grouped_reference, nan_bf16,
                       ragged_pool, routed_pool, scatter_case)


_CUOBJDUMP = find_cuobjdump()
_SMEM_LIMIT = 232448  # 227 KiB of an SM90 CTA (SmemLayout's static_assert)


# -- CPU ----------------------------------------------------------------------------------------------------


def test_staging_knob_names_stages_and_sources():
    e2, e4 = gg.GemmConfig("nt", 256), gg.GemmConfig("nt", 256, epilogue_buffers=4)
    assert e2.epilogue_buffers == 2 and e2.stages == 4 and e4.stages == 3
    assert e4.name == "sm90_bf16_grouped_gemm_nt_n256_s3_e4"
    assert e2.name == "sm90_bf16_grouped_gemm_nt_n256_s4"  # the default's name (and cubin) unchanged
    assert "using Epilogue = dge::gemm::EpilogueStoreBF16;" in e2.code()
    assert "using Epilogue = dge::gemm::EpilogueStoreBF16Buffers<4>;" in e4.code()
    assert e4.code() == e2.code().replace("256, 4, 1, false", "256, 3, 1, false").replace(
        "EpilogueStoreBF16;", "EpilogueStoreBF16Buffers<4>;")
    for layout, epilogue, cpp in (("nt", "scatter_weighted", "EpilogueScatterSlotsBuffers<true, 4>"),
                                  ("nn", "scatter", "EpilogueScatterSlotsBuffers<false, 4>")):
        c = gg.GemmConfig(layout, 256, epilogue=epilogue, epilogue_buffers=4)
        assert c.name == f"sm90_bf16_grouped_gemm_{layout}_n256_s3_{epilogue}_e4"
        assert f"using Epilogue = dge::gemm::{cpp};" in c.code()
        assert "EpilogueScatterSlots<" in gg.GemmConfig(layout, 256, epilogue=epilogue).code()
    tn = gg.GemmConfig("tn", 256, epilogue_buffers=4)
    assert tn.name == "sm90_bf16_grouped_gemm_tn_n256_s3_e4" and "KGroupedContiguous" in tn.code()
    c2 = gg.GemmConfig("nt", 256, cluster_n=2, epilogue_buffers=4)
    assert c2.name == "sm90_bf16_grouped_gemm_nt_n256_s3_c2_e4" and "256, 3, 2, false" in c2.code()
    # The other knobs compose with it.
    assert gg.GemmConfig("nt", 256, gather_a="cp_async", epilogue_buffers=4).name.endswith("_s3_gather_cpasync_e4")
    assert gg.GemmConfig("nt", 256, paired_n=True, epilogue_buffers=4).name.endswith("_s3_paired_e4")


@pytest.mark.parametrize("kwargs", [dict(epilogue_buffers=3), dict(epilogue_buffers=0), dict(epilogue_buffers=8),
                                    dict(epilogue_buffers=True), dict(epilogue_buffers="4"),
                                    dict(epilogue_buffers=4.0)])
def test_staging_config_rejects_values(kwargs):
    with pytest.raises(ValueError, match=r"epilogue_buffers=.*expected one of \(2, 4\)"):
        gg.GemmConfig("nt", 256, **kwargs)


@pytest.mark.parametrize("kwargs,wrong", [
    (dict(layout="nt", block_n=128), "block_n"),
    (dict(layout="nn", block_n=128, epilogue="scatter"), "block_n"),
    (dict(layout="nt", block_n=128, dtype="fp8"), "dtype"),
])
def test_staging_config_rejects_combinations(kwargs, wrong):
    with pytest.raises(ValueError, match=rf"epilogue_buffers=4 takes .*got .*'{wrong}'"):
        gg.GemmConfig(**kwargs, epilogue_buffers=4)


def test_staging_launcher_checks_come_first():
    """The knob is checked before the tensors' devices (CPU tensors here)."""
    a, b = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(1, 256, 64, dtype=torch.bfloat16)
    s, e = torch.zeros(1, dtype=torch.int32), torch.full((1,), 128, dtype=torch.int32)
    for bad in (3, True, None, "4", 4.0):
        msg = re.escape(f"epilogue_buffers={bad!r}: expected one of (2, 4)")
        with pytest.raises(ValueError, match=msg):
            gg.m_grouped_bf16_gemm_nt_contiguous(a, b, s, e, epilogue_buffers=bad)
        with pytest.raises(ValueError, match=msg):
            gg.m_grouped_bf16_gemm_nn_contiguous(a, b.transpose(1, 2).contiguous(), s, e, epilogue_buffers=bad)
        with pytest.raises(ValueError, match=msg):
            gg.k_grouped_bf16_gemm_tn_contiguous(a, a, s, e, epilogue_buffers=bad)
    # On CPU tensors a valid value gets as far as the device check.
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, s, e, epilogue_buffers=4)


def test_staging_falls_back_where_the_tile_is_128_wide():
    assert gg._staged_buffers(4, 256) == 4
    assert gg._staged_buffers(4, 128) == 2
    assert gg._staged_buffers(2, 256) == 2
    assert gg.select_tile(384).block_n == 128 and gg.select_tile(200).block_n == 256
    assert gg.select_tile(1000).block_n == 256


def test_staging_configs_are_registered():
    names = {c.name for items in jit.registered_configs().values() for c in items}
    for layout in ("nt", "nn", "tn"):
        assert f"sm90_bf16_grouped_gemm_{layout}_n256_s3_e4" in names
    assert "sm90_bf16_grouped_gemm_nt_n256_s3_scatter_weighted_e4" in names
    assert "sm90_bf16_grouped_gemm_nn_n256_s3_scatter_e4" in names
    # Registering them changed no default config.
    assert "sm90_bf16_grouped_gemm_nt_n256_s4" in names and "sm90_bf16_grouped_gemm_nt_n128_s6" in names


_STAGED_CONFIGS = [c for c in gg._all_configs() if c.epilogue_buffers == 4]


def _sass(kernel) -> str:
    return subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout


def _named_barrier_syncs(sass: str) -> int:
    """bar.sync with a thread count (the warpgroups' named barriers; __syncthreads has none)."""
    return len(re.findall(r"BAR\.SYNC(?:\.DEFER_BLOCKING)? R\d+, 0x80", sass))


@requires_compiler
@pytest.mark.parametrize("config", _STAGED_CONFIGS, ids=[c.name for c in _STAGED_CONFIGS])
def test_staging_configs_compile(config):
    kernel = config.kernel()
    usage = kernel.resources()
    assert usage and all(u.spill_bytes == 0 for u in usage), f"{config.name}: {usage}"
    # 3 stages of 48 KiB + 4 buffers x 8 KiB x 2 warpgroups, the barriers, the scheduler's expert table, the
    # 1024 of alignment slack.
    assert config.smem_bytes() == 3 * 48 * 1024 + 64 * 1024 + 2 * 3 * 8 + 1024 + 1024 <= _SMEM_LIMIT
    log = (kernel.entry.path / "ptxas.log").read_text()
    assert "wgmma.mma_async instructions are serialized" not in log, f"{config.name}: {log[-2000:]}"
    if _CUOBJDUMP is None:
        pytest.skip("cuobjdump not installed: compile checked, SASS not")
    sass = _sass(kernel)
    assert "HGMMA.64x256x16.F32.BF16" in sass, config.name
    # The whole slice staged: two named-barrier syncs per tile (buffers free, slice staged) instead of
    # two per chunk (eight at 256 wide), and no wait for a store inside the tile.
    assert _named_barrier_syncs(sass) == 2, f"{config.name}: {_named_barrier_syncs(sass)} named-barrier syncs"
    if config.epilogue == "store":
        assert sass.count("UTMASTG.2D") == 4, config.name
        assert not re.search(r"DEPBAR\.LE SB0, 0x1\b", sass), f"{config.name}: waits for a store inside the tile"
        default = dataclasses.replace(config, epilogue_buffers=2)
        assert _named_barrier_syncs(_sass(default.kernel())) == 8, default.name


@requires_compiler
def test_four_buffers_do_not_fit_four_stages():
    """4 x 48 KiB stages + 64 KiB of staging exceed 227 KiB: SmemLayout's static_assert refuses them."""
    code = gg.GemmConfig("nt", 256, epilogue_buffers=4).code().replace("256, 3, 1, false", "256, 4, 1, false")
    assert "256, 4, 1, false" in code
    with pytest.raises(RuntimeError, match="SmemLayout"):
        compiler.compile_cached("sm90_bf16_grouped_gemm_nt_n256_s4_e4_overflow", code, "sm_90a")


# -- GPU ----------------------------------------------------------------------------------------------------


def _same_bits(e2: torch.Tensor, e4: torch.Tensor, what: str) -> None:
    assert_same_bits(e2, e4, what, "4 buffers differ from 2")


def _check_ran(names: list[str], staged: bool, what: str) -> None:
    assert len(names) == 2, f"{what}: launches {names}"
    assert not names[0].endswith("_e4"), f"{what}: the 2-buffer run launched {names[0]}"
    if staged:
        assert names[1].endswith("_e4") and "_n256_s3" in names[1], f"{what}: the 4-buffer run launched {names[1]}"
    else:
        assert names[1] == names[0], f"{what}: expected the default kernel under both, got {names}"


def _pool(kind: str, tokens: int, seed: int):
    return ragged_pool() if kind == "hand" else routed_pool(tokens, 16, 4, kind, seed)




_M_POOLS = [("hand", 0), ("uniform", 777), ("zipf", 600), ("empty_experts", 500), ("one_expert", 300),
            ("uniform", 1)]
# (N, K): N a multiple of 256 (768, 1024), ragged N on 256-wide tiles (200, 1000), ragged K (136, 320),
# and N = 384, which a 128-wide tile pads less (the default kernel under both).
_M_SHAPES = [(768, 512), (1024, 256), (200, 136), (1000, 320), (384, 320)]


@requires_hopper
@pytest.mark.parametrize("kind,tokens", _M_POOLS)
@pytest.mark.parametrize("n,k", _M_SHAPES)
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_m_grouped_staging(kind, tokens, n, k, layout, launched):
    c = m_grouped_case(kind, tokens, n, k, layout, _pool)
    e2 = c.fn(c.a, c.b, c.starts, c.ends, nan_bf16(c.rows, n))
    e4 = c.fn(c.a, c.b, c.starts, c.ends, nan_bf16(c.rows, n), epilogue_buffers=4)
    _check_ran(launched, gg.select_tile(n).block_n == 256, c.what)
    _same_bits(e2, e4, c.what)
    assert_close_where_owned(e2, m_grouped_reference(c.a, c.w_of, c.starts, c.ends, n), c.what)


@requires_hopper
@pytest.mark.parametrize("kind,tokens", [("uniform", 777), ("zipf", 600), ("empty_experts", 500),
                                         ("one_expert", 300), ("uniform", 1)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("layout,n", [("nt", 768), ("nn", 1000)])
def test_scatter_staging(kind, tokens, weighted, layout, n, launched):
    seed = case_seed(kind, tokens, weighted, layout, n)
    c = scatter_case(kind, tokens, n, 512, layout, weighted, seed)
    what = f"{layout} scatter weighted={weighted} {kind} T={tokens} N={n} seed={seed}"
    e2 = c.fn(c.a, c.b, c.meta.starts, c.meta.ends, nan_bf16(c.slots, n), scatter=c.scatter)
    e4 = c.fn(c.a, c.b, c.meta.starts, c.meta.ends, nan_bf16(c.slots, n), scatter=c.scatter, epilogue_buffers=4)
    _check_ran(launched, True, what)
    _same_bits(e2, e4, what)
    assert_close_where_owned(e4, c.reference(), what)


@requires_hopper
@pytest.mark.parametrize("kind,tokens", [("uniform", 777), ("empty_experts", 500), ("one_expert", 300),
                                         ("uniform", 1)])
@pytest.mark.parametrize("m,n", [(384, 768), (256, 1000), (640, 200)])
def test_k_grouped_staging(kind, tokens, m, n, launched):
    c = k_grouped_case(kind, tokens, m, n)
    starts, ends, a, b, what = c.starts, c.ends, c.a, c.b, c.what
    e2 = gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends, nan_bf16(16, m, n))
    e4 = gg.k_grouped_bf16_gemm_tn_contiguous(a, b, starts, ends, nan_bf16(16, m, n), epilogue_buffers=4)
    _check_ran(launched, True, what)
    _same_bits(e2, e4, what)
    ref = k_grouped_reference(a, b, starts, ends)
    assert not torch.isnan(e4.float()).any(), f"{what}: elements left unwritten"
    err = ((e2.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < 1e-2, f"{what}: rel error {err:.2e}"


@requires_hopper
@pytest.mark.parametrize("variant", ["paired", "gather_cp_async", "cluster"])
def test_staging_with_other_knobs(variant, launched):
    """4 buffers under paired N tiles, the gathering loader and clusters of 2: the same bits as the
    default kernel of that variant."""
    seed = case_seed("variant", variant)
    n = 1024
    c = gather_case(seed, n, 320)
    meta, rows, x, b, pool, top_k = c.meta, c.rows, c.x, c.b, c.pool, c.top_k
    kw, a = {}, pool
    if variant == "paired":
        kw = dict(paired_n=True)
    elif variant == "cluster":
        kw = dict(cluster_n=2)
    else:
        kw, a = dict(gather=gg.Gather(meta.row_to_slot, top_k, variant.removeprefix("gather_"))), x
    what = f"{variant} seed={seed}"
    run = gg.m_grouped_bf16_gemm_nt_contiguous
    e2 = run(a, b, meta.starts, meta.ends, nan_bf16(rows, n), **kw)
    e4 = run(a, b, meta.starts, meta.ends, nan_bf16(rows, n), epilogue_buffers=4, **kw)
    _check_ran(launched, True, what)
    _same_bits(e2, e4, what)
    assert_close_where_owned(e4, m_grouped_reference(pool, lambda e: b[e].T, meta.starts, meta.ends, n), what)


@requires_hopper
def test_staging_without_rows(launched):
    starts = torch.zeros(4, dtype=torch.int32, device="cuda")
    a = torch.zeros(0, 256, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4, 768, 256, device="cuda").to(torch.bfloat16)
    assert gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, starts, epilogue_buffers=4).shape == (0, 768)
    assert launched == []
    # Rows in the pool, none owned by an expert: nothing written.
    a = torch.randn(256, 256, device="cuda").to(torch.bfloat16)
    out = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, starts, nan_bf16(256, 768), epilogue_buffers=4)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()
    # K-grouped without rows: zeros, no launch.
    out = gg.k_grouped_bf16_gemm_tn_contiguous(a[:0], a[:0], starts, starts, nan_bf16(4, 256, 256), epilogue_buffers=4)
    torch.cuda.synchronize()
    assert (out.float() == 0).all()


@requires_hopper
def test_staging_many_tiles_per_cta(launched):
    """Many tiles per persistent CTA, so that each tile's first chunk waits for the previous tile's
    stores: a long pool with a short K (a short mainloop between epilogues)."""
    seed = case_seed("many")
    starts, ends, rows = routed_pool(16384, 8, 2, "uniform", seed)
    g = torch.Generator().manual_seed(seed)
    n, k = 2048, 64
    a = torch.randn(rows, k, generator=g).cuda().to(torch.bfloat16)
    b = (torch.randn(8, n, k, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
    what = f"many tiles seed={seed}"
    e2 = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, nan_bf16(rows, n))
    e4 = gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, nan_bf16(rows, n), epilogue_buffers=4)
    _check_ran(launched, True, what)
    _same_bits(e2, e4, what)
    assert_close_where_owned(e4, m_grouped_reference(a, lambda e: b[e].T, starts, ends, n), what)
