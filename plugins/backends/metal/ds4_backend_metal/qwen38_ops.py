"""Qwen3.8-only ops (:mod:`ds4_model_qwen38.ops`) on MLX arrays: rotate-half RoPE, the hyper-connection mixer,
masked GQA attention and the softmax router."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ds4_core.backend import Weight

from .ops import _dense, topk

F32 = mx.float32


def rope_half(x: mx.array, positions: mx.array, inv_freq: Any) -> mx.array:
    """Rotate-half RoPE on the leading ``2·len(inv_freq)`` channels of ``x [T, ..., d]``; the rest pass through."""
    inv_freq = inv_freq if isinstance(inv_freq, mx.array) else mx.array(inv_freq, dtype=F32)
    half = inv_freq.shape[0]
    angles = mx.array(positions).astype(F32)[:, None] * inv_freq.astype(F32)[None, :]
    angles = angles.reshape(angles.shape[:1] + (1,) * (x.ndim - 2) + (half,))
    cos, sin = mx.cos(angles), mx.sin(angles)
    x = x.astype(F32)
    a, b = x[..., :half], x[..., half:2 * half]
    return mx.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., 2 * half:]], axis=-1)


def hc_mix(H: mx.array, norm: Weight, down: Weight, up: Weight, inject: Weight | None,
           eps: float) -> tuple[mx.array, mx.array | None]:
    """A hyper-connection site: ``H [T, n, D]`` -> (block input ``[T, D]``, injection weights ``[T, n]`` or
    ``None``); see the numpy reference for the formula."""
    T, n, D = H.shape
    H = H.astype(F32)
    Hn = H / mx.sqrt(mx.mean(H * H, axis=-1, keepdims=True) + eps) * norm.data.astype(F32).reshape(n, D)
    flat = Hn.reshape(T, n * D)
    a = mx.matmul(flat, _dense(down.data).T) / n
    a = a * mx.sigmoid(a)
    m = mx.sigmoid(mx.matmul(a, _dense(up.data).T)).reshape(T, n, D)
    x = mx.mean(m * Hn, axis=1)
    if inject is None:
        return x, None
    return x, 2 * mx.sigmoid(mx.matmul(flat, _dense(inject.data).T) / n)


def gqa_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float) -> mx.array:
    """Grouped-query attention under a bool mask: ``q [T, H, d]``, ``k [N, G, d]``, ``v [N, G, dv]`` (query head
    ``h`` reads group ``h // (H/G)``), ``mask [T, N]`` (True = visible) -> ``[T, H, dv]``.

    MLX's fused attention (the same head grouping) keeps the ``[H, T, N]`` scores off the device memory on a Mac.
    """
    heads_first = [a.astype(F32).swapaxes(0, 1)[None] for a in (q, k, v)]  # [1, heads, tokens, d]
    o = mx.fast.scaled_dot_product_attention(*heads_first, scale=scale, mask=mask)
    return o[0].swapaxes(0, 1)


def moe_route_softmax(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Softmax router: ``logits [T, E]`` -> (top-k expert ids int32 ``[T, k]``, their probabilities ``[T, k]``,
    renormalised to sum 1 if ``normalize``)."""
    p = mx.softmax(logits.astype(F32), axis=-1, precise=True)
    idx = topk(p, k)
    w = mx.take_along_axis(p, idx, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx, w
