"""Qwen3.8-only ops on CUDA (same signatures as ``ds4_model_qwen38.ops``), CuPy float32."""

from __future__ import annotations

from typing import Any

import cupy as cp

from ds4_core.backend import Weight

from .ops import contract_dot, contract_mix, linear, topk, values

F32 = cp.float32


def _sigmoid(x: Any) -> Any:
    return (1 / (1 + cp.exp(-x))).astype(F32)


def rope_half(x: Any, positions: Any, inv_freq: Any) -> Any:
    """Rotate-half RoPE on the leading ``2·len(inv_freq)`` channels of ``x [T, ..., d]``; the rest pass through."""
    half = inv_freq.shape[0]
    angles = cp.asarray(positions, dtype=F32)[:, None] * cp.asarray(inv_freq, dtype=F32)[None, :]
    angles = angles.reshape(angles.shape[:1] + (1,) * (x.ndim - 2) + (half,))
    cos, sin = cp.cos(angles), cp.sin(angles)
    out = cp.array(x, dtype=F32)
    a, b = x[..., :half], x[..., half:2 * half]
    out[..., :half] = a * cos - b * sin
    out[..., half:2 * half] = b * cos + a * sin
    return out


def hc_mix(H: Any, norm: Weight, down: Weight, up: Weight, inject: Weight | None,
           eps: float) -> tuple[Any, Any | None]:
    """A hyper-connection site: ``H [T, n, D]`` -> (block input ``[T, D]``, injection weights ``[T, n]`` or ``None``).

    ``norm [n·D]``, ``down [R, n·D]``, ``up [n·D, R]``, ``inject [n, n·D]`` or ``None``; see the numpy reference.
    """
    T, n, D = H.shape
    H = cp.asarray(H, dtype=F32)
    Hn = H / cp.sqrt(cp.mean(H * H, axis=-1, keepdims=True) + F32(eps)) * values(norm).reshape(n, D)
    flat = Hn.reshape(T, n * D)
    a = linear(flat, down) / F32(n)
    a = a * _sigmoid(a)
    m = _sigmoid(linear(a, up)).reshape(T, n, D)
    x = cp.mean(m * Hn, axis=1, dtype=F32)
    if inject is None:
        return x, None
    return x, 2 * _sigmoid(linear(flat, inject) / F32(n))


def gqa_attention(q: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
    """Grouped-query attention under ``mask [T, N]`` (bool, True = visible): ``q [T, H, d]``, ``k [N, G, d]``,
    ``v [N, G, dv]`` (head ``h`` reads group ``h // (H/G)``) -> ``[T, H, dv]``.

    One key group at a time through :func:`.ops.contract_dot` / :func:`.ops.contract_mix`: for a few tokens they
    avoid cuBLAS, so a decode step over the whole cache can be recorded as a CUDA graph."""
    G = k.shape[1]
    r = q.shape[1] // G
    q = cp.asarray(q, dtype=F32)
    logits = cp.concatenate([contract_dot(q[:, g * r:(g + 1) * r], k[:, g]) for g in range(G)], axis=1)
    logits = cp.where(mask[:, None, :], logits * F32(scale), -cp.inf)
    p = cp.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return cp.concatenate([contract_mix(p[:, g * r:(g + 1) * r], v[:, g]) for g in range(G)],
                          axis=1).astype(F32, copy=False)


def moe_route_softmax(logits: Any, k: int, normalize: bool) -> tuple[Any, Any]:
    """Softmax router: ``logits [T, E]`` -> (top-k ids int32 ``[T, k]``, their probabilities ``[T, k]``, renormalised
    to sum 1 if ``normalize``). Ties go to the lowest id."""
    z = cp.asarray(logits, dtype=F32)
    p = cp.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    idx = topk(p, k)
    w = cp.take_along_axis(p, idx, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx, w.astype(F32)
