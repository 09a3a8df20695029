"""GGUF access: a bounds-checked reader over an mmap, with typed metadata and zero-copy tensor views.

The header, metadata table and tensor directory are parsed here rather than by
``gguf.GGUFReader``: every length is checked against the bytes left in the
file *before* anything is allocated, so a corrupt or hostile file fails with a
:class:`~ds4_core.errors.GGUFError` naming the file, the offending key or
tensor and what to do. The ``gguf`` package supplies the enums and block sizes.

Shapes are numpy order (the GGUF ``ne`` dims reversed: ``ne0`` is the last,
innermost dimension).
"""

from __future__ import annotations

import itertools
import math
import mmap
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import GGUFError, GGUFFormatError, GGUFMetadataError, GGUFTensorError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_STRING_BYTES = 16 * 1024 * 1024
MAX_ARRAY_ELEMENTS = 64 * 1024 * 1024
# GGUF allows arrays of arrays; no model uses more than one level, and a bound keeps parsing shallow.
MAX_ARRAY_DEPTH = 8
MAX_DIMS = 4
MAX_ALIGNMENT = 1024 * 1024
# ggml stores dims and element counts as int64.
INT64_MAX = 2**63 - 1

_FIX = "re-download the file or re-convert the model"

V = GGUFValueType
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.UINT64: "<Q", V.INT64: "<q", V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<B",
}
_SCALAR_DTYPES = {vtype: np.dtype(fmt) for vtype, fmt in _SCALAR_FORMATS.items()}
_STRUCTS = {fmt: struct.Struct(fmt) for fmt in _SCALAR_FORMATS.values()}
_U64 = _STRUCTS["<Q"]
_INT_TYPES = frozenset({V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64})
# ds4 reads float hyperparameters stored as any of these.
_FLOAT_TYPES = frozenset({V.FLOAT32, V.FLOAT64, V.UINT32, V.INT32})
# Smallest encoding of one element / entry, used to bound counts before reading them.
_MIN_ELEMENT_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}, V.STRING: 8, V.ARRAY: 12}
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # name length, 1-byte name, n_dims, type, offset

Q = GGMLQuantizationType
_ARRAY_DTYPES: dict[GGMLQuantizationType, str] = {
    Q.F32: "<f4", Q.F16: "<f2", Q.BF16: "<u2", Q.F64: "<f8", Q.I8: "<i1", Q.I16: "<i2", Q.I32: "<i4", Q.I64: "<i8",
}

_MISSING: Any = object()


def _block_geometry(qtype: GGMLQuantizationType) -> tuple[int, int]:
    # Every known GGML type is sized here, supported by a backend or not (ds4 sizes all of them);
    # ds4_core.quants.block_geometry accepts only the types ds4-core can compute with.
    return GGML_QUANT_SIZES[qtype]


@attrs.frozen
class TensorInfo:
    """One entry of the tensor directory; ``shape`` is numpy order, ``offset`` absolute in the file."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The GGML type name, e.g. ``"Q8_0"``."""
        return self.qtype.name

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@attrs.frozen
class _Entry:
    vtype: GGUFValueType
    value: Any  # python scalar; ndarray (numeric arrays); list (string and nested arrays)
    element_type: GGUFValueType | None = None


def _type_label(entry: _Entry) -> str:
    if entry.vtype == V.ARRAY:
        return f"ARRAY[{entry.element_type.name}]"
    return entry.vtype.name


def _as_python(entry: _Entry) -> Any:
    if isinstance(entry.value, np.ndarray):
        return entry.value.tolist()
    if isinstance(entry.value, list):
        return list(entry.value)
    return entry.value


class Metadata(Mapping[str, Any]):
    """The metadata table as a read-only mapping ``key -> python value`` (str, int, float, bool, list).

    Typed getters raise :class:`GGUFMetadataError` when the key is missing (and no
    default is given) or holds another type; a wrong type is an error even with a default.
    """

    def __init__(self, path: Path, entries: dict[str, _Entry]):
        self._path = path
        self._entries = entries

    def __getitem__(self, key: str) -> Any:
        return _as_python(self._entries[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Metadata({self._path.name}, {len(self)} keys)"

    def value_type(self, key: str) -> GGUFValueType:
        """The stored GGUF value type of ``key`` (``ARRAY`` for arrays)."""
        return self._entry(key).vtype

    def element_type(self, key: str) -> GGUFValueType:
        """The element type of the array ``key``."""
        entry = self._typed(key, {V.ARRAY}, "ARRAY")
        return entry.element_type

    def str(self, key: str, default: Any = _MISSING) -> str:
        """The STRING value of ``key``."""
        entry = self._typed(key, {V.STRING}, "STRING", default)
        return default if entry is None else entry.value

    def int(self, key: str, default: Any = _MISSING) -> int:
        """The value of ``key`` stored as any integer type (not BOOL)."""
        entry = self._typed(key, _INT_TYPES, "an integer type", default)
        return default if entry is None else entry.value

    def float(self, key: str, default: Any = _MISSING) -> float:
        """The value of ``key`` stored as FLOAT32, FLOAT64, UINT32 or INT32, as a python float."""
        entry = self._typed(key, _FLOAT_TYPES, "FLOAT32, FLOAT64, UINT32 or INT32", default)
        return default if entry is None else float(entry.value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        """The BOOL value of ``key``."""
        entry = self._typed(key, {V.BOOL}, "BOOL", default)
        return default if entry is None else entry.value

    def array(self, key: str, default: Any = _MISSING) -> list:
        """The ARRAY value of ``key`` as a python list (any element type)."""
        entry = self._typed(key, {V.ARRAY}, "ARRAY", default)
        return default if entry is None else _as_python(entry)

    def int_array(self, key: str, default: Any = _MISSING) -> np.ndarray:
        """The integer ARRAY ``key``: a read-only array of shape ``[n]`` and the stored dtype."""
        entry = self._array_of(key, _INT_TYPES, "an integer type", default)
        return default if entry is None else entry.value

    def float_array(self, key: str, default: Any = _MISSING) -> np.ndarray:
        """The ARRAY ``key`` of FLOAT32/FLOAT64/UINT32/INT32 elements as float64, shape ``[n]``."""
        entry = self._array_of(key, _FLOAT_TYPES, "FLOAT32, FLOAT64, UINT32 or INT32", default)
        return default if entry is None else entry.value.astype(np.float64)

    def _entry(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise GGUFMetadataError(
                f"{self._path}: metadata key {key!r} is missing; check that the file is the model you meant, "
                "or re-convert it with a current converter"
            )
        return entry

    def _typed(self, key: str, allowed: Iterable[GGUFValueType], expected: str,
               default: Any = _MISSING) -> _Entry | None:
        if key not in self._entries and default is not _MISSING:
            return None
        entry = self._entry(key)
        if entry.vtype not in allowed:
            raise GGUFMetadataError(
                f"{self._path}: metadata key {key!r} has type {_type_label(entry)}, expected {expected}; "
                "the file was written by a broken or foreign converter — re-convert it"
            )
        return entry

    def _array_of(self, key: str, elements: Iterable[GGUFValueType], expected: str, default: Any) -> _Entry | None:
        entry = self._typed(key, {V.ARRAY}, f"ARRAY of {expected}", default)
        if entry is not None and entry.element_type not in elements:
            raise GGUFMetadataError(
                f"{self._path}: metadata key {key!r} has type {_type_label(entry)}, expected ARRAY of {expected}; "
                "the file was written by a broken or foreign converter — re-convert it"
            )
        return entry


class _Cursor:
    """Reads little-endian fields from the mapped file, refusing to read past its end."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf = buf
        self.path = path
        self.size = len(buf)
        self.pos = 0

    def fail(self, cls: type[GGUFError], message: str) -> GGUFError:
        return cls(f"{self.path}: {message}")

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.fail(
                GGUFFormatError,
                f"the file is truncated in {what}: {n} bytes needed at offset {self.pos}, only {left} left; {_FIX}",
            )

    def scalar(self, fmt: str, what: str) -> Any:
        reader = _STRUCTS[fmt]
        if reader.size > self.size - self.pos:
            self.need(reader.size, what)
        (value,) = reader.unpack_from(self.buf, self.pos)
        self.pos += reader.size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str, index: int | None = None) -> str:
        """A u64-length-prefixed UTF-8 string; ``index`` names an array element (labels are built only on error)."""
        pos, left = self.pos, self.size - self.pos
        length = _U64.unpack_from(self.buf, pos)[0] if left >= 8 else None
        if length is not None and length <= min(MAX_STRING_BYTES, left - 8):
            try:
                value = self.buf[pos + 8:pos + 8 + length].decode("utf-8")
            except UnicodeDecodeError:
                pass
            else:
                self.pos = pos + 8 + length
                return value
        raise self._bad_string(what if index is None else f"element {index} of {what}", length)

    def _bad_string(self, what: str, length: int | None) -> GGUFError:
        if length is None:
            return self.fail(GGUFFormatError, f"the file is truncated in the length of {what}; {_FIX}")
        if length > MAX_STRING_BYTES:
            return self.fail(
                GGUFFormatError,
                f"{what} declares a string of {length} bytes, over the limit of {MAX_STRING_BYTES} (16 MiB); "
                f"the file is corrupt — {_FIX}",
            )
        left = self.size - self.pos - 8
        if length > left:
            return self.fail(
                GGUFFormatError,
                f"{what} declares a string of {length} bytes at offset {self.pos + 8}, longer than the rest of the "
                f"file ({left} bytes); the file is truncated or corrupt — {_FIX}",
            )
        return self.fail(GGUFFormatError, f"{what} is not valid UTF-8; the file is corrupt — {_FIX}")


def _value_type(cur: _Cursor, raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cur.fail(
            GGUFFormatError,
            f"{what} has unknown value type {raw}; the file is corrupt or from a newer GGUF writer — {_FIX}",
        ) from None


def _read_scalar(cur: _Cursor, vtype: GGUFValueType, what: str) -> Any:
    value = cur.scalar(_SCALAR_FORMATS[vtype], what)
    if vtype == V.BOOL:
        if value > 1:
            raise cur.fail(GGUFFormatError, f"{what} is a BOOL of value {value}, not 0 or 1; {_FIX}")
        return bool(value)
    return value


def _read_array(cur: _Cursor, what: str, depth: int) -> _Entry:
    if depth > MAX_ARRAY_DEPTH:
        raise cur.fail(
            GGUFFormatError,
            f"{what} nests arrays more than {MAX_ARRAY_DEPTH} levels deep; the file is corrupt — {_FIX}",
        )
    element_type = _value_type(cur, cur.u32(f"the element type of {what}"), f"the array {what}")
    count = cur.u64(f"the element count of {what}")
    if count > MAX_ARRAY_ELEMENTS:
        raise cur.fail(
            GGUFFormatError,
            f"{what} declares an array of {count} elements, over the limit of {MAX_ARRAY_ELEMENTS} (64 Mi); "
            f"the file is corrupt — {_FIX}",
        )
    left = cur.size - cur.pos
    if count * _MIN_ELEMENT_BYTES[element_type] > left:
        raise cur.fail(
            GGUFFormatError,
            f"{what} declares an array of {count} {element_type.name} elements, which cannot fit in the "
            f"{left} bytes left in the file; the file is truncated or corrupt — {_FIX}",
        )
    if element_type in _SCALAR_DTYPES:
        dtype = _SCALAR_DTYPES[element_type]
        # A copy, so that metadata does not pin the mapping open after close().
        values = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos).copy()
        values.flags.writeable = False
        cur.pos += count * dtype.itemsize
        if element_type == V.BOOL:
            if np.any(values > 1):
                raise cur.fail(GGUFFormatError, f"{what} holds BOOL values that are not 0 or 1; {_FIX}")
            values = values.view(np.bool_)
        return _Entry(V.ARRAY, values, element_type)
    if element_type == V.STRING:
        return _Entry(V.ARRAY, [cur.string(what, i) for i in range(count)], element_type)
    nested = [_as_python(_read_array(cur, f"element {i} of {what}", depth + 1)) for i in range(count)]
    return _Entry(V.ARRAY, nested, element_type)


def _read_value(cur: _Cursor, key: str) -> _Entry:
    what = f"metadata key {key!r}"
    vtype = _value_type(cur, cur.u32(f"the value type of {what}"), what)
    if vtype == V.STRING:
        return _Entry(vtype, cur.string(what))
    if vtype == V.ARRAY:
        return _read_array(cur, what, depth=1)
    return _Entry(vtype, _read_scalar(cur, vtype, what))


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    if cur.size == 0:
        raise cur.fail(GGUFFormatError, f"the file is empty; {_FIX}")
    cur.need(4, "the magic number")
    magic = bytes(cur.buf[0:4])
    if magic != MAGIC:
        raise cur.fail(
            GGUFFormatError,
            f"not a GGUF file: it starts with {magic!r}, not {MAGIC!r}; pass a .gguf model file, {_FIX}",
        )
    cur.pos = 4
    version = cur.u32("the header (version)")
    if version not in SUPPORTED_VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            hint = "it is a big-endian GGUF; re-convert the model as little-endian"
        elif version == 1:
            hint = "GGUF v1 (2023) is no longer supported; re-convert the model with a current converter"
        else:
            hint = f"ds4-core reads GGUF versions {SUPPORTED_VERSIONS[0]} and {SUPPORTED_VERSIONS[1]}; {_FIX}"
        raise cur.fail(GGUFFormatError, f"unsupported GGUF version {version}: {hint}")
    n_tensors = cur.u64("the header (tensor count)")
    n_kv = cur.u64("the header (metadata count)")
    left = cur.size - cur.pos
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > left:
        raise cur.fail(
            GGUFFormatError,
            f"the header declares {n_kv} metadata keys and {n_tensors} tensors, which cannot fit in the "
            f"{left} bytes that follow; the file is truncated or corrupt — {_FIX}",
        )
    return version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for index in range(n_kv):
        key = cur.string(f"the name of metadata key #{index}")
        if not key:
            raise cur.fail(GGUFMetadataError, f"metadata key #{index} has an empty name; the file is corrupt — {_FIX}")
        if key in entries:
            raise cur.fail(
                GGUFMetadataError,
                f"metadata key {key!r} appears twice; the file was written by a broken converter — re-convert it",
            )
        entries[key] = _read_value(cur, key)
    return entries


def _alignment(cur: _Cursor, entries: dict[str, _Entry]) -> int:
    entry = entries.get("general.alignment")
    if entry is None:
        return DEFAULT_ALIGNMENT
    if entry.vtype != V.UINT32:
        raise cur.fail(
            GGUFMetadataError,
            f"metadata key 'general.alignment' has type {_type_label(entry)}, expected UINT32; "
            "the file was written by a broken converter — re-convert it",
        )
    value = entry.value
    if value == 0 or value & (value - 1) or value > MAX_ALIGNMENT:
        raise cur.fail(
            GGUFMetadataError,
            f"metadata key 'general.alignment' is {value}; it must be a power of two no larger than "
            f"{MAX_ALIGNMENT} (1 MiB) — the file is corrupt, {_FIX}",
        )
    return value


def _quant_type(cur: _Cursor, raw: int, what: str) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(raw)
    except ValueError:
        qtype = None
    if qtype is None or qtype not in GGML_QUANT_SIZES:
        raise cur.fail(
            GGUFTensorError,
            f"{what} has unknown GGML type id {raw}; the file is corrupt or uses a type newer than this "
            "ds4-core — re-quantize the model to a supported type",
        )
    return qtype


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int, int]:
    """One directory entry: (name, type, numpy shape, offset relative to the data section, nbytes)."""
    name = cur.string(f"the name of tensor #{index}")
    if not name:
        raise cur.fail(GGUFTensorError, f"tensor #{index} has an empty name; the file is corrupt — {_FIX}")
    what = f"tensor {name!r}"
    n_dims = cur.u32(f"the dimension count of {what}")
    if n_dims > MAX_DIMS:
        raise cur.fail(
            GGUFTensorError, f"{what} has {n_dims} dimensions, more than GGML's {MAX_DIMS}; the file is corrupt, {_FIX}"
        )
    dims = [cur.u64(f"the dimensions of {what}") for _ in range(n_dims)]
    for dim in dims:
        # A zero dim makes an empty tensor that no model needs, and it breaks ggml's row-size arithmetic.
        if dim == 0 or dim > INT64_MAX:
            raise cur.fail(
                GGUFTensorError,
                f"{what} has GGUF dims ne={dims}; each must be between 1 and 2^63-1 (an empty tensor holds no "
                f"weights and no model uses one) — the file is corrupt, {_FIX}",
            )
    n_elements = math.prod(dims)
    if n_elements > INT64_MAX:
        raise cur.fail(
            GGUFTensorError,
            f"{what} has GGUF dims ne={dims} whose element count overflows 64 bits; the file is corrupt — {_FIX}",
        )
    qtype = _quant_type(cur, cur.u32(f"the type of {what}"), what)
    offset = cur.u64(f"the data offset of {what}")
    block_elems, block_bytes = _block_geometry(qtype)
    row = dims[0] if dims else 1
    if row % block_elems:
        raise cur.fail(
            GGUFTensorError,
            f"{what} is {qtype.name} with rows of {row} elements, not a multiple of its block of "
            f"{block_elems}; the file is corrupt — {_FIX}",
        )
    nbytes = n_elements // block_elems * block_bytes
    return name, qtype, tuple(reversed(dims)), offset, nbytes


def _read_tensors(cur: _Cursor, n_tensors: int, alignment: int, require_data: bool) -> dict[str, TensorInfo]:
    directory = []
    names: set[str] = set()
    for index in range(n_tensors):
        entry = _read_tensor_info(cur, index)
        if entry[0] in names:
            raise cur.fail(
                GGUFTensorError,
                f"tensor {entry[0]!r} appears twice in the tensor table; the file was written by a broken "
                "converter — re-convert it",
            )
        names.add(entry[0])
        directory.append(entry)
    data_start = -(-cur.pos // alignment) * alignment
    data_size = max(cur.size - data_start, 0)
    tensors: dict[str, TensorInfo] = {}
    for name, qtype, shape, offset, nbytes in directory:
        what = f"tensor {name!r}"
        if offset % alignment:
            raise cur.fail(
                GGUFFormatError,
                f"{what} starts at data offset {offset}, not a multiple of the alignment {alignment}; "
                f"the file is corrupt — {_FIX}",
            )
        if nbytes > (cur.size if require_data else INT64_MAX):
            raise cur.fail(
                GGUFFormatError,
                f"{what} ({qtype.name}, shape {shape}) declares {nbytes} bytes, more than the whole file "
                f"({cur.size} bytes); the file is corrupt — {_FIX}",
            )
        if require_data and offset + nbytes > data_size:
            raise cur.fail(
                GGUFFormatError,
                f"the file is truncated: {what} needs bytes {offset}..{offset + nbytes} of the tensor data, "
                f"but the file holds only {data_size} bytes of tensor data; {_FIX}",
            )
        tensors[name] = TensorInfo(name, qtype, shape, data_start + offset, nbytes)
    by_offset = sorted(tensors.values(), key=lambda t: t.offset)
    for before, after in itertools.pairwise(by_offset):
        if after.offset < before.offset + before.nbytes:
            raise cur.fail(
                GGUFFormatError,
                f"tensors {before.name!r} and {after.name!r} overlap in the file; the file is corrupt — {_FIX}",
            )
    return tensors


class GGUFFile:
    """A GGUF file mapped read-only; use as a context manager or call :meth:`close`.

    ``tensors`` is in file order; tensor views returned by :meth:`tensor_bytes` and
    :meth:`tensor_array` point into the mapping and stay valid after :meth:`close`
    (the mapping is released once the last view is gone).
    """

    path: Path
    version: int
    alignment: int
    metadata: Metadata
    tensors: dict[str, TensorInfo]

    def __init__(self, path: str | Path, *, require_data: bool = True):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                size = fh.seek(0, 2)
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot open the GGUF file ({exc.strerror}); check the path") from None
        try:
            cur = _Cursor(self._map, self.path)
            self.version, n_tensors, n_kv = _read_header(cur)
            entries = _read_metadata(cur, n_kv)
            self.alignment = _alignment(cur, entries)
            self.metadata = Metadata(self.path, entries)
            self.tensors = _read_tensors(cur, n_tensors, self.alignment, require_data)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, path: str | Path, *, require_data: bool = True) -> GGUFFile:
        """Map and validate ``path``; raises a :class:`GGUFError` subclass if it is not a sound GGUF file.

        With ``require_data=False`` tensor data may be missing (a truncated or header-only file, e.g. for
        ``ds4 info``); reading a tensor whose bytes are absent then raises :class:`GGUFFormatError`.
        """
        return cls(path, require_data=require_data)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"

    @property
    def architecture(self) -> str:
        """``general.architecture``; :class:`GGUFMetadataError` if missing or not a string."""
        return self.metadata.str("general.architecture")

    def close(self) -> None:
        """Release the mapping (deferred by the OS-level mapping while tensor views still use it)."""
        mapped, self._map = self._map, None
        if isinstance(mapped, mmap.mmap):
            try:
                mapped.close()
            except BufferError:
                pass  # live views keep the mapping; it closes when the last one is collected

    def require_tensor(self, name: str, *, shape: Iterable[int | None] | None = None,
                       types: Iterable[GGMLQuantizationType | str] | None = None) -> TensorInfo:
        """The tensor ``name``, checked against ``shape`` (numpy order, ``None`` = any size) and ``types``."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFTensorError(
                f"{self.path}: tensor {name!r} is missing; the file is for another model or an incomplete "
                "conversion — check the file or re-convert it"
            )
        if shape is not None:
            expected = tuple(shape)
            if len(expected) != len(info.shape) or any(
                    e is not None and e != g for e, g in zip(expected, info.shape, strict=True)):
                raise GGUFTensorError(
                    f"{self.path}: tensor {name!r} has shape {info.shape}, expected "
                    f"{tuple('*' if e is None else e for e in expected)}; the file does not match the model's "
                    "hyperparameters — re-convert it"
                )
        if types is not None:
            allowed = [GGMLQuantizationType[t] if isinstance(t, str) else GGMLQuantizationType(t) for t in types]
            if info.qtype not in allowed:
                raise GGUFTensorError(
                    f"{self.path}: tensor {name!r} has type {info.type_name}, expected one of "
                    f"{', '.join(t.name for t in allowed)}; re-quantize the model with a supported recipe"
                )
        return info

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of tensor ``name``: uint8, shape ``[nbytes]``, a read-only view into the file."""
        info = self.require_tensor(name)
        return np.frombuffer(self._mapped(info), dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def tensor_array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a read-only typed view of its numpy shape (F32/F16/F64/I8/I16/I32/I64; BF16 as uint16)."""
        info = self.require_tensor(name)
        dtype = _ARRAY_DTYPES.get(info.qtype)
        if dtype is None:
            raise GGUFTensorError(
                f"{self.path}: tensor {name!r} is {info.type_name}, a block-quantized type with no element view; "
                "use tensor_bytes() and ds4_core.quants to dequantize it"
            )
        flat = np.frombuffer(self._mapped(info), dtype=dtype, count=info.n_elements, offset=info.offset)
        return flat.reshape(info.shape)

    def _mapped(self, info: TensorInfo) -> mmap.mmap:
        if self._map is None:
            raise GGUFError(f"{self.path}: the GGUF file was closed; open it again to read tensors")
        if info.offset + info.nbytes > len(self._map):
            raise GGUFFormatError(
                f"{self.path}: the file is truncated: tensor {info.name!r} needs bytes {info.offset}.."
                f"{info.offset + info.nbytes} but the file has {len(self._map)}; {_FIX}"
            )
        return self._map
