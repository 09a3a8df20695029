"""Recurrent-layer core ops on CUDA (same signatures as :mod:`ds4_core.ops_recurrent`), CuPy float32.

``short_conv`` and the token-by-token ``gated_delta_rule`` are kernels of ``kernels/recurrent.cu`` (one launch per
call, no host synchronisation, so a decode step can be captured as a CUDA graph). The chunked form is CuPy array
code over all heads at once: per chunk a batched triangular system and a few batched matmuls (cuBLAS).
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from ds4_core.backend import Weight
from ds4_core.errors import BackendError
from ds4_core.ops_recurrent import DELTA_CHUNK

from .modules import DELTA_RULE_DK, recurrent_module
from .ops import MAX_GRID_Y, values

F32 = cp.float32
_CONV_THREADS = 128
#: Value columns per block of the delta-rule kernel (one warp: more blocks spread the heads over the SMs).
_DELTA_COLUMNS = 32


def _f32(a: Any) -> Any:
    return cp.ascontiguousarray(a, dtype=F32)


def short_conv(x: Any, history: Any, weight: Weight, dilation: int = 1) -> tuple[Any, Any]:
    """Causal depthwise conv: ``x [T, C]``, ``history [(K−1)·dilation, C]``, ``weight [C, K]`` -> (``y``, history)."""
    T, C = x.shape
    taps = weight.shape[1]
    span = (taps - 1) * dilation
    if history.shape != (span, C):
        raise ValueError(f"history has shape {history.shape}; kernel {taps} with dilation {dilation} over {C} "
                         f"channels needs ({span}, {C})")
    y = cp.empty((T, C), dtype=F32)
    new_history = cp.empty((span, C), dtype=F32)
    rows = max(T, span)
    if rows and C:
        grid = (-(-C // _CONV_THREADS), min(rows, MAX_GRID_Y))
        recurrent_module().get_function("short_conv")(
            grid, (_CONV_THREADS,),
            (_f32(x), _f32(history), _f32(values(weight)), np.int32(T), np.int32(C), np.int32(taps),
             np.int32(dilation), y, new_history))
    return y, new_history


def _delta_rule_kernel(dk: int) -> Any:
    bound = next((b for b in DELTA_RULE_DK if b >= dk), None)
    if bound is None:
        raise BackendError(f"the CUDA delta-rule kernel holds key heads of up to {DELTA_RULE_DK[-1]} channels, "
                           f"this model has {dk}; use --backend numpy")
    return recurrent_module().get_function(f"delta_rule<{bound}>")


def gated_delta_rule(q: Any, k: Any, v: Any, log_decay: Any, beta: Any, state: Any) -> tuple[Any, Any]:
    """The gated delta rule token by token: ``q``, ``k [T, H, dk]``, ``v [T, H, dv]``, ``log_decay [T, H]`` or
    ``[T, H, dk]``, ``beta [T, H]``, ``state [H, dk, dv]`` (not modified) -> (``o [T, H, dv]``, new state)."""
    T, H, dk = k.shape
    dv = v.shape[2]
    g = _f32(log_decay)
    if g.shape not in ((T, H), (T, H, dk)):
        raise ValueError(f"log_decay has shape {g.shape}; it must be [T, H] {(T, H)} or [T, H, dk] {(T, H, dk)}")
    out = cp.empty((T, H, dv), dtype=F32)
    new_state = cp.empty((H, dk, dv), dtype=F32)
    grid = (-(-dv // _DELTA_COLUMNS), H)
    _delta_rule_kernel(dk)(
        grid, (_DELTA_COLUMNS,),
        (_f32(q), _f32(k), _f32(v), g, np.int32(g.ndim == 3), _f32(beta), _f32(state), new_state, out,
         np.int32(T), np.int32(H), np.int32(dk), np.int32(dv)))
    return out, new_state


def gated_delta_rule_chunked(q: Any, k: Any, v: Any, log_decay: Any, beta: Any, state: Any,
                             chunk: int = DELTA_CHUNK) -> tuple[Any, Any]:
    """:func:`gated_delta_rule` ``chunk`` tokens at a time (the chunked form of :mod:`ds4_core.ops_recurrent`)."""
    T, H = k.shape[:2]
    g = _f32(log_decay)
    if g.shape == (T, H):
        g = g[..., None]
    per_channel = g.shape[-1] != 1
    S = cp.array(state, dtype=F32)
    out = cp.empty(v.shape, dtype=F32)
    for start in range(0, T, chunk):
        part = slice(start, start + chunk)
        qc, kc, vc = (cp.swapaxes(a[part], 0, 1).astype(F32) for a in (q, k, v))  # [H, C, d]
        bc = cp.swapaxes(beta[part], 0, 1).astype(F32)  # [H, C]
        G = cp.cumsum(cp.swapaxes(g[part], 0, 1), axis=1, dtype=F32)  # [H, C, dk']
        C = qc.shape[1]
        causal = cp.tril(cp.ones((C, C), dtype=bool))
        diff = G[:, :, None, :] - G[:, None, :, :]  # [H, t, s, dk']
        decay = cp.exp(cp.where(causal[None, :, :, None], diff, -cp.inf)).astype(F32)
        if per_channel:
            kk = (kc[:, :, None, :] * kc[:, None, :, :] * decay).sum(axis=-1)
            qk = (qc[:, :, None, :] * kc[:, None, :, :] * decay).sum(axis=-1)
        else:
            kk = cp.matmul(kc, cp.swapaxes(kc, 1, 2)) * decay[..., 0]
            qk = cp.matmul(qc, cp.swapaxes(kc, 1, 2)) * decay[..., 0]
        A = cp.where(cp.tril(cp.ones((C, C), dtype=bool), -1), kk, 0) * bc[:, :, None]
        lhs = cp.eye(C, dtype=F32) + A
        eG = cp.exp(G)
        U = cp.linalg.solve(lhs, bc[:, :, None] * vc)
        Wk = cp.linalg.solve(lhs, bc[:, :, None] * eG * kc)
        delta = (U - cp.matmul(Wk, S)).astype(F32)
        o = cp.matmul(eG * qc, S) + cp.matmul(qk, delta)
        out[part] = cp.swapaxes(o, 0, 1)
        last = G[:, -1:, :]  # [H, 1, dk']
        S = (cp.exp(last[:, 0, :])[:, :, None] * S
             + cp.matmul(cp.swapaxes(cp.exp(last - G) * kc, 1, 2), delta)).astype(F32)
    return out, S
