"""Input checks of the JIT kernel wrappers: they fail on the host, before any launch."""
from __future__ import annotations

import pytest
import torch

from deep_gemm_ext.jit_kernels import (combine_rows, gather_rows, routing, routing_metadata, swiglu_backward,
                                       swiglu_forward)


def test_routing_rejects_bad_inputs():
    with pytest.raises(ValueError, match="topk_idx: expected a CUDA tensor"):
        routing_metadata(torch.zeros(4, 2, dtype=torch.int64), 8, 128)


def test_routing_index_range_leaves_room_for_a_stride_past_the_end():
    """Slots and pool rows below 2^31 - 2^22: a chunk (at most 2^21 slots) or a grid step past the last
    one still fits an int32; at and past the limit a clear error names both counts."""
    limit = routing.INDEX_LIMIT
    assert limit == 2**31 - 2**22
    assert max(routing.chunking(limit - 1)[0], 1024 * 256) <= 2**31 - limit
    routing.check_index_range(limit - 1, limit - 1, "x")
    for slots, rows in ((limit, 0), (0, limit), (2**31 - 1000, 2**31 - 1000)):
        with pytest.raises(ValueError, match=f"x: {slots} slots and {rows} pool rows"):
            routing.check_index_range(slots, rows, "x")


def test_routing_chunking_is_whole_warp_steps():
    for slots in (0, 1, 2047, 2048, 131072, 300_000, 5_000_000):
        chunk, chunks = routing.chunking(slots)
        assert chunk % 256 == 0 and chunk >= 2048 and chunks <= 1024
        assert chunks * chunk >= slots and (chunks - 1) * chunk < max(slots, 1)


def test_swiglu_rejects_bad_inputs():
    with pytest.raises(ValueError, match="h: expected a CUDA tensor"):
        swiglu_forward(torch.zeros(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="h: expected a CUDA tensor"):
        swiglu_backward(torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16),
                        torch.zeros(4), clamp=None)


def test_gather_combine_reject_bad_inputs():
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        gather_rows(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="o: expected a CUDA tensor"):
        combine_rows(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32), None, 2)
