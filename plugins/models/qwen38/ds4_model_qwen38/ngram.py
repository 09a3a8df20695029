"""Hashed n-gram (PLE) embeddings whose table stays on disk (spec §4.4).

The released table is ~100 GB, so it is never mapped into the model: :class:`NGramTable` reads the rows a
chunk needs with explicit ``os.pread`` calls at the tensor's file offset, keeping a bounded LRU cache of
decoded rows. :func:`ngram_row_ids` is the hash (exact int64 arithmetic, end-of-sequence reset).
:class:`NGramFetcher` does the reads on one background thread, so the disk works while the layers before each
PLE layer compute.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from ds4_core.errors import GGUFFormatError
from ds4_core.gguf import TensorInfo
from ds4_core.quants import dequantize

#: Decoded rows kept in memory (16 heads per PLE layer per token: a few hundred tokens' worth).
DEFAULT_CACHE_ROWS = 4096


def shifted_history(tokens: np.ndarray, context: int, eos: int) -> np.ndarray:
    """Token ``p − s`` for each position ``p ≥ context`` of ``tokens`` and shift ``s = 0..context``: ``[T, context+1]``.

    A shifted token is replaced by ``eos`` when an ``eos`` lies in ``tokens[p−s .. p−1]``: n-grams never reach
    back across an end of sequence. ``tokens`` int64 ``[context + T]`` (the first ``context`` are history).
    """
    n = tokens.shape[0]
    index = np.arange(n)
    last_eos = np.maximum.accumulate(np.where(tokens == eos, index, -1))  # last eos at or before each index
    before = np.concatenate([[-1], last_eos[:-1]])  # last eos strictly before each index
    positions = index[context:]
    out = np.empty((positions.shape[0], context + 1), dtype=np.int64)
    for s in range(context + 1):
        source = positions - s
        out[:, s] = np.where(source > before[positions], tokens[source], eos)
    out[:, 0] = tokens[positions]
    return out


def ngram_row_ids(history: np.ndarray, ids: np.ndarray, eos: int, multipliers: np.ndarray, sizes: np.ndarray,
                  offsets: np.ndarray, heads_per_ngram: int) -> np.ndarray:
    """Table rows ``[T, heads]`` (int64) of one PLE layer for ``ids [T]`` after ``history [n − 1]``.

    For order ``o = 2..n`` the mixed id is ``XOR_{s<o} shifted_s · multipliers[s]``; each of the order's
    heads ``h`` takes row ``mixed mod sizes[h] + offsets[h]`` (heads of order 2 first).
    """
    n = multipliers.shape[0]
    tokens = np.concatenate([np.asarray(history, np.int64), np.asarray(ids, np.int64)])
    shifted = shifted_history(tokens, n - 1, eos) * np.asarray(multipliers, np.int64)  # < 2^63 by construction
    columns = []
    mixed = shifted[:, 0]
    for order in range(2, n + 1):
        mixed = np.bitwise_xor(mixed, shifted[:, order - 1])
        heads = slice((order - 2) * heads_per_ngram, (order - 1) * heads_per_ngram)
        columns.append(np.mod(mixed[:, None], sizes[heads]) + offsets[heads])
    return np.concatenate(columns, axis=1)


class NGramTable:
    """Rows of the on-disk n-gram table ``[rows, width]``, read on demand with ``os.pread``.

    A short or failed read raises :class:`GGUFFormatError` and caches nothing from the failing row.
    """

    def __init__(self, path: str | Path, info: TensorInfo, cache_rows: int = DEFAULT_CACHE_ROWS):
        self.path, self.info = Path(path), info
        self.rows, self.width = info.shape
        self.row_nbytes = info.nbytes // self.rows
        self.cache_rows = cache_rows
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._fd: int | None = None
        self._lock = threading.Lock()  # the cache and the lazily opened descriptor are shared with the fetcher

    def _file(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def _read(self, row: int) -> np.ndarray:
        offset = self.info.offset + row * self.row_nbytes
        try:
            raw = os.pread(self._file(), self.row_nbytes, offset)
        except OSError as exc:
            raise GGUFFormatError(f"{self.path}: cannot read n-gram table row {row} ({exc.strerror}); check that "
                                  "the model file is still readable") from None
        if len(raw) != self.row_nbytes:
            raise GGUFFormatError(f"{self.path}: the file is truncated: n-gram table row {row} needs bytes "
                                  f"{offset}..{offset + self.row_nbytes} but only {len(raw)} of them exist; "
                                  "re-download or re-convert the model")
        return dequantize(np.frombuffer(raw, dtype=np.uint8), self.info.qtype, (self.width,)).astype(np.float32)

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``[..., width]`` float32 of the int row ids ``rows [...]``."""
        flat = np.asarray(rows, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise GGUFFormatError(f"{self.path}: n-gram row {int(flat.max())} is outside the table of {self.rows} "
                                  "rows; the PLE metadata does not match the table — re-convert the model")
        out = np.empty((flat.size, self.width), dtype=np.float32)
        with self._lock:
            for i, row in enumerate(flat.tolist()):
                cached = self._cache.get(row)
                if cached is None:
                    cached = self._read(row)
                    self._cache[row] = cached
                    if len(self._cache) > self.cache_rows:
                        self._cache.popitem(last=False)
                else:
                    self._cache.move_to_end(row)
                out[i] = cached
        return out.reshape(*np.shape(rows), self.width)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __del__(self) -> None:
        self.close()


class NGramFetcher:
    """Looks up n-gram rows on one background reader thread (``background``) or inline on the caller's.

    :meth:`fetch` queues one lookup per PLE layer, in layer order, and returns at once; the forward takes each
    result just before its PLE layer, so the reads overlap the layers in front of it. Reads are the same
    :meth:`NGramTable.lookup` calls in the same order either way, so the rows are bit-identical.

    Memory: the caller waits for (or cancels) every lookup it queued before it returns (:func:`settle`), so at
    most one forward's lookups are ever queued: ``len(ple_layers)`` of them, whose results hold
    ``T · E · 4`` bytes each, the same rows the synchronous path holds. The table's LRU cache stays the only
    other memory. The thread starts on first use and stops in :meth:`close` (or when the fetcher is collected).
    """

    def __init__(self, table: NGramTable, background: bool = True):
        self.table, self.background = table, background
        self._executor: ThreadPoolExecutor | None = None

    def fetch(self, rows: list[np.ndarray]) -> list[Future[np.ndarray]]:
        """Futures of ``table.lookup(r)`` for each int row-id array ``r`` of ``rows``, resolved in list order.

        Inline, a failed read raises here, before the caller has changed anything.
        """
        if not self.background:
            done = []
            for r in rows:
                future: Future[np.ndarray] = Future()
                future.set_result(self.table.lookup(r))
                done.append(future)
            return done
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds4-qwen38-ngram")
        return [self._executor.submit(self.table.lookup, r) for r in rows]

    def close(self) -> None:
        """Stop the reader thread (waiting for a read in progress) and close the table's file."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self.table.close()


def settle(futures: list[Future[np.ndarray]]) -> None:
    """Cancel the lookups of ``futures`` that have not started and wait for the one that has: afterwards no read
    of this batch runs, so nothing outlives the forward that queued it."""
    for future in futures:
        future.cancel()
    wait(futures)
