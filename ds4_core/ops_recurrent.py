"""Core ops of recurrent (linear-attention) layers: short causal convolution and delta-rule recurrences.

Same conventions as :mod:`ds4_core.ops`; each op's numpy reference is the definition.

The gated delta rule keeps, per head, a state ``S [dk, dv]`` that maps keys to values. One token with
query ``q``, key ``k``, value ``v`` (``[dk]``, ``[dk]``, ``[dv]``), write strength ``beta`` and log-decay
``g`` does::

    S ← diag(exp(g)) · S            # decay; g is one value per head (broadcast) or one per key channel
    u = Sᵀ k                         # what the memory currently returns for k
    S ← S + k ⊗ (beta · (v − u))     # move the answer for k towards v
    o = Sᵀ q

A scalar ``g`` per head is Qwen's gated delta-net; a per-channel ``g [dk]`` is Kimi delta attention
(GLM 5.3's KDA). Callers normalise and scale ``q``/``k`` themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .backend import Weight

F32 = np.float32

#: Tokens per chunk of :func:`gated_delta_rule_chunked` (the size the reference implementations use).
DELTA_CHUNK = 64


def short_conv(x: np.ndarray, history: np.ndarray, weight: Weight, dilation: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise convolution over time with carried history; no bias, no activation.

    ``x [T, C]`` new inputs; ``history [P, C]`` the ``P = (K−1)·dilation`` inputs before them (zeros at the
    start of a sequence); ``weight [C, K]`` (tap ``K−1`` multiplies the current input). Output
    ``y[t] = Σ_j weight[:, j] · x̃[t − (K−1−j)·dilation]`` over the concatenation ``x̃`` of history and ``x``.
    Returns ``(y [T, C], new history [P, C])``.
    """
    w = weight.data
    taps = w.shape[1]
    span = (taps - 1) * dilation
    if history.shape[0] != span:
        raise ValueError(f"history has {history.shape[0]} rows; kernel {taps} with dilation {dilation} needs {span}")
    full = np.concatenate([history, x]).astype(F32, copy=False)
    T = x.shape[0]
    y = np.zeros((T, x.shape[1]), dtype=F32)
    for j in range(taps):
        start = j * dilation
        y += full[start:start + T] * w[:, j]
    return y, full[full.shape[0] - span:].copy()


def _decay_shape(log_decay: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``log_decay`` as ``[T, H, dk']`` with ``dk'`` 1 (per-head) or ``dk`` (per-channel)."""
    g = np.asarray(log_decay, dtype=F32)
    if g.shape == k.shape[:2]:
        return g[..., None]
    if g.shape != k.shape:
        raise ValueError(f"log_decay has shape {g.shape}; it must be [T, H] {k.shape[:2]} or [T, H, dk] {k.shape}")
    return g


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, log_decay: np.ndarray, beta: np.ndarray,
                     state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token (the definition; see the module docstring).

    ``q``, ``k [T, H, dk]``; ``v [T, H, dv]``; ``log_decay`` (≤ 0) ``[T, H]`` or ``[T, H, dk]``;
    ``beta [T, H]``; ``state [H, dk, dv]`` (float32, not modified). Returns ``(o [T, H, dv], new state)``.
    """
    g = _decay_shape(log_decay, k)
    S = np.array(state, dtype=F32)
    out = np.empty(v.shape, dtype=F32)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, :, None]
        u = np.einsum("hkv,hk->hv", S, k[t], dtype=F32)
        S += k[t][:, :, None] * ((v[t] - u) * beta[t][:, None])[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t], dtype=F32)
    return out, S


def gated_delta_rule_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, log_decay: np.ndarray, beta: np.ndarray,
                             state: np.ndarray, chunk: int = DELTA_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """:func:`gated_delta_rule` computed ``chunk`` tokens at a time (same arguments, same result).

    Within a chunk (rows = tokens, ``G`` the running sum of log-decays, ``S`` the entering state)::

        A[t,s] = beta_t Σ_c k_t[c] k_s[c] e^(G_t[c] − G_s[c])   (s < t)      T = (I + A)⁻¹
        Δ      = T (beta ⊙ V) − T (beta ⊙ e^G ⊙ K) S                          # the corrected writes
        O      = (e^G ⊙ Q) S + [Σ_c q_t[c] k_s[c] e^(G_t[c] − G_s[c])]_(s ≤ t) Δ
        S'     = e^(G_last) ⊙ S + (e^(G_last − G) ⊙ K)ᵀ Δ

    Exponents are masked to ``s ≤ t`` before ``exp``, so nothing overflows whatever the decay.
    """
    g = _decay_shape(log_decay, k)
    per_channel = g.shape[-1] != 1
    S = np.array(state, dtype=F32)
    out = np.empty(v.shape, dtype=F32)
    for start in range(0, q.shape[0], chunk):
        part = slice(start, start + chunk)
        # heads first: [H, C, d]
        qc, kc, vc = (np.swapaxes(a[part], 0, 1).astype(F32) for a in (q, k, v))
        bc = np.swapaxes(beta[part], 0, 1).astype(F32)  # [H, C]
        G = np.cumsum(np.swapaxes(g[part], 0, 1), axis=1, dtype=F32)  # [H, C, dk']
        C = qc.shape[1]
        diff = G[:, :, None, :] - G[:, None, :, :]  # [H, t, s, dk']
        causal = np.tril(np.ones((C, C), dtype=bool))
        decay = np.exp(np.where(causal[None, :, :, None], diff, -np.inf)).astype(F32)
        if per_channel:
            kk = np.einsum("htc,hsc,htsc->hts", kc, kc, decay, dtype=F32)
            qk = np.einsum("htc,hsc,htsc->hts", qc, kc, decay, dtype=F32)
        else:
            kk = np.einsum("htc,hsc->hts", kc, kc, dtype=F32) * decay[..., 0]
            qk = np.einsum("htc,hsc->hts", qc, kc, dtype=F32) * decay[..., 0]
        A = np.where(np.tril(np.ones((C, C), dtype=bool), -1), kk, 0) * bc[:, :, None]
        lhs = np.eye(C, dtype=F32) + A
        eG = np.exp(G)
        rhs_v = bc[:, :, None] * vc
        rhs_k = bc[:, :, None] * eG * kc
        U = np.linalg.solve(lhs, rhs_v)
        Wk = np.linalg.solve(lhs, rhs_k)
        delta = (U - np.einsum("htk,hkv->htv", Wk, S)).astype(F32)
        o = np.einsum("htk,hkv->htv", eG * qc, S) + np.einsum("hts,hsv->htv", qk, delta)
        out[part] = np.swapaxes(o, 0, 1)
        last = G[:, -1:, :]  # [H, 1, dk']
        S = (np.exp(last[:, 0, :])[:, :, None] * S
             + np.einsum("hsk,hsv->hkv", np.exp(last - G) * kc, delta)).astype(F32)
    return out, S


RECURRENT_OPS: dict[str, Callable] = {
    "short_conv": short_conv,
    "gated_delta_rule": gated_delta_rule,
    "gated_delta_rule_chunked": gated_delta_rule_chunked,
}
