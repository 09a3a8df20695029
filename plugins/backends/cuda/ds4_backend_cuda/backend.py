"""The CUDA backend object: weights as raw GGUF blocks in device memory, arrays as CuPy arrays."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ds4_core.backend import Backend, Weight
from ds4_core.errors import BackendError
from ds4_core.log import get_logger
from ds4_core.memory import available_host_memory
from ds4_core.quants import tensor_nbytes
from ds4_core.sampling import Sampler

from . import host_experts
from .modules import QUANT_TYPES, warm
from .sampling import sample_row

if TYPE_CHECKING:
    from ds4_core.gguf import TensorInfo

_INTEGER_TYPES = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


class CudaBackend(Backend):
    """One CUDA device through CuPy.

    A float or quantized weight's ``data`` is a ``uint8`` CuPy array ``[rows, row bytes]`` holding the tensor's
    exact GGUF bytes (rows = product of all but the last dimension); integer tables are CuPy integer arrays.
    """

    name = "cuda"
    #: A routed expert's weights are read once per chunk, so longer chunks amortize them over more tokens (2048
    #: tokens give each of 256 experts ~48 of them at 6 per token); the scratch stays under 4 GiB on Flash shapes.
    prefill_chunk = 2048

    def __init__(self, device: int = 0, **options: Any):
        try:
            import cupy
        except ImportError as exc:
            raise BackendError("the CUDA backend needs CuPy: pip install cupy-cuda12x (or cupy-cuda13x)") from exc
        self.xp = cupy
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self.options = options
        #: Decode steps replay CUDA graphs unless ``DS4_CUDA_GRAPHS=0``.
        self.graphs = os.environ.get("DS4_CUDA_GRAPHS", "1") != "0"
        #: Per thread (the server runs sessions on worker threads), the streams that run the second, third ...
        #: branch of :meth:`concurrently`, made on first use, and how many of them calls in progress hold.
        self._branches = threading.local()
        #: Tensors :meth:`upload` keeps in pinned host memory (``host_experts.plan``, made by :meth:`weights_nbytes`).
        self._on_host: set[str] = set()
        self._host_bytes = 0
        warm()

    def upload(self, name: str, qtype: str, shape: tuple[int, ...], raw: np.ndarray) -> Weight:
        cupy = self.xp
        if qtype in _INTEGER_TYPES:
            host = np.frombuffer(np.ascontiguousarray(raw).reshape(-1), dtype=_INTEGER_TYPES[qtype])
            return Weight(name, qtype, shape, cupy.asarray(host.reshape(shape)))
        if qtype not in QUANT_TYPES:
            raise BackendError(f"tensor {name}: the CUDA backend cannot hold {qtype} weights; "
                               f"re-quantize to one of {', '.join(QUANT_TYPES)} or use --backend numpy")
        nbytes = tensor_nbytes(qtype, shape)
        host = np.ascontiguousarray(raw).reshape(-1)
        if host.size != nbytes:
            raise BackendError(f"tensor {name}: {host.size} bytes for a {qtype} tensor of shape {shape} "
                               f"that needs {nbytes}; the file is damaged")
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        if name in self._on_host:
            data = host_experts.host_array(cupy, self.device.id, host, rows)
            self._host_bytes += host.size
        else:
            data = cupy.asarray(host.reshape(rows, nbytes // rows))
        return Weight(name, qtype, tuple(shape), data)

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a: Any) -> np.ndarray:
        return self.xp.asnumpy(a)

    def write(self, dst: Any, values: np.ndarray) -> None:
        """One copy on the current stream (from pageable memory: the values are staged when it returns, and it does
        not wait for the stream). A replayed decode step's token and position took two ``fill`` launches, 16 µs of
        the host's time between two steps while the GPU waits, where this takes 3.7."""
        dst.set(values)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def sample(self, row: Any, sampler: Sampler) -> int | None:
        """Greedy and the built-in chain on the device (:mod:`ds4_backend_cuda.sampling`), bringing back the id or
        a few candidates instead of the row; None (the host samples) for custom stages or an unbounded chain."""
        return sample_row(row, sampler)

    def memory_info(self) -> dict[str, int]:
        """Bytes in CuPy's pool (``used``, ``reserved``), the device's ``free``/``total``, and the weights kept in
        pinned host memory (``host``, where there are any); CuPy keeps no peak."""
        pool = self.xp.get_default_memory_pool()
        free, total = self.xp.cuda.runtime.memGetInfo()
        info = {"used": pool.used_bytes(), "reserved": pool.total_bytes(), "free": free, "total": total}
        return info | ({"host": self._host_bytes} if self._host_bytes else {})

    def numerics(self) -> dict[str, str]:
        """int8 decode activations and 16-bit prefill matmuls, or float32 ones (``numerics.numerics``)."""
        from .numerics import numerics

        return numerics()

    def free_memory(self) -> int:
        """Bytes the device can still give: free device memory plus blocks CuPy's pool holds but does not use, within
        the pool's limit where one is set (``CUPY_GPU_MEMORY_LIMIT``)."""
        pool = self.xp.get_default_memory_pool()
        free, _ = self.xp.cuda.runtime.memGetInfo()
        limit = pool.get_limit()
        available = free + pool.free_bytes()
        return available if not limit else max(0, min(available, limit - pool.used_bytes()))

    def weights_nbytes(self, tensors: Iterable[TensorInfo]) -> int:
        """Weights stay as their raw GGUF blocks on the device, but for routed experts that :mod:`host_experts`
        keeps in host memory where the device is too small (those that the following uploads place there)."""
        tensors = list(tensors)
        self._on_host = host_experts.plan(tensors, self.free_memory(), available_host_memory())
        return sum(t.nbytes for t in tensors if t.name not in self._on_host)

    def release_scratch(self) -> None:
        """Free the blocks CuPy's pool caches but no array uses. A long prompt's chunks see a longer context each,
        so each asks for slightly larger scratch than the last, which the cached blocks no longer fit: the pool
        held 84 GB after a 32K prompt on 4 Flash-shaped layers (9.7 GB in use). Trimmed after every chunk it peaked
        at 20 GB, but every chunk paid for fresh allocations; trimmed once at the end, the memory goes back to other
        work, and under pressure the pool frees its cache by itself before it fails an allocation."""
        self.xp.get_default_memory_pool().free_all_blocks()

    def concurrently(self, *branches: Callable[[], Any]) -> tuple[Any, ...]:
        """The first branch on the current stream, each other on a stream of its own that waits for the work queued
        before the call; the current stream then waits for them all. Inside a capture the branches become parallel
        paths of the graph: a decode step's small launches keep few multiprocessors busy, so independent ones
        overlap. Branches are queued in order, and the device starts ready work roughly in that order, so the
        longest branch should come first. A branch may branch again.

        CuPy's pool hands a freed block only to later work of the stream that allocated it. Every branch starts
        after the work queued before the call, and a stream serves one branch until the outermost call has joined
        them all, so a block freed inside a branch is not reused under a running kernel of another branch. Each
        thread has streams of its own: a session on another thread never queues work on them, nor frees blocks there.
        """
        if len(branches) < 2:
            return tuple(branch() for branch in branches)
        cupy = self.xp
        mine = self._branches
        if not hasattr(mine, "streams"):
            mine.streams, mine.taken = [], 0
        outermost, first = mine.taken == 0, mine.taken
        mine.taken += len(branches) - 1
        while len(mine.streams) < mine.taken:
            mine.streams.append(cupy.cuda.Stream(non_blocking=True))
        current = cupy.cuda.get_current_stream()
        fork = current.record()
        results: list[Any] = [None] * len(branches)
        joins = []
        try:
            results[0] = branches[0]()
            for i, branch in enumerate(branches[1:], start=1):
                stream = mine.streams[first + i - 1]
                stream.wait_event(fork)
                with stream:
                    results[i] = branch()
                joins.append(stream.record())
        finally:
            for join in joins:
                current.wait_event(join)
            if outermost:
                mine.taken = 0
        return tuple(results)

    def capture(self, step: Callable[[], Any]) -> tuple[Any, Callable[[], Any] | None]:
        """Run ``step`` on a private stream, then record it as a CUDA graph replayed on the caller's stream.

        The real run fills a private memory pool with the step's scratch blocks, so recording allocates nothing new
        and the graph's scratch never returns to the shared pool (where other work could take it between replays).
        A step the device cannot record (a host round trip inside it) logs why and gets no graph. Both runs leave
        their hyper-connections' Sinkhorn iterations to later launches (:mod:`.split_hosting`).
        """
        from .split_hosting import hosting

        cupy = self.xp
        pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
        caller = cupy.cuda.get_current_stream()
        stream.wait_event(caller.record())
        with cupy.cuda.using_allocator(pool.malloc), stream:
            with hosting():
                outputs = step()
            try:
                stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    with hosting():
                        recorded = step()
                finally:
                    graph = stream.end_capture()
            except Exception as exc:  # any failure to record leaves the eager step, which worked
                get_logger(backend="cuda").warning("decode step not recorded as a CUDA graph; it runs eagerly",
                                                   reason=str(exc))
                caller.wait_event(stream.record())
                return outputs, None
        caller.wait_event(stream.record())

        def replay() -> Any:
            graph.launch(cupy.cuda.get_current_stream())
            return recorded

        replay.resources = (pool, stream, graph)  # alive as long as the replay
        return outputs, replay
