"""TMA descriptors (CUtensorMap) built on the host and passed to kernels by value."""
from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import torch

from .driver import check, driver, ensure_context

_TENSOR_MAP_BYTES = 128
_TENSOR_MAP_ALIGN = 64

#: Encoded maps (_Encoded) by everything the encoding reads (address, dtype, shape, row stride, box, swizzle).
#: A map holds no reference to its memory, only the address: the same key encodes the same 128
#: bytes whatever tensor lives there now, so a layer's maps (weights, and activations the caching
#: allocator hands back at the same addresses) are encoded once, not per launch.
_ENCODED: OrderedDict = OrderedDict()
_ENCODED_MAX = 1024
_ENCODED_LOCK = threading.Lock()


class _Encoded:
    """One encoded CUtensorMap: 128 bytes in 64-byte aligned host memory, never written again (the
    maps of one key share it)."""

    __slots__ = ("_storage", "address", "data")

    def __init__(self, raw: bytes):
        if len(raw) != _TENSOR_MAP_BYTES:
            raise ValueError(f"a CUtensorMap is {_TENSOR_MAP_BYTES} bytes, got {len(raw)}")
        self.data = bytes(raw)  # what a launch copies into its parameter buffer
        self._storage = (ctypes.c_ubyte * (_TENSOR_MAP_BYTES + _TENSOR_MAP_ALIGN))()
        base = ctypes.addressof(self._storage)
        self.address = (base + _TENSOR_MAP_ALIGN - 1) // _TENSOR_MAP_ALIGN * _TENSOR_MAP_ALIGN
        ctypes.memmove(self.address, raw, _TENSOR_MAP_BYTES)


class TensorMap:
    """A 128-byte CUtensorMap (passed to a kernel by value from ``address``); keeps its tensor alive."""

    __slots__ = ("_encoded", "address", "data", "tensor", "rows", "cols", "box_rows", "box_cols", "swizzle")

    def __init__(self, encoded: "_Encoded | bytes", tensor: torch.Tensor, rows: int, cols: int, box_rows: int,
                 box_cols: int, swizzle: int):
        if not isinstance(encoded, _Encoded):
            encoded = _Encoded(encoded)
        self._encoded = encoded
        self.address = encoded.address
        self.data = encoded.data
        self.tensor = tensor
        self.rows, self.cols = rows, cols
        self.box_rows, self.box_cols = box_rows, box_cols
        self.swizzle = swizzle

    def raw(self) -> bytes:
        return ctypes.string_at(self.address, _TENSOR_MAP_BYTES)

    def __repr__(self) -> str:
        return (f"TensorMap({self.rows}x{self.cols} {self.tensor.dtype}, box {self.box_rows}x{self.box_cols}, "
                f"swizzle {self.swizzle})")


_DATA_TYPES: dict = {}


def _data_type(cuda, dtype: torch.dtype):
    if not _DATA_TYPES:
        kinds = cuda.CUtensorMapDataType
        _DATA_TYPES.update({
            torch.bfloat16: kinds.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            torch.float16: kinds.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            torch.float32: kinds.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            torch.int32: kinds.CU_TENSOR_MAP_DATA_TYPE_INT32,
            torch.uint8: kinds.CU_TENSOR_MAP_DATA_TYPE_UINT8,
            torch.float8_e4m3fn: kinds.CU_TENSOR_MAP_DATA_TYPE_UINT8,
            torch.float8_e5m2: kinds.CU_TENSOR_MAP_DATA_TYPE_UINT8,
        })
    if dtype not in _DATA_TYPES:
        raise TypeError(f"make_tma_2d: tensor dtype {dtype} is not supported; expected one of "
                        f"{sorted(str(d) for d in _DATA_TYPES)}")
    return _DATA_TYPES[dtype]


def make_tma_2d(tensor: torch.Tensor, box_rows: int, box_cols: int, *, swizzle: int = 128, rows: int | None = None,
                cols: int | None = None, row_stride_elems: int | None = None) -> TensorMap:
    """A 2-D tiled tensor map over the row-major view ``[rows, cols]`` of ``tensor`` (cols contiguous).

    Defaults: ``cols = tensor.shape[-1]``, ``rows = numel // cols`` (a 3-D ``[E, N, K]`` weight is
    ``[E*N, K]``), ``row_stride_elems = cols``. Out-of-bounds boxes read zeros.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise ValueError(f"make_tma_2d: expected a CUDA tensor, got "
                         f"{tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
    if tensor.dim() == 0 or tensor.stride(-1) != 1:
        raise ValueError(f"make_tma_2d: the last dimension must be contiguous, got strides {tuple(tensor.stride())}")
    # A key encoded before passed every check below that the key determines (dtype, sizes, box,
    # swizzle, the address's alignment); only the storage behind the address is the tensor's own.
    cols_ = tensor.shape[-1] if cols is None else cols
    rows_ = (tensor.numel() // cols_ if cols_ else 0) if rows is None else rows
    stride_ = cols_ if row_stride_elems is None else row_stride_elems
    key = (tensor.data_ptr(), tensor.dtype, rows_, cols_, stride_, box_rows, box_cols, swizzle)
    with _ENCODED_LOCK:
        encoded = _ENCODED.get(key)
        if encoded is not None:
            _ENCODED.move_to_end(key)
    if encoded is not None:
        elem = tensor.element_size()
        if (rows_ - 1) * stride_ + cols_ <= tensor.untyped_storage().nbytes() // elem - tensor.storage_offset():
            return TensorMap(encoded, tensor, rows_, cols_, box_rows, box_cols, swizzle)
    if swizzle not in (0, 32, 64, 128):
        raise ValueError(f"swizzle={swizzle}: expected 0, 32, 64 or 128 (bytes)")
    cuda = driver()
    data_type = _data_type(cuda, tensor.dtype)
    elem = tensor.element_size()
    rows, cols, row_stride_elems = rows_, cols_, stride_
    if rows < 1 or cols < 1:
        raise ValueError(f"make_tma_2d: rows={rows}, cols={cols}: expected both >= 1")
    if not (1 <= box_rows <= 256 and 1 <= box_cols <= 256):
        raise ValueError(f"box=({box_rows}, {box_cols}): each side must be in [1, 256]")
    if (box_cols * elem) % 16:
        raise ValueError(f"box_cols={box_cols}: the inner box must span a multiple of 16 bytes "
                         f"({box_cols} x {elem} B)")
    if swizzle and box_cols * elem > swizzle:
        raise ValueError(f"box_cols={box_cols}: {box_cols * elem} B exceeds the {swizzle}-byte swizzle span")
    if (row_stride_elems * elem) % 16 or row_stride_elems < cols:
        raise ValueError(f"row_stride_elems={row_stride_elems}: expected >= cols ({cols}) and a multiple of "
                         f"16 bytes ({elem} B elements)")
    if tensor.data_ptr() % 16:
        raise ValueError(f"make_tma_2d: tensor address {tensor.data_ptr():#x} is not 16-byte aligned")
    needed = (rows - 1) * row_stride_elems + cols
    available = tensor.untyped_storage().nbytes() // elem - tensor.storage_offset()
    if needed > available:
        raise ValueError(f"make_tma_2d: a [{rows}, {cols}] view with row stride {row_stride_elems} needs "
                         f"{needed} elements, the tensor's storage has {available}")

    device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    raw = _encode(cuda, data_type, tensor.data_ptr(), rows, cols, row_stride_elems * elem, box_rows, box_cols,
                  swizzle, device)
    encoded = _Encoded(raw)
    with _ENCODED_LOCK:
        _ENCODED[key] = encoded
        if len(_ENCODED) > _ENCODED_MAX:
            _ENCODED.popitem(last=False)
    return TensorMap(encoded, tensor, rows, cols, box_rows, box_cols, swizzle)


def _encode(cuda, data_type, address: int, rows: int, cols: int, row_stride_bytes: int, box_rows: int,
            box_cols: int, swizzle: int, device: int) -> bytes:
    swizzles = cuda.CUtensorMapSwizzle
    swizzle_mode = {0: swizzles.CU_TENSOR_MAP_SWIZZLE_NONE, 32: swizzles.CU_TENSOR_MAP_SWIZZLE_32B,
                    64: swizzles.CU_TENSOR_MAP_SWIZZLE_64B, 128: swizzles.CU_TENSOR_MAP_SWIZZLE_128B}[swizzle]

    def encode():
        return cuda.cuTensorMapEncodeTiled(
            data_type, 2, address,
            [cuda.cuuint64_t(cols), cuda.cuuint64_t(rows)],
            [cuda.cuuint64_t(row_stride_bytes)],
            [cuda.cuuint32_t(box_cols), cuda.cuuint32_t(box_rows)],
            [cuda.cuuint32_t(1), cuda.cuuint32_t(1)],
            cuda.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle_mode,
            cuda.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cuda.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )

    result = encode()
    if result[0] == cuda.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # A thread without a current context (the autograd engine's, an emulated rank's): launches run
        # on their stream without one, so nothing before may have made torch's current; the encoding needs it.
        ensure_context(device)
        result = encode()
    tensor_map = check(result, "cuTensorMapEncodeTiled")
    return ctypes.string_at(tensor_map.getPtr(), _TENSOR_MAP_BYTES)
