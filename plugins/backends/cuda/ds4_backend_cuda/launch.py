"""Kernel launches that may start before the previous kernel of their stream has finished (programmatic dependent
launch, compute capability 9.0 and later).

A decode step is a chain of small dependent kernels; between two of them the device drains one grid, flushes its
writes, then schedules the next grid's blocks. Launched with the programmatic-serialization attribute, a kernel's
blocks are scheduled as its predecessor's blocks retire and run up to ``grid_wait()`` (``kernels/pdl.cuh``), which
every kernel of the quant and glue modules calls before it touches data an earlier kernel wrote; the GEMVs load
their first weights before it. In a stream capture the attribute becomes a programmatic edge of the CUDA graph.

CuPy launches with ``cuLaunchKernel``, which takes no attributes, so these launches call the driver's
``cuLaunchKernelEx`` through ctypes. ``DS4_CUDA_PDL=0`` turns them back into CuPy's launches. CuPy is imported
where it is used, as in :mod:`.modules`, so that this module loads on machines without it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Environment switch: programmatic dependent launches unless it is "0" (and only on compute capability >= 9.0).
PDL_ENV = "DS4_CUDA_PDL"
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION in cuda.h


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: a 4-byte id, padding to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernelEx
    launch.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    launch.restype = ctypes.c_int
    return lib


@functools.cache
def _capable(device: int) -> bool:
    import cupy

    return int(cupy.cuda.Device(device).compute_capability) >= 90


def programmatic() -> bool:
    """Whether launches through :class:`Kernel` overlap their predecessors (not with ``DS4_CUDA_PDL=0``; sm_90+)."""
    import cupy

    return os.environ.get(PDL_ENV, "1").strip() != "0" and _capable(cupy.cuda.Device().id)


#: struct codes (native sizes and alignment, as a C parameter list lays them out) of the argument types CuPy
#: converts: a Python int an int64, a float a float64, a numpy scalar its own type; None a null pointer.
_CODES: dict[type, str] = {type(None): "Q", bool: "?", int: "q", float: "d", np.bool_: "?", np.int8: "b",
                           np.uint8: "B", np.int16: "h", np.uint16: "H", np.int32: "i", np.uint32: "I", np.int64: "q",
                           np.uint64: "Q", np.float16: "e", np.float32: "f", np.float64: "d"}
#: (struct, each argument's offset) by codes: a prefill launches a few dozen kernels of a few signatures.
_layouts: dict[str, tuple[struct.Struct, tuple[int, ...]]] = {}


def _converted(value: Any) -> tuple[str, Any]:
    """The struct code and the value to pack of an argument that :data:`_CODES` does not take as it is: None (a
    null pointer), an int past int64 (a uint64), a CuPy array (its device pointer), a subclass of a number type."""
    if value is None:
        return "Q", 0
    cupy = sys.modules.get("cupy")  # not imported: the value is no CuPy array
    if cupy is not None and isinstance(value, cupy.ndarray):
        return "Q", value.data.ptr
    if isinstance(value, int) and value >= 1 << 63:
        return "Q", value
    for kind in (int, float):  # subclasses: an IntEnum, say
        if isinstance(value, kind):
            return _CODES[kind], kind(value)
    raise TypeError(f"kernel argument of type {type(value).__name__}: pass a CuPy array or a number")


def _packed(args: Sequence[Any]) -> tuple[Any, tuple[int, ...]]:
    """Every argument's bytes in one buffer, laid out as a C parameter list, and each one's offset: a launch
    packs one buffer instead of a ctypes array an argument."""
    codes, values = [], []
    for value in args:
        code = _CODES.get(type(value))
        if code is None or value is None or (code == "q" and value >= 1 << 63):
            code, value = _converted(value)
        codes.append(code)
        values.append(value)
    key = "".join(codes)
    layout = _layouts.get(key)
    if layout is None:
        offsets = tuple(struct.calcsize("@" + key[:i + 1]) - struct.calcsize(key[i]) for i in range(len(key)))
        layout = _layouts[key] = (struct.Struct("@" + key), offsets)
    buffer = ctypes.create_string_buffer(max(layout[0].size, 1))
    layout[0].pack_into(buffer, 0, *values)
    return buffer, layout[1]


#: The one launch attribute every programmatic launch passes; the driver only reads it.
_PROGRAMMATIC = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
#: Launch configurations by (grid, block, shared memory, stream): a prefill repeats a few dozen shapes, and a
#: configuration is never changed once made, so launches from several threads may share it.
_configs: dict[tuple, _Config] = {}


def _config(grid: Sequence[int], block: Sequence[int], shared_mem: int, stream: int) -> _Config:
    key = (tuple(grid), tuple(block), shared_mem, stream)
    config = _configs.get(key)
    if config is None:
        if len(_configs) >= 4096:  # shapes that keep changing (contexts of every length): start over
            _configs.clear()
        config = _configs[key] = _Config(grid=_dims(grid), block=_dims(block), shared_mem=shared_mem, stream=stream,
                                         attrs=ctypes.pointer(_PROGRAMMATIC), num_attrs=1)
    return config


def _dims(dims: Sequence[int]) -> Any:
    return (ctypes.c_uint * 3)(*(max(1, d) for d in (*dims, 1, 1)[:3]))


class Kernel:
    """A ``cupy.RawKernel`` called the same way (``kernel(grid, block, args, shared_mem=0)``), whose launches ask
    for programmatic serialization when :func:`programmatic`. The kernel must call ``grid_wait()`` before it reads
    anything an earlier kernel wrote (``kernels/pdl.cuh``)."""

    def __init__(self, raw: Any):
        self.raw = raw

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        self.raw.max_dynamic_shared_size_bytes = nbytes

    def __call__(self, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], shared_mem: int = 0) -> None:
        import cupy

        if not programmatic():
            self.raw(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
            return
        buffer, offsets = _packed(args)
        base = ctypes.addressof(buffer)
        params = (ctypes.c_void_p * max(len(offsets), 1))(*[base + offset for offset in offsets])
        config = _config(grid, block, shared_mem, cupy.cuda.get_current_stream().ptr)
        status = _driver().cuLaunchKernelEx(ctypes.byref(config), self.raw.kernel.ptr, params, None)
        if status:
            name = ctypes.c_char_p()
            _driver().cuGetErrorName(status, ctypes.byref(name))
            raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({status})")
