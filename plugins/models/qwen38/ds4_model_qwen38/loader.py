"""Entry point of the qwen38 model family: ``load(gguf, weights, ops, options) -> Model``."""

from __future__ import annotations

from typing import Any

from ds4_core.backend import Ops, WeightLoader
from ds4_core.errors import ModelConfigError

from .config import Qwen38Config
from .model import NGRAM_TABLE, Qwen38Model
from .ngram import DEFAULT_CACHE_ROWS, NGramTable
from .opnames import GRAPH_OPS

#: Ops the graph calls (checked against the backend before any weight loads).
REQUIRED_OPS = GRAPH_OPS

#: Model options and their defaults. ``ngram_cache_rows``: decoded n-gram table rows kept in memory;
#: ``ngram_prefetch``: read n-gram rows on a background thread, overlapping the layers before each PLE layer.
OPTIONS: dict[str, Any] = {"ngram_cache_rows": DEFAULT_CACHE_ROWS, "ngram_prefetch": True}


def load(gguf: Any, weights: WeightLoader, ops: Ops, options: dict[str, Any]) -> Qwen38Model:
    """Build a :class:`Qwen38Model` from a GGUF file (``ds4_core.gguf.GGUFFile``) on the backend of ``ops``.

    The n-gram table is not loaded: only its location is taken, and rows are read from the file on demand.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ModelConfigError(f"unknown qwen38 model option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    prefetch = options.get("ngram_prefetch", OPTIONS["ngram_prefetch"])
    if not isinstance(prefetch, bool):
        raise ModelConfigError(f"qwen38 model option ngram_prefetch must be true or false, not {prefetch!r}")
    cfg = Qwen38Config.from_metadata(gguf.metadata)
    table = None
    if cfg.ple_layers:
        rows = max(o + s for o, s in zip(cfg.ple_head_offsets, cfg.ple_head_sizes, strict=True))
        info = gguf.require_tensor(NGRAM_TABLE, shape=(None, cfg.ple_row_dim))
        if info.shape[0] < rows:
            raise ModelConfigError(f"{NGRAM_TABLE} has {info.shape[0]} rows but the PLE hash reaches row {rows - 1}; "
                                   "re-convert the model")
        cache_rows = int(options.get("ngram_cache_rows", OPTIONS["ngram_cache_rows"]))
        table = NGramTable(gguf.path, info, cache_rows=cache_rows)
    return Qwen38Model(weights, ops, cfg, table, prefetch=prefetch)
