"""testing.median_ms: how many calls it makes and what it divides by (no timing values are asserted)."""
import pytest
import torch

from deep_gemm_ext.testing import median_ms

from conftest import requires_cuda


def test_calls_must_be_positive():
    with pytest.raises(ValueError, match="calls=0"):
        median_ms(lambda: None, reps=2, calls=0)


@requires_cuda
@pytest.mark.parametrize("calls", [1, 4])
def test_calls_per_repeat(calls):
    count = []
    x = torch.randn(256, 256, device="cuda")

    def fn():
        count.append(1)
        return x @ x

    ms = median_ms(fn, reps=3, warmup=2, calls=calls)
    assert len(count) == 2 + 3 * calls
    assert ms > 0
