"""GLM 5.3 Flash's one-token decode step (position only in a device array, shapes fixed by the context) equals the
chunked forward, which the conformance tests hold to transformers: at every position from an empty state, after a
chunked prefill and before one, through ``forward``/``hidden`` when steps run as decode graphs, and across
snapshots."""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core.decode_graph import DecodeGraphs
from ds4_core.engine import Engine

# 31 tokens: not a multiple of the 2-, 4- and 8-token pools, so the last pool slot never completes; every test
# model has more pool slots (15, 7, 3) than its top-k budget (3, 2, 2 pools), so the step's indexer scores and
# selects, and the feeds cross the point where complete pools outnumber the budget (positions 11, 7, 23).
CTX = 31
PREFILL = 13  # inside an open pool of every test model, past the indexer's budget of the 2- and 4-token pools


def _tolerance(want: np.ndarray) -> float:
    return 1e-5 * float(np.abs(want).max())


@pytest.fixture(scope="module", params=["mixed", "shared", "kda_heavy"])
def engine(request, next_converted):
    loaded = Engine.load(next_converted(request.param, "f32"), backend="numpy", ctx=CTX)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def ids(engine) -> np.ndarray:
    return np.random.default_rng(31).integers(1, engine.model.vocab_size, CTX)


@pytest.fixture(scope="module")
def one_by_one(engine, ids) -> tuple[np.ndarray, np.ndarray]:
    """(logits ``[CTX, V]``, trunk final states ``[CTX, D]``) of the chunked forward fed one token at a time."""
    model = engine.model
    state = model.new_state(CTX)
    hidden = np.concatenate([model.hidden(ids[p:p + 1], state) for p in range(CTX)])
    return model.ops.linear(hidden, model.output), hidden


def _steps(model, ids: np.ndarray, positions: range, state) -> tuple[np.ndarray, np.ndarray]:
    out = [model.decode_step(ids[p:p + 1].astype(np.int32), np.array([p], np.int32), state) for p in positions]
    return np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])


def test_decode_step_equals_token_by_token_at_every_position(engine, ids, one_by_one):
    model, (want, want_hidden) = engine.model, one_by_one
    state = model.new_state(CTX)
    logits, hidden = _steps(model, ids, range(CTX), state)
    assert logits.shape == (CTX, model.vocab_size) and hidden.shape == (CTX, model.cfg.hidden_size)
    assert state.n_tokens == 0  # the step leaves the token count to its caller
    np.testing.assert_allclose(logits, want, atol=_tolerance(want))
    np.testing.assert_allclose(hidden, want_hidden, atol=_tolerance(want_hidden))


def test_decode_step_continues_a_chunked_prefill_and_a_chunk_continues_the_steps(engine, ids, one_by_one):
    model, want = engine.model, one_by_one[0]
    state = model.new_state(CTX)
    model.forward(ids[:PREFILL], state)
    stop = CTX - 6
    got, _ = _steps(model, ids, range(PREFILL, stop), state)
    state.n_tokens = stop
    tail = model.forward(ids[stop:], state)  # reads the open pool, pooled keys and KDA state the steps left
    np.testing.assert_allclose(np.concatenate([got, tail]), want[PREFILL:], atol=_tolerance(want))


def test_forward_and_hidden_through_decode_graphs_match_the_plain_path(engine, ids, one_by_one):
    """The numpy backend records nothing, so the graph path runs ``decode_step`` eagerly; the model's bookkeeping
    around it (token count, copies of the step's outputs, ``hidden`` for the MTP) is what is checked."""
    model, (want, want_hidden) = engine.model, one_by_one
    assert model.decode_graphs is None  # numpy records no graphs
    model.decode_graphs = DecodeGraphs(model.ops.backend, model.decode_step)
    try:
        state = model.new_state(CTX)
        logits = [model.forward(ids[:PREFILL], state)]
        hidden = []
        for p in range(PREFILL, CTX):
            step = model.forward if p % 2 else model.hidden
            (logits if p % 2 else hidden).append(step(ids[p:p + 1], state))
            assert state.n_tokens == p + 1
        assert not model.decode_graphs.replays(state)
    finally:
        model.decode_graphs = None
    odd = [p for p in range(PREFILL, CTX) if p % 2]
    even = [p for p in range(PREFILL, CTX) if not p % 2]
    np.testing.assert_allclose(np.concatenate(logits), want[[*range(PREFILL), *odd]], atol=_tolerance(want))
    np.testing.assert_allclose(np.concatenate(hidden), want_hidden[even], atol=_tolerance(want_hidden))
    assert logits[-1] is not logits[-2] and not np.shares_memory(logits[-1], logits[-2])


def test_snapshot_restore_is_exact_with_decode_graph_steps(engine, ids):
    model = engine.model
    model.decode_graphs = DecodeGraphs(model.ops.backend, model.decode_step)
    try:
        session = engine.new_session()
        session.feed(ids[:PREFILL])
        snap = session.snapshot()
        first = np.concatenate([session.feed(ids[p:p + 1]) for p in range(PREFILL, CTX)])
        session.restore(snap)  # a new state object: its own recording
        again = np.concatenate([session.feed(ids[p:p + 1]) for p in range(PREFILL, CTX)])
    finally:
        model.decode_graphs = None
    np.testing.assert_array_equal(again, first)
