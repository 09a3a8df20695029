"""The Qwen3.8 Flash Next graph: ``hc`` residual streams mixed by hyper-connection sites around every sub-block.

Streams start as copies of the token embedding; each layer optionally adds its PLE update, then a
hyper-connection site feeds the delta-net or gated attention, another one the MoE; the final mixer (no
norm) feeds the output head (spec §4.2–4.3).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4_core.backend import Ops, WeightLoader
from ds4_core.decode_graph import DecodeGraphs
from ds4_core.errors import ContextError

from .config import Qwen38Config
from .layers import FLOAT, MATMUL, NORM, GatedAttention, GatedDeltaNet, MoE, PerLayerEmbedding
from .ngram import NGramFetcher, NGramTable, ngram_row_ids, settle
from .state import Qwen38State, new_state, rollback_point, state_nbytes

NGRAM_TABLE = "per_layer_token_embd.weight"


class HyperConnection:
    """One mixer site: ``{prefix}_norm``, ``_down``, ``_up`` and (inside a layer) ``_inject``."""

    def __init__(self, w: WeightLoader, prefix: str, cfg: Qwen38Config, inject: bool):
        nD, R = cfg.hc_count * cfg.hidden_size, cfg.hc_rank
        self.eps = cfg.rms_norm_eps
        self.norm = w.get(f"{prefix}_norm.weight", (nD,), NORM)
        self.down = w.get(f"{prefix}_down.weight", (R, nD), FLOAT)
        self.up = w.get(f"{prefix}_up.weight", (nD, R), FLOAT)
        self.inject = w.get(f"{prefix}_inject.weight", (cfg.hc_count, nD), FLOAT) if inject else None

    def __call__(self, ops: Ops, H: Any) -> tuple[Any, Any]:
        """Streams ``H [T, n, D]`` -> (block input ``[T, D]``, injection weights ``[T, n]`` or ``None``)."""
        return ops.hc_mix(H, self.norm, self.down, self.up, self.inject, self.eps)


class Block:
    """One decoder layer: [PLE] → site → delta-net or attention → site → MoE."""

    def __init__(self, w: WeightLoader, ops: Ops, layer: int, cfg: Qwen38Config):
        blk = f"blk.{layer}"
        self.hc_attn = HyperConnection(w, f"{blk}.hc_attn", cfg, inject=True)
        self.hc_ffn = HyperConnection(w, f"{blk}.hc_ffn", cfg, inject=True)
        self.mixer: GatedAttention | GatedDeltaNet = (GatedAttention(w, blk, cfg, ops) if cfg.is_attention(layer)
                                                      else GatedDeltaNet(w, blk, cfg, ops))
        self.ple = PerLayerEmbedding(w, blk, cfg, ops) if layer in cfg.ple_layers else None
        self.ffn = MoE(w, blk, cfg)

    def __call__(self, ops: Ops, H: Any, pos: Any, ls: Any, p0: int | None, ngram: Any | None) -> Any:
        """Streams ``H [T, n, D]`` -> ``[T, n, D]``; ``ngram [T, E]`` are this layer's n-gram rows (PLE layers);
        ``p0 = None``: one token whose position is only in the device array ``pos``."""
        if self.ple is not None:
            H = H + self.ple(ops, H, ngram, ls)
        x, inject = self.hc_attn(ops, H)
        y = self.mixer(ops, x, pos, ls, p0) if isinstance(self.mixer, GatedAttention) else self.mixer(ops, x, ls)
        H = H + inject[:, :, None] * y[:, None, :]
        x, inject = self.hc_ffn(ops, H)
        return H + inject[:, :, None] * self.ffn(ops, x)[:, None, :]


class Qwen38Model:
    """A loaded Qwen3.8 model (satisfies :class:`ds4_core.model.Model`).

    ``ngram_table`` is the on-disk n-gram table (``None`` without PLE layers). Each forward queues the reads of
    its chunk's rows at its start; with ``prefetch`` they run on a background thread while the layers before each
    PLE layer compute, else inline before any layer runs. A failed read leaves the state as it was either way
    (with ``prefetch`` the layers already run are rolled back). :meth:`close` stops the reader thread. ``mtp`` is
    the MTP head (:class:`ds4_model_qwen38.mtp.Qwen38Mtp`) when the file has one, else ``None``.

    On backends that record graphs, one-token forwards run :meth:`decode_step` through ``decode_graphs``: the token's
    n-gram rows are read first (a failed read changes nothing) and copied into the state, then the recorded step
    replays.
    """

    family = "qwen38"

    def __init__(self, w: WeightLoader, ops: Ops, cfg: Qwen38Config, ngram_table: NGramTable | None,
                 prefetch: bool = True):
        D, V = cfg.hidden_size, cfg.vocab_size
        self.cfg, self.ops, self.ngram_table = cfg, ops, ngram_table
        self.ngram_fetcher = NGramFetcher(ngram_table, prefetch) if ngram_table is not None else None
        self.vocab_size, self.max_context = V, cfg.context_length
        self.token_embd = w.get("token_embd.weight", (V, D), MATMUL)
        self.blocks = [Block(w, ops, layer, cfg) for layer in range(cfg.num_layers)]
        self.output_hc = HyperConnection(w, "output_hc", cfg, inject=False)
        self.output = w.get("output.weight", (V, D), MATMUL)
        if cfg.nextn_layers:
            from .mtp import Qwen38Mtp

            self.mtp: Any = Qwen38Mtp(w, ops, cfg, self)
        else:
            self.mtp = None
        heads, n = cfg.ple_heads, cfg.ngram_size
        self._hash = [(np.array(cfg.ple_multipliers[i * n:(i + 1) * n], np.int64),
                       np.array(cfg.ple_head_sizes[i * heads:(i + 1) * heads], np.int64),
                       np.array(cfg.ple_head_offsets[i * heads:(i + 1) * heads], np.int64))
                      for i in range(len(cfg.ple_layers))]
        #: One-token forwards as recorded graphs, on backends that record them (else None: plain forwards).
        self.decode_graphs = DecodeGraphs(ops.backend, self.decode_step) if ops.backend.graphs else None

    def new_state(self, ctx: int) -> Qwen38State:
        """Empty state for a context of ``ctx`` tokens."""
        return new_state(self.cfg, ctx, self.ops.xp)

    def state_nbytes(self, ctx: int) -> int:
        return state_nbytes(self.cfg, ctx)

    def ngram_rows(self, history: np.ndarray, ids: np.ndarray) -> list[np.ndarray]:
        """Per PLE layer, the table rows ``[T, heads]`` (int64) of ``ids`` after ``history``."""
        cfg = self.cfg
        return [ngram_row_ids(history, ids, cfg.ple_eos, multipliers, sizes, offsets, cfg.heads_per_ngram)
                for multipliers, sizes, offsets in self._hash]

    def ngram_embeddings(self, history: np.ndarray, ids: np.ndarray) -> list[np.ndarray]:
        """Per PLE layer, the concatenated n-gram rows ``[T, E]`` of ``ids`` after ``history`` (reads the disk)."""
        return [self.ngram_table.lookup(rows).reshape(len(ids), -1) for rows in self.ngram_rows(history, ids)]

    def close(self) -> None:
        """Stop the n-gram reader thread and close the table's file (both come back on the next forward)."""
        if self.ngram_fetcher is not None:
            self.ngram_fetcher.close()

    def forward(self, ids: Any, state: Qwen38State, *, last_row: bool = False) -> Any:
        """Feed ids ``[T]`` (T ≥ 1) after the ``state.n_tokens`` tokens fed so far; return logits ``[T, V]`` (with
        ``last_row``, only the last position's ``[1, V]``: the head runs on that row alone)."""
        return self._feed(ids, state, with_logits=True, last_row=last_row)[0]

    def head(self, H: Any) -> Any:
        """Final mixer and output head: trunk streams ``H [T, n, D]`` -> logits ``[T, V]``."""
        h, _ = self.output_hc(self.ops, H)
        return self.ops.linear(h, self.output)

    def forward_streams(self, ids: Any, state: Qwen38State) -> Any:
        """Like :meth:`forward`, but return the streams after the last layer, before the final mixer ``[T, n, D]``
        (what the MTP head reads)."""
        return self._feed(ids, state, with_logits=False)[1]

    def stage_ngram_rows(self, ids: np.ndarray, state: Qwen38State) -> None:
        """Read the n-gram rows of one token ``ids [1]`` after ``state.ngram_history`` and copy them into
        ``state.ngram_rows``, where :meth:`decode_step` reads them. A failed read raises before anything changes."""
        if self._hash:
            rows = np.stack(self.ngram_embeddings(state.ngram_history, np.asarray(ids, dtype=np.int64)))
            state.ngram_rows[...] = self.ops.backend.asarray(rows)

    def decode_step(self, ids: Any, pos: Any, state: Qwen38State) -> tuple[Any, Any]:
        """One token ``ids [1]`` at the position in the device array ``pos [1]`` -> (logits ``[1, V]``, streams after
        the last layer ``[1, n, D]``). PLE layers read the rows :meth:`stage_ngram_rows` staged. Writes ``state``'s
        arrays in place but not ``n_tokens`` or the n-gram history (the caller's job); takes no host decision on the
        position, so it can be recorded once and replayed."""
        ops, xp, cfg = self.ops, self.ops.xp, self.cfg
        x = ops.embed(self.token_embd, ids)
        H = xp.repeat(x[:, None, :], cfg.hc_count, axis=1)
        staged = dict(zip(cfg.ple_layers, range(len(cfg.ple_layers)), strict=True))
        for layer, block in enumerate(self.blocks):
            ngram = state.ngram_rows[staged[layer]] if layer in staged else None
            H = block(ops, H, pos, state.layers[layer], None, ngram)
        return self.head(H), H

    def _feed(self, ids: Any, state: Qwen38State, with_logits: bool, last_row: bool = False) -> tuple[Any, Any]:
        """(logits ``[T, V]`` (``[1, V]`` with ``last_row``) or None without ``with_logits``, final streams
        ``[T, n, D]``) of ``ids [T]``."""
        T, p0 = len(ids), state.n_tokens
        if T < 1:
            raise ContextError("forward needs at least one token")
        if p0 + T > state.ctx:
            raise ContextError(f"{p0 + T} tokens do not fit the context of {state.ctx}; start a new session "
                               "or load the model with a larger --ctx")
        host_ids = np.asarray(ids, dtype=np.int64)
        if T == 1 and self.decode_graphs is not None:
            self.stage_ngram_rows(host_ids, state)
            logits, H = self.decode_graphs(int(host_ids[0]), p0, state)
            # the recorded buffers are overwritten by the next step
            logits, H = (logits.copy() if with_logits else None), H.copy()
        else:
            H = self._run(host_ids, state)
            logits = self.head(H[-1:] if last_row else H) if with_logits else None
        if state.ngram_history.size:
            state.ngram_history = np.concatenate([state.ngram_history, host_ids])[-state.ngram_history.size:]
        state.n_tokens = p0 + T
        return logits, H

    def _run(self, host_ids: np.ndarray, state: Qwen38State) -> Any:
        """The layers over a chunk ``host_ids [T]`` at positions ``state.n_tokens..`` -> final streams ``[T, n, D]``;
        n-gram rows of a chunk are read while the layers before each PLE layer run."""
        ops, xp, cfg = self.ops, self.ops.xp, self.cfg
        T, p0 = len(host_ids), state.n_tokens
        fetches = self.ngram_fetcher.fetch(self.ngram_rows(state.ngram_history, host_ids)) if self._hash else []
        pending = dict(zip(cfg.ple_layers, fetches, strict=True))
        undo = None
        try:
            if T == 1:  # a token's few rows are read before any layer runs: cheaper than copying the state for undo
                for fetch in fetches:
                    fetch.result()
            elif fetches:  # a read fails when its PLE layer takes the rows: the layers run by then are put back
                undo = rollback_point(state, p0, p0 + T, range(max(cfg.ple_layers, default=0)), xp)
            ids = ops.backend.asarray(host_ids, dtype=xp.int32)
            pos = xp.arange(p0, p0 + T, dtype=xp.int32)
            x = ops.embed(self.token_embd, ids)
            H = xp.repeat(x[:, None, :], cfg.hc_count, axis=1)
            for layer, block in enumerate(self.blocks):
                ngram = None
                if layer in pending:
                    try:
                        ngram = ops.backend.asarray(pending[layer].result().reshape(T, -1))
                    except BaseException:
                        if undo is not None:
                            undo()
                        raise
                H = block(ops, H, pos, state.layers[layer], p0, ngram)
        finally:
            settle(fetches)
        return H
