"""The optional DeepGEMM provider: clear errors without it, layouts on CPU, kernels against torch on GPU."""
import sys

import pytest
import torch

from deep_gemm_ext import elementwise, layer
from deep_gemm_ext.plan import Plan
from deep_gemm_ext.providers import deepgemm
from deep_gemm_ext.recipes import RECIPES
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_inputs, make_routing, rel_err

from conftest import IS_HOPPER, poison_cached_memory
from gpu_utils import reference_grads

# One pool shape for every GPU test, so each DeepGEMM kernel is compiled once (T not a multiple of 128).
T, H, I, E, K = 300, 256, 128, 4, 2
ALIGN = 128
PROVIDER = deepgemm.DeepGemmProvider()


@pytest.fixture
def no_deep_gemm(monkeypatch):
    deepgemm._load.cache_clear()
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # `import deep_gemm` now raises ImportError
    yield
    deepgemm._load.cache_clear()


def test_every_entry_point_says_how_to_install(no_deep_gemm):
    assert not deepgemm.is_available()
    meta = compute_routing_torch(make_routing(4, E, K), E, ALIGN)
    calls = {
        "token_group_alignment": lambda: deepgemm.token_group_alignment(),
        "m_grouped": lambda: PROVIDER.m_grouped(None, None, meta, "nt", recipe=RECIPES["bf16"]),
        "k_grouped": lambda: PROVIDER.k_grouped(None, None, meta, recipe=RECIPES["fp8"]),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as info:
            call()
        message = str(info.value)
        for needle in ("DeepGEMM is not importable", "deep_gemm", "patches", "scripts/check_patches.py",
                       "install.sh"):
            assert needle in message, f"{name}: {needle!r} missing from {message!r}"


@pytest.mark.parametrize("kind", ["uniform", "unused_slots", "empty_experts", "one_expert"])
@pytest.mark.parametrize("num_tokens", [0, 1, 300])
def test_m_indices_follow_the_pool(kind, num_tokens):
    idx = make_routing(num_tokens, E, K, kind, generator=torch.Generator().manual_seed(num_tokens))
    meta = compute_routing_torch(idx, E, ALIGN)
    layout = deepgemm.m_indices(meta)
    assert layout.dtype == torch.int32 and layout.shape == (meta.num_pool_rows,)
    real = meta.row_to_slot >= 0
    expected = idx.reshape(-1)[meta.row_to_slot[real].long()]
    assert torch.equal(layout[real].long(), expected)
    assert (layout[~real] == -1).all()
    # Each block of 128 rows holds one expert (or padding only), as the contiguous layout needs.
    blocks = torch.nn.functional.pad(layout, (0, -layout.numel() % ALIGN), value=-1).view(-1, ALIGN)
    first = blocks[:, :1]
    assert ((blocks == first) | (blocks == -1)).all()


def test_group_transpose_stores_each_group_k_major():
    ks = [256, 0, 128, 384]
    x = torch.randn(sum(ks) + 128, 5)  # trailing rows belong to no group
    flat = deepgemm.group_transpose(x, ks)
    expected, start = [], 0
    for k in ks:
        expected.append(x[start:start + k].t().contiguous().flatten())
        start += k
    assert torch.equal(flat, torch.cat(expected))
    assert deepgemm.group_transpose(x, [0, 0]).numel() == 0


def _dequant_rows(q, scale):
    m, k = q.shape
    return (q.float().view(m, k // 128, 128) * scale[:, :, None]).view(m, k)


def test_fp8_quantizers_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 384, generator=g) * 3
    q, scale = deepgemm.quantize_rows_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (256, 3)
    assert rel_err(_dequant_rows(q, scale), x) < 0.05
    qc, col_scale = deepgemm.quantize_cols_fp8(x)
    assert col_scale.shape == (2, 384)
    assert rel_err(_dequant_rows(qc.t().contiguous(), col_scale.t()), x.t()) < 0.05

    w = torch.randn(2, 256, 384, generator=g)
    fp8 = deepgemm.Fp8ExpertWeights.from_bf16(w)
    assert fp8.shape == (2, 256, 384) and fp8.nk[1].shape == (2, 2, 3) and fp8.kn[1].shape == (2, 3, 2)
    full_nk = fp8.nk[0].float() * fp8.nk[1].repeat_interleave(128, 1).repeat_interleave(128, 2)
    full_kn = fp8.kn[0].float() * fp8.kn[1].repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert torch.equal(full_kn, full_nk.transpose(1, 2))  # the transposed copy adds no error
    assert rel_err(full_nk, w) < 0.05
    with pytest.raises(ValueError, match="multiples of 128"):
        deepgemm.Fp8ExpertWeights.from_bf16(torch.randn(2, 200, 384))


def test_unsupported_shape_reason():
    assert deepgemm.unsupported_shape_reason(2048, 768, RECIPES["bf16"]) is None
    assert deepgemm.unsupported_shape_reason(2048, 768, RECIPES["fp8"]) is None
    assert "intermediate=96" in deepgemm.unsupported_shape_reason(2048, 96, RECIPES["fp8"])
    assert "hidden=20" in deepgemm.unsupported_shape_reason(20, 768, RECIPES["bf16"])
    # 16-byte rows are not enough: upstream's bf16 GEMMs take K in multiples of 64.
    assert "hidden=1032 must be a positive multiple of 64" in deepgemm.unsupported_shape_reason(
        1032, 768, RECIPES["bf16"])
    assert "intermediate=776" in deepgemm.unsupported_shape_reason(2048, 776, RECIPES["bf16"])


@pytest.mark.parametrize("call", ["m_grouped", "k_grouped"])
def test_both_gemms_check_the_pool_alignment(call, torch_deep_gemm):
    # A pool routed with align 64: its expert blocks are not upstream's 128-row K (k_grouped) or M
    # blocks (m_grouped); both say so before calling upstream.
    meta = compute_routing_torch(make_routing(40, E, K), E, 64)
    a = torch.zeros(meta.num_pool_rows, H, dtype=torch.bfloat16)
    run = {"m_grouped": lambda: PROVIDER.m_grouped(a, torch.zeros(E, I, H, dtype=torch.bfloat16), meta, "nt",
                                                   recipe=RECIPES["bf16"]),
           "k_grouped": lambda: PROVIDER.k_grouped(a, a, meta, recipe=RECIPES["bf16"])}[call]
    with pytest.raises(ValueError, match="meta.align=64 is not a multiple of DeepGEMM's contiguous-layout alignment 128"):
        run()


def _dequant_blocks(q, scale):
    return q.float() * scale.repeat_interleave(128, -2).repeat_interleave(128, -1)


class TorchDeepGemm:
    """DeepGEMM's grouped-GEMM calls as the backend makes them, in torch (fp8 operands dequantized).

    Runs the backend's whole pipeline on CPU, and is the fp8 emulation the GPU results are held to.
    Like DeepGEMM, a block of 128 rows takes the expert of its first row, and a block whose first
    row is -1 is skipped (its output rows stay unwritten).
    """

    @staticmethod
    def get_mk_alignment_for_contiguous_layout():
        return ALIGN

    @staticmethod
    def _m(a, w, d, layout):
        for start in range(0, layout.numel(), ALIGN):
            expert = int(layout[start])
            if expert >= 0:
                d[start:start + ALIGN] = (a[start:start + ALIGN] @ w[expert].t()).to(d.dtype)

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, layout):
        self._m(a.float(), b.float(), d, layout)

    def m_grouped_bf16_gemm_nn_contiguous(self, a, b, d, layout):
        self._m(a.float(), b.float().transpose(1, 2), d, layout)

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, layout):
        self._m(_dequant_rows(*a), _dequant_blocks(*b), d, layout)

    @staticmethod
    def k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, layout, c):
        start = 0
        for g, k in enumerate(ks):
            d[g] += a[start:start + k].float().t() @ b[start:start + k].float()
            start += k

    @staticmethod
    def k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks, layout, c, recipe):
        (a_flat, a_scale), (b_flat, b_scale) = a, b
        m, n, start = d.shape[1], d.shape[2], 0
        for g, k in enumerate(ks):
            if k:
                blocks = slice(start // 128, (start + k) // 128)
                a_g = _dequant_rows(a_flat[m * start:m * (start + k)].view(m, k), a_scale[:, blocks])
                b_g = _dequant_rows(b_flat[n * start:n * (start + k)].view(n, k), b_scale[:, blocks])
                d[g] += a_g @ b_g.t()
            start += k


def _run_backend(recipe, routing, clamp, device, seed=2):
    """The layer (deep_gemm_ext.layer) on the DeepGEMM provider, elementwise steps in torch; returns
    the relative errors of y and the four gradients against the fp64 reference."""
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing=routing, device=device, seed=seed, requires_grad=False)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)
    plan = Plan(provider="deep_gemm", recipe=recipe, align=deepgemm.token_group_alignment(), compute_dtype="bfloat16")
    y, saved = layer.forward(plan, x, idx, w, l1, l2, clamp)
    dx, d_topk, d_l1, d_l2 = layer.backward(plan, dy, saved, clamp)
    assert not d_topk[idx < 0].any()
    y_ref, grads_ref = reference_grads(x, idx, w, l1, l2, clamp, dy)
    ours = {"y": y, "dx": dx, "d_topk": d_topk, "d_l1": d_l1, "d_l2": d_l2}
    return {name: rel_err(ours[name], ref) for name, ref in zip(ours, (y_ref, *grads_ref))}


@pytest.fixture
def torch_deep_gemm(monkeypatch):
    """The backend on CPU: DeepGEMM replaced by its torch emulation, any device accepted as SM90."""
    monkeypatch.setattr(deepgemm, "_deep_gemm", TorchDeepGemm)
    monkeypatch.setattr(deepgemm, "_arch_major", lambda name, t: 9)


# bf16 h rounds some SwiGLU inputs across the clamp, so with a clamp the gradients through dh (dx,
# d_l1) move by a few percent against the fp64 reference; the torch path saving bf16 h does the same.
CPU_TOLERANCE = {("bf16", False): 1e-2, ("bf16", True): 1.5e-1, ("fp8", False): 1e-1, ("fp8", True): 2.5e-1}


@pytest.mark.parametrize("recipe, routing, clamp", [
    ("bf16", "uniform", None), ("bf16", "unused_slots", 1.0), ("bf16", "empty_experts", None),
    ("bf16", "one_expert", None), ("fp8", "uniform", None), ("fp8", "unused_slots", 1.0)])
def test_backend_pipeline_on_torch_emulation(recipe, routing, clamp, torch_deep_gemm):
    errors = _run_backend(recipe, routing, clamp, "cpu")
    for name, err in errors.items():
        through_dh = clamp is not None and name in ("dx", "d_l1")
        bound = CPU_TOLERANCE[(recipe, through_dh)]
        assert err < bound, f"{name}: rel err {err:.3g} >= {bound} ({recipe}, {routing}, clamp={clamp})"


# ---------------------------------------------------------------------------------------------
# GPU: the kernels against torch. `gemm` tests first compile every kernel in parallel (pytest -n);
# `layer` tests then run the whole forward / backward against the fp64 reference.


def _sm90_with_deep_gemm() -> bool:
    return IS_HOPPER and deepgemm.is_available()


gpu = pytest.mark.skipif(not _sm90_with_deep_gemm(), reason="needs an SM90 GPU and an importable deep_gemm")


def _pool_meta(routing="uniform", seed=0):
    idx = make_routing(T, E, K, routing, device="cuda", generator=torch.Generator().manual_seed(seed))
    return idx, compute_routing_torch(idx, E, deepgemm.token_group_alignment())


def _expert_loop(a, meta, fn):
    """Per-expert reference over the pool's real rows (padding and tail rows excluded)."""
    out = {}
    counts, starts = meta.counts.tolist(), meta.starts.tolist()
    for e in range(E):
        if counts[e]:
            out[e] = fn(e, a[starts[e]:starts[e] + counts[e]].float())
    return out


# The layer's four pool GEMMs: L1 and L2 forward (a @ W^T), L2 and L1 data gradients (a @ W).
LAYER_GEMMS = [(False, 2 * I, H), (False, H, I), (True, I, H), (True, H, 2 * I)]


@gpu
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize("transposed, n, k", LAYER_GEMMS, ids=["l1", "l2", "l2_dgrad", "l1_dgrad"])
def test_gemm_m_grouped_matches_torch(recipe, transposed, n, k):
    _, meta = _pool_meta()
    # Pool row r holds source row row_to_slot[r]; padding rows are zero, as gather leaves them.
    a = elementwise.gather_rows(torch.randn(T * K, k, device="cuda", dtype=torch.bfloat16), meta.row_to_slot, 1)
    w = (torch.randn(E, k, n, device="cuda") if transposed else torch.randn(E, n, k, device="cuda")) / k ** 0.5
    w = w.to(torch.bfloat16)
    if recipe == "fp8":
        prepared = deepgemm.Fp8ExpertWeights.from_bf16(w)
        b, b_scale = prepared.kn if transposed else prepared.nk
        w_eff = b.float() * b_scale.repeat_interleave(128, 1).repeat_interleave(128, 2)  # [E, N, K]
        q, s = deepgemm.quantize_rows_fp8(a)
        a_eff = _dequant_rows(q, s)
    else:
        prepared = w
        w_eff = (w.transpose(1, 2) if transposed else w).float()
        a_eff = a.float()
    out = PROVIDER.m_grouped(a, prepared, meta, "nn" if transposed else "nt", recipe=RECIPES[recipe])
    ref = _expert_loop(a_eff, meta, lambda e, rows: rows @ w_eff[e].t())
    starts, counts = meta.starts.tolist(), meta.counts.tolist()
    for e, r in ref.items():
        err = rel_err(out[starts[e]:starts[e] + counts[e]], r)
        assert err < 1e-2, f"expert {e}: rel err {err:.3g} ({recipe}, {'nn' if transposed else 'nt'}, n={n}, k={k})"


@gpu
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize("m, n", [(H, I), (2 * I, H)])
def test_gemm_k_grouped_matches_torch(recipe, m, n):
    _, meta = _pool_meta()
    real = (meta.row_to_slot >= 0)[:, None]
    a = torch.where(real, torch.randn(meta.num_pool_rows, m, device="cuda"), 0).to(torch.bfloat16)
    b = torch.where(real, torch.randn(meta.num_pool_rows, n, device="cuda"), 0).to(torch.bfloat16)
    ks = (meta.ends - meta.starts).tolist()
    d = PROVIDER.k_grouped(a, b, meta, recipe=RECIPES[recipe])
    assert d.shape == (E, m, n) and d.dtype == torch.float32
    if recipe == "fp8":
        rows = sum(ks)
        (qa, sa), (qb, sb) = deepgemm.quantize_cols_fp8(a[:rows]), deepgemm.quantize_cols_fp8(b[:rows])
        a = torch.cat([qa.float() * sa.repeat_interleave(128, 0), a[rows:].float()])
        b = torch.cat([qb.float() * sb.repeat_interleave(128, 0), b[rows:].float()])
    starts, ends = meta.starts.tolist(), meta.ends.tolist()
    for e in range(E):
        ref = a[starts[e]:ends[e]].float().t() @ b[starts[e]:ends[e]].float()
        assert rel_err(d[e], ref) < 1e-2 if ends[e] > starts[e] else not d[e].any()


CASES = [("bf16", "uniform", None), ("bf16", "unused_slots", 1.0), ("bf16", "empty_experts", None),
         ("bf16", "one_expert", None), ("fp8", "uniform", None), ("fp8", "unused_slots", 1.0)]


@gpu
@pytest.mark.parametrize("recipe, routing, clamp", CASES)
def test_layer_forward_and_backward_match_emulation(recipe, routing, clamp, monkeypatch):
    """DeepGEMM's errors against the fp64 reference are those of its torch emulation (docs/architecture.md,
    protocol)."""
    poison_cached_memory()
    errors = _run_backend(recipe, routing, clamp, "cuda")
    monkeypatch.setattr(deepgemm, "_deep_gemm", TorchDeepGemm)
    emulated = _run_backend(recipe, routing, clamp, "cuda")
    print(f"[{recipe} {routing} clamp={clamp}] " + " ".join(
        f"{k}={v:.2e}/{emulated[k]:.2e}" for k, v in errors.items()) + " (deep_gemm/emulation)")
    for name, err in errors.items():
        assert err <= 1.1 * emulated[name] + 2e-3, \
            f"{name}: rel err {err:.3g} vs emulation {emulated[name]:.3g} ({recipe}, {routing}, clamp={clamp})"


@gpu
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize("clamp", [None, 4.0])
def test_mega_moe_train_with_deep_gemm_backend(recipe, clamp):
    """The public call with backend="deep_gemm": y and all four gradients against the fp64
    reference; bf16 no worse than 1.05x our default path, fp8 within the fp8 tolerance."""
    import deep_gemm_ext as dge
    from gpu_utils import run_layer

    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing="zipf", device="cuda", seed=21)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    y_ref, g_ref = reference_grads(x, idx, w, l1, l2, clamp, dy)

    def layer(backend, recipe):
        return lambda x, idx, w, l1, l2, c: dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=c,
                                                                backend=backend, recipe=recipe)

    poison_cached_memory()
    y, g = run_layer(layer("deep_gemm", recipe), x, idx, w, l1, l2, clamp, dy)
    y_auto, g_auto = run_layer(layer("auto", "bf16"), x, idx, w, l1, l2, clamp, dy)
    for name, out, base, ref in zip(("y", "dx", "d_topk", "d_l1", "d_l2"), (y, *g), (y_auto, *g_auto),
                                    (y_ref, *g_ref)):
        assert not out.isnan().any(), name
        err, err_auto = rel_err(out, ref), rel_err(base, ref)
        print(f"[{recipe} clamp={clamp}] {name}: deep_gemm {err:.2e}  auto {err_auto:.2e}")
        if recipe == "bf16":
            assert err <= 1.05 * err_auto + 1e-4, f"{name}: {err:.3e} vs auto {err_auto:.3e}"
        else:
            assert err < CPU_TOLERANCE[("fp8", False)], f"{name}: fp8 rel err {err:.3e}"
