"""The readers-writer lock that lets pytest-xdist workers share one GPU's memory (tests/gpu_lock.py), checked
with processes on the CPU: a large test waits for the running ordinary tests and runs alone, those tests
hand their memory back when one waits, no ordinary test starts while it waits or runs, and two large tests
in two processes that each hold the lock shared do not wait for each other forever."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from gpu_lock import GpuTestLock

_CTX = mp.get_context("fork")
_TIMEOUT = 30.0


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(time.monotonic()))


def _stamp(path: str) -> float:
    with open(path) as f:
        return float(f.read())


def _wait_for(path: str) -> None:
    end = time.monotonic() + _TIMEOUT
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(path)
        time.sleep(0.01)


def _ordinary(directory: str, hold_s: float, marks: str) -> None:
    lock = GpuTestLock(directory)
    with lock.shared(release=lambda: _touch(marks + ".released")):
        _touch(marks + ".started")
        time.sleep(hold_s)
        _touch(marks + ".ended")


def _large_inside_shared(directory: str, hold_s: float, marks: str) -> None:
    lock = GpuTestLock(directory)
    with lock.shared():
        with lock.exclusive():
            _touch(marks + ".started")
            time.sleep(hold_s)
            _touch(marks + ".ended")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_large_test_waits_for_running_tests_and_runs_alone(tmp_path):
    d, m = str(tmp_path), str(tmp_path / "a")
    ordinary = _CTX.Process(target=_ordinary, args=(d, 0.6, m))
    ordinary.start()
    _wait_for(m + ".started")
    lock = GpuTestLock(d)
    released = []
    with lock.shared():
        with lock.exclusive(release=lambda: released.append(1)):
            got = time.monotonic()
            assert os.path.exists(m + ".ended"), "the large test started while another test ran"
            assert os.path.exists(m + ".released"), "the running test kept its memory while a large one waited"
            # A test that starts now waits until the large one ends.
            late = _CTX.Process(target=_ordinary, args=(d, 0.0, str(tmp_path / "b")))
            late.start()
            time.sleep(0.5)
            assert not os.path.exists(str(tmp_path / "b.started")), "a test started beside the large one"
            left = time.monotonic()
        assert released == [1]
    late.join(_TIMEOUT)
    ordinary.join(_TIMEOUT)
    assert late.exitcode == 0 and ordinary.exitcode == 0
    assert _stamp(str(tmp_path / "b.started")) >= left
    assert got >= _stamp(m + ".ended")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_two_large_tests_do_not_deadlock(tmp_path):
    d = str(tmp_path)
    procs = [_CTX.Process(target=_large_inside_shared, args=(d, 0.3, str(tmp_path / name))) for name in "xy"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(_TIMEOUT)
    assert [p.exitcode for p in procs] == [0, 0], "a large test never got the GPU"
    spans = sorted((_stamp(str(tmp_path / f"{n}.started")), _stamp(str(tmp_path / f"{n}.ended"))) for n in "xy")
    assert spans[0][1] <= spans[1][0], f"the two large tests overlapped: {spans}"


def test_no_release_when_no_large_test_waits(tmp_path):
    lock = GpuTestLock(str(tmp_path))
    released = []
    with lock.shared(release=lambda: released.append(1)):
        assert not lock.exclusive_wanted()
    assert released == []
    with lock.exclusive():  # without an enclosing shared hold: nothing is left locked after it
        assert lock.exclusive_wanted()
    assert not lock.exclusive_wanted()
    other = GpuTestLock(str(tmp_path))
    with other.exclusive():
        pass
