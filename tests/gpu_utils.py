"""Helpers for GPU tests: fp64 reference gradients, one layer call with its gradients, grouped-GEMM
references and checks."""
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


def m_grouped_reference(a: torch.Tensor, w_of, starts, ends, n: int) -> torch.Tensor:
    """fp64 rows [s, t) of expert e = a[s:t] @ w_of(e), NaN on the rows no expert owns."""
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.float64, device=a.device)
    for e, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
        if t > s:
            out[s:t] = a[s:t].double() @ w_of(e).double()
    return out


def assert_close_where_owned(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-2) -> None:
    """NaN rows of ref (no expert) must be NaN in got (left unwritten), the others written and within tol."""
    unwritten = torch.isnan(ref)
    assert torch.isnan(got[unwritten].float()).all(), f"{what}: rows no expert owns were written"
    g, r = got[~unwritten].double(), ref[~unwritten]
    assert not torch.isnan(g).any(), f"{what}: elements left unwritten"
    if r.numel():
        err = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < tol, f"{what}: rel error {err:.2e}"
