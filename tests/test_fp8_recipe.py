"""The blockwise-fp8 recipe: quantizers, the weight cache and the torch emulation of the kernels."""
import gc
import math

import pytest
import torch

from deep_gemm_ext.recipes import fp8
from deep_gemm_ext.testing import make_inputs, rel_err

from gpu_utils import reference_grads

E4M3_HALF_ULP = 2.0 ** -4  # relative rounding bound of a normal e4m3 value (3 mantissa bits)
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # half the spacing of e4m3 subnormals, in units of the scale
T, H, I, E, K = 300, 256, 128, 4, 2
OUTPUTS = ("y", "dx", "d_topk", "d_l1", "d_l2")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# Each quantizer as (quantize, dequantize, scale expanded to the data's shape, tiles of a tensor),
# so one test covers the three tile shapes.
def _tiles_rows(x):
    m, k = x.shape
    return [x[i, j:j + 128] for i in range(m) for j in range(0, k, 128)]


def _tiles_cols(x):
    r, m = x.shape
    return [x[i:i + 128, j] for i in range(0, r, 128) for j in range(m)]


def _tiles_blocks(w):
    e, n, k = w.shape
    return [w[a, i:i + 128, j:j + 128] for a in range(e) for i in range(0, n, 128) for j in range(0, k, 128)]


QUANTIZERS = {
    "rows": (fp8.quantize_rows, fp8.dequantize_rows, lambda s, shape: fp8._expand(s, 1, shape[1]), _tiles_rows,
             (5, 300)),
    "cols": (fp8.quantize_cols, fp8.dequantize_cols, lambda s, shape: fp8._expand(s, 0, shape[0]), _tiles_cols,
             (300, 5)),
    "blocks": (fp8.quantize_weight_blocks, fp8.dequantize_weight_blocks,
               lambda s, shape: fp8._expand(fp8._expand(s, 1, shape[1]), 2, shape[2]), _tiles_blocks, (2, 200, 300)),
}


def _assert_within_rounding(x, data, scale, expand):
    """|dequant - x| <= 2^-4 |x| (normal e4m3) + 2^-10 scale (subnormals): no saturation, no flush."""
    s = expand(scale, x.shape)
    err = (data.float() * s - x).abs()
    bound = E4M3_HALF_ULP * x.abs() + E4M3_SUBNORMAL_HALF_STEP * s
    assert (err <= bound * (1 + 1e-6)).all(), f"max excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("kind", QUANTIZERS)
@pytest.mark.parametrize("magnitude", [1.0, 1e4, 1e30, 1e-9, 1e-30])
def test_quantizers_round_within_e4m3_precision(kind, magnitude):
    """Scale amax/448 per tile: values past 448 do not saturate, tiny ones are not flushed."""
    quantize, dequantize, expand, tiles, shape = QUANTIZERS[kind]
    x = torch.randn(shape, generator=_gen(1), dtype=torch.float64).float() * magnitude
    data, scale = quantize(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scale.dtype == torch.float32 and torch.isfinite(scale).all() and (scale > 0).all()
    _assert_within_rounding(x, data, scale, expand)
    assert torch.equal(dequantize(data, scale), data.float() * expand(scale, x.shape))
    amax = torch.stack([t.abs().max() for t in tiles(x)])
    assert torch.equal(scale.flatten(), amax / 448), "scale is not the tile's amax / 448"
    # The tile's largest element maps onto 448 exactly: the whole e4m3 range is used.
    assert torch.stack([t.abs().max() for t in tiles(data.float())]).eq(448).all()


def test_small_tiles_keep_precision_unlike_a_1e4_amax_floor():
    """Why the amax floor is 448 * 2^-126 and not 1e-4: tiles of small gradients keep their bits."""
    x = torch.randn(4, 256, generator=_gen(2)) * 1e-10
    data, scale = fp8.quantize_rows(x)
    assert rel_err(fp8.dequantize_rows(data, scale), x) < 0.05
    floored = torch.clamp(x.view(4, 2, 128).abs().amax(2), min=1e-4) / 448
    coarse = (x.view(4, 2, 128) / floored[..., None]).to(torch.float8_e4m3fn).float() * floored[..., None]
    assert rel_err(coarse.view(4, 256), x) > 0.5  # the old floor flushes most of the tile to zero


@pytest.mark.parametrize("kind", QUANTIZERS)
def test_ragged_last_tile_scales_from_its_own_elements(kind):
    """Sizes not a multiple of 128: the result is that of the zero-padded tensor, cut back."""
    quantize, _, _, _, shape = QUANTIZERS[kind]
    x = torch.randn(shape, generator=_gen(3))
    data, scale = quantize(x)
    dims = (1,) if kind == "rows" else (0,) if kind == "cols" else (1, 2)
    padded = fp8._padded(x, dims)
    assert padded.shape != x.shape
    pdata, pscale = quantize(padded)
    cut = tuple(slice(0, n) for n in x.shape)
    assert torch.equal(pdata[cut].float(), data.float()) and torch.equal(pscale, scale)
    assert scale.shape == {"rows": (5, 3), "cols": (3, 5), "blocks": (2, 2, 3)}[kind]


@pytest.mark.parametrize("kind", QUANTIZERS)
def test_all_zero_tile_keeps_zeros_and_a_finite_scale(kind):
    quantize, dequantize, _, _, shape = QUANTIZERS[kind]
    x = torch.zeros(shape)
    data, scale = quantize(x)
    assert not data.float().any()
    assert (scale == fp8.SCALE_FLOOR).all() and fp8.SCALE_FLOOR == 2.0 ** -126
    assert torch.isfinite(1 / scale).all()
    assert not dequantize(data, scale).any()


@pytest.mark.parametrize("kind", QUANTIZERS)
def test_nonfinite_elements_become_nan_and_leave_the_rest_of_the_tile_alone(kind):
    quantize, _, expand, tiles, shape = QUANTIZERS[kind]
    x = torch.randn(shape, generator=_gen(4))
    bad = x.clone()
    flat = bad.view(-1)
    positions = [0, 1, 2, flat.numel() - 1]  # NaN, +Inf, -Inf in the first tile; Inf in the last
    for p, v in zip(positions, (math.nan, math.inf, -math.inf, math.inf)):
        flat[p] = v
    data, scale = quantize(bad)
    nan = data.float().isnan()
    assert nan.view(-1)[positions].all() and nan.sum() == len(positions), "exactly the non-finite elements are NaN"
    assert torch.isfinite(scale).all()
    # Finite elements are quantized as if the non-finite ones were absent (here: zero).
    clean = torch.where(torch.isfinite(bad), bad, 0)
    cdata, cscale = quantize(clean)
    assert torch.equal(scale, cscale)
    assert torch.equal(data.float()[~nan], cdata.float()[~nan])
    # A tile of nothing but non-finite values: floor scale, all NaN.
    only = torch.full(shape, math.inf)
    odata, oscale = quantize(only)
    assert odata.float().isnan().all() and (oscale == fp8.SCALE_FLOOR).all()


def test_cols_are_rows_of_the_transpose():
    x = torch.randn(300, 200, generator=_gen(5))
    data, scale = fp8.quantize_cols(x)
    tdata, tscale = fp8.quantize_rows(x.t())
    assert torch.equal(data.float(), tdata.float().t()) and torch.equal(scale, tscale.t())


def test_weight_copies_transpose_exactly():
    w = torch.randn(3, 256, 384, generator=_gen(6)).bfloat16()
    weights = fp8.Fp8ExpertWeights.from_bf16(w)
    assert weights.shape == (3, 256, 384)
    assert weights.nk[1].shape == (3, 2, 3) and weights.kn[0].shape == (3, 384, 256) and weights.kn[1].shape == (3, 3, 2)
    tdata, tscale = fp8.quantize_weight_blocks(w.transpose(1, 2))
    assert torch.equal(weights.kn[0].float(), tdata.float()) and torch.equal(weights.kn[1], tscale)
    assert torch.equal(fp8.dequantize_weight_blocks(*weights.kn), weights.dequantize().transpose(1, 2))
    assert rel_err(weights.dequantize(), w) < 0.05
    assert weights.nbytes == 2 * (3 * 256 * 384 + 4 * 3 * 6)
    with pytest.raises(ValueError, match=r"multiples of 128 for fp8, got shape \(2, 200, 384\)"):
        fp8.Fp8ExpertWeights.from_bf16(torch.randn(2, 200, 384))


def test_weight_quantization_does_not_depend_on_its_chunking(monkeypatch):
    w = torch.randn(5, 200, 300, generator=_gen(14))
    whole = fp8.quantize_weight_blocks(w)
    monkeypatch.setattr(fp8, "_WEIGHT_CHUNK_ELEMENTS", 2 * 256 * 384)  # two experts per pass
    chunked = fp8.quantize_weight_blocks(w)
    assert torch.equal(whole[0].float(), chunked[0].float()) and torch.equal(whole[1], chunked[1])


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        fp8.quantize_rows([[1.0]])
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, K\], got shape \(2, 3, 4\)"):
        fp8.quantize_rows(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        fp8.quantize_cols(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"w must be 3-D \[E, N, K\]"):
        fp8.quantize_weight_blocks(torch.zeros(2, 3))
    data, scale = fp8.quantize_rows(torch.randn(4, 256))
    with pytest.raises(ValueError, match=r"scale has shape \(4, 3\); expected \(4, 2\)"):
        fp8.dequantize_rows(data, torch.ones(4, 3))
    with pytest.raises(TypeError, match="data has dtype torch.float32; expected torch.float8_e4m3fn"):
        fp8.dequantize_cols(data.float(), scale)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        fp8.WeightCache().get(None)


# ---------------------------------------------------------------------------------------------
# The weight cache.


class Experts(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = _gen(seed)
        self.l1 = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g).bfloat16())
        self.l2 = torch.nn.Parameter(torch.randn(E, H, I, generator=g).bfloat16())


def _same(a: fp8.Fp8ExpertWeights, b: fp8.Fp8ExpertWeights) -> bool:
    return all(torch.equal(p.float(), q.float()) for p, q in zip((*a.nk, *a.kn), (*b.nk, *b.kn)))


def _assert_fresh(cache, param, old):
    new = cache.get(param)
    assert new is not old and not _same(new, old), "a changed parameter served its old fp8 copy"
    assert _same(new, fp8.Fp8ExpertWeights.from_bf16(param))
    assert cache.get(param) is new  # and is cached again


def test_cache_quantizes_once_per_version():
    cache, experts = fp8.WeightCache(), Experts(0)
    first = cache.get(experts.l1)
    assert cache.get(experts.l1) is first and len(cache) == 1
    assert _same(first, fp8.Fp8ExpertWeights.from_bf16(experts.l1))
    # Identity, not value: an equal copy is another entry.
    copy = experts.l1.detach().clone()
    assert cache.get(copy) is not first and len(cache) == 2
    # Deterministic: a second cache builds bit-identical copies.
    assert _same(fp8.WeightCache().get(experts.l1), first)


def test_cache_sees_an_optimizer_step():
    cache, experts = fp8.WeightCache(), Experts(1)
    old = cache.get(experts.l1), cache.get(experts.l2)
    opt = torch.optim.SGD(experts.parameters(), lr=0.5)
    (experts.l1.float().square().sum() + experts.l2.float().sum()).backward()
    opt.step()
    _assert_fresh(cache, experts.l1, old[0])
    _assert_fresh(cache, experts.l2, old[1])


def test_cache_sees_load_state_dict():
    cache, experts = fp8.WeightCache(), Experts(2)
    old = cache.get(experts.l1)
    experts.load_state_dict(Experts(3).state_dict())
    _assert_fresh(cache, experts.l1, old)


def test_cache_sees_an_in_place_edit():
    cache, experts = fp8.WeightCache(), Experts(4)
    old = cache.get(experts.l2)
    with torch.no_grad():
        experts.l2.mul_(3)
    _assert_fresh(cache, experts.l2, old)
    # Writes through .data bypass the version counter: invalidate() is the documented way out.
    stale = cache.get(experts.l2)
    experts.l2.data.mul_(2)
    assert cache.get(experts.l2) is stale
    cache.invalidate(experts.l2)
    _assert_fresh(cache, experts.l2, stale)


def test_cache_does_not_keep_inference_tensors():
    """Inference tensors have no version counter: quantized on every call, never cached."""
    cache = fp8.WeightCache()
    with torch.inference_mode():
        w = torch.randn(E, H, I)
    first = cache.get(w)
    assert len(cache) == 0 and cache.get(w) is not first and _same(cache.get(w), first)


def test_cache_sees_an_optimizer_step_the_version_counter_misses():
    """FSDP2 refills its unsharded parameters without bumping their version: any optimizer step
    in the process makes every entry stale."""
    cache, experts, other = fp8.WeightCache(), Experts(7), torch.nn.Linear(2, 2)
    old = cache.get(experts.l1)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(experts.l1):
        experts.l1.mul_(2)
    assert cache.get(experts.l1) is old  # the counter did not move
    other(torch.ones(2)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    _assert_fresh(cache, experts.l1, old)


def test_cache_entry_goes_with_its_weight():
    """A per-call weight (not a parameter) takes its entry with it; a parameter is not referenced (so that
    it can be swapped), and its entry goes at a sweep: an optimizer step, or a quantization once the
    entries have doubled."""
    cache, experts = fp8.WeightCache(), Experts(5)
    cache.get(experts.l1), cache.get(experts.l2)
    cast = experts.l2.detach().float().bfloat16()  # what autocast makes per call
    cache.get(cast)
    assert len(cache) == 3 and cache.memory_bytes() > 0
    del cast
    gc.collect()
    assert len(cache) == 2
    del experts
    gc.collect()
    cache.sweep()
    assert len(cache) == 0 and cache.memory_bytes() == 0
    # Dead parameters never pile up: the sweep at a quantization keeps the entries within twice the live ones.
    alive = Experts(8)
    for seed in range(40):
        cache.get(Experts(seed).l2)
        cache.get(alive.l2)
        assert len(cache) <= 17
    # And an optimizer step anywhere in the process sweeps the layer's cache.
    fp8.WEIGHT_CACHE.get(Experts(9).l1)
    gc.collect()
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(2)).sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    assert all(not entry.storage.expired() for entry in fp8.WEIGHT_CACHE._entries.values())


def test_cache_sees_a_new_storage_at_the_old_address():
    """``w.data = new`` leaves the version counter alone; where the allocator hands the new storage the old
    one's address, only the storage's identity tells the weights apart. Two storages over one buffer
    (torch.frombuffer) have one address deterministically."""
    import numpy as np

    cache, experts = fp8.WeightCache(), Experts(9)
    buffer = np.empty(experts.l2.numel(), dtype=np.uint16)

    def storage_over_buffer(values):
        buffer[:] = values.view(torch.uint16).reshape(-1).numpy()  # no torch write: no counter moves
        return torch.frombuffer(buffer, dtype=torch.bfloat16).view(experts.l2.shape)

    experts.l2.data = storage_over_buffer(experts.l2.detach().clone())
    old = cache.get(experts.l2)
    address = experts.l2.data_ptr()
    experts.l2.data = storage_over_buffer(torch.randn(E, H, I, generator=_gen(10)).bfloat16())
    assert experts.l2.data_ptr() == address and experts.l2._version == 0
    _assert_fresh(cache, experts.l2, old)


def test_cache_lets_parameters_be_swapped():
    """torch.utils.swap_tensors (Module.to / load_state_dict under swap_module_params_on_conversion)
    refuses a tensor with a weak reference: the cache holds none, and sees the swap."""
    cache, experts = fp8.WeightCache(), Experts(11)
    old = cache.get(experts.l1)
    torch.utils.swap_tensors(experts.l1, torch.nn.Parameter(Experts(12).l1.detach().clone()))
    _assert_fresh(cache, experts.l1, old)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        experts.load_state_dict(Experts(13).state_dict())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    _assert_fresh(cache, experts.l1, cache.get(Experts(12).l1))


def test_cache_memory_matches_the_documented_cost():
    cache, experts = fp8.WeightCache(), Experts(6)
    cache.get(experts.l1), cache.get(experts.l2)
    assert cache.memory_bytes() == fp8.fp8_weight_cache_bytes(E, H, I)
    cache.clear()
    assert len(cache) == 0 and cache.memory_bytes() == 0
    # (2I*H + H*I) * E * 2 copies of 1-byte data, plus 4-byte scales per 128x128 block per copy.
    assert fp8.fp8_weight_cache_bytes(E, H, I) == (2 * I * H + H * I) * E * 2 + (4 + 2) * E * 2 * 4
    # DeepSeek-V3 (H 7168, I 2048, E 256): as many bytes as the bf16 weights (21.0 GiB), plus 0.1%.
    bf16_bytes = 3 * 7168 * 2048 * 256 * 2
    assert 1 < fp8.fp8_weight_cache_bytes(256, 7168, 2048) / bf16_bytes < 1.001


# ---------------------------------------------------------------------------------------------
# The emulated GEMMs.


def _pool(rows_per_expert, align=128):
    """starts / ends of a pool whose experts own round_up(count, align) rows, in order."""
    starts, ends, at = [], [], 0
    for count in rows_per_expert:
        starts.append(at)
        at += -(-count // align) * align
        ends.append(at)
    return starts, ends, at


def test_emulated_m_grouped_gemm_is_an_fp32_matmul_of_the_dequantized_operands():
    starts, ends, rows = _pool([130, 0, 5])
    a = torch.randn(rows + 7, 256, generator=_gen(7))  # trailing rows no expert owns
    w = torch.randn(3, 384, 256, generator=_gen(8))
    (aq, sa), (wq, sw) = fp8.quantize_rows(a), fp8.quantize_weight_blocks(w)
    out = fp8.emulate_grouped_gemm_nt(aq, sa, wq, sw, torch.tensor(starts), torch.tensor(ends))
    a_eff, w_eff = fp8.dequantize_rows(aq, sa).double(), fp8.dequantize_weight_blocks(wq, sw).double()
    assert out.dtype == torch.float32 and out.shape == (rows + 7, 384)
    for e, (s, t) in enumerate(zip(starts, ends)):
        assert rel_err(out[s:t], a_eff[s:t] @ w_eff[e].t()) < 1e-6  # fp32 rounding only
    assert not out[rows:].any()
    assert rel_err(out[:130], a[:130] @ w[0].t()) < 0.1
    with pytest.raises(ValueError, match="weight has K=128"):
        fp8.emulate_grouped_gemm_nt(aq, sa, *fp8.quantize_weight_blocks(torch.randn(3, 384, 128)), starts, ends)
    with pytest.raises(ValueError, match=r"expert 2 owns rows \[256, 9999\)"):
        fp8.emulate_grouped_gemm_nt(aq, sa, wq, sw, starts, [128, 256, 9999])


def test_emulated_k_grouped_gemm_contracts_over_each_experts_rows():
    starts, ends, rows = _pool([200, 0, 60])
    a = torch.randn(rows, 256, generator=_gen(9))
    b = torch.randn(rows, 128, generator=_gen(10))
    (aq, sa), (bq, sb) = fp8.quantize_cols(a), fp8.quantize_cols(b)
    d = fp8.emulate_grouped_gemm_tn(aq, sa, bq, sb, starts, ends)
    a_eff, b_eff = fp8.dequantize_cols(aq, sa).double(), fp8.dequantize_cols(bq, sb).double()
    assert d.shape == (3, 256, 128) and d.dtype == torch.float32 and not d[1].any()
    for e in (0, 2):
        s, t = starts[e], ends[e]
        assert rel_err(d[e], a_eff[s:t].t() @ b_eff[s:t]) < 1e-6
    with pytest.raises(ValueError, match=r"expert 0 owns rows \[0, 200\).*multiples of 128"):
        fp8.emulate_grouped_gemm_tn(aq, sa, bq, sb, [0, 200, 256], [200, 256, 384])


def test_emulated_gemms_put_nan_exactly_where_the_reference_is_not_finite():
    starts, ends, rows = _pool([128, 128])
    a = torch.randn(rows, 256, generator=_gen(11))
    w = torch.randn(2, 128, 256, generator=_gen(12))
    a[3, 7], a[5, 200], a[130, 0] = math.inf, -math.inf, math.nan
    w[1, 9, 100], w[0, 4, 30] = math.inf, 0.0
    a[6, 30] = math.inf  # meets a zero weight: Inf * 0 = NaN in the reference
    out = fp8.emulate_grouped_gemm_nt(*fp8.quantize_rows(a), *fp8.quantize_weight_blocks(w), starts, ends)
    ref = torch.cat([a[s:t].double() @ w[e].double().t() for e, (s, t) in enumerate(zip(starts, ends))])
    assert (~torch.isfinite(ref)).any() and torch.equal(~torch.isfinite(out), ~torch.isfinite(ref))
    assert not torch.isinf(out).any()  # e4m3 carries non-finite values as NaN

    b = torch.randn(rows, 64, generator=_gen(13))
    b[140, 3] = math.inf
    d = fp8.emulate_grouped_gemm_tn(*fp8.quantize_cols(a), *fp8.quantize_cols(b), starts, ends)
    ref = torch.stack([a[s:t].double().t() @ b[s:t].double() for s, t in zip(starts, ends)])
    assert torch.isfinite(ref).any() and torch.equal(~torch.isfinite(d), ~torch.isfinite(ref))


# ---------------------------------------------------------------------------------------------
# The emulated layer against the fp64 reference.


def _case(num_tokens, routing, seed):
    x, idx, w, l1, l2 = make_inputs(num_tokens, H, I, E, K, routing=routing, seed=seed, requires_grad=False)
    dy = torch.randn(num_tokens, H, generator=_gen(seed + 100)).bfloat16()
    return x, idx, w, l1, l2, dy


def _errors(case, clamp, **kw):
    x, idx, w, l1, l2, dy = case
    y_ref, g_ref = reference_grads(x, idx, w, l1, l2, clamp, dy)
    out = fp8.fp8_reference_layer(x, idx, w, l1, l2, clamp, dy, **kw)
    for o, r in zip(out, (y_ref, *g_ref)):
        assert o.dtype == torch.float32 and o.shape == r.shape
    return {name: rel_err(o, r) for name, o, r in zip(OUTPUTS, out, (y_ref, *g_ref))}


@pytest.mark.parametrize("num_tokens, routing, clamp", [
    (300, "uniform", None), (300, "unused_slots", 4.0), (64, "empty_experts", None), (200, "one_expert", 4.0),
    (300, "zipf", None), (1, "uniform", None)])
def test_layer_error_is_fp8_sized_and_vanishes_without_quantization(num_tokens, routing, clamp):
    case = _case(num_tokens, routing, seed=num_tokens)
    for name, err in _errors(case, clamp).items():
        assert 0 < err < 0.1, f"{name}: fp8 rel err {err:.3g} ({routing}, T={num_tokens}, clamp={clamp})"
    for name, err in _errors(case, clamp, quantize=False).items():
        assert err < 1e-5, f"{name}: unquantized rel err {err:.3g} ({routing}, T={num_tokens})"


def test_layer_with_a_tight_clamp():
    """A clamp inside h's range: fp8 noise moves elements across it, which switches their
    gradient on or off, so the gradients through dh (dx, d_l1) carry more error."""
    errors = _errors(_case(300, "uniform", seed=3), 1.0)
    for name, err in errors.items():
        assert 0 < err < (0.25 if name in ("dx", "d_l1") else 0.1), f"{name}: {err:.3g}"


def test_layer_with_no_tokens():
    x, idx, w, l1, l2, dy = _case(0, "uniform", seed=0)
    y, dx, d_topk, d_l1, d_l2 = fp8.fp8_reference_layer(x, idx, w, l1, l2, None, dy)
    assert y.shape == (0, H) and dx.shape == (0, H) and d_topk.shape == (0, K)
    assert d_l1.shape == l1.shape and d_l2.shape == l2.shape and not d_l1.any() and not d_l2.any()


def test_wgrad_mode_changes_the_weight_gradients_only():
    case = _case(300, "uniform", seed=5)
    x, idx, w, l1, l2, dy = case
    fp8_out = fp8.fp8_reference_layer(x, idx, w, l1, l2, None, dy, wgrad="fp8")
    bf16_out = fp8.fp8_reference_layer(x, idx, w, l1, l2, None, dy, wgrad="bf16")
    for name, a, b in zip(OUTPUTS, fp8_out, bf16_out):
        assert torch.equal(a, b) == (name not in ("d_l1", "d_l2")), name
    fp8_err, bf16_err = _errors(case, None, wgrad="fp8"), _errors(case, None, wgrad="bf16")
    for name in ("d_l1", "d_l2"):
        assert bf16_err[name] < fp8_err[name], name
    with pytest.raises(ValueError, match=r"wgrad='fp16'; expected one of \('fp8', 'bf16'\)"):
        fp8.fp8_reference_layer(x, idx, w, l1, l2, None, dy, wgrad="fp16")


def _toward_quantized(t, quantize, dequantize):
    """t moved halfway toward its own quantized value: every element rounds to the same e4m3 code
    and no tile's amax changes, so the quantized operand is bit-identical."""
    data, scale = quantize(t.float())
    moved = (t.float() + 0.5 * (dequantize(data, scale) - t.float())).to(t.dtype)
    assert not torch.equal(moved, t)
    data2, scale2 = quantize(moved.float())
    assert torch.equal(data2.float(), data.float()) and torch.equal(scale2, scale)
    return moved


def _outputs(case, clamp=None):
    return dict(zip(OUTPUTS, fp8.fp8_reference_layer(*case[:5], clamp, case[5])))


def test_quantization_points_are_the_documented_ones():
    """Inputs moved below their tile's quantization step leave exactly the outputs unchanged that
    read them through that quantizer only: x (1x128 rows) for y, the weights (128x128 blocks) for
    everything, dy (1x128 rows) for dx, d topk and d_l1; a move past the step shows up."""
    case = _case(300, "uniform", seed=6)
    x, idx, w, l1, l2, dy = case
    x, l1, l2, dy = (t.float() for t in (x, l1, l2, dy))
    base = _outputs((x, idx, w, l1, l2, dy), 4.0)

    x_moved = _toward_quantized(x, fp8.quantize_rows, fp8.dequantize_rows)
    assert torch.equal(_outputs((x_moved, idx, w, l1, l2, dy), 4.0)["y"], base["y"])
    for name in ("l1", "l2"):
        moved = _toward_quantized({"l1": l1, "l2": l2}[name], fp8.quantize_weight_blocks,
                                  fp8.dequantize_weight_blocks)
        args = (x, idx, w, moved, l2, dy) if name == "l1" else (x, idx, w, l1, moved, dy)
        out = _outputs(args, 4.0)
        assert all(torch.equal(out[k], base[k]) for k in OUTPUTS), name
    dy_moved = _toward_quantized(dy, fp8.quantize_rows, fp8.dequantize_rows)
    out = _outputs((x, idx, w, l1, l2, dy_moved), 4.0)
    assert all(torch.equal(out[k], base[k]) for k in ("y", "dx", "d_topk", "d_l1"))
    assert not torch.equal(out["d_l2"], base["d_l2"])  # dW2 reads dy column-quantized

    # A move of a whole step: the same element now rounds to a neighbouring code.
    data, scale = fp8.quantize_rows(x)
    stepped = x.clone()
    stepped[0, 1] = x[0, 1] + 0.2 * x[0, 1].abs() + scale[0, 0] * 2 ** -6
    assert not torch.equal(_outputs((stepped, idx, w, l1, l2, dy), 4.0)["y"], base["y"])


@pytest.mark.parametrize("where", ["x_inf", "x_nan", "l2_inf"])
def test_layer_nonfinite_positions_match_the_reference(where):
    x, idx, w, l1, l2, dy = _case(300, "uniform", seed=7)
    x, l1, l2 = x.clone(), l1.clone(), l2.clone()
    if where == "x_inf":
        x[5, 17] = math.inf
    elif where == "x_nan":
        x[9, 200] = math.nan
    else:
        l2[int(idx[0, 0]), 3, 40] = -math.inf
    y_ref, g_ref = reference_grads(x, idx, w, l1, l2, None, dy)
    out = fp8.fp8_reference_layer(x, idx, w, l1, l2, None, dy)
    for name, o, r in zip(OUTPUTS, out, (y_ref, *g_ref)):
        # An Inf in W2 does not reach dW2 = dy^T (w*act); every other case reaches all five outputs.
        assert (~torch.isfinite(r)).any() != (where == "l2_inf" and name == "d_l2"), name
        assert torch.equal(~torch.isfinite(o), ~torch.isfinite(r)), \
            f"{name}: {int((~torch.isfinite(o)).sum())} non-finite vs the reference's {int((~torch.isfinite(r)).sum())}"


@pytest.mark.parametrize("where", ["x", "l1"])
def test_an_inf_under_a_clamp_is_the_layer_with_a_nan_there(where):
    """e4m3 stores an Inf as NaN, and under activation_clamp the reference's clamp maps an Inf in h to c but
    keeps a NaN: the fp8 layer then follows the reference for a NaN in that place (README, FP8 recipe)."""
    case = _case(300, "uniform", seed=14)
    outs = []
    for value in (math.inf, math.nan):
        x, idx, w, l1, l2, dy = (t.clone() for t in case)
        if where == "x":
            x[5, 17] = value
        else:
            l1[1, 17, 40] = value
        outs.append(fp8.fp8_reference_layer(x, idx, w, l1, l2, 1.0, dy))
    assert outs[0][0].isnan().any()  # y: the poison reached the output
    for name, a, b in zip(OUTPUTS, *outs):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan()), name


# ---------------------------------------------------------------------------------------------
# recipe="fp8" through the layer: on CPU (and on GPUs without fp8 kernels) the torch providers run
# the emulation; the layer's sequence is the one of every recipe.

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext import plan  # noqa: E402

from conftest import poison_cached_memory, requires_cuda  # noqa: E402
from gpu_utils import run_layer  # noqa: E402


def _layer(recipe="fp8", backend="auto"):
    return lambda x, idx, w, l1, l2, c: dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=c, recipe=recipe,
                                                           backend=backend)


def _leaves(case, dtype=torch.float32, device="cpu"):
    x, idx, w, l1, l2, dy = case
    x, l1, l2, dy = (t.to(device, dtype) for t in (x, l1, l2, dy))
    leaves = [t.detach().clone().requires_grad_() for t in (x, w.to(device), l1, l2)]
    return leaves[0], idx.to(device), leaves[1], leaves[2], leaves[3], dy


@pytest.mark.parametrize("num_tokens, routing, clamp", [
    (300, "uniform", None), (300, "unused_slots", 1.0), (64, "empty_experts", None), (200, "one_expert", 4.0),
    (1, "uniform", None)])
def test_layer_recipe_fp8_is_the_reference_layer(num_tokens, routing, clamp):
    """fp32 on CPU: the layer under recipe="fp8" and the emulated reference layer quantize at the same
    points and compute in the same order: bit-identical."""
    x, idx, w, l1, l2, dy = _leaves(_case(num_tokens, routing, seed=num_tokens + 1))
    assert plan.resolve(x, l1, recipe="fp8").align == 128
    y, grads = run_layer(_layer(), x, idx, w, l1, l2, clamp, dy)
    ref = fp8.fp8_reference_layer(x, idx, w, l1, l2, clamp, dy)
    for name, out, r in zip(OUTPUTS, (y, *grads), ref):
        assert torch.equal(out, r), f"{name}: max |diff| {(out - r).abs().max():.3g}"


def test_layer_recipe_fp8_in_bf16_and_with_no_tokens():
    x, idx, w, l1, l2, dy = _leaves(_case(300, "zipf", seed=8), torch.bfloat16)
    y, grads = run_layer(_layer(), x, idx, w, l1, l2, None, dy)
    y_ref, g_ref = reference_grads(x, idx, w, l1, l2, None, dy)
    for name, out, r in zip(OUTPUTS, (y, *grads), (y_ref, *g_ref)):
        assert out.dtype == (torch.float32 if name == "d_topk" else torch.bfloat16)
        assert 0 < rel_err(out, r) < 0.1, name
    x, idx, w, l1, l2, dy = _leaves(_case(0, "uniform", seed=0), torch.bfloat16)
    y, grads = run_layer(_layer(), x, idx, w, l1, l2, None, dy)
    assert y.shape == (0, H) and all(not g.any() for g in grads)


def test_layer_recipe_fp8_bf16_weight_gradients(monkeypatch):
    x, idx, w, l1, l2, dy = _leaves(_case(300, "uniform", seed=9))
    monkeypatch.setenv("DGE_FP8_WGRAD", "bf16")
    assert plan.resolve(x, l1, recipe="fp8").precision.fp8_wgrad is False
    y, grads = run_layer(_layer(), x, idx, w, l1, l2, None, dy)
    ref = fp8.fp8_reference_layer(x, idx, w, l1, l2, None, dy, wgrad="bf16")
    for name, out, r in zip(OUTPUTS, (y, *grads), ref):
        assert torch.equal(out, r), name
    monkeypatch.setenv("DGE_FP8_WGRAD", "fp16")
    with pytest.raises(ValueError, match="DGE_FP8_WGRAD='fp16': expected fp8 or bf16"):
        dge.mega_moe_train(x, idx, w, l1, l2, recipe="fp8")


def test_layer_quantizes_weights_once_per_version(monkeypatch):
    """Forward and backward of several steps read the cache; an optimizer step re-quantizes once."""
    calls = []
    quantize = fp8.Fp8ExpertWeights.from_bf16.__func__
    monkeypatch.setattr(fp8.Fp8ExpertWeights, "from_bf16",
                        classmethod(lambda cls, w: calls.append(tuple(w.shape)) or quantize(cls, w)))
    x, idx, w, _, _, dy = _case(64, "uniform", seed=10)
    module = dge.MegaMoE(E, H, I, K, recipe="fp8", dtype=torch.float32)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(2):
        module.zero_grad()
        y = module(x.float(), idx, w)
        y.backward(dy.float())
    assert len(calls) == 2, f"quantized {len(calls)} times in two steps without a weight update: {calls}"
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())
    opt.step()
    module(x.float(), idx, w).backward(dy.float())
    assert len(calls) == 4


def test_weight_cache_is_bypassed_under_cuda_graph_capture(monkeypatch):
    """While a CUDA graph is captured the weights are quantized inside it and nothing is cached, so a
    replay after an in-place weight update reads the new weights."""
    w = torch.randn(2, 128, 256)
    cache = fp8.WeightCache()
    monkeypatch.setattr(fp8, "_capturing_cuda_graph", lambda weight: True)
    first, second = cache.get(w), cache.get(w)
    assert first is not second and len(cache) == 0
    assert torch.equal(first.nk[1], second.nk[1])
    monkeypatch.setattr(fp8, "_capturing_cuda_graph", lambda weight: False)
    assert cache.get(w) is cache.get(w) and len(cache) == 1


def test_plan_runs_fp8_on_our_sm90_kernels(monkeypatch):
    """On an SM90 GPU "auto" runs both recipes on our kernels; under fp8 their weight gradients are
    bf16 unless DGE_FP8_WGRAD says otherwise (the fp8 K-grouped GEMM is opt-in there), fp8 on the
    other providers; the SwiGLU backward quantizes dh on ours only."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(plan, "jit_available", lambda device: True)
    facts = plan.ShapeFacts(sm90_gemm=True, grouped_mm_groups=True)
    cuda = torch.device("cuda", 0)
    assert plan.choose_provider(cuda, torch.bfloat16, facts, "auto", "bf16") == "sm90"
    assert plan.choose_provider(cuda, torch.bfloat16, facts, "auto", "fp8") == "sm90"
    assert plan.choose_provider(cuda, torch.bfloat16, facts, "deep_gemm", "fp8") == "deep_gemm"
    resolve = plan._resolve_encoded.__wrapped__ if hasattr(plan._resolve_encoded, "__wrapped__") else \
        plan._resolve_encoded
    monkeypatch.delenv("DGE_FP8_WGRAD", raising=False)
    sm90 = plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "auto", "fp8", "local"))
    assert (sm90.provider, sm90.fp8_wgrad, sm90.precision.fp8_wgrad) == ("sm90", "bf16", False)
    assert sm90.combine_epilogue and sm90.fp8_rows and not sm90.fp8_cols
    assert "act and dh quantized in the SwiGLU kernels, dy per token" in sm90.describe()
    assert plan.Plan.decode(sm90.encode()) == sm90
    assert not plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "auto", "bf16", "local")).fp8_rows
    torch_plan = plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "torch", "fp8", "local"))
    assert (torch_plan.provider, torch_plan.fp8_wgrad, torch_plan.fp8_rows) == ("grouped_mm", "fp8", False)
    monkeypatch.delenv("DGE_FUSED_GATHER_BACKWARD", raising=False)
    monkeypatch.delenv("DGE_FUSED_GATHER", raising=False)
    assert not sm90.gather_backward  # bf16 weight gradients: the GEMMs' gathers are slower than pools
    monkeypatch.setenv("DGE_FUSED_GATHER_BACKWARD", "1")  # bf16 weight gradients read pools regardless
    for recipe in ("bf16", "fp8"):
        assert not plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "auto", recipe, "local")).gather_backward
    monkeypatch.delenv("DGE_FUSED_GATHER_BACKWARD")
    monkeypatch.setenv("DGE_FP8_WGRAD", "fp8")
    fp8_wgrad = plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "auto", "fp8", "local"))
    # fp8 weight gradients on ours: every backward operand is quantized by a gathering kernel.
    assert (fp8_wgrad.fp8_wgrad, fp8_wgrad.gather_x, fp8_wgrad.gather_backward, fp8_wgrad.fp8_rows) == \
        ("fp8", "cp_async", True, True)
    # ... and dh's and act_w's column quantization comes from the SwiGLU backward (Fp8Cols operands).
    assert fp8_wgrad.fp8_cols and "dh and act_w column-quantized in the SwiGLU backward" in fp8_wgrad.describe()
    assert plan.Plan.decode(fp8_wgrad.encode()) == fp8_wgrad
    assert not plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "torch", "fp8", "local")).fp8_cols
    monkeypatch.setenv("DGE_FUSED_GATHER_BACKWARD", "0")
    assert not plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "auto", "fp8", "local")).gather_backward
    monkeypatch.setenv("DGE_FUSED_GATHER", "0")
    monkeypatch.delenv("DGE_FUSED_GATHER_BACKWARD")
    assert not plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "auto", "fp8", "local")).gather_backward
    torch_fp8 = plan.Plan.decode(resolve("cuda", 0, torch.bfloat16, *facts, "torch", "fp8", "local"))
    assert not torch_fp8.gather_backward


def test_recipe_fp8_needs_multiples_of_128():
    assert dge.unsupported_shape_reason(2048, 768, "fp8", device_type="cpu") is None
    assert dge.unsupported_shape_reason(2048, 96, "fp8", device_type="cpu") == (
        "intermediate=96 is not a multiple of 128, which recipe='fp8' needs for its 128x128 weight blocks")
    x, idx, w, l1, l2 = make_inputs(8, 16, 8, 4, 2, seed=0)
    with pytest.raises(ValueError, match="hidden=16 is not a multiple of 128"):
        dge.mega_moe_train(x, idx, w, l1, l2, recipe="fp8")


def test_recipe_fp8_under_torch_compile_is_bit_equal():
    torch._dynamo.reset()
    x, idx, w, l1, l2, dy = _leaves(_case(40, "unused_slots", seed=11))
    eager = run_layer(_layer(), x, idx, w, l1, l2, None, dy)
    compiled = torch.compile(lambda *a: dge.mega_moe_train(*a, recipe="fp8"), fullgraph=True)
    out = run_layer(lambda x, idx, w, l1, l2, c: compiled(x, idx, w, l1, l2), x, idx, w, l1, l2, None, dy)
    torch._dynamo.reset()
    for a, b in zip((eager[0], *eager[1]), (out[0], *out[1])):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize("routing, clamp", [("uniform", None), ("unused_slots", 4.0), ("one_expert", None)])
def test_gpu_layer_recipe_fp8_matches_the_emulation(routing, clamp):
    """The GPU layer under recipe="fp8" (DeepGEMM's kernels where installed, else the emulation on
    torch providers): its error against the fp64 reference within 1.02x (+1e-3) of the fp32 emulated
    reference layer's (docs/architecture.md, protocol), outputs NaN-poisoned first."""
    backends = ["auto", "torch"] + (["deep_gemm"] if _deep_gemm_sm90() else [])
    x, idx, w, l1, l2, dy = _leaves(_case(300, routing, seed=12), torch.bfloat16, "cuda")
    y_ref, g_ref = reference_grads(x, idx, w, l1, l2, clamp, dy)
    emulations = {}
    for backend in backends:
        wgrad = plan.resolve(x, l1, backend=backend, recipe="fp8").fp8_wgrad
        if wgrad not in emulations:
            emulations[wgrad] = fp8.fp8_reference_layer(x, idx, w, l1, l2, clamp, dy, wgrad=wgrad)
        emulated = emulations[wgrad]
        poison_cached_memory(reserve_bytes=1 << 28)
        y, grads = run_layer(_layer(backend=backend), x, idx, w, l1, l2, clamp, dy)
        for name, out, emu, r in zip(OUTPUTS, (y, *grads), emulated, (y_ref, *g_ref)):
            err, emu_err = rel_err(out, r), rel_err(emu, r)
            print(f"[{backend} {routing} clamp={clamp}] {name}: {err:.3e} (emulation {emu_err:.3e})")
            assert torch.isfinite(out).all(), f"{backend} {name}: non-finite output"
            assert err <= 1.02 * emu_err + 1e-3, f"{backend} {name}: {err:.3e} vs emulation {emu_err:.3e}"


def _deep_gemm_sm90() -> bool:
    from deep_gemm_ext.providers import deepgemm
    return torch.cuda.get_device_capability()[0] == 9 and deepgemm.is_available()


@requires_cuda
def test_gpu_deep_gemm_reads_the_weight_cache(monkeypatch):
    if not _deep_gemm_sm90():
        pytest.skip("needs an SM90 GPU and an importable deep_gemm")
    calls = []
    quantize = fp8.Fp8ExpertWeights.from_bf16.__func__
    monkeypatch.setattr(fp8.Fp8ExpertWeights, "from_bf16",
                        classmethod(lambda cls, w: calls.append(tuple(w.shape)) or quantize(cls, w)))
    x, idx, w, l1, l2, dy = _leaves(_case(300, "uniform", seed=13), torch.bfloat16, "cuda")
    for _ in range(2):
        run_layer(_layer(backend="deep_gemm"), x, idx, w, l1, l2, None, dy)
    assert len(calls) == 2, calls


def test_fused_dy_pools_rule():
    # The fp8 backward makes dy's quantized and bf16 pools in one launch up to H = 2048 (where it measured
    # at least as fast as the gather and the quantizer apart), in two above.
    from deep_gemm_ext import layer
    assert layer.FUSED_DY_POOLS_MAX_HIDDEN == 2048
    assert [layer.fused_dy_pools(h) for h in (256, 2048, 2056, 4096, 7168)] == [True, True, False, False, False]


class _WiringKernels:
    """The JIT kernel functions the fp8 backward calls, in torch on the CPU (for the wiring test below)."""
    MAX_TOP_K = 32

    def __init__(self):
        self.swiglu_rows = []

    @staticmethod
    def take_or_zero(src, index):
        return torch.cat([src, src.new_zeros(1)])[index.long()]

    @staticmethod
    def combine_rows(o, slot_to_row, weights, top_k):
        from deep_gemm_ext import elementwise
        return elementwise.combine_rows(o, slot_to_row, weights, top_k, o.dtype)

    @staticmethod
    def _bf16_backward(h, da, row_weight, clamp):
        from deep_gemm_ext import elementwise
        return elementwise.swiglu_backward(h, da, row_weight, clamp)

    def swiglu_backward_fp8(self, h, da, row_weight, clamp):
        dh, dweight, act_w = self._bf16_backward(h, da, row_weight, clamp)
        return (dh, dweight, act_w, *fp8.quantize_rows(dh))

    def swiglu_backward_fp8_t(self, h, da, row_weight, clamp, *, rows):
        self.swiglu_rows.append(rows)
        dh, dweight, act_w = self._bf16_backward(h, da, row_weight, clamp)
        return (dweight, *fp8.quantize_rows(dh), *_cols_transposed(dh, rows), *_cols_transposed(act_w, rows))


def _cols_transposed(x, rows):
    """quantize_cols of x zero-padded to ``rows`` rows, data and scales transposed (the Fp8Cols layout)."""
    data, scale = fp8.quantize_cols(torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]))
    return data.t().contiguous(), scale.t().contiguous()


def test_fp8_weight_gradient_columns_reach_the_k_grouped_gemms(monkeypatch):
    """With fp8 weight gradients on a provider that takes Fp8Cols (plan.fp8_cols), the layer's backward
    asks the SwiGLU backward for dh's and act_w's transposed column quantization with the pool's rows
    rounded up to 16 (providers.base.fp8_cols_rows), hands dW2 act_w and dW1 dh as Fp8Cols and the L1 dgrad
    dh's rows as Fp8Rows; with fp8_cols off the same GEMMs get the bf16 dh and act_w. A provider that
    dequantizes what it gets (and quantizes bf16 operands itself) gives the same gradients both ways."""
    from deep_gemm_ext import layer, plan as plan_module
    from deep_gemm_ext.providers import Fp8Cols, GemmProvider
    from deep_gemm_ext.providers.base import fp8_cols_rows
    from deep_gemm_ext.routing import compute_routing_torch

    T, H, I, E, K = 70, 256, 384, 4, 2
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, seed=23)
    x, l1, l2 = x.bfloat16(), l1.bfloat16(), l2.bfloat16()
    meta = compute_routing_torch(idx, E, 128)
    P = meta.num_pool_rows
    gen = _gen(23)
    h = torch.randn(P, 2 * I, generator=gen).bfloat16()
    dy = torch.randn(T, H, generator=gen).bfloat16()
    da = torch.randn(P, I, generator=gen).bfloat16()
    calls = []

    def pool(operand, gather):
        if isinstance(operand, Fp8Cols):
            data, scale = operand
            return fp8.dequantize_cols(data.t(), scale.t())[:P]
        src = operand if gather is None else torch.cat([operand, operand.new_zeros(1, operand.shape[1])])[
            torch.where(gather.row_to_slot >= 0, gather.row_to_slot // gather.top_k, operand.shape[0]).long()]
        return fp8.dequantize_cols(*fp8.quantize_cols(src.float()))

    class Recording(GemmProvider):
        def m_grouped(self, a, w_, meta_, layout, *, recipe, gather=None, epilogue=None, zero_unowned=False):
            calls.append(("m_grouped", type(a).__name__, layout))
            return da if layout == "nn" and w_.shape[-1] == I else torch.zeros(P, H, dtype=torch.bfloat16)

        def k_grouped(self, a, b, meta_, *, recipe, gather_a=None, gather_b=None):
            calls.append(("k_grouped", type(a).__name__, type(b).__name__))
            if isinstance(a, Fp8Cols):
                assert a.data.shape[1] == fp8_cols_rows(P)
            if isinstance(b, Fp8Cols):
                assert b.data.shape[1] == fp8_cols_rows(P)
            pa, pb = pool(a, gather_a), pool(b, gather_b)
            return torch.stack([pa[s:e].t() @ pb[s:e] for s, e in zip(meta.starts.tolist(), meta.ends.tolist())])

    kernels = _WiringKernels()
    monkeypatch.setitem(plan_module.PROVIDERS, "sm90", Recording())
    monkeypatch.setattr(plan_module, "_jit_kernels_module", lambda: kernels)
    base = dict(provider="sm90", recipe="fp8", align=128, compute_dtype="bfloat16", jit_elementwise=True,
                gather_x="cp_async", gather_backward=True, fp8_wgrad="fp8", fp8_rows=True)
    saved = [x, w, l1, l2, h, *meta.tensors()]
    grads = {}
    for cols in (True, False):
        calls.clear()
        p = plan_module.Plan(**base, fp8_cols=cols)
        grads[cols] = layer.backward(p, dy, saved, None)
        k_calls = [c for c in calls if c[0] == "k_grouped"]
        if cols:
            rows = fp8_cols_rows(P)
            assert kernels.swiglu_rows == [rows] and rows % 16 == 0 and P <= rows < P + 16, (P, kernels.swiglu_rows)
            assert k_calls == [("k_grouped", "Tensor", "Fp8Cols"), ("k_grouped", "Fp8Cols", "Tensor")], calls
        else:
            assert k_calls == [("k_grouped", "Tensor", "Tensor"), ("k_grouped", "Tensor", "Tensor")], calls
        assert ("m_grouped", "Fp8Rows", "nn") in calls, calls
    for name, a, b in zip(("dx", "d topk_weights", "dl1", "dl2"), grads[True], grads[False]):
        assert torch.equal(a, b), f"{name}: the Fp8Cols operands differ from quantizing dh and act_w in the GEMM"
