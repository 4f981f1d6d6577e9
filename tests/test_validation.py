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
    (dict(activation_clamp=10 ** 400), ValueError, r"activation_clamp=1000.* must be a finite positive"),
    (dict(activation_clamp=1e39), ValueError, r"activation_clamp=1e\+39 exceeds the float32 range \(3.40282e\+38\)"),
    (dict(l1_weights=BASE["l1_weights"][:, :0], l2_weights=BASE["l2_weights"][:, :, :0]), ValueError,
     r"hidden=16 and intermediate=0 must be positive"),
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
    # Any spelling of a device: a device string with an index, a torch.device.
    for device in ("cuda:0", torch.device("cuda"), torch.device("cuda", 1)):
        assert "hidden=20 " in dge.unsupported_shape_reason(20, 8, "bf16", device), device
    assert dge.unsupported_shape_reason(20, 8, "bf16", torch.device("cpu")) is None
    with pytest.raises(ValueError, match=r"device_type='CUDA': expected a device type such as 'cuda'"):
        dge.unsupported_shape_reason(20, 8, "bf16", "CUDA")
    with pytest.raises(TypeError, match=r"device_type=None: expected a str or a torch.device"):
        dge.unsupported_shape_reason(20, 8, "bf16", None)
    with pytest.raises(TypeError, match=r"hidden='16': expected an int"):
        dge.unsupported_shape_reason("16", 8)


def test_routing_and_reference_helpers_check_their_arguments():
    idx = torch.tensor([[0, 1], [1, -1]])
    with pytest.raises(TypeError, match=r"topk_idx: expected a 2-D int64 or int32 tensor .* dtype torch.float32"):
        dge.compute_routing_torch(idx.float(), 4, 1)
    with pytest.raises(ValueError, match=r"align=0: expected a positive int"):
        dge.compute_routing_torch(idx, 4, 0)
    with pytest.raises(ValueError, match=r"num_experts=-1: expected a positive int"):
        dge.compute_routing_torch(idx, -1, 1)
    with pytest.raises(TypeError, match=r"num_experts=4.0: expected a positive int"):
        dge.compute_routing_torch(idx, 4.0, 1)
    x, _, w, l1, l2 = make_inputs(2, 16, 8, 4, 2, requires_grad=False, seed=0)
    with pytest.raises(TypeError, match=r"topk_idx has dtype torch.float32; expected an integer dtype"):
        dge.reference_forward(x, idx.float(), w, l1, l2)
    with pytest.raises(ValueError, match=r"expected x \[T, H\] and topk_idx, topk_weights \[T, K\]"):
        dge.reference_forward(x[:1], idx, w, l1, l2)
