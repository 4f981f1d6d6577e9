"""Helpers for GPU tests: fp64 reference gradients, one layer call with its gradients."""
import torch

from deep_gemm_ext.reference import reference_forward


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
