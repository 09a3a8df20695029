"""One-token decode steps replayed as backend graphs (CUDA graphs on the CUDA backend).

Launching a decode step's hundreds of small kernels one by one costs more than the kernels themselves; a recorded
graph replays them for about a microsecond each. A model provides a *step*: a one-token forward whose token id and
position are read from device buffers and whose every shape is fixed by the context, not by the position. The step
is recorded once per state object (its buffers are baked into the graph), on the first token decoded into that
state; every later token only writes the two (one copy) and replays. A state restored from a snapshot is a new object
and gets its own recording.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from .backend import Backend

#: ``step(ids [1] int32, pos [1] int32, state) -> outputs``: one token at ``pos``, state updated in place.
Step = Callable[[Any, Any, Any], Any]


@attrs.define
class _Recording:
    inputs: Any  # int32 [2]: the token id, then the position; the step reads its two one-element views
    replay: Callable[[], Any] | None

    def step_args(self) -> tuple[Any, Any]:
        return self.inputs[0:1], self.inputs[1:2]


class DecodeGraphs:
    """Runs ``step`` for one token, replaying a recording of it per state when the backend records graphs."""

    def __init__(self, backend: Backend, step: Step):
        self.backend, self.step = backend, step
        # by id(state): states compare by value, so they are not hashable; a finalizer drops a dead state's entry
        # (and its graph, whose buffers were the state's) before its id can be reused.
        self._recordings: dict[int, _Recording] = {}
        # once a recording fails it fails for every state (same launches, same shapes): stop trying
        self._unrecordable = False

    def __call__(self, token: int, position: int, state: Any) -> Any:
        """The step's outputs for ``token`` at ``position``; they stay valid until the next call on ``state``."""
        rec = self._recordings.get(id(state))
        inputs = np.array([token, position], dtype=np.int32)
        if rec is None:
            rec = _Recording(self.backend.asarray(inputs), None)
            if self._unrecordable:
                outputs = self.step(*rec.step_args(), state)
            else:
                outputs, rec.replay = self.backend.capture(lambda: self.step(*rec.step_args(), state))
                self._unrecordable = rec.replay is None
            self._recordings[id(state)] = rec
            weakref.finalize(state, self._recordings.pop, id(state), None)
            return outputs
        self.backend.write(rec.inputs, inputs)
        return rec.replay() if rec.replay is not None else self.step(*rec.step_args(), state)

    def replays(self, state: Any) -> bool:
        """Whether decode steps into ``state`` replay a recorded graph."""
        rec = self._recordings.get(id(state))
        return rec is not None and rec.replay is not None
