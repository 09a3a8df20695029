"""DeepSeek-V4-only ops (:mod:`ds4_model_deepseek4.qat`: the QAT roundings) on MLX arrays."""

from __future__ import annotations

import functools

import mlx.core as mx

F32 = mx.float32


# ------------------------------------------------------------ QAT roundings, exact through float bit patterns

def _floor_log2(x: mx.array) -> mx.array:
    """``floor(log2(x))`` of positive normal float32 ``x``, read from its exponent bits (int32)."""
    return ((x.view(mx.uint32) >> 23) & 0xFF).astype(mx.int32) - 127


def _exp2i(e: mx.array) -> mx.array:
    """``2**e`` for int32 ``e`` in the normal range, built from its bits (float32)."""
    return ((e + 127).astype(mx.uint32) << 23).view(F32)


def _round_minifloat(x: mx.array, mantissa_bits: int, min_exp: int) -> mx.array:
    mag = mx.abs(x)
    exp = _floor_log2(mx.maximum(mag, 2.0 ** min_exp))
    quantum = _exp2i(exp - mantissa_bits)
    return mx.sign(x) * mx.round(mag / quantum) * quantum  # mx.round: ties to even, as np.rint


def _block_round(x: mx.array, top: float, mantissa_bits: int, min_exp: int, amax_floor: float) -> mx.array:
    amax = mx.maximum(mx.abs(x).max(axis=-1, keepdims=True), amax_floor)
    ratio = amax / top
    e = _floor_log2(ratio)
    scale = _exp2i(mx.where(ratio > _exp2i(e), e + 1, e))  # 2**ceil(log2(ratio))
    return _round_minifloat(mx.clip(x / scale, -top, top), mantissa_bits, min_exp) * scale


def fp8_kv_round(x: mx.array, rope_dim: int, block: int = 64) -> mx.array:
    """FP8 E4M3 round-trip of the leading ``d − rope_dim`` channels of ``x [..., d]`` in blocks of ``block``."""
    nope = x.shape[-1] - rope_dim
    parts = [_block_round(x[..., s:min(s + block, nope)], 448.0, 3, -6, 1e-4) for s in range(0, nope, block)]
    return mx.concatenate([*parts, x[..., nope:]], axis=-1)


@functools.cache
def _hadamard(d: int) -> mx.array:
    from ds4_model_deepseek4.qat import hadamard

    return mx.array(hadamard(d))


def fp4_hadamard_round(x: mx.array, block: int = 32) -> mx.array:
    """Hadamard rotation of ``x [..., d]`` then an FP4 E2M1 round-trip in blocks of ``block``."""
    d = x.shape[-1]
    y = mx.matmul(x, _hadamard(d))
    blocks = y.reshape(*y.shape[:-1], d // block, block)
    return _block_round(blocks, 6.0, 1, 0, 6.0 * 2.0 ** -126).reshape(y.shape)
