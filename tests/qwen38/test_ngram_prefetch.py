"""N-gram rows read on a background thread, overlapping the layers before each PLE layer (shipped tiny model).

The tiny model has PLE blocks on layers 0, 2 and 4 (attention on layers 1, 3 and 5), so a chunk's rows of layer 2
are read while layers 0 and 1 compute. A one-token feed reads its few rows before any layer runs, as the recorded
decode step does, so a failed read leaves nothing to undo. The oracle is the same model loaded with
``ngram_prefetch=False`` (reads inline).
"""

from __future__ import annotations

import copy
import shutil
import threading
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from ds4_model_qwen38.model import NGRAM_TABLE

from ds4_core.engine import Engine
from ds4_core.errors import GGUFFormatError

MODEL = Path(str(resources.files("ds4_model_qwen38").joinpath("data", "tiny-qwen38.gguf")))
READER = "ds4-qwen38-ngram"  # the reader thread's name prefix
WAIT_S = 5.0


def _load(path: Path = MODEL, **options) -> Engine:
    return Engine.load(path, backend="numpy", ctx=256, **options)


@pytest.fixture
def engine():
    eng = _load()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def inline():
    eng = _load(ngram_prefetch=False)
    yield eng
    eng.close()


def _prompt(eng: Engine, n: int, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(1, eng.model.vocab_size, n)
    ids[[i for i in (3, 7, 17, 18) if i < n]] = eng.model.cfg.ple_eos  # end-of-sequence resets inside the feed
    return ids


def _assert_states_equal(a, b) -> None:
    assert a.n_tokens == b.n_tokens
    np.testing.assert_array_equal(a.ngram_history, b.ngram_history)
    for x, y in zip(a.layers, b.layers, strict=True):
        for field in x.__attrs_attrs__:
            if getattr(x, field.name) is not None:
                np.testing.assert_array_equal(getattr(x, field.name), getattr(y, field.name))


class _LayerLog:
    """A real block wrapped to log which layer starts on which thread (and to run ``on_start`` first)."""

    def __init__(self, block, layer: int, log: list, on_start=None):
        self.block, self.layer, self.log, self.on_start = block, layer, log, on_start

    def __call__(self, *args):
        self.log.append(("layer", self.layer, threading.get_ident()))
        if self.on_start is not None:
            self.on_start()
        return self.block(*args)


def test_prefetch_equals_inline_reads_in_uneven_chunks(engine, inline):
    ids = _prompt(engine, 60, 0)
    ours, theirs = engine.new_session(), inline.new_session()
    ours.prefill_chunk = theirs.prefill_chunk = 16  # the 29-token feed runs as 16 + 13
    start = 0
    for size in (1, 29, 5, 1, 1, 21, 2):
        part = ids[start:start + size]
        start += size
        np.testing.assert_array_equal(ours.feed(part), theirs.feed(part))
    assert start == ids.size
    _assert_states_equal(ours.state, theirs.state)


def test_a_one_token_feed_reads_its_rows_on_the_reader_thread_before_any_layer(engine):
    model, table = engine.model, engine.model.ngram_table
    session = engine.new_session()
    ids = _prompt(engine, 10, 1)
    session.feed(ids[:9])
    log: list = []
    real_read = table._read

    def logged_read(row: int) -> np.ndarray:
        log.append(("read", row, threading.get_ident()))
        return real_read(row)

    table._read = logged_read
    table._cache.clear()
    model.blocks = [_LayerLog(b, i, log) for i, b in enumerate(model.blocks)]
    session.feed(ids[9:])
    reads = [entry for entry in log if entry[0] == "read"]
    assert reads and threading.get_ident() not in {t for _, _, t in reads}  # the reader thread, not the forward's
    assert log.index(reads[-1]) < log.index(("layer", 0, threading.get_ident()))


def test_reads_run_on_the_reader_thread_while_earlier_layers_compute(engine):
    model, table = engine.model, engine.model.ngram_table
    session = engine.new_session()
    ids = _prompt(engine, 20, 1)
    per_layer = [set(r.ravel().tolist()) for r in model.ngram_rows(session.state.ngram_history, ids)]
    first, second = per_layer[:2]
    only_second = second - first
    assert model.cfg.ple_layers == (0, 2, 4) and only_second

    log: list = []
    layer1 = threading.Event()
    overlapped: list[bool] = []
    real_read = table._read

    def logged_read(row: int) -> np.ndarray:
        log.append(("read", row, threading.get_ident()))
        if row in only_second and not overlapped:
            # the first read of layer 2's rows waits until layer 1 runs: it completes only if the forward goes
            # on computing while this read is pending, i.e. if reads and layers run on different threads
            overlapped.append(layer1.wait(WAIT_S))
        return real_read(row)

    table._read = logged_read
    table._cache.clear()  # cold cache: every row of this feed is read from the file
    model.blocks = [_LayerLog(b, i, log, layer1.set if i == 1 else None) for i, b in enumerate(model.blocks)]
    session.feed(ids)

    main = threading.get_ident()
    readers = {t for kind, _, t in log if kind == "read"}
    assert len(readers) == 1 and main not in readers  # one reader thread, never the forward's
    assert {t for kind, _, t in log if kind == "layer"} == {main}
    assert overlapped == [True]
    at = {("layer", i): log.index(("layer", i, main)) for i in range(len(model.blocks))}
    reads = [(i, row) for i, (kind, row, _) in enumerate(log) if kind == "read"]
    assert {row for _, row in reads} == set().union(*per_layer)
    assert all(i < at["layer", 0] for i, row in reads if row in first)  # layer 0's rows before layer 0
    assert all(i < at["layer", 2] for i, row in reads if row in second)  # layer 2's rows before layer 2
    assert any(i > at["layer", 1] for i, row in reads if row in only_second)  # ...some of them during layer 1


@pytest.mark.parametrize("feed", [1, 5], ids=["decode", "chunk"])
def test_failed_prefetch_leaves_the_session_unchanged_and_usable(tmp_path, inline, feed):
    path = tmp_path / "tiny.gguf"
    shutil.copyfile(MODEL, path)
    eng = _load(path)
    try:
        model, table = eng.model, eng.gguf.tensors[NGRAM_TABLE]
        session, reference = eng.new_session(), inline.new_session()
        prefix = _prompt(eng, 12, 2)
        np.testing.assert_array_equal(session.feed(prefix), reference.feed(prefix))
        # the file loses the second half of layer 4's last head (the table is the file's last tensor)
        assert table.offset + table.nbytes == path.stat().st_size
        cut_row = model.cfg.ple_head_offsets[-1] + model.cfg.ple_head_sizes[-1] // 2
        with open(path, "r+b") as f:
            f.truncate(table.offset + cut_row * (table.nbytes // table.shape[0]) + 3)
        model.ngram_table._cache.clear()  # cold cache: the rows must come from the truncated file

        def rows(ids):
            return model.ngram_rows(session.state.ngram_history, np.asarray(ids))

        rng = np.random.default_rng(4)
        candidates = (rng.integers(1, model.vocab_size, feed) for _ in range(10000))
        # layers 0 and 2's rows are readable, layer 4's are not: in a chunk the error surfaces after layers 0-3 ran,
        # a single token reads first and runs none
        bad = next(ids for ids in candidates if max(r.max() for r in rows(ids)[:-1]) < cut_row <= rows(ids)[-1].max())
        ok = next(t for t in range(1, model.vocab_size) if max(r.max() for r in rows([t])) < cut_row)
        ran: list = []
        model.blocks = [_LayerLog(b, i, ran) for i, b in enumerate(model.blocks)]
        before, tokens, last = copy.deepcopy(session.state), list(session.tokens), session.last_logits.copy()
        with pytest.raises(GGUFFormatError, match="truncated"):
            session.feed(bad)
        assert [layer for _, layer, _ in ran] == ([] if feed == 1 else [0, 1, 2, 3])
        _assert_states_equal(session.state, before)
        assert session.tokens == tokens
        np.testing.assert_array_equal(session.last_logits, last)
        # usable: it goes on exactly like the complete file read inline
        np.testing.assert_array_equal(session.feed([ok]), reference.feed([ok]))
        _assert_states_equal(session.state, reference.state)
    finally:
        eng.model.close()
        eng.close()


def test_close_stops_the_reader_thread_and_a_later_feed_restarts_it(engine, inline):
    others = {t for t in threading.enumerate() if t.name.startswith(READER)}  # of models other tests left open

    def _readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith(READER) and t not in others]

    assert not _readers()
    ids = _prompt(engine, 8, 3)
    session, reference = engine.new_session(), inline.new_session()
    np.testing.assert_array_equal(session.feed(ids[:4]), reference.feed(ids[:4]))
    threads = _readers()
    assert len(threads) == 1
    engine.model.close()
    assert not threads[0].is_alive() and not _readers()
    np.testing.assert_array_equal(session.feed(ids[4:]), reference.feed(ids[4:]))
    assert len(_readers()) == 1
    engine.model.close()
    assert not _readers()


def test_engine_close_stops_the_reader_thread():
    others = {t for t in threading.enumerate() if t.name.startswith(READER)}
    engine = _load()
    engine.new_session().feed(_prompt(engine, 4, 1))
    threads = [t for t in threading.enumerate() if t.name.startswith(READER) and t not in others]
    assert len(threads) == 1
    engine.close()
    assert not threads[0].is_alive()
