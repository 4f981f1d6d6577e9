import pytest
import torch

from deep_gemm_ext.routing import compute_routing_torch, pool_rows
from deep_gemm_ext.testing import ROUTINGS, make_routing


@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("num_tokens", [0, 1, 129])
def test_routing_properties(routing, align, num_tokens):
    num_experts, top_k = 9, 3
    idx = make_routing(num_tokens, num_experts, top_k, routing, generator=torch.Generator().manual_seed(3))
    m = compute_routing_torch(idx, num_experts, align)
    flat = idx.reshape(-1)
    assert m.row_to_slot.shape[0] == pool_rows(flat.numel(), num_experts, align)
    expected_counts = torch.stack([(flat == e).sum() for e in range(num_experts)])
    assert torch.equal(m.counts.long(), expected_counts)
    assert torch.all(m.starts % align == 0) and torch.all(m.ends % align == 0)
    assert torch.equal(m.ends - m.starts, (m.counts + align - 1) // align * align)
    assert torch.equal(m.starts[1:], m.ends[:-1]) and (num_experts == 0 or int(m.starts[0]) == 0)
    for slot in range(flat.numel()):
        row = int(m.slot_to_row[slot])
        e = int(flat[slot])
        if e < 0:
            assert row == -1
            continue
        assert int(m.starts[e]) <= row < int(m.starts[e]) + int(m.counts[e])
        assert int(m.row_to_slot[row]) == slot
    # Rows of an expert are ordered by slot; everything else is padding.
    for e in range(num_experts):
        s, c = int(m.starts[e]), int(m.counts[e])
        slots = m.row_to_slot[s:s + c]
        assert torch.all(slots[1:] > slots[:-1])
        assert torch.all(m.row_to_slot[s + c:int(m.ends[e])] == -1)
    assert torch.all(m.row_to_slot[int(m.ends[-1]):] == -1)
    assert int((m.row_to_slot >= 0).sum()) == int((flat >= 0).sum())


def test_out_of_range_ids_never_index_out_of_bounds():
    idx = torch.tensor([[0, 7], [-3, 1]])
    m = compute_routing_torch(idx, 2, 4)
    assert m.slot_to_row.tolist()[1] == -1 and m.slot_to_row.tolist()[2] == -1
    assert int(m.row_to_slot.max()) < idx.numel()


def test_routing_launch_mode_reaches_the_kernels():
    """``elementwise.routing(single_launch=False)`` asks the JIT kernels for their three launches; the
    default leaves the choice to them."""
    from types import SimpleNamespace

    from deep_gemm_ext import elementwise

    seen = []
    fake = SimpleNamespace(routing_metadata=lambda *args, **kwargs: seen.append(kwargs) or "meta")
    idx = torch.zeros(4, 2, dtype=torch.int64)
    assert elementwise.routing(idx, 8, 128, fake) == "meta"
    assert elementwise.routing(idx, 8, 128, fake, single_launch=False, assert_ids=True) == "meta"
    assert seen == [{"assert_ids": False, "launches": None}, {"assert_ids": True, "launches": 3}]


def test_layer_asks_for_three_routing_launches_only_under_expert_parallelism(monkeypatch, tmp_path):
    """One rank: the one-launch routing where it applies; with a process group (tokens exchanged, here
    a one-rank gloo group in process): the three launches (a cluster must find 8 SMs of a GPC free at
    once, which ranks waiting on each other need not leave it)."""
    import torch.distributed as dist

    import deep_gemm_ext as dge
    from deep_gemm_ext import elementwise, layer
    from deep_gemm_ext import plan as dge_plan
    from deep_gemm_ext.testing import make_inputs

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    seen = []
    original = elementwise.routing

    def routing(*args, single_launch=True, **kwargs):
        seen.append(single_launch)
        return original(*args, single_launch=single_launch, **kwargs)

    monkeypatch.setattr(elementwise, "routing", routing)
    x, idx, w, l1, l2 = make_inputs(16, 32, 16, 4, 2, device="cpu", dtype=torch.float32, seed=0, requires_grad=False)
    y_local = dge.mega_moe_train(x, idx, w, l1, l2)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        # A one-rank group is "local" at the API; its all-to-all exchange, taken directly, is not.
        exchange = dge.EpBuffer(dist.group.WORLD, 16, 32, 2, torch.float32).exchange_spec(4)
        plan = dge_plan.resolve(x, l1, exchange=exchange)
        assert plan.exchanges_tokens
        y_group, _ = layer.forward(plan, x, idx, w, l1, l2, None)
    finally:
        dist.destroy_process_group()
    assert seen == [True, False]
    torch.testing.assert_close(y_group, y_local)
