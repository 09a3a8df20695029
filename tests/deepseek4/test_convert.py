"""The DeepSeek V4 converter writes spec §12's schema, from both Hugging Face layouts, and refuses bad input.

Oracles: gguf-py's reader and dequantizers for the written file, transformers' saved models and state dicts
for the source values, torch's float8 types for FP8 decoding, HF tokenizers for the vocabulary.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ds4_model_deepseek4.convert import convert
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from ds4_core.errors import ConversionError

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

U32, F32, U64, BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.UINT64, GGUFValueType.BOOL

# §12.2 keys (the deepseek4 prefix omitted) -> (GGUF value type, HF config.json field or a derived value).
SCALAR_KEYS = {
    "block_count": U32, "embedding_length": U32, "vocab_size": U32, "attention.head_count": U32,
    "attention.head_count_kv": U32, "attention.key_length": U32, "attention.value_length": U32,
    "rope.dimension_count": U32, "attention.q_lora_rank": U32, "attention.output_lora_rank": U32,
    "attention.output_group_count": U32, "expert_count": U32, "expert_used_count": U32,
    "expert_feed_forward_length": U32, "expert_shared_count": U32, "hash_layer_count": U32,
    "attention.sliding_window": U32, "attention.indexer.head_count": U32, "attention.indexer.key_length": U32,
    "attention.indexer.top_k": U32, "hyper_connection.count": U32, "hyper_connection.sinkhorn_iterations": U32,
    "hyper_connection.epsilon": F32, "rope.freq_base": F32, "attention.compress_rope_freq_base": F32,
    "rope.scaling.factor": F32, "rope.scaling.original_context_length": U32, "rope.scaling.yarn_beta_fast": F32,
    "rope.scaling.yarn_beta_slow": F32, "expert_weights_scale": F32, "expert_weights_norm": BOOL,
    "attention.layer_norm_rms_epsilon": F32,
}

# §12.3: GGUF name (inside blk.N.) -> (transformers name inside model.layers.N., type class under q8_0).
# "Q8" is Q8_0 when the row length (ne0) is a multiple of 32, else F16.
LAYER_TENSORS = {
    "hc_attn_fn.weight": ("attn_hc.fn", "F16"), "hc_attn_scale.weight": ("attn_hc.scale", "F32"),
    "hc_attn_base.weight": ("attn_hc.base", "F32"), "hc_ffn_fn.weight": ("ffn_hc.fn", "F16"),
    "hc_ffn_scale.weight": ("ffn_hc.scale", "F32"), "hc_ffn_base.weight": ("ffn_hc.base", "F32"),
    "attn_norm.weight": ("input_layernorm.weight", "F32"),
    "ffn_norm.weight": ("post_attention_layernorm.weight", "F32"),
    "attn_q_a.weight": ("self_attn.q_a_proj.weight", "Q8"),
    "attn_q_a_norm.weight": ("self_attn.q_a_norm.weight", "F32"),
    "attn_q_b.weight": ("self_attn.q_b_proj.weight", "Q8"), "attn_kv.weight": ("self_attn.kv_proj.weight", "Q8"),
    "attn_kv_a_norm.weight": ("self_attn.kv_norm.weight", "F32"), "attn_sinks.weight": ("self_attn.sinks", "F32"),
    "attn_output_a.weight": ("self_attn.o_a_proj.weight", "Q8"),
    "attn_output_b.weight": ("self_attn.o_b_proj.weight", "Q8"), "ffn_gate_inp.weight": ("mlp.gate.weight", "F16"),
    "ffn_gate_shexp.weight": ("mlp.shared_experts.gate_proj.weight", "Q8"),
    "ffn_up_shexp.weight": ("mlp.shared_experts.up_proj.weight", "Q8"),
    "ffn_down_shexp.weight": ("mlp.shared_experts.down_proj.weight", "Q8"),
    "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", "Q8"),
    "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", "Q8"),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", "Q8"),
}
COMPRESSOR_TENSORS = {
    "attn_compressor_ape.weight": ("self_attn.compressor.position_bias", "F16"),
    "attn_compressor_kv.weight": ("self_attn.compressor.kv_proj.weight", "F16"),
    "attn_compressor_gate.weight": ("self_attn.compressor.gate_proj.weight", "F16"),
    "attn_compressor_norm.weight": ("self_attn.compressor.kv_norm.weight", "F32"),
}
INDEXER_TENSORS = {
    "indexer.attn_q_b.weight": ("self_attn.compressor.indexer.q_b_proj.weight", "F16"),
    "indexer.proj.weight": ("self_attn.compressor.indexer.scorer.weights_proj.weight", "F16"),
    "indexer_compressor_ape.weight": ("self_attn.compressor.indexer.position_bias", "F16"),
    "indexer_compressor_kv.weight": ("self_attn.compressor.indexer.kv_proj.weight", "F16"),
    "indexer_compressor_gate.weight": ("self_attn.compressor.indexer.gate_proj.weight", "F16"),
    "indexer_compressor_norm.weight": ("self_attn.compressor.indexer.kv_norm.weight", "F32"),
}
GLOBAL_TENSORS = {
    "token_embd.weight": ("model.embed_tokens.weight", "F16"), "output.weight": ("lm_head.weight", "Q8"),
    "output_norm.weight": ("model.norm.weight", "F32"), "output_hc_fn.weight": ("model.hc_head.hc_fn", "F16"),
    "output_hc_base.weight": ("model.hc_head.hc_base", "F32"),
    "output_hc_scale.weight": ("model.hc_head.hc_scale", "F32"),
}


def expected_tensors(config) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """GGUF name -> (transformers name, q8_0 type class, GGUF dims) for a transformers config, from §12.3."""
    D, V, n, H, hd = config.hidden_size, config.vocab_size, config.hc_mult, config.num_attention_heads, config.head_dim
    q, G, ol, E, F, k = (config.q_lora_rank, config.o_groups, config.o_lora_rank, config.n_routed_experts,
                         config.moe_intermediate_size, config.num_experts_per_tok)
    nih, ih = config.index_n_heads, config.index_head_dim
    dims = {
        "token_embd.weight": (D, V), "output.weight": (D, V), "output_norm.weight": (D,),
        "output_hc_fn.weight": (n * D, n), "output_hc_base.weight": (n,), "output_hc_scale.weight": (1,),
        "hc_attn_fn.weight": (n * D, (2 + n) * n), "hc_attn_scale.weight": (3,), "hc_attn_base.weight": ((2 + n) * n,),
        "attn_norm.weight": (D,), "ffn_norm.weight": (D,), "attn_q_a.weight": (D, q), "attn_q_a_norm.weight": (q,),
        "attn_q_b.weight": (q, H * hd), "attn_kv.weight": (D, hd), "attn_kv_a_norm.weight": (hd,),
        "attn_sinks.weight": (H,), "attn_output_a.weight": (H * hd // G, G * ol), "attn_output_b.weight": (G * ol, D),
        "ffn_gate_inp.weight": (D, E), "exp_probs_b.bias": (E,), "ffn_gate_tid2eid.weight": (k, V),
        "ffn_gate_exps.weight": (D, F, E), "ffn_up_exps.weight": (D, F, E), "ffn_down_exps.weight": (F, D, E),
        "ffn_gate_shexp.weight": (D, F), "ffn_up_shexp.weight": (D, F), "ffn_down_shexp.weight": (F, D),
        "indexer.attn_q_b.weight": (q, nih * ih), "indexer.proj.weight": (D, nih),
        "indexer_compressor_ape.weight": (2 * ih, 4), "indexer_compressor_kv.weight": (D, 2 * ih),
        "indexer_compressor_gate.weight": (D, 2 * ih), "indexer_compressor_norm.weight": (ih,),
    }
    dims |= {k.replace("attn", "ffn", 1): v for k, v in dims.items() if k.startswith("hc_attn")}
    out = {name: (hf, kind, dims[name]) for name, (hf, kind) in GLOBAL_TENSORS.items()}
    for layer, layer_type in enumerate(config.layer_types):
        table = dict(LAYER_TENSORS)
        if layer_type != "sliding_attention":
            m = config.compress_rates[layer_type]
            coff = 2 if layer_type == "compressed_sparse_attention" else 1
            table |= COMPRESSOR_TENSORS
            dims |= {"attn_compressor_ape.weight": (coff * hd, m), "attn_compressor_kv.weight": (D, coff * hd),
                     "attn_compressor_gate.weight": (D, coff * hd), "attn_compressor_norm.weight": (hd,)}
        if layer_type == "compressed_sparse_attention":
            table |= INDEXER_TENSORS
        if config.mlp_layer_types[layer] == "hash_moe":
            table["ffn_gate_tid2eid.weight"] = ("mlp.gate.tid2eid", "I32")
        else:
            table["exp_probs_b.bias"] = ("mlp.gate.e_score_correction_bias", "F32")
        for name, (hf, kind) in table.items():
            out[f"blk.{layer}.{name}"] = (f"model.layers.{layer}.{hf}", kind, dims[name])
    return out


def hf_value(state: dict, gguf_name: str, hf_name: str, config) -> np.ndarray:
    """The transformers tensor a GGUF tensor holds, in numpy order (experts split out of gate_up_proj)."""
    value = state[hf_name].float().numpy() if state[hf_name].is_floating_point() else state[hf_name].numpy()
    i = config.moe_intermediate_size
    if gguf_name.endswith("ffn_gate_exps.weight"):
        return value[:, :i]
    if gguf_name.endswith("ffn_up_exps.weight"):
        return value[:, i:]
    return value


# ---------------------------------------------------------------- metadata


def test_metadata_has_every_spec_key_with_its_type_and_value(tiny_hf, converted):
    _, model = tiny_hf("mixed")
    c = model.config
    fields = GGUFReader(converted("mixed", "q8_0")).fields
    assert fields["general.architecture"].contents() == "deepseek4"
    assert fields["general.name"].contents()
    for key, vtype in SCALAR_KEYS.items():
        field = fields[f"deepseek4.{key}"]
        assert field.types == [vtype], key
    assert fields["deepseek4.context_length"].contents() == c.max_position_embeddings
    expected = {
        "block_count": c.num_hidden_layers, "embedding_length": c.hidden_size, "vocab_size": c.vocab_size,
        "attention.head_count": c.num_attention_heads, "attention.head_count_kv": 1,
        "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
        "rope.dimension_count": c.qk_rope_head_dim, "attention.q_lora_rank": c.q_lora_rank,
        "attention.output_lora_rank": c.o_lora_rank, "attention.output_group_count": c.o_groups,
        "expert_count": c.n_routed_experts, "expert_used_count": c.num_experts_per_tok,
        "expert_feed_forward_length": c.moe_intermediate_size, "expert_shared_count": 1,
        "hash_layer_count": c.mlp_layer_types.count("hash_moe"), "attention.sliding_window": c.sliding_window,
        "attention.indexer.head_count": c.index_n_heads, "attention.indexer.key_length": c.index_head_dim,
        "attention.indexer.top_k": c.index_topk, "hyper_connection.count": c.hc_mult,
        "hyper_connection.sinkhorn_iterations": c.hc_sinkhorn_iters, "rope.freq_base": 10000.0,
        "attention.compress_rope_freq_base": 160000.0, "rope.scaling.factor": 16.0,
        "rope.scaling.original_context_length": 32, "rope.scaling.yarn_beta_fast": 32.0,
        "rope.scaling.yarn_beta_slow": 1.0, "expert_weights_scale": c.routed_scaling_factor,
        "expert_weights_norm": True,
    }
    for key, value in expected.items():
        assert fields[f"deepseek4.{key}"].contents() == pytest.approx(value), key
    assert fields["deepseek4.hyper_connection.epsilon"].contents() == pytest.approx(1e-6)
    assert fields["deepseek4.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(1e-6)
    assert fields["deepseek4.attention.compress_ratios"].contents() == [0, 0, 4, 8, 4]
    assert fields["deepseek4.attention.compress_ratios"].types == [GGUFValueType.ARRAY, U32]
    assert fields["deepseek4.swiglu_clamp_exp"].contents() == pytest.approx([0.5] * 5)


def test_tokenizer_metadata_is_the_hf_vocabulary(tiny_hf, converted):
    from tokenizers import Tokenizer

    directory, model = tiny_hf("mixed")
    fields = GGUFReader(converted("mixed", "f32")).fields
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == model.config.vocab_size
    assert tokens == [hf.id_to_token(i) for i in range(hf.get_vocab_size())]
    assert fields["tokenizer.ggml.pre"].contents() == "joyai-llm"
    assert len(fields["tokenizer.ggml.merges"].contents()) > 0
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 0
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 1
    assert tokens[3] == "<｜User｜>" and tokens[7] == "｜DSML｜"


def test_chat_template_is_copied_from_tokenizer_config(tiny_hf, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(tiny_hf("mixed")[0], source)
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (source / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    convert(source, tmp_path / "out.gguf", "f16")
    fields = GGUFReader(tmp_path / "out.gguf").fields
    assert fields["tokenizer.chat_template"].contents() == config["chat_template"]


# ---------------------------------------------------------------- tensors


@pytest.mark.parametrize("name", ["mixed", "hca_first"])
def test_q8_0_tensor_names_types_and_dims_follow_the_spec(name, tiny_hf, converted):
    _, model = tiny_hf(name)
    expected = expected_tensors(model.config)
    tensors = {t.name: t for t in GGUFReader(converted(name, "q8_0")).tensors}
    assert set(tensors) == set(expected)
    for gguf_name, (_, kind, dims) in expected.items():
        tensor = tensors[gguf_name]
        assert tuple(int(d) for d in tensor.shape) == dims, gguf_name
        want = ("Q8_0" if dims[0] % 32 == 0 else "F16") if kind == "Q8" else kind
        assert tensor.tensor_type.name == want, gguf_name
    assert tensors["output.weight"].tensor_type.name == "Q8_0"  # D = 64: the recipe type, not a fallback


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_float_outtypes_store_big_matrices_in_that_type_and_small_ones_in_f32(outtype, tiny_hf, converted):
    _, model = tiny_hf("mixed")
    expected = expected_tensors(model.config)
    for tensor in GGUFReader(converted("mixed", outtype)).tensors:
        kind = expected[tensor.name][1]
        assert tensor.tensor_type.name == (kind if kind in ("F32", "I32") else outtype.upper()), tensor.name


@pytest.mark.parametrize("name", ["mixed", "all_hash"])
def test_f32_tensors_equal_the_transformers_weights(name, tiny_hf, converted):
    _, model = tiny_hf(name)
    state = model.state_dict()
    expected = expected_tensors(model.config)
    for tensor in GGUFReader(converted(name, "f32")).tensors:
        hf_name = expected[tensor.name][0]
        want = hf_value(state, tensor.name, hf_name, model.config)
        got = np.asarray(tensor.data)
        assert got.shape == want.shape, tensor.name
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=tensor.name)


def test_q8_0_tensors_dequantize_close_to_the_transformers_weights(tiny_hf, converted):
    _, model = tiny_hf("mixed")
    state = model.state_dict()
    expected = expected_tensors(model.config)
    for tensor in GGUFReader(converted("mixed", "q8_0")).tensors:
        want = hf_value(state, tensor.name, expected[tensor.name][0], model.config)
        if tensor.tensor_type.name == "I32":
            np.testing.assert_array_equal(tensor.data, want, err_msg=tensor.name)
            continue
        got = dequantize(tensor.data, tensor.tensor_type).reshape(want.shape)
        if tensor.tensor_type.name == "Q8_0":
            assert np.abs(got - want).max() <= np.abs(want).max() / 127, tensor.name  # one step: d = amax/127 in f16
        else:
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6, err_msg=tensor.name)


def test_progress_reports_growing_bytes_up_to_the_total(tiny_hf, tmp_path):
    calls = []
    convert(tiny_hf("mixed")[0], tmp_path / "out.gguf", "q8_0", progress=lambda *args: calls.append(args))
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and len(set(t for _, t in calls)) == 1
    assert dones[-1] == calls[-1][1] > 0


# ---------------------------------------------------------------- the other layouts


def _save_state(directory: Path, state: dict, config: dict, tokenizer_from: Path) -> Path:
    directory.mkdir()
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, directory / name)
    return directory


def test_transformers_module_names_with_stacked_experts_convert_identically(tiny_hf, converted, tmp_path):
    directory, model = tiny_hf("mixed")
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    source = _save_state(tmp_path / "stacked", model.state_dict(), config, directory)
    convert(source, tmp_path / "stacked.gguf", "f32")
    ours = {t.name: np.asarray(t.data) for t in GGUFReader(tmp_path / "stacked.gguf").tensors}
    reference = {t.name: np.asarray(t.data) for t in GGUFReader(converted("mixed", "f32")).tensors}
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


# transformers module name (inside model.layers.N.) -> official DeepSeek name (spec §11), written from the table.
OFFICIAL_LAYER_NAMES = {
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight", "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight", "self_attn.sinks": "attn.attn_sink",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight", "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid", "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
}
OFFICIAL_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                         "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
                         "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
FP8_WEIGHTS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
               "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
               "ffn.shared_experts.w3.weight")
FP4_VALUES = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 weight, E8M0 128x128 block scales, dequantized float32) of a 2-D weight."""
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(br * 128, bc * 128)
    padded[:rows, :cols] = w
    amax = padded.reshape(br, 128, bc, 128).abs().amax(dim=(1, 3)).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    q = (w / expanded).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu), q.float() * scale.to(torch.float8_e8m0fnu).float().repeat_interleave(
        128, 0).repeat_interleave(128, 1)[:rows, :cols]


def fp4_pack(shape: tuple[int, int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed I8 [out, in/2], E8M0 scales [out, in/32], dequantized float32) of random FP4 codes."""
    codes = torch.randint(0, 16, shape, generator=generator)
    exponents = torch.randint(-6, 2, (shape[0], shape[1] // 32), generator=generator).float()
    scales = torch.exp2(exponents)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scales.to(torch.float8_e8m0fnu), FP4_VALUES[codes] * scales.repeat_interleave(32, 1)


def official_checkpoint(model) -> tuple[dict, dict]:
    """(official-layout state dict with FP8/FP4/BF16 weights, the transformers state dict it dequantizes to)."""
    generator = torch.Generator().manual_seed(7)
    official, dequantized = {}, {}
    for name, value in model.state_dict().items():
        if name in OFFICIAL_GLOBAL_NAMES:
            official[OFFICIAL_GLOBAL_NAMES[name]] = value.to(torch.bfloat16) if name.endswith("norm.weight") else value
            dequantized[name] = official[OFFICIAL_GLOBAL_NAMES[name]].float()
            continue
        layer, local = name.removeprefix("model.layers.").split(".", 1)
        prefix = f"layers.{layer}."
        if local == "mlp.experts.gate_up_proj":
            halves = []
            for w in ("w1", "w3"):
                parts = [fp4_pack((value.shape[1] // 2, value.shape[2]), generator) for _ in range(value.shape[0])]
                for e, (packed, scale, _) in enumerate(parts):
                    official[f"{prefix}ffn.experts.{e}.{w}.weight"] = packed
                    official[f"{prefix}ffn.experts.{e}.{w}.scale"] = scale
                halves.append(torch.stack([deq for _, _, deq in parts]))
            dequantized[name] = torch.cat(halves, dim=1)
        elif local == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                official[f"{prefix}ffn.experts.{e}.w2.weight"] = value[e].to(torch.bfloat16)
            dequantized[name] = value.to(torch.bfloat16).float()
        elif OFFICIAL_LAYER_NAMES[local] in FP8_WEIGHTS:
            q, scale, deq = fp8_block_quantize(value)
            official[prefix + OFFICIAL_LAYER_NAMES[local]] = q
            official[prefix + OFFICIAL_LAYER_NAMES[local].replace(".weight", ".scale")] = scale
            dequantized[name] = deq
        else:
            official[prefix + OFFICIAL_LAYER_NAMES[local]] = value
            dequantized[name] = value
    return official, dequantized


def legacy_config(config: dict) -> dict:
    """The official config.json flavour: compress_ratios (+ MTP entry), num_hash_layers, qk_rope_head_dim,
    rope_scaling instead of layer_types, mlp_layer_types, partial_rotary_factor, rope_parameters."""
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    legacy = {k: v for k, v in config.items() if k not in (
        "layer_types", "mlp_layer_types", "partial_rotary_factor", "rope_parameters", "compress_rates")}
    legacy |= {"compress_ratios": [ratio[t] for t in config["layer_types"]] + [0],
               "num_hash_layers": config["mlp_layer_types"].count("hash_moe"),
               "qk_rope_head_dim": config["qk_rope_head_dim"], "compress_rate_hca": 8,
               "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32,
                                "beta_fast": 32, "beta_slow": 1}}
    return legacy


def test_official_layout_with_fp8_and_fp4_weights_converts_to_its_dequantized_values(tiny_hf, tmp_path):
    directory, model = tiny_hf("mixed")
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    official, dequantized = official_checkpoint(model)
    assert any(v.dtype == torch.float8_e4m3fn for v in official.values())
    official_dir = _save_state(tmp_path / "official", official, legacy_config(config), directory)
    reference_dir = _save_state(tmp_path / "reference", dequantized, config, directory)
    convert(official_dir, tmp_path / "official.gguf", "f32")
    convert(reference_dir, tmp_path / "reference.gguf", "f32")
    got = GGUFReader(tmp_path / "official.gguf")
    want = GGUFReader(tmp_path / "reference.gguf")
    want_tensors = {t.name: np.asarray(t.data) for t in want.tensors}
    assert [t.name for t in got.tensors] == list(want_tensors)
    for tensor in got.tensors:
        np.testing.assert_array_equal(np.asarray(tensor.data), want_tensors[tensor.name], err_msg=tensor.name)
    for key, field in want.fields.items():
        if key.startswith("deepseek4."):
            assert got.fields[key].contents() == field.contents(), key


# ---------------------------------------------------------------- refusals


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_unknown_tensor_is_refused(tiny_hf, tmp_path):
    source = _copy(tiny_hf("mixed")[0], tmp_path / "src")
    safetensors_torch.save_file({"model.layers.0.self_attn.mystery.weight": torch.zeros(2, 2)},
                                source / "extra.safetensors")
    with pytest.raises(ConversionError, match="mystery"):
        convert(source, tmp_path / "out.gguf", "f32")
    assert not (tmp_path / "out.gguf").exists()


def test_missing_tensor_is_refused(tiny_hf, tmp_path):
    directory, model = tiny_hf("mixed")
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    state = {k: v for k, v in model.state_dict().items() if "layers.3.self_attn.compressor.kv_proj" not in k}
    source = _save_state(tmp_path / "src", state, config, directory)
    with pytest.raises(ConversionError, match=r"compressor\.kv_proj"):
        convert(source, tmp_path / "out.gguf", "f32")


def test_missing_config_field_is_refused(tiny_hf, tmp_path):
    source = _copy(tiny_hf("mixed")[0], tmp_path / "src")
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    del config["hc_sinkhorn_iters"]
    (source / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ConversionError, match="hc_sinkhorn_iters"):
        convert(source, tmp_path / "out.gguf", "f32")


@pytest.mark.parametrize("outtype", ["q4_k", "fp8", ""])
def test_unsupported_outtype_is_refused(outtype, tiny_hf, tmp_path):
    with pytest.raises(ConversionError, match="q8_0"):
        convert(tiny_hf("mixed")[0], tmp_path / "out.gguf", outtype)


def test_failed_write_leaves_the_old_file_and_no_temporary(tiny_hf, tmp_path):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"previous model")

    def fail(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(tiny_hf("mixed")[0], out, "f32", progress=fail)
    assert out.read_bytes() == b"previous model"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


# ---------------------------------------------------------------- tiny models


def test_shipped_tokenizer_is_the_trained_tiny_tokenizer():
    pytest.importorskip("tokenizers")
    from ds4_model_deepseek4.tiny import shipped_tokenizer_json, train_tiny_tokenizer

    assert json.loads(shipped_tokenizer_json()) == json.loads(train_tiny_tokenizer().to_str())


def test_default_model_builds_without_torch_deterministically(tmp_path):
    script = (
        "import sys\n"
        "for blocked in ('torch', 'transformers', 'tokenizers'): sys.modules[blocked] = None\n"
        "from ds4_model_deepseek4.tiny import ensure_default_model\n"
        f"print(ensure_default_model({str(tmp_path / 'a')!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    first = Path(result.stdout.strip())
    from ds4_model_deepseek4.tiny import ensure_default_model

    second = ensure_default_model(tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()
    assert 1 << 20 <= first.stat().st_size <= 3 << 20
    mtime = second.stat().st_mtime_ns
    assert ensure_default_model(tmp_path / "b") == second and second.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [second.name]
    reader = GGUFReader(second)
    assert reader.fields["general.architecture"].contents() == "deepseek4"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == reader.fields["deepseek4.vocab_size"].contents()
