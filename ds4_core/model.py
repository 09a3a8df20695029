"""The model contract: what a model plugin's loader returns.

A loader ``load(gguf, weights, ops, options) -> Model`` (``options`` a dict of model options) reads hyperparameters
from the GGUF metadata, uploads weights through the :class:`~ds4_core.backend.WeightLoader`
and returns an object satisfying :class:`Model`. The engine never looks inside.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import numpy as np


class Model(Protocol):
    """A loaded model bound to one backend."""

    #: Family name (the ``ModelSpec.name`` it was registered under).
    family: str
    #: Rows of the logits.
    vocab_size: int
    #: Largest context the model supports.
    max_context: int

    def new_state(self, ctx: int) -> Any:
        """Empty per-layer decoding state for a context of ``ctx`` tokens."""

    def forward(self, ids: np.ndarray, state: Any) -> Any:
        """Feed ``ids`` (int32 ``[T]``) after the tokens already in ``state``; return logits ``[T, vocab]``
        as a backend array, and advance ``state`` in place. A :class:`Ds4Error` (bad input, a short read) must
        be raised before any state is written: ``Session.feed`` relies on it to stay atomic without a copy."""

    def state_nbytes(self, ctx: int) -> int:
        """Bytes of decoding state a context of ``ctx`` tokens needs."""


def copy_state(state: Any) -> Any:
    """A deep copy of a decoding state (works for numpy and cupy arrays)."""
    return copy.deepcopy(state)
