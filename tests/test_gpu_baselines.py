"""The benchmark's strongest baselines against the fp64 reference on the GPU: Liger-Kernel's fused
MoE through our adapter, and the grouped_mm baseline compiled as one graph (what scripts/bench.py
times). Outputs are NaN-poisoned first, so an unwritten row fails."""
import pytest
import torch

from deep_gemm_ext.baselines import grouped_mm_moe, liger_fused_moe, liger_unavailable_reason
from deep_gemm_ext.testing import make_inputs, rel_err
from conftest import poison_cached_memory, requires_cuda
from gpu_utils import reference_grads

NAMES = ("y", "dx", "dtopk_w", "dl1", "dl2")
MAX_REL_ERR = 2e-2  # docs/architecture.md, "Correctness and timing protocol"


def _errors(fn, routing, seed, shape=(512, 256, 128, 16, 4)):
    x, idx, w, l1, l2 = make_inputs(*shape, routing=routing, device="cuda", seed=seed)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).to("cuda", x.dtype)
    poison_cached_memory()
    y = fn(x, idx, w, l1, l2)
    grads = torch.autograd.grad(y, (x, w, l1, l2), dy)
    y_ref, grads_ref = reference_grads(x, idx, w, l1, l2, None, dy)
    for name, out in zip(NAMES, (y, *grads)):
        assert not out.isnan().any(), f"{name} holds NaN (a row left unwritten)"
    return {n: rel_err(out, ref) for n, out, ref in zip(NAMES, (y, *grads), (y_ref, *grads_ref))}


def _assert_within(errors):
    # Every entry: max() would pass over a NaN that is not the first.
    assert all(err < MAX_REL_ERR for err in errors.values()), errors


# Liger has no unused slots (-1): only routings where every slot names an expert.
@requires_cuda
@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts"])
@pytest.mark.parametrize("shape", [(512, 256, 128, 16, 4), (77, 200, 72, 5, 3)], ids=["aligned", "ragged"])
def test_gpu_liger_adapter_matches_reference(routing, shape):
    reason = liger_unavailable_reason()
    if reason:
        pytest.skip(reason)
    errors = _errors(liger_fused_moe, routing, seed=21, shape=shape)
    _assert_within(errors)


@requires_cuda
@pytest.mark.parametrize("routing", ["uniform", "unused_slots"])
def test_gpu_compiled_grouped_mm_is_one_graph_and_matches_reference(routing):
    compiled = torch.compile(grouped_mm_moe, fullgraph=True, dynamic=False)
    errors = _errors(compiled, routing, seed=31)
    _assert_within(errors)
