"""Scoring logits against the tokens that followed: the cross-entropy behind held-out losses and MTP draft losses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def cross_entropy(logits: np.ndarray, targets: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per-position cross-entropy (nats, float64 ``[n]``) of float ``logits [n, V]`` against ``targets [n]``."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -log_probs[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]
