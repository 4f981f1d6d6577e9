"""Typed kernel-argument lists: one declaration renders a template's argument types and checks and
packs the host launch tuple, so the two cannot drift apart.

    EPI = (KernelArg("out", "__nv_bfloat16*"), KernelArg("num_rows", "uint32_t"))
    render_types(EPI)                              -> "__nv_bfloat16*, uint32_t"
    pack_args("kernel", EPI, out=t, num_rows=5)    -> (t, c_uint32(5))
"""
from __future__ import annotations

import ctypes
import struct
from typing import NamedTuple

import torch

from .tma import TensorMap

#: Pointer types and the tensor dtype each one takes.
_POINTER_DTYPES = {
    "const int*": torch.int32, "int*": torch.int32,
    "const float*": torch.float32, "float*": torch.float32,
    "const __nv_bfloat16*": torch.bfloat16, "__nv_bfloat16*": torch.bfloat16,
    # e4m3 data, written by the kernels as raw bytes (no cuda_fp8.h needed).
    "unsigned char*": torch.float8_e4m3fn,
    "__half*": torch.float16, "double*": torch.float64,
    "const long long*": torch.int64, "long long*": torch.int64,
    # Byte masks (a bool tensor viewed as uint8).
    "const unsigned char*": torch.uint8,
    # Raw bytes of any dtype (rows copied as 16-byte vectors, weights as their bits).
    "const void*": None, "void*": None,
}
# "unsigned int" is uint32_t for sources that include no <cstdint> (NVRTC ships no C++ library).
_SCALARS = {"uint32_t": ctypes.c_uint32, "unsigned int": ctypes.c_uint32, "float": ctypes.c_float,
            "int": ctypes.c_int32, "unsigned long long": ctypes.c_uint64}
# (low, high, how an error message writes the range)
_INT_RANGES = {ctypes.c_uint32: (0, 2 ** 32, "[0, 2**32)"), ctypes.c_int32: (-2 ** 31, 2 ** 31, "[-2**31, 2**31)"),
               ctypes.c_uint64: (0, 2 ** 64, "[0, 2**64)")}
CTYPES = (*_POINTER_DTYPES, *_SCALARS, "CUtensorMap")


class KernelArg(NamedTuple):
    """One kernel parameter: its name (the launch passes it by name), its C++ type, and whether a
    pointer may be None (passed as a null pointer, for arguments the instantiation never reads)."""
    name: str
    ctype: str
    nullable: bool = False

    def check(self) -> "KernelArg":
        if self.ctype not in CTYPES:
            raise ValueError(f"KernelArg {self.name!r}: ctype={self.ctype!r}, expected one of {CTYPES}")
        if self.nullable and self.ctype not in _POINTER_DTYPES:
            raise ValueError(f"KernelArg {self.name!r}: only pointers can be nullable, not {self.ctype!r}")
        return self


def render_types(args: tuple[KernelArg, ...]) -> str:
    """The C++ parameter types, comma-separated (for a template's argument pack)."""
    return ", ".join(arg.check().ctype for arg in args)


def _where(kernel: str, arg: KernelArg) -> str:
    return f"{kernel}: kernel argument {arg.name!r} ({arg.ctype})"


def _pack_one(kernel: str, arg: KernelArg, value):
    if arg.ctype in _POINTER_DTYPES:
        if value is None and arg.nullable:
            return ctypes.c_uint64(0)
        dtype = _POINTER_DTYPES[arg.ctype]
        if dtype is None and isinstance(value, torch.Tensor):
            return value
        if not isinstance(value, torch.Tensor) or value.dtype != dtype:
            got = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            want = "tensor" if dtype is None else f"{dtype} tensor"
            raise TypeError(f"{_where(kernel, arg)}: expected a {want}{' or None' if arg.nullable else ''}, got {got}")
        return value
    if arg.ctype == "CUtensorMap":
        if not isinstance(value, TensorMap):
            raise TypeError(f"{_where(kernel, arg)}: expected a jit.TensorMap, got {type(value).__name__}")
        return value
    kind = _SCALARS.get(arg.ctype)
    if kind in _INT_RANGES:
        low, high, text = _INT_RANGES[kind]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
            raise TypeError(f"{_where(kernel, arg)}: expected an int in {text}, got {value!r}")
        return kind(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_where(kernel, arg)}: expected a float, got {value!r}")
    return ctypes.c_float(value)


def _fast_packer(arg: KernelArg):
    """``value -> packed`` for the common case of ``arg`` (an exact tensor of the right dtype, an int
    in range, a TensorMap), handing everything else to :func:`_pack_one` (which packs or raises the
    same error it always does)."""
    if arg.ctype in _POINTER_DTYPES:
        dtype = _POINTER_DTYPES[arg.ctype]
        if arg.nullable:
            if dtype is None:
                return lambda kernel, v: (ctypes.c_uint64(0) if v is None else v if isinstance(v, torch.Tensor)
                                          else _pack_one(kernel, arg, v))
            return lambda kernel, v: (ctypes.c_uint64(0) if v is None else v if type(v) is torch.Tensor and
                                      v.dtype == dtype else _pack_one(kernel, arg, v))
        if dtype is None:
            return lambda kernel, v: v if isinstance(v, torch.Tensor) else _pack_one(kernel, arg, v)
        return lambda kernel, v: v if type(v) is torch.Tensor and v.dtype == dtype else _pack_one(kernel, arg, v)
    if arg.ctype == "CUtensorMap":
        return lambda kernel, v: v if type(v) is TensorMap else _pack_one(kernel, arg, v)
    kind = _SCALARS[arg.ctype]
    if kind in _INT_RANGES:
        low, high, _ = _INT_RANGES[kind]
        return lambda kernel, v: kind(v) if type(v) is int and low <= v < high else _pack_one(kernel, arg, v)
    return lambda kernel, v: kind(v) if type(v) is float else _pack_one(kernel, arg, v)


#: id(args) -> (args, names, packers): a declaration's packers, built on its first launch.
_PACKERS: dict[int, tuple] = {}


def pack_args(kernel: str, args: tuple[KernelArg, ...], **values) -> tuple:
    """The launch tuple of ``args`` from values given by name, each checked against its type."""
    entry = _PACKERS.get(id(args))
    if entry is None or entry[0] is not args:
        if len(_PACKERS) >= 512:  # declarations are module constants: only a caller building them per call gets here
            _PACKERS.clear()
        entry = _PACKERS[id(args)] = (args, tuple(arg.name for arg in args), tuple(_fast_packer(a) for a in args))
    _, names, packers = entry
    if len(values) == len(names):
        try:
            return tuple([pack(kernel, values[name]) for name, pack in zip(names, packers)])
        except KeyError:
            pass  # a name missing: the checks below say which
    return _pack_checked(kernel, args, values)


def _pack_checked(kernel: str, args: tuple[KernelArg, ...], values: dict) -> tuple:
    if len(values) != len(args) or any(arg.name not in values for arg in args):
        names = [arg.name for arg in args]
        missing = [name for name in names if name not in values]
        extra = sorted(set(values) - set(names))
        if missing or extra:
            raise TypeError(f"{kernel}: kernel arguments missing {missing}, unexpected {extra}; declared {names}")
    return tuple(_pack_one(kernel, arg, values[arg.name]) for arg in args)


# -- the launch's parameter bytes -------------------------------------------------------------------
#
# A launch hands the driver one pointer per kernel parameter. The fast path writes every parameter into
# one byte string (struct.pack, a layout per signature) that the kernel copies into its reused buffer;
# the packers are generated per signature as straight-line code (a check and a conversion per argument,
# no loop), and hand anything off the common case to _pack_one, which converts it or raises its error.

_STRUCT = {"CUtensorMap": ("128s", 64), "uint32_t": ("I", 4), "unsigned int": ("I", 4), "int": ("i", 4),
           "float": ("f", 4), "unsigned long long": ("Q", 8)}
_CTYPE_FORMATS = {ctypes.c_int32: ("i", 4), ctypes.c_uint32: ("I", 4), ctypes.c_int64: ("q", 8),
                  ctypes.c_uint64: ("Q", 8), ctypes.c_float: ("f", 4)}
_MAP_FORMAT = ("128s", 64)
_POINTER_FORMAT = ("Q", 8)


class Layout(NamedTuple):
    """Where each parameter of one signature lives in the parameter bytes: ``fmt`` (struct, no native
    alignment: the padding is explicit), each parameter's byte offset, the total size."""
    fmt: str
    offsets: tuple[int, ...]
    size: int


def layout_of(formats) -> Layout:
    """The layout of ``(struct code, alignment)`` pairs, each parameter at its own aligned offset."""
    pieces, offsets, at = ["="], [], 0
    for code, align in formats:
        pad = -at % align
        if pad:
            pieces.append(f"{pad}x")
        at += pad
        offsets.append(at)
        pieces.append(code)
        at += struct.calcsize("=" + code)
    return Layout("".join(pieces), tuple(offsets), at)


def _raw(kernel: str, index: int, packed):
    """The value a packed argument (tensor, ctypes scalar, TensorMap) puts in the parameter bytes."""
    if isinstance(packed, torch.Tensor):
        if not packed.is_cuda:
            raise ValueError(f"{kernel}: argument {index} is a tensor on {packed.device}, expected a CUDA tensor")
        return packed.data_ptr()
    if isinstance(packed, TensorMap):
        return packed.data
    if type(packed) in _CTYPE_FORMATS:
        return packed.value
    raise TypeError(f"{kernel}: argument {index} has type {type(packed).__name__}; expected torch.Tensor, "
                    f"jit.TensorMap or one of ctypes c_int32/c_uint32/c_int64/c_uint64/c_float "
                    f"(plain Python numbers are ambiguous)")


def _slow(kernel: str, args: tuple, index: int, value):
    return _raw(kernel, index, _pack_one(kernel, args[index], value))


def _named_expression(arg: KernelArg, index: int) -> str:
    """The straight-line conversion of parameter ``index`` (held in ``v{index}``) for the common case."""
    v, slow = f"v{index}", f"_slow(kernel, args, {index}, v{index})"
    if arg.ctype in _POINTER_DTYPES:
        dtype = _POINTER_DTYPES[arg.ctype]
        test = f"type({v}) is _Tensor and {v}.is_cuda" + ("" if dtype is None else f" and {v}.dtype is _D{index}")
        expr = f"({v}.data_ptr() if {test} else {slow})"
        return f"(0 if {v} is None else {expr})" if arg.nullable else expr
    if arg.ctype == "CUtensorMap":
        return f"({v}.data if type({v}) is _TensorMap else {slow})"
    kind = _SCALARS[arg.ctype]
    if kind in _INT_RANGES:
        low, high, _ = _INT_RANGES[kind]
        return f"({v} if type({v}) is int and {low} <= {v} < {high} else {slow})"
    return f"({v} if type({v}) is float else {slow})"


def _compile_named(args: tuple[KernelArg, ...]):
    for arg in args:
        arg.check()
    layout = layout_of(_POINTER_FORMAT if a.ctype in _POINTER_DTYPES else _STRUCT[a.ctype] for a in args)
    names = tuple(arg.name for arg in args)
    scope = {"_Tensor": torch.Tensor, "_TensorMap": TensorMap, "_slow": _slow, "_pack": struct.pack,
             "_fmt": layout.fmt, "args": args}
    for i, arg in enumerate(args):
        scope[f"_D{i}"] = _POINTER_DTYPES.get(arg.ctype)
    body = [f"    v{i} = values[{name!r}]" for i, name in enumerate(names)]
    exprs = ", ".join(_named_expression(arg, i) for i, arg in enumerate(args))
    source = "def pack(kernel, values):\n" + "\n".join(body or ["    pass"]) + f"\n    return _pack(_fmt{', ' if exprs else ''}{exprs})\n"
    exec(compile(source, f"<pack {names}>", "exec"), scope)
    return layout, names, scope["pack"]


#: id(args) -> (args, layout, names, packer): a declaration's byte packer, generated on its first launch.
_BYTE_PACKERS: dict[int, tuple] = {}


def pack_bytes(kernel: str, args: tuple[KernelArg, ...], **values) -> tuple[Layout, bytes]:
    """``args`` from values given by name, checked as :func:`pack_args` checks them, as the parameter
    bytes of one launch (``Kernel.launch_bytes``) and their layout."""
    entry = _BYTE_PACKERS.get(id(args))
    if entry is None or entry[0] is not args:
        if len(_BYTE_PACKERS) >= 512:
            _BYTE_PACKERS.clear()
        entry = _BYTE_PACKERS[id(args)] = (args, *_compile_named(args))
    _, layout, names, packer = entry
    if len(values) == len(names):
        try:
            return layout, packer(kernel, values)
        except KeyError:
            pass  # a name missing: the checks below say which
    packed = _pack_checked(kernel, args, values)  # raises for missing or unexpected names
    return layout, struct.pack(layout.fmt, *(_raw(kernel, i, p) for i, p in enumerate(packed)))


def _positional_format(kind: type):
    if kind in _CTYPE_FORMATS:
        return _CTYPE_FORMATS[kind]
    if kind is TensorMap:
        return _MAP_FORMAT
    if issubclass(kind, torch.Tensor):
        return _POINTER_FORMAT
    return None


def compile_positional(kinds: tuple[type, ...]):
    """``(layout, pack(kernel, args) -> bytes)`` for launch tuples whose arguments have the types
    ``kinds`` (torch.Tensor and subclasses, jit.TensorMap, ctypes scalars), or None when one is of
    another type (the launch then raises its TypeError)."""
    formats = [_positional_format(kind) for kind in kinds]
    if any(f is None for f in formats):
        return None
    layout = layout_of(formats)
    exprs = []
    for i, kind in enumerate(kinds):
        if kind is TensorMap:
            exprs.append(f"a{i}.data")
        elif kind in _CTYPE_FORMATS:
            exprs.append(f"a{i}.value")
        else:
            exprs.append(f"(a{i}.data_ptr() if a{i}.is_cuda else _raw(kernel, {i}, a{i}))")
    unpack = "".join(f"a{i}, " for i in range(len(kinds)))
    source = (f"def pack(kernel, args):\n    {unpack or '_'} {'= args' if kinds else '= None'}\n"
              f"    return _pack(_fmt{', ' if exprs else ''}{', '.join(exprs)})\n")
    scope = {"_pack": struct.pack, "_fmt": layout.fmt, "_raw": _raw}
    exec(compile(source, "<pack positional>", "exec"), scope)
    return layout, scope["pack"]
