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


def state_breakdown(config: Glm5NextConfig, ctx: int, indexed: tuple[bool, ...]) -> dict[str, int]:
    """Bytes :func:`new_state` allocates for ``ctx`` tokens, by kind: MLA latent KV, pooled indexer keys and the open
    pool of DSA blocks; KDA recurrent state and conv history. Kinds whose blocks the model lacks are left out."""
    hd, d, P, dI = config.kda_heads * config.kda_head_dim, config.kda_head_dim, config.index_pool, config.index_head_dim
    sizes = dict.fromkeys(("MLA latent KV", "pooled indexer keys", "indexer open pool", "KDA recurrent state",
                           "KDA conv history"), 0)
    for block in range(config.num_layers):
        if not config.is_dsa(block):
            sizes["KDA recurrent state"] += 4 * config.kda_heads * d * d
            sizes["KDA conv history"] += 4 * 3 * (config.kda_conv - 1) * hd
            continue
        sizes["MLA latent KV"] += 4 * ctx * config.kv_lora_rank
        if indexed[block]:
            sizes["pooled indexer keys"] += 4 * (ctx // P) * dI
            sizes["indexer open pool"] += 4 * 2 * P * dI
    dsa = sum(config.is_dsa(b) for b in range(config.num_layers))
    present = {"MLA latent KV": dsa > 0, "pooled indexer keys": any(indexed), "indexer open pool": any(indexed),
               "KDA recurrent state": dsa < config.num_layers, "KDA conv history": dsa < config.num_layers}
    return {kind: n for kind, n in sizes.items() if present[kind]}


def state_nbytes(config: Glm5NextConfig, ctx: int, indexed: tuple[bool, ...]) -> int:
    """Bytes :func:`new_state` allocates for ``ctx`` tokens."""
    return sum(state_breakdown(config, ctx, indexed).values())
