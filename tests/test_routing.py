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
