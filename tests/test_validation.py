"""Every validation error: right exception type, naming the argument, the value and the expectation."""
import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext.testing import make_inputs


def args(**over):
    x, idx, w, l1, l2 = make_inputs(8, 16, 8, 4, 2, requires_grad=False, seed=0)
    a = dict(x=x, topk_idx=idx, topk_weights=w, l1_weights=l1, l2_weights=l2)
    a.update(over)
    return a


def call(**over):
    a = args(**{k: v for k, v in over.items() if k in ("x", "topk_idx", "topk_weights", "l1_weights", "l2_weights")})
    kw = {k: v for k, v in over.items() if k not in a}
    return dge.mega_moe_train(a["x"], a["topk_idx"], a["topk_weights"], a["l1_weights"], a["l2_weights"], **kw)


BASE = args()
CASES = [
    (dict(x=BASE["x"].float().half()), TypeError, r"x has dtype torch.float16"),
    (dict(x=[1, 2]), TypeError, r"x must be a torch.Tensor"),
    (dict(x=BASE["x"][None]), ValueError, r"x must be 2-D"),
    (dict(x=BASE["x"][:5]), ValueError, r"topk_idx has 8 rows but x has 5 tokens"),
    (dict(x=BASE["x"][:, :8]), ValueError, r"l1_weights.shape\[2\]=16 must equal x's hidden size 8"),
    (dict(x=BASE["x"].t().contiguous().t()), ValueError, r"x must be contiguous"),
    (dict(topk_idx=BASE["topk_idx"].float()), TypeError, r"topk_idx has dtype torch.float32"),
    (dict(topk_idx=BASE["topk_idx"][:, :1]), ValueError, r"topk_weights has shape \(8, 2\); expected topk_idx's shape \(8, 1\)"),
    (dict(topk_idx=torch.full((8, 2), 4)), ValueError, r"topk_idx\[0, 0\] = 4 is out of range; expected expert ids in \[-1, 4\)"),
    (dict(topk_idx=torch.full((8, 2), -2)), ValueError, r"= -2 is out of range"),
    (dict(topk_idx=torch.zeros(8, 0, dtype=torch.int64), topk_weights=torch.zeros(8, 0)), ValueError, r"top_k=0"),
    (dict(topk_weights=BASE["topk_weights"].bfloat16()), TypeError, r"topk_weights has dtype torch.bfloat16"),
    (dict(l1_weights=BASE["l1_weights"][:, :15]), ValueError, r"l1_weights.shape\[1\]=15 must be even"),
    (dict(l1_weights=BASE["l1_weights"].float()), TypeError, r"l1_weights has dtype torch.float32; expected x's dtype"),
    (dict(l2_weights=BASE["l2_weights"][:3]), ValueError, r"l2_weights has shape \(3, 16, 8\); expected \(4, 16, 8\)"),
    (dict(l2_weights=BASE["l2_weights"].transpose(1, 2)), ValueError, r"l2_weights has shape"),
    (dict(recipe="fp4"), ValueError, r"recipe='fp4' is not supported"),
    (dict(backend="cutlass"), ValueError, r"backend='cutlass' is not supported"),
    (dict(activation_clamp=-1.0), ValueError, r"activation_clamp=-1.0 must be a finite positive"),
    (dict(activation_clamp=float("inf")), ValueError, r"activation_clamp=inf"),
    (dict(activation_clamp="7"), TypeError, r"activation_clamp must be a float or None"),
]


@pytest.mark.parametrize("over,exc,msg", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input(over, exc, msg):
    with pytest.raises(exc, match=msg):
        call(**over)


def test_group_must_be_a_process_group_or_mesh():
    class FakeGroup:
        def size(self):
            return 4

    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                                        "got FakeGroup"):
        call(group=FakeGroup())


def test_device_mismatch_is_named():
    meta = torch.empty(8, 2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"topk_idx is on meta but x is on cpu"):
        call(topk_idx=meta)


def test_unsupported_shape_reason():
    assert dge.unsupported_shape_reason(2048, 768) is None
    assert "hidden=2044" in dge.unsupported_shape_reason(2044, 768)
    assert "intermediate=770" in dge.unsupported_shape_reason(2048, 770, device_type="cuda")
    assert dge.unsupported_shape_reason(2044, 770, device_type="cpu") is None
