"""Seeded fuzz of the layer on CPU: forward and all four gradients against the fp64 reference.

The CPU path computes in fp32 (fp64 for fp64 inputs) and rounds once to the output dtype, so the
tolerances are tight: one bf16 rounding (2^-8) for bf16 outputs, 2e-5 for fp32, 1e-10 for fp64.
A failing case is reproduced by its seed: ``pytest tests/test_fuzz.py -k "seed-17"``.
The GPU variant is tests/test_gpu_fuzz.py.
"""
import math

import pytest
import torch

from deep_gemm_ext import plan
from deep_gemm_ext.validation import unsupported_shape_reason

from fuzz_utils import (FUZZ_ROUTINGS, GPU_CRITERIA, GPU_LIMITS, Limits, check_case, draw_case, failure_report,
                        make_case_inputs, summary_line)

CPU_SEEDS = range(40)


@pytest.mark.parametrize("seed", CPU_SEEDS, ids=lambda s: f"seed-{s}")
def test_cpu_fuzz(seed):
    result = check_case(draw_case(seed, "cpu"), "cpu")
    assert not result.failures, failure_report([result])


def test_cases_are_reproducible():
    for seed in (0, 7, 123):
        for device_type in ("cpu", "cuda"):
            assert draw_case(seed, device_type) == draw_case(seed, device_type)
        case = draw_case(seed, "cpu")
        a, b = make_case_inputs(case, "cpu"), make_case_inputs(case, "cpu")
        assert all(torch.equal(s, t) for s, t in zip(a, b))


def test_gpu_draws_cover_the_edge_cases():
    """The GPU fuzz's 256 draws hit every routing case of docs/architecture.md's protocol, at legal,
    bounded sizes."""
    cases = [draw_case(seed, "cuda") for seed in range(256)]
    for c in cases:
        assert unsupported_shape_reason(c.hidden, c.intermediate, device_type="cuda") is None, c
        assert c.num_tokens <= GPU_LIMITS.max_tokens and c.hidden <= GPU_LIMITS.max_hidden, c
        assert c.intermediate <= GPU_LIMITS.max_inter and c.num_experts <= GPU_LIMITS.max_experts, c
        assert c.num_tokens * c.top_k * c.hidden * c.intermediate <= GPU_LIMITS.max_work, c
        assert c.num_experts * 3 * c.intermediate * c.hidden <= GPU_LIMITS.max_weights or c.num_experts <= 2, c
    seen = {
        "T = 0": any(c.num_tokens == 0 for c in cases),
        "T = 1": any(c.num_tokens == 1 for c in cases),
        "T a multiple of 128": any(c.num_tokens and c.num_tokens % 128 == 0 for c in cases),
        "T > 1 not a multiple of 128": any(c.num_tokens > 1 and c.num_tokens % 128 for c in cases),
        "clamp on": any(c.clamp is not None for c in cases),
        "clamp off": any(c.clamp is None for c in cases),
        "int32 ids": any(c.idx_dtype == torch.int32 for c in cases),
        "offset views": any(c.offset_views for c in cases),
        "transposed dy": any(c.dy_layout == "transposed" for c in cases),
        "one expert": any(c.num_experts == 1 for c in cases),
        "top_k > experts": any(c.top_k > c.num_experts for c in cases),
        "SM90 GEMM shapes, I an odd multiple of 64": any(c.hidden % 128 == 0 and c.intermediate % 128 == 64
                                                          for c in cases),
        "SM90 GEMM shapes, I a multiple of 128": any(c.hidden % 128 == 0 and c.intermediate % 128 == 0 for c in cases),
        "other shapes": any(c.hidden % 128 or c.intermediate % 64 for c in cases),
        "H not a multiple of 64": any(c.hidden % 64 for c in cases),
        **{f"routing {r}": any(c.routing == r for c in cases) for r in FUZZ_ROUTINGS},
    }
    assert all(seen.values()), [k for k, v in seen.items() if not v]


# The GPU composition (bf16 pool, 16-row aligned groups with padding rows, torch._grouped_mm,
# bf16 h) runs on CPU too when the engine is forced: the GPU criteria (1.05x the baseline) are
# checked here on small shapes, so a regression in the composition shows up without a GPU.
EMULATED = Limits(96, 128, 128, 12, 8, 8, 1 << 22, 1 << 22)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"seed-{s}")
def test_gpu_composition_emulated_on_cpu(seed, monkeypatch):
    monkeypatch.setattr(plan, "choose_provider", lambda device, dtype, facts, backend, recipe:
                        "grouped_mm" if dtype == torch.bfloat16 else "loop")
    case = draw_case(seed, "cuda", EMULATED)
    result = check_case(case, "cpu", criteria_of=lambda dtype: GPU_CRITERIA, with_baseline=True)
    assert not result.failures, failure_report([result]) + "\n" + summary_line([result])
    assert math.isfinite(result.max_err)
