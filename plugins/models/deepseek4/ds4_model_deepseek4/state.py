"""Per-layer decoding state of DeepSeek V4 (spec §9.1), preallocated for a context of ``ctx`` tokens.

Nothing but these arrays and the token count is carried between calls: the raw K=V window
ring, and per compressor (main and indexer) the open window's projections, the previous
window's ``Ca`` half (CSA) and the emitted compressed rows. A layer's raw ring and its attention
compressor's rows are two views of one buffer, so a decode step attends over them without a copy.
"""

from __future__ import annotations

import copy
import functools
from types import ModuleType
from typing import Any

import attrs

from .config import DeepSeekV4Config


@attrs.define
class CompressorState:
    """One compressor's state; ``m`` = ratio, ``d`` = emitted row width, ``coff`` = 2 for CSA (overlap), else 1.

    ``buf_kv``/``buf_gate`` ``[m, coff·d]``: projections (gate with ape) of the open window's tokens, slot =
    position mod m. ``prev_kv``/``prev_gate`` ``[m, d]`` (CSA only): the ``Ca`` half of the last complete
    window; the gate starts at ``-inf`` so window 0 pools its ``Cb`` slots alone. ``rows [ctx // m, d]``:
    emitted rows, row w pooled from window w and RoPE'd at position ``w·m`` (an attention compressor's are a view
    of its layer's :attr:`LayerState.keys`).
    """

    m: int
    buf_kv: Any
    buf_gate: Any
    prev_kv: Any | None
    prev_gate: Any | None
    rows: Any

    @classmethod
    def empty(cls, xp: ModuleType, m: int, d: int, overlap: bool, ctx: int, rows: Any = None) -> CompressorState:
        """Zeroed state; ``rows`` (``[ctx // m, d]``, zeros) is allocated unless given (a view of a layer's keys)."""
        coff = 2 if overlap else 1
        prev_kv = xp.zeros((m, d), dtype=xp.float32) if overlap else None
        prev_gate = xp.full((m, d), -xp.inf, dtype=xp.float32) if overlap else None
        return cls(m=m, buf_kv=xp.zeros((m, coff * d), dtype=xp.float32),
                   buf_gate=xp.zeros((m, coff * d), dtype=xp.float32), prev_kv=prev_kv, prev_gate=prev_gate,
                   rows=xp.zeros((ctx // m, d), dtype=xp.float32) if rows is None else rows)

    @staticmethod
    def frontier_nbytes(m: int, d: int, overlap: bool) -> int:
        """Bytes of the open window's buffers and (CSA) the previous window's half: the same for every context."""
        coff = 2 if overlap else 1
        return 4 * (2 * m * coff * d + (2 * m * d if overlap else 0))

    @staticmethod
    def rows_nbytes(m: int, d: int, ctx: int) -> int:
        """Bytes of the emitted rows for ``ctx`` tokens."""
        return 4 * (ctx // m) * d


@functools.cache
def slices_alias(xp: ModuleType) -> bool:
    """Whether a write into a slice of an ``xp`` array writes the array (numpy, CuPy; not MLX, whose slices are
    copies)."""
    whole = xp.zeros(2, dtype=xp.float32)
    part = whole[1:]
    part[0] = 1
    return bool(whole[1] == 1)


@attrs.define
class LayerState:
    """``keys [W + R, hd]``: every K=V row attention reads, one buffer. ``raw = keys[:W]``: the rows of the last W
    positions, position p in slot p mod W; ``compressor.rows = keys[W:]``: the ``R = ctx // m`` compressed rows
    (none in a sliding layer). Attention indexes ``keys`` directly: compressed row w is row ``W + w``. Where slices
    of the array module are copies (:func:`slices_alias`), ``keys`` is None and ``raw`` and ``rows`` are arrays of
    their own, whose concatenation the rows are indexed in."""

    keys: Any
    raw: Any
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    @classmethod
    def empty(cls, xp: ModuleType, window: int, hd: int, compressor: tuple[int, bool] | None, ctx: int) -> LayerState:
        """Zeroed state of a layer with a ``window``-row ring and, if ``compressor = (m, overlap)`` is given, that
        compressor's rows (``hd`` wide) after it in the one key buffer."""
        n_rows = 0 if compressor is None else ctx // compressor[0]
        keys = xp.zeros((window + n_rows, hd), dtype=xp.float32) if slices_alias(xp) else None
        state = cls(keys=keys, raw=xp.zeros((window, hd), dtype=xp.float32) if keys is None else keys[:window])
        if compressor is not None:
            m, overlap = compressor
            rows = None if keys is None else keys[window:]
            state.compressor = CompressorState.empty(xp, m, hd, overlap, ctx, rows=rows)
        return state

    def attention_keys(self, xp: ModuleType) -> Any:
        """``[W + R, hd]``: the raw ring, then the compressed rows (a concatenation where ``keys`` is None)."""
        if self.keys is not None:
            return self.keys
        return self.raw if self.compressor is None else xp.concatenate([self.raw, self.compressor.rows])

    def __deepcopy__(self, memo: dict) -> LayerState:
        """A copy whose ``raw`` and ``compressor.rows`` are views of its own ``keys`` again (a plain deep copy would
        copy each view on its own)."""
        keys = copy.deepcopy(self.keys, memo)
        if keys is None:
            return LayerState(None, *(copy.deepcopy(part, memo) for part in (self.raw, self.compressor, self.indexer)))
        W = self.raw.shape[0]
        memo[id(self.raw)] = keys[:W]
        if self.compressor is not None:
            memo[id(self.compressor.rows)] = keys[W:]
        return LayerState(keys, memo[id(self.raw)], copy.deepcopy(self.compressor, memo),
                          copy.deepcopy(self.indexer, memo))


@attrs.define
class DeepSeekV4State:
    """The whole decoding state: ``n_tokens`` fed so far (the next position) and one :class:`LayerState` per layer."""

    ctx: int
    n_tokens: int
    layers: list[LayerState]


def new_state(config: DeepSeekV4Config, ctx: int, xp: ModuleType) -> DeepSeekV4State:
    """Empty state for ``ctx`` tokens, arrays allocated with ``xp`` (numpy or cupy)."""
    layers = []
    for layer in range(config.num_layers):
        kind, m = config.layer_kind(layer), config.compress_ratios[layer]
        state = LayerState.empty(xp, config.sliding_window, config.head_dim,
                                 None if kind == "sliding" else (m, kind == "csa"), ctx)
        if kind == "csa":
            state.indexer = CompressorState.empty(xp, m, config.index_head_dim, True, ctx)
        layers.append(state)
    return DeepSeekV4State(ctx=ctx, n_tokens=0, layers=layers)


def state_breakdown(config: DeepSeekV4Config, ctx: int) -> dict[str, int]:
    """Bytes :func:`new_state` allocates for ``ctx`` tokens, by kind: the raw sliding-window ring, the compressed KV
    rows of CSA and of HCA layers, the indexer keys and the compressors' frontier (open and previous windows); kinds
    whose layers the model lacks are left out."""
    raw, csa, hca, index_keys, frontier = "raw window KV ring", "CSA compressed KV rows", "HCA compressed KV rows", \
        "indexer keys", "compressor frontier"
    sizes = dict.fromkeys((raw, csa, hca, index_keys, frontier), 0)
    kinds = {config.layer_kind(layer) for layer in range(config.num_layers)}
    for layer in range(config.num_layers):
        kind, m = config.layer_kind(layer), config.compress_ratios[layer]
        sizes[raw] += 4 * config.sliding_window * config.head_dim
        if kind != "sliding":
            sizes[csa if kind == "csa" else hca] += CompressorState.rows_nbytes(m, config.head_dim, ctx)
            sizes[frontier] += CompressorState.frontier_nbytes(m, config.head_dim, kind == "csa")
        if kind == "csa":
            sizes[index_keys] += CompressorState.rows_nbytes(m, config.index_head_dim, ctx)
            sizes[frontier] += CompressorState.frontier_nbytes(m, config.index_head_dim, True)
    absent = {csa: "csa" not in kinds, index_keys: "csa" not in kinds, hca: "hca" not in kinds,
              frontier: kinds == {"sliding"}}
    return {kind: n for kind, n in sizes.items() if not absent.get(kind, False)}


def state_nbytes(config: DeepSeekV4Config, ctx: int) -> int:
    """Bytes :func:`new_state` allocates for ``ctx`` tokens."""
    return sum(state_breakdown(config, ctx).values())
