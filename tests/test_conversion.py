"""ds4_core.conversion: the safetensors reader against the safetensors package, the GGUF type table, and the atomic
writer read back with gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T

from ds4_core.conversion import (
    PlannedTensor,
    SafetensorsSource,
    gguf_type,
    metadata_row,
    refuse_unknown_tensors,
    row_chunks,
    write_gguf_atomic,
)
from ds4_core.errors import ConversionError

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _f32_tensor(name: str, values: np.ndarray) -> PlannedTensor:
    return PlannedTensor(name, values.shape, T.F32, lambda: iter([values]))


# ---------------------------------------------------------------- reading


def test_float_and_integer_tensors_read_as_the_safetensors_numpy_loader_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    written = {"a.f32": rng.standard_normal((5, 3)).astype(np.float32),
               "b.f16": rng.standard_normal((4, 2, 3)).astype(np.float16),
               "c.i64": rng.integers(-9, 9, (6,), dtype=np.int64)}
    safetensors_numpy.save_file(written, tmp_path / "model.safetensors")
    want = safetensors_numpy.load_file(tmp_path / "model.safetensors")
    source = SafetensorsSource(tmp_path, dtypes=("F32", "F16", "I64"))
    assert source.names() == set(want)
    for name, value in want.items():
        got = source.rows(name)
        assert source.shape(name) == value.shape
        assert got.dtype == (np.int64 if value.dtype.kind == "i" else np.float32)
        np.testing.assert_array_equal(got, value.astype(got.dtype), err_msg=name)
    np.testing.assert_array_equal(source.rows("b.f16", 1, 3), want["b.f16"][1:3].astype(np.float32))


def test_bf16_tensors_read_as_torch_reads_them(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    save_file({"w": torch.randn(7, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
               "scalar": torch.tensor(3.5, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    want = {name: t.float().numpy() for name, t in load_file(tmp_path / "model.safetensors").items()}
    source = SafetensorsSource(tmp_path)
    np.testing.assert_array_equal(source.rows("w"), want["w"])
    np.testing.assert_array_equal(source.rows("w", 2, 4), want["w"][2:4])
    assert source.shape("scalar") == () and source.rows("scalar").tolist() == [3.5]


def test_shards_are_merged_and_a_tensor_in_two_shards_is_refused(tmp_path):
    safetensors_numpy.save_file({"x": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    safetensors_numpy.save_file({"y": np.zeros(3, np.float32)}, tmp_path / "b.safetensors")
    assert SafetensorsSource(tmp_path).names() == {"x", "y"}
    safetensors_numpy.save_file({"x": np.ones(2, np.float32)}, tmp_path / "c.safetensors")
    with pytest.raises(ConversionError, match="stray shard"):
        SafetensorsSource(tmp_path)


def test_unaccepted_dtypes_are_refused_unless_renamed_away(tmp_path):
    safetensors_numpy.save_file({"keep": np.ones(2, np.float32), "skip.ids": np.arange(3)},
                                tmp_path / "model.safetensors")
    with pytest.raises(ConversionError, match=r"I64.*supported: F32, F16, BF16"):
        SafetensorsSource(tmp_path)
    source = SafetensorsSource(tmp_path, rename=lambda name: None if name.startswith("skip.") else f"m.{name}")
    assert source.names() == {"m.keep"}
    with pytest.raises(ConversionError, match="no tensor 'keep'"):
        source.rows("keep")


def test_a_directory_without_safetensors_or_with_a_corrupt_header_is_refused(tmp_path):
    with pytest.raises(ConversionError, match=r"no \*\.safetensors"):
        SafetensorsSource(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little"))
    with pytest.raises(ConversionError, match="not a readable safetensors file"):
        SafetensorsSource(tmp_path)


def test_row_chunks_cover_the_tensor_in_whole_multiples_of_rows(tmp_path):
    values = np.arange(300 * 20000, dtype=np.float32).reshape(300, 20000)  # 6e6 elements: more than one chunk
    safetensors_numpy.save_file({"w": values}, tmp_path / "model.safetensors")
    chunks = list(row_chunks(SafetensorsSource(tmp_path), "w", row_multiple=128)())
    assert [len(c) for c in chunks] == [128, 128, 44]
    np.testing.assert_array_equal(np.concatenate(chunks), values)


# ---------------------------------------------------------------- types and metadata


@pytest.mark.parametrize(("type_class", "outtype", "row_length", "want"), [
    ("matrix", "q8_0", 64, T.Q8_0), ("matrix", "q8_0", 48, T.F16), ("half", "q8_0", 64, T.F16),
    ("f32", "q8_0", 64, T.F32), ("i32", "q8_0", 64, T.I32), ("matrix", "f16", 64, T.F16),
    ("half", "bf16", 64, T.BF16), ("matrix", "f32", 64, T.F32), ("f32", "bf16", 7, T.F32), ("i32", "f16", 3, T.I32),
])
def test_gguf_type_follows_the_recipe(type_class, outtype, row_length, want):
    assert gguf_type(type_class, outtype, row_length) == want


def test_unknown_tensors_are_named_up_to_five():
    refuse_unknown_tensors(set(), "unused")
    with pytest.raises(ConversionError, match=r"a, b, c, d, e and 2 more; check the config$"):
        refuse_unknown_tensors(list("gfedcba"), "check the config")


# ---------------------------------------------------------------- writing


def test_written_file_reads_back_with_gguf_py(tmp_path):
    weights = np.linspace(-1, 1, 4 * 32, dtype=np.float32).reshape(4, 32)
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    plan = [_f32_tensor("norm", np.array([1.5, -2.0], np.float32)),
            PlannedTensor("ids", ids.shape, T.I32, lambda: iter([ids])),
            PlannedTensor("w", weights.shape, T.F16, lambda: iter([weights[:3], weights[3:]]))]
    calls = []
    write_gguf_atomic(tmp_path / "out.gguf", "toy", [metadata_row("toy.block_count", 2),
                                                     metadata_row("toy.list", [1.0, 2.0])],
                      plan, lambda done, total: calls.append((done, total)))
    reader = GGUFReader(tmp_path / "out.gguf")
    assert reader.fields["general.architecture"].contents() == "toy"
    assert reader.fields["toy.block_count"].contents() == 2 and reader.fields["toy.list"].contents() == [1.0, 2.0]
    tensors = {t.name: t for t in reader.tensors}
    assert [t.name for t in reader.tensors] == ["norm", "ids", "w"]
    assert tensors["ids"].tensor_type == T.I32 and tensors["ids"].data.tolist() == ids.tolist()
    np.testing.assert_array_equal(tensors["w"].data, weights.astype(np.float16))
    assert calls == [(8, 288), (32, 288), (288, 288)]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"previous model")

    def chunks():
        yield np.zeros((1, 4), np.float32)
        raise RuntimeError("source went away")

    with pytest.raises(RuntimeError, match="went away"):
        write_gguf_atomic(out, "toy", [], [_f32_tensor("ok", np.ones(4, np.float32)),
                                           PlannedTensor("bad", (2, 4), T.F32, chunks)])
    assert out.read_bytes() == b"previous model"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_chunks_that_do_not_fill_the_declared_shape_are_refused(tmp_path):
    short = PlannedTensor("short", (4, 32), T.F32, lambda: iter([np.zeros((3, 32), np.float32)]))
    with pytest.raises(ConversionError, match="short produced 384 bytes instead of 512"):
        write_gguf_atomic(tmp_path / "out.gguf", "toy", [], [short])
    assert list(tmp_path.iterdir()) == []
