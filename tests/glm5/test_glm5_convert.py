"""The GLM 5.2 converter writes spec §10.2's ``glm-dsa`` schema from transformers' saved models, and refuses bad input.

Oracles: gguf-py's reader and dequantizers for the written file, the transformers model's own parameters for the
values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from ds4_model_glm5.convert import convert
from gguf import GGUFReader
from gguf.quants import dequantize

from ds4_core.errors import ConversionError

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

# (GGUF name inside blk.N., transformers name inside model.layers.N.)
COPIED = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_output.weight": "self_attn.o_proj.weight",
}
INDEXER = {
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight", "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight", "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
}


def _tensors(path: Path) -> dict[str, np.ndarray]:
    reader = GGUFReader(path)
    return {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in reader.tensors}


def _meta(path: Path, key: str):
    field = GGUFReader(path).fields[key]
    return field.contents()


def test_metadata_matches_the_config(tiny_hf, converted):
    _, model = tiny_hf("freq")
    c, path = model.config, converted("freq", "f32")
    expected = {
        "block_count": c.num_hidden_layers, "nextn_predict_layers": 0, "embedding_length": c.hidden_size,
        "attention.head_count": c.num_attention_heads, "attention.head_count_kv": 1,
        "attention.key_length": c.kv_lora_rank + c.qk_rope_head_dim, "attention.value_length": c.kv_lora_rank,
        "attention.key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim,
        "attention.value_length_mla": c.v_head_dim, "rope.dimension_count": c.qk_rope_head_dim,
        "expert_count": c.n_routed_experts, "expert_used_count": c.num_experts_per_tok,
        "expert_shared_count": c.n_shared_experts, "expert_group_count": c.n_group,
        "expert_group_used_count": c.topk_group, "expert_gating_func": 2, "leading_dense_block_count": 2,
        "attention.indexer.head_count": c.index_n_heads, "attention.indexer.key_length": c.index_head_dim,
        "attention.indexer.top_k": c.index_topk, "expert_weights_norm": True,
    }
    assert GGUFReader(path).fields["general.architecture"].contents() == "glm-dsa"
    for key, value in expected.items():
        assert _meta(path, f"glm-dsa.{key}") == value, key
    assert _meta(path, "glm-dsa.rope.freq_base") == pytest.approx(c.rope_parameters["rope_theta"])
    assert _meta(path, "glm-dsa.expert_weights_scale") == pytest.approx(c.routed_scaling_factor)
    assert _meta(path, "tokenizer.ggml.pre") == "glm4"


def test_tensors_carry_the_transformers_values(tiny_hf, converted):
    _, model = tiny_hf("freq")
    c = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    got = _tensors(converted("freq", "f32"))
    H, dn, dv = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    np.testing.assert_array_equal(got["token_embd.weight"], state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(got["output.weight"], state["lm_head.weight"])
    for layer in range(c.num_hidden_layers):
        blk, src = f"blk.{layer}.", f"model.layers.{layer}."
        for ours, theirs in COPIED.items():
            np.testing.assert_array_equal(got[blk + ours], state[src + theirs])
        full = c.indexer_types[layer] == "full"
        assert (blk + "indexer.attn_k.weight" in got) == full
        for ours, theirs in INDEXER.items() if full else ():
            np.testing.assert_array_equal(got[blk + ours], state[src + theirs])
        kv_b = state[src + "self_attn.kv_b_proj.weight"].reshape(H, dn + dv, -1)
        np.testing.assert_array_equal(got[blk + "attn_k_b.weight"], kv_b[:, :dn].transpose(0, 2, 1))
        np.testing.assert_array_equal(got[blk + "attn_v_b.weight"], kv_b[:, dn:])
        if layer < 2:
            np.testing.assert_array_equal(got[blk + "ffn_gate.weight"], state[src + "mlp.gate_proj.weight"])
            continue
        gate_up = state[src + "mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(got[blk + "ffn_gate_exps.weight"], gate_up[:, :c.moe_intermediate_size])
        np.testing.assert_array_equal(got[blk + "ffn_up_exps.weight"], gate_up[:, c.moe_intermediate_size:])
        np.testing.assert_array_equal(got[blk + "ffn_down_exps.weight"], state[src + "mlp.experts.down_proj"])
        np.testing.assert_array_equal(got[blk + "exp_probs_b.bias"], state[src + "mlp.gate.e_score_correction_bias"])
        np.testing.assert_array_equal(got[blk + "ffn_up_shexp.weight"],
                                      state[src + "mlp.shared_experts.up_proj.weight"])


def test_q8_0_file_runs_close_to_f32(converted):
    from ds4_core.engine import Engine

    reader = GGUFReader(converted("default", "q8_0"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.attn_q_b.weight"] == "Q8_0" and types["blk.1.attn_norm.weight"] == "F32"
    q8_tensors, f32_tensors = _tensors(converted("default", "q8_0")), _tensors(converted("default", "f32"))
    for name, reference in f32_tensors.items():  # Q8_0 keeps each 32-block within half a step of amax/127
        np.testing.assert_allclose(q8_tensors[name], reference, rtol=0, atol=np.abs(reference).max() / 200 + 1e-3)
    ids = np.random.default_rng(5).integers(0, 320, 24)
    f32 = np.asarray(Engine.load(converted("default", "f32"), backend="numpy").new_session().feed(ids))
    q8 = np.asarray(Engine.load(converted("default", "q8_0"), backend="numpy").new_session().feed(ids))
    # Rounding may flip a discrete top-k or expert choice at a few positions; typical positions stay close.
    per_position = np.abs(q8 - f32).max(axis=1) / np.abs(f32).max()
    assert np.median(per_position) < 2e-2


def test_mtp_block_weights_load(tiny_hf, tmp_path):
    """A checkpoint holding the MTP block (layer L = num_hidden_layers) converts to blk.L.nextn.* + a full block,
    which the loader exposes as ``model.mtp``."""
    from ds4_core.engine import Engine

    src_dir, model = tiny_hf("default")
    work = tmp_path / "with-mtp"
    shutil.copytree(src_dir, work)
    L, D = model.config.num_hidden_layers, model.config.hidden_size
    state = model.state_dict()
    rng = np.random.default_rng(7)
    extra = {k.replace(f"layers.{L - 1}.", f"layers.{L}."): v.clone() for k, v in state.items()
             if k.startswith(f"model.layers.{L - 1}.")}
    for name, shape in (("eh_proj.weight", (D, 2 * D)), ("enorm.weight", (D,)), ("hnorm.weight", (D,)),
                        ("shared_head.norm.weight", (D,)), ("shared_head.head.weight", (320, D))):
        extra[f"model.layers.{L}.{name}"] = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    safetensors_torch.save_file(extra, work / "mtp.safetensors")
    out = tmp_path / "mtp.gguf"
    convert(work, out, "f32")
    assert _meta(out, "glm-dsa.nextn_predict_layers") == 1 and _meta(out, "glm-dsa.block_count") == L + 1
    loaded = Engine.load(out, backend="numpy").model
    assert len(loaded.blocks) == L and [m.layer for m in loaded.mtp] == [L]
    np.testing.assert_array_equal(loaded.mtp[0].eh_proj.data, extra[f"model.layers.{L}.eh_proj.weight"].numpy())
    np.testing.assert_array_equal(loaded.mtp[0].block.attn.indexer.attn_k.data,
                                  state[f"model.layers.{L - 1}.self_attn.indexer.wk.weight"].numpy())


def _broken_copy(tiny_hf, tmp_path: Path, edit) -> Path:
    src_dir, _ = tiny_hf("default")
    work = tmp_path / "broken"
    shutil.copytree(src_dir, work)
    edit(work)
    return work


def test_refuses_unknown_and_missing_tensors_and_other_rope(tiny_hf, tmp_path):
    def drop_tensor(work: Path) -> None:
        tensors = safetensors_torch.load_file(work / "model.safetensors")
        del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
        safetensors_torch.save_file(tensors, work / "model.safetensors")

    def add_tensor(work: Path) -> None:
        safetensors_torch.save_file({"model.layers.0.mystery.weight": torch.zeros(4)}, work / "extra.safetensors")

    def yarn(work: Path) -> None:
        config = json.loads((work / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
        (work / "config.json").write_text(json.dumps(config))

    for edit, message in ((drop_tensor, "kv_b_proj"), (add_tensor, "mystery"), (yarn, "rope type")):
        work = _broken_copy(tiny_hf, tmp_path / edit.__name__, edit)
        out = tmp_path / f"{edit.__name__}.gguf"
        with pytest.raises(ConversionError, match=message):
            convert(work, out, "f32")
        assert not out.exists()
    with pytest.raises(ConversionError, match="output type"):
        convert(tiny_hf("default")[0], tmp_path / "x.gguf", "q4_k")


def test_ds4_convert_dispatches_both_glm_families(tiny_hf):
    from ds4_core.convert import hf_architectures
    from ds4_core.plugins import get_plugin_manager

    registry = get_plugin_manager().registry
    names = hf_architectures(tiny_hf("default")[0])
    assert registry.model_for_hf_architecture(names[0]).converter == "ds4_model_glm5.convert:convert"
    next_spec = registry.model_for_hf_architecture("Glm5NextForConditionalGeneration")
    assert next_spec.converter == "ds4_model_glm5.next_convert:convert" and next_spec.architectures == ("glm5-next",)
