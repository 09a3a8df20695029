"""The Metal backend object: weights in MLX form (quantized where exact), arrays as lazy ``mlx.core`` arrays.

``xp`` is ``mlx.core`` itself: the glue of the model graphs (``arange``, ``where``, ``concatenate``,
``take_along_axis``, slicing and index assignment into the preallocated state) has the same spelling in MLX.
MLX arrays are immutable values, but ``a[i] = v`` rebinds ``a`` to an updated array, which is exactly what the
graphs' in-place state updates need.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4_core.backend import Backend, Weight
from ds4_core.errors import BackendError
from ds4_core.quants import tensor_nbytes

_INTEGER_TYPES = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


class MetalBackend(Backend):
    """MLX on the default device (the Apple GPU on a Mac, the CPU elsewhere).

    A weight's ``data`` is an ``mx.array`` (float types keep their dtype; integer tables), a
    :class:`~ds4_backend_metal.quant.QuantMatrix` (Q8_0, Q4_0, Q4_K, MXFP4) or a
    :class:`~ds4_backend_metal.quant.RawBlocks` (IQ2_XXS / Q2_K experts). ``self_test`` (default on) checks the custom
    Metal kernels at start and enables those that pass.
    """

    name = "metal"

    def __init__(self, self_test: bool = True, **options: Any):
        try:
            import mlx.core as mx
        except ImportError as exc:
            raise BackendError("the Metal backend needs MLX: pip install mlx (or 'mlx[cpu]' on Linux)") from exc
        from . import kernels

        self.xp = mx
        self.options = options
        self.kernel_checks = kernels.verify_and_enable() if self_test else []

    def upload(self, name: str, qtype: str, shape: tuple[int, ...], raw: np.ndarray) -> Weight:
        from .quant import to_mlx

        host = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if qtype in _INTEGER_TYPES:
            return Weight(name, qtype, shape, self.xp.array(host.view(_INTEGER_TYPES[qtype]).reshape(shape)))
        try:
            nbytes = tensor_nbytes(qtype, shape)
        except Exception as exc:
            raise BackendError(f"tensor {name}: the Metal backend cannot hold it: {exc}") from exc
        if host.size != nbytes:
            raise BackendError(f"tensor {name}: {host.size} bytes for a {qtype} tensor of shape {shape} "
                               f"that needs {nbytes}; the file is damaged")
        return Weight(name, qtype, tuple(shape), to_mlx(qtype, tuple(shape), host))

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """A host array as an ``mx.array``; float64 becomes float32 (Apple GPUs have no float64)."""
        if isinstance(a, self.xp.array):
            return a if dtype is None else a.astype(dtype)
        host = np.asarray(a)
        if dtype is None and host.dtype == np.float64:
            dtype = self.xp.float32
        return self.xp.array(host, dtype=dtype)

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.array(a)

    def synchronize(self) -> None:
        self.xp.synchronize()

    def memory_info(self) -> dict[str, int]:
        """Bytes MLX holds (``used``) and its peak (``peak``)."""
        mx = self.xp
        return {"used": int(mx.get_active_memory()), "peak": int(mx.get_peak_memory())}
