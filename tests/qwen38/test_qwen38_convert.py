"""The converter's value changes, checked tensor by tensor against the transformers checkpoint."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ds4_core.errors import ConversionError
from ds4_core.gguf import GGUFFile

torch = pytest.importorskip("torch")


def _hf(model, name: str) -> np.ndarray:
    return model.state_dict()[name].detach().numpy()


def _tiled(x: np.ndarray, nk: int, nv: int, per: int) -> np.ndarray:
    """Value head kh·(nv/nk) + r of ``x`` (``per`` rows each) moved to position r·nk + kh, written out by hand."""
    out = np.empty_like(x)
    for kh in range(nk):
        for r in range(nv // nk):
            old, new = kh * (nv // nk) + r, r * nk + kh
            out[new * per:(new + 1) * per] = x[old * per:(old + 1) * per]
    return out


def test_value_changes(tiny_hf, converted):
    _, model = tiny_hf("a")
    cfg = model.config
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    keys = 2 * nk * cfg.linear_key_head_dim
    with GGUFFile(converted("a", "f32")) as gguf:
        def get(name):
            return np.asarray(gguf.tensor_array(name))

        gdn = "model.layers.0.linear_attn"
        np.testing.assert_allclose(get("blk.0.ssm_a"), _tiled(-np.exp(_hf(model, f"{gdn}.A_log")), nk, nv, 1),
                                   rtol=1e-6)
        np.testing.assert_array_equal(get("blk.0.ssm_dt.bias"), _tiled(_hf(model, f"{gdn}.dt_bias"), nk, nv, 1))
        np.testing.assert_array_equal(get("blk.0.attn_gate.weight"), _tiled(_hf(model, f"{gdn}.in_proj_z.weight"),
                                                                            nk, nv, dv))
        qkv = _hf(model, f"{gdn}.in_proj_qkv.weight")
        np.testing.assert_array_equal(get("blk.0.attn_qkv.weight")[:keys], qkv[:keys])
        np.testing.assert_array_equal(get("blk.0.attn_qkv.weight")[keys:], _tiled(qkv[keys:], nk, nv, dv))
        np.testing.assert_array_equal(get("blk.0.ssm_out.weight").T, _tiled(_hf(model, f"{gdn}.out_proj.weight").T,
                                                                            nk, nv, dv))
        conv = _hf(model, f"{gdn}.conv1d.weight")[:, 0, :]
        np.testing.assert_array_equal(get("blk.0.ssm_conv1d.weight")[keys:], _tiled(conv[keys:], nk, nv, dv))
        np.testing.assert_array_equal(get("blk.0.ssm_norm.weight"), _hf(model, f"{gdn}.norm.weight"))  # not shifted
        np.testing.assert_allclose(get("blk.0.hc_attn_norm.weight"),
                                   1 + _hf(model, "model.layers.0.attn_hyper_connection.hc_norm.weight"))
        np.testing.assert_allclose(get("blk.3.indexer.k_norm.weight"),
                                   1 + _hf(model, "model.layers.3.self_attn.indexer.k_layernorm.weight"))
        qk = _hf(model, "model.layers.3.self_attn.indexer.index_qk_proj.weight")
        np.testing.assert_array_equal(np.concatenate([get("blk.3.indexer.q_proj.weight"),
                                                      get("blk.3.indexer.k_proj.weight")]), qk)
        assert list(gguf.tensors)[-1] == "per_layer_token_embd.weight"  # a cut-off file loses table rows only
        meta = gguf.metadata
        assert meta["qwen4exp.ple.layers"] == [0, 2]
        multipliers = [int(v) for layer in (0, 2)
                       for v in _hf(model, f"model.layers.{layer}.ple.ple_embedding.layer_multipliers")]
        assert meta["qwen4exp.ple.layer_multipliers"] == multipliers


def test_unknown_tensor_is_refused(tiny_hf, tmp_path):
    from ds4_model_qwen38.convert import convert
    from safetensors.numpy import save_file

    src, _ = tiny_hf("a")
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    save_file({"model.layers.0.mystery.weight": np.zeros((2, 2), np.float32)}, str(copy / "extra.safetensors"))
    with pytest.raises(ConversionError, match="mystery"):
        convert(copy, tmp_path / "out.gguf", "f32")
    assert not (tmp_path / "out.gguf").exists()


def test_config_without_eos_is_refused_when_ple_is_on(tiny_hf, tmp_path):
    from ds4_model_qwen38.convert import hparams_from_config

    config = json.loads((tiny_hf("a")[0] / "config.json").read_text())
    config["eos_token_id"] = None
    with pytest.raises(ConversionError, match="eos_token_id"):
        hparams_from_config(config)


def test_q8_0_conversion_loads_and_stays_close(converted):
    from ds4_core.engine import Engine

    ids = np.arange(1, 25)
    logits = []
    for outtype in ("f32", "q8_0"):
        engine = Engine.load(converted("a", outtype), backend="numpy")
        logits.append(engine.new_session().feed(ids))
        engine.close()
    assert np.abs(logits[1] - logits[0]).max() < 0.05 * np.abs(logits[0]).max()
