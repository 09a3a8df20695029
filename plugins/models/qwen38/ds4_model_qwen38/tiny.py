"""Tiny random Qwen3.8 models for tests: a transformers ``Qwen4ExpForCausalLM`` and a trained toy tokenizer.

Every parameter is redrawn (transformers initialises zero-centred norms and the PLE conv to zero, which would
hide whole sub-blocks): zero-centred norm weights ``0.3·N(0, 1)``, plain weights ``1/sqrt(fan-in)``-scaled
normals, ``A_log`` and ``dt_bias`` in ranges that give decays well away from 0 and 1.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: Special tokens at ids 0.. (``<|endoftext|>`` = 0 is the n-gram separator of the tiny models).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>",
                  "</think>", "<tool_response>", "</tool_response>")
TINY_VOCAB = 320

TRAINING_TEXT = """\
You are a helpful assistant. The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun.
What is the weather like in Paris today? It is sunny and warm, about 22 degrees.
def add(a, b):
    return a + b
<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
</function>
</tool_call>
The numbers 1, 22, 333 and 2026 appear here; so do 3.14159 and 1e-6.
"""

# Spec §12 config A with a second PLE layer, a budget small enough that QSA selection happens early, and 8 index
# heads: with 2, several blocks often score exactly 0 and top-k ties (broken differently by torch) decide.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": TINY_VOCAB, "hidden_size": 24, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 10, "hc_count": 3, "hc_lowrank": 5, "ple_layer_ids": [1, 3],
    "ple_embed_dim": 16, "heads_per_ngram": 2, "ngram_size": 3, "ngram_vocab_size_base": 50,
    "make_ngram_vocab_size_divisible_by": 8, "ple_conv_kernel_size": 4, "indexer_n_heads": 8,
    "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4, "indexer_compress_ratio": 2,
    "output_gate_type": "sigmoid", "eos_token_id": 0, "split_ngram_parts": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [2, 1, 1]},
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def tiny_config(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:data:`TINY_CONFIG` with ``overrides`` applied."""
    config = copy.deepcopy(TINY_CONFIG)
    config.update(copy.deepcopy(dict(overrides or {})))
    return config


def _random_parameter(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("linear_attn.norm.weight"):  # plain (not zero-centred) gated-norm weight
        return 1 + 0.3 * rng.standard_normal(shape)
    if "norm" in name.rsplit(".", 2)[-2]:  # every zero-centred RMSNorm
        return 0.3 * rng.standard_normal(shape)
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.2, 2.0, shape))
    if name.endswith("dt_bias"):
        return rng.uniform(-1.0, 1.0, shape)
    if name.endswith(("embed_tokens.weight", "ngram_embedding.weight")):
        return rng.standard_normal(shape)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return rng.standard_normal(shape) / np.sqrt(fan_in)


@functools.lru_cache(maxsize=4)
def train_tiny_tokenizer_json(vocab_size: int = TINY_VOCAB - 8) -> str:
    """A byte-level BPE ``tokenizer.json`` of ``vocab_size`` tokens with the ``qwen35`` pre-tokenizer and the
    :data:`SPECIAL_TOKENS` at ids 0..8, trained on :data:`TRAINING_TEXT`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from ds4_core.pretokenizers import pre_tokenizer

    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre_tokenizer("qwen35").hf_split_patterns]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TRAINING_TEXT] * 4, trainer)
    return tokenizer.to_str()


def write_tokenizer_files(directory: Path) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` (EOS ``<|im_end|>``, pad ``<|endoftext|>``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(train_tiny_tokenizer_json(), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "model_max_length": 512}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def build_tiny_hf(directory: str | Path, config_overrides: Mapping[str, Any] | None = None, seed: int = 0) -> Any:
    """Save a tiny random ``Qwen4ExpForCausalLM`` (CPU, float32, eager) and its tokenizer into ``directory``.

    Returns the model in eval mode.
    """
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    directory = Path(directory)
    hf_config = Qwen4ExpTextConfig(**tiny_config(config_overrides))
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(hf_config).to(torch.float32).eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            value = _random_parameter(name, tuple(parameter.shape), rng)
            parameter.copy_(torch.from_numpy(value.astype(np.float32)))
    model.save_pretrained(directory)
    write_tokenizer_files(directory)
    return model


def trained_model(cache_dir: str | Path | None = None) -> Path:
    """The shipped tiny Qwen3.8 Flash Next trained on Python's standard library (``ds4 run -m tiny:qwen38``; see its
    card ``data/tiny-qwen38.md``). ``cache_dir`` is unused: the file ships with the package."""
    return Path(__file__).parent / "data" / "tiny-qwen38.gguf"
