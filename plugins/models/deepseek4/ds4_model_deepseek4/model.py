"""The DeepSeek V4 graph on the op vocabulary: mHC residual streams, CSA/HCA attention with sinks, hash/bias MoE.

Ordered weights → compressor → attention → MoE → block → model. Attribute names follow the GGUF tensor
names (spec §12.3); shapes are numpy order (GGUF dims reversed). ``T`` is the chunk length, ``p0`` the
position of its first token. A chunk of any length gives the same result as feeding its tokens one by one:
every window-dependent quantity is computed from absolute positions and the state of spec §9.1.

:meth:`DeepSeekV4Model.decode_step` is the one-token form whose position lives only in a device array: every
shape is fixed by the context and every position-dependent choice is an array operation, so the backend can record
it once as a graph and replay it per token (``ds4_core.decode_graph``). Its one host choice is made at recording:
while a CSA layer has at most ``index_topk`` complete compressed rows, every one is visible and its indexer has
nothing to choose (spec §5.5), so that form of the step reads all of them and leaves the index queries and scores
out; the position picks the recording (:meth:`DeepSeekV4Model.all_visible`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ds4_core.backend import Ops, WeightLoader
from ds4_core.decode_graph import DecodeGraphs
from ds4_core.errors import ContextError

from .config import DeepSeekV4Config
from .state import CompressorState, DeepSeekV4State, LayerState, new_state, state_nbytes

# GGML types each kind of tensor may have.
NORM = ("F32",)
FLOAT = ("F32", "F16", "BF16")
MATMUL = (*FLOAT, "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K")
EXPERT = (*MATMUL, "IQ2_XXS", "MXFP4")

RowHook = Callable[[Any], Any]


def _small(w: WeightLoader, ops: Ops, name: str, shape: tuple[int, ...]) -> Any:
    """A small float tensor used in glue arithmetic, as a backend array."""
    return ops.backend.asarray(w.array(name, shape=shape), dtype=ops.xp.float32)


class Compressor:
    """Pools each complete window of ``m`` tokens into one ``d``-wide row (HCA), or — with ``overlap`` (CSA) — the
    previous window's ``Ca`` half and this window's ``Cb`` half (``2m`` slots), spec §5.3–5.4."""

    def __init__(self, w: WeightLoader, ops: Ops, prefix: str, cfg: DeepSeekV4Config, m: int, d: int, overlap: bool):
        width = 2 * d if overlap else d
        D = cfg.hidden_size
        self.m, self.d, self.overlap, self.eps = m, d, overlap, cfg.rms_norm_eps
        self.ape = _small(w, ops, f"{prefix}_ape.weight", (m, width))
        self.kv = w.get(f"{prefix}_kv.weight", (width, D), FLOAT)
        self.gate = w.get(f"{prefix}_gate.weight", (width, D), FLOAT)
        self.norm = w.get(f"{prefix}_norm.weight", (d,), NORM)

    def __call__(self, ops: Ops, x: Any, pos: Any, cs: CompressorState, p0: int, inv_freq: Any,
                 finish: RowHook | None) -> Any:
        """Feed ``x [T, D]`` at positions ``pos [T]``; emit the rows of the windows it completes into ``cs``.

        Returns every row emitted so far, ``[(p0 + T) // m, d]``; ``finish`` post-processes new rows (QAT).
        """
        xp, m, d = ops.xp, self.m, self.d
        T, b = x.shape[0], p0 % m  # b tokens of the open window are buffered
        kv, gate = fused(ops, "linears", compose_linears)(x, (self.kv, self.gate))
        gate = gate + self.ape[pos % m]
        kv = xp.concatenate([cs.buf_kv[:b], kv])
        gate = xp.concatenate([cs.buf_gate[:b], gate])
        n_win = (b + T) // m
        done = n_win * m
        rest = b + T - done
        cs.buf_kv[:rest] = kv[done:]
        cs.buf_gate[:rest] = gate[done:]
        first = p0 // m
        if n_win == 0:
            return cs.rows[:first]
        kv = kv[:done].reshape(n_win, m, -1)
        gate = gate[:done].reshape(n_win, m, -1)
        if self.overlap:  # slots: Ca of the previous window, then Cb of this one
            prev_kv = xp.concatenate([cs.prev_kv[None], kv[:-1, :, :d]])
            prev_gate = xp.concatenate([cs.prev_gate[None], gate[:-1, :, :d]])
            cs.prev_kv[...] = kv[-1, :, :d]
            cs.prev_gate[...] = gate[-1, :, :d]
            kv = xp.concatenate([prev_kv, kv[:, :, d:]], axis=1)
            gate = xp.concatenate([prev_gate, gate[:, :, d:]], axis=1)
        rows = ops.rms_norm(ops.softmax_pool(kv, gate), self.norm, self.eps)
        rows = ops.rope(rows, (first + xp.arange(n_win, dtype=xp.int32)) * m, inv_freq)
        if finish is not None:
            rows = finish(rows)
        cs.rows[first:first + n_win] = rows
        return cs.rows[:first + n_win]

    def step(self, ops: Ops, kv: Any, gate: Any, pos: Any, cs: CompressorState, inv_freq: Any,
             finish: RowHook | None) -> Any:
        """One token's projections ``kv``, ``gate [1, width]`` (by :attr:`kv` and :attr:`gate`) at the device position
        ``pos [1]``: buffer them in slot ``pos mod m`` and emit the window's row when this token completes it.
        Returns all ``ctx // m`` row slots; rows of windows not yet complete are stale, and callers mask them by
        position."""
        args = (kv, gate, self.ape, pos, cs.buf_kv, cs.buf_gate, cs.prev_kv, cs.prev_gate, cs.rows, self.norm,
                self.eps, inv_freq)
        if finish is None and ops.has("compress_step"):  # a backend's own launches for the whole step
            return ops.compress_step(*args)
        return compose_compress_step(ops, *args, finish)


def fused(ops: Ops, name: str, composition: Callable[..., Any]) -> Callable[..., Any]:
    """The backend's op ``name`` (one of ``FUSED_OPS``) where it has one, else ``composition`` over the core ops,
    the op's definition: a decode step's small ops cost launches more than bytes."""
    return getattr(ops, name) if ops.has(name) else functools.partial(composition, ops)


def compose_linears(ops: Ops, x: Any, weights: tuple[Any, ...]) -> tuple[Any, ...]:
    """Projections of one input from core ops, the definition of the op ``linears``: ``x [T, D]`` through each of
    ``weights`` (``[R_i, D]``) -> ``[T, R_i]`` each."""
    return tuple(ops.linear(x, w) for w in weights)


def compose_norm_linear(ops: Ops, x: Any, norm: Any, eps: float, w: Any) -> Any:
    """RMSNorm (weight ``norm``), then the projection ``w``, from core ops: the definition of the op
    ``norm_linear``."""
    return ops.linear(ops.rms_norm(x, norm, eps), w)


def compose_norm_rope(ops: Ops, x: Any, w: Any, eps: float, positions: Any, inv_freq: Any) -> Any:
    """RMSNorm (weight ``w`` or None), then RoPE at ``positions`` (one per token of ``x [T, ..., d]``), from core ops:
    the definition of the op ``norm_rope``."""
    return ops.rope(ops.rms_norm(x, w, eps), positions, inv_freq)


def compose_norm_rope_into(ops: Ops, x: Any, w: Any, eps: float, positions: Any, inv_freq: Any, out: Any,
                           rows: Any) -> None:
    """``norm_rope`` of ``x [T, d]`` written to the rows ``rows [T]`` of ``out``, from core ops: the definition of the
    op ``norm_rope_into`` (a decode step's raw row into its ring slot)."""
    out[rows] = fused(ops, "norm_rope", compose_norm_rope)(x, w, eps, positions, inv_freq)


def compose_norm_rope_attention(ops: Ops, q: Any, eps: float, kv: Any, idx: Any, sinks: Any, scale: float,
                                positions: Any, inv_freq: Any) -> Any:
    """The queries ``q [T, H, d]`` RMSNormed (no weight, eps ``eps``) and RoPE'd at ``positions``, sparse attention
    over the rows ``idx`` of ``kv``, then its output rotated back by the inverse RoPE (the keys' rotation, which the
    values carry), from core ops: the definition of the op ``norm_rope_attention``."""
    q = compose_norm_rope(ops, q, None, eps, positions, inv_freq)
    return ops.rope(ops.sparse_attention(q, kv, idx, sinks, scale), positions, inv_freq, inverse=True)


def window_rows(xp: Any, T: int, first: int, window: int) -> Any:
    """``[T, window]`` rows of the queries' sliding windows: query ``t`` reads rows ``first + t ..``, -1 where a row
    would be negative."""
    band = first + xp.arange(T)[:, None] + xp.arange(window)[None, :]
    return xp.where(band >= 0, band, -1)


def compose_norm_rope_window_attention(ops: Ops, q: Any, eps: float, kv: Any, first: int, window: int,
                                       comp_start: int, limit: Any, sinks: Any, scale: float, positions: Any,
                                       inv_freq: Any, out_a: Any, groups: int) -> Any:
    """A chunk's sparse attention whose rows have the prefill's shape, from core ops: the definition of the op
    ``norm_rope_window_attention``. The queries ``q [T, H, d]`` are RMSNormed (no weight, eps ``eps``) and RoPE'd at
    ``positions``; query ``t`` reads the rows ``first + t .. first + t + window - 1`` of ``kv`` that are not
    negative (its sliding window), then, with ``limit [T]``, the rows ``comp_start + w`` for ``w < limit[t]`` (the
    complete compressed rows, which follow the window's in ``kv``); the output is rotated back by the inverse RoPE
    at ``positions`` (the keys' rotation, which the values carry), and its heads go through the grouped projection
    ``out_a`` in ``groups`` groups -> ``[T, groups, rows]`` (a backend that knows the output's bound, the values'
    largest magnitude, converts it for that projection without a pass to find it)."""
    xp = ops.xp
    q = compose_norm_rope(ops, q, None, eps, positions, inv_freq)
    parts = [window_rows(xp, q.shape[0], first, window)]
    if limit is not None:
        w = xp.arange(kv.shape[0] - comp_start)[None, :]
        parts.append(xp.where(w < limit[:, None], w + comp_start, -1))
    o = ops.rope(ops.sparse_attention(q, kv, xp.concatenate(parts, axis=1), sinks, scale), positions, inv_freq,
                 inverse=True)
    return ops.grouped_linear(o.reshape(o.shape[0], groups, -1), out_a)


def compose_compress_step(ops: Ops, kv_row: Any, gate_row: Any, ape: Any, pos: Any, buf_kv: Any, buf_gate: Any,
                          prev_kv: Any, prev_gate: Any, rows: Any, norm: Any, eps: float, inv_freq: Any,
                          finish: RowHook | None = None) -> Any:
    """One token through a compressor from core ops, the definition of the op ``compress_step``: the token's
    projections ``kv_row``/``gate_row [1, width]`` go to slot ``pos mod m`` of ``buf_kv``/``buf_gate [m, width]``
    (the gate plus ``ape [m, width]``); the window is pooled (with ``prev_kv``/``prev_gate [m, d]``, the last
    window's first halves, when they are not None: CSA), normalised with ``norm``, RoPE'd at the window's first
    position (``finish`` post-processes it) and stored in ``rows [R, d]`` when the token completes the window; an
    overlapping compressor then keeps this window's first halves. Writes the arrays in place, returns ``rows``."""
    xp, m, d = ops.xp, buf_kv.shape[0], rows.shape[1]
    slot = pos % m
    buf_kv[slot] = kv_row
    buf_gate[slot] = gate_row + ape[slot]
    kv, gate = buf_kv, buf_gate
    if prev_kv is not None:
        kv = xp.concatenate([prev_kv, kv[:, d:]])
        gate = xp.concatenate([prev_gate, gate[:, d:]])
    complete = slot == m - 1
    if rows.shape[0]:  # pooled every step (no host branch); stored only when the window is complete
        row = ops.rms_norm(ops.softmax_pool(kv[None], gate[None]), norm, eps)
        window = xp.minimum(pos // m, rows.shape[0] - 1)
        row = ops.rope(row, window * m, inv_freq)
        if finish is not None:
            row = finish(row)
        rows[window] = xp.where(complete[:, None], row, rows[window])
    if prev_kv is not None:
        xp.copyto(prev_kv, buf_kv[:, :d], where=complete[:, None])
        xp.copyto(prev_gate, buf_gate[:, :d], where=complete[:, None])
    return rows


class Indexer:
    """Lightning indexer of a CSA layer: its own overlapping compressor (width ``ih``) and per-query head scores."""

    def __init__(self, w: WeightLoader, ops: Ops, blk: str, cfg: DeepSeekV4Config, m: int):
        self.nih, self.ih, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.attn_q_b = w.get(f"{blk}.indexer.attn_q_b.weight", (self.nih * self.ih, cfg.q_lora_rank), FLOAT)
        self.proj = w.get(f"{blk}.indexer.proj.weight", (self.nih, cfg.hidden_size), FLOAT)
        self.compressor = Compressor(w, ops, f"{blk}.indexer_compressor", cfg, m, self.ih, overlap=True)

    def queries(self, ops: Ops, qr: Any, pos: Any, inv_freq: Any, finish: RowHook | None) -> Any:
        """The index queries ``[T, nih, ih]`` of the normalised query latent ``qr [T, q_lora]``."""
        q = ops.rope(ops.linear(qr, self.attn_q_b).reshape(qr.shape[0], self.nih, self.ih), pos, inv_freq)
        return q if finish is None else finish(q)

    def select(self, ops: Ops, q: Any, head_w: Any, keys: Any, limit: Any, offset: int, prefix: Any = None) -> Any:
        """Top-k compressed rows per query plus ``offset``, ``[T, min(topk, R)]`` int32 (``-1`` = none), among rows
        ``w < limit[t]``; each row after ``prefix [P]`` when given (the window's rows of a step).

        ``q [T, nih, ih]`` the :meth:`queries`, ``head_w [T, nih]`` the attention input through :attr:`proj`,
        ``keys [R, ih]`` indexer rows.
        """
        # the head weights' scale nih^-1/2 rides on the scores' scale: one launch fewer
        scores = ops.indexer_scores(q, keys, head_w, (self.ih * self.nih) ** -0.5)
        return fused(ops, "index_select", compose_index_select)(scores, limit, self.topk, offset, prefix)


def compose_index_select(ops: Ops, scores: Any, limit: Any, k: int, offset: int, prefix: Any = None) -> Any:
    """The indexer's choice from core ops, the definition of the op ``index_select``: of the rows ``w < limit[t]``
    of ``scores [T, R]`` (the complete ones), the ``k`` best by score (ties to the lowest index, as ``topk``), plus
    ``offset``; ``-1`` where fewer than ``k`` rows are complete -> int32 ``[T, min(k, R)]``, or with ``prefix [P]``
    (int32) that row first in each: ``[T, P + min(k, R)]``."""
    xp = ops.xp
    complete = xp.arange(scores.shape[1], dtype=xp.int32)[None, :] < limit[:, None]
    sel = ops.topk(xp.where(complete, scores, -xp.inf), k)
    sel = xp.where(sel < limit[:, None], sel + offset, -1)  # Python ints keep sel's int32
    if prefix is None:
        return sel
    return xp.concatenate([xp.broadcast_to(prefix, (sel.shape[0], prefix.shape[0])), sel], axis=1)


class StepIndex:
    """The index arrays of a one-token step that every layer shares, made once per step instead of once per layer:
    the ring slot of the new raw row, the window's rows of a layer's keys (``LayerState.keys``), and per compression
    ratio the complete-window limit and, for layers without an indexer, the window's and every complete compressed
    row's rows of the keys: those of ``needs`` (``(m, n_rows)``, ``n_rows`` None for the limit alone), views of the
    buffer of one ``step_index`` op (a backend makes them in one launch). ``all_visible``: the step's position has
    at most ``index_topk`` complete rows of each CSA layer, so those layers read them all, as layers without an
    indexer do."""

    def __init__(self, ops: Ops, pos: Any, window: int, needs: Sequence[tuple[int, int | None]] = (),
                 all_visible: bool = False):
        self.W, self.all_visible = window, all_visible
        specs = tuple(dict.fromkeys((m, n or 0) for m, n in needs))
        buf = fused(ops, "step_index", compose_step_index)(pos, window, specs)
        self.slot, self.window = buf[0:1], buf[1:1 + window][None]
        self._limits: dict[int, Any] = {}
        self._dense: dict[tuple[int, int], Any] = {}
        at = 1 + window
        for m, n in specs:
            self._limits.setdefault(m, buf[at:at + 1])
            at += 1
            if n:
                self._dense[m, n] = buf[at:at + window + n][None]
                at += window + n

    def limit(self, m: int) -> Any:
        """``[1]``: compressed rows ``w < limit`` are complete (ratio ``m``)."""
        return self._limits[m]

    def dense(self, m: int, n_rows: int) -> Any:
        """``[1, W + n_rows]``: the rows of the keys a query reads when every complete one of the ``n_rows``
        compressed rows of ratio ``m`` is visible: the window's, then ``W + w`` for complete rows w (else -1); the
        window's alone for a context too short to hold a compressed row."""
        return self._dense[m, n_rows] if n_rows else self.window


def compose_step_index(ops: Ops, pos: Any, window: int, specs: tuple[tuple[int, int], ...]) -> Any:
    """A one-token step's index arrays from core array code, the definition of the op ``step_index``: int32 ``[1 + W
    + ...]``, the ring slot ``pos mod W``, the window's rows ``[W]`` (slot ``s`` where ``s <= pos``, else -1: after
    this step's write slot s holds position ``pos - (pos - s) mod W``), then for each ``(m, n)`` of ``specs`` the
    limit ``(pos + 1) // m`` and, where ``n > 0``, the window's rows again followed by ``W + w`` for ``w < n`` below
    the limit (else -1): ``[1 + (W + n if n else 0)]`` each."""
    xp = ops.xp
    pos = xp.asarray(pos, dtype=xp.int32).reshape(1)
    slots = xp.arange(window, dtype=xp.int32)
    rows = xp.where(slots <= pos, slots, -1).astype(xp.int32)
    parts = [pos % window, rows]
    for m, n in specs:
        limit = (pos + 1) // m
        parts.append(limit)
        if n:
            w = xp.arange(n, dtype=xp.int32)
            parts += [rows, xp.where(w < limit, window + w, -1).astype(xp.int32)]
    return xp.concatenate(parts).astype(xp.int32)


class Attention:
    """Shared-K=V multi-query attention over the raw window and (CSA/HCA) compressed rows, spec §5."""

    def __init__(self, w: WeightLoader, ops: Ops, layer: int, cfg: DeepSeekV4Config, qat: bool):
        blk, D, H, hd = f"blk.{layer}", cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.cfg, self.kind, self.m = cfg, cfg.layer_kind(layer), cfg.compress_ratios[layer]
        self.attn_q_a = w.get(f"{blk}.attn_q_a.weight", (cfg.q_lora_rank, D), MATMUL)
        self.attn_q_a_norm = w.get(f"{blk}.attn_q_a_norm.weight", (cfg.q_lora_rank,), NORM)
        self.attn_q_b = w.get(f"{blk}.attn_q_b.weight", (H * hd, cfg.q_lora_rank), MATMUL)
        self.attn_kv = w.get(f"{blk}.attn_kv.weight", (hd, D), MATMUL)
        self.attn_kv_a_norm = w.get(f"{blk}.attn_kv_a_norm.weight", (hd,), NORM)
        self.attn_sinks = w.get(f"{blk}.attn_sinks.weight", (H,), NORM)
        G = cfg.o_groups
        self.attn_output_a = w.get(f"{blk}.attn_output_a.weight", (G * cfg.o_lora_rank, H * hd // G), MATMUL)
        self.attn_output_b = w.get(f"{blk}.attn_output_b.weight", (D, cfg.o_groups * cfg.o_lora_rank), MATMUL)
        self.compressor = self.indexer = None
        if self.kind != "sliding":
            self.compressor = Compressor(w, ops, f"{blk}.attn_compressor", cfg, self.m, hd, self.kind == "csa")
        if self.kind == "csa":
            self.indexer = Indexer(w, ops, blk, cfg, self.m)
        freqs = cfg.main_inv_freq() if self.kind == "sliding" else cfg.compress_inv_freq()
        self.inv_freq = ops.backend.asarray(freqs)
        self.kv_finish: RowHook | None = (lambda r: ops.fp8_kv_round(r, cfg.rope_dim)) if qat else None
        self.index_finish: RowHook | None = ops.fp4_hadamard_round if qat else None

    def __call__(self, ops: Ops, x: Any, pos: Any, ls: LayerState, p0: int | None,
                 index: StepIndex | None = None) -> Any:
        """``x [T, D]`` (normalised collapsed stream) at positions ``pos [T]`` -> ``[T, D]``; advances ``ls``.

        ``p0 = None``: one token whose position is only on the device (:meth:`step`, with the step's ``index``)."""
        if p0 is None:
            return self.step(ops, x, pos, ls, index or StepIndex(ops, pos, self.cfg.sliding_window,
                                                                 self.index_needs(ls)))
        cfg, xp, T = self.cfg, ops.xp, x.shape[0]
        W = cfg.sliding_window
        q_low, q, kv = self._project(ops, x, pos)

        # Raw window: the last W-1 earlier rows from the ring, then the chunk; query i sees rows (i+n_prev-W, i+n_prev].
        n_prev = min(p0, W - 1)
        keys = [ls.raw[xp.arange(p0 - n_prev, p0) % W], kv]
        first = n_prev - W + 1
        keep = min(T, W)
        ls.raw[pos[T - keep:] % W] = kv[T - keep:]
        limit = None
        if self.compressor is not None:
            rows = self.compressor(ops, x, pos, ls.compressor, p0, self.inv_freq, self.kv_finish)
            limit = (pos + 1) // self.m  # rows w < limit[t] are complete for query t
            offset = n_prev + T  # compressed row w is row offset + w of the keys
            keys.append(rows)
            if self.indexer is not None:
                index_rows = self.indexer.compressor(ops, x, pos, ls.indexer, p0, self.inv_freq, self.index_finish)
                if rows.shape[0] > self.indexer.topk:  # the chosen rows: a list per query
                    iq = self.indexer.queries(ops, self._q_latent(ops, q_low), pos, self.inv_freq, self.index_finish)
                    sel = self.indexer.select(ops, iq, ops.linear(x, self.indexer.proj), index_rows, limit, offset)
                    idx = xp.concatenate([window_rows(xp, T, first, W), sel], axis=1)
                    return self._attend(ops, q, xp.concatenate(keys), idx, pos)
        # every complete compressed row is visible: the rows have the window's shape
        cfg = self.cfg
        low = fused(ops, "norm_rope_window_attention", compose_norm_rope_window_attention)(
            q, cfg.rms_norm_eps, xp.concatenate(keys), first, W, n_prev + T, limit, self.attn_sinks,
            cfg.head_dim ** -0.5, pos, self.inv_freq, self.attn_output_a, cfg.o_groups)
        return self._output_b(ops, low)

    def index_needs(self, ls: LayerState, all_visible: bool) -> list[tuple[int, int | None]]:
        """What a step of this layer reads of :class:`StepIndex` besides the slot and window: its ratio's limit and,
        without an indexer or while every complete row is visible (``all_visible``: the first ``index_topk`` at
        most), the dense rows of its compressed rows (its attention reads them all)."""
        return [] if self.compressor is None else [(self.m, self._dense_rows(ls, all_visible))]

    def _dense_rows(self, ls: LayerState, all_visible: bool) -> int | None:
        """How many compressed rows a step's attention reads in order (every one without an indexer, the first
        ``index_topk`` while all complete ones are visible), or None where the indexer chooses them."""
        n_rows = ls.compressor.rows.shape[0]
        if self.indexer is None:
            return n_rows
        return min(n_rows, self.indexer.topk) if all_visible else None

    def choice_from(self) -> float:
        """The first position whose step has more than ``index_topk`` complete rows of this layer, so that its
        indexer chooses: ``(pos + 1) // m > topk`` from ``pos = (topk + 1) m - 1``; infinite without an indexer."""
        return float("inf") if self.indexer is None else (self.indexer.topk + 1) * self.m - 1

    def step(self, ops: Ops, x: Any, pos: Any, ls: LayerState, index: StepIndex) -> Any:
        """One token ``x [1, D]`` at the device position ``pos [1]`` -> ``[1, D]``; advances ``ls``.

        Shapes depend only on the context: the query reads every ring slot that holds a position in its window
        and (CSA/HCA) the selected compressed rows, with the complete-window mask computed from ``pos``, all rows
        of the layer's one key buffer ``ls.keys`` (so nothing is gathered or concatenated but the indices). The
        compressors need only ``x``, so the backend may run them beside the queries and the raw row. While every
        complete row is visible (``index.all_visible``) a CSA layer reads them all and makes no index queries, head
        weights or scores; its indexer's compressor still takes the token."""
        if self.compressor is None:
            q, _ = self._step_queries(ops, x, pos, ls, index)
            return self._attend(ops, q, ls.raw, index.window, pos)
        (q, index_q), rows = ops.concurrently(lambda: self._step_queries(ops, x, pos, ls, index),
                                              lambda: self._step_compressed(ops, x, pos, ls, index.all_visible))
        dense = self._dense_rows(ls, index.all_visible)
        if dense is not None:
            parts = index.dense(self.m, dense)
        else:  # the window's rows, then the chosen ones
            parts = self.indexer.select(ops, index_q, rows[2], rows[1], index.limit(self.m), index.W, index.window[0])
        return self._attend(ops, q, ls.attention_keys(ops.xp), parts, pos)

    def _step_queries(self, ops: Ops, x: Any, pos: Any, ls: LayerState, index: StepIndex) -> tuple[Any, Any]:
        """A step's queries and (CSA, else None) index queries; its raw row goes into the ring. All three need the
        query latent or the raw row and nothing else, so they may run concurrently."""
        q_low, kv = self._latents(ops, x)

        def put_raw() -> None:
            if self.kv_finish is None:  # normalised and rotated straight into the ring slot
                fused(ops, "norm_rope_into", compose_norm_rope_into)(kv, self.attn_kv_a_norm, self.cfg.rms_norm_eps,
                                                                     pos, self.inv_freq, ls.raw, index.slot)
            else:
                ls.raw[index.slot] = self._kv_rows(ops, kv, pos)

        def index_queries() -> Any:
            return self.indexer.queries(ops, self._q_latent(ops, q_low), pos, self.inv_freq, self.index_finish)

        choosing = self.indexer is not None and not index.all_visible
        branches = [lambda: self._queries(ops, q_low), put_raw]  # longest first
        if choosing:
            branches.insert(1, index_queries)
        q, *rest = ops.concurrently(*branches)
        return q, rest[0] if choosing else None

    def _step_compressed(self, ops: Ops, x: Any, pos: Any, ls: LayerState, all_visible: bool) -> tuple[Any, ...]:
        """A step of the compressors -> ``(compressed rows,)`` (HCA) or ``(compressed rows, indexer rows, head
        weights [1, nih])`` (CSA; the head weights None while every complete row is visible)."""
        weights = (self.compressor.kv, self.compressor.gate)
        if self.indexer is not None:
            weights += (self.indexer.compressor.kv, self.indexer.compressor.gate)
            if not all_visible:
                weights += (self.indexer.proj,)
        proj = fused(ops, "linears", compose_linears)(x, weights)  # every projection the compressors and indexer need
        rows = self.compressor.step(ops, *proj[:2], pos, ls.compressor, self.inv_freq, self.kv_finish)  # into ls.keys
        if self.indexer is None:
            return (rows,)
        index_rows = self.indexer.compressor.step(ops, *proj[2:4], pos, ls.indexer, self.inv_freq, self.index_finish)
        return rows, index_rows, None if all_visible else proj[4]

    def _project(self, ops: Ops, x: Any, pos: Any) -> tuple[Any, Any, Any]:
        """(query latent before its norm ``[T, q_lora]``, queries ``[T, H, hd]`` before their norm and RoPE, the K=V
        rows ``[T, hd]``)."""
        q_low, kv = self._latents(ops, x)
        return q_low, self._queries(ops, q_low), self._kv_rows(ops, kv, pos)

    def _latents(self, ops: Ops, x: Any) -> tuple[Any, Any]:
        """(query latent ``[T, q_lora]``, the K=V rows ``[T, hd]``), both before their norms."""
        return fused(ops, "linears", compose_linears)(x, (self.attn_q_a, self.attn_kv))

    def _q_latent(self, ops: Ops, q_low: Any) -> Any:
        """The normalised query latent, which the indexer's queries read."""
        return ops.rms_norm(q_low, self.attn_q_a_norm, self.cfg.rms_norm_eps)

    def _queries(self, ops: Ops, q_low: Any) -> Any:
        """Queries ``[T, H, hd]`` of the query latent ``q_low`` (normalised on the way into ``attn_q_b``: a backend
        may fold the norm into that projection), before their own norm and RoPE, which the attention op applies."""
        cfg = self.cfg
        q = fused(ops, "norm_linear", compose_norm_linear)(q_low, self.attn_q_a_norm, cfg.rms_norm_eps,
                                                            self.attn_q_b)
        return q.reshape(q_low.shape[0], cfg.num_heads, cfg.head_dim)

    def _kv_rows(self, ops: Ops, kv: Any, pos: Any) -> Any:
        """The K=V rows ``[T, hd]``: normalised, RoPE'd and (QAT) rounded."""
        kv = fused(ops, "norm_rope", compose_norm_rope)(kv, self.attn_kv_a_norm, self.cfg.rms_norm_eps, pos,
                                                        self.inv_freq)
        return kv if self.kv_finish is None else self.kv_finish(kv)

    def _attend(self, ops: Ops, q: Any, keys: Any, idx: Any, pos: Any) -> Any:
        """The queries ``q [T, H, hd]`` normalised and RoPE'd, their sparse attention over the rows ``keys [N, hd]``
        at the indices ``idx [T, K]``, the inverse RoPE and the grouped output projection -> ``[T, D]``."""
        cfg = self.cfg
        o = fused(ops, "norm_rope_attention", compose_norm_rope_attention)(
            q, cfg.rms_norm_eps, keys, idx, self.attn_sinks, cfg.head_dim ** -0.5, pos, self.inv_freq)
        return self._output(ops, o)

    def _output(self, ops: Ops, o: Any) -> Any:
        """The grouped output projection of the attention's heads ``o [T, H, hd]`` -> ``[T, D]``."""
        return fused(ops, "output_projection", compose_output_projection)(o, self.attn_output_a, self.attn_output_b,
                                                                           self.cfg.o_groups)

    def _output_b(self, ops: Ops, low: Any) -> Any:
        """The grouped projection's ``low [T, G, rows]`` through ``attn_output_b`` -> ``[T, D]``."""
        return ops.linear(low.reshape(low.shape[0], -1), self.attn_output_b)


class MoE:
    """Routed SwiGLU experts (bias-corrected top-k, or a fixed token→experts table in hash layers) + a shared one."""

    def __init__(self, w: WeightLoader, ops: Ops, layer: int, cfg: DeepSeekV4Config):
        blk, D, E, F = f"blk.{layer}", cfg.hidden_size, cfg.n_experts, cfg.expert_ffn
        self.k, self.scale, self.limit = cfg.n_experts_used, cfg.routed_scaling_factor, cfg.swiglu_limits[layer]
        self.ffn_gate_inp = w.get(f"{blk}.ffn_gate_inp.weight", (E, D), FLOAT)
        self.exp_probs_b = self.ffn_gate_tid2eid = None
        if cfg.is_hash_layer(layer):
            table = w.array(f"{blk}.ffn_gate_tid2eid.weight", dtype=np.int32, shape=(cfg.vocab_size, self.k))
            self.ffn_gate_tid2eid = ops.backend.asarray(table)
        else:
            self.exp_probs_b = w.optional(f"{blk}.exp_probs_b.bias", (E,), NORM)
        self.ffn_gate_exps = w.get(f"{blk}.ffn_gate_exps.weight", (E, F, D), EXPERT)
        self.ffn_up_exps = w.get(f"{blk}.ffn_up_exps.weight", (E, F, D), EXPERT)
        self.ffn_down_exps = w.get(f"{blk}.ffn_down_exps.weight", (E, D, F), EXPERT)
        self.ffn_gate_shexp = w.get(f"{blk}.ffn_gate_shexp.weight", (F, D), MATMUL)
        self.ffn_up_shexp = w.get(f"{blk}.ffn_up_shexp.weight", (F, D), MATMUL)
        self.ffn_down_shexp = w.get(f"{blk}.ffn_down_shexp.weight", (D, F), MATMUL)

    def __call__(self, ops: Ops, x: Any, ids: Any) -> tuple[Any, Any]:
        """``x [T, D]``, token ids ``[T]`` -> (routed experts' output, shared expert's output), ``[T, D]`` each: the
        MoE's output is their sum, which the caller's ``hc_post_pre_norm`` takes in its expansion."""
        shared = fused(ops, "shared_expert", compose_shared_expert)
        return ops.concurrently(
            lambda: self._routed(ops, x, ids),
            lambda: shared(x, self.ffn_gate_shexp, self.ffn_up_shexp, self.ffn_down_shexp, self.limit))

    def _routed(self, ops: Ops, x: Any, ids: Any) -> Any:
        table = self.ffn_gate_tid2eid  # a hash layer's experts are its rows of the tokens: read by the router's launch
        idx, weights = fused(ops, "moe_gate_route", compose_moe_gate_route)(
            x, self.ffn_gate_inp, self.exp_probs_b, self.k, self.scale, table, None if table is None else ids)
        return ops.moe_experts(x, self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps, idx, weights,
                               self.limit)


def compose_output_projection(ops: Ops, o: Any, out_a: Any, out_b: Any, groups: int) -> Any:
    """The grouped output projection of the attention's heads ``o [T, H, hd]``: ``groups`` blocks of the
    block-diagonal ``out_a``, then ``out_b`` -> ``[T, D]``."""
    low = ops.grouped_linear(o.reshape(o.shape[0], groups, -1), out_a)
    return ops.linear(low.reshape(low.shape[0], -1), out_b)


def compose_moe_gate_route(ops: Ops, x: Any, gate: Any, bias: Any, k: int, scale: float, fixed: Any = None,
                           fixed_rows: Any = None) -> tuple[Any, Any]:
    """The router from core ops, the definition of the op ``moe_gate_route``: ``x [T, D]`` projected by ``gate
    [E, D]``, then ``moe_route`` -> (expert ids ``[T, k]``, weights ``[T, k]``). ``fixed``: the tokens' experts
    ``[T, k]``, or with ``fixed_rows [T]`` a table whose rows ``fixed_rows`` they are (a hash layer's, by token id)."""
    if fixed_rows is not None:
        fixed = fixed[fixed_rows]
    return ops.moe_route(ops.linear(x, gate), bias, k, scale, fixed)


def compose_shared_expert(ops: Ops, x: Any, gate: Any, up: Any, down: Any, limit: float) -> Any:
    """The shared expert from core ops, the definition of the op ``shared_expert``: ``x [T, D]`` through the SwiGLU
    of ``gate``, ``up [F, D]`` (clamped at ``limit`` when positive), then ``down [D, F]`` -> ``[T, D]``."""
    return ops.linear(ops.swiglu(ops.linear(x, gate), ops.linear(x, up), limit), down)


def compose_hc_pre_norm(ops: Ops, S: Any, fn: Any, scale: Any, base: Any, iters: int, eps: float, norm_eps: float,
                        norm: Any) -> tuple[Any, Any, Any]:
    """A sub-layer's input from core ops, the definition of the op ``hc_pre_norm``: ``hc_pre`` of the streams
    ``S [T, n, D]``, its collapsed row RMSNormed with weight ``norm`` (eps ``norm_eps``) -> (``[T, D]``, post,
    comb)."""
    c, post, comb = ops.hc_pre(S, fn, scale, base, iters, eps, norm_eps)
    return ops.rms_norm(c, norm, norm_eps), post, comb


def total(ys: tuple[Any, ...]) -> Any:
    """The sum of a sub-layer's outputs ``ys`` (the MoE's routed and shared experts, or attention's one), in order."""
    return functools.reduce(operator.add, ys)


def compose_hc_post_pre_norm(ops: Ops, S: Any, ys: tuple[Any, ...], post: Any, comb: Any, fn: Any, scale: Any,
                             base: Any, iters: int, eps: float, norm_eps: float,
                             norm: Any) -> tuple[Any, Any, Any, Any]:
    """One sub-layer's output into the streams and the next one's input, the definition of the op
    ``hc_post_pre_norm``: ``hc_post(S, total(ys), post, comb)`` (``ys`` the sub-layer's outputs ``[T, D]``, summed),
    then ``hc_pre_norm`` of those streams -> (streams, the normalised input ``[T, D]``, post, comb)."""
    S = ops.hc_post(S, total(ys), post, comb)
    return (S, *fused(ops, "hc_pre_norm", compose_hc_pre_norm)(S, fn, scale, base, iters, eps, norm_eps, norm))


def compose_hc_post_head_norm(ops: Ops, S: Any, ys: tuple[Any, ...], post: Any, comb: Any, fn: Any, scale: Any,
                              base: Any, eps: float, norm_eps: float, norm: Any) -> tuple[Any, Any]:
    """The last sub-layer's output into the streams and the model's normalised output, the definition of the op
    ``hc_post_head_norm``: ``hc_post(S, total(ys), post, comb)``, then ``hc_head`` of those streams and its RMSNorm
    with weight ``norm`` -> (streams, the normalised output ``[T, D]``)."""
    S = ops.hc_post(S, total(ys), post, comb)
    return S, ops.rms_norm(ops.hc_head(S, fn, scale, base, eps, norm_eps), norm, norm_eps)


class Block:
    """One decoder layer: hyper-connection around attention, then around the MoE (spec §3–4)."""

    def __init__(self, w: WeightLoader, ops: Ops, layer: int, cfg: DeepSeekV4Config, qat: bool):
        blk, n, D = f"blk.{layer}", cfg.hc_mult, cfg.hidden_size
        self.cfg = cfg
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", w.get(f"{blk}.hc_{sub}_fn.weight", ((2 + n) * n, n * D), FLOAT))
            setattr(self, f"hc_{sub}_scale", w.get(f"{blk}.hc_{sub}_scale.weight", (3,), NORM))
            setattr(self, f"hc_{sub}_base", w.get(f"{blk}.hc_{sub}_base.weight", ((2 + n) * n,), NORM))
        self.attn_norm = w.get(f"{blk}.attn_norm.weight", (D,), NORM)
        self.ffn_norm = w.get(f"{blk}.ffn_norm.weight", (D,), NORM)
        self.attn = Attention(w, ops, layer, cfg, qat)
        self.ffn = MoE(w, ops, layer, cfg)

    def __call__(self, ops: Ops, S: Any, ids: Any, pos: Any, ls: LayerState, p0: int | None,
                 index: StepIndex | None = None) -> Any:
        """Streams ``S [T, n, D]`` -> ``[T, n, D]`` (``p0 = None``: one token at the device position ``pos``, with
        the step's shared ``index``)."""
        S, (ys, post, comb) = self.layer(ops, S, None, ids, pos, ls, p0, index)
        return ops.hc_post(S, total(ys), post, comb)

    def layer(self, ops: Ops, S: Any, pending: tuple[Any, Any, Any] | None, ids: Any, pos: Any, ls: LayerState,
              p0: int | None, index: StepIndex | None = None) -> tuple[Any, tuple[Any, Any, Any]]:
        """The layer with its last ``hc_post`` left to the caller, so that it can go with the next layer's
        ``hc_pre_norm`` (``hc_post_pre_norm``, one op): ``pending`` is the previous layer's (MoE outputs, post, comb)
        still to add to ``S``, or None; returns the streams and this layer's pending triple."""
        cfg = self.cfg
        hc = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        post_pre = fused(ops, "hc_post_pre_norm", compose_hc_post_pre_norm)
        attn = (self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, *hc, self.attn_norm)
        if pending is None:
            x, post, comb = fused(ops, "hc_pre_norm", compose_hc_pre_norm)(S, *attn)
        else:
            S, x, post, comb = post_pre(S, *pending, *attn)
        S, x, post, comb = post_pre(S, (self.attn(ops, x, pos, ls, p0, index),), post, comb, self.hc_ffn_fn,
                                    self.hc_ffn_scale, self.hc_ffn_base, *hc, self.ffn_norm)
        return S, (self.ffn(ops, x, ids), post, comb)


class DeepSeekV4Model:
    """A loaded DeepSeek V4 model (satisfies :class:`ds4_core.model.Model`)."""

    family = "deepseek4"

    def __init__(self, w: WeightLoader, ops: Ops, cfg: DeepSeekV4Config, qat_rounding: bool = False):
        n, D, V = cfg.hc_mult, cfg.hidden_size, cfg.vocab_size
        self.cfg, self.ops, self.qat_rounding = cfg, ops, qat_rounding
        self.vocab_size, self.max_context = V, cfg.context_length
        self.token_embd = w.get("token_embd.weight", (V, D), MATMUL)
        self.blocks = [Block(w, ops, layer, cfg, qat_rounding) for layer in range(cfg.num_layers)]
        self.output_hc_fn = w.get("output_hc_fn.weight", (n, n * D), FLOAT)
        self.output_hc_scale = w.get("output_hc_scale.weight", (1,), NORM)
        self.output_hc_base = w.get("output_hc_base.weight", (n,), NORM)
        self.output_norm = w.get("output_norm.weight", (D,), NORM)
        self.output = w.get("output.weight", (V, D), MATMUL)
        from .mtp import load_mtp  # the MTP block is built from this module's Block

        #: The MTP (next-n) block when the file holds ``mtp.0.*`` tensors, else None (run by ``mtp.MtpDrafter``).
        self.mtp = load_mtp(w, ops, cfg, qat_rounding)
        #: The final streams ``[T, n, D]`` (before the HyperHead) of the last :meth:`forward`, which the MTP reads.
        self.last_stream: Any = None
        self._choice_from = min(block.attn.choice_from() for block in self.blocks)  # all_visible's bound
        #: One-token forwards as recorded graphs, on backends that record them (else None: plain forwards).
        self.decode_graphs = (DecodeGraphs(ops.backend, self.decode_step, variant=self.all_visible)
                              if ops.backend.graphs else None)

    def new_state(self, ctx: int) -> DeepSeekV4State:
        """Empty state for a context of ``ctx`` tokens."""
        return new_state(self.cfg, ctx, self.ops.xp)

    def state_nbytes(self, ctx: int) -> int:
        return state_nbytes(self.cfg, ctx)

    def forward(self, ids: Any, state: DeepSeekV4State, *, last_row: bool = False) -> Any:
        """Feed ids ``[T]`` (T ≥ 1) after the ``state.n_tokens`` tokens fed so far; return logits ``[T, V]`` (with
        ``last_row``, only the last position's ``[1, V]``: the head runs on that row alone)."""
        ops, xp = self.ops, self.ops.xp
        T, p0 = len(ids), state.n_tokens
        if T < 1:
            raise ContextError("forward needs at least one token")
        if p0 + T > state.ctx:
            raise ContextError(f"{p0 + T} tokens do not fit the context of {state.ctx}; start a new session "
                               "or load the model with a larger --ctx")
        if T == 1 and self.decode_graphs is not None:
            logits, self.last_stream = self.decode_graphs(int(ids[0]), p0, state)
            logits = logits.copy()  # the recorded buffer is overwritten by the next step
        else:
            logits, self.last_stream = self._run(ops.backend.asarray(ids, dtype=xp.int32),
                                                 xp.arange(p0, p0 + T, dtype=xp.int32), state, p0, last_row)
        state.n_tokens = p0 + T
        return logits

    def decode_step(self, ids: Any, pos: Any, state: DeepSeekV4State,
                    all_visible: bool = False) -> tuple[Any, Any]:
        """One token ``ids [1]`` at the position in the device array ``pos [1]`` -> (logits ``[1, V]``, final
        streams ``[1, n, D]``). Writes ``state``'s arrays but not ``state.n_tokens`` (the caller's job); takes no
        host decision on the position, so it can be recorded once and replayed. ``all_visible`` (only where
        :meth:`all_visible` holds for the position): the form whose CSA layers read every complete row unchosen."""
        return self._run(ids, pos, state, None, all_visible=all_visible)

    def all_visible(self, position: int) -> bool:
        """Whether a step at ``position`` sees every complete compressed row of every CSA layer (at most
        ``index_topk`` are complete: Flash's first 2051 positions), so that its indexers need not choose."""
        return position < self._choice_from

    def _index_needs(self, state: DeepSeekV4State, all_visible: bool) -> list[tuple[int, int | None]]:
        """:class:`StepIndex`'s needs of a step into ``state``: every layer's (:meth:`Attention.index_needs`)."""
        return [need for block, ls in zip(self.blocks, state.layers, strict=True)
                for need in block.attn.index_needs(ls, all_visible)]

    def _run(self, ids: Any, pos: Any, state: DeepSeekV4State, p0: int | None,
             last_row: bool = False, all_visible: bool = False) -> tuple[Any, Any]:
        ops, xp, cfg = self.ops, self.ops.xp, self.cfg
        x = ops.embed(self.token_embd, ids)
        S = xp.repeat(x[:, None, :], cfg.hc_mult, axis=1)
        index = (StepIndex(ops, pos, cfg.sliding_window, self._index_needs(state, all_visible), all_visible)
                 if p0 is None else None)
        pending = None
        for block, ls in zip(self.blocks, state.layers, strict=True):
            S, pending = block.layer(ops, S, pending, ids, pos, ls, p0, index)
        head = (self.output_hc_fn, self.output_hc_scale, self.output_hc_base, cfg.hc_eps, cfg.rms_norm_eps)
        if pending is not None and not last_row:  # every row's logits (a decode step): hc_post, head and norm as one op
            S, h = fused(ops, "hc_post_head_norm", compose_hc_post_head_norm)(S, *pending, *head, self.output_norm)
            return ops.linear(h, self.output), S
        if pending is not None:
            ys, post, comb = pending
            S = ops.hc_post(S, total(ys), post, comb)
        h = ops.hc_head(S[-1:] if last_row else S, *head)
        return ops.linear(ops.rms_norm(h, self.output_norm, cfg.rms_norm_eps), self.output), S

