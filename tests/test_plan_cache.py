"""The plan's resolution is cached per arguments, valid while the environment variables it read read the
same (deep_gemm_ext.plan._resolve_encoded, deep_gemm_ext._env.recording)."""
import os

import pytest
import torch

from deep_gemm_ext import _env, plan

_ARGS = ("cpu", -1, torch.bfloat16, True, True, "auto", "bf16", "local")


def _resolve(*args):
    return plan.Plan.decode(plan._resolve_encoded(*(args or _ARGS)))


def test_recording_notes_each_variable_read_with_its_raw_value(monkeypatch):
    monkeypatch.setenv("DGE_FP8_WGRAD", "bf16")
    monkeypatch.delenv("DGE_CHECK_IDS", raising=False)
    with _env.recording() as reads:
        assert _env.fp8_wgrad() == "bf16"
        assert _env.check_ids() is None
        with _env.recording() as inner:  # nested: the outer recording sees the inner reads too
            _env.fused_combine()
    assert reads["DGE_FP8_WGRAD"] == "bf16" and reads["DGE_CHECK_IDS"] is None
    assert "DGE_FUSED_COMBINE" in reads and set(inner) == {"DGE_FUSED_COMBINE"}
    assert _env.unchanged(tuple(reads.items()))
    monkeypatch.setenv("DGE_FP8_WGRAD", "fp8")
    assert not _env.unchanged(tuple(reads.items()))
    monkeypatch.setenv("DGE_FP8_WGRAD", "bf16")
    monkeypatch.setenv("DGE_CHECK_IDS", "1")  # set where it was unset
    assert not _env.unchanged(tuple(reads.items()))
    assert getattr(_env._local, "recorded", None) is None  # outside a recording, reads note nothing


def test_recordings_of_two_threads_stay_apart(monkeypatch):
    import threading

    monkeypatch.setenv("DGE_FP8_WGRAD", "fp8")
    inside, go_on = threading.Event(), threading.Event()
    other = {}

    def thread_body():
        with _env.recording() as reads:
            inside.set()
            go_on.wait(10)
            _env.check_ids()
        other.update(reads)

    t = threading.Thread(target=thread_body)
    t.start()
    inside.wait(10)
    with _env.recording() as mine:
        _env.fp8_wgrad()
        go_on.set()
        t.join()
    assert set(mine) == {"DGE_FP8_WGRAD"} and set(other) == {"DGE_CHECK_IDS"}
    assert getattr(_env._local, "recorded", None) is None


def test_a_changed_variable_resolves_anew(monkeypatch):
    monkeypatch.setenv("DGE_FP8_WGRAD", "fp8")
    monkeypatch.setenv("DGE_CHECK_IDS", "0")
    monkeypatch.setenv("DGE_FUSED_COMBINE", "1")
    first = _resolve()
    assert _resolve() == first and first.fp8_wgrad == "fp8" and not first.check_ids
    monkeypatch.setenv("DGE_FP8_WGRAD", "bf16")
    assert _resolve().fp8_wgrad == "bf16"
    monkeypatch.setenv("DGE_CHECK_IDS", "1")
    assert _resolve().check_ids
    monkeypatch.delenv("DGE_CHECK_IDS")
    assert _resolve().check_ids  # unset: the host check on CPU tensors (a "cpu" plan)
    monkeypatch.setenv("DGE_FUSED_COMBINE", "0")
    assert not _resolve().combine_epilogue
    monkeypatch.setenv("DGE_FP8_WGRAD", "fp8")
    assert _resolve().fp8_wgrad == "fp8"


def test_a_bad_value_raises_every_call(monkeypatch):
    _resolve()
    monkeypatch.setenv("DGE_FP8_WGRAD", "sideways")
    for _ in range(2):
        with pytest.raises(ValueError, match="DGE_FP8_WGRAD"):
            _resolve()
    monkeypatch.delenv("DGE_FP8_WGRAD")
    assert _resolve().fp8_wgrad == "fp8"  # unset: fp8 weight gradients off our SM90 kernels


def test_a_replaced_provider_choice_resolves_anew(monkeypatch):
    base = _resolve()
    monkeypatch.setattr(plan, "choose_provider", lambda device, dtype, facts, backend, recipe: "grouped_mm")
    assert _resolve().provider == "grouped_mm"
    monkeypatch.undo()
    assert _resolve() == base


def test_arguments_are_part_of_the_key():
    assert _resolve(*_ARGS[:6], "fp8", "local").recipe == "fp8"
    assert _resolve(*_ARGS[:6], "bf16", "local").recipe == "bf16"
    assert _resolve("cpu", -1, torch.float32, *_ARGS[3:]).compute_dtype == "float32"


@pytest.mark.parametrize("environ", ["os", "replaced"])
def test_unchanged_reads_what_os_environ_reads(monkeypatch, environ):
    """_env.unchanged (the per-call check of a cached call) agrees with os.environ.get on set, unset,
    empty and changed variables, through CPython's encoded mapping and through a replaced os.environ."""
    if environ == "replaced":
        monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in ("DGE_TEST_A", "DGE_TEST_B", "DGE_TEST_C"):
        os.environ.pop(name, None)
    os.environ["DGE_TEST_A"] = "1"
    os.environ["DGE_TEST_B"] = ""
    reads = (("DGE_TEST_A", "1"), ("DGE_TEST_B", ""), ("DGE_TEST_C", None))
    try:
        assert _env.unchanged(reads) and _env.unchanged(())
        for name, value in (("DGE_TEST_A", "0"), ("DGE_TEST_B", "x"), ("DGE_TEST_C", ""), ("DGE_TEST_C", "1")):
            old = os.environ.get(name)
            os.environ[name] = value
            assert not _env.unchanged(reads), (name, value)
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old
            assert _env.unchanged(reads), (name, old)
        del os.environ["DGE_TEST_A"]
        assert not _env.unchanged(reads)
    finally:
        for name in ("DGE_TEST_A", "DGE_TEST_B", "DGE_TEST_C"):
            os.environ.pop(name, None)
