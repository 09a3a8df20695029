"""Tiny transformers Qwen3.8 models and their converted GGUFs, built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ds4_core.testing.conformance import built_once, converted_once

LINEAR, ATTENTION = "linear_attention", "indexed_attention"

# Overrides of ds4_model_qwen38.tiny.TINY_CONFIG. Between them: PLE on several layers (two tables, primes continuing
# across layers), both output-gate types, QSA budgets that force block selection, hc 3 and 2, grouped and equal
# key/value head counts.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # spec §12 config A plus a second PLE layer: GDN, GDN, GDN, QSA (budget 4, blocks of 2); sigmoid gate
    "a": {},
    # spec §12 config B: 6 layers, QSA every 3rd, PLE on layers 2 and 5, silu gate, hc 2, nv = nk, budget 6 / ratio 3
    "b": {"num_hidden_layers": 6, "layer_types": [LINEAR, LINEAR, ATTENTION] * 2, "ple_layer_ids": [2, 5],
          "output_gate_type": "silu", "hc_count": 2, "linear_num_value_heads": 2, "indexer_budget": 6,
          "indexer_compress_ratio": 3, "num_experts": 5, "num_experts_per_tok": 3},
}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """``tiny_hf(name) -> (directory, model)`` for a :data:`MODEL_CONFIGS` entry, saved by ``build_tiny_hf``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ds4_model_qwen38.tiny import build_tiny_hf

    return built_once(tmp_path_factory, build_tiny_hf, MODEL_CONFIGS, prefix="hf", seed_offset=1)


@pytest.fixture(scope="session")
def converted(tiny_hf: Callable[[str], tuple[Path, Any]],
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``converted(name, outtype) -> path`` of the GGUF converted from ``tiny_hf(name)``."""
    from ds4_model_qwen38.convert import convert

    return converted_once(tmp_path_factory, tiny_hf, convert, prefix="gguf")
