"""Tiny GLM 5.2, GLM 5.3 Flash and Qwen3.8 models on ``backend="cuda"`` against ``backend="numpy"``.

The models are random transformers models of each family (the plugins' tiny builders), converted to Q8_0 GGUFs by
the plugins' converters; both backends read the same file, so they must agree at every position up to float32
summation order.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# family -> (tiny builder, converter, builder overrides, tokens fed). Lengths: several times the indexer's top-k
# (GLM) or the QSA budget (Qwen), so sparse selection is exercised, and past one 64-token delta-rule chunk.
FAMILIES = {
    "glm52": ("ds4_model_glm5.tiny", "ds4_model_glm5.convert", {"index_n_heads": 16}, 40),
    "glm53": ("ds4_model_glm5.next_tiny", "ds4_model_glm5.next_convert", {}, 72),
    "qwen38": ("ds4_model_qwen38.tiny", "ds4_model_qwen38.convert", {}, 72),
}
CHUNKS = (1, 7, 3, 17, 1, 1, 11, 2)
CTX = 128


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_gguf(request, cuda_backend, tmp_path_factory) -> tuple[str, Path]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    builder, converter, overrides, _ = FAMILIES[request.param]
    hf_dir = tmp_path_factory.mktemp(f"hf-{request.param}")
    importlib.import_module(builder).build_tiny_hf(hf_dir, overrides, seed=5)
    path = tmp_path_factory.mktemp(f"gguf-{request.param}") / f"{request.param}-q8_0.gguf"
    importlib.import_module(converter).convert(hf_dir, path, "q8_0")
    return request.param, path


def _ids(family: str, vocab: int) -> np.ndarray:
    return np.random.default_rng(11).integers(1, vocab, FAMILIES[family][3])


def _feed(session, ids: np.ndarray, chunks: tuple[int, ...]) -> np.ndarray:
    parts, start, i = [], 0, 0
    while start < len(ids):
        stop = min(start + chunks[i % len(chunks)], len(ids))
        parts.append(np.asarray(session.feed(ids[start:stop]), dtype=np.float32))
        start, i = stop, i + 1
    return np.concatenate(parts)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_cuda_matches_numpy_at_every_position(tiny_gguf, engines):
    ids = _ids(tiny_gguf[0], engines["numpy"].model.vocab_size)
    want = engines["numpy"].new_session().feed(ids)
    _close(_feed(engines["cuda"].new_session(), ids, (len(ids),)), want)  # one prefill (chunked recurrences)
    _close(_feed(engines["cuda"].new_session(), ids, CHUNKS), want)  # uneven chunks, single-token decode steps


def test_cuda_snapshot_restore_replays_exactly(tiny_gguf, engines):
    ids = _ids(tiny_gguf[0], engines["cuda"].model.vocab_size)
    session = engines["cuda"].new_session()
    session.feed(ids[:20])
    snap = session.snapshot()
    first = _feed(session, ids[20:30], (1,))
    session.feed(ids[:3])  # wander off, then come back
    session.restore(snap)
    np.testing.assert_array_equal(_feed(session, ids[20:30], (1,)), first)


def test_experts_in_host_memory_give_the_logits_of_experts_on_the_device(tiny_gguf, engines, monkeypatch):
    """Every layer's routed experts in pinned host memory (``DS4_CUDA_HOST_EXPERTS=all``): the same logits, bit for
    bit, as the experts held on the device, through a whole prefill and through uneven chunks and decode steps."""
    from ds4_core.engine import Engine

    ids = _ids(tiny_gguf[0], engines["cuda"].model.vocab_size)
    monkeypatch.setenv("DS4_CUDA_HOST_EXPERTS", "all")
    hosted = Engine.load(tiny_gguf[1], backend="cuda", ctx=CTX)
    try:
        assert hosted.backend.memory_info().get("host", 0) > 0
        for chunks in ((len(ids),), CHUNKS):
            np.testing.assert_array_equal(_feed(hosted.new_session(), ids, chunks),
                                          _feed(engines["cuda"].new_session(), ids, chunks))
    finally:
        hosted.close()
