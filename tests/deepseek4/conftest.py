"""Tiny transformers DeepSeek V4 models and their converted GGUFs, built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ds4_core.testing.conformance import built_once, converted_once

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

# Overrides of ds4_model_deepseek4.tiny.TINY_CONFIG. Between them: all three layer types, hash and learned MoE,
# more complete compressed rows than index_topk (so the indexer selection matters), >= 8 indexer heads (no top-k
# ties, spec §9.4), hc_mult 4 and 2, several HCA ratios.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # spec §1.4: sliding, sliding, CSA, HCA(8), CSA; hash, hash, moe, moe, moe; top-k 3 of up to 16 rows
    "mixed": {},
    # HCA first, no hash layers, hc_mult 2, 16 indexer heads, 8 heads in 4 output groups, top-3 of 6 experts
    "hca_first": {
        "num_hidden_layers": 4, "layer_types": [HCA, CSA, SLIDING, CSA], "mlp_layer_types": ["moe"] * 4,
        "hc_mult": 2, "num_attention_heads": 8, "o_groups": 4, "index_n_heads": 16, "index_topk": 5,
        "sliding_window": 6, "compress_rates": {CSA: 4, HCA: 16}, "n_routed_experts": 6, "num_experts_per_tok": 3,
    },
    # every MoE hash-routed, wider heads (rope dim 16 = indexer head dim), a tighter SwiGLU clamp
    "all_hash": {
        "num_hidden_layers": 3, "layer_types": [CSA, HCA, SLIDING], "mlp_layer_types": ["hash_moe"] * 3,
        "head_dim": 64, "index_topk": 2, "sliding_window": 12, "compress_rates": {CSA: 4, HCA: 12},
        "n_routed_experts": 6, "num_experts_per_tok": 3, "swiglu_limit": 0.3,
    },
}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """``tiny_hf(name) -> (directory, model)`` for a :data:`MODEL_CONFIGS` entry, saved by ``build_tiny_hf``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ds4_model_deepseek4.tiny import build_tiny_hf

    return built_once(tmp_path_factory, build_tiny_hf, MODEL_CONFIGS, prefix="hf", seed_offset=1)


@pytest.fixture(scope="session")
def converted(tiny_hf: Callable[[str], tuple[Path, Any]],
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``converted(name, outtype) -> path`` of the GGUF converted from ``tiny_hf(name)``."""
    from ds4_model_deepseek4.convert import convert

    return converted_once(tmp_path_factory, tiny_hf, convert, prefix="gguf")
