"""experts_implementation="deep_gemm_ext" in transformers 5.x (deep_gemm_ext.register_transformers):
tiny random Qwen3-MoE, Mixtral, DeepSeek-V3 and OLMoE models, loss and every parameter's gradient
against transformers' eager experts on the same weights (fp64 and fp32 on CPU); from_pretrained,
from_config and set_experts_implementation; the experts module called directly over routing edge
cases; transposed layouts; the clear errors for what the layer cannot compute. The bf16 GPU
version is tests/test_gpu_transformers.py."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.integrations import transformers as dge_tf  # noqa: E402
from deep_gemm_ext.testing import make_routing, rel_err  # noqa: E402
from hf_utils import FAMILIES, experts_modules, layer_calls, loss_and_grads, tiny_config, tiny_model  # noqa: E402,F401

NAME = dge.register_transformers()


def test_register_is_idempotent_and_returns_the_name():
    assert NAME == "deep_gemm_ext" and dge.register_transformers() == NAME
    assert moe.ALL_EXPERTS_FUNCTIONS[NAME] is dge_tf.transformers_experts_forward


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_every_gradient_match_eager(family, dtype, tol, layer_calls):
    model = tiny_model(family, dtype, experts_implementation="eager")
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref = loss_and_grads(model, ids)
    model.set_experts_implementation(NAME)
    assert model.config._experts_implementation == NAME
    loss, grads = loss_and_grads(model, ids)
    assert layer_calls[0] == len(experts_modules(model)) > 0
    assert abs(loss.item() - loss_ref.item()) <= tol * abs(loss_ref.item())
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert grad.abs().max() > 0 or grads_ref[name].abs().max() == 0, name
        assert rel_err(grad, grads_ref[name]) < tol, (name, rel_err(grad, grads_ref[name]))
    for experts in experts_modules(model):
        assert experts.gate_up_proj.grad.abs().max() > 0 and experts.down_proj.grad.abs().max() > 0


def test_computes_on_the_module_parameters_without_a_copy():
    """Qwen3-MoE's gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I] are the
    layer's l1_weights and l2_weights as they are."""
    experts = experts_modules(tiny_model("qwen3_moe"))[0]
    l1, l2 = dge_tf._layer_weights(experts)
    assert l1 is experts.gate_up_proj and l2 is experts.down_proj


def test_from_config_and_from_pretrained(tmp_path, layer_calls):
    ids = torch.randint(3, 64, (1, 16), generator=torch.Generator().manual_seed(2))
    saved = tiny_model("qwen3_moe", torch.float32)
    saved.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=NAME,
                                                               dtype=torch.float64)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager",
                                                              dtype=torch.float64)
    assert loaded.config._experts_implementation == NAME
    loss, loss_ref = (m(input_ids=ids, labels=ids).loss.item() for m in (loaded, eager))
    assert layer_calls[0] == 2 and abs(loss - loss_ref) < 1e-10 * loss_ref
    fresh = transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral"), experts_implementation=NAME)
    assert fresh.config._experts_implementation == NAME


def test_compiles_fullgraph_like_eager():
    model = tiny_model("qwen3_moe", torch.float32, experts_implementation=NAME)
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    want = model(input_ids=ids).logits
    got = compiled(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


# -- the experts module called directly -------------------------------------------------------------------


def eager_experts(experts, *args):
    return type(experts).forward.__wrapped__(experts, *args)


def routing_case(case: str, num_tokens: int, gen):
    """[T, 2] ids over 8 experts without -1 slots (transformers' routers never emit them)."""
    if case == "one_expert":  # every token on the same two experts
        return torch.tensor([[3, 5]]).expand(num_tokens, 2).contiguous()
    return make_routing(num_tokens, 8, 2, case, generator=gen)


@pytest.mark.parametrize("num_tokens", [0, 1, 37])
@pytest.mark.parametrize("case", ["uniform", "zipf", "one_expert", "empty_experts"])
def test_experts_module_routing_edge_cases(case, num_tokens):
    experts = experts_modules(tiny_model("qwen3_moe"))[0]
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, 32, dtype=torch.float64, generator=gen)
    idx = routing_case(case, num_tokens, gen)
    # Routing weights arrive in the model's dtype; here bf16-valued to pin the fp32/fp64 computation.
    weights = torch.rand(num_tokens, 2, generator=gen, dtype=torch.float64).bfloat16().double()
    results = []
    for fn in (eager_experts, dge_tf.transformers_experts_forward):
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        y = fn(experts, x, idx, w)
        y.square().sum().backward() if num_tokens else None
        results.append((y.detach(), x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for name, got, want in zip(("y", "dx", "dw", "d gate_up", "d down"), results[1], results[0]):
        if want is None:  # no tokens: no gradient anywhere
            assert got is None or not got.any(), name
            continue
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (name, rel_err(got, want))


def test_expert_parallel_sentinels_are_unused_slots():
    """Under transformers' expert parallelism ids of other ranks' experts arrive as >= num_experts."""
    experts = experts_modules(tiny_model("qwen3_moe"))[0]
    if not hasattr(experts, "_is_expert_parallel"):
        pytest.skip(f"transformers {transformers.__version__} has no expert-parallel sentinel ids")
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(20, 32, dtype=torch.float64, generator=gen)
    idx = routing_case("uniform", 20, gen)
    idx[::3, 1] = 8  # the sentinel transformers uses, which its eager loop skips
    weights = torch.rand(20, 2, dtype=torch.float64, generator=gen)
    want = eager_experts(experts, hidden, idx, weights)
    experts._is_expert_parallel = True
    got = dge_tf.transformers_experts_forward(experts, hidden, idx, weights)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def make_experts_class(hidden_act: str = "silu", transposed: bool = False, gate=None, **flags):
    """A transformers-style experts class (3-D parameters) decorated with the given layout flags."""

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts, hidden, inter = 4, 16, 8
            gate_up, down = (4, 2 * inter, hidden), (4, hidden, inter)
            if transposed:
                gate_up, down = (4, hidden, 2 * inter), (4, inter, hidden)
            self.gate_up_proj = nn.Parameter(torch.randn(gate_up, dtype=torch.float64))
            self.down_proj = nn.Parameter(torch.randn(down, dtype=torch.float64))
            self.act_fn = transformers.activations.ACT2FN[config.hidden_act]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("the eager forward is not under test")

    if gate is not None:
        Experts._apply_gate = gate
    return moe.use_experts_implementation(Experts, is_transposed=transposed, **flags), \
        transformers.PretrainedConfig(hidden_act=hidden_act)


def test_transposed_layout_matches_transformers_batched_mm():
    cls, config = make_experts_class(transposed=True)
    torch.manual_seed(6)
    experts = cls(config)
    hidden = torch.randn(9, 16, dtype=torch.float64)
    idx = torch.randint(0, 4, (9, 2))
    weights = torch.rand(9, 2, dtype=torch.float64)
    grads = []
    for fn in (moe.batched_mm_experts_forward, dge_tf.transformers_experts_forward):
        experts.zero_grad(set_to_none=True)
        y = fn(experts, hidden, idx, weights)
        y.square().sum().backward()
        grads.append((y.detach(), experts.gate_up_proj.grad, experts.down_proj.grad))
    for name, got, want in zip(("y", "d gate_up", "d down"), grads[1], grads[0]):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (name, rel_err(got, want))


def _clamped_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)


UNSUPPORTED = [
    (dict(has_bias=True), "silu", None, r"expert biases \(has_bias=True\)"),
    (dict(has_gate=False), "silu", None, r"no gate projection \(has_gate=False\)"),
    (dict(), "gelu", None, "the activation GELUActivation"),
    (dict(), "silu", _clamped_gate, r"its own gating function Experts._apply_gate"),
    (dict(is_concatenated=False), "silu", None, r"interleaved \(is_concatenated=False\)"),
]
if "has_post_expert_norm" in inspect.signature(moe.use_experts_implementation).parameters:
    UNSUPPORTED.append((dict(has_post_expert_norm=True), "silu", None, r"has_post_expert_norm=True"))


@pytest.mark.parametrize("flags,act,gate,message", UNSUPPORTED)
def test_unsupported_features_raise_naming_module_and_feature(flags, act, gate, message):
    cls, config = make_experts_class(act, gate=gate, **flags)
    experts = cls(config)
    with pytest.raises(NotImplementedError, match=r"experts_implementation='deep_gemm_ext' cannot run Experts .*"
                                                  + message):
        dge_tf.transformers_experts_forward(experts, torch.randn(3, 16, dtype=torch.float64),
                                            torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def test_gpt_oss_raises_at_the_first_call():
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       num_local_experts=4, num_experts_per_tok=2, bos_token_id=1,
                                       eos_token_id=2, pad_token_id=0, layer_types=["full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=NAME)
    with pytest.raises(NotImplementedError, match=r"cannot run GptOssExperts \(model_type 'gpt_oss'\): it has "
                                                  r"expert biases"):
        model(input_ids=torch.tensor([[3, 4, 5]]))
