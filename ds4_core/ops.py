"""The core op vocabulary and its numpy reference implementations.

Each op is a plain function over float32 arrays (plus ints/floats and :class:`~ds4_core.backend.Weight`
objects, whose ``.data`` is the dequantized float32 array on the numpy backend). A GPU backend
implements the same signatures. ``T`` is the number of tokens of a call, ``D`` a feature width.
Index arrays use ``-1`` for "no row"; top-k ties always go to the lowest index.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .backend import Weight

F32 = np.float32
# Queries per step of the gathering ops, so their temporaries stay small for long chunks.
_QUERY_BLOCK = 128


def embed(w: Weight, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (int ``[T]``) of the table ``w`` ``[V, D]`` -> ``[T, D]``."""
    return np.asarray(w.data[np.asarray(ids)], dtype=F32)


def linear(x: np.ndarray, w: Weight) -> np.ndarray:
    """``x @ w.T``: ``x [..., in]``, ``w [out, in]`` -> ``[..., out]``."""
    return np.matmul(x, w.data.T, dtype=F32)


def grouped_linear(x: np.ndarray, w: Weight) -> np.ndarray:
    """Block-diagonal projection: ``x [T, G, in]``, ``w [G·out, in]`` (group g's rows contiguous) -> ``[T, G, out]``."""
    groups = x.shape[1]
    wg = w.data.reshape(groups, -1, x.shape[2])
    return np.einsum("tgi,goi->tgo", x, wg, dtype=F32)


def rms_norm(x: np.ndarray, w: Weight | None, eps: float) -> np.ndarray:
    """``x · rsqrt(mean(x²) + eps) [· w]`` over the last axis; ``x [..., D]``, ``w [D]`` or ``None``."""
    x = np.asarray(x, dtype=F32)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps))
    return y if w is None else y * w.data


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Interleaved RoPE on the trailing ``2·len(inv_freq)`` channels of ``x [T, ..., d]``.

    Channel pairs ``(2i, 2i+1)`` of that trailing slice rotate by ``positions[t] · inv_freq[i]``
    (``positions`` int ``[T]``); ``inverse`` rotates backwards. Leading channels pass through.
    """
    half = inv_freq.shape[0]
    angles = np.asarray(positions, dtype=F32)[:, None] * np.asarray(inv_freq, dtype=F32)[None, :]  # [T, half]
    angles = angles.reshape(angles.shape[:1] + (1,) * (x.ndim - 2) + (half,))
    cos, sin = np.cos(angles), np.sin(angles)
    if inverse:
        sin = -sin
    out = np.array(x, dtype=F32)
    a, b = x[..., -2 * half::2], x[..., -2 * half + 1::2]
    out[..., -2 * half::2] = a * cos - b * sin
    out[..., -2 * half + 1::2] = a * sin + b * cos
    return out


def swiglu(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    """``silu(min(gate, L)) · clip(up, -L, L)`` elementwise; ``limit <= 0`` means no clamp."""
    if limit > 0:
        gate = np.minimum(gate, F32(limit))
        up = np.clip(up, F32(-limit), F32(limit))
    with np.errstate(over="ignore"):  # e^-gate -> inf for very negative gates: silu's exact limit, 0
        return (gate / (1 + np.exp(-gate)) * up).astype(F32)


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices ``[T, k]`` (int32) of the ``k`` largest of each row of ``scores [T, N]``, largest first.

    Equal scores are ordered lowest index first, so ties at the boundary keep the lowest indices.
    """
    order = np.argsort(-scores, axis=-1, kind="stable")
    return order[:, :k].astype(np.int32)


def sparse_attention(q: np.ndarray, kv: np.ndarray, idx: np.ndarray, sinks: Weight | None, scale: float) -> np.ndarray:
    """Multi-query attention of each query over its own rows of a shared K=V table.

    ``q [T, H, d]``; ``kv [N, d]`` serves as keys and values; ``idx`` int ``[T, K]`` lists the rows query t
    sees (``-1`` = none). ``sinks [H]`` (or ``None``) are per-head logits that join the softmax
    denominator without a value. Scores are ``(q·k) · scale``. Returns ``[T, H, d]``; a query that sees no
    row gets zeros with sinks and NaN without (an empty softmax), as the backends' kernels do.
    """
    out = np.empty(q.shape, dtype=F32)
    for start in range(0, q.shape[0], _QUERY_BLOCK):  # bounds the gathered [block, K, d] rows
        part = slice(start, start + _QUERY_BLOCK)
        out[part] = _attend(q[part], kv, idx[part], sinks, scale)
    return out


def _attend(q: np.ndarray, kv: np.ndarray, idx: np.ndarray, sinks: Weight | None, scale: float) -> np.ndarray:
    rows = kv[np.maximum(idx, 0)]  # [T, K, d]
    logits = np.einsum("thd,tkd->thk", q, rows, dtype=F32) * F32(scale)
    logits = np.where((idx >= 0)[:, None, :], logits, -np.inf)
    peak = logits.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.data[None, :, None]
        peak = np.maximum(peak, sink)
    else:
        peak = np.where(np.isfinite(peak), peak, 0)
    p = np.exp(logits - peak)
    denom = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sink - peak)
    with np.errstate(invalid="ignore"):  # 0/0 for a query that sees nothing and has no sink: NaN, documented
        return np.einsum("thk,tkd->thd", p / denom, rows, dtype=F32)


def indexer_scores(q: np.ndarray, keys: np.ndarray, head_weights: np.ndarray, scale: float) -> np.ndarray:
    """Lightning-indexer scores ``s[t, r] = Σ_h head_weights[t, h] · ReLU(q[t, h] · keys[r]) · scale``.

    ``q [T, Hi, d]``, ``keys [R, d]``, ``head_weights [T, Hi]`` -> ``[T, R]``.
    """
    out = np.empty((q.shape[0], keys.shape[0]), dtype=F32)
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        part = slice(start, start + _QUERY_BLOCK)
        dots = np.maximum(np.einsum("thd,rd->thr", q[part], keys, dtype=F32), 0)
        out[part] = np.einsum("th,thr->tr", head_weights[part], dots, dtype=F32) * F32(scale)
    return out


def moe_route(logits: np.ndarray, bias: Weight | None, k: int, routed_scale: float,
              fixed_idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """sqrt-softplus MoE router: ``logits [T, E]`` -> (expert ids int32 ``[T, k]``, weights ``[T, k]``).

    Experts are the top-k of ``scores + bias`` (ties to the lowest id) unless ``fixed_idx [T, k]``
    (hash routing) gives them. Weights are the *unbiased* scores of the chosen experts,
    renormalised to sum 1 and multiplied by ``routed_scale``.
    """
    scores = np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(np.minimum(logits, 20))))).astype(F32)
    if fixed_idx is None:
        choice = scores + bias.data if bias is not None else scores
        idx = topk(choice, k)
    else:
        idx = np.asarray(fixed_idx, dtype=np.int32)
    w = np.take_along_axis(scores, idx, axis=-1)
    w = w / (w.sum(axis=-1, keepdims=True) + F32(1e-20)) * F32(routed_scale)
    return idx, w.astype(F32)


def moe_experts(x: np.ndarray, gate_exps: Weight, up_exps: Weight, down_exps: Weight, idx: np.ndarray,
                weights: np.ndarray, swiglu_limit: float) -> np.ndarray:
    """Weighted sum of the chosen SwiGLU experts: ``Σ_j weights[t, j] · Expert_{idx[t, j]}(x[t])``.

    ``x [T, D]``; ``gate_exps``/``up_exps`` ``[E, I, D]``, ``down_exps`` ``[E, D, I]``; ``idx`` int
    ``[T, k]``; ``weights [T, k]``. Only the selected experts are read. Returns ``[T, D]``.
    """
    out = np.zeros(x.shape, dtype=F32)
    for e in np.unique(idx):
        tok, slot = np.nonzero(idx == e)
        xe = x[tok]
        h = swiglu(xe @ gate_exps.data[e].T, xe @ up_exps.data[e].T, swiglu_limit)
        np.add.at(out, tok, (h @ down_exps.data[e].T) * weights[tok, slot][:, None])
    return out


CORE_OPS: dict[str, Callable] = {
    "embed": embed,
    "linear": linear,
    "grouped_linear": grouped_linear,
    "rms_norm": rms_norm,
    "rope": rope,
    "swiglu": swiglu,
    "topk": topk,
    "sparse_attention": sparse_attention,
    "indexer_scores": indexer_scores,
    "moe_route": moe_route,
    "moe_experts": moe_experts,
}

# Recurrent-layer ops live in their own module to keep this one readable; they are part of the same vocabulary.
from .ops_hc import HC_OPS  # noqa: E402 - appended to the table above
from .ops_recurrent import RECURRENT_OPS  # noqa: E402

CORE_OPS.update(HC_OPS)
CORE_OPS.update(RECURRENT_OPS)
