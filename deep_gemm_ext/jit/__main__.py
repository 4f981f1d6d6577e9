"""``python -m deep_gemm_ext.jit build --arch sm_90a --all``: compile every registered config (no GPU needed).

Prints ptxas' resource report per kernel (registers, spill and shared memory bytes), for GEMM
kernels whether the PTX issues ``wgmma.mma_async``, the compile time and the start of the cache
entry's hash (``-v``: the entry's path), within about 100 columns. Exits non-zero on a compile
error or on register spills in a GEMM kernel.
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from .compiler import DEFAULT_ARCH, compile_cached
from .registry import Config, import_kernel_modules, registered_configs
from .runtime import SMEM_SYMBOL


def _build_one(config: Config, arch: str):
    try:
        return compile_cached(config.name, config.code, arch, want_ptx=config.is_gemm), None
    except Exception as exc:  # reported per kernel; the exit code carries the failure
        return None, exc


def _short_name(group: str, name: str) -> str:
    """The config's name without its group's prefix (the group heads its rows)."""
    return name[len(group) + 1:] if name.startswith(group + "_") else name


def _row(group: str, config: Config, entry, error, verbose: bool) -> tuple[list[str], list[str]]:
    name = _short_name(group, config.name)
    if error is not None:
        return [name, "ERROR"], [f"{config.name}: {error}"]
    problems = []
    usages = entry.resources()
    if not usages:
        problems.append(f"{config.name}: no ptxas report in {entry.path / 'ptxas.log'}")
        usage = None
    else:
        usage = max(usages, key=lambda u: (u.registers, u.spill_bytes))
    wgmma = ""
    if config.is_gemm:
        wgmma = "yes" if "wgmma.mma_async" in entry.ptx_path.read_text() else "NO"
        if usage is not None and usage.spill_bytes:
            problems.append(f"{config.name}: GEMM kernel spills {usage.spill_stores} B stores + "
                            f"{usage.spill_loads} B loads")
    smem = entry.exported_u32(SMEM_SYMBOL)
    dyn = "-" if smem is None else str(smem)
    # Entries are named <kernel>.<sha256>; a short prefix of the hash tells entries apart.
    key = entry.path.name.rsplit(".", 1)[-1][:_SHORT_HASH]
    cells = [name,
             str(usage.registers) if usage else "?",
             f"{usage.spill_stores}+{usage.spill_loads}" if usage else "?",
             str(usage.static_smem) if usage else "?", dyn, wgmma or "-",
             f"{entry.seconds:.1f}s" if entry.compiled else "hit", key]
    if verbose:
        cells.append(str(entry.path))
    return cells, problems


_SHORT_HASH = 8
# Sizes in bytes (spill: stores+loads; smem: static; dyn: dynamic shared memory); build: compile seconds,
# or "hit" for a cache hit; key: the start of the cache entry's hash.
_HEADER = ["config", "regs", "spill", "smem", "dyn", "wgmma", "build", "key"]


def _print_table(groups: list[tuple[str, list[list[str]]]], verbose: bool) -> None:
    """One block per group (its name, then its configs indented), columns aligned across blocks."""
    header = _HEADER + (["cache entry"] if verbose else [])
    rows = [row for _, block in groups for row in block]
    widths = [max(len(r[i]) for r in [header] + rows if i < len(r)) for i in range(len(header))]

    def line(cells):
        return ("  " + "  ".join(cell.ljust(width) for cell, width in zip(cells, widths))).rstrip()

    print(line(header))
    for group, block in groups:
        print(group)
        for row in block:
            print(line(row))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deep_gemm_ext.jit")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="compile registered kernel configurations into the JIT cache")
    build.add_argument("--arch", default=DEFAULT_ARCH, help=f"target, e.g. {DEFAULT_ARCH}")
    build.add_argument("--all", action="store_true", help="every registered configuration")
    build.add_argument("--only", action="append", default=[],
                       help="configurations whose group or name contains this text (repeatable)")
    build.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    build.add_argument("-v", "--verbose", action="store_true", help="also print each cache entry's path")
    args = parser.parse_args(argv)

    if not args.all and not args.only:
        parser.error("build: give --all or at least one --only")
    if any(not text for text in args.only):
        parser.error("build: --only '' matches every configuration; give part of a name, or --all")
    # With --all a module that fails to import is a failure; with --only it is reported only.
    import_failures = [f"{name}: {type(exc).__name__}: {exc}" for name, exc in import_kernel_modules().items()]
    for failure in import_failures:
        print(f"{'FAILED' if args.all else 'WARNING'} import {failure}", file=sys.stderr)
    selected = [(group, config) for group, configs in registered_configs().items() for config in configs
                if args.all or any(s in group or s in config.name for s in args.only)]
    if not selected:
        print("no registered configuration matches", file=sys.stderr)
        return 1

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda item: _build_one(item[1], args.arch), selected))

    groups: dict[str, list[list[str]]] = {}
    problems, failed = [], 0
    for (group, config), (entry, error) in zip(selected, results):
        cells, issues = _row(group, config, entry, error, args.verbose)
        groups.setdefault(group, []).append(cells)
        problems += issues
        failed += bool(issues)
    _print_table(list(groups.items()), args.verbose)
    for problem in problems:
        print(f"FAILED {problem}", file=sys.stderr)
    print(f"{len(selected) - failed}/{len(selected)} configurations OK for {args.arch}")
    return 1 if problems or (args.all and import_failures) else 0


if __name__ == "__main__":
    sys.exit(main())
