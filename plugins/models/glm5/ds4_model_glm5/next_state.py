"""Per-layer decoding state of GLM 5.3 Flash (spec §7), preallocated for a context of ``ctx`` tokens.

KDA blocks carry their conv history and recurrent matrix; DSA blocks carry the MLA latent of every
token, and (blocks with their own indexer) one pooled indexer key per complete pool plus the raw keys
and gate logits of the open pool. Nothing else survives between calls but the token count.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import attrs

from .next_config import Glm5NextConfig


@attrs.define
class KdaState:
    """``conv [K−1, 3·h·d]``: the last K−1 pre-conv q|k|v rows; ``recurrent [h, d, d]`` (key × value), fp32."""

    conv: Any
    recurrent: Any


@attrs.define
class PoolState:
    """``open_keys``/``open_gates [P, dI]``: LayerNorm'd keys and gate logits (APE added) of the open pool's tokens,
    slot = position mod P; ``pooled [ctx // P, dI]``: the key of each complete pool."""

    open_keys: Any
    open_gates: Any
    pooled: Any


@attrs.define
class DsaState:
    """``latent [ctx, R]``: ``kv_a_layernorm(kv_a(x))`` of every token; ``pool``: its indexer (``None`` when the
    block reuses an earlier block's selection)."""

    latent: Any
    pool: PoolState | None = None


@attrs.define
class Glm5NextState:
    """The whole decoding state: ``n_tokens`` fed so far (the next position) and one state per trunk block."""

    ctx: int
    n_tokens: int
    layers: list[KdaState | DsaState]


def new_state(config: Glm5NextConfig, ctx: int, xp: ModuleType, indexed: tuple[bool, ...]) -> Glm5NextState:
    """Empty state for ``ctx`` tokens with ``xp`` arrays; ``indexed[b]``: trunk block b runs its own indexer."""
    f32, layers = xp.float32, []
    hd, K, P, dI = config.kda_heads * config.kda_head_dim, config.kda_conv, config.index_pool, config.index_head_dim
    for block in range(config.num_layers):
        if not config.is_dsa(block):
            layers.append(KdaState(conv=xp.zeros((K - 1, 3 * hd), dtype=f32),
                                   recurrent=xp.zeros((config.kda_heads, config.kda_head_dim, config.kda_head_dim),
                                                      dtype=f32)))
            continue
        pool = None
        if indexed[block]:
            pool = PoolState(open_keys=xp.zeros((P, dI), dtype=f32), open_gates=xp.zeros((P, dI), dtype=f32),
                             pooled=xp.zeros((ctx // P, dI), dtype=f32))
        layers.append(DsaState(latent=xp.zeros((ctx, config.kv_lora_rank), dtype=f32), pool=pool))
    return Glm5NextState(ctx=ctx, n_tokens=0, layers=layers)


def state_nbytes(config: Glm5NextConfig, ctx: int, indexed: tuple[bool, ...]) -> int:
    """Bytes :func:`new_state` allocates for ``ctx`` tokens."""
    hd, d, P, dI = config.kda_heads * config.kda_head_dim, config.kda_head_dim, config.index_pool, config.index_head_dim
    total = 0
    for block in range(config.num_layers):
        if not config.is_dsa(block):
            total += 4 * (3 * (config.kda_conv - 1) * hd + config.kda_heads * d * d)
        else:
            total += 4 * ctx * config.kv_lora_rank + (4 * (2 * P + ctx // P) * dI if indexed[block] else 0)
    return total
