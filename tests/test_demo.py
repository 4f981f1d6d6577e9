"""``python -m deep_gemm_ext.demo``, README's first command, prints the same numbers on every run
(the README says results are deterministic): it seeds everything it draws, dy included."""
import sys

import torch

from deep_gemm_ext import demo


def run_demo(monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", ["demo", "--tokens", "64"])
    torch.manual_seed(torch.seed())  # whatever state the process is in
    demo.main()
    return capsys.readouterr().out


def test_demo_prints_the_same_norms_on_every_run(monkeypatch, capsys):
    first, second = run_demo(monkeypatch, capsys), run_demo(monkeypatch, capsys)
    assert "d l1_weights" in first and "forward error vs fp64 reference" in first
    assert first == second
