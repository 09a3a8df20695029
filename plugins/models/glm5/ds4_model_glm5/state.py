"""Per-layer decoding state of GLM 5.2 (spec §7), preallocated for a context of ``ctx`` tokens.

Every layer caches its MLA row (normalised latent ``c_kv`` then the RoPE'd shared key); layers with their own
indexer also cache the indexer keys. The top-k selection shared between layers is recomputed every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import attrs

from .config import GlmDsaConfig


@attrs.define
class LayerState:
    """``latent [ctx, kv_lora_rank + rope_dim]``: row p is position p; ``index_keys [ctx, index_head_dim]`` or None."""

    latent: Any
    index_keys: Any | None = None


@attrs.define
class GlmDsaState:
    """The whole decoding state: ``n_tokens`` fed so far (the next position) and one :class:`LayerState` per layer."""

    ctx: int
    n_tokens: int
    layers: list[LayerState]


def new_state(config: GlmDsaConfig, full_indexer: Sequence[bool], ctx: int, xp: ModuleType) -> GlmDsaState:
    """Empty state for ``ctx`` tokens; ``full_indexer[l]`` says whether layer l keeps indexer keys."""
    layers = [LayerState(latent=xp.zeros((ctx, config.key_length), dtype=xp.float32),
                         index_keys=xp.zeros((ctx, config.index_head_dim), dtype=xp.float32) if full else None)
              for full in full_indexer]
    return GlmDsaState(ctx=ctx, n_tokens=0, layers=layers)


def state_breakdown(config: GlmDsaConfig, full_indexer: Sequence[bool], ctx: int) -> dict[str, int]:
    """Bytes :func:`new_state` allocates for ``ctx`` tokens, by kind: the MLA latent KV rows of every layer and the
    indexer keys of the layers with their own indexer."""
    sizes = {"MLA latent KV": 4 * ctx * config.key_length * len(full_indexer)}
    if any(full_indexer):
        sizes["indexer keys"] = 4 * ctx * config.index_head_dim * sum(full_indexer)
    return sizes


def state_nbytes(config: GlmDsaConfig, full_indexer: Sequence[bool], ctx: int) -> int:
    """Bytes :func:`new_state` allocates for ``ctx`` tokens."""
    return sum(state_breakdown(config, full_indexer, ctx).values())
