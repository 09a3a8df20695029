"""The DeepSeek V4 MTP block: trained in torch (tools/train_tiny/mtp_deepseek4.py), converted, run in numpy.

Oracle: ``MtpHead``, built from transformers' own ``DeepseekV4DecoderLayer``/``DeepseekV4HyperHead`` and run on
the trunk's captured streams. Our side: the converted f32 GGUF's ``mtp.0.*`` tensors on the numpy backend.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "train_tiny"))

from ds4_model_deepseek4.convert import (  # noqa: E402
    ARCHITECTURE,
    BlockScaledSafetensorsSource,
    convert,
    gguf_metadata,
    hparams_from_config,
    plan_tensors,
)
from ds4_model_deepseek4.mtp import MtpDrafter  # noqa: E402
from ds4_model_deepseek4.tiny import _random_tensor, build_tiny_hf, tiny_config  # noqa: E402
from mtp_deepseek4 import MtpHead  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ds4_core.conversion import metadata_row, read_hf_config, tokenizer_metadata, write_gguf_atomic  # noqa: E402
from ds4_core.engine import Engine  # noqa: E402
from ds4_core.errors import GGUFTensorError  # noqa: E402
from ds4_core.gguf import GGUFFile  # noqa: E402
from ds4_core.testing.conformance import assert_logits_match  # noqa: E402

LENGTH = 40  # several MTP sliding windows (8) and HCA groups of the trunk
RELATIVE_TOLERANCE = 1e-3
# GGUF names of the MTP block (spec §12.3): its own tensors, then a sliding non-hash layer's under "mtp.0.".
MTP_GGUF_NAMES = {f"mtp.0.{n}" for n in (
    "e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn.weight",
    "hc_head_base.weight", "hc_head_scale.weight", "hc_attn_fn.weight", "hc_attn_scale.weight",
    "hc_attn_base.weight", "hc_ffn_fn.weight", "hc_ffn_scale.weight", "hc_ffn_base.weight", "attn_norm.weight",
    "ffn_norm.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight", "attn_kv.weight",
    "attn_kv_a_norm.weight", "attn_sinks.weight", "attn_output_a.weight", "attn_output_b.weight",
    "ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
    "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint directory with model/mtp.safetensors, trunk, MtpHead, f32 GGUF path)."""
    directory = tmp_path_factory.mktemp("mtp-hf")
    model = build_tiny_hf(directory, seed=7)
    head = MtpHead(model).eval()
    # Re-draw the block's own weights as the tiny oracle models do (random sinks, biases, HC base/scale, norms),
    # so every term of the block shows in the logits; embedding and head stay the trunk's.
    rng = np.random.default_rng(8)
    config = tiny_config()
    with torch.no_grad():
        for name, tensor in [*head.named_parameters(), *head.named_buffers()]:
            if not name.startswith(("embed_tokens.", "lm_head.", "rotary_emb.")):
                tensor.copy_(torch.from_numpy(_random_tensor(name, tuple(tensor.shape), config, rng)))
    save_file({k: v.detach().contiguous() for k, v in head.checkpoint_tensors().items()},
              directory / "mtp.safetensors")
    gguf = directory / "with-mtp-f32.gguf"
    convert(directory, gguf, "f32")
    return directory, model, head, gguf


def torch_mtp_logits(model, head, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        batch = torch.from_numpy(ids[None].astype(np.int64))
        model(input_ids=batch)
        return head(batch)[0].numpy()


def test_numpy_mtp_matches_torch_mtp_head(trained):
    _, model, head, gguf = trained
    ids = np.random.default_rng(9).integers(0, model.config.vocab_size, LENGTH)
    expected = torch_mtp_logits(model, head, ids)
    engine = Engine.load(gguf, backend="numpy")
    got = np.asarray(MtpDrafter(engine.model).logits(ids))
    assert_logits_match(got, expected, RELATIVE_TOLERANCE, "mtp prefill")


def test_incremental_drafting_matches_prefill(trained):
    _, model, _, gguf = trained
    ids = np.random.default_rng(10).integers(0, model.config.vocab_size, LENGTH)
    engine = Engine.load(gguf, backend="numpy")
    drafter = MtpDrafter(engine.model)
    engine.model.forward(ids, engine.model.new_state(LENGTH))
    streams = engine.model.last_stream
    state, rows, start = drafter.new_state(LENGTH), [], 0
    for size in (1, 5, 3, 9, 1, 2, 11, 7):
        stop = min(start + size, LENGTH - 1)
        rows.append(drafter.draft(streams[start:stop], ids[start + 1:stop + 1], state)[0])
        start = stop
    assert start == LENGTH - 1
    assert_logits_match(np.concatenate(rows), np.asarray(drafter.logits(ids)), 1e-5, "mtp chunked")


def test_heldout_cross_entropy_matches_torch(trained):
    _, model, head, gguf = trained
    window = np.random.default_rng(11).integers(0, model.config.vocab_size, LENGTH + 1)
    logits = torch.from_numpy(torch_mtp_logits(model, head, window[:-1]))
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(window[2:]), reduction="sum").item()
    total, count = MtpDrafter(Engine.load(gguf, backend="numpy").model).cross_entropy(window)
    assert count == LENGTH - 1
    assert total == pytest.approx(expected, rel=1e-4)


def test_converter_writes_the_mtp_block(trained, tmp_path):
    directory, model, _, gguf = trained
    d, e, i, n = model.config.hidden_size, model.config.n_routed_experts, model.config.moe_intermediate_size, 4
    with GGUFFile(gguf) as g:
        names = {name for name in g.tensors if name.startswith("mtp.")}
        shapes = {name: tuple(g.tensors[name].shape) for name in names}
        trunk = {name for name in g.tensors if not name.startswith("mtp.")}
        assert shapes["mtp.0.attn_q_a.weight"] == tuple(g.tensors["blk.0.attn_q_a.weight"].shape)
    assert names == MTP_GGUF_NAMES
    assert shapes["mtp.0.e_proj.weight"] == shapes["mtp.0.h_proj.weight"] == (d, d)
    assert shapes["mtp.0.hc_head_fn.weight"] == (n, n * d)
    assert shapes["mtp.0.ffn_down_exps.weight"] == (e, d, i)
    assert shapes["mtp.0.exp_probs_b.bias"] == (e,)
    convert(directory, tmp_path / "q8.gguf", "q8_0")
    with GGUFFile(tmp_path / "q8.gguf") as g:
        assert {name for name in g.tensors if name.startswith("mtp.")} == MTP_GGUF_NAMES
        assert {g.tensors[f"mtp.0.{name}"].type_name for name in ("e_proj.weight", "attn_q_a.weight",
                                                                  "ffn_gate_exps.weight")} == {"Q8_0"}
    (directory / "mtp.safetensors").rename(tmp_path / "mtp.safetensors")  # a checkpoint without MTP converts as before
    try:
        convert(directory, tmp_path / "trunk.gguf", "f32")
        with GGUFFile(tmp_path / "trunk.gguf") as g:
            assert set(g.tensors) == trunk
    finally:
        (tmp_path / "mtp.safetensors").rename(directory / "mtp.safetensors")


def test_gguf_missing_one_mtp_tensor_is_one_clear_error(trained, tmp_path):
    directory = trained[0]
    config = read_hf_config(directory)
    hp = hparams_from_config(config)
    plan = [t for t in plan_tensors(hp, BlockScaledSafetensorsSource(directory), "f32")
            if t.name != "mtp.0.attn_kv.weight"]
    path = tmp_path / "incomplete.gguf"
    rows = [metadata_row("general.name", "incomplete"), *gguf_metadata(hp),
            *tokenizer_metadata(directory, hp.vocab_size, "joyai-llm")]
    write_gguf_atomic(path, ARCHITECTURE, rows, plan)
    with pytest.raises(GGUFTensorError, match=r"MTP block .*mtp\.0\.attn_kv\.weight.* is missing"):
        Engine.load(path, backend="numpy")
