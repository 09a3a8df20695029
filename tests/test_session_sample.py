"""Session.sample and feed(logits="none") on the tiny DeepSeek V4 model (numpy backend).

The numpy backend leaves sampling to the host, so Session.sample must be exactly ``sampler.sample(last_logits)``;
a backend that samples must get the row where it lives and never send it to the host during a decode loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ds4_core.backends.numpy import NumpyBackend
from ds4_core.engine import Engine
from ds4_core.errors import Ds4Error
from ds4_core.sampling import Sampler, SamplingParams, greedy

PARAMS = ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 20, "min_p": 0.05, "top_p": 0.9},
          {"temperature": 1.2, "top_k": 0, "min_p": 0.0, "top_p": 1.0})


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    from ds4_model_deepseek4.tiny import ensure_default_model

    return Engine.load(ensure_default_model(tmp_path_factory.mktemp("cache")), backend="numpy", ctx=128)


@pytest.mark.parametrize("params", PARAMS)
def test_sample_on_the_numpy_backend_is_the_host_sampler(engine, params):
    session = engine.new_session()
    session.feed([3, 4, 5, 6], logits="none")
    mine, reference = (engine.sampler(SamplingParams(seed=7, **params)) for _ in range(2))
    assert engine.backend.sample(session.last_logits, mine) is None  # the numpy backend leaves it to the host
    got = [session.sample(mine) for _ in range(8)]
    assert got == [reference.sample(session.last_logits) for _ in range(8)]


def test_sample_before_any_feed_says_what_to_do(engine):
    session = engine.new_session()
    assert not session.has_logits
    with pytest.raises(Ds4Error, match="feed tokens first"):
        session.sample(engine.sampler(SamplingParams()))


def test_feed_without_rows_keeps_the_same_last_logits(engine):
    ids = np.random.default_rng(5).integers(1, engine.model.vocab_size, 21)
    rows, none = engine.new_session(), engine.new_session()
    rows.prefill_chunk = none.prefill_chunk = 8  # three chunks
    last = rows.feed(ids, logits="last")  # both run the head on the last row only
    assert none.feed(ids, logits="none").shape == (0, engine.model.vocab_size)
    np.testing.assert_array_equal(none.last_logits, last[0])
    np.testing.assert_array_equal(none.feed([9], logits="none"), np.zeros((0, engine.model.vocab_size)))
    np.testing.assert_array_equal(none.last_logits, rows.feed([9])[0])
    assert none.tokens == rows.tokens


def test_a_refused_feed_keeps_the_row_sample_reads(engine):
    session = engine.new_session()
    session.feed([3, 4, 5], logits="none")
    before = session.last_logits.copy()
    with pytest.raises(Ds4Error, match="out of range"):
        session.feed([2, engine.model.vocab_size], logits="none")
    np.testing.assert_array_equal(session.last_logits, before)
    assert session.sample(Sampler(SamplingParams(temperature=0.0))) == greedy(before)


def test_restore_brings_back_the_row_sample_reads(engine):
    session = engine.new_session()
    session.feed([3, 4, 5], logits="none")
    snap = session.snapshot()
    want = greedy(session.last_logits)
    session.feed([7, 8], logits="none")
    session.restore(snap)
    assert session.sample(Sampler(SamplingParams(temperature=0.0))) == want
    np.testing.assert_array_equal(session.last_logits, snap.last_logits)


class _SamplingBackend(NumpyBackend):
    """A numpy backend that samples greedy rows itself and counts the arrays it sends to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.to_host = 0

    def to_numpy(self, a: Any) -> np.ndarray:
        self.to_host += 1
        return super().to_numpy(a)

    def sample(self, row: Any, sampler: Sampler) -> int | None:
        return greedy(row) if sampler.params.greedy else None


def test_generate_leaves_the_rows_with_a_backend_that_samples(engine):
    prompt, greedy_params = [3, 4, 5, 6, 7], SamplingParams(temperature=0.0)
    want = [g.id for g in engine.new_session().generate(prompt, max_tokens=12, sampling=greedy_params)]
    sampling = _SamplingBackend()
    engine.backend = sampling
    try:
        got = [g.id for g in engine.new_session().generate(prompt, max_tokens=12, sampling=greedy_params)]
    finally:
        engine.backend = engine.ops.backend
    assert got == want and len(got) > 1
    assert sampling.to_host == 0


def test_has_logits_follows_feeds_and_restores_without_a_host_copy(engine):
    counting = _SamplingBackend()
    engine.backend = counting
    try:
        session = engine.new_session()
        empty = session.snapshot()
        session.feed([3, 4], logits="none")
        assert session.has_logits and counting.to_host == 0  # known without bringing the row over
        fed = session.snapshot()
        session.restore(empty)
        assert not session.has_logits
        session.restore(fed)
        assert session.has_logits
    finally:
        engine.backend = engine.ops.backend
