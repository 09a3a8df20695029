"""``DecodeGraphs`` on the numpy backend (which records nothing): steps run eagerly, one entry per live state."""

from __future__ import annotations

import gc

import attrs
import numpy as np

from ds4_core.backends.numpy import NumpyBackend
from ds4_core.decode_graph import DecodeGraphs


@attrs.define
class _State:  # compares by value, like the model states, so it is not hashable
    seen: list[tuple[int, int]] = attrs.Factory(list)


def _step(ids, pos, state):
    state.seen.append((int(ids[0]), int(pos[0])))
    return ids * 10 + pos


def test_steps_run_with_the_given_token_and_position_and_entries_die_with_their_state():
    graphs = DecodeGraphs(NumpyBackend(), _step)
    a, b = _State(), _State()
    assert int(graphs(3, 0, a)[0]) == 30 and int(graphs(4, 1, a)[0]) == 41 and int(graphs(5, 0, b)[0]) == 50
    assert a.seen == [(3, 0), (4, 1)] and b.seen == [(5, 0)]
    assert not graphs.replays(a)  # numpy records no graph
    assert len(graphs._recordings) == 2
    del a
    gc.collect()
    assert len(graphs._recordings) == 1
    np.testing.assert_array_equal(graphs(6, 2, b), [62])


def test_each_variant_of_a_state_gets_its_own_entry_and_the_step_its_form():
    forms: list[str] = []

    def step(ids, pos, state, form):
        forms.append(form)
        return _step(ids, pos, state)

    graphs = DecodeGraphs(NumpyBackend(), step, variant=lambda position: "short" if position < 2 else "long")
    a, b = _State(), _State()
    outs = [int(graphs(t, p, a)[0]) for t, p in ((1, 0), (2, 1), (3, 2), (4, 3))] + [int(graphs(5, 0, b)[0])]
    assert outs == [10, 21, 32, 43, 50]
    assert forms == ["short", "short", "long", "long", "short"]
    assert a.seen == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert {id(a): {"short", "long"}, id(b): {"short"}} == {k: {f[0] for f in v} for k, v in graphs._recordings.items()}
    del a
    gc.collect()
    assert list(graphs._recordings) == [id(b)]


class _CountingBackend(NumpyBackend):
    """The numpy backend, counting recording attempts (it records nothing, like a step the device cannot record)."""

    calls = 0

    def capture(self, step):
        self.calls += 1
        return super().capture(step)


def test_after_a_failed_recording_later_states_are_not_recorded_again():
    backend = _CountingBackend()
    graphs = DecodeGraphs(backend, _step)
    states = [_State() for _ in range(3)]
    for state in states:
        graphs(1, 0, state)
        graphs(2, 1, state)
    assert backend.calls == 1
    assert all(s.seen == [(1, 0), (2, 1)] for s in states)


def test_branches_run_in_order_once_each_and_return_their_results_in_order():
    from ds4_core.backend import Ops

    ran: list[str] = []
    ops = Ops(NumpyBackend(), {})

    def branch(name: str, value: int):
        return lambda: ran.append(name) or value

    assert ops.concurrently(branch("a", 1), branch("b", 2), branch("c", 3)) == (1, 2, 3)
    assert ran == ["a", "b", "c"]
    assert ops.concurrently() == ()
