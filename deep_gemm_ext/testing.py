"""Inputs and error measures shared by the tests and the benchmarks (one generator for both)."""
from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from dataclasses import dataclass

import torch

ROUTINGS = ("uniform", "zipf", "one_expert", "empty_experts", "unused_slots")


@dataclass(frozen=True)
class Workload:
    name: str
    num_tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int

    def flops_forward(self) -> float:
        """6·T·K·H·I: two GEMMs of 2·H·I (L1 is 2I wide) per routed slot."""
        return 6.0 * self.num_tokens * self.top_k * self.hidden * self.intermediate


#: Headline workloads of docs/architecture.md's protocol (single GPU, all experts local).
WORKLOADS = {
    w.name: w
    for w in (
        Workload("qwen3-30b-a3b-t16384", 16384, 2048, 768, 128, 8),
        Workload("qwen3-30b-a3b-t4096", 4096, 2048, 768, 128, 8),
        Workload("qwen3-235b-a22b-t8192", 8192, 4096, 1536, 128, 8),
        Workload("deepseek-v3-t8192", 8192, 7168, 2048, 256, 8),
    )
}


def make_routing(num_tokens: int, num_experts: int, top_k: int, kind: str = "uniform", *,
                 device="cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """topk_idx [T, K] int64 with distinct experts per token (where the kind allows it)."""
    g = generator
    if kind not in ROUTINGS:
        raise ValueError(f"kind={kind!r}; expected one of {ROUTINGS}")
    if kind == "one_expert":
        idx = torch.full((num_tokens, top_k), -1, dtype=torch.int64)
        idx[:, 0] = num_experts // 2  # every token on one expert, other slots unused
        return idx.to(device)
    if kind == "zipf":
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
        probs = (1.0 / ranks ** 1.2).expand(num_tokens, -1)
    elif kind == "empty_experts":
        probs = torch.ones(num_tokens, num_experts, dtype=torch.float64)
        probs[:, ::3] = 0  # every third expert receives nothing
    else:
        probs = torch.ones(num_tokens, num_experts, dtype=torch.float64)
    # Fewer reachable experts than top_k: the remaining slots stay unused (-1).
    k = min(top_k, num_experts - (num_experts + 2) // 3 if kind == "empty_experts" else num_experts)
    idx = torch.full((num_tokens, top_k), -1, dtype=torch.int64)
    if num_tokens and k > 0:
        idx[:, :k] = torch.multinomial(probs, k, replacement=False, generator=g)
    if kind == "unused_slots" and num_tokens:
        drop = torch.rand(num_tokens, top_k, generator=g) < 0.25
        idx[drop] = -1
    return idx.to(device)


def make_inputs(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                routing: str = "uniform", device="cpu", dtype=torch.bfloat16, seed: int | None = None,
                requires_grad: bool = True):
    """Fresh random inputs (never zeros) scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2 ** 31))
    x = torch.randn(num_tokens, hidden, generator=g)
    l1 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    l2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    idx = make_routing(num_tokens, num_experts, top_k, routing, generator=g)
    w = torch.rand(num_tokens, top_k, generator=g) + 0.05
    w = w / w.sum(-1, keepdim=True)
    tensors = [x.to(device, dtype), idx.to(device), w.to(device), l1.to(device, dtype), l2.to(device, dtype)]
    if requires_grad:
        for i in (0, 2, 3, 4):
            tensors[i].requires_grad_(True)
    return tuple(tensors)


_L2_FLUSH: torch.Tensor | None = None


@contextlib.contextmanager
def environ(values: dict):
    """``values`` set in ``os.environ`` within, the previous values (or their absence) restored
    after: the package's knobs are read at call time, and spawned processes copy the environment."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def host_median_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds by the host's clock, after ``warmup`` calls: the
    timer of the scripts' dry runs on a CPU, where there are no CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def median_ms(fn, reps: int = 10, warmup: int = 3, flush_l2: bool = False, calls: int = 1,
              during=None) -> float:
    """Median device time of ``fn()`` in milliseconds from CUDA events, after ``warmup`` calls.

    ``flush_l2`` writes 256 MiB before each repeat so every call starts with a cold L2.
    ``calls``: calls per repeat, timed between one pair of events and divided: from the second call
    on, a call's host work (argument checks, descriptors, the launch) overlaps the previous call's
    kernels, as inside a layer's step, so a kernel that takes far longer than its launch is timed
    without its host time. With 1 (the default) the window also holds the host time of the one
    call before its first kernel starts, which for a launcher with some host work and a kernel of
    a millisecond or so is a visible share. ``during`` (optional, e.g. a
    :class:`GpuReadings`): its ``begin()`` runs just before each repeat's start event is recorded and
    its ``end()`` once the end event has completed, so it brackets every timed window.
    """
    global _L2_FLUSH
    if calls < 1:
        raise ValueError(f"calls={calls}: expected >= 1")
    if flush_l2 and _L2_FLUSH is None:
        _L2_FLUSH = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if flush_l2:
            _L2_FLUSH.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if during is not None:
            during.begin()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        if during is not None:
            during.end()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


#: NVML's clock-event reasons that mean the board's power limit holds the clock down (software power
#: cap, hardware power brake), as pynvml numbers them.
POWER_CAP_REASONS = 0x4 | 0x80
#: NVML field id of the instantaneous board power (mW), where the driver has it.
NVML_FI_DEV_POWER_INSTANT = 186


class GpuReadings:
    """What the current CUDA device's clock and power do while timed windows run, through NVML
    (``nvidia-ml-py``): between :meth:`begin` and :meth:`end` (``median_ms(during=...)``) a background
    thread samples, every ``period_s``, the SM clock (MHz), the board's instantaneous power (W; the
    driver's running average where it has no instantaneous field) and whether a power-limit reason
    holds the clock down. (The board's energy counter is not read: it moves in steps of ~0.1 s and
    more, coarser than a window of a few milliseconds.)
    The driver refreshes these readings every few tens of milliseconds, so they describe windows at
    least that long; a window of a few milliseconds may read the load before it. The samples cover
    the host's view of each window (from just before its start event to its end
    event's completion), so they include the idle GPU before a window's first kernel. NVML's calls
    release the GIL, so the thread takes little time from the timed host work. ``available`` is False (and :meth:`medians` gives Nones) where NVML cannot be used: no GPU,
    no ``pynvml``, no driver. A query the GPU does not support ends that reading only, never a row.
    Call :meth:`close` (or use it as a context manager) to stop the thread."""

    def __init__(self, period_s: float = 0.002):
        self.period_s = period_s
        self.clocks_mhz: list[int] = []
        self.power_w: list[float] = []
        self.capped: list[bool] = []
        self._nvml = self._handle = None
        self._queries = {}
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = None
        if not torch.cuda.is_available():
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            index = torch.cuda._get_nvml_device_index(torch.cuda.current_device())
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # no pynvml, no driver, an index NVML does not know: no readings
            self._nvml = self._handle = None
            return
        self._queries = {"clock": self._clock, "power": self._power, "reasons": self._reasons}

    @property
    def available(self) -> bool:
        return self._handle is not None

    # -- one NVML query each; None once the GPU has refused it --
    def _query(self, name):
        query = self._queries.get(name)
        if query is None:
            return None
        try:
            return query()
        except Exception:  # unsupported here: this reading ends, the others go on
            self._queries[name] = None
            return None

    def _clock(self):
        return self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM)

    def _power(self):
        nvml = self._nvml
        if getattr(nvml, "nvmlDeviceGetFieldValues", None) is not None:
            value = nvml.nvmlDeviceGetFieldValues(self._handle, [NVML_FI_DEV_POWER_INSTANT])[0]
            if int(getattr(value, "nvmlReturn", 1)) == 0:
                return value.value.uiVal / 1000.0
        return nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0

    def _reasons(self):
        nvml = self._nvml
        get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return bool(get(self._handle) & POWER_CAP_REASONS)

    def sample(self) -> None:
        """One sample of the clock, the power and the power-cap reasons (the thread's step)."""
        clock = self._query("clock")
        if clock is None:
            return
        power, capped = self._query("power"), self._query("reasons")
        self.clocks_mhz.append(clock)
        if power is not None:
            self.power_w.append(power)
        if capped is not None:
            self.capped.append(capped)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._on.wait(timeout=0.05) and not self._stop.is_set():
                self.sample()
                self._stop.wait(self.period_s)

    def begin(self) -> None:
        if self._handle is None:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="GpuReadings", daemon=True)
            self._thread.start()
        self._on.set()

    def end(self) -> None:
        if self._handle is None:
            return
        self._on.clear()

    def close(self) -> None:
        self._on.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def medians(self) -> dict:
        """``sm_mhz`` and ``power_w``: medians of the samples; ``power_capped``: the share of samples
        with a power-limit reason on. None for what was not read."""
        def median(values):
            return statistics.median(values) if values else None
        return dict(sm_mhz=median(self.clocks_mhz), power_w=median(self.power_w),
                    power_capped=sum(self.capped) / len(self.capped) if self.capped else None)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives NaN)."""
    out = out.detach().double()
    ref = ref.detach().double()
    denom = ref.norm().item()
    num = (out - ref).norm().item()
    return num / denom if denom > 0 else num


# Expert parallelism with W ranks emulated on one GPU (the symmetric-memory exchange's test harness).
from .comm.emulated import EmulatedGroup, emulated_ep_buffers, run_emulated_ranks  # noqa: E402,F401

#: Environment for processes that run expert parallelism over several GPUs: NVLink multicast off in
#: NCCL (NVLS), torch symmetric memory (which would otherwise map a multicast object for a buffer
#: where the driver offers one) and NVSHMEM. The exchange never uses multicast; set these explicitly
#: (before CUDA and NCCL start) wherever a multi-GPU test or benchmark starts its processes.
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
