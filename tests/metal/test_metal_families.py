"""Tiny GLM 5.2, GLM 5.3 Flash and Qwen3.8 models on the Metal backend (MLX CPU here) against the numpy backend."""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core.engine import Engine

FAMILY_NAMES = ["glm52", "glm53", "qwen38"]
# Past each family's sparse selection (top-k rows, pools, QSA blocks) and past one delta-rule chunk of 64.
PROMPT_TOKENS = 72
RAGGED_CHUNKS = [3, 1, 17, 40, 11]
# One token per call is slow on MLX's CPU device (per-op dispatch); 24 tokens already select sparsely.
BY_TOKEN = 24


def _feed(path, backend: str, chunks: list[int], ids: np.ndarray) -> np.ndarray:
    engine = Engine.load(path, backend=backend, ctx=128)
    try:
        session, out, start = engine.new_session(), [], 0
        for n in chunks:
            out.append(session.feed(ids[start:start + n]))
            start += n
        return np.concatenate(out)
    finally:
        engine.close()


def _ids(n: int) -> np.ndarray:
    return np.random.default_rng(11).integers(0, 320, n).astype(np.int32)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_every_graph_op_has_a_metal_kernel():
    from ds4_core.descriptors import resolve
    from ds4_core.plugins import get_plugin_manager

    registry = get_plugin_manager().registry
    metal = registry.kernels_for("metal")
    for family in (*FAMILY_NAMES, "deepseek4"):
        assert set(registry.models[family].ops) <= set(metal), family
    assert all(callable(resolve(spec.impl)) for spec in metal.values())


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_prefill_matches_numpy_at_every_position(family_gguf, family):
    path, ids = family_gguf(family), _ids(PROMPT_TOKENS)
    want = _feed(path, "numpy", [PROMPT_TOKENS], ids)
    got = _feed(path, "metal", [PROMPT_TOKENS], ids)
    assert got.shape == want.shape == (PROMPT_TOKENS, 320)
    _close(got, want)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_chunked_equals_token_by_token(family_gguf, family):
    path, ids = family_gguf(family), _ids(PROMPT_TOKENS)
    whole = _feed(path, "metal", [PROMPT_TOKENS], ids)
    _close(_feed(path, "metal", RAGGED_CHUNKS, ids), whole)
    _close(_feed(path, "metal", [1] * BY_TOKEN, ids[:BY_TOKEN]), whole[:BY_TOKEN])


def test_snapshot_restore_replays_recurrent_state_exactly(family_gguf):
    engine = Engine.load(family_gguf("glm53"), backend="metal", ctx=64)
    try:
        session = engine.new_session()
        session.feed(_ids(20))
        snap = session.snapshot()
        first = session.feed([42, 43])
        session.feed([7])  # moves the KDA memory and conv history on past the snapshot
        session.restore(snap)
        np.testing.assert_array_equal(session.feed([42, 43]), first)
    finally:
        engine.close()
