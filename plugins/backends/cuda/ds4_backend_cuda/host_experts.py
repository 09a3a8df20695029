"""Routed experts kept in pinned host memory when a model's weights do not fit the device.

A decode step reads only the few experts its router picks, so a layer whose experts stay in host memory costs a
token those experts' bytes over the bus, not the layer's. Under unified addressing a pinned host allocation has one
address that the device dereferences too: a decode step's launch copies the picked experts into device scratch
(:func:`gathered`; the ids never leave the device), and a prefill chunk, which reads every expert, copies the layer's
experts whole first (:func:`on_device`).
``DS4_CUDA_HOST_EXPERTS`` picks the layers: ``auto`` (the default: the last layers, only as many as the device
lacks, plus :data:`HEADROOM`), ``off``, ``all``, or a number of layers counted from the last.
"""

from __future__ import annotations

import ctypes
import os
import re
import weakref
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


class _PinnedOwner:
    """Holds a pinned allocation for the arrays made over it, and is in :data:`_live` while any of them lives."""

    __slots__ = ("__weakref__", "memory")

    def __init__(self, memory: Any) -> None:
        self.memory = memory


#: Owners of the pinned allocations :func:`host_array` made that arrays still read; while there are none, no tensor
#: can be in host memory, so :func:`in_host_memory` asks the driver nothing (every eager MoE call asks it).
_live: weakref.WeakSet[_PinnedOwner] = weakref.WeakSet()


def in_host_memory(w: Weight) -> bool:
    """Whether ``w``'s data is pinned host memory (a tensor :func:`plan` chose)."""
    if not _live:
        return False
    import cupy

    return cupy.cuda.runtime.pointerGetAttributes(w.data.data.ptr).type == MEMORY_TYPE_HOST


def on_device(w: Weight) -> Weight:
    """``w``, or for a tensor in host memory a device copy of it made by one bulk copy: a prefill chunk reads every
    expert, and its tiles' scattered reads of host memory took ~10 times as long as one bulk copy (session 63)."""
    import cupy

    if not in_host_memory(w):
        return w
    copy = cupy.empty(w.data.shape, w.data.dtype)
    cupy.cuda.runtime.memcpyAsync(copy.data.ptr, w.data.data.ptr, w.data.nbytes, cupy.cuda.runtime.memcpyDefault,
                                  cupy.cuda.get_current_stream().ptr)
    return Weight(w.name, w.qtype, w.shape, copy)


#: ``gather_experts``' blocks a multiprocessor, shared among the launch's (pair, tensor) copies.
_GATHER_BLOCKS_PER_SM = 4


def gathered(experts: tuple[Weight, ...], idx: Any) -> tuple[tuple[Weight, ...], Any] | None:
    """The experts that ``idx`` (int32 ``[P]`` on the device, a negative id none) picks of the stacked expert tensors
    ``experts`` (up to three, ``[E, R, C]``), copied by one launch into device scratch ``[P, R, C]``, with the slot
    ids (p, or -1) that address them there; None when none of them is in host memory or their experts are not whole
    16-byte words. Scattered reads of host memory by the expert kernels themselves took a Flash layer ~1.6 ms a
    token (session 63)."""
    import cupy

    from .gemv import _multiprocessors
    from .modules import glue_kernel

    if not 0 < len(experts) <= 3 or not any(in_host_memory(w) for w in experts):
        return None
    expert_bytes = [w.data.nbytes // w.shape[0] for w in experts]
    if any(n % 16 or w.data.data.ptr % 16 for n, w in zip(expert_bytes, experts, strict=True)):
        return None
    pairs = idx.shape[0]
    copies = tuple(Weight(w.name, w.qtype, (pairs, *w.shape[1:]),
                          cupy.empty((pairs * n // w.data.shape[1], w.data.shape[1]), cupy.uint8))
                   for n, w in zip(expert_bytes, experts, strict=True))
    slots = cupy.empty(pairs, cupy.int32)
    blocks = max(1, -(-_GATHER_BLOCKS_PER_SM * _multiprocessors(cupy.cuda.Device().id) // (pairs * len(experts))))
    # the launch takes three tensors; with fewer, its grid leaves the repeated ones out
    glue_kernel("gather_experts")((blocks, pairs, len(experts)), (256,), (
        *(w.data for w in (experts * 3)[:3]), *(c.data for c in (copies * 3)[:3]),
        *(np.int64(n // 16) for n in (expert_bytes * 3)[:3]), idx, slots))
    return copies, slots


def host_array(cupy: Any, device: int, host: np.ndarray, rows: int) -> Any:
    """``host``'s bytes in pinned host memory as a CuPy ``uint8`` array ``[rows, bytes a row]`` the kernels read."""
    size = host.size
    pinned = cupy.cuda.PinnedMemory(size)
    ctypes.memmove(pinned.ptr, host.ctypes.data, size)
    owner = _PinnedOwner(pinned)
    _live.add(owner)
    memory = cupy.cuda.UnownedMemory(pinned.ptr, size, owner, device_id=device)
    return cupy.ndarray((rows, size // rows), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
