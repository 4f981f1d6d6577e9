"""experts_implementation="deep_gemm_ext" on the GPU in bf16: tiny Qwen3-MoE and DeepSeek-V3 models
whose experts take our SM90 path (hidden and 2 * intermediate multiples of 128), loss and every
parameter's gradient against an fp64 copy of the model with transformers' eager experts, no worse
than transformers' own grouped_mm experts in bf16 on the same weights (with a little slack: the two
round differently). The CPU version is tests/test_transformers.py."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import requires_cuda

transformers = pytest.importorskip("transformers")

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.testing import rel_err  # noqa: E402
from hf_utils import experts_modules, layer_calls, loss_and_grads, tiny_model  # noqa: E402,F401

pytestmark = requires_cuda
NAME = dge.register_transformers()
SIZES = dict(hidden=256, inter=128, experts=16, top_k=4)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_bf16_model_loss_and_grads_against_fp64_eager(family, layer_calls):
    model = tiny_model(family, torch.bfloat16, device="cuda", expert_std=0.1, sizes=SIZES,
                       experts_implementation="grouped_mm")
    reference = copy.deepcopy(model).double()
    reference.set_experts_implementation("eager")
    ids = torch.randint(3, 64, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loss_ref, grads_ref = loss_and_grads(reference, ids)
    loss_base, grads_base = loss_and_grads(model, ids)
    model.set_experts_implementation(NAME)
    loss, grads = loss_and_grads(model, ids)
    assert layer_calls[0] == len(experts_modules(model)) > 0
    assert grads.keys() == grads_ref.keys() == grads_base.keys()
    lines = []
    for name in ("loss", *grads):
        got, base, ref = ((loss, loss_base, loss_ref) if name == "loss"
                          else (grads[name], grads_base[name], grads_ref[name]))
        assert torch.isfinite(got).all(), name
        err, err_base = rel_err(got, ref), rel_err(base, ref)
        lines.append(f"{name:<60} ours {err:.2e}  grouped_mm {err_base:.2e}")
        assert err <= 1.25 * err_base + 2e-3, (name, err, err_base)
    print("\n" + "\n".join(lines))


def test_bf16_experts_module_against_fp64_eager():
    """One experts module called directly (bf16, routing weights in bf16 as routers give them):
    output and the gradients of the hidden states, the routing weights and both parameters."""
    from transformers.integrations import moe

    from deep_gemm_ext.integrations.transformers import transformers_experts_forward
    from deep_gemm_ext.testing import make_routing

    model = tiny_model("qwen3_moe", torch.bfloat16, device="cuda", expert_std=0.1, sizes=SIZES)
    experts = experts_modules(model)[0]
    reference = copy.deepcopy(experts).double()
    gen = torch.Generator().manual_seed(1)
    idx = make_routing(300, SIZES["experts"], SIZES["top_k"], "zipf", generator=gen).cuda()
    x = torch.randn(300, SIZES["hidden"], generator=gen).cuda().bfloat16()
    weights = torch.rand(300, SIZES["top_k"], generator=gen).cuda().bfloat16()
    dy = torch.randn(300, SIZES["hidden"], generator=gen).cuda().bfloat16()

    def run(module, fn, dtype):
        xs, ws = (t.detach().to(dtype).requires_grad_() for t in (x, weights))
        y = fn(module, xs, idx, ws)
        grads = torch.autograd.grad(y, (xs, ws, module.gate_up_proj, module.down_proj), dy.to(dtype))
        return (y.detach(), *grads)

    eager = type(experts).forward.__wrapped__
    want = run(reference, eager, torch.float64)
    got = run(experts, transformers_experts_forward, torch.bfloat16)
    base = run(experts, moe.grouped_mm_experts_forward, torch.bfloat16)
    for name, g, b, w in zip(("y", "dx", "d weights", "d gate_up_proj", "d down_proj"), got, base, want):
        err, err_base = rel_err(g, w), rel_err(b, w)
        print(f"  {name:<16} ours {err:.2e}  grouped_mm {err_base:.2e}")
        assert err < 2e-2 and err <= 1.05 * err_base + 1e-3, (name, err, err_base)
