"""The scheduler's walk of the M-grouped GEMMs: groups of M blocks (GemmConfig.group_m) that the persistent
grid sweeps across all N blocks before the next group, fixed-size or cut within each expert
(GemmConfig.expert_groups). Only the order of the tiles changes, so every output must equal the default
walk's bit for bit (each tile is the same wgmmas on the same operands in the same K order), and the
default output is checked against an fp64 reference (bf16) or the fp8 emulation, so that two equally
broken walks cannot pass.

The cases aim at the walk's tails (kernels/scheduler/sm90_grouped.cuh): a last group with fewer blocks
than group_m, groups that straddle experts, experts of more blocks than a group, blocks no expert owns,
empty experts, one block in all, groups of one block, and clusters of 2 (groups rounded up to pairs).
Outputs are NaN-poisoned: rows no expert owns must stay NaN, every other element must be written.

CPU: the knobs' checks, names and sources, the selection, and the walk's arithmetic (every owned tile
once) on the host mirror of the scheduler (walk_tiles).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.jit_kernels import sm90_fp8_grouped_gemm as fg
from deep_gemm_ext.recipes import fp8 as recipe

from conftest import requires_compiler, requires_hopper
from gpu_utils import (assert_close_where_owned, assert_same_bits, case_seed, gather_case, m_grouped_case,
                       m_grouped_reference, nan_bf16, ragged_pool, routed_pool, scatter_case)

# -- CPU ----------------------------------------------------------------------------------------------------


def test_group_m_names_and_sources():
    base = gg.GemmConfig("nt", 256)
    assert base.group_m == gg.GROUP_M_DEFAULT
    assert base.name == "sm90_bf16_grouped_gemm_nt_n256_s4"  # the default keeps the names of the cache
    for g in gg.GROUP_M_CHOICES:
        c = dataclasses.replace(base, group_m=g)
        assert c.name == base.name + ("" if g == gg.GROUP_M_DEFAULT else f"_g{g}")
        assert c.code() == base.code().replace("256, 4, 1, false, 16>", f"256, 4, 1, false, {g}>")
    f = gg.GemmConfig("nt", 192, dtype="fp8", group_m=4, cluster_n=2)
    assert f.name.endswith("_c2_g4") and "192, 4, 2, false, 4, dge::gemm::ElementType::E4M3>" in f.code()


@pytest.mark.parametrize("g", [0, 3, 64, True, "8", None])
def test_group_m_config_rejects(g):
    with pytest.raises(ValueError, match="group_m"):
        gg.GemmConfig("nt", 256, group_m=g)


def test_group_m_is_m_grouped_only():
    with pytest.raises(ValueError, match="group_m=8 with layout='tn'"):
        gg.GemmConfig("tn", 256, group_m=8)
    with pytest.raises(ValueError, match="group_m=8 with layout='k_nt'"):
        gg.GemmConfig("k_nt", 128, dtype="fp8", group_m=8)


def test_group_m_launcher_checks_come_first():
    a, b = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(1, 256, 64, dtype=torch.bfloat16)
    s, e = torch.zeros(1, dtype=torch.int32), torch.full((1,), 128, dtype=torch.int32)
    for fn in (gg.m_grouped_bf16_gemm_nt_contiguous, gg.m_grouped_bf16_gemm_nn_contiguous):
        with pytest.raises(ValueError, match=r"group_m=3: expected None or one of \(1, 2, 4, 8, 16, 32\)"):
            fn(a, b, s, e, group_m=3)
    q = torch.zeros(128, 128).to(fg.FP8_DTYPE)
    with pytest.raises(ValueError, match="group_m=True"):
        fg.m_grouped_fp8_gemm_nt_contiguous(q, torch.ones(128, 1), q[None], torch.ones(1, 1, 1), s, e, group_m=True)


def test_expert_groups_names_sources_and_rejects():
    base = gg.GemmConfig("nn", 256, epilogue="scatter")
    c = dataclasses.replace(base, expert_groups=True, group_m=8)
    assert c.name == base.name + "_g8_eg"
    assert "256, 4, 1, false, 8, dge::gemm::ElementType::BF16, 0, true>" in c.code()
    f = gg.GemmConfig("nt", 192, dtype="fp8", shape_k=2048, expert_groups=True)
    assert f.name.endswith("_k2048_eg")
    assert "192, 4, 1, false, 16, dge::gemm::ElementType::E4M3, 2048, true>" in f.code()
    f = gg.GemmConfig("nt", 128, dtype="fp8", expert_groups=True)
    assert "128, 5, 1, false, 16, dge::gemm::ElementType::E4M3, 0, true>" in f.code()
    for kwargs in (dict(cluster_n=2), dict(gather_a="cp_async", await_rows=True)):
        with pytest.raises(ValueError, match="expert_groups=True takes"):
            gg.GemmConfig("nt", 256, expert_groups=True, **kwargs)
    with pytest.raises(ValueError, match="expert_groups=True takes an M-grouped layout"):
        gg.GemmConfig("tn", 256, expert_groups=True)
    with pytest.raises(ValueError, match="expert_groups=1"):
        gg.GemmConfig("nt", 256, expert_groups=1)


def test_expert_groups_launcher_checks():
    a, b = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(1, 256, 64, dtype=torch.bfloat16)
    s, e = torch.zeros(1, dtype=torch.int32), torch.full((1,), 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="expert_groups=True with cluster_n=2"):
        gg.m_grouped_bf16_gemm_nn_contiguous(a, b, s, e, cluster_n=2, expert_groups=True)
    with pytest.raises(ValueError, match="expert_groups='yes': expected None or a bool"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, s, e, expert_groups="yes")
    q = torch.zeros(128, 128).to(fg.FP8_DTYPE)
    with pytest.raises(ValueError, match="expert_groups=True with cluster_n=2"):
        fg.m_grouped_fp8_gemm_nt_contiguous(q, torch.ones(128, 1), q[None], torch.ones(1, 1, 1), s, e, cluster_n=2,
                                            expert_groups=True)


def test_select_walk():
    e16 = (gg.GROUP_M_DEFAULT, True)
    fixed = (gg.GROUP_M_DEFAULT, False)
    # (pool rows, experts, one expert's weight bytes) -> walk: the pools of the layer's workloads (T K + E 127
    # rows) and each GEMM's weights. DeepSeek-V3 T 8192 (bf16 and fp8) and Qwen3-235B T 8192: within experts;
    # Qwen3-30B: fixed groups (its experts' weights stay in the L2).
    cases = [((8192 * 8 + 256 * 127, 256, 2048 * 7168 * 2), e16), ((8192 * 8 + 256 * 127, 256, 2048 * 7168), e16),
             ((8192 * 8 + 128 * 127, 128, 4096 * 1536 * 2), e16),
             ((16384 * 8 + 128 * 127, 128, 1536 * 2048 * 2), fixed), ((4096 * 8 + 128 * 127, 128, 1536 * 2048 * 2), fixed),
             ((16384 * 8 + 128 * 127, 128, 4096 * 1536 * 2), fixed),  # large weights, but many blocks per expert
             ((0, 0, 0), fixed), ((128, 1, 1 << 30), e16)]
    for (rows, experts, weight_bytes), walk in cases:
        assert gg.select_walk(rows, experts, weight_bytes) == walk, (rows, experts, weight_bytes)
        # Where the launch cannot take groups within experts, resolve_walk does not choose them.
        assert gg.resolve_walk(None, None, rows, experts, weight_bytes, cluster_n=2) == (walk[0], False)
        assert gg.resolve_walk(None, None, rows, experts, weight_bytes, awaits=True) == (walk[0], False)
        assert gg.resolve_walk(None, None, rows, experts, weight_bytes) == walk
        assert gg.resolve_walk(4, False, rows, experts, weight_bytes) == (4, False)
        assert gg.resolve_walk(4, True, rows, experts, weight_bytes) == (4, True)


_EG_CONFIGS = [gg.GemmConfig("nt", 256, gather_a="cp_async", expert_groups=True),
               gg.GemmConfig("nt", 128, gather_a="cp_async", expert_groups=True, group_m=8),
               gg.GemmConfig("nt", 256, epilogue="scatter_weighted", expert_groups=True),
               gg.GemmConfig("nn", 256, epilogue="scatter", expert_groups=True, group_m=8),
               gg.GemmConfig("nn", 256, expert_groups=True),
               gg.GemmConfig("nt", 192, dtype="fp8", shape_k=2048, expert_groups=True),
               gg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop="overlap", epilogue="scatter", expert_groups=True)]


@requires_compiler
@pytest.mark.parametrize("config", _EG_CONFIGS, ids=[c.name for c in _EG_CONFIGS])
def test_expert_groups_compile_without_spills(config):
    usage = config.kernel().resources()
    assert usage and all(u.spill_bytes == 0 for u in usage), f"{config.name}: {usage}"
    plain = dataclasses.replace(config, expert_groups=False, group_m=gg.GROUP_M_DEFAULT)
    assert config.smem_bytes() == plain.smem_bytes()


@pytest.mark.parametrize("seed", range(6))
def test_walks_hand_out_every_owned_tile_once(seed):
    g = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(1, 12, (1,), generator=g))
    sizes = torch.randint(0, 40, (experts,), generator=g).tolist()
    starts, ends, row = [], [], 0
    for i, size in enumerate(sizes):
        row += 128 * int(torch.randint(0, 2, (1,), generator=g))  # blocks no expert owns between experts
        starts.append(row)
        row += -(-size // 8) * 128 if i % 3 else size * 128  # experts of 0..39 blocks
        ends.append(row)
    n_blocks = int(torch.randint(1, 6, (1,), generator=g))
    owned = {(m, n, e) for e, (s, t) in enumerate(zip(starts, ends)) for m in range(s // 128, t // 128)
             for n in range(n_blocks)}
    for group_m in gg.GROUP_M_CHOICES:
        for expert_groups in (False, True):
            tiles = gg.walk_tiles(starts, ends, n_blocks, group_m, expert_groups)
            assert len(tiles) == len(set(tiles)) and set(tiles) == owned, (seed, group_m, expert_groups)
            # Each group's tiles are handed out in one run: groups of group_m blocks counted from block 0,
            # or, within experts, from each expert's first block (so no group holds two experts).
            keys = [(e, (m - starts[e] // 128) // group_m) if expert_groups else m // group_m for m, n, e in tiles]
            runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
            assert len(runs) == len(set(runs)), (seed, group_m, expert_groups)


# -- GPU ----------------------------------------------------------------------------------------------------

# Pools: the hand-made ragged one (11 used blocks, an empty expert, a block past ends[-1]), uniform over
# 16 experts (blocks of several experts per group), zipf (one expert of many blocks; at T 4000 more than
# 32, so groups within it too), empty experts, one
# block in all.
_POOLS = [("hand", 0), ("uniform", 1500), ("zipf", 900), ("zipf", 4000), ("empty_experts", 500), ("uniform", 1)]
# (group_m, expert_groups) besides the default walk.
_WALKS = ([(g, False) for g in gg.GROUP_M_CHOICES if g != gg.GROUP_M_DEFAULT] +
          [(g, True) for g in (1, 2, 8, gg.GROUP_M_DEFAULT, 32)])


def _pool(kind: str, tokens: int, seed: int):
    if kind == "hand":
        return ragged_pool()
    return routed_pool(tokens, 16, 4, kind, seed)


@requires_hopper
@pytest.mark.parametrize("kind,tokens", _POOLS)
@pytest.mark.parametrize("layout", ["nt", "nn"])
@pytest.mark.parametrize("cluster_n", [1, 2])
def test_bf16_group_m_same_bits(kind, tokens, layout, cluster_n):
    n = 768  # three 256-wide N blocks: groups of tiles that end mid-row of a wave
    c = m_grouped_case(kind, tokens, n, 320, layout, _pool)
    base = c.fn(c.a, c.b, c.starts, c.ends, nan_bf16(c.rows, n), cluster_n=cluster_n, group_m=gg.GROUP_M_DEFAULT,
                expert_groups=False)
    assert_close_where_owned(base, m_grouped_reference(c.a, c.w_of, c.starts, c.ends, n), c.what)
    for g, eg in _WALKS:
        if eg and cluster_n > 1:
            continue  # groups within experts take no clusters (test_expert_groups_launcher_checks)
        got = c.fn(c.a, c.b, c.starts, c.ends, nan_bf16(c.rows, n), cluster_n=cluster_n, group_m=g, expert_groups=eg)
        assert_same_bits(base, got, f"{c.what} cluster_n={cluster_n}",
                         f"group_m={g} expert_groups={eg} differs from the default")


@requires_hopper
@pytest.mark.parametrize("kind,tokens", [("uniform", 1500), ("zipf", 900), ("empty_experts", 500)])
@pytest.mark.parametrize("layout,weighted", [("nt", True), ("nn", False)])
def test_bf16_group_m_scatter_same_bits(kind, tokens, layout, weighted):
    seed = case_seed("group_m scatter", kind, tokens, layout)
    n = 384
    c = scatter_case(kind, tokens, n, 256, layout, weighted, seed)
    meta = c.meta
    what = f"{layout} scatter weighted={weighted} {kind} T={tokens} seed={seed}"
    base = c.fn(c.a, c.b, meta.starts, meta.ends, nan_bf16(c.slots, n), scatter=c.scatter,
                group_m=gg.GROUP_M_DEFAULT, expert_groups=False)
    assert_close_where_owned(base, c.reference(), what)
    for g, eg in _WALKS:
        got = c.fn(c.a, c.b, meta.starts, meta.ends, nan_bf16(c.slots, n), scatter=c.scatter, group_m=g,
                   expert_groups=eg)
        assert_same_bits(base, got, what, f"group_m={g} expert_groups={eg} differs from the default")


@requires_hopper
def test_bf16_group_m_gather_same_bits():
    seed = case_seed("group_m gather")
    c = gather_case(seed, 512, 256, tokens=1100)
    meta = c.meta
    gather = gg.Gather(meta.row_to_slot, c.top_k)
    base = gg.m_grouped_bf16_gemm_nt_contiguous(c.x, c.b, meta.starts, meta.ends, nan_bf16(c.rows, 512),
                                                gather=gather, group_m=gg.GROUP_M_DEFAULT, expert_groups=False)
    ref = m_grouped_reference(c.pool, lambda e: c.b[e].T, meta.starts, meta.ends, 512)
    assert_close_where_owned(base, ref, f"gather seed={seed}")
    for g, eg in _WALKS:
        got = gg.m_grouped_bf16_gemm_nt_contiguous(c.x, c.b, meta.starts, meta.ends, nan_bf16(c.rows, 512),
                                                   gather=gather, group_m=g, expert_groups=eg)
        assert_same_bits(base, got, f"gather seed={seed}", f"group_m={g} expert_groups={eg} differs from the default")


@requires_hopper
@pytest.mark.parametrize("kind,tokens", [("hand", 0), ("uniform", 1500), ("zipf", 900)])
@pytest.mark.parametrize("block_n", fg.FP8_BLOCK_NS)
def test_fp8_group_m_same_bits(kind, tokens, block_n):
    seed = case_seed("group_m fp8", kind, tokens, block_n)
    starts, ends, rows = _pool(kind, tokens, seed)
    n, k = 576, 512
    g = torch.Generator().manual_seed(seed)
    a_q, sa = (t.contiguous() for t in recipe.quantize_rows(torch.randn(rows, k, generator=g).cuda()))
    w = torch.randn(starts.shape[0], n, k, generator=g).cuda()
    b_q, sb = (t.contiguous() for t in recipe.quantize_weight_blocks(w))
    run = fg.m_grouped_fp8_gemm_nt_contiguous
    what = f"fp8 n{block_n} {kind} T={tokens} seed={seed}"
    base = run(a_q, sa, b_q, sb, starts, ends, nan_bf16(rows, n), block_n=block_n, group_m=gg.GROUP_M_DEFAULT,
               expert_groups=False)
    emu = recipe.emulate_grouped_gemm_nt(a_q, sa, b_q, sb, starts, ends)
    ref = torch.full((rows, n), float("nan"), dtype=torch.float64, device="cuda")
    for s, t in zip(starts.tolist(), ends.tolist()):
        ref[s:t] = emu[s:t].double()
    assert_close_where_owned(base, ref, what, tol=2e-2)
    for gm, eg in _WALKS:
        got = run(a_q, sa, b_q, sb, starts, ends, nan_bf16(rows, n), block_n=block_n, group_m=gm, expert_groups=eg)
        assert_same_bits(base, got, what, f"group_m={gm} expert_groups={eg} differs from the default")
