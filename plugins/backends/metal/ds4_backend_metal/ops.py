"""The core op vocabulary (:mod:`ds4_core.ops`) on MLX arrays; same signatures, same numerics up to float rounding.

A weight's ``data`` is an ``mx.array`` (float), a :class:`~ds4_backend_metal.quant.QuantMatrix` or (expert tensors
of IQ2_XXS / Q2_K) a :class:`~ds4_backend_metal.quant.RawBlocks`. Everything stays lazy: no op reads a value back to
the host, so one token's graph is evaluated once, by the caller's ``to_numpy``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ds4_core.backend import Weight

from . import kernels
from .quant import QuantMatrix, RawBlocks, dequantize_matrix, dequantize_raw

F32 = mx.float32
# Queries per step of the gathering ops, so their temporaries stay small for long chunks.
_QUERY_BLOCK = 128


def _dense(data: Any) -> mx.array:
    """A weight payload as a float32 matrix (dequantizing if needed)."""
    if isinstance(data, QuantMatrix):
        return dequantize_matrix(data)
    if isinstance(data, RawBlocks):
        return dequantize_raw(data)
    return data.astype(F32)


def _matmul_t(x: mx.array, data: Any) -> mx.array:
    """``x @ W.T`` for any payload ``W [out, in]``."""
    if isinstance(data, QuantMatrix):
        return mx.quantized_matmul(x, data.w, data.scales, data.biases, transpose=True, **data.kwargs())
    if isinstance(data, RawBlocks):
        return mx.matmul(x, dequantize_raw(data).T)
    return mx.matmul(x, data.T.astype(F32))


def embed(w: Weight, ids: mx.array) -> mx.array:
    """Rows ``ids [T]`` of ``w [V, D]`` -> ``[T, D]``."""
    ids = mx.array(ids) if not isinstance(ids, mx.array) else ids
    if isinstance(w.data, QuantMatrix):
        return dequantize_matrix(w.data.rows(ids))
    if isinstance(w.data, RawBlocks):
        return dequantize_raw(RawBlocks(w.data.blocks[ids], w.data.qtype))
    return w.data[ids].astype(F32)


def linear(x: mx.array, w: Weight) -> mx.array:
    """``x [..., in] @ w.T`` with ``w [out, in]`` -> ``[..., out]``."""
    return _matmul_t(x.astype(F32), w.data)


def _split_groups(data: Any, groups: int) -> Any:
    """A payload ``[G·out, in]`` (or already ``[G, out, in]``) viewed as ``[G, out, in]``."""
    def split(a: mx.array) -> mx.array:
        return a.reshape(groups, -1, a.shape[-1])

    if isinstance(data, QuantMatrix):
        biases = None if data.biases is None else split(data.biases)
        return QuantMatrix(split(data.w), split(data.scales), biases, data.mode, data.bits)
    if isinstance(data, RawBlocks):
        return RawBlocks(split(data.blocks), data.qtype)
    return split(data)


def grouped_linear(x: mx.array, w: Weight) -> mx.array:
    """Block-diagonal projection: ``x [T, G, in]``, ``w [G·out, in]`` (group g's rows contiguous) or ``[G, out, in]``
    -> ``[T, G, out]``."""
    groups = x.shape[1]
    data = _split_groups(w.data, groups)
    xg = x.astype(F32).swapaxes(0, 1)  # [G, T, in]: one batched product per group
    if isinstance(data, QuantMatrix):
        y = mx.gather_qmm(xg, data.w, data.scales, data.biases, rhs_indices=mx.arange(groups), transpose=True,
                          **data.kwargs())
    else:
        y = mx.matmul(xg, _dense(data).swapaxes(-1, -2))
    return y.swapaxes(0, 1)


def rms_norm(x: mx.array, w: Weight | None, eps: float) -> mx.array:
    """``x · rsqrt(mean(x²) + eps) [· w]`` over the last axis."""
    x = x.astype(F32)
    y = x / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w.data.astype(F32)


def rope(x: mx.array, positions: mx.array, inv_freq: Any, inverse: bool = False) -> mx.array:
    """Interleaved RoPE on the trailing ``2·len(inv_freq)`` channels of ``x [T, ..., d]`` (as ``ds4_core.ops.rope``)."""
    inv_freq = mx.array(inv_freq, dtype=F32) if not isinstance(inv_freq, mx.array) else inv_freq
    half = inv_freq.shape[0]
    angles = mx.array(positions).astype(F32)[:, None] * inv_freq[None, :]
    angles = angles.reshape(angles.shape[:1] + (1,) * (x.ndim - 2) + (half,))
    cos, sin = mx.cos(angles), mx.sin(angles)
    if inverse:
        sin = -sin
    x = x.astype(F32)
    pairs = x[..., x.shape[-1] - 2 * half:].reshape(*x.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], 2 * half)
    return mx.concatenate([x[..., :x.shape[-1] - 2 * half], rotated], axis=-1)


def swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """``silu(min(gate, L)) · clip(up, -L, L)``; ``limit <= 0`` means no clamp."""
    if limit > 0:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
    return gate / (1 + mx.exp(-gate)) * up


def topk(scores: mx.array, k: int) -> mx.array:
    """Indices ``[T, k]`` int32 of the ``k`` largest of each row, largest first.

    Exactly equal scores are ordered by MLX's sort, which need not put the lowest index first (see docs/metal.md).
    """
    return mx.argsort(-scores, axis=-1)[:, :k].astype(mx.int32)


def _attend(q: mx.array, kv: mx.array, idx: mx.array, sink: mx.array | None, scale: float) -> mx.array:
    rows = kv[mx.maximum(idx, 0)]  # [T, K, d]
    logits = mx.einsum("thd,tkd->thk", q, rows) * scale
    logits = mx.where((idx >= 0)[:, None, :], logits, -mx.inf)
    peak = logits.max(axis=-1, keepdims=True)
    if sink is not None:
        sink = sink[None, :, None]
        peak = mx.maximum(peak, sink)
    else:
        peak = mx.where(mx.isinf(peak), 0, peak)
    p = mx.exp(logits - peak)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + mx.exp(sink - peak)
    return mx.einsum("thk,tkd->thd", p / denom, rows)


def gathered_attention(q: mx.array, kv: mx.array, idx: mx.array, sink: mx.array | None, scale: float) -> mx.array:
    """The MLX-op path of :func:`sparse_attention`, with the sinks as a float32 ``[H]`` array (or ``None``).

    Shapes as there; also the reference the ``sparse_attention_gather`` kernels are checked against.
    """
    parts = [_attend(q[s:s + _QUERY_BLOCK], kv, idx[s:s + _QUERY_BLOCK], sink, scale)
             for s in range(0, q.shape[0], _QUERY_BLOCK)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def sparse_attention(q: mx.array, kv: mx.array, idx: mx.array, sinks: Weight | None, scale: float) -> mx.array:
    """Each query ``q [T, H, d]`` over its rows ``idx [T, K]`` (``-1`` = none) of a K=V table ``kv [N, d]``.

    Returns ``[T, H, d]``. ``sinks [H]`` (or ``None``) join each softmax denominator without a value; scores are
    ``(q·k) · scale``. Runs the custom gather kernel when it passed its self-test, else the MLX ops.
    """
    q, kv = q.astype(F32), kv.astype(F32)
    sink = None if sinks is None else sinks.data.astype(F32)
    custom = kernels.active("sparse_attention_gather" if sink is not None else "sparse_attention_gather_nosink")
    return (custom or gathered_attention)(q, kv, idx, sink, scale)


def indexer_scores(q: mx.array, keys: mx.array, head_weights: mx.array, scale: float) -> mx.array:
    """``s[t, r] = Σ_h head_weights[t, h] · ReLU(q[t, h] · keys[r]) · scale``; ``q [T, Hi, d]`` -> ``[T, R]``."""
    parts = []
    for s in range(0, q.shape[0], _QUERY_BLOCK):
        dots = mx.maximum(mx.einsum("thd,rd->thr", q[s:s + _QUERY_BLOCK], keys), 0)
        parts.append(mx.einsum("th,thr->tr", head_weights[s:s + _QUERY_BLOCK], dots) * scale)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def moe_route(logits: mx.array, bias: Weight | None, k: int, routed_scale: float,
              fixed_idx: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """sqrt-softplus router: ``logits [T, E]`` -> (expert ids int32 ``[T, k]``, weights ``[T, k]``)."""
    softplus = mx.where(logits > 20, logits, mx.log1p(mx.exp(mx.minimum(logits, 20))))
    scores = mx.sqrt(softplus)
    if fixed_idx is None:
        idx = topk(scores + bias.data if bias is not None else scores, k)
    else:
        idx = mx.array(fixed_idx).astype(mx.int32)
    w = mx.take_along_axis(scores, idx, axis=-1)
    return idx, w / (w.sum(axis=-1, keepdims=True) + 1e-20) * routed_scale


def _experts_matmul(x: mx.array, data: Any, idx: mx.array) -> mx.array:
    """``x [T, k, 1, in]`` times expert ``idx[t, j]``'s ``W [out, in]`` transposed -> ``[T, k, 1, out]``."""
    if isinstance(data, QuantMatrix):
        return mx.gather_qmm(x, data.w, data.scales, data.biases, rhs_indices=idx, transpose=True, **data.kwargs())
    if isinstance(data, RawBlocks):
        custom = kernels.active(f"{data.qtype.lower()}_gemv")
        if custom is not None:
            return custom(x, data.blocks, idx)
        chosen = dequantize_raw(RawBlocks(data.blocks[idx], data.qtype))  # only the selected experts: [T, k, out, in]
        return mx.matmul(x, chosen.swapaxes(-1, -2))
    return mx.gather_mm(x, data.swapaxes(-1, -2).astype(F32), rhs_indices=idx)


def moe_experts(x: mx.array, gate_exps: Weight, up_exps: Weight, down_exps: Weight, idx: mx.array,
                weights: mx.array, swiglu_limit: float) -> mx.array:
    """``Σ_j weights[t, j] · Expert_{idx[t, j]}(x[t])``: ``x [T, D]``, ``idx``/``weights [T, k]`` -> ``[T, D]``."""
    xe = x.astype(F32)[:, None, None, :]  # [T, 1, 1, D]: broadcast against the k chosen experts
    h = swiglu(_experts_matmul(xe, gate_exps.data, idx), _experts_matmul(xe, up_exps.data, idx), swiglu_limit)
    y = _experts_matmul(h, down_exps.data, idx)[:, :, 0, :]  # [T, k, D]
    return (y * weights[:, :, None]).sum(axis=1)
