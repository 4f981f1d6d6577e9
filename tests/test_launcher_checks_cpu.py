"""The launchers' checks before a launch, on the CPU: tensors that report ``is_cuda`` and a recorder in
place of the driver. On a GPU what these checks catch would be a misaligned-address fault or silently
wrong rows: inputs at an address that is not 16-byte aligned are copied (the kernels move 16-byte
vectors), outputs there are refused, index tensors must be contiguous (the kernels get base pointers),
and sizes the kernels index in 32-bit ints are bounded."""
import contextlib
import struct

import pytest
import torch

from deep_gemm_ext import jit
from deep_gemm_ext.jit_kernels import Scatter, gather_combine, swiglu


class _OnGpu(torch.Tensor):
    """A CPU tensor the launchers take for a CUDA one."""

    @property
    def is_cuda(self):
        return True


def _gpu(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_OnGpu)


class _Recorder:
    def __init__(self, name, launches):
        self.name, self.launches, self.loaded, self.dynamic_smem = name, launches, True, 1024

    def resources(self):
        return []

    def launch(self, grid, block, args, **kw):
        self.launches.append((self.name, args))

    def launch_bytes(self, grid, block, layout, payload, **kw):
        self.launches.append((self.name, (layout, payload)))

    def max_active_clusters(self, *args):
        return 66


@pytest.fixture
def launches(monkeypatch):
    recorded = []
    monkeypatch.setattr(jit, "build", lambda name, code, **kw: _Recorder(name, recorded))
    monkeypatch.setattr(jit, "num_sms", lambda device=None: 132)
    monkeypatch.setattr(jit, "device_guard", lambda t: contextlib.nullcontext())
    return recorded


def _misaligned(rows, cols, dtype=torch.bfloat16):
    view = torch.randn(rows * cols + 1).to(dtype)[1:].view(rows, cols)
    assert view.is_contiguous() and view.data_ptr() % 16
    return _gpu(view)


def _pointers(args):
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]


def test_misaligned_inputs_are_copied(launches):
    rows, top_k = 8, 2
    row_to_slot = _gpu(torch.arange(rows, dtype=torch.int32))
    slot_to_row = _gpu(torch.arange(rows, dtype=torch.int32))
    gather_combine.gather_rows(_misaligned(4, 64), row_to_slot, top_k)
    gather_combine.combine_rows(_misaligned(rows, 64), slot_to_row, None, top_k)
    gather_combine.combine_slots(_misaligned(rows, 64), slot_to_row, top_k)
    swiglu.swiglu_forward(_misaligned(rows, 64))
    swiglu.swiglu_backward(_misaligned(rows, 64), _misaligned(rows, 32), _gpu(torch.ones(rows)))
    assert len(launches) == 5
    for name, args in launches:
        assert all(p % 16 == 0 for p in _pointers(args)), name


def test_misaligned_outputs_are_refused(launches, monkeypatch):
    with pytest.raises(ValueError, match="out: starts at address .* not 16-byte aligned"):
        gather_combine.zero_rows_past(_misaligned(8, 64), _gpu(torch.tensor([3], dtype=torch.int32)))
    # The M-grouped GEMM's slot-scatter epilogue (the plain store's TMA map refuses it as well).
    from deep_gemm_ext.jit import tma
    from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg

    monkeypatch.setattr(tma, "_encode", lambda *a, **k: bytes(128))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rows, k, n, slots = 256, 64, 128, 200
    a, b = _gpu(torch.zeros(rows, k, dtype=torch.bfloat16)), _gpu(torch.zeros(2, n, k, dtype=torch.bfloat16))
    starts, ends = _gpu(torch.tensor([0, 128], dtype=torch.int32)), _gpu(torch.tensor([128, 256], dtype=torch.int32))
    scatter = Scatter(_gpu(torch.arange(rows, dtype=torch.int32) % slots), slots)
    gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, _gpu(torch.zeros(slots, n, dtype=torch.bfloat16)),
                                         scatter=scatter)
    with pytest.raises(ValueError, match="out: starts at address .* not 16-byte aligned"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, _misaligned(slots, n), scatter=scatter)
    # Pool-order weights the kernel reads from a base pointer: a strided view is refused.
    strided = _gpu(torch.ones(2 * rows)[::2])
    with pytest.raises(ValueError, match=r"scatter.row_weights: .* expected a contiguous \(256,\) tensor"):
        gg.m_grouped_bf16_gemm_nt_contiguous(a, b, starts, ends, _gpu(torch.zeros(slots, n, dtype=torch.bfloat16)),
                                             scatter=Scatter(scatter.row_to_slot, slots, row_weights=strided))


def test_index_tensors_must_be_contiguous(launches):
    strided = _gpu(torch.arange(16, dtype=torch.int32)[::2])
    x = _gpu(torch.randn(4, 64).bfloat16())
    with pytest.raises(ValueError, match="row_to_slot: expected a contiguous 1-D int32 tensor"):
        gather_combine.gather_rows(x, strided, 2)
    with pytest.raises(ValueError, match="ends: expected a contiguous 1-D int32 tensor"):
        gather_combine.zero_rows_past(_gpu(torch.zeros(8, 64, dtype=torch.bfloat16)), strided)
    with pytest.raises(ValueError, match="index: expected a contiguous 1-D int32 tensor"):
        gather_combine.take_or_zero(_gpu(torch.ones(4)), strided)
    assert launches == []


def test_sizes_past_int32_are_refused(launches):
    x, row_to_slot = _gpu(torch.randn(4, 64).bfloat16()), _gpu(torch.arange(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"top_k=4294967298: expected an int in \[1, 2147483647\]"):
        gather_combine.gather_rows(x, row_to_slot, 2**32 + 2)
    assert launches == []
