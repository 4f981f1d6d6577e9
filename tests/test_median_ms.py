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

    class Windows:
        def begin(self):
            pass

        def end(self):
            repeats.append(len(count))
    ms = median_ms(fn, reps=3, warmup=2, calls=calls, during=Windows())
    assert len(count) == 2 + 3 * calls
    assert repeats == [2 + calls * (i + 1) for i in range(3)]  # once after each repeat's calls
    assert ms > 0


class _Windows:
    """A ``during`` object that records the order of its calls against fn's."""
    def __init__(self, log):
        self.log = log

    def begin(self):
        self.log.append("begin")

    def end(self):
        self.log.append("end")


@requires_cuda
def test_during_brackets_every_window():
    log = []
    median_ms(lambda: log.append("fn"), reps=2, warmup=1, calls=2, during=_Windows(log))
    assert log == ["fn", "begin", "fn", "fn", "end", "begin", "fn", "fn", "end"]


def _fake_nvml(clocks, milliwatts, index_seen, reasons=None, instant=True):
    """A pynvml with scripted readings: each query pops the next value of its list."""
    fake = types.ModuleType("pynvml")
    fake.NVML_CLOCK_SM = 1
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda i: index_seen.append(i) or ("handle", i)
    fake.nvmlDeviceGetClockInfo = lambda handle, kind: clocks.pop(0) if kind == 1 else -1
    if instant:
        def field_values(handle, ids):
            assert ids == [186]  # NVML_FI_DEV_POWER_INSTANT
            return [types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=milliwatts.pop(0)))]
        fake.nvmlDeviceGetFieldValues = field_values
    else:
        fake.nvmlDeviceGetPowerUsage = lambda handle: milliwatts.pop(0)
    reasons = [0] * 8 if reasons is None else reasons
    fake.nvmlDeviceGetCurrentClocksEventReasons = lambda handle: reasons.pop(0)
    return fake


def _install(monkeypatch, fake, cuda_index=0, nvml_index=0):
    """``fake`` as pynvml, and a CUDA device ``cuda_index`` that NVML knows as ``nvml_index``."""
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda_index)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda d: {cuda_index: nvml_index}[d])


def test_gpu_readings_medians_through_nvml(monkeypatch):
    index_seen = []
    # SW power cap (0x4), none, HW power brake (0x80) | a thermal reason (0x20): two of three capped
    fake = _fake_nvml([1980, 1470, 1500], [700000, 650000, 655500], index_seen, reasons=[0x4, 0x0, 0xa0])
    _install(monkeypatch, fake, 3, 5)
    readings = GpuReadings()
    assert readings.available and index_seen == [5]  # the NVML index of the current CUDA device
    assert readings.medians() == dict(sm_mhz=None, power_w=None, power_capped=None)
    for _ in range(3):
        readings.sample()
    assert readings.clocks_mhz == [1980, 1470, 1500] and readings.power_w == [700.0, 650.0, 655.5]
    got = readings.medians()
    assert got["sm_mhz"] == 1500 and got["power_w"] == 655.5
    assert got["power_capped"] == pytest.approx(2 / 3)


def test_gpu_readings_average_power_without_the_instant_field(monkeypatch):
    _install(monkeypatch, _fake_nvml([1755], [612000], [], instant=False))
    readings = GpuReadings()
    readings.sample()
    assert readings.medians()["power_w"] == 612.0


def test_gpu_readings_sample_while_windows_run(monkeypatch):
    """The thread samples between begin() and end() only, and close() stops it."""
    import time
    _install(monkeypatch, _fake_nvml([1600] * 10**5, [500000] * 10**5, [], reasons=[0x4] * 10**5))
    with GpuReadings(period_s=0.001) as readings:
        readings.begin()
        deadline = time.monotonic() + 10
        while len(readings.clocks_mhz) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        readings.end()
        taken = len(readings.clocks_mhz)
        time.sleep(0.05)
        assert len(readings.clocks_mhz) <= taken + 1  # at most the sample in flight at end()
    assert readings._thread is None
    got = readings.medians()
    assert taken >= 3 and got["sm_mhz"] == 1600 and got["power_w"] == 500.0 and got["power_capped"] == 1.0


def test_gpu_readings_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    readings = GpuReadings()
    readings.begin()
    readings.sample()
    readings.end()
    readings.close()
    assert not readings.available and readings.medians()["sm_mhz"] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not GpuReadings().available


def test_gpu_readings_stop_at_an_unsupported_query(monkeypatch):
    fake = _fake_nvml([1500, 1400, 1300], [600000, 610000], [])

    def unsupported(*args):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
    _install(monkeypatch, fake)
    readings = GpuReadings()
    readings.sample()
    fake.nvmlDeviceGetFieldValues = unsupported
    fake.nvmlDeviceGetPowerUsage = unsupported
    readings.sample()  # no exception: the power readings end, the clock's go on
    fake.nvmlDeviceGetClockInfo = unsupported
    readings.sample()
    readings.sample()
    got = readings.medians()
    assert readings.clocks_mhz == [1500, 1400] and readings.power_w == [600.0]
    assert got["sm_mhz"] == 1450 and got["power_w"] == 600.0
