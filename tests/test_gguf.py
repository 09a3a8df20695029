"""GGUFFile: round trip through gguf.GGUFWriter, zero-copy views, typed metadata and tensor checks."""

from __future__ import annotations

import mmap

import gguf
import numpy as np
import pytest

from ds4_core.errors import GGUFError, GGUFFormatError, GGUFMetadataError, GGUFTensorError
from ds4_core.gguf import GGUFFile, TensorInfo
from ds4_core.testing.gguf_files import tiny_gguf_bytes, write_gguf, write_tiny_gguf

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

METADATA = {
    "test.u8": (200, V.UINT8), "test.i8": (-100, V.INT8), "test.u16": (60000, V.UINT16),
    "test.i16": (-30000, V.INT16), "test.u32": (4_000_000_000, V.UINT32), "test.i32": (-2_000_000_000, V.INT32),
    "test.u64": (2**64 - 1, V.UINT64), "test.i64": (-(2**63), V.INT64), "test.f32": (0.1, V.FLOAT32),
    "test.f64": (0.1, V.FLOAT64), "test.bool": (True, V.BOOL), "test.str": ("héllo ⟨ds4⟩", V.STRING),
    "test.strs": (["a", "", "ü"], V.ARRAY, V.STRING), "test.u32s": ([0, 7, 2**32 - 1], V.ARRAY, V.UINT32),
    "test.i64s": ([-1, 2**40], V.ARRAY, V.INT64), "test.f32s": ([1.5, -2.25], V.ARRAY, V.FLOAT32),
    "test.f64s": ([1e300, 2.0], V.ARRAY, V.FLOAT64), "test.bools": ([True, False], V.ARRAY, V.BOOL),
    "test.nested": ([[1, 2], [3]], V.ARRAY, V.ARRAY),
}

rng = np.random.default_rng(0)
Q8_RAW = rng.integers(0, 256, size=(3, 2 * 34), dtype=np.uint8)
Q8_RAW[:, 0:2] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)  # a finite scale per block
Q8_RAW[:, 34:36] = np.frombuffer(np.float16(-0.5).tobytes(), np.uint8)
BF16_RAW = rng.integers(0, 2**16, size=(2, 5), dtype=np.uint16)
TENSORS = {
    "f32": rng.standard_normal((3, 4, 5)).astype(np.float32),
    "f16": rng.standard_normal((7, 3)).astype(np.float16),
    "f64": rng.standard_normal(4),
    "i8": np.arange(-5, 5, dtype=np.int8).reshape(2, 5),
    "i16": np.arange(6, dtype=np.int16),
    "i32": np.arange(12, dtype=np.int32).reshape(3, 4),
    "i64": np.array([2**40, -1], dtype=np.int64),
    "bf16": (BF16_RAW, Q.BF16, (2, 5)),
    "q8_0": (Q8_RAW, Q.Q8_0, (3, 64)),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf", "tinyarch", METADATA, TENSORS)
    with GGUFFile.open(path) as file:
        yield file


def test_header_fields(model):
    assert (model.version, model.alignment, model.architecture) == (3, 32, "tinyarch")


def test_metadata_round_trips_every_value_type(model):
    for key, (value, vtype, *element) in METADATA.items():
        assert model.metadata.value_type(key) == vtype
        expected = float(np.float32(value)) if vtype == V.FLOAT32 else value
        if element and element[0] == V.FLOAT32:
            expected = [float(np.float32(v)) for v in value]
        assert model.metadata[key] == expected, key
    assert list(model.metadata) == ["general.architecture", *METADATA]


def test_tensors_are_in_file_order_with_numpy_shapes(model):
    assert list(model.tensors) == list(TENSORS)
    assert model.tensors["f32"].shape == (3, 4, 5)
    assert model.tensors["q8_0"] == TensorInfo("q8_0", Q.Q8_0, (3, 64), model.tensors["q8_0"].offset, 3 * 2 * 34)
    assert model.tensors["bf16"].type_name == "BF16"


def test_tensor_views_equal_what_was_written(model):
    for name, value in TENSORS.items():
        if isinstance(value, tuple):
            assert model.tensor_bytes(name).tobytes() == value[0].tobytes()
        else:
            np.testing.assert_array_equal(model.tensor_array(name), value)
            assert model.tensor_array(name).dtype == value.dtype
    assert model.tensor_array("bf16").dtype == np.uint16
    np.testing.assert_array_equal(model.tensor_array("bf16"), BF16_RAW)


def test_tensors_agree_with_the_gguf_package_reader(model):
    for tensor in gguf.GGUFReader(model.path).tensors:
        info = model.tensors[tensor.name]
        assert (info.offset, info.nbytes, info.qtype) == (tensor.data_offset, tensor.n_bytes, tensor.tensor_type)
        assert model.tensor_bytes(tensor.name).tobytes() == tensor.data.tobytes()


def _mapped_buffer(view: np.ndarray) -> object:
    base = view
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_tensor_views_are_zero_copy_and_read_only(model):
    raw, typed = model.tensor_bytes("f32"), model.tensor_array("f32")
    assert np.shares_memory(raw, typed)
    assert isinstance(_mapped_buffer(raw), mmap.mmap) and isinstance(_mapped_buffer(typed), mmap.mmap)
    assert not raw.flags.writeable and not typed.flags.writeable


def test_quantized_tensor_has_no_element_view(model):
    with pytest.raises(GGUFTensorError, match="tensor_bytes"):
        model.tensor_array("q8_0")


# --------------------------------------------------------------------------------------------------- metadata getters

def test_typed_getters_return_python_values(model):
    md = model.metadata
    assert md.str("test.str") == "héllo ⟨ds4⟩"
    assert md.int("test.u64") == 2**64 - 1 and md.int("test.i8") == -100
    assert md.bool("test.bool") is True
    assert md.array("test.strs") == ["a", "", "ü"]
    assert md.float("test.f64") == 0.1


def test_float_getter_accepts_f32_f64_u32_and_i32(model):
    md = model.metadata
    assert md.float("test.f32") == pytest.approx(0.1, rel=1e-7)
    assert md.float("test.u32") == 4_000_000_000.0
    assert md.float("test.i32") == -2_000_000_000.0
    for key in ("test.u64", "test.i8", "test.str", "test.bool"):
        with pytest.raises(GGUFMetadataError, match="expected FLOAT32, FLOAT64, UINT32 or INT32"):
            md.float(key)


def test_int_getter_rejects_bool_float_and_string(model):
    for key, got in (("test.bool", "BOOL"), ("test.f32", "FLOAT32"), ("test.str", "STRING")):
        with pytest.raises(GGUFMetadataError, match=f"'{key}' has type {got}, expected an integer type"):
            model.metadata.int(key)


def test_missing_key_error_names_the_file_and_key(model):
    with pytest.raises(GGUFMetadataError) as caught:
        model.metadata.int("tinyarch.block_count")
    assert "'tinyarch.block_count' is missing" in str(caught.value)
    assert str(model.path) in str(caught.value)


def test_default_is_returned_for_missing_keys_but_does_not_hide_a_wrong_type(model):
    md = model.metadata
    assert md.int("absent", 7) == 7 and md.str("absent", None) is None and md.float_array("absent", None) is None
    with pytest.raises(GGUFMetadataError, match="has type STRING"):
        md.int("test.str", 7)


def test_numeric_array_getters(model):
    md = model.metadata
    ids = md.int_array("test.u32s")
    assert ids.dtype == np.uint32 and ids.tolist() == [0, 7, 2**32 - 1] and not ids.flags.writeable
    assert md.int_array("test.i64s").tolist() == [-1, 2**40]
    assert md.float_array("test.f32s").dtype == np.float64
    assert md.float_array("test.f32s").tolist() == [1.5, -2.25]
    assert md.float_array("test.u32s").tolist() == [0.0, 7.0, 2.0**32 - 1]
    assert md.element_type("test.bools") == V.BOOL and md.array("test.bools") == [True, False]
    with pytest.raises(GGUFMetadataError, match=r"ARRAY\[STRING\], expected ARRAY of an integer type"):
        md.int_array("test.strs")
    with pytest.raises(GGUFMetadataError, match="has type UINT32, expected ARRAY"):
        md.float_array("test.u32")


def test_value_type_of_a_missing_key_raises(model):
    with pytest.raises(GGUFMetadataError, match="missing"):
        model.metadata.value_type("absent")


# --------------------------------------------------------------------------------------------------- require_tensor

def test_require_tensor_accepts_matching_shape_and_types(model):
    info = model.require_tensor("q8_0", shape=(3, None), types=("Q8_0", "Q4_K"))
    assert info.shape == (3, 64)
    assert model.require_tensor("f16", types=[Q.F16]).type_name == "F16"


def test_require_tensor_reports_missing_tensor(model):
    with pytest.raises(GGUFTensorError, match=r"'blk\.0\.attn_q\.weight' is missing"):
        model.require_tensor("blk.0.attn_q.weight")


def test_require_tensor_reports_expected_and_actual_shape(model):
    with pytest.raises(GGUFTensorError, match=r"has shape \(3, 4, 5\), expected \(3, 5, '\*'\)"):
        model.require_tensor("f32", shape=(3, 5, None))
    with pytest.raises(GGUFTensorError, match=r"has shape \(3, 4, 5\), expected \(60,\)"):
        model.require_tensor("f32", shape=(60,))


def test_require_tensor_reports_expected_and_actual_type(model):
    with pytest.raises(GGUFTensorError, match="has type F16, expected one of F32, BF16"):
        model.require_tensor("f16", types=("F32", Q.BF16))


# --------------------------------------------------------------------------------------------------- lifecycle

def test_views_outlive_close_and_reads_after_close_raise(tmp_path):
    with GGUFFile(write_tiny_gguf(tmp_path / "tiny.gguf")) as file:
        kept = file.tensor_array("a.weight")
    np.testing.assert_array_equal(kept, np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(GGUFError, match="closed"):
        file.tensor_bytes("a.weight")


def test_truncated_file_opens_without_required_data_but_absent_tensors_raise(tmp_path):
    path = tmp_path / "partial.gguf"
    path.write_bytes(tiny_gguf_bytes()[:-40])  # the data of the last tensor, c.ids, is cut off
    with pytest.raises(GGUFFormatError, match="truncated"):
        GGUFFile(path)
    with GGUFFile.open(path, require_data=False) as file:
        assert list(file.tensors) == ["a.weight", "b.weight", "c.ids"]
        assert file.metadata.array("tokenizer.ggml.tokens") == ["<s>", "a", "b"]
        np.testing.assert_array_equal(file.tensor_array("a.weight"), np.arange(6, dtype=np.float32).reshape(2, 3))
        with pytest.raises(GGUFFormatError, match=r"'c\.ids' needs bytes"):
            file.tensor_bytes("c.ids")


def test_missing_path_and_directory_raise_gguf_errors(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path)


def test_write_gguf_custom_alignment_is_honoured(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", "x", {}, {"t": np.ones(3, np.float32), "u": np.ones(5, np.int32)},
                      alignment=256)
    with GGUFFile(path) as file:
        assert file.alignment == 256 and file.metadata.int("general.alignment") == 256
        assert all(info.offset % 256 == 0 for info in file.tensors.values())
        np.testing.assert_array_equal(file.tensor_array("u"), np.ones(5, np.int32))
