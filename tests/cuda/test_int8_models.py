"""The default int8 decode path on the shipped trained tiny models, against the numpy backend.

Each model reads the first tokens of a held-out file, then decodes the rest one token at a time (teacher forcing:
the file's own next token is fed, so both backends see the same inputs at every step). One-token steps take the
int8-activation GEMVs, so their logits differ from numpy's by the rounding of the activations (about 0.4% of each
32-block's largest value): the bounds below are on what users see, the next-token loss and the logits.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from ds4_core.engine import Engine
from ds4_core.scoring import cross_entropy
from ds4_core.testing.heldout import held_out_sources

pytestmark = pytest.mark.gpu

# (plugin package, file, BOS first)
MODELS = [("ds4_model_deepseek4", "tiny-deepseek4.gguf", True), ("ds4_model_glm5", "tiny-glm53.gguf", True),
          ("ds4_model_qwen38", "tiny-qwen38.gguf", False)]
PROMPT, STEPS = 48, 64
#: Largest |logit difference| / largest |logit| over the decode steps, and |mean loss difference| in nats. Measured
#: on the H200: drift 2.1e-2 (GLM 5.3) to 4.0e-2 (Qwen3.8), loss -0.004 to +0.0001 nats (float32 path: 4e-7, 0).
LOGIT_BOUND, LOSS_BOUND = 6e-2, 1e-2


def _decode(engine: Engine, ids: list[int]) -> np.ndarray:
    """Logits after each of ids[PROMPT - 1:], fed one token at a time after a prompt of PROMPT - 1 tokens."""
    session = engine.new_session()
    session.feed(ids[:PROMPT - 1])
    return np.stack([np.asarray(session.feed([t])[-1], dtype=np.float64) for t in ids[PROMPT - 1:-1]])


@pytest.mark.parametrize("package, name, bos", MODELS, ids=[m[1] for m in MODELS])
def test_int8_decode_keeps_loss_and_logits(cuda_backend, monkeypatch, package, name, bos):
    texts = held_out_sources()
    if texts is None:
        pytest.skip("this interpreter ships no standard-library sources")
    path = Path(str(resources.files(package).joinpath("data", name)))
    logits = {}
    for run, backend, int8 in (("numpy", "numpy", "0"), ("float32", "cuda", "0"), ("int8", "cuda", "1")):
        monkeypatch.setenv("DS4_CUDA_INT8", int8)
        engine = Engine.load(path, backend=backend)
        try:
            tok = engine.tokenizer
            text = next(iter(texts.values()))
            ids = ([tok.bos_id] if bos else []) + tok.encode(text[:2000])
            ids = ids[:PROMPT + STEPS]
            logits[run] = _decode(engine, ids)
        finally:
            engine.close()
    want, targets = logits["numpy"], np.asarray(ids[PROMPT:])
    drift = {run: np.abs(logits[run] - want).max() / np.abs(want).max() for run in ("float32", "int8")}
    dloss = cross_entropy(logits["int8"], targets).mean() - cross_entropy(want, targets).mean()
    print(f"{name}: logit drift float32 {drift['float32']:.1e} int8 {drift['int8']:.1e}, "
          f"loss {cross_entropy(want, targets).mean():.4f} int8 {dloss:+.5f}")
    assert drift["float32"] < 1e-4
    assert 10 * drift["float32"] < drift["int8"] < LOGIT_BOUND  # the int8 steps were taken, and stay close
    assert abs(dloss) < LOSS_BOUND
