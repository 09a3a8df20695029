"""Tiny GGUF files for tests and plugin authors: a writer over ``gguf.GGUFWriter`` and a malformed corpus.

:func:`write_gguf` writes real files with the ``gguf`` package. The corpus
(:data:`MALFORMED`, :data:`CONTROLS`) needs files that writer refuses to
produce, so it is assembled by a small raw encoder (:func:`pack_gguf` and
friends) whose output for the tiny model is byte-identical to the writer's.
Each malformed case is a variant of that tiny file with one defect.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import GGUFError, GGUFFormatError, GGUFMetadataError, GGUFTensorError

V = GGUFValueType
Q = GGMLQuantizationType

#: A tensor given as raw encoded bytes: (bytes as any numpy array, GGML type, numpy shape in elements).
RawTensor = tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]

_FORMATS = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.UINT64: "<Q", V.INT64: "<q", V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<?",
}
_DTYPE_TYPES = {
    np.dtype(np.uint8): V.UINT8, np.dtype(np.int8): V.INT8, np.dtype(np.uint16): V.UINT16,
    np.dtype(np.int16): V.INT16, np.dtype(np.uint32): V.UINT32, np.dtype(np.int32): V.INT32,
    np.dtype(np.uint64): V.UINT64, np.dtype(np.int64): V.INT64, np.dtype(np.float32): V.FLOAT32,
    np.dtype(np.float64): V.FLOAT64, np.dtype(np.bool_): V.BOOL,
}
_TENSOR_TYPES = {
    np.dtype(np.float32): Q.F32, np.dtype(np.float16): Q.F16, np.dtype(np.float64): Q.F64, np.dtype(np.int8): Q.I8,
    np.dtype(np.int16): Q.I16, np.dtype(np.int32): Q.I32, np.dtype(np.int64): Q.I64,
}


# ------------------------------------------------------------------------------------------------ typing values

def _int_type(value: int, *, signed_first: bool) -> GGUFValueType:
    if signed_first and -(2**31) <= value < 2**31:
        return V.INT32
    if 0 <= value < 2**32:
        return V.UINT32
    if -(2**31) <= value < 0:
        return V.INT32
    return V.INT64 if value < 0 else V.UINT64


def _element_type(values: Sequence[Any]) -> GGUFValueType:
    """The element type of a non-empty python list, following the gguf package (ints -> INT32, floats -> FLOAT32)."""
    first = values[0]
    if all(isinstance(v, bool) for v in values):
        return V.BOOL
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        wide = [v for v in values if not -(2**31) <= v < 2**31]
        return (V.INT64 if min(values) < 0 else V.UINT64) if wide else V.INT32
    for vtype, kind in ((V.FLOAT32, float), (V.STRING, str), (V.ARRAY, list)):
        if all(isinstance(v, kind) for v in values):
            return vtype
    raise ValueError(f"GGUF arrays hold one element type; got {type(first).__name__} mixed with others")


def metadata_type(value: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """(python value, value type, element type) of a metadata value.

    ``value`` is a python str/bool/int/float/list, a numpy scalar or 1-D array, or an explicit
    ``(value, GGUFValueType)`` / ``(list, GGUFValueType.ARRAY, element_type)`` tuple.
    Python ints become UINT32 (INT32 if negative, 64-bit if wide), floats FLOAT32;
    lists follow the gguf package (ints INT32, floats FLOAT32).
    """
    if isinstance(value, tuple) and len(value) in (2, 3) and isinstance(value[1], GGUFValueType):
        raw, vtype = value[0], value[1]
        raw = raw.tolist() if isinstance(raw, np.ndarray) else raw
        if vtype == V.ARRAY:
            return list(raw), vtype, value[2] if len(value) == 3 else _element_type(raw)
        return raw, vtype, None
    if isinstance(value, np.ndarray):
        return value.tolist(), V.ARRAY, _DTYPE_TYPES[value.dtype]
    if isinstance(value, np.generic):
        return value.item(), _DTYPE_TYPES[value.dtype], None
    if isinstance(value, bool):
        return value, V.BOOL, None
    if isinstance(value, int):
        return value, _int_type(value, signed_first=False), None
    if isinstance(value, float):
        return value, V.FLOAT32, None
    if isinstance(value, str):
        return value, V.STRING, None
    if isinstance(value, list):
        return value, V.ARRAY, _element_type(value)
    raise TypeError(f"cannot store a {type(value).__name__} as GGUF metadata")


# ------------------------------------------------------------------------------------------------ the real writer

def _tensor_parts(value: np.ndarray | RawTensor) -> tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]:
    """(raw bytes as uint8 of the byte shape, GGML type, numpy element shape)."""
    if isinstance(value, tuple):
        raw, qtype, shape = value
        qtype = GGMLQuantizationType(qtype)
        shape = tuple(int(d) for d in shape)
    else:
        qtype = _TENSOR_TYPES[value.dtype]
        raw, shape = np.ascontiguousarray(value), value.shape
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block_elems:
        raise ValueError(f"shape {shape} does not hold whole {qtype.name} blocks of {block_elems}")
    byte_shape = (*shape[:-1], shape[-1] // block_elems * block_bytes)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size != int(np.prod(byte_shape)):
        raise ValueError(f"{raw.size} bytes given for {qtype.name} of shape {shape}, not {np.prod(byte_shape)}")
    return raw.reshape(byte_shape), qtype, shape


def write_gguf(path: str | Path, arch: str, metadata: Mapping[str, Any] | None = None,
               tensors: Mapping[str, np.ndarray | RawTensor] | None = None, *, alignment: int | None = None) -> Path:
    """Write a GGUF v3 file with ``gguf.GGUFWriter`` and return its path.

    ``metadata`` values are typed by :func:`metadata_type`. ``tensors`` maps a name to a numpy array
    (F32/F16/F64/I8/I16/I32/I64, numpy shape) or to ``(raw_bytes, qtype, shape)`` for any GGML type,
    ``shape`` in numpy order. ``alignment`` sets ``general.alignment``.
    """
    path = Path(path)
    writer = GGUFWriter(path, arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value in (metadata or {}).items():
        raw, vtype, element_type = metadata_type(value)
        writer.add_key_value(key, raw, vtype, sub_type=element_type)
    for name, value in (tensors or {}).items():
        raw, qtype, _ = _tensor_parts(value)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------------------------------------ raw encoder

def pack_string(value: str | bytes) -> bytes:
    """A GGUF string: u64 byte length, then the bytes (``str`` is UTF-8 encoded)."""
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("<Q", len(raw)) + raw


def pack_value(vtype: GGUFValueType | int, value: Any, element_type: GGUFValueType | int | None = None) -> bytes:
    """The payload of a value of type ``vtype`` (no type tag); arrays carry their element type and count."""
    if vtype == V.STRING:
        return pack_string(value)
    if vtype == V.ARRAY:
        if element_type is None:
            element_type = _element_type(value)
        items = b"".join(
            pack_value(element_type, item, _element_type(item) if element_type == V.ARRAY and item else None)
            for item in value
        )
        return struct.pack("<IQ", element_type, len(value)) + items
    return struct.pack(_FORMATS[GGUFValueType(vtype)], value)


def pack_kv(key: str | bytes, vtype: GGUFValueType | int, value: Any, element_type: GGUFValueType | int | None = None,
            ) -> bytes:
    """One metadata entry: key string, u32 value type, payload."""
    return pack_string(key) + struct.pack("<I", vtype) + pack_value(vtype, value, element_type)


def pack_tensor_info(name: str | bytes, shape: Sequence[int], qtype: GGMLQuantizationType | int, offset: int) -> bytes:
    """One tensor directory entry; ``shape`` in numpy order (written reversed, ggml ``ne`` order)."""
    dims = list(reversed(shape))
    return pack_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


def pack_gguf(kvs: Sequence[bytes], infos: Sequence[bytes], data: bytes = b"", *, magic: bytes = b"GGUF",
              version: int = 3, n_kv: int | None = None, n_tensors: int | None = None, alignment: int = 32) -> bytes:
    """Header, packed KVs, packed tensor infos, zero padding to ``alignment`` (only when ``data``), then ``data``."""
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    if data:
        body += bytes(-len(body) % alignment)
    return body + data


def layout_tensors(tensors: Mapping[str, np.ndarray | RawTensor], alignment: int = 32) -> tuple[list[bytes], bytes]:
    """(packed tensor infos, data section) laid out as ``GGUFWriter`` does: each tensor padded to ``alignment``."""
    infos, chunks, offset = [], [], 0
    for name, value in tensors.items():
        raw, qtype, shape = _tensor_parts(value)
        infos.append(pack_tensor_info(name, shape, qtype, offset))
        padded = raw.tobytes() + bytes(-raw.nbytes % alignment)
        chunks.append(padded)
        offset += len(padded)
    return infos, b"".join(chunks)


# ------------------------------------------------------------------------------------------------ the tiny model

TINY_ARCH = "tiny"
TINY_METADATA: dict[str, Any] = {
    "general.name": "tiny test model",
    "tiny.block_count": 2,
    "tiny.rope.freq_base": 10000.0,
    "tiny.expert_weights_norm": True,
    "tokenizer.ggml.tokens": ["<s>", "a", "b"],
    "tokenizer.ggml.token_type": [3, 1, 1],
}
_Q8_BLOCK = np.concatenate([
    np.float16(0.5).reshape(1).view(np.uint8),
    np.arange(-16, 16, dtype=np.int8).view(np.uint8),
])
TINY_TENSORS: dict[str, np.ndarray | RawTensor] = {
    "a.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b.weight": (_Q8_BLOCK, Q.Q8_0, (1, 32)),
    "c.ids": np.arange(4, dtype=np.int32),
}


def tiny_kvs(arch: str = TINY_ARCH, metadata: Mapping[str, Any] = TINY_METADATA) -> list[bytes]:
    """The packed metadata of the tiny model, ``general.architecture`` first as ``GGUFWriter`` writes it."""
    kvs = []
    for key, value in {"general.architecture": arch, **metadata}.items():
        raw, vtype, element_type = metadata_type(value)
        kvs.append(pack_kv(key, vtype, raw, element_type))
    return kvs


def tiny_gguf_bytes() -> bytes:
    """The tiny model's file, byte for byte what :func:`write_gguf` writes for it."""
    return pack_gguf(tiny_kvs(), *layout_tensors(TINY_TENSORS))


def write_tiny_gguf(path: str | Path) -> Path:
    """Write the tiny model with ``gguf.GGUFWriter``."""
    return write_gguf(path, TINY_ARCH, TINY_METADATA, TINY_TENSORS)


def _tiny(*, kvs: Sequence[bytes] | None = None, extra_kvs: Sequence[bytes] = (), infos: Sequence[bytes] | None = None,
          data: bytes | None = None, **header: Any) -> bytes:
    default_infos, default_data = layout_tensors(TINY_TENSORS)
    return pack_gguf([*(tiny_kvs() if kvs is None else kvs), *extra_kvs],
                     default_infos if infos is None else infos,
                     default_data if data is None else data, **header)


def _with_tensor(name: str | bytes = "x", shape: Sequence[int] = (32,), qtype: int = Q.F32, offset: int = 0) -> bytes:
    """A file whose only tensor has the given directory entry, with 4 KiB of zero data."""
    return _tiny(infos=[pack_tensor_info(name, shape, qtype, offset)], data=bytes(4096))


def _nested_array(levels: int) -> bytes:
    """A KV holding ``levels`` arrays nested one inside the other, the innermost holding one byte."""
    nest = struct.pack("<IQ", V.ARRAY, 1) * (levels - 1) + struct.pack("<IQB", V.UINT8, 1, 7)
    return pack_string("test.deep") + struct.pack("<I", V.ARRAY) + nest


# ------------------------------------------------------------------------------------------------ the corpus

@attrs.frozen
class MalformedCase:
    """A defective file: ``build()`` returns its bytes; opening it raises ``error`` mentioning ``mentions``."""

    name: str
    build: Callable[[], bytes]
    error: type[GGUFError]
    mentions: str


MALFORMED: dict[str, MalformedCase] = {}
CONTROLS: dict[str, Callable[[], bytes]] = {}


def _malformed(error: type[GGUFError], mentions: str) -> Callable[[Callable[[], bytes]], Callable[[], bytes]]:
    def register(build: Callable[[], bytes]) -> Callable[[], bytes]:
        MALFORMED[build.__name__] = MalformedCase(build.__name__, build, error, mentions)
        return build
    return register


def _control(build: Callable[[], bytes]) -> Callable[[], bytes]:
    CONTROLS[build.__name__] = build
    return build


F, M, T = GGUFFormatError, GGUFMetadataError, GGUFTensorError


# Header ---------------------------------------------------------------------------------------------------------
@_malformed(F, "empty")
def empty_file() -> bytes:
    return b""


@_malformed(F, "truncated")
def truncated_magic() -> bytes:
    return b"GG"


@_malformed(F, "not a gguf file")
def bad_magic() -> bytes:
    return b"GGUX" + tiny_gguf_bytes()[4:]


@_malformed(F, "version 0")
def version_0() -> bytes:
    return _tiny(version=0)


@_malformed(F, "v1")
def version_1() -> bytes:
    return _tiny(version=1)


@_malformed(F, "version 4")
def version_future() -> bytes:
    return _tiny(version=4)


@_malformed(F, "big-endian")
def big_endian() -> bytes:
    return _tiny(version=0x03000000)


@_malformed(F, "truncated")
def truncated_header() -> bytes:
    return tiny_gguf_bytes()[:14]


@_malformed(F, "cannot fit")
def n_tensors_huge() -> bytes:
    return _tiny(n_tensors=2**64 - 1)


@_malformed(F, "cannot fit")
def n_kv_huge() -> bytes:
    return _tiny(n_kv=2**63)


@_malformed(F, "truncated")
def n_kv_one_too_many() -> bytes:
    kvs = tiny_kvs()
    return pack_gguf(kvs, [], n_kv=len(kvs) + 1)


# Metadata -------------------------------------------------------------------------------------------------------
@_malformed(F, "16 mib")
def key_length_huge() -> bytes:
    return _tiny(extra_kvs=[struct.pack("<Q", 2**40) + b"test.key"])


@_malformed(F, "longer than the rest of the file")
def key_length_past_end() -> bytes:
    return _tiny(extra_kvs=[struct.pack("<Q", 100_000) + b"test.key"])


@_malformed(M, "empty name")
def key_empty() -> bytes:
    return _tiny(extra_kvs=[pack_kv("", V.UINT32, 1)])


@_malformed(F, "utf-8")
def key_not_utf8() -> bytes:
    return _tiny(extra_kvs=[pack_kv(b"test.\xff\xfe", V.UINT32, 1)])


@_malformed(F, "unknown value type 13")
def unknown_value_type() -> bytes:
    return _tiny(extra_kvs=[pack_string("test.key") + struct.pack("<II", 13, 1)])


@_malformed(M, "appears twice")
def duplicate_key() -> bytes:
    return _tiny(extra_kvs=[pack_kv("general.name", V.STRING, "again")])


@_malformed(F, "truncated")
def truncated_kv_value() -> bytes:
    return pack_gguf(tiny_kvs(), [])[:-1]


@_malformed(F, "longer than the rest of the file")
def string_length_past_end() -> bytes:
    return _tiny(extra_kvs=[pack_string("test.key") + struct.pack("<IQ", V.STRING, 1_000_000) + b"abc"])


@_malformed(F, "16 mib")
def string_over_limit() -> bytes:
    return _tiny(extra_kvs=[pack_string("test.key") + struct.pack("<IQ", V.STRING, 16 * 2**20 + 1) + b"abc"])


@_malformed(F, "utf-8")
def string_not_utf8() -> bytes:
    return _tiny(extra_kvs=[pack_kv("test.key", V.STRING, b"\xc3\x28")])


@_malformed(F, "not 0 or 1")
def bool_not_0_or_1() -> bytes:
    return _tiny(extra_kvs=[pack_string("test.key") + struct.pack("<IB", V.BOOL, 2)])


@_malformed(F, "unknown value type 99")
def array_unknown_element_type() -> bytes:
    return _tiny(extra_kvs=[pack_string("test.key") + struct.pack("<IIQ", V.ARRAY, 99, 1) + bytes(8)])


@_malformed(F, "64 mi")
def array_count_huge() -> bytes:
    return _tiny(extra_kvs=[pack_string("test.key") + struct.pack("<IIQ", V.ARRAY, V.UINT8, 2**62)])


@_malformed(F, "cannot fit")
def array_count_past_end() -> bytes:
    return pack_gguf([*tiny_kvs(), pack_string("test.key") + struct.pack("<IIQ", V.ARRAY, V.UINT32, 1000) + bytes(8)],
                     [])


@_malformed(F, "16 mib")
def token_length_over_int32() -> bytes:
    tokens = pack_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2)
    return _tiny(kvs=tiny_kvs(metadata={}), extra_kvs=[tokens + pack_string("a") + struct.pack("<Q", 2**31 + 1)])


@_malformed(F, "not 0 or 1")
def array_bool_not_0_or_1() -> bytes:
    return _tiny(extra_kvs=[pack_string("test.key") + struct.pack("<IIQ3B", V.ARRAY, V.BOOL, 3, 0, 1, 5)])


@_malformed(F, "levels deep")
def nested_array_depth_10000() -> bytes:
    return _tiny(extra_kvs=[_nested_array(10_000)])


@_malformed(F, "levels deep")
def nested_array_one_level_too_deep() -> bytes:
    return _tiny(extra_kvs=[_nested_array(9)])


@_malformed(M, "power of two")
def alignment_not_power_of_two() -> bytes:
    return _tiny(extra_kvs=[pack_kv("general.alignment", V.UINT32, 48)], alignment=48)


@_malformed(M, "power of two")
def alignment_zero() -> bytes:
    return _tiny(extra_kvs=[pack_kv("general.alignment", V.UINT32, 0)])


@_malformed(M, "power of two")
def alignment_over_1_mib() -> bytes:
    return _tiny(extra_kvs=[pack_kv("general.alignment", V.UINT32, 2 * 2**20)])


@_malformed(M, "expected uint32")
def alignment_wrong_type() -> bytes:
    return _tiny(extra_kvs=[pack_kv("general.alignment", V.UINT64, 32)])


# Tensor directory -----------------------------------------------------------------------------------------------
@_malformed(F, "16 mib")
def tensor_name_length_huge() -> bytes:
    return _tiny(infos=[struct.pack("<Q", 2**63) + b"x" * 32])


@_malformed(T, "empty name")
def tensor_name_empty() -> bytes:
    return _with_tensor(name="")


@_malformed(F, "utf-8")
def tensor_name_not_utf8() -> bytes:
    return _with_tensor(name=b"\xff.weight")


@_malformed(T, "5 dimensions")
def tensor_n_dims_5() -> bytes:
    return _with_tensor(shape=(1, 1, 1, 1, 32))


@_malformed(T, "4294967295 dimensions")
def tensor_n_dims_huge() -> bytes:
    return _tiny(infos=[pack_string("x") + struct.pack("<I", 2**32 - 1) + bytes(64)], data=bytes(64))


@_malformed(T, "between 1 and")
def tensor_dim_zero() -> bytes:
    return _with_tensor(shape=(0, 32))


@_malformed(T, "between 1 and")
def tensor_dim_negative() -> bytes:
    return _with_tensor(shape=(2**64 - 1, 32))


@_malformed(T, "overflows")
def tensor_absurd_dims() -> bytes:
    return _with_tensor(shape=(1, 1, 2, 2**63 - 1))


@_malformed(T, "unknown ggml type id 4")
def tensor_removed_type() -> bytes:
    return _with_tensor(qtype=4)


@_malformed(T, "unknown ggml type id 2147483648")
def tensor_unknown_type() -> bytes:
    return _with_tensor(qtype=2**31)


@_malformed(T, "multiple of its block")
def tensor_row_not_whole_blocks() -> bytes:
    return _with_tensor(shape=(33,), qtype=Q.Q8_0)


@_malformed(T, "appears twice")
def tensor_duplicate_name() -> bytes:
    return _tiny(infos=[pack_tensor_info("x", (4,), Q.F32, 0), pack_tensor_info("x", (4,), Q.F32, 32)], data=bytes(64))


@_malformed(F, "truncated")
def tensor_table_truncated() -> bytes:
    infos, _ = layout_tensors(TINY_TENSORS)
    return pack_gguf(tiny_kvs(), infos)[:-10]


# Tensor data ----------------------------------------------------------------------------------------------------
@_malformed(F, "alignment")
def tensor_offset_misaligned() -> bytes:
    return _with_tensor(offset=4)


@_malformed(F, "truncated")
def tensor_offset_past_end() -> bytes:
    return _with_tensor(offset=2**20)


@_malformed(F, "truncated")
def tensor_offset_pad_wrap() -> bytes:
    return _with_tensor(offset=2**64 - 32)


@_malformed(F, "more than the whole file")
def tensor_exabyte() -> bytes:
    return _with_tensor(shape=(4, 2**30, 2**30))


@_malformed(F, "more than the whole file")
def cumulative_size_overflow() -> bytes:
    half = 2**61  # two F32 tensors of 2^63 bytes each: their sum wraps a 64-bit size
    infos = [pack_tensor_info("x", (half,), Q.F32, 0), pack_tensor_info("y", (half,), Q.F32, 2**63)]
    return _tiny(infos=infos, data=bytes(64))


@_malformed(F, "truncated")
def tensor_data_truncated() -> bytes:
    return tiny_gguf_bytes()[:-40]


@_malformed(F, "truncated")
def tensor_data_missing() -> bytes:
    infos, _ = layout_tensors(TINY_TENSORS)
    return pack_gguf(tiny_kvs(), infos)


@_malformed(F, "overlap")
def tensors_same_offset() -> bytes:
    return _tiny(infos=[pack_tensor_info("x", (4,), Q.F32, 0), pack_tensor_info("y", (4,), Q.F32, 0)], data=bytes(64))


@_malformed(F, "overlap")
def tensors_overlap() -> bytes:
    return _tiny(infos=[pack_tensor_info("x", (12,), Q.F32, 0), pack_tensor_info("y", (4,), Q.F32, 32)], data=bytes(64))


# Controls -------------------------------------------------------------------------------------------------------
@_control
def header_only() -> bytes:
    return pack_gguf([], [])


@_control
def metadata_only() -> bytes:
    return pack_gguf(tiny_kvs(), [])


@_control
def tiny_model() -> bytes:
    return tiny_gguf_bytes()


@_control
def custom_alignment() -> bytes:
    kvs = tiny_kvs()
    return pack_gguf([kvs[0], pack_kv("general.alignment", V.UINT32, 64), *kvs[1:]],
                     *layout_tensors(TINY_TENSORS, alignment=64), alignment=64)


@_control
def version_2() -> bytes:
    return _tiny(version=2)


@_control
def every_value_type() -> bytes:
    scalars = [pack_kv(f"test.{vtype.name.lower()}", vtype, 1) for vtype in _FORMATS]
    arrays = [
        pack_kv("test.empty_array", V.ARRAY, [], V.UINT32),
        pack_kv("test.empty_string", V.STRING, ""),
        pack_kv("test.nested", V.ARRAY, [[1, 2], [3]], V.ARRAY),
        _nested_array(8),
    ]
    return _tiny(extra_kvs=[*scalars, *arrays])
