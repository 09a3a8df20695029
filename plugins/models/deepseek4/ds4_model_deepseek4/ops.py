"""DeepSeek-V4-only ops (numpy references): the QAT roundings of spec §10, the fused compressor step and shared
expert.

Registered for backend ``"numpy"`` through ``register_kernels`` (names in :mod:`.opnames`). The
hyper-connection and compressor-pool ops the graph also uses are core ops (:mod:`ds4_core.ops_hc`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds4_core.backend import Ops
from ds4_core.backends.numpy import NumpyBackend
from ds4_core.ops import CORE_OPS

from .model import compose_compress_step, compose_shared_expert
from .qat import fp4_hadamard_round, fp8_kv_round

_NUMPY_OPS = Ops(NumpyBackend(), CORE_OPS)


def compress_step(kv_row: Any, gate_row: Any, ape: Any, pos: Any, buf_kv: Any, buf_gate: Any, prev_kv: Any,
                  prev_gate: Any, rows: Any, norm: Any, eps: float, inv_freq: Any) -> Any:
    """One token through a compressor (:func:`.model.compose_compress_step` over the core numpy ops), the reference
    of backends that run the step in fewer launches; arrays written in place, returns ``rows``."""
    return compose_compress_step(_NUMPY_OPS, kv_row, gate_row, ape, pos, buf_kv, buf_gate, prev_kv, prev_gate, rows,
                                 norm, eps, inv_freq)


def shared_expert(x: Any, gate: Any, up: Any, down: Any, limit: float) -> Any:
    """The shared expert (:func:`.model.compose_shared_expert` over the core numpy ops), the reference of backends
    that run its gate and up projections and the SwiGLU in one launch."""
    return compose_shared_expert(_NUMPY_OPS, x, gate, up, down, limit)


DEEPSEEK4_OPS: dict[str, Callable] = {
    "fp8_kv_round": fp8_kv_round,
    "fp4_hadamard_round": fp4_hadamard_round,
    "compress_step": compress_step,
    "shared_expert": shared_expert,
}
