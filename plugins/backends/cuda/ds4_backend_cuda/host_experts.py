"""Routed experts kept in pinned host memory when a model's weights do not fit the device.

A decode step reads only the few experts its router picks, so a layer whose experts stay in host memory costs a
token those experts' bytes over the bus, not the layer's. Decode kernels read such tensors in place: under unified
addressing a pinned host allocation has one address that the device dereferences too, so no kernel changes. A
prefill chunk, which reads every expert, copies the layer's experts to the device first (:func:`on_device`).
``DS4_CUDA_HOST_EXPERTS`` picks the layers: ``auto`` (the default: the last layers, only as many as the device
lacks, plus :data:`HEADROOM`), ``off``, ``all``, or a number of layers counted from the last.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ds4_core.backend import Weight
from ds4_core.errors import BackendError
from ds4_core.log import get_logger
from ds4_core.memory import human_bytes

if TYPE_CHECKING:
    from ds4_core.gguf import TensorInfo

ENV = "DS4_CUDA_HOST_EXPERTS"
#: Device memory left free beyond the weights once experts move to the host: the prefill's scratch at the default
#: chunk (at most 4 GiB on Flash shapes), a layer's experts copied in for a prefill chunk (:func:`on_device`, 1.8 GB
#: on Flash shapes), the decoding state and the decode graphs.
HEADROOM = 8 * 2**30
#: ``cudaMemoryTypeHost``, the kind ``cudaPointerGetAttributes`` gives a pinned host allocation.
MEMORY_TYPE_HOST = 1
_ROUTED = re.compile(r"blk\.(\d+)\.ffn_\w+_exps\.")


def plan(tensors: Sequence[TensorInfo], device_free: int, host_free: int | None,
         setting: str | None = None) -> set[str]:
    """Names of the routed-expert tensors to keep in host memory, by ``setting`` (``DS4_CUDA_HOST_EXPERTS``)."""
    setting = (os.environ.get(ENV, "auto") if setting is None else setting).strip().lower()
    layers: dict[int, list[TensorInfo]] = defaultdict(list)
    for t in tensors:
        if match := _ROUTED.match(t.name):
            layers[int(match.group(1))].append(t)
    order = sorted(layers, reverse=True)  # the last layers first
    if setting in ("0", "off"):
        return set()
    if setting == "all":
        chosen = order
    elif setting.isdigit():
        chosen = order[:int(setting)]
    elif setting == "auto":
        lacking = sum(t.nbytes for t in tensors) - device_free
        if lacking <= 0:
            return set()
        lacking += HEADROOM
        chosen = []
        for layer in order:
            if lacking <= 0:
                break
            chosen.append(layer)
            lacking -= sum(t.nbytes for t in layers[layer])
        if lacking > 0:
            return set()  # even every expert on the host leaves the rest too large: Engine.load refuses it
    else:
        raise BackendError(f"{ENV}={setting!r}: expected auto, off, all or a number of layers")
    names = {t.name for layer in chosen for t in layers[layer]}
    nbytes = sum(t.nbytes for t in tensors if t.name in names)
    if names and host_free is not None and nbytes > host_free:
        return set()  # the host cannot hold them either: the device check refuses the model with its numbers
    if names:
        get_logger(backend="cuda").warning(
            "routed experts kept in host memory, read over the bus: decode and prefill are slower for them",
            layers=f"{min(chosen)}-{max(chosen)}" if len(chosen) > 1 else str(chosen[0]), bytes=human_bytes(nbytes),
            setting=f"{ENV}={setting}")
    return names


def on_device(w: Weight) -> Weight:
    """``w``, or for a tensor in host memory a device copy of it made by one bulk copy: a prefill chunk reads every
    expert, and its tiles' scattered reads of host memory took ~10 times as long as one bulk copy (session 63)."""
    import cupy

    if cupy.cuda.runtime.pointerGetAttributes(w.data.data.ptr).type != MEMORY_TYPE_HOST:
        return w
    copy = cupy.empty(w.data.shape, w.data.dtype)
    cupy.cuda.runtime.memcpyAsync(copy.data.ptr, w.data.data.ptr, w.data.nbytes, cupy.cuda.runtime.memcpyDefault,
                                  cupy.cuda.get_current_stream().ptr)
    return Weight(w.name, w.qtype, w.shape, copy)


def host_array(cupy: Any, device: int, host: np.ndarray, rows: int) -> Any:
    """``host``'s bytes in pinned host memory as a CuPy ``uint8`` array ``[rows, bytes a row]`` the kernels read."""
    size = host.size
    pinned = cupy.cuda.PinnedMemory(size)
    ctypes.memmove(pinned.ptr, host.ctypes.data, size)
    memory = cupy.cuda.UnownedMemory(pinned.ptr, size, pinned, device_id=device)
    return cupy.ndarray((rows, size // rows), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
