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


def _argument(value: Any) -> ctypes.Array:
    """A kernel argument as the bytes its parameter holds, converted as CuPy converts it: an array's device
    pointer, None a null pointer, a Python int an int64, a float a float64, a numpy scalar its own bytes."""
    if value is None:
        value = np.uint64(0)
    elif isinstance(value, bool | int | float):
        value = np.asarray(value, dtype=np.bool_ if isinstance(value, bool) else None)[()]
    elif not isinstance(value, np.generic):
        cupy = sys.modules.get("cupy")  # not imported: the value is no CuPy array
        if cupy is None or not isinstance(value, cupy.ndarray):
            raise TypeError(f"kernel argument of type {type(value).__name__}: pass a CuPy array or a number")
        value = np.uint64(value.data.ptr)
    return (ctypes.c_char * value.nbytes).from_buffer_copy(value.tobytes())


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
        values = [_argument(a) for a in args]
        params = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _Config(grid=_dims(grid), block=_dims(block), shared_mem=shared_mem,
                         stream=cupy.cuda.get_current_stream().ptr, attrs=ctypes.pointer(attribute), num_attrs=1)
        status = _driver().cuLaunchKernelEx(ctypes.byref(config), self.raw.kernel.ptr, params, None)
        if status:
            name = ctypes.c_char_p()
            _driver().cuGetErrorName(status, ctypes.byref(name))
            raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({status})")
