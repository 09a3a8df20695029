"""The numpy GLM 5.3 Flash MTP drafter reproduces the torch MTP head that ``tools/train_tiny`` trains.

Oracle: ``tools/train_tiny/mtp_glm53.py``'s ``MtpHead`` (built from transformers' own Glm5Next attention and MoE
modules) on a tiny random ``Glm5NextForConditionalGeneration``, float32. Our side: the directory saved as the
training script saves it (``save_pretrained`` + ``mtp.safetensors``), converted to an f32 GGUF and loaded by
``Engine.load(backend="numpy")``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ds4_model_glm5.next_convert import convert, hparams_from_config, plan_tensors  # noqa: E402
from ds4_model_glm5.next_mtp import MtpDrafter  # noqa: E402
from ds4_model_glm5.next_tiny import build_tiny_hf, random_parameter  # noqa: E402

from ds4_core.conversion import (  # noqa: E402
    SafetensorsSource,
    read_hf_config,
    tokenizer_metadata,
    write_gguf_atomic,
)
from ds4_core.engine import Engine  # noqa: E402
from ds4_core.errors import ConversionError, GGUFTensorError, ModelConfigError  # noqa: E402
from ds4_core.testing.conformance import assert_logits_match  # noqa: E402

MTP_SCRIPT = Path(__file__).parents[2] / "tools" / "train_tiny" / "mtp_glm53.py"
LENGTH = 41  # 40 MTP rows: 10 pools of 4, several times the top-8 (2 pools) budget, so the indexer selects
CHUNKS = (1, 7, 3, 13, 2, 5, 9)
RELATIVE_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def trained(tmp_path_factory, load_script):
    """(directory with config, model and mtp safetensors, torch model, its MtpHead, f32 GGUF path)."""
    directory = tmp_path_factory.mktemp("glm53-mtp")
    model = build_tiny_hf(directory / "model", seed=71)
    mtp = load_script(MTP_SCRIPT, "mtp_glm53").MtpHead(model).eval()
    rng = np.random.default_rng(72)
    shared = {id(p) for p in model.parameters()}
    with torch.no_grad():  # random, order-one weights so every term of the block matters (next_tiny's recipe)
        for name, t in [*mtp.named_parameters(), *mtp.named_buffers()]:
            if id(t) not in shared:
                t.copy_(torch.from_numpy(random_parameter(name, tuple(t.shape), rng)))
    safetensors_torch.save_file({k: v.contiguous() for k, v in mtp.checkpoint_tensors().items()},
                                directory / "model" / "mtp.safetensors")
    convert(directory / "model", directory / "mtp.gguf", "f32")
    return directory / "model", model, mtp, directory / "mtp.gguf"


@pytest.fixture(scope="module")
def engine(trained):
    engine = Engine.load(trained[3], backend="numpy", ctx=64)
    yield engine
    engine.close()


def _torch_mtp_logits(model, mtp, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        batch = torch.from_numpy(ids[None].astype(np.int64))
        model(input_ids=batch)
        return mtp(batch)[0].float().numpy()


def test_numpy_mtp_logits_match_the_torch_head(trained, engine):
    _, model, mtp, _ = trained
    ids = np.random.default_rng(73).integers(0, model.config.text_config.vocab_size, LENGTH)
    expected = _torch_mtp_logits(model, mtp, ids)
    got = MtpDrafter(engine.model).logits(ids)
    assert got.shape == (LENGTH - 1, model.config.text_config.vocab_size)
    assert_logits_match(np.asarray(got), expected, RELATIVE_TOLERANCE, "glm53 mtp")


def test_chunked_drafting_equals_the_prefill(trained, engine):
    """Trunk and MTP fed in uneven chunks (as while decoding) give the prefill's draft logits."""
    _, model, _, _ = trained
    ids = np.random.default_rng(74).integers(0, model.config.text_config.vocab_size, LENGTH)
    drafter = MtpDrafter(engine.model)
    trunk, mtp_state = engine.model.new_state(LENGTH), drafter.new_state(LENGTH - 1)
    hidden = np.concatenate([engine.model.hidden(ids[s:s + 10], trunk) for s in range(0, LENGTH, 10)])
    rows, start, i = [], 0, 0
    while start < LENGTH - 1:
        stop = min(start + CHUNKS[i % len(CHUNKS)], LENGTH - 1)
        rows.append(drafter.draft(hidden[start:stop], ids[start + 1:stop + 1], mtp_state))
        start, i = stop, i + 1
    np.testing.assert_allclose(np.concatenate(rows), drafter.logits(ids), rtol=1e-4, atol=1e-4)


def test_heldout_cross_entropy_matches_the_training_loss(trained, engine):
    """``cross_entropy(window)`` is train.py's held-out MTP loss (trunk on window[:-1], targets window[2:])."""
    _, model, mtp, _ = trained
    window = np.random.default_rng(75).integers(0, model.config.text_config.vocab_size, LENGTH + 1)
    logits = torch.from_numpy(_torch_mtp_logits(model, mtp, window[:-1]))
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(window[2:]), reduction="sum").item()
    total, count = MtpDrafter(engine.model).cross_entropy(window)
    assert count == LENGTH - 1
    assert total / count == pytest.approx(expected / count, rel=1e-3)


def test_missing_mtp_tensors_are_refused_clearly(trained, tmp_path):
    directory = trained[0]
    src = tmp_path / "no-hnorm"
    shutil.copytree(directory, src)
    state = safetensors_torch.load_file(src / "mtp.safetensors")
    safetensors_torch.save_file({k: v for k, v in state.items() if not k.endswith("hnorm.weight")},
                                src / "mtp.safetensors")
    with pytest.raises(ConversionError, match="hnorm"):
        convert(src, tmp_path / "x.gguf", "f32")

    # A GGUF that declares the MTP block but lacks one of its nextn tensors.
    hp = hparams_from_config(read_hf_config(directory), 1)
    plan = plan_tensors(hp, SafetensorsSource(directory), "f32")
    metadata = [*((k, v, t, s) for k, (v, t, s) in hp.to_gguf_metadata().items()),
                *tokenizer_metadata(directory, hp.vocab_size, "glm4")]
    write_gguf_atomic(tmp_path / "broken.gguf", "glm5-next", metadata,
                      [t for t in plan if t.name != f"blk.{hp.num_layers}.nextn.hnorm.weight"])
    with pytest.raises(GGUFTensorError, match=rf"blk\.{hp.num_layers}\.nextn\.hnorm\.weight' is missing"):
        Engine.load(tmp_path / "broken.gguf", backend="numpy", ctx=16)

    # A GGUF without an MTP block loads, but has nothing to draft with.
    (src / "mtp.safetensors").unlink()
    convert(src, tmp_path / "trunk.gguf", "f32")
    trunk_only = Engine.load(tmp_path / "trunk.gguf", backend="numpy", ctx=16)
    with pytest.raises(ModelConfigError, match="no MTP block"):
        MtpDrafter(trunk_only.model)
