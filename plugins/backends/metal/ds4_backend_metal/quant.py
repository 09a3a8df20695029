"""GGUF blocks in MLX form: affine / mxfp4 quantized matrices where that is exact, raw blocks otherwise.

MLX's affine mode dequantizes ``scale · q + bias`` per group of 32 with unsigned codes ``q``; its ``mxfp4``
mode is OCP MXFP4 (E2M1 codes, E8M0 byte scales, groups of 32). The mappings below choose codes,
scales and biases whose products are exact in float32, so MLX's dequantized values equal GGUF's bit for bit:

* ``Q8_0``  (``d · c``, c int8):               codes ``c + 128`` (8 bits), scale ``d``, bias ``-128 · d``.
* ``Q4_0``  (``d · (c − 8)``):                 codes ``c`` (4 bits), scale ``d``, bias ``-8 · d``.
* ``Q4_K``  (``d·sc_j · c − dmin·m_j``, 32-wide sub-blocks): codes ``c``, scale ``d·sc_j``, bias ``-(dmin·m_j)``.
* ``MXFP4`` (E2M1 code, byte exponent ``e``):  the same codes and bytes (GGUF keeps the 16 low nibbles first),
  except that code 8 (-0) is stored as 0, because GGUF decodes it to +0.0.

``Q2_K`` and ``Q6_K`` use 16-wide groups (MLX's smallest is 32) and ``IQ2_XXS`` a lattice codebook: expert
tensors of these stay raw blocks (custom Metal kernels, or MLX-op dequantization of the chosen experts);
smaller ones are dequantized to float32 at load.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from ds4_core.quants import block_geometry, dequantize

#: Types held as MLX quantized matrices.
NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_K", "MXFP4")
#: Types whose expert tensors stay raw blocks on the device.
RAW_TYPES = ("IQ2_XXS", "Q2_K")
_FLOAT_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
GROUP = 32


@attrs.frozen(eq=False)
class QuantMatrix:
    """An MLX quantized matrix ``[..., out, in]``: packed ``w`` uint32 ``[..., out, in·bits/32]``, ``scales`` (float32,
    or uint8 exponents for mxfp4) and ``biases`` (affine only) ``[..., out, in/32]``."""

    w: mx.array
    scales: mx.array
    biases: mx.array | None
    mode: str
    bits: int

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``mx.quantized_matmul`` / ``mx.gather_qmm`` / ``mx.dequantize`` for this matrix."""
        return {"group_size": GROUP, "bits": self.bits, "mode": self.mode}

    def rows(self, ids: mx.array) -> QuantMatrix:
        """The rows (or experts) ``ids`` along the first axis."""
        biases = None if self.biases is None else self.biases[ids]
        return QuantMatrix(self.w[ids], self.scales[ids], biases, self.mode, self.bits)


@attrs.frozen(eq=False)
class RawBlocks:
    """A tensor ``[..., out, in]`` kept as its GGUF blocks: ``blocks`` uint8 ``[..., out, row bytes]``."""

    blocks: mx.array
    qtype: str


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes ``[..., n]`` (< 2**bits) -> uint32 ``[..., n·bits/32]``, element j at bit ``bits·j`` onwards."""
    per_word = 32 // bits
    grouped = codes.reshape(*codes.shape[:-1], -1, per_word).astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint32)


def _f16(columns: np.ndarray) -> np.ndarray:
    """Byte pairs ``[n, 2]`` (little-endian f16) -> float32 ``[n, 1]``."""
    return np.ascontiguousarray(columns).view("<f2").astype(np.float32)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[:, :2])
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, qs = _f16(blocks[:, :2]), blocks[:, 2:]
    return np.concatenate([qs & 0xF, qs >> 4], axis=1), d, -8 * d


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(blocks)
    d, dmin, packed, qs = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), blocks[:, 4:16], blocks[:, 16:]
    # Six-bit scale/min of sub-blocks 0-3 sit in bytes 0-3 / 4-7; those of 4-7 take a nibble of bytes 8-11
    # plus the top two bits of bytes 0-3 / 4-7.
    low, high = packed[:, 0:4], packed[:, 4:8]
    sc = np.concatenate([low & 63, (packed[:, 8:12] & 0xF) | ((low >> 6) << 4)], axis=1).astype(np.float32)
    mn = np.concatenate([high & 63, (packed[:, 8:12] >> 4) | ((high >> 6) << 4)], axis=1).astype(np.float32)
    # 32-byte group g: sub-block 2g in the low nibbles, 2g+1 in the high nibbles.
    qs = qs.reshape(n, 4, 1, 32)
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, 256)
    return codes, d * sc, -(dmin * mn)


def _mxfp4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    qs = blocks[:, 1:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    codes[codes == 8] = 0  # GGUF decodes the "-0" code as +0.0, MLX as -0.0: store +0 so even the sign bit agrees
    return codes, blocks[:, :1].copy()


def to_quant_matrix(qtype: str, shape: tuple[int, ...], raw: np.ndarray) -> QuantMatrix:
    """GGUF bytes of a ``qtype`` tensor of ``shape`` (numpy order, ≥ 2-D) -> an exact :class:`QuantMatrix`."""
    block_elems, block_bytes = block_geometry(qtype)
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, block_bytes)
    groups_per_block = block_elems // GROUP
    lead = (*shape[:-1], shape[-1] // GROUP)
    if qtype == "MXFP4":
        codes, exps = _mxfp4(blocks)
        w = _pack(codes.reshape(*shape[:-1], shape[-1]), 4)
        return QuantMatrix(mx.array(w), mx.array(exps.reshape(lead)), None, "mxfp4", 4)
    codes, scales, biases = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k}[qtype](blocks)
    bits = 8 if qtype == "Q8_0" else 4
    w = _pack(codes.reshape(*shape[:-1], shape[-1]), bits)
    scales = np.broadcast_to(scales, (len(blocks), groups_per_block)).reshape(lead)
    biases = np.broadcast_to(biases, (len(blocks), groups_per_block)).reshape(lead)
    return QuantMatrix(mx.array(w), mx.array(np.ascontiguousarray(scales)), mx.array(np.ascontiguousarray(biases)),
                       "affine", bits)


def dequantize_matrix(m: QuantMatrix) -> mx.array:
    """MLX's own dequantization of ``m`` -> float32 ``[..., out, in]``."""
    return mx.dequantize(m.w, m.scales, m.biases, dtype=mx.float32, **m.kwargs())


# ------------------------------------------------------------ MLX-op dequantizers of the raw-block types

@functools.cache
def _iq2xxs_tables() -> tuple[mx.array, mx.array]:
    """(grid ``[256, 8]``, signs ``[128, 8]``) float32 tables of IQ2_XXS, taken from ds4_core's decoder."""
    from ds4_core.quants import iq2xxs_tables as host_tables

    grid, signs = host_tables()
    return mx.array(grid), mx.array(signs)


def _u16(lo: mx.array, hi: mx.array) -> mx.array:
    return lo.astype(mx.uint16) | (hi.astype(mx.uint16) << 8)


def _half(lo: mx.array, hi: mx.array) -> mx.array:
    """Little-endian f16 from two byte arrays -> float32."""
    return _u16(lo, hi).view(mx.float16).astype(mx.float32)


def _iq2_xxs_blocks(b: mx.array) -> mx.array:
    """``b`` uint8 ``[..., 66]`` -> float32 ``[..., 256]``."""
    grid, signs = _iq2xxs_tables()
    d = _half(b[..., 0], b[..., 1])[..., None]
    groups = b[..., 2:].reshape(*b.shape[:-1], 8, 8)
    aux = groups[..., 4:].astype(mx.uint32)
    aux = aux[..., 0] | (aux[..., 1] << 8) | (aux[..., 2] << 16) | (aux[..., 3] << 24)  # [..., 8]
    group_scale = d * ((aux >> 28).astype(mx.float32) + 0.5) * 0.25
    sign_index = (aux[..., None] >> mx.array([0, 7, 14, 21], dtype=mx.uint32)) & 127  # [..., 8, 4]
    values = group_scale[..., None, None] * grid[groups[..., :4].astype(mx.int32)] * signs[sign_index.astype(mx.int32)]
    return values.reshape(*b.shape[:-1], 256)


def _q2_k_blocks(b: mx.array) -> mx.array:
    """``b`` uint8 ``[..., 84]`` -> float32 ``[..., 256]``."""
    lead = b.shape[:-1]
    packed, qs = b[..., :16], b[..., 16:80]
    d, dmin = _half(b[..., 80], b[..., 81])[..., None], _half(b[..., 82], b[..., 83])[..., None]
    # Per 128-element half: element 32·j + l is bits 2j..2j+1 of byte l of that half's 32 bytes.
    shifts = mx.array([0, 2, 4, 6], dtype=mx.uint8)[:, None]
    codes = (qs.reshape(*lead, 2, 1, 32) >> shifts) & 3
    scale = d * (packed & 0xF).astype(mx.float32)
    offset = dmin * (packed >> 4).astype(mx.float32)
    values = scale[..., None] * codes.reshape(*lead, 16, 16).astype(mx.float32) - offset[..., None]
    return values.reshape(*lead, 256)


_RAW_DECODERS = {"IQ2_XXS": (_iq2_xxs_blocks, 66), "Q2_K": (_q2_k_blocks, 84)}


def dequantize_raw(r: RawBlocks) -> mx.array:
    """MLX-op dequantization of raw blocks ``[..., out, row bytes]`` -> float32 ``[..., out, in]``."""
    decode, nbytes = _RAW_DECODERS[r.qtype]
    lead = r.blocks.shape[:-1]
    values = decode(r.blocks.reshape(*lead, -1, nbytes))
    return values.reshape(*lead, -1)


def to_mlx(qtype: str, shape: tuple[int, ...], raw: np.ndarray) -> Any:
    """The MLX payload of a GGUF tensor: a :class:`QuantMatrix`, a :class:`RawBlocks` or an ``mx.array``.

    Float tensors keep their dtype (F16/BF16 promote exactly inside float32 matmuls); raw-block types stay raw for
    expert tensors (3-D) and are dequantized through MLX ops otherwise; the rest falls back to float32.
    """
    if qtype in _FLOAT_DTYPES:
        host = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if qtype == "BF16":  # numpy has no bfloat16: widen on the host, narrow again in MLX (exact)
            return mx.array(dequantize(host, qtype, shape)).astype(mx.bfloat16)
        return mx.array(host.view("<f4" if qtype == "F32" else "<f2").reshape(shape))
    if qtype in NATIVE_TYPES and len(shape) >= 2:
        return to_quant_matrix(qtype, shape, raw)
    if qtype in RAW_TYPES:
        nbytes = np.ascontiguousarray(raw).size
        rows = int(np.prod(shape[:-1]))
        blocks = RawBlocks(mx.array(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(
            *shape[:-1], nbytes // rows)), qtype)
        if len(shape) >= 3:
            return blocks
        return dequantize_raw(blocks)
    return mx.array(dequantize(raw, qtype, shape))
