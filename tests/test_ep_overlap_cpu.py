"""The dispatch overlapped with the L1 GEMM (DGE_EP_OVERLAP) without a GPU: the knob, the plan's
choice, the waiting GEMM configs and the split transport kernels (render and, with nvcc, compile)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from deep_gemm_ext import _env, plan
from deep_gemm_ext.jit_kernels import ep_transport
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg


def test_knob(monkeypatch):
    monkeypatch.delenv("DGE_EP_OVERLAP", raising=False)
    assert _env.ep_overlap() is False
    for value, want in (("1", True), ("on", True), ("0", False), ("no", False)):
        monkeypatch.setenv("DGE_EP_OVERLAP", value)
        assert _env.ep_overlap() is want
    monkeypatch.setenv("DGE_EP_OVERLAP", "maybe")
    with pytest.raises(ValueError, match="DGE_EP_OVERLAP='maybe'"):
        _env.ep_overlap()


def test_plan_takes_the_overlap_only_where_it_applies():
    sym, bf16 = "symmetric:3:2:16:x", torch.bfloat16
    assert plan.ep_overlap_applies(True, sym, "sm90", "bf16", bf16, "cp_async")
    assert not plan.ep_overlap_applies(False, sym, "sm90", "bf16", bf16, "cp_async")  # opt-in
    for exchange, provider, recipe, dtype, gather in (
            ("local", "sm90", "bf16", bf16, "cp_async"),
            ("all_to_all:g:2:16:x", "sm90", "bf16", bf16, "cp_async"),
            ("symmetric:3:2:16:fp8", "sm90", "fp8", bf16, "cp_async"),
            (sym, "grouped_mm", "bf16", bf16, "cp_async"),
            (sym, "sm90", "fp8", bf16, "cp_async"),
            (sym, "sm90", "bf16", torch.float32, "cp_async"),
            (sym, "sm90", "bf16", bf16, "")):
        assert not plan.ep_overlap_applies(True, exchange, provider, recipe, dtype, gather), (exchange, provider)


def test_plan_field_round_trips_and_defaults_off():
    p = plan.Plan(provider="sm90", exchange="symmetric:3:2:16:x", ep_overlap=True)
    assert plan.Plan.decode(p.encode()) == p
    assert "dispatch overlapped with the L1 GEMM" in p.describe()
    assert plan.Plan(provider="sm90").ep_overlap is False


def test_cpu_plan_never_overlaps(monkeypatch):
    monkeypatch.setenv("DGE_EP_OVERLAP", "1")
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    l1 = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    assert plan.resolve(x, l1, exchange="symmetric:3:2:16:x").ep_overlap is False  # no sm90 provider on CPU


def _await_configs():
    return [c for c in gg._all_configs() if c.await_rows]


def test_waiting_gemm_configs_render():
    configs = _await_configs()
    names = {c.name for c in configs}
    assert {"sm90_bf16_grouped_gemm_nt_n256_s4_gather_cpasync_await",
            "sm90_bf16_grouped_gemm_nt_n128_s6_gather_cpasync_await"} <= names
    for c in configs:
        code = c.code()
        assert "dge::gemm::LoaderGatherCpAsyncAwait" in code
        # The loader's arguments come right after the core's, before the epilogue's.
        assert c.args[:len(gg.CORE_ARGS) + len(gg.AWAIT_ARGS)] == gg.CORE_ARGS + gg.AWAIT_ARGS
        assert ("const long long*, const long long*, uint32_t, unsigned long long, int, unsigned long long, "
                "const int*") in code
    # The default configs are untouched: no await arguments, the same loaders.
    for c in gg._all_configs():
        if not c.await_rows:
            assert "Await" not in c.code() and "await" not in c.name
            assert not set(gg.AWAIT_ARGS) & set(c.args)


@pytest.mark.parametrize("bad", [dict(layout="nn"), dict(gather_a=None),
                                 dict(cluster_n=2, gather_a="cp_async")])
def test_waiting_gemm_config_rules(bad):
    kwargs = dict(layout="nt", block_n=256, gather_a="cp_async", await_rows=True)
    kwargs.update(bad)
    with pytest.raises(ValueError, match="await_rows=True takes|cluster_n=2 takes"):
        gg.GemmConfig(**kwargs)


def test_split_transport_configs_registered():
    names = [name for name, _, _ in ep_transport.configs()]
    for name in ("ep_transport_pull_meta_w32", "ep_transport_pull_meta_w64", "ep_transport_pull_rows_arrive"):
        assert name in names
    code = dict((name, code) for name, code, _ in ep_transport.configs())
    assert "ep_pull_rows_arrive_kernel<256>" in code["ep_transport_pull_rows_arrive"]
    assert "long long*, int*, unsigned long long" in code["ep_transport_pull_rows_arrive"]


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(), reason="needs nvcc")
def test_overlap_kernels_compile_without_spills_or_serialized_wgmma(tmp_path, monkeypatch):
    from deep_gemm_ext.jit.compiler import compile_cached

    monkeypatch.setenv("DGE_JIT_CACHE_DIR", str(tmp_path))
    wanted = [(c.name, c.code(), True) for c in _await_configs() if c.block_n == 256]
    wanted += [(n, code, g) for n, code, g in ep_transport.configs() if "meta_w32" in n or "arrive" in n]
    assert len(wanted) == 3
    for name, code, is_gemm in wanted:
        entry = compile_cached(name, code, "sm_90a", want_ptx=is_gemm)
        usage = max(entry.resources(), key=lambda u: u.registers)
        assert usage.spill_bytes == 0, name
        log = (entry.path / "ptxas.log").read_text()
        # A call in the GEMM (printf) would serialize every wgmma of the kernel.
        assert "C7510" not in log, f"{name}: {log}"
        if is_gemm:
            assert "wgmma.mma_async" in entry.ptx_path.read_text()


def test_arrival_block_order():
    """The waiting GEMM's M-block order: a permutation whose first ceil(ends[-1] / 128) entries are
    the used blocks, sorted by the latest arrival among their rows' sources, pool order within a key."""
    world, cap, top_k, rank = 4, 100, 2, 1
    wait = gg.AwaitRows(torch.zeros(world, dtype=torch.int64), torch.ones(1, dtype=torch.int64), cap, rank, 1, 1,
                        torch.zeros(5, dtype=torch.int64))
    g = torch.Generator().manual_seed(5)
    # 7 blocks of rows, the last two past the last expert; each used block holds rows of random sources.
    row_to_slot = torch.full((7 * 128 - 10,), -1, dtype=torch.int32)
    sources = []
    for block in range(5):
        picks = torch.randint(0, world, (3,), generator=g)
        sources.append(picks)
        for i, s in enumerate(picks.tolist()):
            row_to_slot[block * 128 + i] = (s * cap + i) * top_k
    ends = torch.tensor([256, 640], dtype=torch.int32)
    order = gg.arrival_block_order(row_to_slot, top_k, wait, ends)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(7))
    assert order[5:].tolist() == [5, 6]
    keys = [max((s - rank) % world for s in picks.tolist()) for picks in sources]
    assert order[:5].tolist() == sorted(range(5), key=lambda b: (keys[b], b))
