"""GLM 5.2 decoding state: chunked prefill equals token-by-token feeding, snapshot/restore is exact, and the
state's size and context limit are what the model reports."""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core.engine import Engine
from ds4_core.errors import ContextError


@pytest.fixture(scope="module")
def engine(converted):
    return Engine.load(converted("freq", "f32"), backend="numpy", ctx=64)


def _ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 320, n)


def test_one_chunk_equals_token_by_token(engine):
    ids = _ids(30)
    whole = np.asarray(engine.new_session().feed(ids))
    session = engine.new_session()
    steps = np.concatenate([np.asarray(session.feed(ids[i:i + 1])) for i in range(len(ids))])
    np.testing.assert_allclose(whole, steps, rtol=0, atol=2e-5 * np.abs(whole).max())


def test_snapshot_restore_replays_exactly(engine):
    session = engine.new_session()
    session.feed(_ids(20, 1))
    snap = session.snapshot()
    first = np.asarray(session.feed(_ids(9, 2)))
    session.feed(_ids(5, 3))  # move on, then go back
    session.restore(snap)
    assert session.state.n_tokens == 20
    again = np.asarray(session.feed(_ids(9, 2)))
    np.testing.assert_array_equal(first, again)


def test_state_size_and_layout(engine):
    model = engine.model
    state = model.new_state(64)
    full = [ls.index_keys is not None for ls in state.layers]
    assert full == [True, True, False, True, False, True]  # index_topk_freq 2, offset 2
    assert model.state_nbytes(64) == sum(a.nbytes for ls in state.layers for a in (ls.latent, ls.index_keys)
                                         if a is not None)


def test_context_overflow_is_refused(engine):
    state = engine.model.new_state(8)
    engine.model.forward(_ids(8), state)
    with pytest.raises(ContextError, match="larger --ctx"):
        engine.model.forward(_ids(1), state)
