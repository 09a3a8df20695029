"""The hostile-GGUF corpus (SERVING.md T1), limit boundaries (T4) and a short mutation fuzz (T2, CI variant)."""

from __future__ import annotations

import struct
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4_core.errors import GGUFError, GGUFFormatError, GGUFMetadataError, GGUFTensorError
from ds4_core.gguf import MAX_ARRAY_ELEMENTS, MAX_STRING_BYTES, GGUFFile
from ds4_core.testing import gguf_files as gf

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


def _touch_everything(file: GGUFFile) -> None:
    """Read every value and every tensor, as a model load would."""
    dict(file.metadata)
    for name, info in file.tensors.items():
        assert file.tensor_bytes(name).nbytes == info.nbytes
        if info.type_name in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
            assert file.tensor_array(name).shape == info.shape


def _leaves(value: list) -> list:
    return [leaf for item in value for leaf in (_leaves(item) if isinstance(item, list) else [item])]


# --------------------------------------------------------------------------------------------------- corpus

def test_corpus_has_at_least_40_malformed_files_and_6_controls():
    assert len(gf.MALFORMED) >= 40
    assert len(gf.CONTROLS) == 6


@pytest.mark.parametrize("case", gf.MALFORMED.values(), ids=list(gf.MALFORMED))
def test_malformed_file_is_rejected_with_a_typed_error_naming_the_problem(case, tmp_path):
    path = tmp_path / f"{case.name}.gguf"
    path.write_bytes(case.build())
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(GGUFError) as caught:
            GGUFFile(path)
    finally:
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert type(caught.value) is case.error
    message = str(caught.value)
    assert str(path) in message
    assert case.mentions in message.lower()
    assert elapsed <= 1.0
    assert peak < 4 * 2**20, f"parsing a {path.stat().st_size}-byte file allocated {peak} bytes"


@pytest.mark.parametrize("build", gf.CONTROLS.values(), ids=list(gf.CONTROLS))
def test_control_file_loads_and_matches_the_gguf_package_reader(build, tmp_path):
    path = tmp_path / "control.gguf"
    path.write_bytes(build())
    started = time.perf_counter()
    with GGUFFile(path) as file:
        _touch_everything(file)
        assert time.perf_counter() - started <= 1.0
        oracle = gguf.GGUFReader(path)
        assert list(file.metadata) == [k for k in oracle.fields if not k.startswith("GGUF.")]
        for key, value in file.metadata.items():
            nested = file.metadata.value_type(key) == V.ARRAY and file.metadata.element_type(key) == V.ARRAY
            # GGUFReader flattens arrays of arrays; compare the leaves in order.
            assert (_leaves(value) if nested else value) == oracle.fields[key].contents(), key
        assert [t.name for t in oracle.tensors] == list(file.tensors)
        for tensor in oracle.tensors:
            info = file.tensors[tensor.name]
            assert (info.qtype, info.nbytes, info.offset) == (tensor.tensor_type, tensor.n_bytes, tensor.data_offset)
            assert file.tensor_bytes(tensor.name).tobytes() == tensor.data.tobytes()


def test_raw_encoder_writes_the_tiny_model_byte_for_byte_like_gguf_writer(tmp_path):
    written = gf.write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    assert gf.tiny_gguf_bytes() == written


def test_header_only_file_loads_but_has_no_architecture(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(gf.header_only())
    with GGUFFile(path) as file, pytest.raises(GGUFMetadataError, match=r"'general\.architecture' is missing"):
        _ = file.architecture


# --------------------------------------------------------------------------------------------------- T4 limits

def _string_kv_file(path: Path, nbytes: int) -> Path:
    kv = gf.pack_string("test.big") + struct.pack("<IQ", V.STRING, nbytes) + b"a" * nbytes
    path.write_bytes(gf.pack_gguf([*gf.tiny_kvs(), kv], []))
    return path


def _u8_array_file(path: Path, count: int) -> Path:
    kv = gf.pack_string("test.big") + struct.pack("<IIQ", V.ARRAY, V.UINT8, count) + bytes(count)
    path.write_bytes(gf.pack_gguf([*gf.tiny_kvs(), kv], []))
    return path


def test_string_of_exactly_16_mib_is_accepted_and_one_byte_more_is_rejected(tmp_path):
    with GGUFFile(_string_kv_file(tmp_path / "at.gguf", MAX_STRING_BYTES)) as file:
        assert len(file.metadata.str("test.big")) == MAX_STRING_BYTES == 16 * 2**20
    with pytest.raises(GGUFFormatError, match="over the limit"):
        GGUFFile(_string_kv_file(tmp_path / "over.gguf", MAX_STRING_BYTES + 1))


def test_array_of_exactly_64_mi_elements_is_accepted_and_one_more_is_rejected(tmp_path):
    with GGUFFile(_u8_array_file(tmp_path / "at.gguf", MAX_ARRAY_ELEMENTS)) as file:
        assert file.metadata.int_array("test.big").shape == (MAX_ARRAY_ELEMENTS,) == (64 * 2**20,)
    with pytest.raises(GGUFFormatError, match="over the limit"):
        GGUFFile(_u8_array_file(tmp_path / "over.gguf", MAX_ARRAY_ELEMENTS + 1))


def _tensor_file(path: Path, shape: tuple[int, ...], alignment: int = 32) -> Path:
    kvs = gf.tiny_kvs()
    if alignment != 32:
        kvs.append(gf.pack_kv("general.alignment", V.UINT32, alignment))
    info = gf.pack_tensor_info("x", shape, Q.F32, 0)
    path.write_bytes(gf.pack_gguf(kvs, [info], bytes(4 * int(np.prod(shape))), alignment=alignment))
    return path


def test_four_dimensions_are_accepted_and_five_rejected(tmp_path):
    with GGUFFile(_tensor_file(tmp_path / "4d.gguf", (2, 3, 4, 5))) as file:
        assert file.tensor_array("x").shape == (2, 3, 4, 5)
    with pytest.raises(GGUFTensorError, match="5 dimensions"):
        GGUFFile(_tensor_file(tmp_path / "5d.gguf", (1, 2, 3, 4, 5)))


def test_alignment_of_1_mib_is_accepted_and_2_mib_or_non_powers_of_two_rejected(tmp_path):
    with GGUFFile(_tensor_file(tmp_path / "1m.gguf", (8,), alignment=2**20)) as file:
        assert file.alignment == 2**20
        assert file.tensors["x"].offset == 2**20
    for bad in (2**21, 3 * 2**19, 2**20 + 1):
        with pytest.raises(GGUFMetadataError, match="power of two"):
            GGUFFile(_tensor_file(tmp_path / f"{bad}.gguf", (8,), alignment=bad))


def test_arrays_nested_8_deep_are_accepted_and_9_deep_rejected(tmp_path):
    ok, bad = tmp_path / "8.gguf", tmp_path / "9.gguf"
    ok.write_bytes(gf.pack_gguf([gf._nested_array(8)], []))
    bad.write_bytes(gf.pack_gguf([gf._nested_array(9)], []))
    with GGUFFile(ok) as file:
        assert file.metadata["test.deep"] == [[[[[[[[7]]]]]]]]
    with pytest.raises(GGUFFormatError, match="levels deep"):
        GGUFFile(bad)


# --------------------------------------------------------------------------------------------------- T2 fuzz (CI)

_SEEDS = [gf.tiny_gguf_bytes(), gf.every_value_type()]
_INTERESTING = [0, 1, 2, 31, 32, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]

_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("u64"), st.integers(0, 10**6), st.sampled_from(_INTERESTING)),
    st.tuples(st.just("u32"), st.integers(0, 10**6), st.sampled_from([v for v in _INTERESTING if v < 2**32])),
)


def _mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, where, value in mutations:
        if not buf:
            break
        pos = where % len(buf)
        if kind == "flip":
            buf[pos] ^= 1 << value
        elif kind == "truncate":
            del buf[pos:]
        else:
            width = 8 if kind == "u64" else 4
            buf[pos:pos + width] = value.to_bytes(width, "little")
    return bytes(buf)


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "mutant.gguf"


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(range(len(_SEEDS))), mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_mutated_files_either_load_or_raise_a_gguf_error(fuzz_path, seed, mutations):
    fuzz_path.write_bytes(_mutate(_SEEDS[seed], mutations))
    tracemalloc.start()
    try:
        with GGUFFile(fuzz_path) as file:
            _touch_everything(file)
    except GGUFError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 2**20
