"""Entry point of the GLM 5.2 (``glm-dsa``) family: ``load(gguf, weights, ops, options) -> Model``."""

from __future__ import annotations

from typing import Any

from ds4_core.backend import Ops, WeightLoader
from ds4_core.errors import ModelConfigError

from .config import GlmDsaConfig
from .model import GlmDsaModel


def load(gguf: Any, weights: WeightLoader, ops: Ops, options: dict[str, Any]) -> GlmDsaModel:
    """Build a :class:`GlmDsaModel` from a GGUF file (``ds4_core.gguf.GGUFFile``) on the backend of ``ops``."""
    if options:
        raise ModelConfigError(f"the glm-dsa model takes no options; remove {', '.join(sorted(options))}")
    return GlmDsaModel(weights, ops, GlmDsaConfig.from_metadata(gguf.metadata))
