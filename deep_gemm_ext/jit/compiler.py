"""Compile rendered CUDA sources into cubins, cached on disk by content.

A cache entry is a directory ``<cache>/kernels/<name>.<sha256>/`` holding ``kernel.cu``,
``kernel.cubin``, ``ptxas.log`` and ``command.txt`` (plus ``kernel.ptx`` / ``kernel.sass`` when
asked for). It is built in ``<cache>/tmp/`` and published with one ``os.rename``, so readers
only ever see complete entries and concurrent builders (EP ranks) race harmlessly: the loser
deletes its copy and uses the winner's.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from .. import _env

logger = logging.getLogger("deep_gemm_ext.jit")

DEFAULT_ARCH = "sm_90a"
#: A first compile slower than this is reported through the logger.
SLOW_COMPILE_SECONDS = 1.0

_ARCH_RE = re.compile(r"^sm_(\d+[a-z]?)$")
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.MULTILINE)
_NAME_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]+")


def kernels_dir() -> Path:
    """The CUDA template tree: ``deep_gemm_ext/_kernels`` when installed, ``<repo>/kernels`` in a checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_kernels", package.parent / "kernels"):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(f"CUDA kernel templates not found: neither {package / '_kernels'} nor "
                       f"{package.parent / 'kernels'} is a directory")


def include_dirs() -> list[Path]:
    return [kernels_dir()]


def gencode_flag(arch: str) -> str:
    match = _ARCH_RE.match(arch)
    if match is None:
        raise ValueError(f"arch={arch!r}: expected a real architecture such as 'sm_90a'")
    return f"-gencode=arch=compute_{match.group(1)},code=sm_{match.group(1)}"


def included_headers(code: str, root: Path) -> dict[str, bytes]:
    """Every header under ``root`` that ``code`` includes, directly or transitively, by relative path.

    Headers outside ``root`` (CUDA, libc++) are keyed by the compiler / package version
    instead. Conditional includes are followed too: over-keying is harmless, under-keying is not.
    """
    root = root.resolve()
    found: dict[str, bytes] = {}
    pending: list[tuple[str, Path | None]] = [(code, None)]
    while pending:
        text, here = pending.pop()
        for quote, name in _INCLUDE_RE.findall(text):
            candidates = ([here / name] if quote == '"' and here is not None else []) + [root / name]
            for candidate in candidates:
                if not candidate.is_file():
                    continue
                resolved = candidate.resolve()
                if resolved.is_relative_to(root):
                    rel = resolved.relative_to(root).as_posix()
                    if rel not in found:
                        found[rel] = resolved.read_bytes()
                        pending.append((found[rel].decode("utf-8", errors="replace"), resolved.parent))
                break
    return found


def cache_key(code: str, flags: list[str], compiler_identity: str, arch: str, root: Path | None = None) -> str:
    """sha256 over the source, the content of every included project header, flags, compiler and arch."""
    digest = hashlib.sha256()

    def part(label: str, data: bytes) -> None:
        digest.update(f"{label}:{len(data)}:".encode())
        digest.update(data)

    part("code", code.encode())
    for rel, content in sorted(included_headers(code, root or kernels_dir()).items()):
        part("header " + rel, content)
    part("flags", "\0".join(flags).encode())
    part("compiler", compiler_identity.encode())
    part("arch", arch.encode())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# ptxas resource reports


@dataclasses.dataclass(frozen=True)
class ResourceUsage:
    """What ptxas reports for one entry function."""

    function: str
    registers: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    static_smem: int = 0

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> list[ResourceUsage]:
    """Resource usage per entry function from ``ptxas -v`` output (nvcc or NVRTC)."""
    usages: list[ResourceUsage] = []
    current: dict | None = None
    for line in log.splitlines():
        if match := _ENTRY_RE.search(line):
            current = {"function": match.group(1)}
            usages.append(ResourceUsage(**current))
            continue
        if current is None:
            continue
        if match := _FRAME_RE.search(line):
            current.update(stack_frame=int(match.group(1)), spill_stores=int(match.group(2)),
                           spill_loads=int(match.group(3)))
        if match := _REGS_RE.search(line):
            current["registers"] = int(match.group(1))
            if smem := _SMEM_RE.search(line):
                current["static_smem"] = int(smem.group(1))
        usages[-1] = ResourceUsage(**current)
    return usages


# ---------------------------------------------------------------------------------------------
# compilers


def _log_debug(message: str, *args) -> None:
    """DGE_JIT_DEBUG messages: visible even when the application configured no logging."""
    if not _env.jit_debug():
        return
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[deep_gemm_ext.jit] %(message)s"))
        logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.info(message, *args)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class NvccCompiler:
    """``nvcc -cubin`` in a scratch directory (so no file there can shadow a system header)."""

    kind = "nvcc"

    def __init__(self, path: Path):
        self.path = path
        try:
            result = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
        except OSError as exc:
            raise RuntimeError(f"nvcc at {path} cannot be run: {exc}") from exc
        if result.returncode != 0:
            raise RuntimeError(f"`{path} --version` failed (exit {result.returncode}): {result.stderr.strip()}")
        # The whole banner: release and build number both change code generation.
        self.identity = "nvcc:" + result.stdout.strip()

    def key_flags(self, arch: str) -> list[str]:
        flags = ["-std=c++20", "-O3", "--expt-relaxed-constexpr", gencode_flag(arch), "--ptxas-options=-v"]
        if _env.jit_with_lineinfo():
            flags.append("-lineinfo")
        return flags

    def _command(self, arch: str, output_kind: str, output: str) -> list[str]:
        flags = self.key_flags(arch)
        if output_kind == "-ptx":
            flags.remove("--ptxas-options=-v")
        command = [str(self.path), "kernel.cu", output_kind, "-o", output, *flags]
        for include in include_dirs():
            command.append(f"-I{include}")
        return command

    def compile(self, workdir: Path, arch: str, want_ptx: bool) -> str:
        """Compile ``workdir/kernel.cu`` into ``kernel.cubin`` (and ``kernel.ptx``); returns the ptxas log."""
        command = self._command(arch, "-cubin", "kernel.cubin")
        if _env.jit_debug():
            (workdir / "intermediates").mkdir(exist_ok=True)
            command += ["--keep", f"--keep-dir={workdir / 'intermediates'}"]
        (workdir / "command.txt").write_text(shlex.join(command) + "\n")
        _log_debug("running %s", shlex.join(command))
        result = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
        log = result.stdout + result.stderr
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed (exit {result.returncode}) on {workdir / 'kernel.cu'}\n"
                               f"command: {shlex.join(command)}\n{log[-20000:]}")
        if want_ptx:
            self.compile_ptx(workdir, arch)
        return log

    def compile_ptx(self, workdir: Path, arch: str) -> None:
        name = f".kernel.ptx.{uuid.uuid4().hex}"
        command = self._command(arch, "-ptx", name)
        result = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc -ptx failed (exit {result.returncode}) on {workdir / 'kernel.cu'}\n"
                               f"command: {shlex.join(command)}\n{(result.stdout + result.stderr)[-20000:]}")
        os.replace(workdir / name, workdir / "kernel.ptx")

    def cuobjdump(self) -> Path | None:
        sibling = self.path.resolve().parent / "cuobjdump"
        if sibling.is_file():
            return sibling
        found = shutil.which("cuobjdump")
        return Path(found) if found else None


class NvrtcCompiler:
    """NVRTC through cuda-python: for machines with the driver and libnvrtc but no toolkit."""

    kind = "nvrtc"

    def __init__(self):
        try:
            from cuda.bindings import nvrtc
            self._nvrtc = nvrtc
            err, major, minor = nvrtc.nvrtcVersion()
        except Exception as exc:  # ImportError, or the library loader's own not-found error
            raise RuntimeError(f"NVRTC is not usable: libnvrtc could not be loaded through cuda-python "
                               f"({type(exc).__name__}: {exc})") from exc
        self._check(err, "nvrtcVersion")
        self.identity = f"nvrtc:{major}.{minor}"

    def _check(self, err, what: str, program=None) -> None:
        if err == self._nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return
        log = self._program_log(program) if program is not None else ""
        raise RuntimeError(f"{what} failed: {self._nvrtc.nvrtcGetErrorString(err)[1].decode()}\n{log[-20000:]}")

    def _program_log(self, program) -> str:
        err, size = self._nvrtc.nvrtcGetProgramLogSize(program)
        buffer = b" " * size
        self._nvrtc.nvrtcGetProgramLog(program, buffer)
        return buffer.rstrip(b"\0").decode(errors="replace")

    def key_flags(self, arch: str) -> list[str]:
        gencode_flag(arch)  # validates arch
        # NVRTC has no --expt-relaxed-constexpr: constexpr functions are callable from device code there.
        flags = ["-std=c++20", f"--gpu-architecture={arch}", "--ptxas-options=-v"]
        if _env.jit_with_lineinfo():
            flags.append("--generate-line-info")
        return flags

    @staticmethod
    def _cuda_include_dirs() -> list[Path]:
        dirs = []
        home = _env.cuda_home()
        for candidate in ([home / "include"] if home else []) + [Path("/usr/local/cuda/include")]:
            if (candidate / "cuda_bf16.h").is_file():
                dirs.append(candidate)
        try:
            from cuda import pathfinder
            found = pathfinder.find_nvidia_header_directory("cudart")
            if found:
                dirs.append(Path(found))
        except Exception:  # optional helper: older cuda-pathfinder lacks it
            pass
        return dirs

    def _run(self, source: str, options: list[str]):
        nvrtc = self._nvrtc
        err, program = nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], [])
        self._check(err, "nvrtcCreateProgram")
        encoded = [option.encode() for option in options]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        self._check(err, "nvrtcCompileProgram", program)
        return program

    def compile(self, workdir: Path, arch: str, want_ptx: bool) -> str:
        nvrtc = self._nvrtc
        source = (workdir / "kernel.cu").read_text()
        includes = [f"-I{d}" for d in include_dirs() + self._cuda_include_dirs()]
        options = self.key_flags(arch) + includes
        (workdir / "command.txt").write_text("nvrtc " + shlex.join(options) + "\n")
        _log_debug("nvrtc %s", shlex.join(options))
        program = self._run(source, options)
        log = self._program_log(program)
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        self._check(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        self._check(nvrtc.nvrtcGetCUBIN(program, cubin)[0], "nvrtcGetCUBIN")
        (workdir / "kernel.cubin").write_bytes(cubin)
        nvrtc.nvrtcDestroyProgram(program)
        if want_ptx:
            self.compile_ptx(workdir, arch)
        return log

    def compile_ptx(self, workdir: Path, arch: str) -> None:
        # A real-arch compile yields SASS only: ask for the virtual arch to get the PTX.
        options = [f.replace("--gpu-architecture=sm_", "--gpu-architecture=compute_") for f in self.key_flags(arch)
                   if f != "--ptxas-options=-v"]
        options += [f"-I{d}" for d in include_dirs() + self._cuda_include_dirs()]
        program = self._run((workdir / "kernel.cu").read_text(), options)
        err, size = self._nvrtc.nvrtcGetPTXSize(program)
        self._check(err, "nvrtcGetPTXSize")
        ptx = b" " * size
        self._check(self._nvrtc.nvrtcGetPTX(program, ptx)[0], "nvrtcGetPTX")
        self._nvrtc.nvrtcDestroyProgram(program)
        _write_atomic(workdir / "kernel.ptx", ptx.rstrip(b"\0"))

    def cuobjdump(self) -> Path | None:
        home = _env.cuda_home()
        if home and (home / "bin" / "cuobjdump").is_file():
            return home / "bin" / "cuobjdump"
        found = shutil.which("cuobjdump")
        return Path(found) if found else None


def find_nvcc() -> Path | None:
    """DGE_JIT_NVCC_COMPILER, then $CUDA_HOME/bin/nvcc, then PATH, then /usr/local/cuda."""
    explicit = _env.jit_nvcc_compiler()
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RuntimeError(f"DGE_JIT_NVCC_COMPILER={explicit!r}: not an executable file")
        return path
    home = _env.cuda_home()
    if home is not None and (home / "bin" / "nvcc").is_file():
        return home / "bin" / "nvcc"
    on_path = shutil.which("nvcc")
    if on_path:
        return Path(on_path)
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.is_file() else None


@functools.lru_cache(maxsize=None)
def _nvcc_compiler(path: str) -> NvccCompiler:
    return NvccCompiler(Path(path))


@functools.lru_cache(maxsize=None)
def _nvrtc_compiler() -> NvrtcCompiler:
    return NvrtcCompiler()


def select_compiler() -> NvccCompiler | NvrtcCompiler:
    """nvcc unless DGE_JIT_USE_NVRTC is set or no nvcc exists; NVRTC then."""
    if _env.jit_use_nvrtc():
        try:
            return _nvrtc_compiler()
        except RuntimeError as exc:
            raise RuntimeError(f"DGE_JIT_USE_NVRTC=1 but {exc}") from exc
    nvcc = find_nvcc()
    if nvcc is not None:
        return _nvcc_compiler(str(nvcc))
    try:
        return _nvrtc_compiler()
    except RuntimeError as exc:
        raise RuntimeError("no CUDA compiler found: nvcc is not at DGE_JIT_NVCC_COMPILER, $CUDA_HOME/bin, on PATH "
                           f"or in /usr/local/cuda/bin, and {exc}") from exc


# ---------------------------------------------------------------------------------------------
# the disk cache


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    name: str
    path: Path
    compiled: bool  # this call compiled it (False: found on disk, maybe built by another process)
    seconds: float

    @property
    def cubin_path(self) -> Path:
        return self.path / "kernel.cubin"

    @property
    def ptx_path(self) -> Path:
        return self.path / "kernel.ptx"

    def ptxas_log(self) -> str:
        log = self.path / "ptxas.log"
        return log.read_text() if log.is_file() else ""

    def resources(self) -> list[ResourceUsage]:
        return parse_ptxas_log(self.ptxas_log())

    def exported_u32(self, symbol: str) -> int | None:
        """The initial value of a 4-byte ``extern "C" __constant__`` symbol of the cubin (a value
        the kernel source computes for the host, e.g. its dynamic smem bytes), or None."""
        return cubin_symbol_u32(self.cubin_path.read_bytes(), symbol)


def cubin_symbol_u32(elf: bytes, symbol: str) -> int | None:
    """Little-endian uint32 at ``symbol`` in a 64-bit ELF cubin (from its symbol table and the
    initialised section that holds it), or None when the cubin has no such symbol."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError(f"cubin_symbol_u32: not a 64-bit ELF file (starts {elf[:5]!r})")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count = struct.unpack_from("<HH", elf, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize) per section header
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    wanted = symbol.encode()
    for _, kind, _, _, offset, size, link, _, _, sym_size in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        names = sections[link][4]
        for at in range(offset, offset + size, sym_size):
            name, _, _, section, value, length = struct.unpack_from("<IBBHQQ", elf, at)
            end = elf.index(b"\0", names + name)
            if elf[names + name:end] == wanted and length == 4 and 0 < section < count:
                return struct.unpack_from("<I", elf, sections[section][4] + value)[0]
    return None


_key_locks: dict[str, threading.Lock] = {}
_key_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _key_locks_guard:
        return _key_locks.setdefault(key, threading.Lock())


def _add_dumps(entry_dir: Path, compiler, arch: str) -> None:
    """Honour DGE_JIT_DUMP_PTX / DGE_JIT_DUMP_SASS on entries built without them."""
    if _env.jit_dump_ptx() and not (entry_dir / "kernel.ptx").is_file():
        compiler.compile_ptx(entry_dir, arch)
    if _env.jit_dump_sass() and not (entry_dir / "kernel.sass").is_file():
        tool = compiler.cuobjdump()
        if tool is None:
            logger.warning("DGE_JIT_DUMP_SASS=1 but cuobjdump was not found; %s has no SASS dump", entry_dir)
            return
        result = subprocess.run([str(tool), "--dump-sass", str(entry_dir / "kernel.cubin")],
                                capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("cuobjdump failed on %s: %s", entry_dir / "kernel.cubin", result.stderr.strip())
            return
        _write_atomic(entry_dir / "kernel.sass", result.stdout.encode())


def compile_cached(name: str, code: str, arch: str = DEFAULT_ARCH, *, want_ptx: bool = False) -> CacheEntry:
    """The cache entry of ``code``: found on disk, or compiled and published atomically."""
    compiler = select_compiler()
    key = cache_key(code, compiler.key_flags(arch), compiler.identity, arch)
    safe_name = _NAME_UNSAFE_RE.sub("_", name)[:96] or "kernel"
    cache = _env.jit_cache_dir()
    entry_dir = cache / "kernels" / f"{safe_name}.{key}"
    want_ptx = want_ptx or _env.jit_dump_ptx()

    with _lock_for(key):
        if (entry_dir / "kernel.cubin").is_file():
            _log_debug("cache hit %s: %s", name, entry_dir)
            if want_ptx and not (entry_dir / "kernel.ptx").is_file():
                compiler.compile_ptx(entry_dir, arch)
            _add_dumps(entry_dir, compiler, arch)
            return CacheEntry(name, entry_dir, compiled=False, seconds=0.0)

        workdir = cache / "tmp" / f"{safe_name}.{uuid.uuid4().hex}"
        workdir.mkdir(parents=True)
        start = time.perf_counter()
        try:
            (workdir / "kernel.cu").write_text(code)
            log = compiler.compile(workdir, arch, want_ptx)
            (workdir / "ptxas.log").write_text(log)
            _add_dumps(workdir, compiler, arch)
            with open(workdir / "kernel.cubin", "rb") as cubin:
                os.fsync(cubin.fileno())  # visible to other nodes of a shared filesystem before the rename
        except BaseException:
            if not _env.jit_debug():
                shutil.rmtree(workdir, ignore_errors=True)
            raise
        seconds = time.perf_counter() - start

        entry_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(workdir, entry_dir)
            compiled = True
        except OSError:
            # Another process published the same key first: its entry is equivalent, use it.
            if not (entry_dir / "kernel.cubin").is_file():
                raise
            shutil.rmtree(workdir, ignore_errors=True)
            compiled = False
        _log_debug("compiled %s in %.2f s: %s", name, seconds, entry_dir)
        if compiled and seconds > SLOW_COMPILE_SECONDS:
            logger.info("compiled %s in %.1f s", name, seconds)
        if _env.jit_ptxas_verbose():
            sys.stderr.write(f"[deep_gemm_ext.jit] ptxas report for {name}:\n{log.strip()}\n")
        return CacheEntry(name, entry_dir, compiled=compiled, seconds=seconds)
