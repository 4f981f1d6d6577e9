"""A readers-writer lock across the processes of a pytest-xdist run, for the GPU's memory.

Ordinary tests hold it shared; a test whose fp64 reference takes tens of GB (the headline layers' sizes)
holds it exclusive, so it runs with no other test on the GPU. Two files under one directory:

- ``main``: shared by every running test, exclusive for a large one;
- ``intent``: held exclusive by a large test from before it waits for ``main`` until it ends. A test about
  to start waits for ``intent`` to be free (so a large test waiting for ``main`` is not starved by the
  tests that keep starting), and a test that ends while ``intent`` is held hands its cached GPU memory
  back to the driver (``release``) before it lets go of ``main``: the large test then finds the memory
  the other processes no longer use.

A large test's process already holds ``main`` shared (its own ordinary hold): it lets go of it before it
waits for ``intent``, or two large tests in two processes would each wait for the other. flock locks
belong to an open file, so each process keeps one open file per lock file.
"""
from __future__ import annotations

import contextlib
import fcntl
import os


class GpuTestLock:
    def __init__(self, directory: str, name: str = "deep_gemm_ext_gpu_tests"):
        self._main_path = os.path.join(directory, f"{name}.lock")
        self._intent_path = os.path.join(directory, f"{name}.intent")
        self._main = None
        self._shared = False  # this process is inside shared()

    def _main_file(self):
        if self._main is None:
            self._main = open(self._main_path, "a+")
        return self._main

    def exclusive_wanted(self) -> bool:
        """Whether a large test holds ``intent`` (waiting for ``main``, or running)."""
        with open(self._intent_path, "a+") as intent:
            try:
                fcntl.flock(intent, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(intent, fcntl.LOCK_UN)
            return False

    @contextlib.contextmanager
    def shared(self, release=None):
        """An ordinary test: waits while a large test wants or holds the GPU; ``release()`` runs at the end
        when a large test is waiting."""
        with open(self._intent_path, "a+") as intent:  # no new test while a large one waits or runs
            fcntl.flock(intent, fcntl.LOCK_SH)
            fcntl.flock(intent, fcntl.LOCK_UN)
        main = self._main_file()
        fcntl.flock(main, fcntl.LOCK_SH)
        self._shared = True
        try:
            yield
        finally:
            if release is not None and self.exclusive_wanted():
                release()
            self._shared = False
            fcntl.flock(main, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def exclusive(self, release=None):
        """A large test (inside its own ``shared`` hold, or not): runs once no other test holds ``main``;
        ``release()`` runs at its end."""
        main = self._main_file()
        fcntl.flock(main, fcntl.LOCK_UN)  # this process's own shared hold, if any
        with open(self._intent_path, "a+") as intent:
            fcntl.flock(intent, fcntl.LOCK_EX)
            try:
                fcntl.flock(main, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    if release is not None:
                        release()
                    # Back to the shared hold an enclosing ordinary hold expects to let go of, if any.
                    fcntl.flock(main, fcntl.LOCK_SH if self._shared else fcntl.LOCK_UN)
            finally:
                fcntl.flock(intent, fcntl.LOCK_UN)
