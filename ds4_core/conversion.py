"""What every Hugging Face -> GGUF converter shares: reading the checkpoint, choosing tensor types, writing atomically.

A model plugin's converter keeps what is specific to its family (hyperparameters, name tables, the plan of GGUF
tensors, value transforms) and builds on this module:

* :func:`read_hf_config`, :func:`config_field`, :func:`check_outtype` - the inputs;
* :class:`SafetensorsSource` - a directory's ``*.safetensors`` files, memory-mapped, read as leading-axis row slices;
* :class:`PlannedTensor`, :func:`gguf_type`, :func:`row_chunks`, :func:`stacked_expert_chunks`,
  :func:`member_chunks`, :func:`refuse_unknown_tensors` - the plan, one entry per GGUF tensor;
* :func:`metadata_row`, :func:`tokenizer_metadata`, :func:`write_gguf_atomic` - the output.

Tensors stream one chunk at a time, so memory stays bounded by the largest chunk, and the output file appears only
once it is complete (temporary file beside it, fsync, rename, fsync of the directory).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType

from .errors import ConversionError, TokenizerError
from .files import fsync_dir
from .quants import quantize, tensor_nbytes
from .tokenizer import TOKEN_UNUSED, tokenizer_metadata_from_hf

#: (key, value, value type, array element type or None): one GGUF metadata entry as ``GGUFWriter`` takes it.
MetadataRow = tuple[str, Any, GGUFValueType, GGUFValueType | None]
#: ``progress(done_bytes, total_bytes)``, called after each tensor is written.
Progress = Callable[[int, int], None]
#: A zero-argument callable yielding a tensor's values in row order, as arrays whose rows concatenate to it.
Chunks = Callable[[], Iterator[np.ndarray]]

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
#: Elements per streamed chunk of a tensor of two or more dimensions.
CHUNK_ELEMENTS = 1 << 22

_T = GGMLQuantizationType


# ---------------------------------------------------------------- inputs


def read_hf_config(src_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model directory ``src_dir`` as a dict."""
    config_path = Path(src_dir) / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{src_dir} has no config.json; point the converter at a Hugging Face model directory")
    try:
        return json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{config_path} is not valid JSON ({exc}); re-download it") from None


def config_field(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, refused with a hint when it is missing or null (no default would be safe)."""
    if config.get(key) is None:
        raise ConversionError(f"config.json has no {key!r}; the converter needs it (add it from the model card or "
                              "the model's original config.json)")
    return config[key]


def check_outtype(outtype: str) -> str:
    """``outtype`` lower-cased, if it is one of :data:`OUTTYPES`."""
    if not isinstance(outtype, str) or outtype.lower() not in OUTTYPES:
        raise ConversionError(f"unsupported output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    return outtype.lower()


# ---------------------------------------------------------------- sources


class TensorSource(Protocol):
    """Named tensors read as leading-axis slices."""

    def names(self) -> set[str]:
        """Every tensor name the source holds."""

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy-order shape of ``name``."""

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """``name[start:stop]``: float32, or int64 for integer tensors."""


#: safetensors dtype -> little-endian numpy dtype its payload is viewed as (BF16 as raw bits, FP8 as bytes).
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
                      "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "u1", "F8_E4M3": "u1", "F8_E8M0": "u1"}
FLOAT_DTYPES = ("F32", "F16", "BF16")
# A header beyond this is a corrupt length field, not a checkpoint.
_MAX_HEADER_BYTES = 100 << 20


@attrs.frozen
class StoredTensor:
    """Where one tensor's payload lies: file, safetensors dtype, shape, and absolute byte offsets ``[begin, end)``."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(path: Path) -> dict[str, StoredTensor]:
    """Tensor directory of one safetensors file (parsed here: safetensors' numpy API cannot decode BF16)."""
    try:
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= _MAX_HEADER_BYTES:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{path} is not a readable safetensors file ({exc}); re-download it") from None
    base = 8 + length
    return {name: StoredTensor(path, entry["dtype"], tuple(entry["shape"]), base + entry["data_offsets"][0],
                               base + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


class SafetensorsSource:
    """Every ``*.safetensors`` file of a directory, memory-mapped, read as leading-axis row slices.

    ``dtypes`` lists the safetensors dtypes the converter accepts (others are refused when the source opens).
    ``rename`` maps a stored name to the name the converter uses, or to ``None`` to skip the tensor (vision towers,
    MTP blocks); skipped tensors are not dtype-checked. Two tensors under one name are refused.
    """

    def __init__(self, directory: str | os.PathLike[str], *, dtypes: Collection[str] = FLOAT_DTYPES,
                 rename: Callable[[str], str | None] | None = None):
        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{directory} holds no *.safetensors files; point the converter at the model "
                                  "directory downloaded from Hugging Face or written by save_pretrained")
        self._stored: dict[str, StoredTensor] = {}
        self._maps: dict[Path, np.memmap] = {}
        for path in files:
            for stored_name, entry in _read_header(path).items():
                name = rename(stored_name) if rename is not None else stored_name
                if name is None:
                    continue
                if entry.dtype not in dtypes:
                    hint = " (dequantize FP8 checkpoints first)" if entry.dtype.startswith("F8") else ""
                    raise ConversionError(f"{path.name}: tensor {stored_name!r} has dtype {entry.dtype}, which this "
                                          f"converter cannot read; supported: {', '.join(dtypes)}{hint}")
                if name in self._stored:
                    raise ConversionError(f"tensor {name!r} appears in both {self._stored[name].path.name} and "
                                          f"{path.name}; remove the stray shard")
                self._stored[name] = entry

    def names(self) -> set[str]:
        """Every tensor name, after ``rename``."""
        return set(self._stored)

    def has(self, name: str) -> bool:
        return name in self._stored

    def entry(self, name: str) -> StoredTensor:
        """Where ``name`` is stored; refused with a hint when the checkpoint lacks it."""
        if name not in self._stored:
            raise ConversionError(f"the checkpoint has no tensor {name!r}; the download is incomplete or config.json "
                                  "does not match the weights")
        return self._stored[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def raw(self, entry: StoredTensor, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of ``entry``'s payload viewed as :data:`SAFETENSORS_DTYPES` (no copy, no decoding);
        a scalar reads as shape ``(1,)``."""
        if entry.path not in self._maps:
            self._maps[entry.path] = np.memmap(entry.path, dtype=np.uint8, mode="r")
        data = self._maps[entry.path][entry.begin:entry.end].view(SAFETENSORS_DTYPES[entry.dtype])
        return data.reshape(entry.shape or (1,))[start:stop]

    def decode(self, raw: np.ndarray, dtype: str) -> np.ndarray:
        """A :meth:`raw` array of safetensors ``dtype`` as float32 (int64 for integer dtypes), same shape."""
        if dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if dtype.startswith("I"):
            return raw.astype(np.int64)
        return raw.astype(np.float32)

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """``name[start:stop]`` decoded (the whole tensor by default)."""
        entry = self.entry(name)
        return self.decode(self.raw(entry, start, stop), entry.dtype)


# ---------------------------------------------------------------- the plan


@attrs.frozen
class PlannedTensor:
    """One GGUF tensor: name, numpy-order shape (GGUF dims reversed), type, and its chunks in row order."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    chunks: Chunks

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def gguf_type(type_class: str, outtype: str, row_length: int) -> GGMLQuantizationType:
    """The GGML type of a tensor of ``type_class`` whose rows hold ``row_length`` elements, under ``outtype``.

    Type classes: ``"matrix"`` -> Q8_0 under q8_0 (F16 when ``row_length`` does not fill 32-element Q8_0 blocks);
    ``"half"`` -> F16 under q8_0; both -> the outtype under f32/f16/bf16; ``"f32"`` always F32; ``"i32"`` always I32.
    """
    if type_class == "i32":
        return _T.I32
    if type_class == "f32":
        return _T.F32
    if outtype != "q8_0":
        return _T[outtype.upper()]
    return _T.Q8_0 if type_class == "matrix" and row_length % 32 == 0 else _T.F16


def row_chunks(source: TensorSource, name: str, row_multiple: int = 1) -> Chunks:
    """``name`` in chunks of about :data:`CHUNK_ELEMENTS` elements, each a whole number of ``row_multiple`` rows
    (for block-scaled sources); a 1-D or scalar tensor comes in one chunk of shape ``shape or (1,)``."""
    def chunks() -> Iterator[np.ndarray]:
        shape = source.shape(name)
        if len(shape) < 2:
            yield source.rows(name, 0, shape[0] if shape else 1).reshape(shape or (1,))
            return
        step = CHUNK_ELEMENTS // max(1, math.prod(shape[1:])) // row_multiple * row_multiple
        step = max(row_multiple, step)
        for start in range(0, shape[0], step):
            yield source.rows(name, start, min(start + step, shape[0]))
    return chunks


def stacked_expert_chunks(source: TensorSource, name: str, n_experts: int, part: str, ffn: int) -> Chunks:
    """One routed expert at a time from a stacked tensor: ``part`` ``"gate"``/``"up"`` yields rows ``[:ffn]`` /
    ``[ffn:]`` of ``gate_up_proj [E, 2·ffn, D]`` as ``[ffn, D]``; ``"down"`` yields ``down_proj [E, D, ffn]`` as
    ``[D, ffn]``."""
    def chunks() -> Iterator[np.ndarray]:
        for expert in range(n_experts):
            block = source.rows(name, expert, expert + 1)[0]
            yield block if part == "down" else block[:ffn] if part == "gate" else block[ffn:]
    return chunks


def member_chunks(source: TensorSource, names: list[str]) -> Chunks:
    """Each tensor of ``names`` whole, in order: per-expert ``[rows, cols]`` tensors as one ``[E, rows, cols]``."""
    def chunks() -> Iterator[np.ndarray]:
        for name in names:
            yield source.rows(name, 0, source.shape(name)[0])
    return chunks


def refuse_unknown_tensors(unknown: Collection[str], hint: str) -> None:
    """Raise when the plan left checkpoint tensors unread; the message names up to five and ends with ``hint``."""
    if unknown:
        names = sorted(unknown)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ConversionError(f"the checkpoint holds tensors this converter does not know: {shown}; {hint}")


# ---------------------------------------------------------------- metadata


def metadata_row(key: str, value: Any) -> MetadataRow:
    """The row of a plain Python value; lists, tuples and arrays become arrays typed by their first element."""
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        return (key, items, GGUFValueType.ARRAY, GGUFValueType.get_type(items[0]) if items else GGUFValueType.INT32)
    return (key, value, GGUFValueType.get_type(value), None)


def tokenizer_metadata(src_dir: Path, vocab: int, pre: str) -> list[MetadataRow]:
    """``tokenizer.*`` rows from ``src_dir``'s tokenizer.json (special ids and chat template from
    tokenizer_config.json when present) with pre-tokenizer ``pre``; the token list is padded with unused
    ``[PAD<id>]`` entries up to the model's ``vocab`` embedding rows."""
    if not (src_dir / "tokenizer.json").is_file():
        raise ConversionError(f"{src_dir} has no tokenizer.json; copy it from the model's Hugging Face repository")
    try:
        metadata = tokenizer_metadata_from_hf(src_dir, pre=pre)
    except TokenizerError as exc:
        raise ConversionError(f"cannot convert the tokenizer of {src_dir}: {exc}") from None
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    if len(tokens) > vocab:
        raise ConversionError(f"tokenizer.json has {len(tokens)} tokens but the model only {vocab} embedding rows; "
                              "the tokenizer belongs to another model")
    metadata["tokenizer.ggml.tokens"] = [*tokens, *(f"[PAD{i}]" for i in range(len(tokens), vocab))]
    metadata["tokenizer.ggml.token_type"] = [*types, *[TOKEN_UNUSED] * (vocab - len(types))]
    rows = [metadata_row(key, value) for key, value in metadata.items()]
    # special-token ids are UINT32, as gguf-py writes them and llama.cpp requires
    return [(k, v, GGUFValueType.UINT32, None) if k.endswith("_token_id") else (k, v, t, e) for k, v, t, e in rows]


# ---------------------------------------------------------------- writing


def _encode(chunk: np.ndarray, qtype: GGMLQuantizationType) -> bytes:
    if qtype == _T.I32:
        return np.ascontiguousarray(chunk, dtype="<i4").tobytes()
    return quantize(np.ascontiguousarray(chunk, dtype=np.float32), qtype).tobytes()


def write_gguf_atomic(out_path: str | os.PathLike[str], arch: str, metadata_rows: list[MetadataRow],
                      plan: list[PlannedTensor], progress: Progress | None = None) -> None:
    """Write a GGUF of architecture ``arch``: ``metadata_rows`` in order, then every tensor of ``plan`` in order.

    The file is written to a temporary file beside ``out_path``, fsynced and renamed over it, so ``out_path`` keeps
    its old content on any failure (including an exception raised by ``progress``). A tensor whose chunks do not
    fill exactly :attr:`PlannedTensor.nbytes` is refused.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    writer = GGUFWriter(None, arch)
    try:
        for key, value, vtype, sub_type in metadata_rows:
            writer.add_key_value(key, value, vtype, sub_type)
        for tensor in plan:
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes,
                                   raw_dtype=tensor.qtype)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        _write_tensor_data(writer, plan, progress)
        writer.flush()
        os.fsync(writer.fout[0].fileno())
        writer.close()
        os.replace(tmp, out_path)
        fsync_dir(out_path.parent)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _write_tensor_data(writer: GGUFWriter, plan: list[PlannedTensor], progress: Progress | None) -> None:
    fout, alignment = writer.fout[0], writer.data_alignment
    total, done = sum(t.nbytes for t in plan), 0
    for tensor in plan:
        fout.write(b"\0" * (-fout.tell() % alignment))
        written = 0
        for chunk in tensor.chunks():
            data = _encode(chunk, tensor.qtype)
            fout.write(data)
            written += len(data)
        if written != tensor.nbytes:
            raise ConversionError(f"tensor {tensor.name} produced {written} bytes instead of {tensor.nbytes}; the "
                                  "source tensor does not match its declared shape")
        done += written
        if progress is not None:
            progress(done, total)
    fout.write(b"\0" * (-fout.tell() % alignment))
