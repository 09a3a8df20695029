"""GLM-5.3-Flash-only ops (numpy references): manifold-constrained hyper-connections and the indexer's pool softmax.

``S [T, n, D]`` is the residual state of ``n`` streams per token. The KDA layers need no op of their own: they
use the core ``short_conv`` and ``gated_delta_rule(_chunked)`` with a per-channel decay. Registered for backend
``"numpy"`` through ``register_kernels`` (names in :mod:`.next_opnames`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ds4_core.backend import Weight

F32 = np.float32


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1 / (1 + np.exp(-x))).astype(F32)


def glm5_hc_pre(S: np.ndarray, fn: Weight, scale: Weight, base: Weight, iters: int, eps: float,
           norm_eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hyper-connection weights of one site and the collapsed block input (spec §6.2).

    ``S [T, n, D]``, ``fn [(2+n)·n, n·D]``, ``scale [3]``, ``base [(2+n)·n]`` -> (``x [T, D]``, ``post [T, n]``,
    ``comb [T, n, n]``): ``x = Σ_i pre_i S_i``; ``comb`` is balanced by Sinkhorn (a column pass, then
    ``iters − 1`` row/column passes).
    """
    n = S.shape[1]
    flat = S.reshape(S.shape[0], -1).astype(F32)
    mix = np.matmul(flat / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + F32(norm_eps)), fn.data.T,
                    dtype=F32)
    b, s = base.data, scale.data
    pre = _sigmoid(mix[:, :n] * s[0] + b[:n]) + F32(eps)
    post = 2 * _sigmoid(mix[:, n:2 * n] * s[1] + b[n:2 * n])
    logits = mix[:, 2 * n:].reshape(-1, n, n) * s[2] + b[2 * n:].reshape(n, n)
    comb = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + F32(eps)
    comb = comb / (comb.sum(axis=-2, keepdims=True) + F32(eps))
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + F32(eps))
        comb = comb / (comb.sum(axis=-2, keepdims=True) + F32(eps))
    return np.einsum("tn,tnd->td", pre, S, dtype=F32), post.astype(F32), comb.astype(F32)


def glm5_hc_post(S: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Merge a block output back into the streams: ``S'_k = post_k · y + Σ_i comb[i, k] · S_i``.

    ``S [T, n, D]``, ``y [T, D]``, ``post [T, n]``, ``comb [T, n, n]`` -> ``[T, n, D]``.
    """
    return (post[:, :, None] * y[:, None, :] + np.einsum("tik,tid->tkd", comb, S, dtype=F32)).astype(F32)


def glm5_pool_softmax(keys: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """Per-channel softmax pooling: ``keys``, ``gate`` ``[N, P, d]`` -> ``Σ_m softmax_m(gate)[n, m, c] · keys``,
    ``[N, d]``."""
    p = np.exp(gate - gate.max(axis=1, keepdims=True))
    return np.sum(p / p.sum(axis=1, keepdims=True) * keys, axis=1, dtype=F32)


NEXT_OPS: dict[str, Callable] = {op.__name__: op for op in (
    glm5_hc_pre, glm5_hc_post, glm5_pool_softmax)}
