"""Device side of ``ds4 bench``: random valid weight blocks in GPU memory, a decode step as a fixed list of the
backend's own launches (capturable as one CUDA graph), CUDA-event timing and the device's measured ceilings
(a device-to-device copy for HBM bandwidth, a bf16 cuBLAS matmul for tensor cores).

Weights are random *valid* GGUF blocks (scales finite, codes uniform), made on the host for a template of
blocks and tiled across device buffers, so no file and no host-sized memory are needed. CuPy is imported inside
the functions, so the package imports without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ds4_core.quants import block_geometry, random_blocks

_TEMPLATE_BLOCKS = 1 << 16


def device_blocks(qtype: str, rows: int, ncols: int) -> Any:
    """A CuPy ``uint8 [rows, row bytes]`` of valid random ``qtype`` blocks (a host template tiled by doubling)."""
    import cupy as cp

    qk, size = block_geometry(qtype)
    n = rows * ncols // qk
    out = cp.empty((n, size), dtype=cp.uint8)
    m = min(n, _TEMPLATE_BLOCKS)
    out[:m] = cp.asarray(_template(qtype)[:m])
    while m < n:
        step = min(m, n - m)
        out[m:m + step] = out[:step]
        m += step
    return out.reshape(rows, -1)


@functools.cache
def _template(qtype: str) -> np.ndarray:
    return random_blocks(qtype, _TEMPLATE_BLOCKS, np.random.default_rng(list(qtype.encode())))


@attrs.define
class Launch:
    """One kernel launch of a step, with the bytes of weights or state it must read."""

    kernel: Any
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple
    nbytes: int


@attrs.define
class Step:
    """A decode step as a fixed list of launches over preallocated buffers (capturable as a CUDA graph)."""

    launches: list[Launch]
    outputs: list[Any]

    @property
    def nbytes(self) -> int:
        return sum(launch.nbytes for launch in self.launches)

    def __add__(self, other: Step) -> Step:
        return Step(self.launches + other.launches, self.outputs + other.outputs)

    def run(self) -> None:
        for launch in self.launches:
            launch.kernel(launch.grid, launch.block, launch.args)


class StepBuilder:
    """Appends the backend's GEMV and routed-expert launches (``ds4_backend_cuda.ops``) over fresh buffers."""

    def __init__(self, rng: np.random.Generator):
        import cupy as cp

        self.cp, self.rng = cp, rng
        self.launches: list[Launch] = []
        self.outputs: list[Any] = []

    def step(self) -> Step:
        return Step(self.launches, self.outputs)

    def gemv(self, qtype: str, rows: int, ncols: int, groups: int = 1) -> None:
        """One launch of the backend's GEMV; ``groups > 1``: a block-diagonal projection (one x per group)."""
        from ds4_backend_cuda.gemv import gemv_launch

        cp = self.cp
        w = device_blocks(qtype, groups * rows, ncols)
        x = cp.asarray(self.rng.standard_normal(groups * ncols, dtype=np.float32))
        y = cp.empty(groups * rows, dtype=cp.float32)
        self.outputs.append(y)
        kernel, grid, block, args = gemv_launch(w, qtype, ncols, x, 1, y, groups * ncols,
                                                rows if groups > 1 else None)
        self.launches.append(Launch(kernel, grid, block, args, w.nbytes))

    def _experts(self, qtype: str, experts: int, rows: int, ncols: int) -> Any:
        from ds4_core.backend import Weight

        return Weight("w", qtype, (experts, rows, ncols), device_blocks(qtype, experts * rows, ncols))

    def gate_up(self, qtype: str, experts: int, rows: int, ncols: int, idx: Any, x: Any,
                quantized: bool = False) -> tuple[Any, Any]:
        """The fused routed gate/up/SwiGLU launch for the pairs ``idx`` against one token ``x [1, ncols]`` -> (its
        output, with ``quantized`` the output also written as the down projections' int8 activation, else None)."""
        from ds4_backend_cuda.gemv import act_bytes, moe_gate_up_launch

        gate, up = (self._experts(qtype, experts, rows, ncols) for _ in range(2))
        pairs = idx.shape[0]
        h = self.cp.empty((pairs, rows), dtype=self.cp.float32)
        act = self.cp.empty(act_bytes(h.size), self.cp.uint8) if quantized else None
        self.outputs.append(h)
        kernel, grid, block, args = moe_gate_up_launch(gate, up, idx, x, pairs, 0.0, h, act_out=act)
        self.launches.append(Launch(kernel, grid, block, args, 2 * pairs * rows * gate.data.shape[1]))
        return h, act

    def down(self, qtype: str, experts: int, rows: int, ncols: int, idx: Any, h: Any, act: Any = None) -> Any:
        """The routed experts' down projections of one token's pairs ``idx`` (``h [pairs, ncols]``): with ``act``,
        its quantized form, their weighted sum in the same launch (``moe_down_sum_launch``), else one GEMV a
        pair."""
        from ds4_backend_cuda.gemv import moe_down_sum_launch, moe_gemv_launch

        cp = self.cp
        w = self._experts(qtype, experts, rows, ncols)
        pairs = idx.shape[0]
        if act is not None:
            y = cp.empty((1, rows), dtype=cp.float32)
            weights = cp.full((1, pairs), 1 / pairs, dtype=cp.float32)
            kernel, grid, block, args = moe_down_sum_launch(w, idx, pairs, h, weights, y, act_in=act)
        else:
            y = cp.empty((pairs, rows), dtype=cp.float32)
            kernel, grid, block, args = moe_gemv_launch(w, idx, h, 1, y)
        self.outputs.append(y)
        self.launches.append(Launch(kernel, grid, block, args, pairs * rows * w.data.shape[1]))
        return y


def time_on_stream(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` on the current stream, by CUDA events, after two warm-up calls."""
    import cupy as cp

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def peak_pool(fn: Callable[[], Any]) -> tuple[int, int]:
    """(peak pool bytes, growth during ``fn``): what CuPy's pool holds after one call, from a trimmed pool."""
    import cupy as cp

    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    fn()
    cp.cuda.get_current_stream().synchronize()
    return pool.total_bytes(), pool.total_bytes() - before


def copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """HBM bandwidth in bytes/s from a device-to-device copy of ``nbytes`` (bytes read + written ÷ time)."""
    import cupy as cp

    src = cp.empty(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    seconds = time_on_stream(lambda: dst.data.copy_from_device_async(src.data, nbytes), repeats)
    return 2 * nbytes / seconds


def bf16_matmul_rate(n: int = 8192, repeats: int = 10) -> tuple[float, str]:
    """(FLOP/s, how) of an ``n³`` bf16 cuBLAS matmul (through torch when present, else fp16 through CuPy)."""
    try:
        import torch

        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        seconds = _time_torch(lambda: torch.matmul(a, b), repeats)
        return 2 * n**3 / seconds, "bf16 cuBLAS via torch"
    except ImportError:
        import cupy as cp

        a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
        seconds = time_on_stream(lambda: cp.matmul(a, a), repeats)
        return 2 * n**3 / seconds, "fp16 cuBLAS via CuPy (no torch)"


def _time_torch(fn: Callable[[], Any], repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return float(np.median(times))
