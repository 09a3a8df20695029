"""Tiny transformers GLM 5.2 models and their converted GGUFs, built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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

    built: dict[str, tuple[Path, Any]] = {}

    def get(name: str) -> tuple[Path, Any]:
        if name not in built:
            directory = tmp_path_factory.mktemp(f"glm52-hf-{name}")
            built[name] = (directory, build_tiny_hf(directory, MODEL_CONFIGS[name], seed=len(built) + 1))
        return built[name]

    return get


@pytest.fixture(scope="session")
def converted(tiny_hf: Callable[[str], tuple[Path, Any]],
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``converted(name, outtype) -> path`` of the GGUF converted from ``tiny_hf(name)``."""
    from ds4_model_glm5.convert import convert

    paths: dict[tuple[str, str], Path] = {}

    def get(name: str, outtype: str) -> Path:
        if (name, outtype) not in paths:
            out = tmp_path_factory.mktemp(f"glm52-gguf-{name}") / f"{name}-{outtype}.gguf"
            convert(tiny_hf(name)[0], out, outtype)
            paths[name, outtype] = out
        return paths[name, outtype]

    return get
