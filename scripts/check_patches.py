#!/usr/bin/env python3
"""Check that patches/ still applies to a DeepGEMM checkout (upstream drift check).

    python scripts/check_patches.py PATH/TO/DeepGEMM [--patches DIR]

Applies the series (``NNNN-*.patch`` in name order, as listed in patches/README.md) one after the
other to a copy of the checkout's committed tree (``git archive HEAD``), so each patch is checked on
top of its predecessors and the checkout itself is never touched. Prints the checkout's commit and
one line per patch; exits 1 if any patch no longer applies, 2 on bad arguments. An empty series
(no patch needed against upstream) checks nothing and exits 0.
"""
from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEFAULT_PATCHES = Path(__file__).resolve().parent.parent / "patches"


def git(*args: str, cwd: Path, data: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, input=data, capture_output=True)


def series(patch_dir: Path) -> list[Path]:
    """The patches in application order: NNNN-name.patch sorted by name."""
    return sorted(p for p in patch_dir.glob("[0-9][0-9][0-9][0-9]-*.patch") if p.is_file())


def check(checkout: Path, patches: list[Path], out=sys.stdout) -> tuple[str, list[str]]:
    """Returns ``(commit, names of patches that no longer apply)``; prints a line per patch."""
    head = git("rev-parse", "HEAD", cwd=checkout)
    if head.returncode != 0:
        raise ValueError(f"checkout={str(checkout)!r} is not a git checkout: {head.stderr.decode().strip()}")
    commit = head.stdout.decode().strip()
    print(f"checkout {checkout} at {commit}", file=out)
    archive = git("archive", "--format=tar", "HEAD", cwd=checkout)
    if archive.returncode != 0:
        raise ValueError(f"git archive failed in {checkout}: {archive.stderr.decode().strip()}")
    drifted = []
    with tempfile.TemporaryDirectory(prefix="check_patches_") as tmp:
        tree = Path(tmp)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            # The "data" filter refuses links and paths outside the tree (Python >= 3.10.12).
            tar.extractall(tree, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        git("init", "-q", cwd=tree)  # a repository of its own, so git apply never looks further up
        for patch in patches:
            result = git("apply", "--check", str(patch.resolve()), cwd=tree)
            if result.returncode == 0:
                git("apply", str(patch.resolve()), cwd=tree)
                print(f"ok     {patch.name}", file=out)
            else:
                reason = result.stderr.decode().strip().splitlines()
                drifted.append(patch.name)
                print(f"DRIFT  {patch.name}: {'; '.join(reason[:3])}", file=out)
    return commit, drifted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a DeepGEMM git checkout")
    parser.add_argument("--patches", type=Path, default=DEFAULT_PATCHES, help="patch directory")
    args = parser.parse_args(argv)
    if not args.patches.is_dir():
        print(f"--patches={str(args.patches)!r} is not a directory", file=sys.stderr)
        return 2
    patches = series(args.patches)
    try:
        commit, drifted = check(args.checkout, patches)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if drifted:
        print(f"{len(drifted)} of {len(patches)} patches no longer apply to {commit}: {', '.join(drifted)}")
        return 1
    print(f"all {len(patches)} patches apply to {commit}" if patches else
          f"the series in {args.patches} is empty: nothing to apply to {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
