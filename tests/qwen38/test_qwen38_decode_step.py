"""The one-token decode step whose position lives only in a device array (what the CUDA backend records once as a
graph and replays per token), run here on the numpy backend through the same ``DecodeGraphs`` path.

On numpy nothing is recorded (``Backend.capture`` runs the step and returns no replay), so every one-token forward
runs ``decode_step`` with its token and position in arrays, reading the whole preallocated cache under a position
mask and the n-gram rows staged in the state. Oracle: the same model's chunked forward fed one token at a time
(itself checked against transformers in ``test_qwen38_conformance.py``).
"""

from __future__ import annotations

import copy
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from ds4_model_qwen38.model import NGRAM_TABLE

from ds4_core.decode_graph import DecodeGraphs
from ds4_core.engine import Engine
from ds4_core.errors import GGUFFormatError

SHIPPED = Path(str(resources.files("ds4_model_qwen38").joinpath("data", "tiny-qwen38.gguf")))
# Configs a/b select 2 QSA blocks (of 2 and 3 tokens): 40 tokens pass that budget many times over; the step's cache
# of CTX rows holds more blocks than the budget, so it always takes the selection path.
CTX, LENGTH = 48, 40
EOS_AT = (3, 4, 17, 30)  # n-gram resets inside the feed
PREFILL = 21  # inside a QSA block of 2 and of 3, past the budget of both


@pytest.fixture(scope="module")
def engines(converted):
    loaded: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in loaded:
            pytest.importorskip("torch")
            loaded[name] = Engine.load(converted(name, "f32"), backend="numpy", ctx=CTX)
        return loaded[name]

    yield get
    for engine in loaded.values():
        engine.close()


def _ids(model, n: int = LENGTH, seed: int = 5) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(1, model.vocab_size, n)
    ids[[p for p in EOS_AT if p < n]] = model.cfg.ple_eos
    return ids


def _state_arrays(state) -> list:
    return [getattr(ls, f.name) for ls in state.layers for f in ls.__attrs_attrs__
            if getattr(ls, f.name) is not None] + [state.ngram_rows]


def _one_by_one(model, ids: np.ndarray, state, graphed: bool) -> np.ndarray:
    """Logits ``[len(ids), V]`` of ``ids`` fed one at a time, through the decode step when ``graphed``; every third
    token goes through ``forward_streams`` (what the MTP reads) and the output head."""
    model.decode_graphs = DecodeGraphs(model.ops.backend, model.decode_step) if graphed else None
    try:
        out = []
        for p, token in enumerate(ids):
            one = np.array([token], np.int32)
            out.append(model.head(model.forward_streams(one, state)) if p % 3 == 2 else model.forward(one, state))
        return np.concatenate(out)
    finally:
        model.decode_graphs = None


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["a", "b"])
def test_decode_step_equals_token_by_token_forward_at_every_position(name, engines):
    model = engines(name).model
    assert model.decode_graphs is None  # numpy records no graphs: plain forwards unless a test installs the step
    ids = _ids(model)
    eager_state, step_state = model.new_state(CTX), model.new_state(CTX)
    want = _one_by_one(model, ids, eager_state, graphed=False)
    got = _one_by_one(model, ids, step_state, graphed=True)
    _close(got, want)
    assert step_state.n_tokens == eager_state.n_tokens == LENGTH
    np.testing.assert_array_equal(step_state.ngram_history, eager_state.ngram_history)
    for a, b in zip(_state_arrays(step_state)[:-1], _state_arrays(eager_state)[:-1], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1))


@pytest.mark.parametrize("name", ["a", "b"])
def test_decode_step_continues_a_chunked_prefill_and_state_is_written_in_place(name, engines):
    model = engines(name).model
    ids = _ids(model)
    want = _one_by_one(model, ids, model.new_state(CTX), graphed=False)
    state = model.new_state(CTX)
    arrays = _state_arrays(state)
    model.forward(ids[:13], state)
    model.forward(ids[13:PREFILL], state)
    _close(_one_by_one(model, ids[PREFILL:PREFILL + 8], state, graphed=True), want[PREFILL:PREFILL + 8])
    model.forward(ids[PREFILL + 8:PREFILL + 13], state)  # a chunk between decode steps (a new user turn)
    _close(_one_by_one(model, ids[PREFILL + 13:], state, graphed=True), want[PREFILL + 13:])
    # a recorded step holds the addresses of the state's arrays: chunks and steps must write them, not replace them
    assert all(a is b for a, b in zip(arrays, _state_arrays(state), strict=True))


def test_snapshot_restore_with_decode_steps_replays_exactly(engines):
    engine = engines("a")
    ids = _ids(engine.model)
    engine.model.decode_graphs = DecodeGraphs(engine.model.ops.backend, engine.model.decode_step)
    try:
        session = engine.new_session()
        session.feed(ids[:PREFILL])
        snap = session.snapshot()
        first = np.concatenate([session.feed(ids[p:p + 1]) for p in range(PREFILL, LENGTH)])
        session.feed(ids[:3])  # wander off, then come back
        session.restore(snap)
        assert session.state is not snap.state
        again = np.concatenate([session.feed(ids[p:p + 1]) for p in range(PREFILL, LENGTH)])
        np.testing.assert_array_equal(first, again)
        np.testing.assert_array_equal(session.state.ngram_history, ids[LENGTH - 2:LENGTH])
    finally:
        engine.model.decode_graphs = None


def test_failed_ngram_read_before_a_decode_step_leaves_the_session_unchanged(converted, tmp_path):
    pytest.importorskip("torch")
    path = converted("a", "f32")
    truncated = tmp_path / "truncated.gguf"
    shutil.copyfile(path, truncated)
    engines = [Engine.load(p, backend="numpy", ctx=CTX) for p in (truncated, path)]
    try:
        broken = engines[0].model
        table = engines[0].gguf.tensors[NGRAM_TABLE]
        assert table.offset + table.nbytes == truncated.stat().st_size  # the table is the file's last tensor
        cut_row = broken.cfg.ple_head_offsets[-1] + broken.cfg.ple_head_sizes[-1] // 2  # last head loses half
        with open(truncated, "r+b") as f:
            f.truncate(table.offset + cut_row * (table.nbytes // table.shape[0]) + 3)
        broken.decode_graphs = DecodeGraphs(broken.ops.backend, broken.decode_step)

        def readable(history: np.ndarray, ids: list[int]) -> bool:  # the rows of the last of ids after history
            return max(r[-1].max() for r in broken.ngram_rows(history, np.array(ids))) < cut_row

        session, reference = engines[0].new_session(), engines[1].new_session()
        prefix: list[int] = []  # tokens whose every read succeeds
        for t in np.random.default_rng(2).integers(1, broken.vocab_size, 500).tolist():
            if len(prefix) < 12 and readable(session.state.ngram_history, [*prefix, t]):
                prefix.append(t)
        assert len(prefix) == 12
        np.testing.assert_array_equal(session.feed(prefix[:6]), reference.feed(prefix[:6]))
        steps = [session.feed(prefix[p:p + 1]) for p in range(6, len(prefix))]
        np.testing.assert_allclose(np.concatenate(steps), reference.feed(prefix[6:]), rtol=0,
                                   atol=1e-5 * np.abs(steps).max())
        bad = next(t for t in range(1, broken.vocab_size) if not readable(session.state.ngram_history, [t]))
        ok = next(t for t in range(1, broken.vocab_size) if readable(session.state.ngram_history, [t]))
        before, tokens, last = copy.deepcopy(session.state), list(session.tokens), session.last_logits.copy()
        with pytest.raises(GGUFFormatError, match="truncated"):
            session.feed([bad])
        assert session.state.n_tokens == before.n_tokens and session.tokens == tokens
        np.testing.assert_array_equal(session.state.ngram_history, before.ngram_history)
        for a, b in zip(_state_arrays(session.state)[:-1], _state_arrays(before)[:-1], strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(session.last_logits, last)
        got, want = session.feed([ok]), reference.feed([ok])  # usable: it goes on like the complete file
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    finally:
        for e in engines:
            e.close()


def test_mtp_drafts_from_decode_step_streams_like_from_a_chunked_forward():
    """The shipped (trained) tiny model: 16 QSA blocks of 4 tokens kept, so 80 tokens pass the budget; its MTP head
    drafts from the streams each one-token forward returns."""
    engine = Engine.load(SHIPPED, backend="numpy", ctx=96)
    try:
        model, length = engine.model, 80
        assert model.mtp is not None
        ids = _ids(model, length + 1, seed=9)
        whole = model.new_state(96)
        want_logits = model.forward(ids[:length], whole)
        want_streams = model.forward_streams(ids[:length], model.new_state(96))
        want_drafts, _ = model.mtp.draft(want_streams, ids[1:], model.mtp.new_state(96), 0)
        model.decode_graphs = DecodeGraphs(model.ops.backend, model.decode_step)
        state, mtp_state, got_logits, got_drafts = model.new_state(96), model.mtp.new_state(96), [], []
        for p in range(length):
            streams = model.forward_streams(ids[p:p + 1], state)
            got_logits.append(model.head(streams))
            got_drafts.append(model.mtp.draft(streams, ids[p + 1:p + 2], mtp_state, p)[0])
        _close(np.concatenate(got_logits), want_logits)
        _close(np.concatenate(got_drafts), want_drafts)
    finally:
        engine.model.decode_graphs = None
        engine.close()
