"""Tiny transformers GLM 5.3 Flash models and their converted GGUFs, built once per test process.

Import :func:`tiny_next_hf` and :func:`next_converted` into a test module to use them as fixtures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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

_built: dict[str, tuple[Path, Any]] = {}
_converted: dict[tuple[str, str], Path] = {}


@pytest.fixture(scope="session")
def tiny_next_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """``tiny_next_hf(name) -> (directory, model)`` for a :data:`NEXT_MODEL_CONFIGS` entry."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ds4_model_glm5.next_tiny import build_tiny_hf

    def get(name: str) -> tuple[Path, Any]:
        if name not in _built:
            directory = tmp_path_factory.mktemp(f"hf-next-{name}")
            _built[name] = (directory, build_tiny_hf(directory, NEXT_MODEL_CONFIGS[name], seed=len(_built) + 11))
        return _built[name]

    return get


@pytest.fixture(scope="session")
def next_converted(tiny_next_hf: Callable[[str], tuple[Path, Any]],
                   tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``next_converted(name, outtype) -> path`` of the GGUF converted from ``tiny_next_hf(name)``."""
    from ds4_model_glm5.next_convert import convert

    def get(name: str, outtype: str) -> Path:
        if (name, outtype) not in _converted:
            out = tmp_path_factory.mktemp(f"gguf-next-{name}") / f"{name}-{outtype}.gguf"
            convert(tiny_next_hf(name)[0], out, outtype)
            _converted[name, outtype] = out
        return _converted[name, outtype]

    return get
