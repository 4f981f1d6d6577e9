"""testing.median_ms: how many calls it makes and what it divides by (no timing values are asserted);
testing.GpuReadings: what it reads through NVML (a fake pynvml on the CPU) and its absence without NVML."""
import sys
import types

import pytest
import torch

from deep_gemm_ext.testing import GpuReadings, median_ms

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

    repeats = []
    ms = median_ms(fn, reps=3, warmup=2, calls=calls, after_repeat=lambda: repeats.append(len(count)))
    assert len(count) == 2 + 3 * calls
    assert repeats == [2 + calls * (i + 1) for i in range(3)]  # once after each repeat's calls
    assert ms > 0


def _fake_nvml(clocks, milliwatts, index_seen):
    fake = types.ModuleType("pynvml")
    fake.NVML_CLOCK_SM = 1
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda i: index_seen.append(i) or ("handle", i)
    fake.nvmlDeviceGetClockInfo = lambda handle, kind: clocks.pop(0) if kind == 1 else -1
    fake.nvmlDeviceGetPowerUsage = lambda handle: milliwatts.pop(0)
    return fake


def _install(monkeypatch, fake, cuda_index=0, nvml_index=0):
    """``fake`` as pynvml, and a CUDA device ``cuda_index`` that NVML knows as ``nvml_index``."""
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda_index)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda d: {cuda_index: nvml_index}[d])


def test_gpu_readings_medians_through_nvml(monkeypatch):
    index_seen = []
    _install(monkeypatch, _fake_nvml([1980, 1470, 1500], [700000, 650000, 655500], index_seen), 3, 5)
    readings = GpuReadings()
    assert readings.available and index_seen == [5]  # the NVML index of the current CUDA device
    assert readings.medians() == (None, None)  # nothing read yet
    for _ in range(3):
        readings.read()
    assert readings.clocks_mhz == [1980, 1470, 1500] and readings.power_w == [700.0, 650.0, 655.5]
    assert readings.medians() == (1500, 655.5)


def test_gpu_readings_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    readings = GpuReadings()
    readings.read()
    assert not readings.available and readings.medians() == (None, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not GpuReadings().available


def test_gpu_readings_stop_at_an_unsupported_query(monkeypatch):
    fake = _fake_nvml([1500, 1400], [600000], [])

    def unsupported(handle):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
    _install(monkeypatch, fake)
    readings = GpuReadings()
    readings.read()
    fake.nvmlDeviceGetPowerUsage = unsupported
    readings.read()  # no exception: the readings end, the ones taken stay
    readings.read()
    assert not readings.available and readings.medians() == (1500, 600.0)
