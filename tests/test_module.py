"""MegaMoE: parameters, initialisation, forward equal to mega_moe_train, argument checks, autocast,
meta-device construction; and a smoke run of examples/train_tiny_moe.py."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext.testing import make_inputs

ROOT = Path(__file__).resolve().parents[1]


class FakeGroup:
    """Stands in for a ProcessGroup: MegaMoE only asks a group for its size and this rank."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_parameters_and_repr():
    m = dge.MegaMoE(8, 32, 16, 2, activation_clamp=7, dtype=torch.float32)
    assert m.l1_weights.shape == (8, 32, 32) and m.l2_weights.shape == (8, 32, 16)
    assert m.l1_weights.dtype == torch.float32
    assert [n for n, _ in m.named_parameters()] == ["l1_weights", "l2_weights"]
    assert repr(m) == ("MegaMoE(num_experts=8, hidden=32, intermediate=16, top_k=2, recipe='bf16', "
                       "activation_clamp=7.0)")
    assert dge.MegaMoE(8, 32, 16, 2).l1_weights.dtype == torch.bfloat16  # the default


def test_init_follows_torchtitan():
    torch.manual_seed(0)
    m = dge.MegaMoE(64, 256, 128, 4, dtype=torch.float32)
    m.reset_parameters(init_std=0.005)
    gate, up = m.l1_weights[:, :128], m.l1_weights[:, 128:]
    for t, std in ((gate, 0.02), (up, 0.005), (m.l2_weights, 0.005)):
        assert abs(t.std().item() - std) < 0.02 * std
        assert abs(t.mean().item()) < 0.02 * std
    torch.manual_seed(0)
    again = dge.MegaMoE(64, 256, 128, 4, dtype=torch.float32)
    torch.manual_seed(0)
    first = dge.MegaMoE(64, 256, 128, 4, dtype=torch.float32)
    assert torch.equal(first.l1_weights, again.l1_weights)


def test_init_truncates():
    m = dge.MegaMoE(4, 16, 8, 2, dtype=torch.float32)
    m.reset_parameters(init_std=5.0)  # wide enough for the +-2 bounds to bite
    assert m.l2_weights.abs().max() <= 2.0 and m.l1_weights.abs().max() <= 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_forward_equals_functional(dtype, clamp):
    T, H, I, E, K = 29, 16, 8, 6, 3
    x, idx, w, _, _ = make_inputs(T, H, I, E, K, routing="unused_slots", dtype=dtype, seed=1)
    m = dge.MegaMoE(E, H, I, K, activation_clamp=clamp, dtype=dtype)
    dy = torch.randn(T, H, dtype=dtype)
    y = m(x, idx, w)
    got = torch.autograd.grad(y, (x, w, m.l1_weights, m.l2_weights), dy)
    l1 = m.l1_weights.detach().requires_grad_()
    l2 = m.l2_weights.detach().requires_grad_()
    y_ref = dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp)
    want = torch.autograd.grad(y_ref, (x, w, l1, l2), dy)
    assert torch.equal(y, y_ref)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_leading_dims_and_weight_dtypes():
    """[B, S, H] inputs come back [B, S, H]; bf16 / fp64 routing weights are taken as fp32."""
    B, S, H, I, E, K = 2, 5, 16, 8, 4, 2
    m = dge.MegaMoE(E, H, I, K, dtype=torch.float32)
    x, idx, w, _, _ = make_inputs(B * S, H, I, E, K, dtype=torch.float32, seed=2, requires_grad=False)
    flat = m(x, idx, w)
    for weights in (w, w.bfloat16().float(), w.double()):
        y = m(x.view(B, S, H), idx.view(B, S, K), weights.view(B, S, K))
        assert y.shape == (B, S, H)
    assert torch.equal(m(x.view(B, S, H), idx.view(B, S, K), w.view(B, S, K)).view(B * S, H), flat)


@pytest.mark.parametrize("shape", [(16, 3), (5, 3), (2, 8, 2), (16,), (16, 1)])
def test_topk_weights_shape_must_equal_topk_idx_shape(shape):
    """Checked before any reshape: a (16, 3) input used to be reported as (24, 2), a (5, 3) one as a
    raw reshape error, and (2, 8, 2) against a (16, 2) topk_idx was silently accepted."""
    m = dge.MegaMoE(4, 16, 8, 2, dtype=torch.float32)
    x, idx, _, _, _ = make_inputs(16, 16, 8, 4, 2, dtype=torch.float32, requires_grad=False)
    expected = re.escape(f"topk_weights has shape {shape}; expected topk_idx's shape (16, 2)")
    with pytest.raises(ValueError, match=expected):
        m(x, idx, torch.rand(shape))


def test_argument_errors():
    m = dge.MegaMoE(4, 16, 8, 2, dtype=torch.float32)
    x, idx, w, _, _ = make_inputs(6, 16, 8, 4, 2, dtype=torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=r"topk_idx has shape \(6, 3\); expected its last dim to be top_k=2"):
        m(x, torch.zeros(6, 3, dtype=torch.long), torch.ones(6, 3))
    with pytest.raises(ValueError, match=r"x has shape \(6, 8\); expected its last dim to be hidden=16"):
        m(x[:, :8], idx, w)
    with pytest.raises(ValueError, match=r"topk_idx\[\d+, \d+\] = 4 is out of range"):
        m(x, torch.full_like(idx, 4), w)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        dge.MegaMoE(4.0, 16, 8, 2)
    with pytest.raises(ValueError, match="top_k=0 must be at least 1"):
        dge.MegaMoE(4, 16, 8, 0)
    with pytest.raises(ValueError, match="recipe='int3' is not supported"):
        dge.MegaMoE(4, 16, 8, 2, recipe="int3")
    with pytest.raises(ValueError, match="backend='cutlass' is not supported"):
        dge.MegaMoE(4, 16, 8, 2, backend="cutlass")
    with pytest.raises(ValueError, match="activation_clamp=-1"):
        dge.MegaMoE(4, 16, 8, 2, activation_clamp=-1)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the group size 4"):
        dge.MegaMoE(6, 16, 8, 2, group=FakeGroup(4, 0))
    # One row of topk_idx per token: the leading dimensions must be x's, not just as many elements.
    with pytest.raises(ValueError, match=r"topk_idx has shape \(3, 2, 2\) and x \(2, 3, 16\); expected the same "
                                         r"leading dimensions"):
        m(x.view(2, 3, 16), idx.view(3, 2, 2), w.view(3, 2, 2))
    with pytest.raises(ValueError, match="expected the same leading dimensions"):
        m(x[0], idx[:1], w[:1])
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        m(x.tolist(), idx, w)
    with pytest.raises(TypeError, match="topk_weights must be a torch.Tensor, got NoneType"):
        m(x, idx, None)
    with pytest.raises(TypeError, match="x has dtype torch.int64; expected a floating dtype"):
        m(x.long(), idx, w)


def test_meta_inputs_take_the_fake():
    m = dge.MegaMoE(4, 16, 8, 2, device="meta", dtype=torch.float32)
    x, idx, w, _, _ = make_inputs(6, 16, 8, 4, 2, dtype=torch.float32, requires_grad=False)
    y = m(*(t.to("meta") for t in (x.view(2, 3, 16), idx.view(2, 3, 2), w.view(2, 3, 2))))
    assert y.device.type == "meta" and y.shape == (2, 3, 16)
    g = dge.MegaGroupedExperts(16, 8, 4, device="meta", dtype=torch.float32)
    assert g(*(t.to("meta") for t in (x, idx, w))).shape == (6, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_functional_call_ignores_autocast(dtype):
    """The layer computes in its inputs' dtypes: autocast does not re-cast the CPU path's matmuls, in the
    forward or in a backward run under autocast (MegaMoE casts its inputs to the autocast dtype instead)."""
    x, idx, w, l1, l2 = make_inputs(6, 16, 8, 4, 2, dtype=torch.float32, seed=2)
    plain = dge.mega_moe_train(x, idx, w, l1, l2)
    plain_grads = torch.autograd.grad(plain.sum(), (x, w, l1, l2))
    with torch.autocast("cpu", dtype=dtype):
        y = dge.mega_moe_train(x, idx, w, l1, l2)
        grads = torch.autograd.grad(y.sum(), (x, w, l1, l2))
    assert y.dtype == torch.float32 and torch.equal(y, plain)
    for g, p in zip(grads, plain_grads):
        assert torch.equal(g, p)


def test_expert_parallel_shard_layout():
    """Rank 1 of 4 owns experts [4, 8): the parameters hold E_loc = 4 experts. Any object with size()
    and rank() lays them out; forward needs a real group (tests/test_ep_all_to_all.py runs it)."""
    m = dge.MegaMoE(16, 16, 8, 2, group=FakeGroup(4, 1), dtype=torch.float32)
    assert (m.num_local_experts, m.expert_offset) == (4, 4)
    assert m.l1_weights.shape == (4, 16, 16) and m.l2_weights.shape == (4, 16, 8)
    assert "num_local_experts=4, expert_offset=4" in repr(m)
    x, idx, w, _, _ = make_inputs(6, 16, 8, 16, 2, dtype=torch.float32, requires_grad=False)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                                        "got FakeGroup"):
        m(x, idx, w)


def test_autocast_computes_in_autocast_dtype():
    T, H, I, E, K = 21, 16, 8, 4, 2
    x, idx, w, _, _ = make_inputs(T, H, I, E, K, dtype=torch.float32, seed=3)
    m = dge.MegaMoE(E, H, I, K, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, idx, w)
    assert y.dtype == torch.bfloat16
    y_ref = dge.mega_moe_train(x.bfloat16(), idx, w, m.l1_weights.bfloat16(), m.l2_weights.bfloat16())
    assert torch.equal(y, y_ref)
    y.float().sum().backward()
    assert m.l1_weights.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_meta_device_then_materialise():
    with torch.device("meta"):
        m = dge.MegaMoE(4, 16, 8, 2, dtype=torch.float32)
    assert m.l1_weights.is_meta
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert torch.isfinite(m.l1_weights).all() and m.l1_weights.std() > 0


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_train_tiny_moe_example_smoke(tmp_path, recipe):
    """The example trains both implementations for 3 steps on CPU; in bf16 (fp32 math on CPU) ours
    agrees with the baseline to rounding, under the fp8 recipe (its emulation) within 1%."""
    cmd = [sys.executable, str(ROOT / "examples" / "train_tiny_moe.py"), "--device", "cpu", "--tiny",
           "--steps", "3", "--recipe", recipe, "--out-dir", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "end-to-end speedup" in proc.stdout
    record = json.loads((tmp_path / "train_tiny_moe.json").read_text())
    ours, base = record["curves"]["ours"]["loss"], record["curves"]["grouped_mm"]["loss"]
    assert len(ours) == len(base) == 3
    tolerance = 1e-4 if recipe == "bf16" else 1e-2 * max(base)
    assert max(abs(a - b) for a, b in zip(ours, base)) < tolerance


def _example_args(argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tiny_moe", ROOT / "examples" / "train_tiny_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args(["--device", "cpu", *argv])


def test_train_tiny_moe_example_arguments(capsys):
    """--tiny sets the defaults, not the sizes given explicitly; sizes that cannot train are argument errors."""
    args = _example_args(["--tiny", "--experts", "16", "--hidden", "96"])
    assert (args.experts, args.hidden, args.intermediate, args.top_k) == (16, 96, 32, 2)
    assert (_example_args(["--tiny", "--recipe", "fp8"]).hidden, _example_args([]).hidden) == (128, 1024)
    for argv, message in ((["--tiny", "--steps", "0"], "--steps 0: expected at least 1"),
                          (["--batch", "0"], "--batch 0: expected at least 1"),
                          (["--hidden", "60", "--heads", "7"], "--hidden 60 is not a multiple of --heads 7"),
                          (["--experts", "4", "--top-k", "6"], r"--top-k 6: expected at most --experts \(4\)")):
        with pytest.raises(SystemExit):
            _example_args(argv)
        assert re.search(message, capsys.readouterr().err), argv


def test_deep_gemm_backend_is_checked_at_construction(monkeypatch):
    """The constructor checks its options on meta tensors: backend='deep_gemm' is not refused for the
    meta device, but a missing DeepGEMM is reported there, with the install hint."""
    from deep_gemm_ext.providers import deepgemm

    deepgemm._load.cache_clear()
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # `import deep_gemm` raises ImportError
    try:
        with pytest.raises(RuntimeError, match="DeepGEMM is not importable"):
            dge.MegaMoE(4, 128, 128, 2, backend="deep_gemm")
        with pytest.raises(RuntimeError, match="DeepGEMM is not importable"):
            dge.MegaGroupedExperts(128, 128, 4, backend="deep_gemm")
    finally:
        deepgemm._load.cache_clear()
    monkeypatch.setattr(deepgemm, "_deep_gemm", lambda: None)  # importable: the module builds
    monkeypatch.setattr(deepgemm, "_load", lambda: (object(), None))
    assert dge.MegaMoE(4, 128, 128, 2, backend="deep_gemm").backend == "deep_gemm"
