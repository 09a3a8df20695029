"""Per-sequence decoding state of Qwen3.8 (spec §5), preallocated for a context of ``ctx`` tokens.

Delta-net layers carry a fixed-size state (conv history and the fp32 delta-rule memory); attention layers
carry their K/V and raw indexer keys per position; PLE layers carry the history of their dilated conv. The
last ``n − 1`` raw token ids (the n-gram context) are shared by every PLE layer.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import attrs
import numpy as np

from .config import Qwen38Config


@attrs.define
class DeltaNetState:
    """``conv [K−1, conv_dim]``: pre-activation projections of the last K−1 tokens; ``memory [nv, dk, dv]``
    the delta-rule state; ``ple_conv [(K_ple−1)·n, hc·D]`` the normed PLE values of the last tokens (PLE layers)."""

    conv: Any
    memory: Any
    ple_conv: Any | None = None


@attrs.define
class AttentionState:
    """Row p of ``keys [ctx, Hkv, hd]`` (normed, RoPE'd), ``values [ctx, Hkv, hd]`` and ``index_keys [ctx, di]``
    (raw indexer keys) belongs to position p."""

    keys: Any
    values: Any
    index_keys: Any


@attrs.define
class Qwen38State:
    """The whole decoding state: ``n_tokens`` fed so far, the n-gram context ``ngram_history [n − 1]`` (int64,
    starts as end-of-sequence ids) and one layer state per layer."""

    ctx: int
    n_tokens: int
    ngram_history: np.ndarray
    layers: list[DeltaNetState | AttentionState]


def _layer_shapes(cfg: Qwen38Config, layer: int, ctx: int) -> list[tuple[int, ...]]:
    """Shapes of one layer's float32 arrays, in :class:`DeltaNetState` / :class:`AttentionState` field order."""
    if cfg.is_attention(layer):
        kv = (ctx, cfg.num_kv_heads, cfg.head_dim)
        return [kv, kv, (ctx, cfg.index_dim)]
    shapes = [(cfg.conv_kernel - 1, cfg.conv_dim), (cfg.ssm_value_heads, cfg.ssm_key_dim, cfg.ssm_value_dim)]
    if layer in cfg.ple_layers:
        shapes.append(((cfg.ple_conv_kernel - 1) * cfg.ngram_size, cfg.hc_count * cfg.hidden_size))
    return shapes


def new_state(cfg: Qwen38Config, ctx: int, xp: ModuleType) -> Qwen38State:
    """Empty state for ``ctx`` tokens, arrays allocated with ``xp`` (numpy or cupy)."""
    layers: list[DeltaNetState | AttentionState] = []
    for layer in range(cfg.num_layers):
        arrays = [xp.zeros(shape, dtype=xp.float32) for shape in _layer_shapes(cfg, layer, ctx)]
        layers.append(AttentionState(*arrays) if cfg.is_attention(layer) else DeltaNetState(*arrays))
    history = np.full(max(cfg.ngram_size - 1, 0), cfg.ple_eos, dtype=np.int64)
    return Qwen38State(ctx=ctx, n_tokens=0, ngram_history=history, layers=layers)


def state_nbytes(cfg: Qwen38Config, ctx: int) -> int:
    """Bytes :func:`new_state` allocates for ``ctx`` tokens."""
    return sum(4 * int(np.prod(shape)) for layer in range(cfg.num_layers) for shape in _layer_shapes(cfg, layer, ctx))
