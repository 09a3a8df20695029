"""Qwen3.8-only ops (numpy references): rotate-half RoPE, hyper-connection mixers, masked GQA, softmax routing.

Registered for backend ``"numpy"`` through ``register_kernels`` (names in :mod:`.opnames`).
"""

from __future__ import annotations

import numpy as np

from ds4_core.backend import Weight
from ds4_core.ops_hc import sigmoid

F32 = np.float32


def rope_half(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on the leading ``2·len(inv_freq)`` channels of ``x [T, ..., d]``; the rest pass through.

    Channel ``i`` and ``i + half`` (``i < half``) rotate together by ``positions[t] · inv_freq[i]``
    (``positions`` int ``[T]``). For text every mRoPE axis carries the same position, so the section
    layout does not change the angles.
    """
    half = inv_freq.shape[0]
    angles = np.asarray(positions, dtype=F32)[:, None] * np.asarray(inv_freq, dtype=F32)[None, :]
    angles = angles.reshape(angles.shape[:1] + (1,) * (x.ndim - 2) + (half,))
    cos, sin = np.cos(angles), np.sin(angles)
    out = np.array(x, dtype=F32)
    a, b = x[..., :half], x[..., half:2 * half]
    out[..., :half] = a * cos - b * sin
    out[..., half:2 * half] = b * cos + a * sin
    return out


def hc_mix(H: np.ndarray, norm: Weight, down: Weight, up: Weight, inject: Weight | None,
           eps: float) -> tuple[np.ndarray, np.ndarray | None]:
    """A hyper-connection site: the block input and, with ``inject``, the per-stream injection weights.

    ``H [T, n, D]`` streams; ``norm [n·D]`` (stored ``1 + w``: each stream is RMS-normalised on its own);
    ``down [R, n·D]``, ``up [n·D, R]``, ``inject [n, n·D]`` or ``None``. With ``Hn`` the normalised streams:
    ``x = mean_k(sigmoid(up · silu(down · Hn / n))_k ⊙ Hn_k)`` ``[T, D]`` and
    ``inj = 2·sigmoid(inject · Hn / n)`` ``[T, n]``.
    """
    T, n, D = H.shape
    Hn = H / np.sqrt(np.mean(H * H, axis=-1, keepdims=True) + F32(eps)) * norm.data.reshape(n, D)
    flat = Hn.reshape(T, n * D)
    a = np.matmul(flat, down.data.T, dtype=F32) / F32(n)
    a = a * sigmoid(a)
    m = sigmoid(np.matmul(a, up.data.T, dtype=F32)).reshape(T, n, D)
    x = np.mean(m * Hn, axis=1, dtype=F32)
    if inject is None:
        return x, None
    return x, 2 * sigmoid(np.matmul(flat, inject.data.T, dtype=F32) / F32(n))


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """Grouped-query attention under an explicit mask.

    ``q [T, H, d]``; ``k [N, G, d]``, ``v [N, G, dv]`` (query head ``h`` reads group ``h // (H/G)``);
    ``mask [T, N]`` bool (True = visible; every row needs one). Scores ``(q·k)·scale``, softmax in float32.
    Returns ``[T, H, dv]``.
    """
    T, H, _ = q.shape
    G = k.shape[1]
    qg = q.reshape(T, G, H // G, -1)
    logits = np.einsum("tgrd,ngd->tgrn", qg, k, dtype=F32) * F32(scale)
    logits = np.where(mask[:, None, None, :], logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("tgrn,ngd->tgrd", p, v, dtype=F32).reshape(T, H, -1)


def moe_route_softmax(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax router: ``logits [T, E]`` -> (top-k expert ids int32 ``[T, k]``, their probabilities ``[T, k]``,
    renormalised to sum 1 if ``normalize``). Ties go to the lowest id."""
    z = logits.astype(F32)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(p, idx, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx, w.astype(F32)

