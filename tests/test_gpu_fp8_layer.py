"""The layer under recipe="fp8" on our SM90 kernels (blockwise-fp8 GEMMs, quantization kernels,
act and dh quantized in the SwiGLU kernels, bf16 weight gradients by default, fp8 ones on the K-grouped
fp8 GEMM with DGE_FP8_WGRAD=fp8) against the fp64 reference: y and all four gradients within
1.02x (+1e-3) of the error of the fp32 emulation of the same quantization points
(recipes.fp8.fp8_reference_layer with the plan's weight-gradient mode), NaN-poisoned memory first,
on the headline layers' sizes (fewer tokens, both weight-gradient modes) and the routing edge
cases, under the documented variants (pool instead of the gathering quantizer, pool instead of the
combine epilogue, fp8 weight gradients with and without the backward's gathers). The fused dh
quantization (rows, and with fp8 weight gradients dh's and act_w's columns) against the separate
passes: every output bit for bit. The errors are printed
(pytest -s) for the notes.
"""
import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext import plan
from deep_gemm_ext.providers import Sm90Provider
from deep_gemm_ext.recipes import fp8
from deep_gemm_ext.testing import ROUTINGS, make_inputs, rel_err

from conftest import poison_cached_memory, requires_hopper
from gpu_utils import reference_grads, run_layer

pytestmark = requires_hopper

NAMES = ("y", "dx", "dtopk_w", "dl1", "dl2")
FACTOR, SLACK = 1.02, 1e-3

SHAPES = {  # real hidden / intermediate / experts, fewer tokens to keep the fp64 reference quick
    "qwen3-30b-a3b": (2048, 2048, 768, 128, 8),
    "qwen3-235b-a22b": (1024, 4096, 1536, 128, 8),
    "deepseek-v3-e32": (512, 7168, 2048, 32, 8),  # 32 of the 256 experts
}


def _fp8_layer(x, idx, w, l1, l2, clamp):
    return dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp, recipe="fp8")


def check_fp8_layer(T, H, I, E, K, routing, clamp, seed, label):
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, routing=routing, device="cuda", seed=seed)
    dy = torch.randn(T, H, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(torch.bfloat16)
    p = plan.resolve(x, l1, recipe="fp8")
    assert p.provider == "sm90", f"recipe='fp8' on an SM90 GPU should run our kernels, plan: {p.describe()}"
    y_ref, g_ref = reference_grads(x, idx, w, l1, l2, clamp, dy)
    emulated = fp8.fp8_reference_layer(x, idx, w, l1, l2, clamp, dy, wgrad=p.fp8_wgrad)
    poison_cached_memory()
    y, grads = run_layer(_fp8_layer, x, idx, w, l1, l2, clamp, dy)
    torch.cuda.synchronize()
    for name, out, emu, ref in zip(NAMES, (y, *grads), emulated, (y_ref, *g_ref)):
        assert out.shape == ref.shape, (name, tuple(out.shape), tuple(ref.shape))
        assert torch.isfinite(out).all(), f"{label} {name}: non-finite output (unwritten memory?) seed={seed}"
        if float(ref.norm()) == 0:
            assert float(out.abs().max()) == 0, f"{label} {name}: expected zeros"
            continue
        err, emu_err = rel_err(out, ref), rel_err(emu, ref)
        print(f"[fp8 {label} {routing} clamp={clamp} T={T}] {name}: ours {err:.3e}, emulation {emu_err:.3e}, "
              f"ratio {err / emu_err:.3f}")
        assert err <= FACTOR * emu_err + SLACK, (f"{label} {routing} {name}: {err:.3e} vs emulation {emu_err:.3e} "
                                                 f"(seed={seed})")


@pytest.mark.parametrize("wgrad", ["default", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_layer_headline_shapes(monkeypatch, one_large_test_at_a_time, shape, wgrad):
    if wgrad == "fp8":
        monkeypatch.setenv("DGE_FP8_WGRAD", "fp8")
    T, H, I, E, K = SHAPES[shape]
    check_fp8_layer(T, H, I, E, K, "uniform", None, seed=5, label=f"{shape} wgrad={wgrad}")


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("clamp", [None, 7.0])
def test_fp8_layer_routings(routing, clamp):
    check_fp8_layer(777, 1024, 384, 16, 4, routing, clamp, seed=11, label="small")


@pytest.mark.parametrize("env", [{"DGE_FUSED_GATHER": "0"}, {"DGE_FUSED_COMBINE": "0"}, {"DGE_FP8_WGRAD": "fp8"},
                                 {"DGE_FP8_WGRAD": "fp8", "DGE_FUSED_GATHER_BACKWARD": "1"},
                                 {"DGE_FP8_WGRAD": "fp8", "DGE_FUSED_GATHER": "0", "DGE_FUSED_COMBINE": "0"}])
def test_fp8_layer_variants(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    check_fp8_layer(600, 1024, 384, 16, 4, "zipf", 7.0, seed=13, label=",".join(f"{k}={v}" for k, v in env.items()))


@pytest.mark.parametrize("env", [{}, {"DGE_FP8_WGRAD": "fp8"}, {"DGE_FUSED_COMBINE": "0"}])
def test_fp8_act_and_dh_quantized_in_swiglu_kernels_are_bit_identical(monkeypatch, env):
    """The plan quantizes act in the SwiGLU forward and dh in the SwiGLU backward on our SM90
    provider; with that off (the provider taking no Fp8Rows) the L2 forward and the L1 dgrad quantize
    act and dh themselves: every output bit for bit the same (the fused quantizers are quantize_rows'
    twins), NaN-poisoned memory before each run."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _assert_fusion_bit_identical(monkeypatch, "empty_experts", 17, "takes_fp8_rows", "fp8_rows", f"{env}")


def _assert_fusion_bit_identical(monkeypatch, routing, seed, provider_attr, plan_field, label):
    """The layer's y and four gradients with the plan's ``plan_field`` on, then with the SM90 provider's
    ``provider_attr`` off (so the plan turns it off): bit for bit the same, NaN-poisoned memory before each run
    (600 tokens, H 1024, I 384, 16 experts, top-4, clamp 7)."""
    x, idx, w, l1, l2 = make_inputs(600, 1024, 384, 16, 4, routing=routing, device="cuda", seed=seed)
    dy = torch.randn(600, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(torch.bfloat16)
    p = plan.resolve(x, l1, recipe="fp8")
    assert getattr(p, plan_field), p.describe()
    poison_cached_memory()
    fused = run_layer(_fp8_layer, x, idx, w, l1, l2, 7.0, dy)
    monkeypatch.setattr(Sm90Provider, provider_attr, False)
    plan.clear_cache()  # the resolution reads the provider's attributes, which plans are not keyed by
    assert not getattr(plan.resolve(x, l1, recipe="fp8"), plan_field)
    poison_cached_memory()
    separate = run_layer(_fp8_layer, x, idx, w, l1, l2, 7.0, dy)
    torch.cuda.synchronize()
    for name, a, b in zip(NAMES, (fused[0], *fused[1]), (separate[0], *separate[1])):
        assert torch.isfinite(a).all(), f"{label} {name}: non-finite output"
        assert torch.equal(a, b), f"{label} {name}: {plan_field} differs from the separate passes (seed={seed})"


@pytest.mark.parametrize("env", [{}, {"DGE_FUSED_GATHER_BACKWARD": "0"}, {"DGE_FUSED_GATHER": "0"}])
@pytest.mark.parametrize("routing", ["zipf", "empty_experts"])
def test_fp8_weight_gradient_columns_from_swiglu_backward_are_bit_identical(monkeypatch, routing, env):
    """fp8 weight gradients: the SwiGLU backward writes dh's and act_w's transposed column quantization
    (plan.fp8_cols); with that off (the provider taking no Fp8Cols) the weight-gradient GEMMs quantize the
    bf16 dh and act_w themselves. Every output bit for bit the same, NaN-poisoned memory before each run;
    I = 384 (three 128-column chunks: dweight's sum across an odd count)."""
    monkeypatch.setenv("DGE_FP8_WGRAD", "fp8")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _assert_fusion_bit_identical(monkeypatch, routing, 19, "takes_fp8_cols", "fp8_cols", f"{routing} {env}")


@pytest.mark.parametrize("wgrad", ["default", "fp8"])
@pytest.mark.parametrize("num_tokens", [0, 1])
def test_fp8_layer_tiny_token_counts(monkeypatch, num_tokens, wgrad):
    if wgrad == "fp8":
        monkeypatch.setenv("DGE_FP8_WGRAD", "fp8")
    if num_tokens == 1:
        # One token: against the fp64 reference relative to the emulation's error, as every shape (a fixed
        # bound on a two-element d topk_weights would test the draw of dy, not the kernels).
        check_fp8_layer(1, 256, 128, 8, 2, "uniform", None, seed=3, label=f"one token wgrad={wgrad}")
        return
    x, idx, w, l1, l2 = make_inputs(num_tokens, 256, 128, 8, 2, device="cuda", seed=3)
    dy = torch.randn(num_tokens, 256, device="cuda").to(torch.bfloat16)
    y, grads = run_layer(_fp8_layer, x, idx, w, l1, l2, None, dy)
    assert y.shape == (num_tokens, 256)
    assert all(not g.any() for g in grads)


def test_fp8_layer_is_deterministic_and_compiles():
    x, idx, w, l1, l2 = make_inputs(500, 1024, 384, 16, 4, routing="zipf", device="cuda", seed=21)
    dy = torch.randn(500, 1024, device="cuda").to(torch.bfloat16)
    first = run_layer(_fp8_layer, x, idx, w, l1, l2, None, dy)
    second = run_layer(_fp8_layer, x, idx, w, l1, l2, None, dy)
    torch._dynamo.reset()
    compiled_fn = torch.compile(lambda *a: dge.mega_moe_train(*a, recipe="fp8"), fullgraph=True)
    compiled = run_layer(lambda x, idx, w, l1, l2, c: compiled_fn(x, idx, w, l1, l2), x, idx, w, l1, l2, None, dy)
    torch._dynamo.reset()
    for name, a, b, c in zip(NAMES, (first[0], *first[1]), (second[0], *second[1]), (compiled[0], *compiled[1])):
        assert torch.equal(a, b), f"{name}: two runs differ"
        assert torch.equal(a, c), f"{name}: torch.compile differs from eager"


def test_fp8_cuda_graph_replay_reads_updated_weights():
    """fwd + bwd under recipe="fp8" captured once, replayed after new x, routing, weights and dy are
    copied into the static inputs (the weights in place, as an optimizer step writes them): every
    replay bit-equal to an eager step on the new values (the weight quantization is in the graph)."""
    T, H, I, E, K = 512, 512, 256, 8, 4

    def leaves(*t):
        return [v.detach().clone().requires_grad_(v.is_floating_point()) for v in t]

    static = leaves(*make_inputs(T, H, I, E, K, routing="zipf", device="cuda", seed=0))
    sx, sidx, sw, sl1, sl2 = static
    sdy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step(x, idx, w, l1, l2, dy):
        y = dge.mega_moe_train(x, idx, w, l1, l2, recipe="fp8")
        return (y, *torch.autograd.grad(y, (x, w, l1, l2), dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(sx, sidx, sw, sl1, sl2, sdy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(sx, sidx, sw, sl1, sl2, sdy)
    for seed, routing in ((1, "zipf"), (2, "uniform"), (3, "unused_slots")):
        new = make_inputs(T, H, I, E, K, routing=routing, device="cuda", seed=seed, requires_grad=False)
        dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for dst, src in zip((*static, sdy), (*new, dy)):
                dst.copy_(src)
        graph.replay()
        want = step(*leaves(*new), dy)
        torch.cuda.synchronize()
        for name, got, ref in zip(NAMES, outs, want):
            assert torch.equal(got, ref), f"{routing}: replayed {name} differs from eager (seed={seed})"
