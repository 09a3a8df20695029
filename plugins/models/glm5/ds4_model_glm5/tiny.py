"""Tiny random-weight GLM 5.2 models (``GlmMoeDsaForCausalLM``) with a small GLM-style tokenizer: the transformers
oracle of the tests (needs torch, transformers and tokenizers).

The initialisation avoids transformers' test-hostile defaults (spec §2.4): norms, LayerNorm biases and correction
biases are random, and weights are scaled by 1/sqrt(fan-in) so activations stay of order one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: GLM special tokens (spec §9.1), at ids 0.. of the tiny vocabulary.
SPECIAL_TOKENS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                  "/nothink")
TINY_VOCAB = 320

TRAINING_TEXT = """\
You are a helpful assistant. The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun.
Hello world! How are you today? What is the weather like in the mountains this week?
def add(a, b):
    return a + b
The numbers 1, 22, 333, 4444 and 2026 appear here; so do 3.14159 and 1e-6.
[gMASK]<sop><|user|>What is the capital of France?<|assistant|><think></think>The capital of France is Paris.
<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>
你好，世界。
"""

# The default oracle configuration in transformers' config.json flavour: 4 layers (1 dense), IndexShare F F S F,
# index_topk 5 with 8 indexer heads, 8 experts in 2 groups.
TINY_CONFIG: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "architectures": ["GlmMoeDsaForCausalLM"],
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 20,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "index_topk": 5,
    "index_head_dim": 16,
    "index_n_heads": 8,
    "indexer_types": ["full", "full", "shared", "full"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 8000.0},
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 2,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def tiny_config(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tiny config.json dict with ``overrides`` applied."""
    config = copy.deepcopy(TINY_CONFIG)
    config.update(copy.deepcopy(dict(overrides or {})))
    return config


def random_parameter(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One parameter drawn so that every term of the forward pass matters (see the module docstring)."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(("norm.bias", "e_score_correction_bias")):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = 1 if name.endswith("embed_tokens.weight") else shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def train_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` tokens with GLM's pre-tokenizer
    (``glm4``) and :data:`SPECIAL_TOKENS` at ids 0.., trained on :data:`TRAINING_TEXT`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from ds4_core.pretokenizers import pre_tokenizer

    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre_tokenizer("glm4").hf_split_patterns]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TRAINING_TEXT] * 4, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the training text yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}; "
                         "pick a smaller vocab_size")
    return tokenizer


def write_tokenizer_files(directory: Path, tokenizer_json: str) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` (BOS ``[gMASK]``, EOS/pad ``<|endoftext|>``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[gMASK]", "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 4096}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")


def build_tiny_hf(directory: str | Path, config_overrides: Mapping[str, Any] | None = None, seed: int = 0) -> Any:
    """Save a tiny random ``GlmMoeDsaForCausalLM`` (CPU, float32, eager) and its tokenizer into ``directory``.

    Returns the model in eval mode; ``vocab_size`` in the overrides also sets the tokenizer size (≥ 277).
    """
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    directory = Path(directory)
    config = tiny_config(config_overrides)
    hf_config = GlmMoeDsaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    hf_config._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(hf_config).to(torch.float32).eval()
    rng = np.random.default_rng(seed)
    state = {name: torch.from_numpy(random_parameter(name, tuple(t.shape), rng))
             for name, t in model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    model.save_pretrained(directory)
    write_tokenizer_files(directory, train_tiny_tokenizer(config["vocab_size"]).to_str())
    return model
