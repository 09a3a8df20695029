"""Per-sequence decoding state of Qwen3.8 (spec §5), preallocated for a context of ``ctx`` tokens.

Delta-net layers carry a fixed-size state (conv history and the fp32 delta-rule memory); attention layers
carry their K/V and raw indexer keys per position; PLE layers carry the history of their dilated conv. The
last ``n − 1`` raw token ids (the n-gram context) are shared by every PLE layer. Every array is written in place,
never replaced: a decode step recorded as a graph keeps reading and writing the arrays it was recorded on.
"""

from __future__ import annotations

from collections.abc import Callable
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
    starts as end-of-sequence ids, kept on the host) and one layer state per layer.

    ``ngram_rows [PLE layers, 1, E]`` (``None`` without PLE layers) is where the n-gram rows of the next decoded
    token are copied before a decode step reads them: the disk read stays outside a recorded step."""

    ctx: int
    n_tokens: int
    ngram_history: np.ndarray
    layers: list[DeltaNetState | AttentionState]
    ngram_rows: Any = None


def _layer_arrays(cfg: Qwen38Config, layer: int, ctx: int) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, shape) of one layer's float32 arrays, in :class:`DeltaNetState` / :class:`AttentionState` field order."""
    if cfg.is_attention(layer):
        kv = (ctx, cfg.num_kv_heads, cfg.head_dim)
        return [("attention KV", kv), ("attention KV", kv), ("indexer keys", (ctx, cfg.index_dim))]
    arrays = [("delta-net conv history", (cfg.conv_kernel - 1, cfg.conv_dim)),
              ("delta-net state", (cfg.ssm_value_heads, cfg.ssm_key_dim, cfg.ssm_value_dim))]
    if layer in cfg.ple_layers:
        arrays.append(("n-gram (PLE) conv history",
                       ((cfg.ple_conv_kernel - 1) * cfg.ngram_size, cfg.hc_count * cfg.hidden_size)))
    return arrays


def new_state(cfg: Qwen38Config, ctx: int, xp: ModuleType) -> Qwen38State:
    """Empty state for ``ctx`` tokens, arrays allocated with ``xp`` (numpy or cupy)."""
    layers: list[DeltaNetState | AttentionState] = []
    for layer in range(cfg.num_layers):
        arrays = [xp.zeros(shape, dtype=xp.float32) for _, shape in _layer_arrays(cfg, layer, ctx)]
        layers.append(AttentionState(*arrays) if cfg.is_attention(layer) else DeltaNetState(*arrays))
    history = np.full(max(cfg.ngram_size - 1, 0), cfg.ple_eos, dtype=np.int64)
    rows = (xp.zeros((len(cfg.ple_layers), 1, cfg.ple_heads * cfg.ple_row_dim), dtype=xp.float32)
            if cfg.ple_layers else None)
    return Qwen38State(ctx=ctx, n_tokens=0, ngram_history=history, layers=layers, ngram_rows=rows)


def state_breakdown(cfg: Qwen38Config, ctx: int) -> dict[str, int]:
    """Bytes of the arrays :func:`new_state` allocates for ``ctx`` tokens, by kind (attention KV, indexer keys,
    delta-net state and conv history, n-gram conv history); the few n-gram token ids and the one token's n-gram rows
    staged for a decode step are left out."""
    sizes: dict[str, int] = {}
    for layer in range(cfg.num_layers):
        for kind, shape in _layer_arrays(cfg, layer, ctx):
            sizes[kind] = sizes.get(kind, 0) + 4 * int(np.prod(shape))
    return sizes


def rollback_point(state: Qwen38State, p0: int, n: int, layers: range, xp: ModuleType) -> Callable[[], None]:
    """A function that puts ``layers`` of ``state`` back as they are now, for a forward over positions ``p0..n−1``
    that fails after running some of them.

    Attention layers write only rows ``p0..n−1`` of their caches, so only those rows are copied; delta-net layers
    rewrite their fixed-size arrays, which are copied whole (``xp.array`` copies: numpy, CuPy and MLX alike).
    Restoring writes the copies back in place.
    """
    saved: list[tuple[Any, str, Any, slice]] = []
    for ls in (state.layers[i] for i in layers):
        rows = slice(p0, n) if isinstance(ls, AttentionState) else slice(None)
        for name, value in attrs.asdict(ls, recurse=False).items():
            if value is not None:
                saved.append((ls, name, xp.array(value[rows]), rows))

    def restore() -> None:
        for ls, name, value, rows in saved:
            getattr(ls, name)[rows] = value

    return restore


def state_nbytes(cfg: Qwen38Config, ctx: int) -> int:
    """Bytes of the arrays :func:`new_state` allocates for ``ctx`` tokens."""
    return sum(state_breakdown(cfg, ctx).values())
