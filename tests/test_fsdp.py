"""FSDP2 (``fully_shard``) over a small model holding a MegaMoE, one rank: the same outputs and
gradients as the unsharded model, through an optimizer step; also with a bf16 mixed-precision
policy over fp32 master weights. gloo on CPU, nccl on a GPU."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import deep_gemm_ext as dge

from conftest import requires_cuda

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

# (backend, device); H and I are multiples of 8 for the GPU path.
SETUPS = [
    pytest.param(("gloo", "cpu"), id="gloo-cpu"),
    pytest.param(("nccl", "cuda"), id="nccl-cuda",
                 marks=requires_cuda),
]
T, H, I, E, K = 96, 64, 32, 8, 2


class TinyModel(nn.Module):
    def __init__(self, dtype, device, hidden=H, intermediate=I, recipe="bf16"):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, device=device, dtype=dtype)
        self.router = nn.Linear(hidden, E, bias=False, device=device, dtype=dtype)
        self.moe = dge.MegaMoE(E, hidden, intermediate, K, device=device, dtype=dtype, recipe=recipe)

    def forward(self, x):
        h = self.proj(x)
        weights, idx = torch.topk(F.softmax(self.router(h).float(), dim=-1), K, dim=-1)
        return self.moe(h, idx, weights)


@pytest.fixture
def process_group(request, tmp_path):
    backend, device = request.param
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    options = {}
    if device == "cuda":
        torch.cuda.set_device(0)
        options["device_id"] = torch.device("cuda", 0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **options)
    yield device
    dist.destroy_process_group()


def _mesh(device):
    # Name the device type: fully_shard's default mesh is on CUDA whenever a GPU exists, which
    # would move the gloo/CPU variant's parameters to the GPU.
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (1,))


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_same(got, want, what):
    """Bitwise on a GPU. On a CPU, the steps after the first go through MKL's sgemm on the all-gathered
    weights, whose blocking (and with it the order of a sum) can differ between two copies of the same
    weights on some x86 CPUs: equal to 1e-5 relative there, far below what a stale weight or a lost
    gradient changes (an AdamW step at lr 1e-2 moves each weight by about 1e-2)."""
    if got.is_cuda:
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=what)


def train_steps(model, x, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outs, grads = [], []
    for _ in range(steps):
        y = model(x)
        (y.float().square().mean()).backward()
        outs.append(y.detach())
        grads.append({n: full(p.grad).detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, grads


@pytest.mark.parametrize("process_group", SETUPS, indirect=True)
def test_fully_shard_matches_unsharded(process_group):
    device = process_group
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    reference = TinyModel(dtype, device)
    sharded = copy.deepcopy(reference)
    mesh = _mesh(device)
    fsdp.fully_shard(sharded.moe, mesh=mesh)
    fsdp.fully_shard(sharded, mesh=mesh)
    assert type(sharded.moe.l1_weights).__name__ == "DTensor"
    x = torch.randn(T, H, device=device, dtype=dtype)
    ref_outs, ref_grads = train_steps(reference, x)
    outs, grads = train_steps(sharded, x)
    for step, (a, b) in enumerate(zip(outs, ref_outs)):
        assert_same(a, b, f"step {step}: output differs")
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        assert got.keys() == want.keys()
        for name in want:
            assert_same(got[name], want[name], f"step {step}: grad of {name} differs")


@pytest.mark.parametrize("process_group", SETUPS, indirect=True)
def test_fully_shard_fp8_recipe_requantizes_after_each_step(process_group):
    """recipe="fp8" quantizes each weight once per version: the all-gathered weights of every step
    must reach the fp8 weight cache as a new version (a stale copy would change step 2)."""
    device = process_group
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    reference = TinyModel(dtype, device, hidden=128, intermediate=128, recipe="fp8")
    sharded = copy.deepcopy(reference)
    mesh = _mesh(device)
    fsdp.fully_shard(sharded.moe, mesh=mesh)
    fsdp.fully_shard(sharded, mesh=mesh)
    x = torch.randn(T, 128, device=device, dtype=dtype)
    ref_outs, ref_grads = train_steps(reference, x, steps=3)
    outs, grads = train_steps(sharded, x, steps=3)
    assert not torch.equal(ref_outs[0], ref_outs[2])
    for step, (a, b) in enumerate(zip(outs, ref_outs)):
        assert torch.equal(a, b), f"step {step}: output differs"
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        for name in want:
            assert torch.equal(got[name], want[name]), f"step {step}: grad of {name} differs"


@pytest.mark.parametrize("process_group", SETUPS, indirect=True)
def test_fully_shard_bf16_mixed_precision(process_group):
    """fp32 master weights, bf16 compute: MegaMoE gets the all-gathered bf16 weights. Its own
    policy must not cast forward inputs, or FSDP rounds the fp32 routing weights to bf16."""
    device = process_group
    torch.manual_seed(0)
    master = TinyModel(torch.float32, device)
    sharded = copy.deepcopy(master)
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    moe_policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           cast_forward_inputs=False)
    mesh = _mesh(device)
    fsdp.fully_shard(sharded.moe, mp_policy=moe_policy, mesh=mesh)
    fsdp.fully_shard(sharded, mp_policy=policy, mesh=mesh)
    x = torch.randn(T, H, device=device)
    compute = copy.deepcopy(master).to(torch.bfloat16)  # what the bf16 compute sees
    y_ref = compute(x.bfloat16())
    y_ref.float().square().mean().backward()
    y = sharded(x)
    y.float().square().mean().backward()
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    for name, p in sharded.named_parameters():
        want = dict(compute.named_parameters())[name].grad.float()
        assert full(p.grad).dtype == torch.float32
        assert torch.equal(full(p.grad), want), f"grad of {name} differs"


@pytest.mark.parametrize("process_group", SETUPS, indirect=True)
def test_meta_init_then_fully_shard(process_group):
    """torchtitan's order: build on meta, shard, materialise, then initialise the sharded weights."""
    device = process_group
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        model = TinyModel(dtype, None)
    mesh = _mesh(device)
    fsdp.fully_shard(model.moe, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    model.moe.reset_parameters(init_std=0.01)
    l1 = full(model.moe.l1_weights).float()
    assert abs(l1[:, :I].std().item() - 0.02) < 2e-3 and abs(l1[:, I:].std().item() - 0.01) < 1e-3
    with torch.no_grad():
        for p in (model.proj.weight, model.router.weight):
            p.normal_(0, 0.1)
        model.proj.bias.zero_()
    y = model(torch.randn(T, H, device=device, dtype=dtype))
    y.float().square().mean().backward()
    assert all(torch.isfinite(full(p.grad)).all() for p in model.parameters())
