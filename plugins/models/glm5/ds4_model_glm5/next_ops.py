"""GLM-5.3-Flash-only ops (numpy references): hyper-connections, pool softmax, and the KDA short conv and recurrence.

``S [T, n, D]`` is the residual state of ``n`` streams per token. KDA tensors are per token and head:
``q``, ``k`` ``[T, h, dk]``, ``v`` ``[T, h, dv]``, log-decay ``g [T, h, dk]`` (one per key channel),
``beta [T, h]``; the recurrent state is ``[h, dk, dv]`` float32. Registered for backend ``"numpy"``
through ``register_kernels`` (names in :mod:`.next_opnames`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ds4_core.backend import Weight

F32 = np.float32
#: Tokens per block of :func:`kda_chunked`; its decays are taken pairwise inside a block, so any size is exact.
KDA_CHUNK = 16
_L2_EPS = 1e-6


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


def kda_short_conv(x: np.ndarray, history: np.ndarray, weight: Weight) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution + SiLU over ``x [T, C]`` after ``history [K−1, C]`` (the previous inputs).

    ``weight [C, 1, K]``: tap ``K−1`` multiplies the current row. Returns (``[T, C]``, the new history
    ``[K−1, C]``, i.e. the last ``K−1`` input rows).
    """
    K = weight.shape[-1]
    w = weight.data.reshape(-1, K)
    full = np.concatenate([history, x]).astype(F32)
    T = x.shape[0]
    y = np.zeros(x.shape, dtype=F32)
    for j in range(K):
        y += full[j:j + T] * w[:, j]
    return (y / (1 + np.exp(-y))).astype(F32), full[full.shape[0] - (K - 1):].copy()


def _l2norm(x: np.ndarray) -> np.ndarray:
    return (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + F32(_L2_EPS))).astype(F32)


def kda_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                  state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kimi delta attention, one token at a time (the definition, spec §6.3).

    ``q``/``k`` are L2-normalised here (``q`` also scaled by ``dk^-0.5``). Per token:
    ``S = diag(exp g)·S;  S += k·(β(v − Sᵀk))ᵀ;  o = Sᵀq``. Returns (``o [T, h, dv]``, final state ``[h, dk, dv]``).
    """
    q = _l2norm(q) * F32(q.shape[-1] ** -0.5)
    k = _l2norm(k)
    S = np.array(state, dtype=F32)
    out = np.empty(v.shape, dtype=F32)
    decay = np.exp(g).astype(F32)
    for t in range(q.shape[0]):
        S *= decay[t][:, :, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], S))
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], S)
    return out, S


def kda_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same map as :func:`kda_recurrent`, computed :data:`KDA_CHUNK` tokens at a time (prefill form).

    Inside a block with cumulative log-decays ``G_t = Σ_{s≤t} g_s`` the deltas solve the unit lower-triangular
    system ``(I + L)·Δ = β ⊙ (V − (e^G ⊙ K)·S₀)`` with ``L[t, j] = β_t Σ_c k_t k_j e^{G_t − G_j}`` (j < t);
    every exponent is ≤ 0, so nothing overflows. Same arguments and result as :func:`kda_recurrent`.
    """
    q = _l2norm(q) * F32(q.shape[-1] ** -0.5)
    k = _l2norm(k)
    S = np.array(state, dtype=F32)
    out = np.empty(v.shape, dtype=F32)
    for start in range(0, q.shape[0], KDA_CHUNK):
        part = slice(start, start + KDA_CHUNK)
        out[part], S = _kda_block(q[part], k[part], v[part], g[part], beta[part], S)
    return out, S


def _kda_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
               S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    C = q.shape[0]
    G = np.cumsum(g.astype(np.float64), axis=0).astype(F32)  # [C, h, dk]
    pair = np.exp(np.minimum(G[:, None] - G[None, :], 0))  # [C(t), C(j), h, dk]; only j <= t is used
    lower = np.tril(np.ones((C, C), dtype=bool), -1)
    kk = np.einsum("thc,jhc,tjhc->htj", k, k, pair, dtype=F32) * beta.T[:, :, None]
    kk = np.where(lower[None], kk, 0)
    rhs = beta.T[:, :, None] * (v.transpose(1, 0, 2) - np.einsum("thc,hcv->htv", np.exp(G) * k, S, dtype=F32))
    delta = np.linalg.solve(np.eye(C, dtype=F32)[None] + kk, rhs).astype(F32)  # [h, C, dv]
    qk = np.einsum("thc,jhc,tjhc->htj", q, k, pair, dtype=F32)
    qk = np.where(np.tril(np.ones((C, C), dtype=bool))[None], qk, 0)
    out = np.einsum("thc,hcv->thv", np.exp(G) * q, S, dtype=F32) + np.einsum("htj,hjv->thv", qk, delta, dtype=F32)
    tail = np.exp(G[-1][None] - G)  # [C, h, dk]
    S = np.exp(G[-1])[:, :, None] * S + np.einsum("jhc,hjv->hcv", tail * k, delta, dtype=F32)
    return out.astype(F32), S.astype(F32)


NEXT_OPS: dict[str, Callable] = {op.__name__: op for op in (
    glm5_hc_pre, glm5_hc_post, glm5_pool_softmax, kda_short_conv, kda_recurrent, kda_chunked)}
