"""DeepSeek-V4-only ops on CUDA (same signatures as ``ds4_model_deepseek4.ops`` and ``.qat``), CuPy float32."""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp

from ds4_core.backend import Weight

from .ops import linear, values

F32 = cp.float32


def _sigmoid(x: Any) -> Any:
    return (1 / (1 + cp.exp(-x))).astype(F32)


def _hc_mix(S: Any, fn: Weight, norm_eps: float) -> Any:
    flat = S.reshape(S.shape[0], -1).astype(F32)
    z = flat / cp.sqrt(cp.mean(flat * flat, axis=-1, keepdims=True) + F32(norm_eps))
    return linear(z, fn)


def hc_pre(S: Any, fn: Weight, scale: Weight, base: Weight, iters: int, eps: float,
           norm_eps: float) -> tuple[Any, Any, Any]:
    """``S [T, n, D]`` -> (``c [T, D]``, ``post [T, n]``, ``comb [T, n, n]``), Sinkhorn-balanced ``comb``."""
    n = S.shape[1]
    mix = _hc_mix(S, fn, norm_eps)
    b, s = values(base), values(scale)
    pre = _sigmoid(mix[:, :n] * s[0] + b[:n]) + F32(eps)
    post = 2 * _sigmoid(mix[:, n:2 * n] * s[1] + b[n:2 * n])
    logits = mix[:, 2 * n:].reshape(-1, n, n) * s[2] + b[2 * n:].reshape(n, n)
    comb = cp.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + F32(eps)
    comb = comb / (comb.sum(axis=-2, keepdims=True) + F32(eps))
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + F32(eps))
        comb = comb / (comb.sum(axis=-2, keepdims=True) + F32(eps))
    c = cp.einsum("tn,tnd->td", pre, S)
    return c.astype(F32), post.astype(F32), comb.astype(F32)


def hc_post(S: Any, y: Any, post: Any, comb: Any) -> Any:
    """``S'_k = post_k · y + Σ_i comb[i, k] · S_i``; ``S [T, n, D]`` -> ``[T, n, D]``."""
    return (post[:, :, None] * y[:, None, :] + cp.einsum("tik,tid->tkd", comb, S)).astype(F32)


def hc_head(S: Any, fn: Weight, scale: Weight, base: Weight, eps: float, norm_eps: float) -> Any:
    """Final collapse of the streams ``S [T, n, D]`` -> ``[T, D]``."""
    w = _sigmoid(_hc_mix(S, fn, norm_eps) * values(scale)[0] + values(base)) + F32(eps)
    return cp.einsum("tn,tnd->td", w, S).astype(F32)


def softmax_pool(kv: Any, gate: Any) -> Any:
    """Per channel, softmax of ``gate [N, S, d]`` over slots weights ``kv [N, S, d]`` -> ``[N, d]``."""
    p = cp.exp(gate - gate.max(axis=1, keepdims=True))
    p = p / p.sum(axis=1, keepdims=True)
    return cp.sum(p * kv, axis=1).astype(F32)


_E4M3 = (448.0, 3, -6)
_E2M1 = (6.0, 1, 0)


def _round_minifloat(x: Any, mantissa_bits: int, min_exp: int) -> Any:
    mag = cp.abs(x).astype(F32)
    exp = cp.floor(cp.log2(cp.maximum(mag, F32(2.0 ** min_exp))))
    quantum = cp.exp2(exp - mantissa_bits).astype(F32)
    return (cp.sign(x) * cp.rint(mag / quantum) * quantum).astype(F32)


def _block_round(x: Any, fmt: tuple[float, int, int], amax_floor: float) -> Any:
    top, mantissa_bits, min_exp = fmt
    amax = cp.maximum(cp.abs(x).max(axis=-1, keepdims=True), F32(amax_floor)).astype(F32)
    scale = cp.exp2(cp.ceil(cp.log2(amax / F32(top)))).astype(F32)
    return (_round_minifloat(cp.clip(x / scale, -top, top), mantissa_bits, min_exp) * scale).astype(F32)


def fp8_kv_round(x: Any, rope_dim: int, block: int = 64) -> Any:
    """FP8 E4M3 round-trip of the leading ``d − rope_dim`` channels of ``x [..., d]`` in blocks of ``block``."""
    out = cp.array(x, dtype=F32)
    nope = x.shape[-1] - rope_dim
    for start in range(0, nope, block):
        stop = min(start + block, nope)
        out[..., start:stop] = _block_round(out[..., start:stop], _E4M3, 1e-4)
    return out


@functools.cache
def _hadamard(d: int) -> Any:
    from ds4_model_deepseek4.qat import hadamard

    return cp.asarray(hadamard(d))


def fp4_hadamard_round(x: Any, block: int = 32) -> Any:
    """Hadamard rotation of ``x [..., d]``, then an FP4 E2M1 round-trip in blocks of ``block``."""
    d = x.shape[-1]
    y = cp.matmul(cp.asarray(x, dtype=F32), _hadamard(d))
    blocks = y.reshape(*y.shape[:-1], d // block, block)
    return _block_round(blocks, _E2M1, 6.0 * 2.0 ** -126).reshape(y.shape)


DEEPSEEK4_OPS = {
    "hc_pre": hc_pre,
    "hc_post": hc_post,
    "hc_head": hc_head,
    "softmax_pool": softmax_pool,
    "fp8_kv_round": fp8_kv_round,
    "fp4_hadamard_round": fp4_hadamard_round,
}
