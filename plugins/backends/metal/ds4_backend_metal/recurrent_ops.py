"""The recurrent core ops (:mod:`ds4_core.ops_recurrent`) on MLX arrays: short conv and the gated delta rule.

``gated_delta_rule`` (decode: one token per call) runs the custom ``gated_delta_rule`` / ``gated_delta_rule_kda``
Metal kernel when its self-test passed, else :func:`delta_rule_steps`, its exact MLX-op path.
``gated_delta_rule_chunked`` (prefill) follows the numpy reference chunk by chunk; its unit-triangular solve runs
on MLX's CPU stream, because MLX has no GPU kernel for it (on a Mac the memory is shared, so nothing is copied).
"""

from __future__ import annotations

import mlx.core as mx

from ds4_core.backend import Weight
from ds4_core.ops_recurrent import DELTA_CHUNK

from . import kernels
from .ops import _dense

F32 = mx.float32


def short_conv(x: mx.array, history: mx.array, weight: Weight, dilation: int = 1) -> tuple[mx.array, mx.array]:
    """Causal depthwise conv over time: ``x [T, C]`` after ``history [(K−1)·dilation, C]`` with ``weight [C, K]``
    (tap ``K−1`` on the current input) -> ``(y [T, C], new history)``."""
    w = _dense(weight.data)
    taps = w.shape[1]
    span = (taps - 1) * dilation
    if history.shape[0] != span:
        raise ValueError(f"history has {history.shape[0]} rows; kernel {taps} with dilation {dilation} needs {span}")
    full = mx.concatenate([history.astype(F32), x.astype(F32)])
    T = x.shape[0]
    y = full[:T] * w[:, 0]
    for j in range(1, taps):
        y = y + full[j * dilation:j * dilation + T] * w[:, j]
    return y, full[full.shape[0] - span:]


def _decay_shape(log_decay: mx.array, k: mx.array) -> mx.array:
    """``log_decay`` as ``[T, H, dk']`` with ``dk'`` 1 (per head) or ``dk`` (per key channel)."""
    g = log_decay.astype(F32)
    if tuple(g.shape) == tuple(k.shape[:2]):
        return g[..., None]
    if tuple(g.shape) != tuple(k.shape):
        raise ValueError(f"log_decay has shape {g.shape}; it must be [T, H] {k.shape[:2]} or [T, H, dk] {k.shape}")
    return g


def _delta_step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                S: mx.array) -> tuple[mx.array, mx.array]:
    """One token: ``q``, ``k [H, dk]``, ``v [H, dv]``, ``g [H, dk']``, ``beta [H]``, ``S [H, dk, dv]``."""
    S = S * mx.exp(g)[:, :, None]
    u = mx.matmul(k[:, None, :], S)[:, 0]  # [H, dv]: what the memory returns for k
    S = S + k[:, :, None] * ((v - u) * beta[:, None])[:, None, :]
    return mx.matmul(q[:, None, :], S)[:, 0], S


# A decode step is a dozen tiny ops per layer: one compiled graph cuts their dispatch overhead.
_delta_step_compiled = mx.compile(_delta_step)


def delta_rule_steps(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                     state: mx.array) -> tuple[mx.array, mx.array]:
    """The gated delta rule token by token through MLX ops, with ``g [T, H, dk']`` already shaped (1 or ``dk``).

    The exact fallback of the custom ``gated_delta_rule`` kernels and their self-test reference.
    Returns ``(o [T, H, dv], new state [H, dk, dv])``.
    """
    S = state.astype(F32)
    q, k, v, beta = q.astype(F32), k.astype(F32), v.astype(F32), beta.astype(F32)
    out = []
    for t in range(q.shape[0]):
        o, S = _delta_step_compiled(q[t], k[t], v[t], g[t], beta[t], S)
        out.append(o)
    return mx.stack(out), S


def gated_delta_rule(q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array,
                     state: mx.array) -> tuple[mx.array, mx.array]:
    """The gated delta rule token by token: ``q``, ``k [T, H, dk]``; ``v [T, H, dv]``; ``log_decay [T, H]`` or
    ``[T, H, dk]``; ``beta [T, H]``; ``state [H, dk, dv]`` -> ``(o [T, H, dv], new state)``."""
    g = _decay_shape(log_decay, k)
    custom = kernels.active("gated_delta_rule_kda" if g.shape[-1] != 1 else "gated_delta_rule")
    return (custom or delta_rule_steps)(q, k, v, g, beta, state)


def _chunk(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
           S: mx.array) -> tuple[mx.array, mx.array]:
    """One chunk in closed form (see :func:`ds4_core.ops_recurrent.gated_delta_rule_chunked`); inputs heads first:
    ``q``, ``k [H, C, dk]``, ``v [H, C, dv]``, ``g [H, C, dk']``, ``beta [H, C]``. Returns ``(o [H, C, dv], S')``."""
    C, dv = q.shape[1], v.shape[-1]
    G = mx.cumsum(g, axis=1)  # [H, C, dk']
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    # Exponents masked to s <= t before exp, so nothing overflows whatever the decay.
    decay = mx.exp(mx.where(causal[None, :, :, None], G[:, :, None, :] - G[:, None, :, :], -mx.inf))  # [H, t, s, dk']
    if g.shape[-1] != 1:
        kk = mx.sum(k[:, :, None, :] * k[:, None, :, :] * decay, axis=-1)
        qk = mx.sum(q[:, :, None, :] * k[:, None, :, :] * decay, axis=-1)
    else:
        kk = mx.matmul(k, k.swapaxes(1, 2)) * decay[..., 0]
        qk = mx.matmul(q, k.swapaxes(1, 2)) * decay[..., 0]
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), -1)
    lhs = mx.eye(C, dtype=F32) + mx.where(strict, kk, 0) * beta[:, :, None]
    eG = mx.exp(G)
    rhs = mx.concatenate([beta[:, :, None] * v, beta[:, :, None] * eG * k], axis=-1)
    solved = mx.linalg.solve_triangular(lhs, rhs, upper=False, stream=mx.cpu)
    delta = solved[..., :dv] - mx.matmul(solved[..., dv:], S)  # the corrected writes [H, C, dv]
    o = mx.matmul(eG * q, S) + mx.matmul(qk, delta)
    last = G[:, -1:, :]
    S = mx.exp(last[:, 0, :])[:, :, None] * S + mx.matmul((mx.exp(last - G) * k).swapaxes(1, 2), delta)
    return o, S


def gated_delta_rule_chunked(q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array,
                             state: mx.array, chunk: int = DELTA_CHUNK) -> tuple[mx.array, mx.array]:
    """:func:`gated_delta_rule` computed ``chunk`` tokens at a time (same arguments, same result up to rounding)."""
    g = _decay_shape(log_decay, k)
    S = state.astype(F32)
    out = []
    for start in range(0, q.shape[0], chunk):
        part = slice(start, start + chunk)
        heads_first = [a[part].astype(F32).swapaxes(0, 1) for a in (q, k, v, g, beta)]
        o, S = _chunk(*heads_first, S)
        out.append(o.swapaxes(0, 1))
    return (out[0] if len(out) == 1 else mx.concatenate(out)), S
