"""Core ops of manifold-constrained hyper-connections (mHC) and softmax pooling (DeepSeek V4, GLM 5.3 Flash).

``S [T, n, D]`` is the residual state of ``n`` streams per token. Same conventions as :mod:`ds4_core.ops`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .backend import Weight

F32 = np.float32


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + e^-x)`` in float32; ``e^-x`` overflowing to infinity for very negative ``x`` gives the exact 0."""
    with np.errstate(over="ignore"):
        return (1 / (1 + np.exp(-x))).astype(F32)


def _hc_mix(S: np.ndarray, fn: Weight, norm_eps: float) -> np.ndarray:
    """``UnweightedRMSNorm(flat S) @ fn.T``: ``S [T, n, D]`` -> ``[T, rows of fn]``."""
    flat = S.reshape(S.shape[0], -1).astype(F32)
    z = flat / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + F32(norm_eps))
    return np.matmul(z, fn.data.T, dtype=F32)


def hc_pre(S: np.ndarray, fn: Weight, scale: Weight, base: Weight, iters: int, eps: float,
           norm_eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hyper-connection weights and collapsed sub-block input.

    ``S [T, n, D]``, ``fn [(2+n)·n, n·D]``, ``scale [3]``, ``base [(2+n)·n]`` -> (``c [T, D]``,
    ``post [T, n]``, ``comb [T, n, n]``): ``c = Σ_i pre_i S_i``; ``comb`` is the Sinkhorn-balanced
    mixing matrix (one column pass, then ``iters − 1`` row/column passes).
    """
    n = S.shape[1]
    mix = _hc_mix(S, fn, norm_eps)
    b, s = base.data, scale.data
    pre = sigmoid(mix[:, :n] * s[0] + b[:n]) + F32(eps)
    post = 2 * sigmoid(mix[:, n:2 * n] * s[1] + b[n:2 * n])
    logits = mix[:, 2 * n:].reshape(-1, n, n) * s[2] + b[2 * n:].reshape(n, n)
    comb = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + F32(eps)
    comb = comb / (comb.sum(axis=-2, keepdims=True) + F32(eps))
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + F32(eps))
        comb = comb / (comb.sum(axis=-2, keepdims=True) + F32(eps))
    c = np.einsum("tn,tnd->td", pre, S, dtype=F32)
    return c, post.astype(F32), comb.astype(F32)


def hc_post(S: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Merge a sub-block output back: ``S'_k = post_k · y + Σ_i comb[i, k] · S_i``.

    ``S [T, n, D]``, ``y [T, D]``, ``post [T, n]``, ``comb [T, n, n]`` -> ``[T, n, D]``.
    """
    return (post[:, :, None] * y[:, None, :] + np.einsum("tik,tid->tkd", comb, S, dtype=F32)).astype(F32)


def hc_head(S: np.ndarray, fn: Weight, scale: Weight, base: Weight, eps: float, norm_eps: float) -> np.ndarray:
    """Final collapse of the streams: ``S [T, n, D]``, ``fn [n, n·D]``, ``scale [1]``, ``base [n]`` -> ``[T, D]``."""
    w = sigmoid(_hc_mix(S, fn, norm_eps) * scale.data[0] + base.data) + F32(eps)
    return np.einsum("tn,tnd->td", w, S, dtype=F32)


def softmax_pool(kv: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """Compressor pooling: per channel, softmax of ``gate`` over the slot axis weights ``kv``.

    ``kv``, ``gate`` ``[N, S, d]`` (a ``-inf`` gate gives its slot weight 0) -> ``[N, d]``.
    """
    p = np.exp(gate - gate.max(axis=1, keepdims=True))
    p = p / p.sum(axis=1, keepdims=True)
    return np.sum(p * kv, axis=1, dtype=F32)


HC_OPS: dict[str, Callable] = {
    "hc_pre": hc_pre,
    "hc_post": hc_post,
    "hc_head": hc_head,
    "softmax_pool": softmax_pool,
}
