"""GGML quant types: block geometry, numpy reference dequantizers, a few quantizers.

Shapes are in numpy order (row-major, last dimension innermost = GGUF ``ne0``);
a row is split into blocks along its last dimension. The dequantizers are our
own vectorised numpy code written from the ggml block layouts and follow ggml's
float operation order, so they match ggml (and the ``gguf`` package, the test
oracle) bit for bit. Backend kernels are checked against them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ConversionError, GGUFTensorError

_T = GGMLQuantizationType
QuantType = GGMLQuantizationType | int | str

SUPPORTED_TYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "I32",
    "Q8_0",
    "Q4_0",
    "Q4_K",
    "Q6_K",
    "Q2_K",
    "IQ2_XXS",
    "MXFP4",
)

#: "Q8_0" and "q8_0" alike -> the GGML type.
QUANT_NAMES: dict[str, GGMLQuantizationType] = {
    **{name: _T[name] for name in SUPPORTED_TYPES},
    **{name.lower(): _T[name] for name in SUPPORTED_TYPES},
}

_SUPPORTED = frozenset(QUANT_NAMES.values())

# Elements dequantized per step: bounds the temporaries and keeps them in cache.
_CHUNK_ELEMENTS = 1 << 18


def _resolve(qtype: QuantType) -> GGMLQuantizationType:
    """The supported GGML type named by an enum member, its integer id or its name."""
    supported = ", ".join(SUPPORTED_TYPES)
    if isinstance(qtype, str):
        found = QUANT_NAMES.get(qtype) or QUANT_NAMES.get(qtype.upper())
        if found is None:
            raise GGUFTensorError(f"unknown quant type name {qtype!r}; use one of: {supported}")
        return found
    try:
        resolved = _T(qtype)
    except ValueError:
        raise GGUFTensorError(
            f"unknown GGML tensor type id {qtype!r}; the file may come from a newer llama.cpp — "
            f"re-quantize it to one of: {supported}"
        ) from None
    if resolved not in _SUPPORTED:
        raise GGUFTensorError(
            f"GGML tensor type {resolved.name} is not supported by ds4-core; "
            f"re-quantize the model to one of: {supported}"
        )
    return resolved


def block_geometry(qtype: QuantType) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported type; float types have 1-element blocks."""
    return GGML_QUANT_SIZES[_resolve(qtype)]


def tensor_nbytes(qtype: QuantType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` (numpy order) stored as ``qtype``; the last dim must fill whole blocks."""
    resolved = _resolve(qtype)
    block_size, type_size = GGML_QUANT_SIZES[resolved]
    shape = tuple(shape)
    if not shape or any(int(dim) < 0 for dim in shape):
        raise GGUFTensorError(f"tensor shape {shape} is invalid: it needs at least one dimension and no negative sizes")
    if shape[-1] % block_size:
        raise GGUFTensorError(
            f"a {resolved.name} row holds whole blocks of {block_size} elements, but the shape {shape} has rows "
            f"of {shape[-1]}; the tensor table is wrong or the tensor needs another type"
        )
    return math.prod(shape[:-1]) * (shape[-1] // block_size) * type_size


# ---------------------------------------------------------------- lookup tables

# E2M1 values times two, indexed by the 4-bit MXFP4 code; the block scale below is halved to match.
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
# E8M0 byte e -> 2**(e - 127) / 2, exact in float32 (e = 0 gives the subnormal 2**-128).
_E8M0_HALF = np.ldexp(np.float32(1), np.arange(256) - 128).astype(np.float32)


@functools.cache
def iq2xxs_tables() -> tuple[np.ndarray, np.ndarray]:
    """(grid (256, 8) float32 magnitudes, signs (128, 8) float32 of +-1) for IQ2_XXS.

    The grid is data taken from the gguf package: 256 rows of 8 two-bit codes
    (low bits first) naming the magnitudes 8, 25, 43. Each 7-bit sign index
    gains an eighth sign bit that makes the number of minus signs even.
    """
    from gguf.quants import IQ2_XXS

    packed = np.frombuffer(bytes.fromhex(IQ2_XXS.grid_hex.decode()), dtype=np.uint8)
    codes = (packed[:, None] >> np.arange(0, 8, 2, dtype=np.uint8)) & 3
    grid = np.asarray(IQ2_XXS.grid_map, dtype=np.float32)[codes].reshape(256, 8)

    index = np.arange(128, dtype=np.uint8)
    bits = (index[:, None] >> np.arange(7, dtype=np.uint8)) & 1
    parity = bits.sum(axis=1, dtype=np.uint8) & 1
    sign_bits = np.concatenate([bits, parity[:, None]], axis=1)
    return grid, np.where(sign_bits == 1, np.float32(-1), np.float32(1))


# ---------------------------------------------------------------- dequantizers
# Each takes blocks (n, bytes per block) uint8 and returns (n, elements per block) float32.


def _f16(columns: np.ndarray) -> np.ndarray:
    """Two byte columns (n, 2) holding a little-endian f16 -> (n, 1) float32."""
    return np.ascontiguousarray(columns).view("<f2").astype(np.float32)


def _dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view("<f4")


def _dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view("<f2").astype(np.float32)


def _dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, 2:].view(np.int8) * _f16(blocks[:, :2])


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    qs = blocks[:, 2:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=1).view(np.int8) - np.int8(8)
    return codes * _f16(blocks[:, :2])


def _dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    d, dmin, packed, qs = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), blocks[:, 4:16], blocks[:, 16:]
    # 8 six-bit scales and mins: sub-blocks 0-3 in the low bits of bytes 0-7, sub-blocks 4-7 split
    # between the nibbles of bytes 8-11 and the top two bits of bytes 0-7.
    scales = np.concatenate([packed[:, 0:4] & 63, (packed[:, 8:12] & 0xF) | ((packed[:, 0:4] >> 6) << 4)], axis=1)
    mins = np.concatenate([packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)], axis=1)
    # Each 32-byte group holds sub-block 2g in its low nibbles and 2g+1 in its high nibbles.
    qs = qs.reshape(n, 4, 1, 32)
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32)
    return ((d * scales)[:, :, None] * codes - (dmin * mins)[:, :, None]).reshape(n, 256)


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208].view(np.int8), _f16(blocks[:, 208:])
    # Per 128-element half: quarters 0/1 take the low nibbles of ql bytes 0-31/32-63, quarters 2/3 the
    # high nibbles; the two high bits of all four come from one qh byte, at shifts 0, 2, 4, 6.
    ql = ql.reshape(n, 2, 2, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    codes = (low | (high << 4)).view(np.int8) - np.int8(32)
    return ((d * scales)[:, :, None] * codes.reshape(n, 16, 16)).reshape(n, 256)


def _dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    packed, qs, d, dmin = blocks[:, :16], blocks[:, 16:80], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    # Per 128-element half: 32 bytes, element 32*j + l is bits 2j..2j+1 of byte l.
    codes = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    scale, offset = d * (packed & 0xF), dmin * (packed >> 4)
    return (scale[:, :, None] * codes.reshape(n, 16, 16) - offset[:, :, None]).reshape(n, 256)


def _dequantize_iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    grid, signs = iq2xxs_tables()
    d, groups = _f16(blocks[:, :2]), blocks[:, 2:].reshape(n, 8, 8)
    # Each 32-element group: 4 grid indices, then a u32 with four 7-bit sign indices and a 4-bit scale on top.
    aux = np.ascontiguousarray(groups[:, :, 4:]).view("<u4")[:, :, 0]
    group_scale = d * ((aux >> 28).astype(np.float32) + np.float32(0.5)) * np.float32(0.25)
    sign_index = (aux[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 127
    values = group_scale[:, :, None, None] * grid[groups[:, :, :4]] * signs[sign_index]
    return values.reshape(n, 256)


def _dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    qs = blocks[:, 1:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    return _MXFP4_VALUES[codes] * _E8M0_HALF[blocks[:, :1]]


_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    _T.F32: _dequantize_f32,
    _T.F16: _dequantize_f16,
    _T.BF16: _dequantize_bf16,
    _T.Q8_0: _dequantize_q8_0,
    _T.Q4_0: _dequantize_q4_0,
    _T.Q4_K: _dequantize_q4_k,
    _T.Q6_K: _dequantize_q6_k,
    _T.Q2_K: _dequantize_q2_k,
    _T.IQ2_XXS: _dequantize_iq2_xxs,
    _T.MXFP4: _dequantize_mxfp4,
}


def dequantize(raw: np.ndarray, qtype: QuantType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode the bytes of a tensor: ``raw`` (its exact bytes, any shape) -> float32 array of ``shape``.

    The result is a new array; ``raw`` may be a read-only memory map.
    """
    resolved = _resolve(qtype)
    if resolved == _T.I32:
        raise GGUFTensorError("I32 tensors hold integers, not weights; read them with raw.view(np.int32) instead")
    nbytes = tensor_nbytes(resolved, shape)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != nbytes:
        raise GGUFTensorError(
            f"a {resolved.name} tensor of shape {tuple(shape)} needs {nbytes} bytes but {data.size} were given; "
            "the file is truncated or its tensor table is wrong"
        )
    block_size, type_size = GGML_QUANT_SIZES[resolved]
    blocks = data.reshape(-1, type_size)
    out = np.empty((len(blocks), block_size), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // block_size)
    decode = _DEQUANTIZERS[resolved]
    for start in range(0, len(blocks), step):
        out[start : start + step] = decode(blocks[start : start + step])
    return out.reshape(shape)


# ---------------------------------------------------------------- quantizers


def _round_half_away(values: np.ndarray) -> np.ndarray:
    """C ``roundf``: halves go away from zero (numpy's ``round`` goes to even)."""
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    return np.copysign(whole + (magnitude - whole >= 0.5), values)


def _quantize_q8_0(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 32)
    if not np.isfinite(blocks).all():
        raise ConversionError("cannot quantize to Q8_0: the tensor holds NaN or infinity; fix the source weights")
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    codes = _round_half_away(blocks * inverse).astype(np.int8)
    return np.concatenate([d.astype("<f2").view(np.uint8), codes.view(np.uint8)], axis=1)


def _quantize_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.view("<u4")
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    # Round to nearest even; NaNs keep their top bits and are made quiet. A NaN is the only input that
    # could overflow the u32 sum, and it takes the other branch.
    rounded = (np.where(nan, 0, bits) + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype("<u2").view(np.uint8)


_QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    _T.F32: lambda x: x.astype("<f4").view(np.uint8),
    _T.F16: lambda x: x.astype("<f2").view(np.uint8),
    _T.BF16: _quantize_bf16,
    _T.Q8_0: _quantize_q8_0,
}


def quantize(x: np.ndarray, qtype: QuantType) -> np.ndarray:
    """Encode ``x`` (float, shape (..., n)) as ``qtype`` -> uint8 array of shape (..., bytes per row).

    Bit-exact with ggml's reference quantizers (Q8_0: d = amax / 127, codes rounded half away from zero).
    """
    resolved = _resolve(qtype)
    encode = _QUANTIZERS.get(resolved)
    if encode is None:
        raise ConversionError(
            f"quantizing to {resolved.name} is not implemented; use one of {', '.join(t.name for t in _QUANTIZERS)}"
            " or quantize with llama.cpp"
        )
    x = np.ascontiguousarray(x, dtype=np.float32)
    tensor_nbytes(resolved, x.shape)  # validates the row length
    block_size, type_size = GGML_QUANT_SIZES[resolved]
    return encode(x.reshape(-1)).reshape(*x.shape[:-1], x.shape[-1] // block_size * type_size)


# ---------------------------------------------------------------- random blocks

# Block layouts in byte order: "f16" is a positive f16 scale, "e8m0" a power-of-two scale byte,
# an integer is that many bytes of codes, any value of which is valid.
_RANDOM_LAYOUTS: dict[GGMLQuantizationType, Sequence[str | int]] = {
    _T.Q8_0: ("f16", 32),
    _T.Q4_0: ("f16", 16),
    _T.Q4_K: ("f16", "f16", 12, 128),
    _T.Q6_K: (128, 64, 16, "f16"),
    _T.Q2_K: (16, 64, "f16", "f16"),
    _T.IQ2_XXS: ("f16", 64),
    _T.MXFP4: ("e8m0", 16),
}


def _random_part(part: str | int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    if part == "f16":  # 2**-12 .. 2**-6: normal f16, about the range real weight scales live in
        return np.exp2(rng.uniform(-12, -6, (n_blocks, 1))).astype("<f2").view(np.uint8)
    if part == "e8m0":  # byte e means the scale 2**(e - 127): here 2**-15 .. 2**1
        return rng.integers(112, 129, (n_blocks, 1), dtype=np.uint8)
    return rng.integers(0, 256, (n_blocks, int(part)), dtype=np.uint8)


def random_blocks(qtype: QuantType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` valid random blocks of ``qtype`` -> uint8 (n_blocks, bytes per block).

    Scales are finite and of realistic size; codes are uniform over all valid values. Float types
    get standard-normal values, I32 uniform int32 values.
    """
    resolved = _resolve(qtype)
    if resolved in _RANDOM_LAYOUTS:
        return np.concatenate([_random_part(p, n_blocks, rng) for p in _RANDOM_LAYOUTS[resolved]], axis=1)
    if resolved == _T.I32:
        values = rng.integers(-(2**31), 2**31, n_blocks, dtype=np.int64).astype("<i4")
        return values.view(np.uint8).reshape(n_blocks, 4)
    normal = rng.standard_normal(n_blocks, dtype=np.float32)[:, None]
    return quantize(normal, resolved)
