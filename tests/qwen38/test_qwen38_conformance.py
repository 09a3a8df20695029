"""The numpy engine on converted tiny models reproduces transformers' cached, token-by-token logits.

Oracle: ``Qwen4ExpForCausalLM`` (transformers, eager, float32) fed one token per call with its cache. Our side:
the converted f32 GGUF on the numpy backend, fed in uneven chunks through ``Session.feed``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4_core.testing.conformance import (  # noqa: E402
    assert_logits_match,
    feed_in_chunks,
    transformers_cached_logits,
)

# Long enough for many more complete QSA blocks than the budget keeps; several end-of-sequence ids inside.
SEQUENCE_LENGTH = 48
EOS_POSITIONS = (4, 5, 19, 33)
CHUNKS = (1, 7, 3, 16, 2, 13, 5, 1)
RELATIVE_TOLERANCE = 1e-3


def prompt(model) -> np.ndarray:
    ids = np.random.default_rng(7).integers(1, model.config.vocab_size, SEQUENCE_LENGTH)
    ids[list(EOS_POSITIONS)] = model.config.eos_token_id
    return ids


@pytest.fixture(scope="module")
def engines(converted):
    from ds4_core.engine import Engine

    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = Engine.load(converted(name, "f32"), backend="numpy")
        return loaded[name]

    yield get
    for engine in loaded.values():
        engine.close()


@pytest.mark.parametrize("name", ["a", "b"])
def test_engine_matches_transformers_cached_decode(name, tiny_hf, engines):
    _, model = tiny_hf(name)
    ids = prompt(model)
    expected = transformers_cached_logits(model, ids)
    got = feed_in_chunks(engines(name).new_session(), ids, CHUNKS)
    assert_logits_match(got, expected, RELATIVE_TOLERANCE, name)


def test_block_selection_is_exercised(tiny_hf, engines):
    """Dense attention (a budget covering every block) gives clearly different logits: selection matters here."""
    engine = engines("a")
    ids = prompt(tiny_hf("a")[1])
    sparse = feed_in_chunks(engine.new_session(), ids, CHUNKS)
    for block in engine.model.blocks:
        if hasattr(block.mixer, "block_topk"):
            block.mixer.block_topk, saved = SEQUENCE_LENGTH, block.mixer.block_topk
    try:
        dense = feed_in_chunks(engine.new_session(), ids, CHUNKS)
    finally:
        for block in engine.model.blocks:
            if hasattr(block.mixer, "block_topk"):
                block.mixer.block_topk = saved
    assert np.abs(sparse - dense).max() > 1e-2 * np.abs(dense).max()


@pytest.mark.parametrize("name", ["a", "b"])
def test_chunked_equals_token_by_token(name, tiny_hf, engines):
    engine = engines(name)
    ids = prompt(tiny_hf(name)[1])
    whole = feed_in_chunks(engine.new_session(), ids, chunks=(SEQUENCE_LENGTH,))
    single = feed_in_chunks(engine.new_session(), ids, chunks=(1,))
    assert np.abs(whole - single).max() <= 1e-4 * np.abs(single).max()


def test_snapshot_restore_replays_exactly(tiny_hf, engines):
    engine = engines("a")
    ids = prompt(tiny_hf("a")[1])
    session = engine.new_session()
    session.feed(ids[:20])
    snap = session.snapshot()
    first = session.feed(ids[20:])
    session.feed(ids[:5])  # wander off, then come back
    session.restore(snap)
    np.testing.assert_array_equal(session.state.ngram_history, snap.state.ngram_history)
    again = session.feed(ids[20:])
    np.testing.assert_array_equal(first, again)
