"""GLM 5.3 Flash converter: tensor layout against the checkpoint, both transformers layouts, the MTP block, q8_0,
and clear errors."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from ds4_model_glm5.next_convert import convert

from ds4_core.engine import Engine
from ds4_core.errors import ConversionError
from ds4_core.gguf import GGUFFile
from ds4_core.quants import dequantize

safetensors_numpy = pytest.importorskip("safetensors.numpy")
PREFIX = "model.language_model."


def gguf_arrays(path) -> dict[str, np.ndarray]:
    with GGUFFile.open(path) as g:
        return {name: dequantize(g.tensor_bytes(name), info.qtype, tuple(info.shape))
                for name, info in g.tensors.items()}


def checkpoint(directory) -> dict[str, np.ndarray]:
    return safetensors_numpy.load_file(directory / "model.safetensors")


def test_tensors_follow_the_ds4_layout(tiny_next_hf, next_converted):
    directory, model = tiny_next_hf("mixed")
    text = model.config.text_config
    ck, out = checkpoint(directory), gguf_arrays(next_converted("mixed", "f32"))
    H, dk, dv = text.num_attention_heads, text.qk_nope_head_dim, text.v_head_dim
    kv_b = ck[f"{PREFIX}layers.3.self_attn.kv_b_proj.weight"].reshape(H, dk + dv, -1)
    np.testing.assert_array_equal(out["blk.3.attn_k_b.weight"], kv_b[:, :dk].transpose(0, 2, 1))
    np.testing.assert_array_equal(out["blk.3.attn_v_b.weight"], kv_b[:, dk:])
    np.testing.assert_array_equal(out["blk.3.indexer.pool_ape.weight"],
                                  ck[f"{PREFIX}layers.3.self_attn.indexer.index_kpool_compress_ape"])
    np.testing.assert_array_equal(out["blk.0.kda_k_conv.weight"], ck[f"{PREFIX}layers.0.self_attn.k_conv1d.weight"])
    np.testing.assert_array_equal(out["blk.0.kda_a_log.weight"], ck[f"{PREFIX}layers.0.self_attn.A_log"])
    np.testing.assert_array_equal(out["blk.4.ffn_up_exps.weight"][5],
                                  ck[f"{PREFIX}layers.4.mlp.experts.5.up_proj.weight"])
    np.testing.assert_array_equal(out["blk.4.hc_ffn_fn.weight"], ck[f"{PREFIX}layers.4.hc_ffn_fn"])
    assert not any("visual" in name or "vision" in name for name in out)  # the vision tower is skipped
    with GGUFFile.open(next_converted("mixed", "f32")) as g:
        assert g.architecture == "glm5-next"
        assert list(g.metadata["glm5-next.layer_types"]) == [0, 0, 0, 1, 0, 1]


def test_runtime_module_layout_converts_identically(tiny_next_hf, next_converted, tmp_path):
    """transformers' in-memory names (merged conv1d, forget_gate.*, attn_hc.*, stacked experts) give the same file."""
    directory, model = tiny_next_hf("mixed")
    src = tmp_path / "runtime"
    shutil.copytree(directory, src, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}
    assert {f"{PREFIX}layers.0.self_attn.conv1d.weight", f"{PREFIX}layers.4.mlp.experts.gate_up_proj"} <= set(state)
    safetensors_numpy.save_file(state, src / "model.safetensors")
    convert(src, tmp_path / "runtime.gguf", "f32")
    got, want = gguf_arrays(tmp_path / "runtime.gguf"), gguf_arrays(next_converted("mixed", "f32"))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_mtp_block_is_converted_and_loaded_but_not_run(tiny_next_hf, next_converted, tmp_path):
    directory, model = tiny_next_hf("mixed")
    ck = checkpoint(directory)
    L, D = model.config.text_config.num_hidden_layers, model.config.text_config.hidden_size
    rng = np.random.default_rng(4)
    last = f"{PREFIX}layers.{L - 1}."  # a DSA + MoE layer: the MTP block has the same modules, without HC
    for name, value in list(ck.items()):
        if name.startswith(last) and "hc_" not in name:
            ck[f"{PREFIX}layers.{L}." + name[len(last):]] = value + 0.01
    mtp = f"{PREFIX}layers.{L}."
    ck |= {mtp + "eh_proj.weight": rng.standard_normal((D, 2 * D)).astype(np.float32),
           mtp + "enorm.weight": np.ones(D, np.float32), mtp + "hnorm.weight": np.ones(D, np.float32),
           mtp + "shared_head.norm.weight": np.full(D, 0.5, np.float32)}
    src = tmp_path / "with-mtp"
    shutil.copytree(directory, src, ignore=shutil.ignore_patterns("*.safetensors"))
    safetensors_numpy.save_file(ck, src / "model.safetensors")
    convert(src, tmp_path / "mtp.gguf", "f32")

    engine = Engine.load(tmp_path / "mtp.gguf", backend="numpy", ctx=32)
    cfg, block = engine.model.cfg, engine.model.mtp[0]
    assert (cfg.num_layers, cfg.n_nextn, cfg.block_count, cfg.layer_types[-1]) == (L, 1, L + 1, 1)
    np.testing.assert_array_equal(block.nextn_eh_proj.data, ck[mtp + "eh_proj.weight"])
    np.testing.assert_array_equal(block.nextn_shared_head_norm.data, ck[mtp + "shared_head.norm.weight"])
    assert block.attn.indexer is not None and block.ffn.ffn_gate_exps.shape[0] == cfg.n_experts
    ids = [5, 17, 99, 3, 250, 8]
    without = Engine.load(next_converted("mixed", "f32"), backend="numpy", ctx=32).new_session().feed(ids)
    np.testing.assert_array_equal(engine.new_session().feed(ids), without)


def test_q8_0_recipe_types_and_values(next_converted):
    """q8_0: Q8_0 matrices within half a quantization step (plus the rounding of the block's F16 scale), F16 small
    matrices, F32 norms, biases, convs and router."""
    f32, q8 = next_converted("mixed", "f32"), next_converted("mixed", "q8_0")
    assert q8.stat().st_size < 0.5 * f32.stat().st_size
    want = gguf_arrays(f32)
    with GGUFFile.open(q8) as g:
        types = {name: info.type_name for name, info in g.tensors.items()}
    got = gguf_arrays(q8)
    assert {types[n] for n in ("blk.0.kda_q.weight", "blk.4.ffn_gate_exps.weight", "blk.3.attn_k_b.weight")} == {"Q8_0"}
    # F16: rows too short for Q8_0 blocks (experts' down, 24 wide), the embedding and the indexer's pool gate
    assert {types[n] for n in ("blk.4.ffn_down_exps.weight", "token_embd.weight", "blk.3.indexer.pool_gate.weight")} \
        == {"F16"}
    assert all(types[n] == "F32" for n in ("blk.0.kda_q_conv.weight", "blk.0.kda_a_log.weight",
                                           "blk.4.ffn_gate_inp.weight", "blk.4.exp_probs_b.bias"))
    for name, ref in want.items():
        if types[name] == "Q8_0":
            blocks = ref.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(got[name].reshape(-1, 32) - blocks) <= 0.6 * step + 1e-7), name
        else:
            half = types[name] == "F16"
            np.testing.assert_allclose(got[name], ref, rtol=1e-3 if half else 0, atol=1e-6 if half else 0, err_msg=name)


def test_incomplete_or_foreign_checkpoints_are_refused(tiny_next_hf, tmp_path):
    directory, _ = tiny_next_hf("mixed")
    ck = checkpoint(directory)
    src = tmp_path / "broken"
    shutil.copytree(directory, src, ignore=shutil.ignore_patterns("*.safetensors"))
    missing = {k: v for k, v in ck.items() if not k.endswith("layers.2.self_attn.b_proj.weight")}
    safetensors_numpy.save_file(missing, src / "model.safetensors")
    with pytest.raises(ConversionError, match="b_proj"):
        convert(src, tmp_path / "x.gguf", "f32")
    safetensors_numpy.save_file({**ck, f"{PREFIX}layers.1.self_attn.mystery.weight": np.zeros(3, np.float32)},
                                src / "model.safetensors")
    with pytest.raises(ConversionError, match="mystery"):
        convert(src, tmp_path / "x.gguf", "f32")
    with pytest.raises(ConversionError, match="output type"):
        convert(directory, tmp_path / "x.gguf", "q4_0")
    assert not (tmp_path / "x.gguf").exists()
