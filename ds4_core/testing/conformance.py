"""Oracle conformance helpers: a reference model's cached token-by-token logits against the engine's.

For model-plugin tests: build a tiny Hugging Face model, convert it, then compare
:func:`transformers_cached_logits` with :func:`engine_chunked_logits` through :func:`assert_logits_match`.
torch is imported only when the reference runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: Uneven chunk sizes that cross every window, group and block boundary of the tiny test configs.
UNEVEN_CHUNKS: tuple[int, ...] = (1, 7, 3, 16, 2, 13, 5, 1, 11, 9, 4, 17)


def transformers_cached_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    """``[T, vocab]`` logits of a transformers ``model`` decoding ``ids`` one token per call with its cache."""
    import torch

    rows, past = [], None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: thread start-up costs several times the work
    try:
        with torch.no_grad():
            for token in ids:
                out = model(input_ids=torch.tensor([[int(token)]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                rows.append(out.logits[0, -1].float().numpy())
    finally:
        torch.set_num_threads(threads)
    return np.stack(rows)


def feed_in_chunks(session: Any, ids: np.ndarray, chunks: Sequence[int] = UNEVEN_CHUNKS) -> np.ndarray:
    """``[T, vocab]`` logits of ``session`` fed ``ids`` in pieces of the (cycled) ``chunks`` sizes."""
    parts, start, i = [], 0, 0
    while start < len(ids):
        stop = min(start + chunks[i % len(chunks)], len(ids))
        parts.append(np.asarray(session.feed(ids[start:stop]), dtype=np.float32))
        start, i = stop, i + 1
    return np.concatenate(parts)


def engine_chunked_logits(path: str | Path, ids: np.ndarray, chunks: Sequence[int] = UNEVEN_CHUNKS,
                          backend: str = "numpy") -> np.ndarray:
    """``[T, vocab]`` logits of a fresh engine session on ``path`` fed ``ids`` in uneven ``chunks``."""
    from ..engine import Engine

    engine = Engine.load(path, backend=backend)
    try:
        return feed_in_chunks(engine.new_session(), ids, chunks)
    finally:
        engine.close()


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """Largest absolute difference divided by the largest absolute expected logit."""
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def assert_logits_match(got: np.ndarray, expected: np.ndarray, tolerance: float = 1e-3, label: str = "") -> float:
    """Assert equal shapes and ``relative_error <= tolerance``; return the error (printed for the record)."""
    assert got.shape == expected.shape, f"{label}: shape {got.shape} != {expected.shape}"
    error = relative_error(got, expected)
    print(f"{label}: max |logit| {np.abs(expected).max():.3f}, max relative error {error:.2e}")
    worst = int(np.abs(got - expected).max(axis=1).argmax())
    assert error <= tolerance, f"{label}: relative error {error:.2e} > {tolerance:g}, worst position {worst}"
    return error


def built_once(tmp_path_factory: Any, build: Any, configs: dict[str, dict], *, prefix: str = "hf",
               seed_offset: int = 1) -> Any:
    """``get(name) -> (directory, model)``: ``build(directory, configs[name], seed=...)`` run once per name.

    For a session fixture over a family's tiny Hugging Face configs. A name's seed is its place in ``configs`` plus
    ``seed_offset``, so a model's weights do not depend on which test (or test worker) asked for it first.
    """
    built: dict[str, tuple[Path, Any]] = {}

    def get(name: str) -> tuple[Path, Any]:
        if name not in built:
            directory = tmp_path_factory.mktemp(f"{prefix}-{name}")
            built[name] = (directory, build(directory, configs[name], seed=list(configs).index(name) + seed_offset))
        return built[name]

    return get


def converted_once(tmp_path_factory: Any, source: Any, convert: Any, *, prefix: str = "gguf") -> Any:
    """``get(name, outtype) -> path``: ``convert(source(name)[0], path, outtype)`` run once per pair."""
    paths: dict[tuple[str, str], Path] = {}

    def get(name: str, outtype: str) -> Path:
        if (name, outtype) not in paths:
            out = tmp_path_factory.mktemp(f"{prefix}-{name}") / f"{name}-{outtype}.gguf"
            convert(source(name)[0], out, outtype)
            paths[name, outtype] = out
        return paths[name, outtype]

    return get
