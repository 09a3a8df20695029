"""One-token decode steps replayed as backend graphs (CUDA graphs on the CUDA backend).

Launching a decode step's hundreds of small kernels one by one costs more than the kernels themselves; a recorded
graph replays them for about a microsecond each. A model provides a *step*: a one-token forward whose token id and
position are read from device buffers and whose every shape is fixed by the context, not by the position. The step
is recorded once per state object (its buffers are baked into the graph), on the first token decoded into that
state; every later token only writes the two buffers and replays. A state restored from a snapshot is a new object
and gets its own recording.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import attrs

from .backend import Backend

#: ``step(ids [1] int32, pos [1] int32, state) -> outputs``: one token at ``pos``, state updated in place.
Step = Callable[[Any, Any, Any], Any]


@attrs.define
class _Recording:
    ids: Any
    pos: Any
    replay: Callable[[], Any] | None


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
        if rec is None:
            xp = self.backend.xp
            ids, pos = xp.full((1,), token, dtype=xp.int32), xp.full((1,), position, dtype=xp.int32)
            if self._unrecordable:
                outputs, replay = self.step(ids, pos, state), None
            else:
                outputs, replay = self.backend.capture(lambda: self.step(ids, pos, state))
                self._unrecordable = replay is None
            self._recordings[id(state)] = _Recording(ids, pos, replay)
            weakref.finalize(state, self._recordings.pop, id(state), None)
            return outputs
        rec.ids.fill(token)
        rec.pos.fill(position)
        return rec.replay() if rec.replay is not None else self.step(rec.ids, rec.pos, state)

    def replays(self, state: Any) -> bool:
        """Whether decode steps into ``state`` replay a recorded graph."""
        rec = self._recordings.get(id(state))
        return rec is not None and rec.replay is not None
