"""Tiny random-weight GLM 5.3 Flash models (``Glm5NextForConditionalGeneration``): the transformers oracle of the
tests (needs torch, transformers and tokenizers).

The initialisation avoids transformers' test-hostile defaults (spec §2.4): norms, ``A_log``, ``dt_bias``, the pool
APE and gate, HC base/scale and correction biases are random, weights are scaled by 1/sqrt(fan-in) so activations
stay of order one, and the SwiGLU limit is small enough for the clamp to trigger.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .tiny import TINY_VOCAB, train_tiny_tokenizer, write_tokenizer_files

KDA_LAYER, DSA_LAYER = "linear_attention", "indexed_attention"

#: The default oracle text config: K K K D K D (dense first 2), 4-token pools, top-8 (2 pools) of 16 indexer heads.
TINY_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 6,
    "layer_types": [KDA_LAYER, KDA_LAYER, KDA_LAYER, DSA_LAYER, KDA_LAYER, DSA_LAYER],
    "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 0,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "index_topk": 8,
    "index_head_dim": 32,
    "index_n_heads": 16,
    "index_kpool": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "swiglu_limit": 1.5,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "pad_token_id": 0,
    "eos_token_id": 0,
}
#: A minimal vision tower: the composite model needs one; the converter skips it.
TINY_VISION_CONFIG: dict[str, Any] = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
                                      "out_hidden_size": 64, "projection_intermediate_size": 32}


def tiny_text_config(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tiny text config with ``overrides`` applied."""
    config = copy.deepcopy(TINY_TEXT_CONFIG)
    config.update(copy.deepcopy(dict(overrides or {})))
    return config


def random_parameter(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One parameter drawn so that every term of the forward pass matters (see the module docstring)."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(("hc.scale", "hc_attn_scale", "hc_ffn_scale")):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith(("bias", "A_log", "hc.base", "index_kpool_compress_ape")):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = 1 if name.endswith("embed_tokens.weight") else shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def build_tiny_hf(directory: str | Path, text_overrides: Mapping[str, Any] | None = None, seed: int = 0) -> Any:
    """Save a tiny random ``Glm5NextForConditionalGeneration`` (CPU, float32, eager) and a GLM-style tokenizer into
    ``directory``; returns the model in eval mode."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    directory = Path(directory)
    text = tiny_text_config(text_overrides)
    hf_config = Glm5NextConfig(text_config=text, vision_config=TINY_VISION_CONFIG)
    hf_config._attn_implementation = "eager"
    hf_config.text_config._attn_implementation = "eager"
    model = Glm5NextForConditionalGeneration(hf_config).to(torch.float32).eval()
    rng = np.random.default_rng(seed)
    state = {name: torch.from_numpy(random_parameter(name, tuple(t.shape), rng))
             for name, t in model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    model.save_pretrained(directory)
    write_tokenizer_files(directory, train_tiny_tokenizer(text["vocab_size"]).to_str())
    return model


def trained_model(cache_dir: str | Path | None = None) -> Path:
    """The shipped tiny GLM 5.3 Flash trained on Python's standard library (``ds4 run -m tiny:glm53``; see its card
    ``data/tiny-glm53.md``). ``cache_dir`` is unused: the file ships with the package."""
    return Path(__file__).parent / "data" / "tiny-glm53.gguf"
