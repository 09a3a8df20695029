"""Entry point of GLM 5.3 Flash (``glm5-next``): ``load(gguf, weights, ops, options) -> Model``."""

from __future__ import annotations

from typing import Any

from ds4_core.backend import Ops, WeightLoader
from ds4_core.errors import ModelConfigError

from .next_config import Glm5NextConfig
from .next_model import Glm5NextModel
from .next_opnames import NEXT_GRAPH_OPS

#: Ops the graph calls (checked against the backend before any weight loads).
REQUIRED_OPS = NEXT_GRAPH_OPS


def load(gguf: Any, weights: WeightLoader, ops: Ops, options: dict[str, Any]) -> Glm5NextModel:
    """Build a :class:`Glm5NextModel` from a GGUF file (``ds4_core.gguf.GGUFFile``) on the backend of ``ops``."""
    if options:
        raise ModelConfigError(f"glm5-next takes no model options, got {', '.join(sorted(options))}")
    return Glm5NextModel(weights, ops, Glm5NextConfig.from_metadata(gguf.metadata))
