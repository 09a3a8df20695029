"""Quantisation-aware rounding of DeepSeek V4's official inference graph (spec §10 items 1–2), numpy references.

Off by default (transformers does none of it). Both round-trips use power-of-two block scales
``2^ceil(log2(amax / max_value))`` and round to the nearest representable value, ties to the even code.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32

#: (largest value, mantissa bits, smallest normal exponent) of the two minifloats.
E4M3 = (448.0, 3, -6)
E2M1 = (6.0, 1, 0)


def round_minifloat(x: np.ndarray, mantissa_bits: int, min_exp: int) -> np.ndarray:
    """Round ``x`` (already within range) to the nearest value with ``mantissa_bits`` explicit mantissa bits
    and normal exponents ≥ ``min_exp`` (smaller magnitudes land on the subnormal grid), ties to even."""
    mag = np.abs(x).astype(F32)
    exp = np.floor(np.log2(np.maximum(mag, F32(2.0 ** min_exp))))
    quantum = np.exp2(exp - mantissa_bits).astype(F32)
    return (np.sign(x) * np.rint(mag / quantum) * quantum).astype(F32)


def block_round(x: np.ndarray, fmt: tuple[float, int, int], amax_floor: float) -> np.ndarray:
    """Round-trip the last axis of ``x [..., b]`` (one block) through minifloat ``fmt`` with a power-of-two scale."""
    top, mantissa_bits, min_exp = fmt
    amax = np.maximum(np.abs(x).max(axis=-1, keepdims=True), F32(amax_floor)).astype(F32)
    scale = np.exp2(np.ceil(np.log2(amax / F32(top)))).astype(F32)
    q = round_minifloat(np.clip(x / scale, -top, top), mantissa_bits, min_exp)
    return (q * scale).astype(F32)


def fp8_kv_round(x: np.ndarray, rope_dim: int, block: int = 64) -> np.ndarray:
    """FP8 E4M3 simulation of KV rows ``x [..., d]``: the leading ``d − rope_dim`` channels round-trip in blocks
    of ``block`` (amax floored at 1e-4); the RoPE channels are untouched."""
    out = np.array(x, dtype=F32)
    nope = x.shape[-1] - rope_dim
    for start in range(0, nope, block):
        stop = min(start + block, nope)
        out[..., start:stop] = block_round(out[..., start:stop], E4M3, 1e-4)
    return out


def hadamard(d: int) -> np.ndarray:
    """The ``d``-point Walsh–Hadamard matrix (Sylvester order) scaled by ``1/√d`` (orthonormal), ``[d, d]``."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    h = np.ones((1, 1), dtype=F32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(F32(d))).astype(F32)


def fp4_hadamard_round(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Indexer simulation: rotate ``x [..., d]`` by the orthonormal Hadamard matrix, then round-trip through
    FP4 E2M1 in blocks of ``block`` (amax floored at the smallest positive float32 normal × 6)."""
    d = x.shape[-1]
    y = np.matmul(x, hadamard(d), dtype=F32)
    blocks = y.reshape(*y.shape[:-1], d // block, block)
    return block_round(blocks, E2M1, 6.0 * 2.0 ** -126).reshape(y.shape)
