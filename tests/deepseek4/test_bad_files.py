"""A DeepSeek V4 file with a missing tensor, a wrong shape or a wrong type is refused with one clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from ds4_core.engine import Engine
from ds4_core.errors import GGUFTensorError, ModelConfigError
from ds4_core.gguf import GGUFFile
from ds4_core.testing.gguf_files import write_gguf


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from ds4_model_deepseek4.tiny import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def rewrite(src: Path, dst: Path, *, drop: str | None = None, replace: dict | None = None,
            metadata: dict | None = None) -> Path:
    """Copy ``src`` through the real writer, dropping or replacing tensors and overriding metadata."""
    with GGUFFile(src) as g:
        md = {k: (g.metadata[k], g.metadata.value_type(k), g.metadata.element_type(k)
                  if g.metadata.value_type(k).name == "ARRAY" else None) for k in g.metadata
              if not k.startswith("general.architecture") and k != "general.alignment"}
        md = {k: (v, t) if e is None else (list(v), t, e) for k, (v, t, e) in md.items()}
        md.update(metadata or {})
        tensors = {n: (np.array(g.tensor_bytes(n)), t.qtype, t.shape) for n, t in g.tensors.items() if n != drop}
    tensors.update(replace or {})
    return write_gguf(dst, "deepseek4", md, tensors)


def test_the_rewritten_copy_still_loads(source, tmp_path):
    engine = Engine.load(rewrite(source, tmp_path / "copy.gguf"), backend="numpy")
    reference = Engine.load(source, backend="numpy")
    ids = [5, 6, 7, 8]
    np.testing.assert_array_equal(engine.new_session().feed(ids), reference.new_session().feed(ids))


def test_missing_tensor_names_it(source, tmp_path):
    with pytest.raises(GGUFTensorError, match=r"blk\.2\.attn_kv\.weight"):
        Engine.load(rewrite(source, tmp_path / "m.gguf", drop="blk.2.attn_kv.weight"), backend="numpy")


def test_wrong_shape_names_expected_and_found(source, tmp_path):
    with GGUFFile(source) as g:
        info = g.tensors["output_norm.weight"]
    bad = np.ones(info.shape[0] + 1, np.float32)
    with pytest.raises(GGUFTensorError, match=r"output_norm\.weight"):
        Engine.load(rewrite(source, tmp_path / "s.gguf", replace={"output_norm.weight": bad}), backend="numpy")


def test_wrong_type_for_a_slot_is_refused(source, tmp_path):
    with GGUFFile(source) as g:
        info = g.tensors["blk.0.attn_norm.weight"]
    as_int = (np.zeros(info.shape, np.int32).view(np.uint8), GGMLQuantizationType.I32, info.shape)
    with pytest.raises(GGUFTensorError, match=r"blk\.0\.attn_norm\.weight"):
        Engine.load(rewrite(source, tmp_path / "t.gguf", replace={"blk.0.attn_norm.weight": as_int}), backend="numpy")


def test_inconsistent_hyperparameters_are_refused(source, tmp_path):
    from gguf import GGUFValueType

    bad = {"deepseek4.attention.output_group_count": (3, GGUFValueType.UINT32)}
    with pytest.raises(ModelConfigError, match=r"o_groups|group"):
        Engine.load(rewrite(source, tmp_path / "c.gguf", metadata=bad), backend="numpy")
