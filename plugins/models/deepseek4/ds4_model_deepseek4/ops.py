"""DeepSeek-V4-only ops (numpy references): the QAT roundings of spec §10.

Registered for backend ``"numpy"`` through ``register_kernels`` (names in :mod:`.opnames`). The
hyper-connection and compressor-pool ops the graph also uses are core ops (:mod:`ds4_core.ops_hc`).
"""

from __future__ import annotations

from collections.abc import Callable

from .qat import fp4_hadamard_round, fp8_kv_round

DEEPSEEK4_OPS: dict[str, Callable] = {
    "fp8_kv_round": fp8_kv_round,
    "fp4_hadamard_round": fp4_hadamard_round,
}
