"""Session.feed is atomic: a feed that fails leaves the session exactly as before the call, and usable.

Failures are real: a Qwen3.8 n-gram table truncated on disk (read per chunk, so the failure comes in a later chunk),
and Ctrl-C (SIGINT) delivered inside the DeepSeek V4 graph after some layers have written their state. The oracle
for "usable" is a fresh session on an intact engine given the same tokens: its logits must be bit-identical.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import ds4_model_deepseek4
import ds4_model_qwen38
import numpy as np
import pytest
from ds4_model_qwen38.model import NGRAM_TABLE
from ds4_model_qwen38.ngram import ngram_row_ids

from ds4_core.backend import DEFAULT_PREFILL_CHUNK
from ds4_core.engine import Engine, Session
from ds4_core.errors import Ds4Error, GGUFFormatError
from ds4_core.model import copy_state

QWEN_GGUF = Path(ds4_model_qwen38.__file__).parent / "data" / "tiny-qwen38.gguf"
DEEPSEEK_GGUF = Path(ds4_model_deepseek4.__file__).parent / "data" / "tiny-deepseek4.gguf"
CTX = DEFAULT_PREFILL_CHUNK + 64


def _assert_same(a: Any, b: Any) -> None:
    """Decoding states (attrs objects, lists, arrays, ints) are equal everywhere, bit for bit."""
    if attrs.has(type(a)):
        assert type(a) is type(b)
        for field in attrs.fields(type(a)):
            _assert_same(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def _assert_unchanged(session: Session, before: tuple[list[int], Any, np.ndarray | None]) -> None:
    tokens, state, last_logits = before
    assert session.tokens == tokens and session.remaining == session.engine.ctx - len(tokens)
    assert session.state.n_tokens == len(tokens)
    _assert_same(session.state, state)
    np.testing.assert_array_equal(session.last_logits, last_logits)


def _before(session: Session) -> tuple[list[int], Any, np.ndarray | None]:
    return list(session.tokens), copy_state(session.state), session.last_logits.copy()


def _continues_like_fresh(session: Session, reference: Engine, continuation: list[int]) -> None:
    """Feeding ``continuation`` gives the logits a fresh session on ``reference`` gives after the same tokens."""
    fresh = reference.new_session()
    fresh.feed(session.tokens)
    np.testing.assert_array_equal(session.feed(continuation), fresh.feed(continuation))
    assert session.tokens == fresh.tokens


# --- Qwen3.8: the n-gram table is cut short on disk --------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """An engine whose on-disk n-gram table loses the upper half of its last head, the intact reference engine,
    a token ``good`` whose repeated n-grams all lie below the cut, and a token ``bad`` reading a row past it."""
    path = tmp_path_factory.mktemp("qwen") / "tiny-qwen38.gguf"
    shutil.copyfile(QWEN_GGUF, path)
    engine = Engine.load(path, backend="numpy", ctx=CTX)
    reference = Engine.load(QWEN_GGUF, backend="numpy", ctx=CTX)
    model, cfg = engine.model, engine.model.cfg
    table = engine.gguf.tensors[NGRAM_TABLE]
    assert table.offset + table.nbytes == path.stat().st_size  # the table is the tail: a cut spares the rest
    cut_row = cfg.ple_head_offsets[-1] + cfg.ple_head_sizes[-1] // 2

    def top_row(history: list[int], ids: list[int]) -> int:
        return max(int(ngram_row_ids(np.array(history), np.array(ids), cfg.ple_eos, *h, cfg.heads_per_ngram).max())
                   for h in model._hash)

    eos = [cfg.ple_eos] * (cfg.ngram_size - 1)
    good = next(t for t in range(3, cfg.vocab_size) if top_row(eos, [t] * cfg.ngram_size) < cut_row)
    bad = next(t for t in range(3, cfg.vocab_size) if t != good and top_row([good] * len(eos), [t]) >= cut_row)
    with open(path, "r+b") as f:  # the model holds no mapping of the table: its rows are read per chunk with pread
        f.truncate(table.offset + cut_row * (table.nbytes // table.shape[0]) + 3)
    yield {"engine": engine, "reference": reference, "good": good, "bad": bad}
    engine.close()
    reference.close()


def test_later_chunk_failure_rolls_the_whole_feed_back(qwen):
    engine, good, bad = qwen["engine"], qwen["good"], qwen["bad"]
    session = engine.new_session()
    session.feed([good] * 3)
    before = _before(session)
    prompt = [good] * (DEFAULT_PREFILL_CHUNK + 8) + [bad] + [good] * 4  # the first chunk reads only intact rows
    with pytest.raises(GGUFFormatError) as failure:
        session.feed(prompt)
    message = str(failure.value)
    assert "truncated" in message and "re-download or re-convert" in message
    assert failure.value.__context__ is None  # raised once: the rollback added no second error
    _assert_unchanged(session, before)
    _continues_like_fresh(session, qwen["reference"], [good] * (DEFAULT_PREFILL_CHUNK + 20))


def test_one_chunk_table_failure_leaves_the_state_untouched_without_a_copy(qwen):
    engine, good, bad = qwen["engine"], qwen["good"], qwen["bad"]
    session = engine.new_session()
    session.feed([good] * 5)
    before = _before(session)
    with pytest.raises(GGUFFormatError, match="truncated"):
        session.feed([good, good, bad])
    _assert_unchanged(session, before)
    _continues_like_fresh(session, qwen["reference"], [good] * 7)


# --- DeepSeek V4: Ctrl-C inside the graph -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek() -> Iterator[Engine]:
    engine = Engine.load(DEEPSEEK_GGUF, backend="numpy", ctx=CTX)
    yield engine
    engine.close()


@pytest.fixture
def interrupt_at(deepseek, monkeypatch):
    """``interrupt_at(n)``: the n-th attention call from now (1-based) gets a SIGINT, as from Ctrl-C, after its layer
    has written this chunk's rows into the state."""

    def arm(n: int) -> None:
        calls = 0

        def counted(attention: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls == n:
                    raise KeyboardInterrupt  # what Ctrl-C raises there (not a signal: CI may run with SIGINT ignored)
                return attention(*args, **kwargs)
            return call

        # the fused ops the graph calls (numpy has them): a prefill's attention, and a step's or chosen rows'
        for name in ("norm_rope_window_attention", "norm_rope_attention"):
            monkeypatch.setitem(deepseek.ops._kernels, name, counted(deepseek.ops._kernels[name]))

    return arm


def test_interrupt_in_a_later_chunk_restores_the_session(deepseek, interrupt_at, monkeypatch):
    session = deepseek.new_session()
    session.feed([5, 6, 7])
    before = _before(session)
    layers = deepseek.model.cfg.num_layers
    interrupt_at(layers + 2)  # second chunk, second layer: two layers of it have advanced their state
    prompt = [(7 * i) % (deepseek.model.vocab_size - 1) + 1 for i in range(DEFAULT_PREFILL_CHUNK + 5)]
    with pytest.raises(KeyboardInterrupt):
        session.feed(prompt)
    _assert_unchanged(session, before)
    monkeypatch.undo()
    _continues_like_fresh(session, deepseek, [11, 12, 13, 14])


def test_interrupt_in_a_one_chunk_feed_stops_the_session_until_restored(deepseek, interrupt_at, monkeypatch):
    session = deepseek.new_session()
    session.feed([5, 6, 7, 8])
    snap = session.snapshot()
    interrupt_at(2)  # second layer of the only chunk: the state is half-written and no copy was taken
    with pytest.raises(KeyboardInterrupt):
        session.feed([9, 10, 11])
    monkeypatch.undo()
    assert session.tokens == [5, 6, 7, 8]
    for use in (lambda: session.feed([9]), session.snapshot, lambda: next(session.generate(max_tokens=1))):
        with pytest.raises(Ds4Error, match=r"state is incomplete.*restore a snapshot .* or start a new session"):
            use()
    session.restore(snap)
    _continues_like_fresh(session, deepseek, [9, 10, 11])


def test_refused_input_costs_no_rollback_and_no_state_change(deepseek):
    session = deepseek.new_session()
    session.feed([1, 2])
    before = _before(session)
    with pytest.raises(Ds4Error, match="out of range"):
        session.feed([3] * DEFAULT_PREFILL_CHUNK + [deepseek.model.vocab_size])
    with pytest.raises(Ds4Error, match="do not fit"):
        session.feed([3] * CTX)
    _assert_unchanged(session, before)
    session.feed([3])  # refusals do not mark the session unusable
