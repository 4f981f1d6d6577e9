"""Half tiles of the bf16 M-grouped GEMMs: ``ends`` as each expert's real end (``starts + counts``).

The 128-row block holding an expert's last rows stays its own; where it holds at most 64 of them,
a 256-wide tile computes its first 64 rows only, both consumer warpgroups on half of the columns
each, and stores zeros in rows [64, 128) (the scheduler's GroupedTile::half). Against the same GEMM
with aligned ends on the same inputs:

- every owned row outside those halves has the same bits (the same wgmmas over the same K order for
  each output element), including the padding rows below row 64 of a half block, which read the
  pool's (here non-zero) padding rows;
- the rows [64, 128) of every half block are zero: on a pool whose padding rows are not zero they
  would not be if the block ran whole, so the test fails when no half tile runs;
- rows no expert owns stay unwritten (NaN);
- slot-scatter epilogues (padding rows have no slot) and gathering loaders (padding rows read zeros)
  give the aligned run's bits everywhere.

Tails of 1, 63, 64 (half), 65, 127, 0, 128 rows (whole), empty experts, and more experts than the
scheduler stages in shared memory (600: the search in global memory); "nt" with and without paired
N, gathering and scattering, and "nn". The fp8 GEMMs take real ends too and compute whole blocks
(same bits as aligned ends); the layer has the same bits with half tiles and without.
"""
from __future__ import annotations

import pytest
import torch

from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.jit_kernels import m_grouped_fp8_gemm_nt_contiguous
from deep_gemm_ext.recipes import fp8 as recipe

from conftest import requires_hopper

# Real rows per expert: every tail class of the last block, twice over, and empty experts.
_COUNTS = [1, 63, 64, 65, 127, 128, 0, 129, 191, 192, 193, 256, 320, 2, 0, 448, 64 + 384, 101]


def _ranges(counts: list[int], extra_rows: int = 128):
    """(starts, real ends, aligned ends) int32 on the GPU, the pool's row count (an unowned tail of
    extra_rows after the last block), and the rows of the half blocks' second halves."""
    starts, real, aligned, halves, row = [], [], [], [], 0
    for c in counts:
        blocks = -(-c // 128)
        starts.append(row)
        real.append(row + c)
        aligned.append(row + 128 * blocks)
        tail = c % 128
        if 0 < tail <= 64:
            last = row + 128 * (blocks - 1)
            halves.append((last + 64, last + 128))
        row += 128 * blocks
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    return i32(starts), i32(real), i32(aligned), row + extra_rows, halves


def _random_counts(num_experts: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, 300, (num_experts,), generator=g).tolist()


def _nan(rows: int, n: int) -> torch.Tensor:
    return torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _check_halves(got: torch.Tensor, aligned: torch.Tensor, halves, what: str) -> None:
    """got: the real-ends run; aligned: the aligned-ends run of the same GEMM on the same inputs."""
    assert halves, f"{what}: the case has no half block"
    want = aligned.clone()
    for lo, hi in halves:
        # Non-zero in the whole-tile run (the pool's padding rows are not zero here).
        assert aligned[lo:hi].float().abs().sum() > 0, f"{what}: rows {lo}..{hi} of the aligned run are zero"
        want[lo:hi] = 0
    unowned = torch.isnan(aligned.float()).all(1)
    assert torch.isnan(got[unowned].float()).all(), f"{what}: rows no expert owns were written"
    assert not torch.isnan(got[~unowned].float()).any(), f"{what}: owned rows left unwritten"
    diff = (_bits(got) != _bits(want)).any(1).nonzero().flatten().tolist()
    assert not diff, f"{what}: rows {diff[:8]} differ from the aligned run (zeros in the half blocks' second halves)"


def _reference_rows(out, a, b_of, starts, real_ends, what: str) -> None:
    """The real rows against fp64 (the aligned run is the bitwise reference of the rest)."""
    for e, (s, t) in enumerate(zip(starts.tolist(), real_ends.tolist())):
        if t > s:
            ref = a[s:t].double() @ b_of(e).double()
            err = ((out[s:t].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            assert err < 1e-2, f"{what}: expert {e}: rel error {err:.2e}"


@requires_hopper
@pytest.mark.parametrize("case", ["nt", "nt_paired", "nn", "nt_600_experts"])
def test_bf16_half_tiles_store(case):
    g = torch.Generator().manual_seed(len(case))
    counts = _random_counts(600, g) if case == "nt_600_experts" else _COUNTS
    starts, real, aligned, rows, halves = _ranges(counts)
    e = len(counts)
    k, n = (256, 512) if case != "nt_600_experts" else (128, 256)
    # Every row random, padding rows included: a whole tile would store their products.
    a = torch.randn(rows, k, generator=g).cuda().to(torch.bfloat16)
    if case == "nn":
        b = (torch.randn(e, k, n, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
        fn, b_of = gg.m_grouped_bf16_gemm_nn_contiguous, (lambda i: b[i])
        kw = {}
    else:
        b = (torch.randn(e, n, k, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
        fn, b_of = gg.m_grouped_bf16_gemm_nt_contiguous, (lambda i: b[i].T)
        kw = dict(paired_n=True) if case == "nt_paired" else {}
    want = fn(a, b, starts, aligned, _nan(rows, n), **kw)
    got = fn(a, b, starts, real, _nan(rows, n), **kw)
    _check_halves(got, want, halves, case)
    _reference_rows(got, a, b_of, starts, real, case)


def _slot_maps(counts: list[int], starts, g: torch.Generator, top_k: int):
    """row_to_slot [P] for pools laid out as _ranges: real rows take a random permutation of the slots."""
    num_slots = sum(counts)
    num_slots += (-num_slots) % top_k
    perm = torch.randperm(num_slots, generator=g)
    rows = int(starts[-1].item()) + 128 * -(-counts[-1] // 128) + 128
    row_to_slot = torch.full((rows,), -1, dtype=torch.int32)
    used = 0
    for s, c in zip(starts.tolist(), counts):
        row_to_slot[s:s + c] = perm[used:used + c].to(torch.int32)
        used += c
    return row_to_slot.cuda(), num_slots


@requires_hopper
@pytest.mark.parametrize("case", ["gather", "scatter", "scatter_weighted", "nn_scatter"])
def test_bf16_half_tiles_gather_and_scatter(case):
    g = torch.Generator().manual_seed(7 + len(case))
    top_k = 2
    starts, real, aligned, rows, halves = _ranges(_COUNTS)
    row_to_slot, num_slots = _slot_maps(_COUNTS, starts, g, top_k)
    e, k, n = len(_COUNTS), 256, 512  # 256-wide tiles, which have half tiles
    b = (torch.randn(e, n, k, generator=g) * k ** -0.5).cuda().to(torch.bfloat16)
    if case == "gather":
        x = torch.randn(num_slots // top_k, k, generator=g).cuda().to(torch.bfloat16)
        gather = gg.Gather(row_to_slot, top_k)
        want = gg.m_grouped_bf16_gemm_nt_contiguous(x, b, starts, aligned, _nan(rows, n), gather=gather)
        got = gg.m_grouped_bf16_gemm_nt_contiguous(x, b, starts, real, _nan(rows, n), gather=gather)
        pool = torch.where((row_to_slot >= 0)[:, None], x[(row_to_slot.clamp_min(0) // top_k).long()], 0)
        _reference_rows(got, pool, lambda i: b[i].T, starts, real, case)
    else:
        a = torch.randn(rows, k, generator=g).cuda().to(torch.bfloat16)
        weights = torch.rand(num_slots, generator=g).cuda() if case == "scatter_weighted" else None
        scatter = gg.Scatter(row_to_slot, num_slots, weights)
        if case == "nn_scatter":
            b = b.transpose(1, 2).contiguous()
            fn = gg.m_grouped_bf16_gemm_nn_contiguous
        else:
            fn = gg.m_grouped_bf16_gemm_nt_contiguous
        want = fn(a, b, starts, aligned, _nan(num_slots, n), scatter=scatter)
        got = fn(a, b, starts, real, _nan(num_slots, n), scatter=scatter)
        assert not torch.isnan(got.float()).any(), f"{case}: slots left unwritten"
    assert torch.equal(_bits(got), _bits(want)), f"{case}: differs from the aligned run"


@requires_hopper
@pytest.mark.parametrize("mainloop,block_n,static_k,scatter", [("serial", 192, True, False), ("serial", 128, False, False),
                                                               ("overlap", 128, False, False), ("serial", 192, True, True)])
def test_fp8_takes_real_ends(mainloop, block_n, static_k, scatter):
    # No half tiles in the fp8 kernels: real ends compute whole blocks, the aligned run's bits everywhere.
    g = torch.Generator().manual_seed(block_n + static_k + scatter)
    starts, real, aligned, rows, _ = _ranges(_COUNTS)
    e, k, n = len(_COUNTS), 512, 384
    a_q, sa = recipe.quantize_rows(torch.randn(rows, k, generator=g).cuda())
    b_q, sb = recipe.quantize_weight_blocks((torch.randn(e, n, k, generator=g) * k ** -0.5).cuda())
    kw = dict(mainloop=mainloop, block_n=block_n, static_k=static_k)
    if scatter:
        row_to_slot, num_slots = _slot_maps(_COUNTS, starts, g, 2)
        kw["scatter"] = gg.Scatter(row_to_slot, num_slots, torch.rand(num_slots, generator=g).cuda())
    out_rows = num_slots if scatter else rows
    want = m_grouped_fp8_gemm_nt_contiguous(a_q, sa, b_q, sb, starts, aligned, _nan(out_rows, n), **kw)
    got = m_grouped_fp8_gemm_nt_contiguous(a_q, sa, b_q, sb, starts, real, _nan(out_rows, n), **kw)
    assert torch.equal(_bits(got), _bits(want)), f"fp8 {kw}: differs from the aligned run"
    if scatter:
        assert not torch.isnan(got.float()).any(), "fp8 scatter: slots left unwritten"
    else:
        emu = recipe.emulate_grouped_gemm_nt(a_q, sa, b_q, sb, starts, real)
        for i, (s, t) in enumerate(zip(starts.tolist(), real.tolist())):
            if t > s:
                err = ((got[s:t].double() - emu[s:t].double()).norm() / emu[s:t].double().norm()).item()
                assert err < 1e-2, f"fp8 {kw}: expert {i}: rel error {err:.2e} against the emulation"


@requires_hopper
@pytest.mark.parametrize("recipe,routing", [("bf16", "uniform"), ("bf16", "zipf"), ("fp8", "uniform")])
def test_layer_has_the_same_bits_with_whole_tiles(recipe, routing, monkeypatch):
    # The layer's M-grouped GEMMs run half tiles by default (DGE_HALF_TILES): on pools whose padding
    # rows are zero, y and all four gradients have the bits of whole tiles.
    import deep_gemm_ext as dge
    from deep_gemm_ext.routing import compute_routing_torch
    from deep_gemm_ext.testing import make_inputs

    num_experts, top_k = 16, 4
    inputs = make_inputs(1000, 512, 256, num_experts, top_k, routing=routing, device="cuda", seed=5)
    counts = compute_routing_torch(inputs[1], num_experts, 128).counts.tolist()
    assert any(0 < c % 128 <= 64 for c in counts), f"no half block at counts {counts}"
    dy = torch.randn_like(inputs[0])

    def run():
        y = dge.mega_moe_train(*inputs, recipe=recipe)
        grads = torch.autograd.grad(y, [inputs[i] for i in (0, 2, 3, 4)], dy)
        torch.cuda.synchronize()
        return [y.detach(), *grads]

    monkeypatch.setenv("DGE_HALF_TILES", "1")
    half = run()
    monkeypatch.setenv("DGE_HALF_TILES", "0")
    whole = run()
    for name, h, w in zip(("y", "dx", "dtopk_weights", "dl1", "dl2"), half, whole):
        assert not torch.isnan(h).any(), f"{recipe} {routing}: {name} has NaNs"
        assert torch.equal(h, w), f"{recipe} {routing}: {name} differs between half and whole tiles"
