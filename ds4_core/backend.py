"""The backend contract: weights on a device and the op dispatcher models call.

A backend turns GGUF tensors into :class:`Weight` objects in its own form and
supplies one kernel per op. Model graphs call ops through :class:`Ops`, which
binds the chosen backend's kernels, so models and backends never import each
other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from .errors import BackendError

if TYPE_CHECKING:
    from .gguf import TensorInfo
    from .sampling import Sampler


@attrs.frozen(eq=False)
class Weight:
    """A model tensor as a backend holds it.

    ``shape`` is the logical numpy-order shape (e.g. ``[out, in]`` or ``[experts, out, in]``),
    ``qtype`` the GGML type name it came from (``"Q8_0"``, ``"F16"`` …), ``data`` the
    backend's payload (the numpy backend holds float32 values; a GPU backend raw blocks).
    """

    name: str
    qtype: str
    shape: tuple[int, ...]
    data: Any


#: Prompt tokens per forward pass unless a backend asks for more (:attr:`Backend.prefill_chunk`).
DEFAULT_PREFILL_CHUNK = 512


class Backend:
    """Base class of backends; subclasses set ``name``, ``xp`` and implement ``upload``.

    ``xp`` is a numpy-compatible array namespace (numpy, cupy …) used for the
    small glue arithmetic of model graphs.
    """

    name: str = "?"
    xp: ModuleType = np
    #: Prompt tokens a session feeds per forward pass (a backend whose prefill gains from more raises it).
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    def upload(self, name: str, qtype: str, shape: tuple[int, ...], raw: np.ndarray) -> Weight:
        """Make a :class:`Weight` from raw GGUF bytes (uint8, the tensor's exact blocks)."""
        raise NotImplementedError

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """Move a host array to the backend."""
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a: Any) -> np.ndarray:
        """Bring a backend array back to the host."""
        return np.asarray(a)

    def write(self, dst: Any, values: np.ndarray) -> None:
        """Copy the host array ``values`` into the backend array ``dst`` of the same shape and dtype, after the work
        queued before it (a replayed step's inputs)."""
        dst[...] = values

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on the host)."""

    def sample(self, row: Any, sampler: Sampler) -> int | None:
        """The token id ``sampler`` picks from ``row``, a float32 backend array ``[vocab]`` of logits, computed where
        the row lives; None leaves it to the host (``sampler.sample`` on a host copy), as this base class does.

        A backend that answers must return the id the host would and advance ``sampler.rng`` exactly as the host
        would (one ``uniform()`` per draw, none for greedy), so that a seed gives the same text on every backend.
        """
        return None

    def memory_info(self) -> dict[str, int]:
        """Bytes on the device as far as the backend knows them (empty: nothing known): ``used`` by its arrays,
        ``peak`` the most ``used`` has been, ``reserved`` by its allocator's cache, ``free`` and ``total`` of the
        whole device (every allocator and the context), ``host`` held for the device in host memory (weights that
        did not fit it). ``ds4 bench -m`` reports them."""
        return {}

    def numerics(self) -> dict[str, str]:
        """Where this backend's arithmetic may differ from the numpy reference beyond float32 summation order, and
        how to change it: step -> setting, for reports such as ``ds4 bench`` (empty: it computes as the reference)."""
        return {}

    def free_memory(self) -> int | None:
        """Bytes still available on this backend's device (``None``: unknown). ``Engine.load`` checks the weights
        against it before it uploads them, and the decoding state after."""
        return None

    def weights_nbytes(self, tensors: Iterable[TensorInfo]) -> int | None:
        """Bytes :meth:`upload` keeps on the device for these GGUF tensors (``None``: unknown, and ``Engine.load``
        checks nothing before loading). ``Engine.load`` calls it once before the uploads, so a backend may decide
        here where each tensor goes (the CUDA backend keeps routed experts in host memory when the device is short)."""
        return None

    def release_scratch(self) -> None:
        """Give cached scratch memory back to the device (after a prompt fed in several chunks; no-op here)."""

    #: Whether :meth:`capture` records work for replay (a model then runs its decode steps as graphs).
    graphs: bool = False

    def capture(self, step: Callable[[], Any]) -> tuple[Any, Callable[[], Any] | None]:
        """Run ``step`` once and, where this backend can, record it for replay.

        Returns ``(what this run of step returned, replay)``. ``replay()`` repeats the recorded device work on the
        buffers ``step`` used and returns the recorded run's outputs, overwritten by every replay. ``replay`` is
        None when nothing was recorded (this base class, or a step the device could not record). ``step`` must
        take no data-dependent decision on the host, since a replay repeats exactly the recorded launches.
        """
        return step(), None

    def concurrently(self, *branches: Callable[[], Any]) -> tuple[Any, ...]:
        """Run independent parts of a graph and return their results in order; a backend with several device
        queues may overlap them (this base class runs them one after another). Put the longest first: a busy
        device tends to start work in the order it was queued.

        Each branch may read arrays made before the call and write only what it returns or state that no other
        branch touches. The arrays it reads must stay referenced until the call returns (the caller's variables
        are), since a device may still be reading them when a branch's Python code is done.
        """
        return tuple(branch() for branch in branches)


class Ops:
    """The op vocabulary bound to one backend: ``ops.linear(x, w)`` calls its kernel."""

    def __init__(self, backend: Backend, kernels: Mapping[str, Callable[..., Any]]):
        self.backend = backend
        self.xp = backend.xp
        self._kernels = dict(kernels)

    def __getattr__(self, op: str) -> Callable[..., Any]:
        try:
            return self._kernels[op]
        except KeyError:
            raise BackendError(f"backend {self.backend.name!r} has no kernel for op {op!r}") from None

    def has(self, op: str) -> bool:
        return op in self._kernels

    def concurrently(self, *branches: Callable[[], Any]) -> tuple[Any, ...]:
        """:meth:`Backend.concurrently` of the bound backend: independent branches of a graph, results in order."""
        return self.backend.concurrently(*branches)

    def missing(self, required: Iterable[str]) -> list[str]:
        """The ops of ``required`` this backend cannot run, sorted."""
        return sorted(set(required) - set(self._kernels))


class WeightLoader:
    """Validates GGUF tensors against what a model expects and uploads them, reporting progress.

    ``gguf`` is a :class:`ds4_core.gguf.GGUFFile`; ``progress(nbytes)`` is called after each upload.
    """

    def __init__(self, gguf: Any, backend: Backend, progress: Callable[[int], None] | None = None):
        self.gguf = gguf
        self.backend = backend
        self._progress = progress or (lambda n: None)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def names(self) -> Iterable[str]:
        """The names of every tensor there is to load."""
        return self.gguf.tensors.keys()

    def get(self, name: str, shape: tuple[int, ...] | None = None, types: Iterable[str] | None = None) -> Weight:
        """Upload tensor ``name``; ``shape`` (numpy order) and ``types`` (GGML names) are checked if given."""
        info = self.gguf.require_tensor(name, shape=shape, types=tuple(types) if types is not None else None)
        raw = self.gguf.tensor_bytes(name)
        weight = self.backend.upload(name, info.type_name, tuple(info.shape), raw)
        self._progress(info.nbytes)
        return weight

    def optional(self, name: str, shape: tuple[int, ...] | None = None,
                 types: Iterable[str] | None = None) -> Weight | None:
        """Like :meth:`get`, but ``None`` when the file has no such tensor."""
        return self.get(name, shape, types) if self.has(name) else None

    def array(self, name: str, dtype: Any = np.float32, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A small tensor as a host array (dequantized), e.g. a lookup table used on the host."""
        from .quants import dequantize

        info = self.gguf.require_tensor(name, shape=shape)
        if info.type_name in ("I32", "I16", "I8", "I64"):
            out = np.array(self.gguf.tensor_array(name), dtype=dtype)
        else:
            out = dequantize(self.gguf.tensor_bytes(name), info.qtype, tuple(info.shape)).astype(dtype)
        self._progress(info.nbytes)
        return out
