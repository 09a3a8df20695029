"""One-token decode steps replayed as backend graphs (CUDA graphs on the CUDA backend).

Launching a decode step's hundreds of small kernels one by one costs more than the kernels themselves; a recorded
graph replays them for about a microsecond each. A model provides a *step*: a one-token forward whose token id and
position are read from device buffers and whose every shape is fixed by the context, not by the position. The step
is recorded once per state object (its buffers are baked into the graph), on the first token decoded into that
state; every later token only writes the two (one copy) and replays. A state restored from a snapshot is a new object
and gets its own recording. A model whose step can leave work out at some positions names, per position, the form
of the step it needs (a *variant*); each form is recorded apart, on the first token that needs it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import attrs
import numpy as np

from .backend import Backend

#: ``step(ids [1] int32, pos [1] int32, state) -> outputs``: one token at ``pos``, state updated in place (with a
#: variant, its form is a fourth argument).
Step = Callable[..., Any]


@attrs.define
class _Recording:
    inputs: Any  # int32 [2]: the token id, then the position; the step reads its two one-element views
    replay: Callable[[], Any] | None

    def step_args(self) -> tuple[Any, Any]:
        return self.inputs[0:1], self.inputs[1:2]


class DecodeGraphs:
    """Runs ``step`` for one token, replaying a recording of it per state (and variant) when the backend records
    graphs. ``variant(position)``, where given, is the form of the step that position needs, handed to ``step`` as
    its fourth argument."""

    def __init__(self, backend: Backend, step: Step, variant: Callable[[int], Hashable] | None = None):
        self.backend, self.step, self.variant = backend, step, variant
        # by id(state), then variant: states compare by value, so they are not hashable; a finalizer drops a dead
        # state's entries (and their graphs, whose buffers were the state's) before its id can be reused.
        self._recordings: dict[int, dict[Hashable, _Recording]] = {}
        # once a recording fails it fails for every state (same launches, same shapes): stop trying
        self._unrecordable = False

    def __call__(self, token: int, position: int, state: Any) -> Any:
        """The step's outputs for ``token`` at ``position``; they stay valid until the next call on ``state``."""
        form = () if self.variant is None else (self.variant(position),)
        recordings = self._recordings.get(id(state))
        if recordings is None:
            recordings = self._recordings[id(state)] = {}
            weakref.finalize(state, self._recordings.pop, id(state), None)
        rec = recordings.get(form)
        inputs = np.array([token, position], dtype=np.int32)
        if rec is None:
            rec = recordings[form] = _Recording(self.backend.asarray(inputs), None)
            if self._unrecordable:
                return self.step(*rec.step_args(), state, *form)
            outputs, rec.replay = self.backend.capture(lambda: self.step(*rec.step_args(), state, *form))
            self._unrecordable = rec.replay is None
            return outputs
        self.backend.write(rec.inputs, inputs)
        return rec.replay() if rec.replay is not None else self.step(*rec.step_args(), state, *form)

    def replays(self, state: Any) -> bool:
        """Whether decode steps into ``state`` replay a recorded graph."""
        return any(rec.replay is not None for rec in self._recordings.get(id(state), {}).values())
