"""scripts/check_patches.py on a small synthetic repository: a patch that applies, one that drifts."""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_patches.py"
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


def diff_for(repo: Path, path: str, old_text: str, new_text: str) -> str:
    """The unified diff from ``old_text`` to ``new_text`` of ``path``; the checkout is restored after."""
    file = repo / path
    file.write_text(old_text)
    git(repo, "add", path)
    file.write_text(new_text)
    diff = git(repo, "diff", "--", path)  # working tree against the index
    git(repo, "reset", "-q", "--", path)
    git(repo, "checkout", "--", path)
    return diff


@pytest.fixture
def upstream(tmp_path):
    repo = tmp_path / "upstream"
    (repo / "csrc").mkdir(parents=True)
    (repo / "csrc" / "parser.hpp").write_text("".join(f"line {i}\n" for i in range(20)))
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "upstream")
    return repo


def load_module():
    spec = importlib.util.spec_from_file_location("check_patches", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_series(tmp_path, upstream):
    path = "csrc/parser.hpp"
    text = (upstream / path).read_text()
    first = text.replace("line 3\n", "line 3 patched\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    # 0001 applies; 0002 applies only on top of 0001 (the check is cumulative); 0003 expects
    # context that upstream no longer has (drift).
    (patches / "0001-first.patch").write_text("Note: what, why, upstream commit.\n\n" + diff_for(upstream, path, text, first))
    (patches / "0002-on-top.patch").write_text(
        diff_for(upstream, path, first, first.replace("line 3 patched\n", "line 3 twice\n")))
    drift = diff_for(upstream, path, text, text.replace("line 10\n", "line 10 changed\n"))
    (patches / "0003-drifted.patch").write_text(drift.replace(" line 9\n", " line 9 (as it used to be)\n"))
    return patches


def test_reports_commit_and_drift(tmp_path, upstream):
    patches = write_series(tmp_path, upstream)
    before = (upstream / "csrc" / "parser.hpp").read_text()
    run = subprocess.run([sys.executable, str(SCRIPT), str(upstream), "--patches", str(patches)],
                         capture_output=True, text=True)
    commit = git(upstream, "rev-parse", "HEAD").strip()
    assert run.returncode == 1, run.stdout + run.stderr
    assert commit in run.stdout
    assert "ok     0001-first.patch" in run.stdout
    assert "ok     0002-on-top.patch" in run.stdout  # only applies after 0001
    assert "DRIFT  0003-drifted.patch" in run.stdout
    assert (upstream / "csrc" / "parser.hpp").read_text() == before  # checkout untouched
    assert git(upstream, "status", "--porcelain") == ""


def test_clean_series_exits_zero(tmp_path, upstream):
    patches = write_series(tmp_path, upstream)
    (patches / "0003-drifted.patch").unlink()
    module = load_module()
    assert module.main([str(upstream), "--patches", str(patches)]) == 0
    assert [p.name for p in module.series(patches)] == ["0001-first.patch", "0002-on-top.patch"]


def test_empty_series_exits_zero(tmp_path, upstream, capsys):
    (tmp_path / "empty").mkdir()
    assert load_module().main([str(upstream), "--patches", str(tmp_path / "empty")]) == 0
    assert git(upstream, "rev-parse", "HEAD").strip() in capsys.readouterr().out


def test_bad_arguments_exit_two(tmp_path, upstream, capsys):
    module = load_module()
    assert module.main([str(upstream), "--patches", str(tmp_path / "missing")]) == 2
    not_a_repo = tmp_path / "plain"
    not_a_repo.mkdir()
    patches = write_series(tmp_path, upstream)
    assert module.main([str(not_a_repo), "--patches", str(patches)]) == 2
    assert "not a git checkout" in capsys.readouterr().err
