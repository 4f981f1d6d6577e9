"""Helpers for GPU tests: NaN-poisoned allocator, fp64 reference gradients."""
import torch

from deep_gemm_ext.reference import reference_forward

requires_cuda = __import__("pytest").mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def poison_allocator(num_bytes: int = 8 << 30) -> None:
    """Fill memory the caching allocator will hand out next with 0xFF bytes (NaN in bf16/fp32).

    Any output row a kernel forgets to write then shows up as NaN instead of a stale value.
    """
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    blob = torch.empty(min(num_bytes, int(free * 0.5)), dtype=torch.uint8, device="cuda")
    blob.fill_(0xFF)
    del blob


def reference_grads(x, idx, w, l1, l2, clamp, dy):
    """fp64 reference y and (dx, dtopk_w, dl1, dl2) on upcast inputs."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, l1, l2)]
    y = reference_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], clamp)
    if not y.requires_grad:  # every slot unused
        return y.detach(), tuple(torch.zeros_like(t) for t in leaves)
    return y.detach(), torch.autograd.grad(y, leaves, dy.double())


def run_layer(fn, x, idx, w, l1, l2, clamp, dy):
    y = fn(x, idx, w, l1, l2, clamp)
    grads = torch.autograd.grad(y, (x, w, l1, l2), dy)
    return y.detach(), grads
