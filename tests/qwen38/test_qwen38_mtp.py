"""The numpy Qwen3.8 MTP head reproduces the torch MTP head that ``tools/train_tiny`` trains.

Oracle: ``tools/train_tiny/mtp_qwen38.py``'s ``MtpHead`` (built from transformers' own Qwen4Exp decoder layer, norm
and hyper-connection mixer) on a tiny random ``Qwen4ExpForCausalLM``, float32. Our side: the directory saved as the
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

from ds4_model_qwen38.convert import convert, hparams_from_config, plan_tensors, text_tower_source  # noqa: E402
from ds4_model_qwen38.mtp import mtp_cross_entropy, mtp_logits  # noqa: E402
from ds4_model_qwen38.tiny import build_tiny_hf  # noqa: E402

from ds4_core.conversion import read_hf_config, tokenizer_metadata, write_gguf_atomic  # noqa: E402
from ds4_core.engine import Engine  # noqa: E402
from ds4_core.errors import ConversionError, GGUFTensorError, ModelConfigError  # noqa: E402
from ds4_core.gguf import GGUFFile  # noqa: E402
from ds4_core.testing.conformance import assert_logits_match  # noqa: E402

MTP_SCRIPT = Path(__file__).parents[2] / "tools" / "train_tiny" / "mtp_qwen38.py"
LENGTH = 41  # 40 MTP rows: 20 blocks of 2 against a budget of 2 blocks, so the MTP's indexer selects
EOS_POSITIONS = (3, 4, 17, 30)  # n-gram resets in the trunk's PLE layers
CHUNKS = (1, 7, 3, 13, 2, 5, 9)
RELATIVE_TOLERANCE = 1e-3


def _random(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Order-one weights: zero-centred norms ``0.3·N(0, 1)`` (the converter's ``1 + w`` shift matters), matrices
    ``N(0, 1/fan-in)``."""
    if "norm" in name.rsplit(".", 2)[-2]:
        return 0.3 * rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1] if len(shape) > 1 else 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, load_script):
    """(model directory with ``mtp.safetensors``, torch model, its MtpHead, f32 GGUF path)."""
    directory = tmp_path_factory.mktemp("qwen38-mtp")
    model = build_tiny_hf(directory / "model", seed=81)
    mtp = load_script(MTP_SCRIPT, "mtp_qwen38").MtpHead(model).eval()
    rng = np.random.default_rng(82)
    shared = {id(p) for p in model.parameters()}
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if id(p) not in shared:
                p.copy_(torch.from_numpy(_random(name, tuple(p.shape), rng).astype(np.float32)))
    safetensors_torch.save_file({k: v.contiguous() for k, v in mtp.checkpoint_tensors().items()},
                                directory / "model" / "mtp.safetensors")
    convert(directory / "model", directory / "mtp.gguf", "f32")
    return directory / "model", model, mtp, directory / "mtp.gguf"


@pytest.fixture(scope="module")
def engine(trained):
    engine = Engine.load(trained[3], backend="numpy", ctx=64)
    yield engine
    engine.close()


def _ids(model) -> np.ndarray:
    ids = np.random.default_rng(83).integers(1, model.config.vocab_size, LENGTH)
    ids[list(EOS_POSITIONS)] = model.config.eos_token_id
    return ids


def _torch_logits(model, mtp, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(trunk logits ``[T, V]``, MTP logits ``[T-1, V]``)."""
    with torch.no_grad():
        batch = torch.from_numpy(ids[None].astype(np.int64))
        trunk = model(input_ids=batch).logits[0].numpy()
        return trunk, mtp(batch)[0].numpy()


def test_numpy_mtp_matches_torch_head(trained, engine):
    _, model, mtp, _ = trained
    ids = _ids(model)
    trunk, expected = _torch_logits(model, mtp, ids)
    assert engine.model.cfg.num_layers == model.config.num_hidden_layers  # the MTP block is not run as trunk
    assert_logits_match(engine.new_session().feed(ids), trunk, RELATIVE_TOLERANCE, "trunk")
    assert_logits_match(mtp_logits(engine.model, ids), expected, RELATIVE_TOLERANCE, "mtp")
    total, count = mtp_cross_entropy(engine.model, ids)
    reference = torch.nn.functional.cross_entropy(torch.from_numpy(expected[:-1]), torch.from_numpy(ids[2:]),
                                                  reduction="sum").item()
    assert count == LENGTH - 2
    assert abs(total - reference) <= 1e-3 * reference


def test_chunked_drafting_equals_one_run(trained, engine):
    _, model, _, _ = trained
    ids = _ids(model)
    whole = mtp_logits(engine.model, ids)
    m = engine.model
    streams = m.forward_streams(ids[:-1], m.new_state(LENGTH))
    state, parts, start, i = m.mtp.new_state(LENGTH), [], 0, 0
    while start < LENGTH - 1:
        stop = min(start + CHUNKS[i % len(CHUNKS)], LENGTH - 1)
        parts.append(m.mtp.draft(streams[start:stop], ids[start + 1:stop + 1], state, start)[0])
        start, i = stop, i + 1
    assert_logits_match(np.concatenate(parts), whole, 1e-4, "chunked")


def test_mtp_block_selection_is_exercised(trained, engine):
    """A budget covering every block (dense attention) changes the drafts clearly: QSA selection matters here."""
    ids = _ids(trained[1])
    mixer = engine.model.mtp.block.mixer
    sparse = mtp_logits(engine.model, ids)
    mixer.block_topk, saved = LENGTH, mixer.block_topk
    try:
        dense = mtp_logits(engine.model, ids)
    finally:
        mixer.block_topk = saved
    assert np.abs(sparse - dense).max() > 1e-2 * np.abs(dense).max()


def test_converted_names_and_values(trained):
    _, model, mtp, path = trained
    L, D = model.config.num_hidden_layers, model.config.hidden_size
    state = {k: v.numpy() for k, v in mtp.checkpoint_tensors().items()}
    with GGUFFile(path) as gguf:
        meta = gguf.metadata
        assert meta["qwen4exp.block_count"] == L + 1 and meta["qwen4exp.nextn_predict_layers"] == 1
        assert len(meta["qwen4exp.attention.compress_ratios"]) == L + 1
        get = lambda name: np.asarray(gguf.tensor_array(name))  # noqa: E731
        np.testing.assert_array_equal(get(f"blk.{L}.nextn.eh_proj.weight"),
                                      np.concatenate([state["mtp.fc_embedding.weight"],
                                                      state["mtp.fc_hidden.weight"]], axis=1))
        assert get(f"blk.{L}.nextn.eh_proj.weight").shape == (D, 2 * D)
        np.testing.assert_allclose(get(f"blk.{L}.nextn.hnorm.weight"), 1 + state["mtp.pre_fc_norm_hidden.weight"])
        np.testing.assert_allclose(get(f"blk.{L}.nextn.hc_head_norm.weight"),
                                   1 + state["mtp.hyper_connection_mixer.hc_norm.weight"])
        np.testing.assert_allclose(get(f"blk.{L}.attn_q_norm.weight"),
                                   1 + state["mtp.layers.0.self_attn.q_norm.weight"])
        assert list(gguf.tensors)[-1] == "per_layer_token_embd.weight"


def test_incomplete_mtp_is_refused_by_converter(trained, tmp_path):
    directory = trained[0]
    copy = tmp_path / "src"
    shutil.copytree(directory, copy)
    tensors = safetensors_torch.load_file(copy / "mtp.safetensors")
    del tensors["mtp.fc_hidden.weight"]
    safetensors_torch.save_file(tensors, copy / "mtp.safetensors")
    with pytest.raises(ConversionError, match=r"mtp\.fc_hidden\.weight"):
        convert(copy, tmp_path / "out.gguf", "f32")
    assert not (tmp_path / "out.gguf").exists()


def test_missing_mtp_tensor_is_a_clear_load_error(trained, tmp_path):
    directory, model, _, _ = trained
    source = text_tower_source(directory)
    hp = hparams_from_config(read_hf_config(directory), 1)
    name = f"blk.{model.config.num_hidden_layers}.nextn.eh_proj.weight"
    plan = [t for t in plan_tensors(hp, source, "f32") if t.name != name]
    write_gguf_atomic(tmp_path / "cut.gguf", "qwen4exp", [*hp.to_gguf_metadata(),
                                                         *tokenizer_metadata(directory, hp.vocab_size, "qwen35")], plan)
    with pytest.raises(GGUFTensorError, match=r"MTP head .*eh_proj"):
        Engine.load(tmp_path / "cut.gguf", backend="numpy", ctx=16)


def test_misuse_errors(trained, engine, tmp_path):
    m = engine.model
    with pytest.raises(ModelConfigError, match="streams have shape"):
        m.mtp.draft(np.zeros((3, 2, 2), np.float32), np.array([1, 2, 3]), m.mtp.new_state(8), 0)
    plain = tmp_path / "plain"
    shutil.copytree(trained[0], plain)
    (plain / "mtp.safetensors").unlink()
    convert(plain, tmp_path / "plain.gguf", "f32")  # without mtp.* the trunk converts as before
    trunk_only = Engine.load(tmp_path / "plain.gguf", backend="numpy", ctx=16)
    try:
        assert trunk_only.model.mtp is None
        with pytest.raises(ModelConfigError, match="no MTP head"):
            mtp_logits(trunk_only.model, _ids(trained[1])[:8])
    finally:
        trunk_only.close()
