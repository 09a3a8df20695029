"""N-gram (PLE) embeddings: the hash against transformers, reads from disk, truncated files, bounded memory."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
from ds4_model_qwen38.hashing import layer_multipliers, table_sizes
from ds4_model_qwen38.loader import load
from ds4_model_qwen38.model import NGRAM_TABLE

from ds4_core.backend import Ops, WeightLoader
from ds4_core.backends.numpy import NumpyBackend
from ds4_core.errors import GGUFFormatError
from ds4_core.gguf import GGUFFile
from ds4_core.plugins import get_plugin_manager

torch = pytest.importorskip("torch")


def _load(path, **options):
    gguf = GGUFFile(path, require_data=False)
    backend = NumpyBackend()
    registry = get_plugin_manager().registry
    kernels = {op: k.impl for op, k in registry.kernels_for("numpy").items()}
    from ds4_core.descriptors import resolve

    reported = []
    weights = WeightLoader(gguf, backend, reported.append)
    model = load(gguf, weights, Ops(backend, {op: resolve(impl) for op, impl in kernels.items()}), options)
    return gguf, model, sum(reported)


def test_hash_constants_match_the_spec_release_values():
    assert layer_multipliers(248320, 3, 0, 1234) == [23703573157769, 20109073645365, 8052911324071]
    sizes = table_sizes(20000000, 16, 0)
    assert sizes[0] == 20000003 and sizes[-1] == 20000171 and sum(sizes) == 320001446


@pytest.mark.parametrize("name", ["a", "b"])
def test_ngram_rows_equal_transformers_embeddings(name, tiny_hf, converted):
    """Hash, EOS reset, stacked tables and the chunk/history split against each PLE layer's transformers module."""
    _, hf = tiny_hf(name)
    _, model, _ = _load(converted(name, "f32"))
    ids = np.random.default_rng(3).integers(1, hf.config.vocab_size, 30)
    ids[[2, 3, 11, 20]] = hf.config.eos_token_id
    history = np.full(2, hf.config.eos_token_id, np.int64)
    ours = [np.concatenate(parts) for parts in zip(
        model.ngram_embeddings(history, ids[:9]), model.ngram_embeddings(ids[7:9], ids[9:]), strict=True)]
    with torch.no_grad():
        theirs = [hf.model.layers[layer].ple.ple_embedding(torch.tensor(ids[None]), None)[0].numpy()
                  for layer in model.cfg.ple_layers]
    assert len(ours) == len(theirs) >= 2
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_table_is_read_from_disk_not_loaded(converted):
    path = converted("a", "f32")
    gguf, model, uploaded = _load(path, ngram_cache_rows=8)
    table = gguf.tensors[NGRAM_TABLE]
    assert uploaded == sum(t.nbytes for t in gguf.tensors.values()) - table.nbytes
    state = model.new_state(64)
    model.forward(np.arange(1, 41, dtype=np.int32), state)
    assert len(model.ngram_table._cache) == 8  # the cache stays bounded however many rows were read


def test_truncated_table_fails_cleanly_and_leaves_state_unchanged(converted, tmp_path):
    path = converted("a", "f32")
    full_gguf, full, _ = _load(path)
    table = full_gguf.tensors[NGRAM_TABLE]
    # every token reads one row of each head's range; cut the last head's range in half
    cut_row = full.cfg.ple_head_offsets[-1] + full.cfg.ple_head_sizes[-1] // 2
    truncated = tmp_path / "truncated.gguf"
    shutil.copyfile(path, truncated)
    with open(truncated, "r+b") as f:
        f.truncate(table.offset + cut_row * (table.nbytes // table.shape[0]) + 3)  # inside row cut_row
    _, model, _ = _load(truncated)

    def rows_needed(history, ids):
        from ds4_model_qwen38.ngram import ngram_row_ids

        return np.concatenate([ngram_row_ids(history, ids, model.cfg.ple_eos, *h, model.cfg.heads_per_ngram)
                               for h in model._hash], axis=1)

    eos = model.cfg.ple_eos
    rng = np.random.default_rng(0)
    good = next(ids for ids in (rng.integers(1, 320, 2) for _ in range(10000))
                if rows_needed(np.array([eos, eos]), ids).max() < cut_row)
    state = model.new_state(32)
    model.forward(good.astype(np.int32), state)
    reference = full.new_state(32)
    full.forward(good.astype(np.int32), reference)
    bad = next(t for t in range(1, 320) if rows_needed(state.ngram_history, np.array([t])).max() >= cut_row)
    before = copy.deepcopy(state)
    with pytest.raises(GGUFFormatError, match="truncated"):
        model.forward(np.array([bad], np.int32), state)
    assert state.n_tokens == before.n_tokens
    np.testing.assert_array_equal(state.ngram_history, before.ngram_history)
    for now, then in zip(state.layers, before.layers, strict=True):
        for field in now.__attrs_attrs__:
            a, b = getattr(now, field.name), getattr(then, field.name)
            if a is not None:
                np.testing.assert_array_equal(a, b)
    # the session recovers: a token whose rows exist continues exactly like the complete file
    ok = next(t for t in range(1, 320) if rows_needed(state.ngram_history, np.array([t])).max() < cut_row)
    np.testing.assert_array_equal(model.forward(np.array([ok], np.int32), state),
                                  full.forward(np.array([ok], np.int32), reference))
