"""Entry point of the deepseek4 model family: ``load(gguf, weights, ops, options) -> Model``."""

from __future__ import annotations

from typing import Any

from ds4_core.backend import Ops, WeightLoader
from ds4_core.errors import BackendError, ModelConfigError

from .config import DeepSeekV4Config
from .model import DeepSeekV4Model
from .opnames import GRAPH_OPS, QAT_OPS

#: Ops the graph calls (checked against the backend before any weight loads).
REQUIRED_OPS = GRAPH_OPS

#: Model options and their defaults. ``qat_rounding``: simulate the official graph's FP8 KV and
#: Hadamard+FP4 indexer rounding (spec §10 items 1–2); off = the transformers numerics.
OPTIONS: dict[str, Any] = {"qat_rounding": False}


def load(gguf: Any, weights: WeightLoader, ops: Ops, options: dict[str, Any]) -> DeepSeekV4Model:
    """Build a :class:`DeepSeekV4Model` from a GGUF file (``ds4_core.gguf.GGUFFile``) on the backend of ``ops``."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ModelConfigError(f"unknown deepseek4 model option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    qat = bool(options.get("qat_rounding", OPTIONS["qat_rounding"]))
    cfg = DeepSeekV4Config.from_metadata(gguf.metadata)
    if qat:
        missing = ops.missing(QAT_OPS)
        if missing:
            raise BackendError(f"backend {ops.backend.name!r} lacks {', '.join(missing)} needed by qat_rounding; "
                               "turn the option off or use the numpy backend")
        ih = cfg.index_head_dim
        if ih & (ih - 1) or ih % 32:
            raise ModelConfigError(f"qat_rounding needs an indexer key_length that is a power of two ≥ 32, got {ih}")
    return DeepSeekV4Model(weights, ops, cfg, qat_rounding=qat)
