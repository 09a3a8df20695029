"""The mHC and softmax-pool core ops (:mod:`ds4_core.ops_hc`) on MLX arrays, for DeepSeek V4 and GLM 5.3 Flash."""

from __future__ import annotations

import mlx.core as mx

from ds4_core.backend import Weight

from . import kernels
from .ops import _dense

F32 = mx.float32


def _hc_mix(S: mx.array, fn: Weight, norm_eps: float) -> mx.array:
    flat = S.reshape(S.shape[0], -1).astype(F32)
    z = flat / mx.sqrt(mx.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    return mx.matmul(z, _dense(fn.data).T)


def sinkhorn(logits: mx.array, iters: int, eps: float) -> mx.array:
    """The mHC mixing matrix from ``logits [T, n, n]``: row softmax (+eps), column pass, then ``iters − 1``
    row/column passes. The MLX-op path (and the reference of the custom ``sinkhorn`` kernel)."""
    comb = mx.softmax(logits, axis=-1, precise=True) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


# Twenty tiny row/column passes are dozens of ops per token: one compiled graph cuts their dispatch overhead.
_sinkhorn_compiled = mx.compile(sinkhorn)


def hc_pre(S: mx.array, fn: Weight, scale: Weight, base: Weight, iters: int, eps: float,
           norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """``S [T, n, D]`` -> (``c [T, D]``, ``post [T, n]``, ``comb [T, n, n]``), see the numpy reference."""
    n = S.shape[1]
    mix = _hc_mix(S, fn, norm_eps)
    b, s = base.data.astype(F32), scale.data.astype(F32)
    pre = mx.sigmoid(mix[:, :n] * s[0] + b[:n]) + eps
    post = 2 * mx.sigmoid(mix[:, n:2 * n] * s[1] + b[n:2 * n])
    logits = mix[:, 2 * n:].reshape(-1, n, n) * s[2] + b[2 * n:].reshape(n, n)
    custom = kernels.active("sinkhorn")
    comb = custom(logits, iters, eps) if custom is not None else _sinkhorn_compiled(logits, iters, eps)
    c = mx.einsum("tn,tnd->td", pre, S.astype(F32))
    return c, post, comb


def hc_post(S: mx.array, y: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """``S'_k = post_k · y + Σ_i comb[i, k] · S_i``: ``S [T, n, D]`` -> ``[T, n, D]``."""
    return post[:, :, None] * y[:, None, :] + mx.einsum("tik,tid->tkd", comb, S)


def hc_head(S: mx.array, fn: Weight, scale: Weight, base: Weight, eps: float, norm_eps: float) -> mx.array:
    """Final collapse of the streams ``S [T, n, D]`` -> ``[T, D]``."""
    w = mx.sigmoid(_hc_mix(S, fn, norm_eps) * scale.data.astype(F32)[0] + base.data.astype(F32)) + eps
    return mx.einsum("tn,tnd->td", w, S.astype(F32))


def softmax_pool(kv: mx.array, gate: mx.array) -> mx.array:
    """Per channel, softmax of ``gate`` over the slot axis weights ``kv``: ``[N, S, d]`` -> ``[N, d]``."""
    p = mx.exp(gate - gate.max(axis=1, keepdims=True))
    p = p / p.sum(axis=1, keepdims=True)
    return mx.sum(p * kv, axis=1)
