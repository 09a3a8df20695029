"""GLM 5.3 Flash decode steps on CUDA replay one recorded CUDA graph per state, and agree with the same steps
launched eagerly and with the numpy backend on the same Q8_0 GGUF (a tiny random transformers model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# Context 126: not a multiple of the 4-token pools (31 pool slots, the last one never completes). The prompt
# passes one 64-token delta-rule chunk and the indexer's top-8 (2 pools); the 40 decode steps complete 10 more
# pools and stay inside the context.
CTX = 126
PROMPT = 70
STEPS = 40


@pytest.fixture(scope="module")
def tiny_gguf(cuda_backend, tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ds4_model_glm5.next_convert import convert
    from ds4_model_glm5.next_tiny import build_tiny_hf

    hf_dir = tmp_path_factory.mktemp("hf-glm53-graph")
    build_tiny_hf(hf_dir, {}, seed=5)
    path = tmp_path_factory.mktemp("gguf-glm53-graph") / "glm53-q8_0.gguf"
    convert(hf_dir, path, "q8_0")
    return path


@pytest.fixture(scope="module")
def ids(engines) -> np.ndarray:
    return np.random.default_rng(53).integers(1, engines["numpy"].model.vocab_size, PROMPT + STEPS)


def _decode(engine, ids: np.ndarray) -> tuple[np.ndarray, object]:
    """Logits ``[len(ids), V]`` of a prefill of :data:`PROMPT` tokens, then one-token forwards; and the state."""
    model, to_numpy = engine.model, engine.backend.to_numpy
    state = model.new_state(CTX)
    out = [to_numpy(model.forward(ids[:PROMPT], state))]
    out += [to_numpy(model.forward(ids[p:p + 1], state)) for p in range(PROMPT, len(ids))]
    return np.concatenate(out), state


def _close_to_numpy(got: np.ndarray, want: np.ndarray) -> None:
    """tests/cuda/test_cuda_glm_qwen_models.py's CUDA-vs-numpy tolerance (float32 summation order, Q8_0 GEMVs)."""
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_decode_replays_one_cuda_graph_per_state_and_matches_eager_and_numpy(engines, ids):
    model = engines["cuda"].model
    graphs = model.decode_graphs
    assert graphs is not None
    try:
        graphed, state = _decode(engines["cuda"], ids)
        assert graphs.replays(state)
        assert state.n_tokens == len(ids)
        model.decode_graphs = None  # the same weights, each step launched eagerly
        eager, _ = _decode(engines["cuda"], ids)
    finally:
        model.decode_graphs = graphs
    np.testing.assert_allclose(graphed, eager, rtol=1e-4, atol=1e-4 * np.abs(eager).max())
    want, _ = _decode(engines["numpy"], ids)
    _close_to_numpy(graphed, want)


def test_graphed_hidden_states_are_copies_that_match_eager_steps(engines, ids):
    """``hidden`` (what the MTP drafter reads) through the graph: each call's result survives the next replay."""
    engine = engines["cuda"]
    model, to_numpy = engine.model, engine.backend.to_numpy
    graphs = model.decode_graphs
    graphed_state, eager_state = model.new_state(CTX), model.new_state(CTX)
    model.hidden(ids[:PROMPT], graphed_state)
    model.hidden(ids[:PROMPT], eager_state)
    graphed, eager = [], []
    try:
        for p in range(PROMPT, PROMPT + 12):
            model.decode_graphs = graphs
            graphed.append(model.hidden(ids[p:p + 1], graphed_state))  # device arrays, read after later replays
            model.decode_graphs = None
            eager.append(to_numpy(model.hidden(ids[p:p + 1], eager_state)))
    finally:
        model.decode_graphs = graphs
    assert graphs.replays(graphed_state)
    got, want = np.concatenate([to_numpy(h) for h in graphed]), np.concatenate(eager)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_restored_session_replays_its_graph_and_decodes_the_same(engines, ids):
    engine = engines["cuda"]
    graphs = engine.model.decode_graphs
    session = engine.new_session()
    session.feed(ids[:PROMPT])
    snap = session.snapshot()
    first = np.concatenate([session.feed(ids[p:p + 1]) for p in range(PROMPT, PROMPT + 10)])
    state = session.state
    assert graphs.replays(state)
    session.restore(snap)  # copied into the same arrays: the recorded graph stays valid
    assert session.state is state and graphs.replays(state)
    again = np.concatenate([session.feed(ids[p:p + 1]) for p in range(PROMPT, PROMPT + 10)])
    np.testing.assert_array_equal(again, first)
