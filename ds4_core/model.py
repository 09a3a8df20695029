"""The model contract: what a model plugin's loader returns.

A loader ``load(gguf, weights, ops, options) -> Model`` (``options`` a dict of model options) reads hyperparameters
from the GGUF metadata, uploads weights through the :class:`~ds4_core.backend.WeightLoader`
and returns an object satisfying :class:`Model`. The engine never looks inside.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import attrs
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
        be raised before any state is written: ``Session.feed`` relies on it to stay atomic without a copy.

        A model whose ``forward`` also takes a keyword ``last_row`` gets ``last_row=True`` when only the last
        position's logits will be read (a prompt's chunks): it then returns ``[1, vocab]`` and may skip the output
        head for the other positions, which on a 129K vocabulary is a large matmul and a 1 GB array per 2048 tokens.
        """

    def state_nbytes(self, ctx: int) -> int:
        """Bytes of decoding state a context of ``ctx`` tokens needs."""


def copy_state(state: Any) -> Any:
    """A deep copy of a decoding state (works for numpy and cupy arrays)."""
    return copy.deepcopy(state)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__setitem__")


def _same_layout(dst: Any, src: Any) -> bool:
    """Whether every array of ``src`` has a counterpart in ``dst`` of the same type, shape and dtype."""
    if _is_array(src):
        return type(dst) is type(src) and dst.shape == src.shape and dst.dtype == src.dtype
    if attrs.has(type(src)):
        return type(dst) is type(src) and all(_same_layout(getattr(dst, f.name), getattr(src, f.name))
                                              for f in attrs.fields(type(src)))
    if isinstance(src, (list, tuple)):
        return type(dst) is type(src) and len(dst) == len(src) and all(map(_same_layout, dst, src))
    if isinstance(src, dict):
        return isinstance(dst, dict) and dst.keys() == src.keys() and all(_same_layout(dst[k], src[k]) for k in src)
    return not _is_array(dst)


def _assign(dst: Any, src: Any) -> Any:
    if _is_array(src):
        dst[...] = src
        return dst
    if attrs.has(type(src)):
        for f in attrs.fields(type(src)):
            setattr(dst, f.name, _assign(getattr(dst, f.name), getattr(src, f.name)))
        return dst
    if isinstance(src, list):
        dst[:] = [_assign(d, s) for d, s in zip(dst, src, strict=True)]
        return dst
    if isinstance(src, tuple):
        return tuple(_assign(d, s) for d, s in zip(dst, src, strict=True))
    if isinstance(src, dict):
        for k in src:
            dst[k] = _assign(dst[k], src[k])
        return dst
    return copy.deepcopy(src)


def restore_state_into(dst: Any, src: Any) -> bool:
    """Make ``dst`` equal to ``src`` by copying into ``dst``'s own arrays; False (``dst`` untouched) when their
    layouts differ or the state is not an attrs class (the form this can walk). Keeping the arrays keeps anything
    recorded on them, such as a decode graph, valid."""
    if not attrs.has(type(src)) or not _same_layout(dst, src):
        return False
    _assign(dst, src)
    return True
