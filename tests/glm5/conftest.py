"""Tiny transformers GLM 5.2 models and their converted GGUFs, built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ds4_core.testing.conformance import built_once, converted_once

# Overrides of ds4_model_glm5.tiny.TINY_CONFIG. Between them: explicit, frequency-derived and pattern IndexShare
# schedules (shared after shared included), more keys than index_topk, >= 16 indexer heads (no ReLU-zero top-k
# ties, spec §5.3), grouped routing with several kept groups, two shared experts, 0 / 1 / 2 dense layers.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # 4 layers F F S F, 1 dense layer, top-5, 8 experts in 2 groups (1 kept)
    "default": {"index_n_heads": 16},
    # schedule from index_topk_freq 2 / offset 2: F F S F S F; 16 experts in 4 groups (2 kept), 2 shared experts
    "freq": {"num_hidden_layers": 6, "indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 2,
             "first_k_dense_replace": 2, "n_routed_experts": 16, "n_group": 4, "topk_group": 2,
             "num_experts_per_tok": 4, "n_shared_experts": 2, "index_n_heads": 32, "index_topk": 7},
    # pattern F S S F, every layer MoE, the indexer head fully roped, wider heads
    "pattern": {"indexer_types": None, "index_topk_pattern": "FSSF", "first_k_dense_replace": 0,
                "qk_rope_head_dim": 16, "index_head_dim": 16, "num_attention_heads": 8, "num_key_value_heads": 8,
                "index_n_heads": 24, "index_topk": 3},
}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """``tiny_hf(name) -> (directory, model)`` for a :data:`MODEL_CONFIGS` entry, saved by ``build_tiny_hf``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ds4_model_glm5.tiny import build_tiny_hf

    return built_once(tmp_path_factory, build_tiny_hf, MODEL_CONFIGS, prefix="glm52-hf", seed_offset=1)


@pytest.fixture(scope="session")
def converted(tiny_hf: Callable[[str], tuple[Path, Any]],
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``converted(name, outtype) -> path`` of the GGUF converted from ``tiny_hf(name)``."""
    from ds4_model_glm5.convert import convert

    return converted_once(tmp_path_factory, tiny_hf, convert, prefix="glm52-gguf")


# ---------------------------------------------------------------- GLM 5.3 Flash (glm5-next)

K, D = "linear_attention", "indexed_attention"

# Overrides of ds4_model_glm5.next_tiny.TINY_TEXT_CONFIG. Between them: KDA/DSA mixes, a shared-indexer layer,
# pools of 2, 4 and 8 tokens, more complete pools than index_topk / pool, >= 8 indexer heads (no top-k ties),
# hc_mult 4 and 2, one and several expert groups, conv kernels of 4 and 2.
NEXT_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # K K K D K D, 4-token pools, top-8 = 2 pools of 16 indexer heads, 8 experts in 2 groups
    "mixed": {},
    # D(full) D(shared) K D: IndexShare, 2-token pools, top-6 = 3 pools, hc_mult 2, one expert group
    "shared": {
        "num_hidden_layers": 4, "layer_types": [D, D, K, D], "indexer_types": ["full", "shared", "full", "full"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "index_kpool": 2, "index_topk": 6,
        "index_n_heads": 8, "hc_mult": 2, "n_group": 1, "topk_group": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2,
    },
    # K K D K K D: 8-token pools, top-16 = 2 pools, conv kernel 2, 8 experts in 4 groups (2 kept), swiglu 0.8
    "kda_heavy": {
        "layer_types": [K, K, D, K, K, D], "mlp_layer_types": ["dense"] + ["sparse"] * 5, "index_kpool": 8,
        "index_topk": 16, "index_n_heads": 8, "linear_conv_kernel_dim": 2, "linear_num_heads": 2,
        "linear_head_dim": 32, "n_group": 4, "topk_group": 2, "swiglu_limit": 0.8,
    },
}

@pytest.fixture(scope="session")
def tiny_next_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """``tiny_next_hf(name) -> (directory, model)`` for a :data:`NEXT_MODEL_CONFIGS` entry (GLM 5.3 Flash)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ds4_model_glm5.next_tiny import build_tiny_hf

    return built_once(tmp_path_factory, build_tiny_hf, NEXT_MODEL_CONFIGS, prefix="hf-next", seed_offset=11)


@pytest.fixture(scope="session")
def next_converted(tiny_next_hf: Callable[[str], tuple[Path, Any]],
                   tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``next_converted(name, outtype) -> path`` of the GGUF converted from ``tiny_next_hf(name)``."""
    from ds4_model_glm5.next_convert import convert

    return converted_once(tmp_path_factory, tiny_next_hf, convert, prefix="gguf-next")
