"""Qwen3.8 decode steps replayed as CUDA graphs: one recording per state, equal to eager steps and to numpy.

Two models: the shipped trained tiny model (QSA keeps 16 blocks of 4 tokens) and a random tiny model whose every
projection width is a multiple of 8, so each of its projections runs a GEMV kernel (other widths would call cuBLAS,
which a CUDA graph cannot record, and the step would run eagerly).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

CTX = 128
SHIPPED = Path(str(resources.files("ds4_model_qwen38").joinpath("data", "tiny-qwen38.gguf")))
# GEMV-friendly widths (multiples of 8) for the random model's hyper-connection rank and FFNs.
RANDOM_OVERRIDES = {"hc_lowrank": 8, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}
# model -> feed schedule: a prefill, one-token steps, a chunk between steps (a new user turn), more steps. The
# shipped model selects blocks from position 67 on; the random one (2 blocks of 2 kept) from position 5.
SCHEDULES = {"shipped": [50] + [1] * 20 + [7] + [1] * 20, "random": [20] + [1] * 20 + [7] + [1] * 20}


def _close(got: np.ndarray, want: np.ndarray) -> None:  # the Qwen CUDA-vs-numpy tolerance
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def tiny_gguf(request, cuda_backend, tmp_path_factory) -> tuple[str, Path]:
    if request.param == "shipped":
        return request.param, SHIPPED
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ds4_model_qwen38.convert import convert
    from ds4_model_qwen38.tiny import build_tiny_hf

    hf_dir = tmp_path_factory.mktemp("hf-qwen38-graph")
    build_tiny_hf(hf_dir, RANDOM_OVERRIDES, seed=5)
    path = tmp_path_factory.mktemp("gguf-qwen38-graph") / "qwen38-q8_0.gguf"
    convert(hf_dir, path, "q8_0")
    return request.param, path


def _ids(name: str, model) -> np.ndarray:
    prefill = SCHEDULES[name][0]
    ids = np.random.default_rng(11).integers(1, model.vocab_size, sum(SCHEDULES[name]))
    # n-gram resets in the prefill, in the first steps, in the mid chunk and in the last steps
    ids[[3, 4, prefill + 2, prefill + 22, prefill + 30]] = model.cfg.ple_eos
    return ids


def _run(engine, ids: np.ndarray, schedule: list[int]) -> tuple[np.ndarray, object]:
    model, state = engine.model, engine.model.new_state(CTX)
    out, start = [], 0
    for n in schedule:
        out.append(engine.backend.to_numpy(model.forward(ids[start:start + n], state)))
        start += n
    return np.concatenate(out), state


def test_decode_replays_one_cuda_graph_per_state_and_matches_eager_and_numpy(tiny_gguf, engines):
    name, cuda = tiny_gguf[0], engines["cuda"]
    model, schedule = cuda.model, SCHEDULES[name]
    ids = _ids(name, model)
    graphs = model.decode_graphs
    assert graphs is not None
    graphed, state = _run(cuda, ids, schedule)
    assert graphs.replays(state)  # recorded on the first step, replayed after the mid chunk too
    model.decode_graphs = None  # the same weights, each step launched eagerly
    try:
        eager, _ = _run(cuda, ids, schedule)
    finally:
        model.decode_graphs = graphs
    np.testing.assert_allclose(graphed, eager, rtol=1e-4, atol=1e-4 * np.abs(eager).max())
    _close(graphed, _run(engines["numpy"], ids, schedule)[0])


def test_restored_session_replays_its_graph_and_decodes_the_same(tiny_gguf, engines):
    name, cuda = tiny_gguf[0], engines["cuda"]
    graphs = cuda.model.decode_graphs
    session = cuda.new_session()
    session.feed(_ids(name, cuda.model)[:SCHEDULES[name][0]])
    snap = session.snapshot()

    def greedy(n: int) -> tuple[list[int], np.ndarray]:
        tokens, logits = [], []
        for _ in range(n):
            tokens.append(int(np.argmax(session.last_logits)))
            logits.append(session.feed(tokens[-1:]))
        return tokens, np.concatenate(logits)

    first, first_logits = greedy(16)
    assert graphs.replays(session.state)
    state = session.state
    session.restore(snap)  # copied into the same arrays: the recorded graph replays on
    assert session.state is state and graphs.replays(state)
    again, again_logits = greedy(16)
    assert again == first
    np.testing.assert_array_equal(again_logits, first_logits)
