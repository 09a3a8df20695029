"""Held-out scoring of the shipped tiny models (trained on Python's standard library, docs/tiny-models.md).

The corpus split is by file name, so any interpreter's standard library provides the held-out text.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ds4_core.scoring import cross_entropy

#: Held-out modules present in every supported Python version.
HELD_OUT_FILES: tuple[str, ...] = ("base64.py", "copy.py", "difflib.py", "gzip.py")


def is_held_out(relative_path: str) -> bool:
    """The corpus split rule: a file is held out when ``sha1(relative posix path) % 10 == 0``."""
    return int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % 10 == 0


def held_out_sources(names: Sequence[str] = HELD_OUT_FILES) -> dict[str, str] | None:
    """Source text of each held-out stdlib module, or ``None`` when this interpreter ships no sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = {name: root / name for name in names}
    if not all(p.is_file() for p in paths.values()):
        return None
    return {name: p.read_text(encoding="utf-8") for name, p in paths.items()}


def card_value(card: Path, label: str) -> float:
    """The number in a model card's table row whose first cell is ``label``."""
    match = re.search(rf"^\| {re.escape(label)} \| ([0-9.]+)", card.read_text(encoding="utf-8"), re.MULTILINE)
    if match is None:
        raise AssertionError(f"{card.name} has no table row {label!r}")
    return float(match.group(1))


def _openings(engine: Any, texts: Sequence[str], tokens: int, prefix_chars: int, bos: bool) -> list[list[int]]:
    """The first ``tokens`` token ids of each text (BOS first when ``bos``)."""
    tok = engine.tokenizer
    windows = []
    for text in texts:
        ids = (([tok.bos_id] if bos else []) + tok.encode(text[:prefix_chars]))[:tokens]
        if len(ids) != tokens:
            raise AssertionError(f"only {len(ids)} tokens in the first {prefix_chars} characters")
        windows.append(ids)
    return windows


def mtp_mean_loss(engine: Any, score: Callable[[np.ndarray], tuple[float, int]], texts: Sequence[str], *,
                  tokens: int, prefix_chars: int = 4000, bos: bool = True) -> float:
    """Mean MTP cross-entropy (token after next) over the first ``tokens`` tokens of each text; ``score(window)``
    is a family's drafter scoring: (summed nats, predicted tokens)."""
    total, count = 0.0, 0
    for ids in _openings(engine, texts, tokens, prefix_chars, bos):
        nats, n = score(np.asarray(ids))
        total, count = total + nats, count + n
    return total / count


def mean_loss(engine: Any, texts: Sequence[str], *, tokens: int, prefix_chars: int = 4000,
              bos: bool = True) -> float:
    """Mean next-token cross-entropy of the first ``tokens`` tokens of each text (BOS first when ``bos``),
    each scored in a fresh session."""
    losses = []
    for ids in _openings(engine, texts, tokens, prefix_chars, bos):
        losses.append(cross_entropy(engine.new_session().feed(ids)[:-1], ids[1:]))
    return float(np.concatenate(losses).mean())
