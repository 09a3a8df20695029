"""The synthetic DeepSeek V4 Flash GGUF writer: a toy-size file read back by gguf-py, ``ds4 info`` and the numpy
Engine; the full-size tensor plan against the published Q2 table; the vocabulary against HF ``tokenizers``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from ds4_bench.flash_gguf import (
    FLASH,
    SQRT_SOFTPLUS_GATING,
    flash_config,
    planned_nbytes,
    synthetic_vocabulary,
    tensor_plan,
    write_flash_gguf,
)
from gguf import GGUFReader
from gguf.quants import dequantize

from ds4_core.cli import cli
from ds4_core.engine import Engine
from ds4_core.quants import tensor_nbytes
from ds4_core.tokenizer import Tokenizer

# Flash's structure at toy size: every quantized row still holds whole blocks (256 for IQ2_XXS / Q2_K).
TOY = dict(vocab_size=512, hidden_size=256, context_length=4096, num_heads=4, head_dim=64, value_dim=64, rope_dim=16,
           q_lora_rank=64, o_lora_rank=64, o_groups=2, n_experts=8, n_experts_used=2, expert_ffn=256,
           index_n_heads=4, index_head_dim=32, index_topk=4, sliding_window=8, yarn_original_context=256,
           compress_ratios=[0, 0, 4, 8, 4])
TOY_LAYERS = 5  # sliding, sliding, CSA, HCA, CSA; the first three hash-routed


def _published_flash_table(load_script):
    """tests/deepseek4/test_info_flash.py's table of the published 43-layer Q2 file, written independently."""
    module = load_script(Path(__file__).parents[1] / "deepseek4" / "test_info_flash.py", "_flash_table_oracle")
    return module.flash_tensors(), module.FLASH


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory) -> Path:
    return write_flash_gguf(tmp_path_factory.mktemp("flash") / "toy-flash.gguf", TOY_LAYERS, seed=3, progress=False,
                            shapes=TOY)


def test_gguf_py_reads_every_tensor_with_its_type_shape_and_size(toy_path):
    plan = tensor_plan(flash_config(TOY_LAYERS, TOY))
    reader = GGUFReader(toy_path)
    assert [t.name for t in reader.tensors] == [t.name for t in plan]
    for read, planned in zip(reader.tensors, plan, strict=True):
        assert read.tensor_type == planned.qtype, read.name
        assert tuple(int(d) for d in reversed(read.shape)) == planned.shape, read.name
        assert read.n_bytes == tensor_nbytes(planned.qtype, planned.shape) == read.data.nbytes, read.name
        if planned.qtype.name != "I32":  # valid blocks: gguf-py's own dequantizer gives finite values
            assert np.isfinite(dequantize(read.data, read.tensor_type)).all(), read.name
    tid2eid = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_tid2eid.weight").data
    assert tid2eid.min() >= 0 and tid2eid.max() < TOY["n_experts"]
    assert all(len(set(row)) == TOY["n_experts_used"] for row in tid2eid)  # distinct experts per token
    assert {t.tensor_type.name for t in reader.tensors} == {"F16", "F32", "Q8_0", "IQ2_XXS", "Q2_K", "I32"}


def test_metadata_carries_what_llama_cpp_requires(toy_path):
    fields = GGUFReader(toy_path).fields

    def value(key):
        return fields[key].contents()

    assert value("general.architecture") == "deepseek4"
    assert value("deepseek4.block_count") == TOY_LAYERS and value("deepseek4.hash_layer_count") == 3
    assert value("deepseek4.expert_gating_func") == SQRT_SOFTPLUS_GATING
    assert value("deepseek4.rope.scaling.type") == "yarn"
    assert value("deepseek4.context_length") == TOY["context_length"]
    assert len(value("deepseek4.swiglu_clamp_exp")) == TOY_LAYERS  # llama.cpp: exactly block_count entries
    assert value("deepseek4.attention.compress_ratios") == TOY["compress_ratios"]
    assert value("tokenizer.ggml.model") == "gpt2" and value("tokenizer.ggml.pre") == "joyai-llm"
    assert len(value("tokenizer.ggml.tokens")) == TOY["vocab_size"] and value("tokenizer.ggml.merges")


def test_ds4_info_accepts_the_file(toy_path):
    result = CliRunner().invoke(cli, ["info", "--json", str(toy_path)])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["model"]["layers"].startswith("5: 2 sliding, 2 CSA (m=4), 1 HCA (m=8); 3 hash-routed")
    assert info["tensor_bytes"] == planned_nbytes(TOY_LAYERS, shapes=TOY)


def test_numpy_engine_loads_it_and_feeds_tokens_to_finite_logits(toy_path):
    engine = Engine.load(toy_path, backend="numpy", ctx=64)
    try:
        assert engine.tokenizer.vocab_size == TOY["vocab_size"]
        ids = engine.tokenizer.encode("Hello, world! 12345")
        assert engine.tokenizer.decode(ids) == "Hello, world! 12345"
        logits = engine.new_session().feed(ids + [7] * (20 - len(ids)))  # 20 tokens: CSA and HCA rows complete
        assert logits.shape == (20, TOY["vocab_size"]) and np.isfinite(logits).all()
        assert logits.std() > 0
    finally:
        engine.close()


@pytest.mark.parametrize("layers", [2, 4])
def test_full_size_plan_is_the_published_table_cut_to_its_layers(layers, load_script):
    table, flash = _published_flash_table(load_script)
    assert flash == FLASH
    kept = [(n, s, q) for n, s, q in table if not n.startswith("blk.") or int(n.split(".")[1]) < layers]
    plan = tensor_plan(flash_config(layers), "q2")
    assert sorted((t.name, t.shape, t.qtype) for t in plan) == sorted(kept)
    assert planned_nbytes(layers) == sum(tensor_nbytes(q, s) for _, s, q in kept)
    if layers == 2:  # two sliding, hash-routed layers (hash_layer_count capped at 2) plus embedding and head
        assert flash_config(2).n_hash_layers == 2 and 5.5e9 < planned_nbytes(2) < 5.6e9
    else:
        assert flash_config(4).layer_kind(2) == "csa" and flash_config(4).layer_kind(3) == "hca"
        assert 9.4e9 < planned_nbytes(4) < 9.6e9


def test_full_vocabulary_tokenizes_as_hf_tokenizers_does():
    tokenizers = pytest.importorskip("tokenizers")
    from ds4_core.pretokenizers import pre_tokenizer

    tokens, types, merges = synthetic_vocabulary(FLASH["vocab_size"])
    assert len(tokens) == len(set(tokens)) == FLASH["vocab_size"]
    ours = Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "joyai-llm",
                                    "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                    "tokenizer.ggml.merges": merges})
    first_normal = types.index(1)
    model = tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens) if i >= first_normal},
                                  merges=[tuple(m.split(" ")) for m in merges])
    hf = tokenizers.Tokenizer(model)
    splits = [tokenizers.pre_tokenizers.Split(tokenizers.Regex(p), behavior="isolated")
              for p in pre_tokenizer("joyai-llm").hf_split_patterns]
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [*splits, tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    text = "The quick brown fox, 2026 times: déjà vu — 你好世界 ¿qué? \tdone\n"
    assert ours.encode(text) == hf.encode(text).ids
    assert ours.decode(ours.encode(text)) == text


def test_write_gguf_option_needs_deepseek_and_a_layer_count(tmp_path):
    runner = CliRunner()
    no_layers = runner.invoke(cli, ["bench", "--write-gguf", str(tmp_path / "x.gguf")])
    assert no_layers.exit_code == 2 and "--layers" in no_layers.output
    other = runner.invoke(cli, ["bench", "--synthetic", "glm53-flash", "--layers", "2",
                                "--write-gguf", str(tmp_path / "x.gguf")])
    assert other.exit_code == 2 and "only deepseek4-flash" in other.output
    assert not list(tmp_path.iterdir())
