"""Blockwise-fp8 quantization kernels (jit_kernels.fp8_quant) against the torch quantizers of
recipes.fp8 on the same CUDA tensors: e4m3 bytes and fp32 scale bits must be identical. The fused
kernels against the unfused ones: swiglu_backward_fp8 against jit_kernels.swiglu_backward (dh,
dweight, act_w bit for bit) followed by quantize_rows of its dh; swiglu_backward_fp8_t against
swiglu_backward_fp8 followed by quantize_cols_transposed_fp8 of its dh and act_w; quantize_cols_transposed_fp8
against quantize_cols transposed (plain and gathering the routed pool).

GPU tests (an SM90 GPU: the kernels are built for sm_90a) draw fresh seeded inputs with special
tiles (zeros, -0, NaN / +-Inf, all non-finite, bf16 extremes, 1e-30, bf16 subnormals, exact e4m3
grid values and rounding ties at power-of-two scales), poison the allocator (or the given
outputs) with NaN bytes first, and name the seed in every failure. CPU tests: argument checks
and the sm_90a compile (no spills, the e4m3 conversion in the SASS).
"""
from __future__ import annotations

import functools
import shutil
import subprocess

import pytest
import torch

from conftest import poison_cached_memory, requires_compiler, requires_cuda, requires_hopper

from deep_gemm_ext import elementwise, jit
from deep_gemm_ext.jit_kernels import (fp8_quant, quantize_cols_fp8, quantize_cols_transposed_fp8, quantize_rows_fp8,
                                       swiglu_backward, swiglu_backward_fp8, swiglu_backward_fp8_t, swiglu_forward,
                                       swiglu_forward_fp8)
from deep_gemm_ext.recipes import fp8
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_routing

DEVICE = "cuda"
BF16_MAX = torch.finfo(torch.bfloat16).max
BF16_TINY_SUB = 2.0 ** -133  # smallest positive bf16 subnormal


# -- inputs ----------------------------------------------------------------------------------------


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values) & (values >= 0)].unique().sort().values


def _special_tile(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """n fp32 values (all bf16-representable where the kind needs it) of one special tile."""
    r = torch.randn(n, generator=gen)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "neg_zeros":
        return torch.full((n,), -0.0)
    if kind == "nan_inf":
        r[0] = float("nan")
        r[n // 2] = float("inf")
        r[-1] = float("-inf")
        return r
    if kind == "all_nonfinite":
        return torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(n)[:n]
    if kind == "extremes":
        r = r * 1e30
        r[0], r[-1] = BF16_MAX, -BF16_MAX
        return r
    if kind == "beyond_448":
        return r * 5000
    if kind == "tiny":
        return r * 1e-30
    if kind == "subnormal":
        k = torch.randint(1, 128, (n,), generator=gen).float()
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        return sign * k * BF16_TINY_SUB
    if kind == "tiny_and_subnormal":
        out = _special_tile("subnormal", n, gen)
        out[n // 3] = -1e-30
        return out
    if kind in ("grid", "ties"):
        # amax = 448 * 2^e, so the scale is exactly 2^e (448 * fl(1/448) == 1 in fp32) and the
        # quotients are the chosen e4m3 values or midpoints between neighbours (ties to even).
        grid = _e4m3_grid()
        pick = torch.randint(0, grid.numel() - 1, (n,), generator=gen)
        values = grid[pick] if kind == "grid" else (grid[pick] + grid[pick + 1]) / 2
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        values = sign * values
        values[0] = 448.0
        e = int(torch.randint(-30, 30, (1,), generator=gen))
        return values * 2.0 ** e
    if kind == "single":
        out = torch.zeros(n)
        out[int(torch.randint(0, n, (1,), generator=gen))] = float(r[0]) * 3
        return out
    raise ValueError(kind)


SPECIAL_KINDS = ("zeros", "neg_zeros", "nan_inf", "all_nonfinite", "extremes", "beyond_448", "tiny", "subnormal",
                 "tiny_and_subnormal", "grid", "ties", "single")


def _make_rows(m: int, k: int, seed: int, special: bool = True) -> torch.Tensor:
    """bf16 [m, k] on the GPU: normal values with per-row magnitudes 2^-40 .. 2^40, and (special)
    every third 1x128 tile one of the special kinds in turn."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 2.0 ** torch.randint(-40, 41, (m, 1), generator=gen).float()
    if special and k:
        tiles = fp8.num_blocks(k)
        count = 0
        for t in range(0, m * tiles, 3):
            row, tile = divmod(t, tiles)
            lo, hi = tile * 128, min(k, tile * 128 + 128)
            x[row, lo:hi] = _special_tile(SPECIAL_KINDS[count % len(SPECIAL_KINDS)], hi - lo, gen)
            count += 1
    return x.bfloat16().to(DEVICE)


# -- comparison ------------------------------------------------------------------------------------


def _assert_bit_equal(got, ref, what: str) -> None:
    (data, scale), (ref_data, ref_scale) = got, ref
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, what
    assert data.shape == ref_data.shape and scale.shape == ref_scale.shape, \
        f"{what}: shapes {tuple(data.shape)} / {tuple(scale.shape)}, expected {tuple(ref_data.shape)} / " \
        f"{tuple(ref_scale.shape)}"
    bad_scale = (scale.view(torch.int32) != ref_scale.view(torch.int32)).nonzero()
    if bad_scale.numel():
        first = bad_scale[:4].tolist()
        pairs = [(scale[tuple(i)].item(), ref_scale[tuple(i)].item()) for i in first]
        raise AssertionError(f"{what}: {bad_scale.shape[0]} scales differ, first at {first}: (ours, torch) {pairs}")
    bad = (data.view(torch.uint8) != ref_data.view(torch.uint8)).nonzero()
    if bad.numel():
        first = bad[:4].tolist()
        pairs = [(hex(data.view(torch.uint8)[tuple(i)].item()), hex(ref_data.view(torch.uint8)[tuple(i)].item()))
                 for i in first]
        raise AssertionError(f"{what}: {bad.shape[0]} data bytes differ, first at {first}: (ours, torch) {pairs}")


@pytest.fixture(scope="module")
def prebuilt():
    """Compile every config once up front (the tests then hit the cache)."""
    for name, code, _ in fp8_quant.configs():
        jit.build(name, code)


# -- quantize_rows_fp8 -----------------------------------------------------------------------------

ROW_SHAPES = [(0, 2048), (1, 200), (1, 7168), (1000, 200), (1000, 2048), (1000, 7168), (257, 8), (64, 136),
              (300, 768), (3, 0)]


@requires_hopper
@pytest.mark.parametrize("special", [False, True], ids=["random", "special"])
@pytest.mark.parametrize("m,k", ROW_SHAPES)
def test_quantize_rows_matches_torch(prebuilt, m, k, special):
    seed = 1000 * m + k + special
    x = _make_rows(m, k, seed, special)
    ref = fp8.quantize_rows(x)
    poison_cached_memory(0xFF)
    got = quantize_rows_fp8(x)
    _assert_bit_equal(got, ref, f"quantize_rows_fp8 [{m}, {k}] special={special} seed={seed}")


@requires_hopper
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_quantize_rows_every_tile_special(prebuilt, kind):
    """Whole tensors of one special kind (ragged last tile included)."""
    seed = SPECIAL_KINDS.index(kind)
    gen = torch.Generator().manual_seed(seed)
    m, k = 40, 328
    x = torch.stack([torch.cat([_special_tile(kind, 128, gen), _special_tile(kind, 128, gen),
                                _special_tile(kind, 72, gen)]) for _ in range(m)]).bfloat16().to(DEVICE)
    ref = fp8.quantize_rows(x)
    poison_cached_memory(0xFF)
    _assert_bit_equal(quantize_rows_fp8(x), ref, f"quantize_rows_fp8 kind={kind} seed={seed}")


@requires_hopper
def test_quantize_rows_scale_rule(prebuilt):
    """The scale is max(amax, 448 * 2^-126) * fl32(1/448), torch's CUDA rule, not fl32(amax / 448),
    for amaxes where the two differ; an all-zero tile gets exactly 2^-126."""
    seed = 7
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 128, generator=gen).bfloat16()
    x[0] = 0
    amax = x.float().abs().amax(1)
    by_reciprocal = amax.clamp(min=fp8.AMAX_FLOOR) * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    by_division = amax.clamp(min=fp8.AMAX_FLOOR) / 448.0  # on the CPU: true division
    assert (by_reciprocal != by_division).any(), "no amax tells the two rules apart"
    _, scale = quantize_rows_fp8(x.to(DEVICE))
    assert torch.equal(scale.cpu()[:, 0].view(torch.int32), by_reciprocal.view(torch.int32)), f"seed={seed}"
    assert scale[0, 0].item() == 2.0 ** -126


@requires_hopper
def test_quantize_rows_into_given_outputs(prebuilt):
    seed = 11
    x = _make_rows(333, 7168, seed)
    ref = fp8.quantize_rows(x)
    out = torch.full((333, 7168), 0xFF, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    scale_out = torch.full((333, 56), float("nan"), device=DEVICE)
    data, scale = quantize_rows_fp8(x, out=out, scale_out=scale_out)
    assert data is out and scale is scale_out
    _assert_bit_equal((data, scale), ref, f"quantize_rows_fp8 out= seed={seed}")


@requires_hopper
def test_quantize_rows_non_contiguous_and_offset_input(prebuilt):
    seed = 12
    base = _make_rows(64, 2 * 400 + 8, seed)
    misaligned = base.reshape(-1)[4:4 + 64 * 400].view(64, 400)  # contiguous, 8 bytes off 16-byte alignment
    for x in (base[:, :400], base[:, 8:408], base.t().contiguous().t()[:, :400], misaligned):
        _assert_bit_equal(quantize_rows_fp8(x), fp8.quantize_rows(x), f"strided {tuple(x.stride())} seed={seed}")


@requires_hopper
def test_quantize_rows_split_into_launches(prebuilt, monkeypatch):
    """More tiles than one launch indexes: the launcher splits the rows (limit lowered here)."""
    seed = 13
    x = _make_rows(100, 2000, seed)
    ref = fp8.quantize_rows(x)
    monkeypatch.setattr(fp8_quant, "_MAX_ITEMS", 37)  # 16 tiles a row: two rows a launch
    poison_cached_memory(0xFF)
    _assert_bit_equal(quantize_rows_fp8(x), ref, f"split launches seed={seed}")


# -- the gathering variant -------------------------------------------------------------------------


@requires_hopper
@pytest.mark.parametrize("kind", ["uniform", "empty_experts", "unused_slots", "one_expert"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden", [(0, 8, 2, 256), (1, 4, 2, 200), (300, 16, 4, 2048),
                                                                  (129, 64, 8, 7168), (1000, 3, 1, 136)])
def test_quantize_rows_gather_matches_pool(prebuilt, kind, num_tokens, num_experts, top_k, hidden):
    """quantize_rows(gather_rows(x)) of the 128-aligned pool: padding rows are zero tiles."""
    seed = num_tokens * 7 + num_experts * 3 + top_k + hidden
    gen = torch.Generator().manual_seed(seed)
    idx = make_routing(num_tokens, num_experts, top_k, kind, generator=gen).to(DEVICE)
    meta = compute_routing_torch(idx, num_experts, 128)
    x = _make_rows(num_tokens, hidden, seed)
    pool = elementwise.gather_rows(x, meta.row_to_slot, top_k)  # the torch pool (zeros where < 0)
    ref = fp8.quantize_rows(pool)
    poison_cached_memory(0xFF)
    got = quantize_rows_fp8(x, gather=(meta.row_to_slot, top_k))
    _assert_bit_equal(got, ref, f"gather kind={kind} T={num_tokens} E={num_experts} K={top_k} H={hidden} seed={seed}")
    padding = meta.row_to_slot < 0
    if padding.any():
        assert (got[0][padding].view(torch.uint8) == 0).all()
        assert (got[1][padding] == 2.0 ** -126).all()


@requires_hopper
@pytest.mark.parametrize("with_pool", [False, True])
@pytest.mark.parametrize("token_order", [False, True])
@pytest.mark.parametrize("kind", ["uniform", "empty_experts", "unused_slots", "one_expert"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden", [(1, 4, 2, 512), (300, 16, 4, 2048),
                                                                  (129, 64, 8, 7168), (77, 8, 2, 256),
                                                                  (50, 8, 3, 200), (40, 64, 32, 1152)])
def test_quantize_pool_rows_matches_gathering_quantizer(prebuilt, kind, num_tokens, num_experts, top_k, hidden,
                                                        token_order, with_pool):
    """Per token, then gathered (token_order: in one token-order launch): every used row's data and
    scales bit for bit those of the gathering quantizer; padding rows zero data and scale 0 (or, in the
    row walk where a scale row is not whole 16-byte vectors, H = 256, the gathering quantizer itself,
    with the zero tile's scale). with_pool: the bf16 pool returned beside them is gather_rows' pool
    bit for bit (zeros on padding rows), and data and scale are the same as without it."""
    seed = num_tokens * 5 + num_experts + top_k * 3 + hidden
    gen = torch.Generator().manual_seed(seed)
    idx = make_routing(num_tokens, num_experts, top_k, kind, generator=gen).to(DEVICE)
    meta = compute_routing_torch(idx, num_experts, 128)
    x = _make_rows(num_tokens, hidden, seed)
    ref = quantize_rows_fp8(x, gather=(meta.row_to_slot, top_k))
    poison_cached_memory(0xFF)
    got = fp8_quant.quantize_pool_rows_fp8(x, meta.row_to_slot, top_k,
                                           slot_to_row=meta.slot_to_row if token_order else None, with_pool=with_pool)
    what = (f"pool kind={kind} T={num_tokens} E={num_experts} K={top_k} H={hidden} seed={seed} "
            f"token_order={token_order} with_pool={with_pool}")
    assert len(got) == (3 if with_pool else 2), what
    data, scale = got[:2]
    if with_pool:
        pool = got[2]
        assert pool.dtype == x.dtype and pool.shape == (meta.row_to_slot.shape[0], hidden), what
        ref_pool = elementwise.gather_rows(x, meta.row_to_slot, top_k)  # torch: zeros where < 0
        assert torch.equal(pool.view(torch.int16), ref_pool.view(torch.int16)), what
    used = meta.row_to_slot >= 0
    assert used.any(), what
    assert torch.equal(data[used].view(torch.uint8), ref[0][used].view(torch.uint8)), what
    assert torch.equal(scale[used], ref[1][used]), what
    padding = ~used
    if padding.any():
        assert (data[padding].view(torch.uint8) == 0).all(), what
        assert (scale[padding] == (0.0 if token_order or (hidden // 128) % 4 == 0 else 2.0 ** -126)).all(), what


@requires_hopper
def test_quantize_rows_gather_out_of_range_tokens_read_zeros(prebuilt):
    """A slot past the tokens reads as a zero row (like gather_rows), never out of bounds."""
    x = _make_rows(4, 256, 21)
    row_to_slot = torch.tensor([0, 7, 8, 100, -1, 3], dtype=torch.int32, device=DEVICE)  # top_k 2: tokens 0, 3, 4, 50
    data, scale = quantize_rows_fp8(x, gather=(row_to_slot, 2))
    ref_data, ref_scale = fp8.quantize_rows(x)
    for r, token in enumerate([0, 3, None, None, None, 1]):
        if token is None:
            assert (data[r].view(torch.uint8) == 0).all() and (scale[r] == 2.0 ** -126).all(), r
        else:
            assert torch.equal(data[r].view(torch.uint8), ref_data[token].view(torch.uint8)), r
            assert torch.equal(scale[r], ref_scale[token]), r


@requires_hopper
def test_quantize_rows_gather_split_into_launches(prebuilt, monkeypatch):
    seed = 22
    gen = torch.Generator().manual_seed(seed)
    idx = make_routing(200, 8, 4, "unused_slots", generator=gen).to(DEVICE)
    meta = compute_routing_torch(idx, 8, 128)
    x = _make_rows(200, 384, seed)
    ref = fp8.quantize_rows(elementwise.gather_rows(x, meta.row_to_slot, 4))
    monkeypatch.setattr(fp8_quant, "_MAX_ITEMS", 100)
    _assert_bit_equal(quantize_rows_fp8(x, gather=(meta.row_to_slot, 4)), ref, f"gather split seed={seed}")


# -- quantize_cols_fp8 -----------------------------------------------------------------------------

COL_SHAPES = [(0, 256), (1, 8), (127, 200), (128, 2048), (129, 136), (1000, 768), (4101, 2048), (300, 7168), (5, 0)]


@requires_hopper
@pytest.mark.parametrize("special", [False, True], ids=["random", "special"])
@pytest.mark.parametrize("r,m", COL_SHAPES)
def test_quantize_cols_matches_torch(prebuilt, r, m, special):
    seed = 3000 * r + m + special
    # Specials along the columns: build row-special tiles of x^T, so every third 128x1 tile is one.
    x = _make_rows(m, r, seed, special).t().contiguous() if special else _make_rows(r, m, seed, False)
    ref = fp8.quantize_cols(x)
    poison_cached_memory(0xFF)
    got = quantize_cols_fp8(x)
    _assert_bit_equal(got, ref, f"quantize_cols_fp8 [{r}, {m}] special={special} seed={seed}")


@requires_hopper
def test_quantize_cols_into_given_outputs_and_split(prebuilt, monkeypatch):
    seed = 31
    x = _make_rows(700, 264, seed)
    ref = fp8.quantize_cols(x)
    out = torch.full((700, 264), 0xFF, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    scale_out = torch.full((6, 264), float("nan"), device=DEVICE)
    monkeypatch.setattr(fp8_quant, "_MAX_ITEMS", 5)  # 3 column blocks: 128 rows a launch
    data, scale = quantize_cols_fp8(x, out=out, scale_out=scale_out)
    assert data is out and scale is scale_out
    _assert_bit_equal((data, scale), ref, f"quantize_cols_fp8 out= split seed={seed}")


@requires_hopper
def test_quantize_cols_tiles_ignore_expert_boundaries(prebuilt):
    """Tiles are rows [128 i, 128 i + 128) of the whole tensor, as quantize_cols defines them: a
    huge value in row 130 sets the scale of rows 128..255 only."""
    x = torch.ones(300, 16, dtype=torch.bfloat16, device=DEVICE)
    x[130] = 4480.0
    _, scale = quantize_cols_fp8(x)
    inv = torch.tensor(1.0, dtype=torch.float32) / 448.0
    expected = torch.stack([inv, torch.tensor(4480.0) * inv, inv])
    assert torch.equal(scale[:, 0].cpu().view(torch.int32), expected.view(torch.int32)), scale[:, 0]
    _assert_bit_equal(quantize_cols_fp8(x), fp8.quantize_cols(x), "boundaries")


# -- SwiGLU forward + quantize ---------------------------------------------------------------------


@requires_hopper
@pytest.mark.parametrize("clamp", [None, 7.0])
@pytest.mark.parametrize("p,inter", [(0, 768), (1, 8), (300, 200), (1024, 768), (77, 2048)])
def test_swiglu_forward_fp8_matches_quantized_act(prebuilt, p, inter, clamp):
    seed = 5000 + p * 3 + inter + (clamp is not None)
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(p, 2 * inter, generator=gen) * 4).bfloat16().to(DEVICE)
    if p > 3:
        h[1, 5] = float("nan")
        h[2, inter + 9] = float("inf")
        h[3, :128] = 0
    act = swiglu_forward(h, clamp)
    ref = fp8.quantize_rows(act)
    poison_cached_memory(0xFF)
    data, scale, got_act = swiglu_forward_fp8(h, clamp, return_act=True)
    what = f"swiglu_forward_fp8 [{p}, {2 * inter}] clamp={clamp} seed={seed}"
    assert torch.equal(got_act.view(torch.int16), act.view(torch.int16)), f"{what}: act differs"
    _assert_bit_equal((data, scale), ref, what)
    _assert_bit_equal(swiglu_forward_fp8(h, clamp), ref, what + " (no act)")


# -- SwiGLU backward + quantize dh ----------------------------------------------------------------


def _swiglu_backward_inputs(p: int, inter: int, seed: int):
    """h [p, 2I] (x4 Gaussian, NaN in a gate, +Inf in an up value), da [p, I] with per-row magnitudes
    2^-40 .. 2^40 and every third 1x128 tile special (zeros, NaN / Inf, subnormals, ties...), row
    weights Gaussian with zeros (all-zero dh rows) and one 2^-100 (tiny dh tiles)."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(p, 2 * inter, generator=gen) * 4).bfloat16()
    if p > 4:
        h[1, 5] = float("nan")
        h[2, inter + 9] = float("inf")
        h[3, :128] = 0
    da = _make_rows(p, inter, seed + 1)
    w = torch.randn(p, generator=gen)
    w[::7] = 0
    if p > 5:
        w[5] = 2.0 ** -100
    return h.to(DEVICE), da, w.to(DEVICE)


@requires_hopper
@pytest.mark.parametrize("clamp", [None, 7.0])
@pytest.mark.parametrize("p,inter", [(0, 128), (1, 128), (300, 384), (1024, 768), (77, 2048), (513, 1536), (40, 640)])
def test_swiglu_backward_fp8_matches_unfused(prebuilt, p, inter, clamp):
    """Outputs bit for bit those of the bf16 kernel, dh's quantization bit for bit
    recipes.fp8.quantize_rows of that dh (2I/128 tiles a row, half of them in the up half)."""
    seed = 7000 + p * 3 + inter + (clamp is not None)
    h, da, w = _swiglu_backward_inputs(p, inter, seed)
    dh, dweight, act_w = swiglu_backward(h, da, w, clamp)
    ref = fp8.quantize_rows(dh)
    poison_cached_memory(0xFF)
    got = swiglu_backward_fp8(h, da, w, clamp)
    what = f"swiglu_backward_fp8 [{p}, {2 * inter}] clamp={clamp} seed={seed}"
    assert len(got) == 5, what
    for name, a, b in (("dh", got[0], dh), ("dweight", got[1], dweight), ("act_w", got[2], act_w)):
        bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {name} {a.shape} {a.dtype}"
        assert torch.equal(a.view(bits), b.view(bits)), f"{what}: {name} differs from swiglu_backward"
    _assert_bit_equal(got[3:], ref, what)
    if p > 4:  # the specials reached dh: NaN tiles, and zero tiles from the zero row weights
        assert torch.isnan(dh.float()).any() and (got[4] == 2.0 ** -126).any(), what


@requires_hopper
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_swiglu_backward_fp8_special_dh_tiles(prebuilt, kind):
    """dh made of one special kind in every tile: with h = (g, u) = (0, 1) the gate gradient is
    w * da / 2 and the up one w * da * silu(0) (zeros for finite da, NaN for non-finite), so the
    gate half of dh is the special values halved."""
    seed = 100 + SPECIAL_KINDS.index(kind)
    gen = torch.Generator().manual_seed(seed)
    p, inter = 48, 384
    h = torch.cat([torch.zeros(p, inter), torch.ones(p, inter)], 1).bfloat16().to(DEVICE)
    da = torch.stack([torch.cat([_special_tile(kind, 128, gen) for _ in range(3)]) for _ in range(p)])
    da = da.bfloat16().to(DEVICE)
    w = torch.ones(p, device=DEVICE)
    dh, _, _ = swiglu_backward(h, da, w)
    ref = fp8.quantize_rows(dh)
    poison_cached_memory(0xFF)
    got = swiglu_backward_fp8(h, da, w)
    assert torch.equal(got[0].view(torch.int16), dh.view(torch.int16)), f"kind={kind} seed={seed}: dh differs"
    _assert_bit_equal(got[3:], ref, f"swiglu_backward_fp8 kind={kind} seed={seed}")


@requires_cuda
@pytest.mark.parametrize("fn", [swiglu_backward_fp8, functools.partial(swiglu_backward_fp8_t, rows=16)],
                         ids=["rows", "rows_and_transposed_columns"])
def test_swiglu_backward_fp8_rejects_bad_inputs(fn):
    h = torch.zeros(4, 2 * 192, dtype=torch.bfloat16, device=DEVICE)
    da = torch.zeros(4, 192, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match=r"h: shape \(4, 384\), I=192; expected I a multiple of 128"):
        fn(h, da, w)
    with pytest.raises(ValueError, match=r"da: shape \(4, 128\), expected \(4, 192\)"):
        fn(h, da[:, :128], w)
    with pytest.raises(ValueError, match="row_weight: expected a float32 tensor of shape"):
        fn(h, da, w.double())
    with pytest.raises(ValueError, match="clamp=0: expected None or a positive float"):
        fn(h[:, :256], da[:, :128], w, 0)


# -- SwiGLU backward with the transposed column-quantized dh and act_w ------------------------------


def _assert_swiglu_t_matches(got, h, da, w, clamp, rows, what):
    """``got`` = swiglu_backward_fp8_t(...) against swiglu_backward_fp8 and quantize_cols_transposed_fp8 of
    its dh and act_w, every bit."""
    dh, dweight, act_w, dh_data, dh_scale = swiglu_backward_fp8(h, da, w, clamp)
    assert len(got) == 7, what
    assert got[0].dtype == torch.float32 and got[0].shape == dweight.shape, what
    assert torch.equal(got[0].view(torch.int32), dweight.view(torch.int32)), f"{what}: dweight differs"
    _assert_bit_equal(got[1:3], (dh_data, dh_scale), what + " (dh rows)")
    _assert_bit_equal(got[3:5], quantize_cols_transposed_fp8(dh, rows=rows), what + " (dh columns)")
    _assert_bit_equal(got[5:7], quantize_cols_transposed_fp8(act_w, rows=rows), what + " (act_w columns)")


@requires_hopper
@pytest.mark.parametrize("clamp", [None, 7.0])
@pytest.mark.parametrize("p,inter,rows", [(0, 128, 0), (0, 128, 32), (1, 128, 16), (300, 384, 304), (1024, 768, 1024),
                                          (77, 2048, 80), (513, 1536, 656), (40, 640, 48), (256, 256, 272)])
def test_swiglu_backward_fp8_t_matches_unfused(prebuilt, p, inter, clamp, rows):
    """dweight and dh's rows as swiglu_backward_fp8 gives them, dh's and act_w's column quantization as
    quantize_cols_transposed_fp8 of its bf16 dh and act_w with the same padded row count (odd and even
    chunk counts: dweight's sum in the other kernels' order; ragged and padding row blocks)."""
    seed = 7500 + p * 3 + inter + (clamp is not None) + rows
    h, da, w = _swiglu_backward_inputs(p, inter, seed)
    poison_cached_memory(0xFF)
    got = swiglu_backward_fp8_t(h, da, w, clamp, rows=rows)
    what = f"swiglu_backward_fp8_t [{p}, {2 * inter}] rows={rows} clamp={clamp} seed={seed}"
    _assert_swiglu_t_matches(got, h, da, w, clamp, rows, what)
    if p > 4:  # the specials reached the column tiles too
        assert (got[3].view(torch.uint8) == 0x7F).any(), what
    if fp8.num_blocks(rows) > fp8.num_blocks(p):  # a row block of padding only: zero bytes, the zero tile's scale
        assert not got[3][:, fp8.num_blocks(p) * 128:].view(torch.uint8).any(), what
        assert (got[4][:, -1] == 2.0 ** -126).all() and (got[6][:, -1] == 2.0 ** -126).all(), what


@requires_hopper
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_swiglu_backward_fp8_t_special_column_tiles(prebuilt, kind):
    """Every 128x1 column tile of dh special: with h = (g, u) = (0, 1) the gate half of dh is w * da / 2,
    so da's special values down the columns become dh's gate columns (the up half zeros or NaN)."""
    seed = 300 + SPECIAL_KINDS.index(kind)
    gen = torch.Generator().manual_seed(seed)
    p, inter = 272, 256
    h = torch.cat([torch.zeros(p, inter), torch.ones(p, inter)], 1).bfloat16().to(DEVICE)
    da_t = torch.stack([torch.cat([_special_tile(kind, 128, gen), _special_tile(kind, 128, gen),
                                   _special_tile(kind, 16, gen)]) for _ in range(inter)])
    da = da_t.t().contiguous().bfloat16().to(DEVICE)
    w = torch.ones(p, device=DEVICE)
    poison_cached_memory(0xFF)
    got = swiglu_backward_fp8_t(h, da, w)
    _assert_swiglu_t_matches(got, h, da, w, None, p, f"swiglu_backward_fp8_t kind={kind} seed={seed}")


@requires_cuda
def test_swiglu_backward_fp8_t_rejects_bad_row_counts():
    h = torch.zeros(40, 2 * 128, dtype=torch.bfloat16, device=DEVICE)
    da = torch.zeros(40, 128, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(40, device=DEVICE)
    with pytest.raises(ValueError, match=r"h: 40 rows, expected a multiple of 16 .*pass rows= to pad"):
        swiglu_backward_fp8_t(h, da, w)
    for rows in (32, 56, 48.0, True):
        with pytest.raises(ValueError, match=rf"rows={rows!r}: expected an int multiple of 16, at least the 40 rows"):
            swiglu_backward_fp8_t(h, da, w, rows=rows)


# -- quantize_cols_transposed_fp8 ------------------------------------------------------------------

COL_T_SHAPES = [(0, 256), (16, 8), (128, 2048), (144, 136), (1008, 768), (4112, 2048), (304, 7168), (32, 0),
                (1024, 200), (256, 72)]


def _assert_transposed_equal(got, ref, what: str) -> None:
    """``got`` (data [M, R], scale [M, R/128]) is ``ref`` = quantize_cols (data [R, M], scale [R/128, M])
    transposed."""
    (data, scale), (ref_data, ref_scale) = got, ref
    assert data.shape == ref_data.t().shape and scale.shape == ref_scale.t().shape, \
        f"{what}: shapes {tuple(data.shape)} / {tuple(scale.shape)}, expected the transposes of " \
        f"{tuple(ref_data.shape)} / {tuple(ref_scale.shape)}"
    _assert_bit_equal((data, scale), (ref_data.t().contiguous(), ref_scale.t().contiguous()), what)


@requires_hopper
@pytest.mark.parametrize("special", [False, True], ids=["random", "special"])
@pytest.mark.parametrize("r,m", COL_T_SHAPES)
def test_quantize_cols_transposed_matches_torch(prebuilt, r, m, special):
    seed = 9000 * r + m + special
    # Specials along the columns: row-special tiles of x^T, so every third 128x1 tile is one.
    x = _make_rows(m, r, seed, special).t().contiguous() if special else _make_rows(r, m, seed, False)
    ref = fp8.quantize_cols(x)
    poison_cached_memory(0xFF)
    got = quantize_cols_transposed_fp8(x)
    _assert_transposed_equal(got, ref, f"quantize_cols_transposed_fp8 [{r}, {m}] special={special} seed={seed}")


@requires_hopper
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_quantize_cols_transposed_every_tile_special(prebuilt, kind):
    seed = 200 + SPECIAL_KINDS.index(kind)
    gen = torch.Generator().manual_seed(seed)
    r, m = 272, 80  # a ragged last row block (16 rows), a ragged column block (16 of 64)
    xt = torch.stack([torch.cat([_special_tile(kind, 128, gen), _special_tile(kind, 128, gen),
                                 _special_tile(kind, 16, gen)]) for _ in range(m)])
    x = xt.t().contiguous().bfloat16().to(DEVICE)
    ref = fp8.quantize_cols(x)
    poison_cached_memory(0xFF)
    _assert_transposed_equal(quantize_cols_transposed_fp8(x), ref, f"kind={kind} seed={seed}")


@requires_hopper
@pytest.mark.parametrize("kind", ["uniform", "empty_experts", "unused_slots", "one_expert"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden", [(0, 8, 2, 256), (1, 4, 2, 200), (300, 16, 4, 2048),
                                                                  (129, 64, 8, 768), (1000, 3, 1, 136)])
def test_quantize_cols_transposed_gather_matches_pool(prebuilt, kind, num_tokens, num_experts, top_k, hidden):
    """quantize_cols(gather_rows(x)) of the 128-aligned pool (T*K + E*127 rows), zero-padded to a
    multiple of 16 rows as the layer's K-grouped GEMM takes it, transposed: padding rows are zeros."""
    seed = num_tokens * 11 + num_experts * 5 + top_k + hidden
    gen = torch.Generator().manual_seed(seed)
    idx = make_routing(num_tokens, num_experts, top_k, kind, generator=gen).to(DEVICE)
    meta = compute_routing_torch(idx, num_experts, 128)
    x = _make_rows(num_tokens, hidden, seed)
    pool = elementwise.gather_rows(x, meta.row_to_slot, top_k)
    rows = -(-pool.shape[0] // 16) * 16
    ref = fp8.quantize_cols(torch.nn.functional.pad(pool, (0, 0, 0, rows - pool.shape[0])))
    poison_cached_memory(0xFF)
    got = quantize_cols_transposed_fp8(x, gather=(meta.row_to_slot, top_k), rows=rows)
    what = f"gather kind={kind} T={num_tokens} E={num_experts} K={top_k} H={hidden} P={pool.shape[0]} seed={seed}"
    _assert_transposed_equal(got, ref, what)
    padding = meta.row_to_slot < 0
    if padding.any():
        assert (got[0][:, :pool.shape[0]][:, padding].view(torch.uint8) == 0).all(), what
    assert (got[0][:, pool.shape[0]:].view(torch.uint8) == 0).all(), what


@requires_hopper
@pytest.mark.parametrize("r,m,rows", [(1, 8, 16), (100, 136, 112), (1018, 768, 1024), (1018, 768, 1152), (0, 64, 32),
                                      (130, 2048, 144)])
def test_quantize_cols_transposed_padded_rows(prebuilt, r, m, rows):
    """rows=R' >= R: x quantized as if zero-padded to R' rows (zero bytes in the padding, the scales
    of tiles with real rows unchanged, floor scales for tiles of padding only)."""
    seed = 11000 + r + m + rows
    x = _make_rows(m, r, seed).t().contiguous()
    ref = fp8.quantize_cols(torch.nn.functional.pad(x, (0, 0, 0, rows - r)))
    poison_cached_memory(0xFF)
    got = quantize_cols_transposed_fp8(x, rows=rows)
    _assert_transposed_equal(got, ref, f"padded [{r}, {m}] -> {rows} rows seed={seed}")
    assert (got[0][:, r:].view(torch.uint8) == 0).all()


@requires_hopper
def test_quantize_cols_transposed_gather_out_of_range_tokens_read_zeros(prebuilt):
    x = _make_rows(4, 256, 41)
    # top_k 2: tokens 0, 3, 4 (past the end), 50 (past), padding, 1; 10 more padding rows (16 in all)
    row_to_slot = torch.tensor([0, 7, 8, 100, -1, 3] + [-1] * 10, dtype=torch.int32, device=DEVICE)
    assert row_to_slot.shape[0] == 16
    pool = torch.zeros(16, 256, dtype=torch.bfloat16, device=DEVICE)
    for r, token in enumerate([0, 3, None, None, None, 1]):
        if token is not None:
            pool[r] = x[token]
    got = quantize_cols_transposed_fp8(x, gather=(row_to_slot, 2))
    _assert_transposed_equal(got, fp8.quantize_cols(pool), "out-of-range tokens")


@requires_hopper
def test_quantize_cols_transposed_into_given_outputs_and_views(prebuilt):
    seed = 43
    base = _make_rows(704, 2 * 264, seed)
    x = base[:, 264:]  # a strided view: copied to a contiguous tensor first
    ref = fp8.quantize_cols(x)
    out = torch.full((264, 704), 0xFF, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    scale_out = torch.full((264, 6), float("nan"), device=DEVICE)
    data, scale = quantize_cols_transposed_fp8(x, out=out, scale_out=scale_out)
    assert data is out and scale is scale_out
    _assert_transposed_equal((data, scale), ref, f"out= strided seed={seed}")


@requires_cuda
def test_quantize_cols_transposed_rejects_bad_inputs():
    x = torch.zeros(40, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="x: 40 rows, expected a multiple of 16 .*pass rows= to pad"):
        quantize_cols_transposed_fp8(x)
    with pytest.raises(ValueError, match="x: 24 pool rows, expected a multiple of 16"):
        quantize_cols_transposed_fp8(x, gather=(torch.zeros(24, dtype=torch.int32, device=DEVICE), 1))
    for rows in (32, 40, 50, 48.0, True, 2 ** 31):
        with pytest.raises(ValueError, match=f"rows={rows!r}: expected an int multiple of 16, at least the 40 rows"):
            quantize_cols_transposed_fp8(x, rows=rows)
    with pytest.raises(ValueError, match=r"out: got .*expected a torch.float8_e4m3fn tensor of shape \(128, 48\)"):
        quantize_cols_transposed_fp8(x, rows=48, out=torch.empty(128, 40, dtype=torch.float8_e4m3fn, device=DEVICE))
    with pytest.raises(ValueError, match=r"out: got .*expected a torch.float8_e4m3fn tensor of shape \(128, 32\)"):
        quantize_cols_transposed_fp8(x[:32], out=torch.empty(32, 128, dtype=torch.float8_e4m3fn, device=DEVICE))
    with pytest.raises(ValueError, match=r"scale_out: got .*expected a torch.float32 tensor of shape \(128, 1\)"):
        quantize_cols_transposed_fp8(x[:32], scale_out=torch.empty(1, 128, device=DEVICE))
    with pytest.raises(ValueError, match="gather: top_k=0, expected a positive int"):
        quantize_cols_transposed_fp8(x[:32], gather=(torch.zeros(32, dtype=torch.int32, device=DEVICE), 0))


# -- argument checks -------------------------------------------------------------------------------


def test_rejects_host_tensors():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        quantize_rows_fp8(x)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        quantize_cols_fp8(x)
    with pytest.raises(ValueError, match="h: expected a CUDA tensor"):
        swiglu_forward_fp8(torch.zeros(4, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        quantize_cols_transposed_fp8(x)
    with pytest.raises(ValueError, match="h: expected a CUDA tensor"):
        swiglu_backward_fp8(torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 128, dtype=torch.bfloat16),
                            torch.zeros(4))
    with pytest.raises(ValueError, match="h: expected a CUDA tensor"):
        swiglu_backward_fp8_t(torch.zeros(16, 256, dtype=torch.bfloat16), torch.zeros(16, 128, dtype=torch.bfloat16),
                              torch.zeros(16))
    with pytest.raises(ValueError, match="x: expected a CUDA tensor, got list"):
        quantize_rows_fp8([[1.0]])


def test_kernel_arg_types_for_fp8():
    data = torch.zeros(4, dtype=torch.float8_e4m3fn)
    args = (jit.KernelArg("data", "unsigned char*"), jit.KernelArg("n", "unsigned int"))
    assert jit.render_types(args) == "unsigned char*, unsigned int"
    packed = jit.pack_args("k", args, data=data, n=5)
    assert packed[0] is data and packed[1].value == 5
    with pytest.raises(TypeError, match="expected a torch.float8_e4m3fn tensor, got a torch.uint8 tensor"):
        jit.pack_args("k", args, data=data.view(torch.uint8), n=5)
    with pytest.raises(TypeError, match=r"expected an int in \[0, 2\*\*32\)"):
        jit.pack_args("k", args, data=data, n=-1)


@requires_cuda
def test_rejects_bad_inputs_on_gpu():
    x = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="x: dtype torch.float32, expected torch.bfloat16"):
        quantize_rows_fp8(x.float())
    with pytest.raises(ValueError, match=r"x: shape \(4, 12\), expected 2-D with a column count divisible by 8"):
        quantize_rows_fp8(x[:, :12])
    with pytest.raises(ValueError, match=r"x: shape \(2, 2, 128\)"):
        quantize_cols_fp8(x.view(2, 2, 128))
    with pytest.raises(ValueError, match=r"h: shape \(4, 24\), expected 2-D with a column count divisible by 16"):
        swiglu_forward_fp8(x[:, :24])
    with pytest.raises(ValueError, match="clamp=-1.0: expected None or a positive float"):
        swiglu_forward_fp8(x, -1.0)
    with pytest.raises(ValueError, match="return_act=1: expected a bool"):
        swiglu_forward_fp8(x, return_act=1)
    with pytest.raises(ValueError, match=r"out: got a torch.uint8 tensor .*expected a torch.float8_e4m3fn tensor "
                                         r"of shape \(4, 128\)"):
        quantize_rows_fp8(x, out=torch.empty(4, 128, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match=r"scale_out: got a torch.float32 tensor of shape \(4, 2\).*expected a "
                                         r"torch.float32 tensor of shape \(4, 1\)"):
        quantize_rows_fp8(x, scale_out=torch.empty(4, 2, device=DEVICE))
    with pytest.raises(ValueError, match=r"scale_out: got .*expected a torch.float32 tensor of shape \(1, 128\)"):
        quantize_cols_fp8(x, scale_out=torch.empty(4, 1, device=DEVICE))
    with pytest.raises(ValueError, match="out: must be contiguous"):
        quantize_rows_fp8(x, out=torch.empty(128, 4, dtype=torch.float8_e4m3fn, device=DEVICE).t())
    with pytest.raises(ValueError, match="scale_out: must be contiguous and 16-byte aligned"):
        quantize_cols_fp8(x, scale_out=torch.empty(129, device=DEVICE)[1:].view(1, 128))
    with pytest.raises(ValueError, match=r"gather: expected None or a tuple \(row_to_slot, top_k\), got list"):
        quantize_rows_fp8(x, gather=[torch.zeros(3, dtype=torch.int32, device=DEVICE), 1])
    with pytest.raises(ValueError, match="gather: row_to_slot is a torch.int64 tensor .*expected a 1-D int32 tensor"):
        quantize_rows_fp8(x, gather=(torch.zeros(3, dtype=torch.int64, device=DEVICE), 1))
    with pytest.raises(ValueError, match="gather: row_to_slot is a torch.int32 tensor of shape .* on cpu"):
        quantize_rows_fp8(x, gather=(torch.zeros(3, dtype=torch.int32), 1))
    with pytest.raises(ValueError, match="gather: top_k=0, expected a positive int"):
        quantize_rows_fp8(x, gather=(torch.zeros(3, dtype=torch.int32, device=DEVICE), 0))
    with pytest.raises(ValueError, match="gather: top_k=True, expected a positive int"):
        quantize_rows_fp8(x, gather=(torch.zeros(3, dtype=torch.int32, device=DEVICE), True))


def test_grid_is_one_resident_wave(monkeypatch):
    """The grid-stride kernels launch as many CTAs as the SMs hold at once (from ptxas' register
    count), never a partial second wave."""
    class FakeKernel:
        def __init__(self, name, regs):
            self.name, self.regs = name, regs

        def resources(self):
            return [jit.ResourceUsage("f", registers=self.regs)] if self.regs else []

    monkeypatch.setattr(fp8_quant, "_resident", {})
    assert fp8_quant.resident_ctas_per_sm(FakeKernel("a", 32)) == 8
    assert fp8_quant.resident_ctas_per_sm(FakeKernel("b", 38)) == 6  # 40 allocated: 10240 per CTA
    assert fp8_quant.resident_ctas_per_sm(FakeKernel("c", 64)) == 4
    assert fp8_quant.resident_ctas_per_sm(FakeKernel("d", 255)) == 1
    assert fp8_quant.resident_ctas_per_sm(FakeKernel("e", 0)) == 4  # no report
    monkeypatch.setattr(jit, "num_sms", lambda device: 132)
    assert fp8_quant._grid(FakeKernel("b", 38), 10 ** 6, "cuda") == (792, 1, 1)
    assert fp8_quant._grid(FakeKernel("b", 38), 5, "cuda") == (5, 1, 1)


# -- compile (no GPU needed) -----------------------------------------------------------------------

_CUOBJDUMP = shutil.which("cuobjdump") or shutil.which("/usr/local/cuda/bin/cuobjdump")


@requires_compiler
@pytest.mark.parametrize("name,code", [c[:2] for c in fp8_quant.configs()], ids=[c[0] for c in fp8_quant.configs()])
def test_compiles_for_sm90a_without_spills(name, code):
    kernel = jit.build(name, code, arch="sm_90a")
    usages = kernel.resources()
    assert usages and all(u.spill_bytes == 0 and u.stack_frame == 0 for u in usages), f"{name}: {usages}"
    if _CUOBJDUMP is None:
        return
    sass = subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout
    assert "F2FP.SATFINITE.E4M3.F32" in sass, f"{name}: no e4m3 conversion in its SASS"
    # 16-byte loads past L1: into registers, or (the transposing SwiGLU backward, which stages its inputs)
    # cp.async copies into shared memory.
    loads = "LDGSTS.E.BYPASS.128" if name.startswith("fp8_quant_swiglu_bwd_t_") else "LDG.E.NA.128"
    assert loads in sass, f"{name}: no 16-byte {loads} in its SASS"


# -- quantize_weight_blocks_fp8 --------------------------------------------------------------------


def _make_weights(e: int, n: int, k: int, seed: int, special: bool = True) -> torch.Tensor:
    """bf16 [e, n, k] on the GPU: per-block magnitudes 2^-40 .. 2^40, and (special) every third 128x128
    block one of the special kinds in turn (its 128 x 128 values drawn as one flat tile)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen)
    nb, kb = n // 128, k // 128
    count = 0
    for b in range(e * nb * kb):
        ex, rest = divmod(b, nb * kb)
        bn, bk = divmod(rest, kb)
        block = w[ex, bn * 128:(bn + 1) * 128, bk * 128:(bk + 1) * 128]
        block *= 2.0 ** int(torch.randint(-40, 41, (1,), generator=gen))
        if special and b % 3 == 0:
            block.copy_(_special_tile(SPECIAL_KINDS[count % len(SPECIAL_KINDS)], 128 * 128, gen).view(128, 128))
            count += 1
    return w.bfloat16().to(DEVICE)


@requires_hopper
@pytest.mark.parametrize("special", [False, True], ids=["random", "special"])
@pytest.mark.parametrize("e,n,k", [(1, 128, 128), (3, 256, 384), (2, 1536, 2048), (4, 512, 128), (0, 256, 128)])
def test_quantize_weight_blocks_matches_torch(prebuilt, e, n, k, special):
    """Both copies bit for bit what Fp8ExpertWeights.from_bf16's torch path makes: nk = quantize_weight_blocks(w),
    kn its transpose (bytes and scale grid)."""
    seed = 300 + e * 7 + n // 128 + k // 128 + 50 * special
    w = _make_weights(e, n, k, seed, special)
    ref_data, ref_scale = fp8.quantize_weight_blocks(w)
    poison_cached_memory(0xFF)
    nk, nk_scale, kn, kn_scale = fp8_quant.quantize_weight_blocks_fp8(w)
    what = f"quantize_weight_blocks_fp8 [{e}, {n}, {k}] special={special} seed={seed}"
    _assert_bit_equal((nk, nk_scale), (ref_data, ref_scale), what + " nk")
    _assert_bit_equal((kn, kn_scale), (ref_data.transpose(1, 2).contiguous(), ref_scale.transpose(1, 2).contiguous()),
                      what + " kn")


@requires_hopper
def test_weight_cache_takes_the_kernel_when_asked(prebuilt, monkeypatch):
    """DGE_FP8_WEIGHT_KERNEL=1: Fp8ExpertWeights.from_bf16 through the one-pass kernel, the same bits as the
    torch path; a view at an odd offset is copied first."""
    w = _make_weights(2, 256, 384, seed=410)
    torch_path = fp8.Fp8ExpertWeights.from_bf16(w)
    monkeypatch.setenv("DGE_FP8_WEIGHT_KERNEL", "1")
    kernel_path = fp8.Fp8ExpertWeights.from_bf16(w)
    for got, ref, name in ((kernel_path.nk, torch_path.nk, "nk"), (kernel_path.kn, torch_path.kn, "kn")):
        _assert_bit_equal(got, ref, name)
    flat = torch.empty(w.numel() + 1, dtype=torch.bfloat16, device=DEVICE)
    offset = flat[1:].view_as(w)
    offset.copy_(w)
    _assert_bit_equal(fp8_quant.quantize_weight_blocks_fp8(offset)[:2], torch_path.nk, "offset view")


def test_quantize_weight_blocks_rejects_bad_inputs():
    with pytest.raises(ValueError, match="w: expected a CUDA tensor"):
        fp8_quant.quantize_weight_blocks_fp8(torch.zeros(1, 128, 128, dtype=torch.bfloat16))
