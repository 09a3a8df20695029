"""The CUDA backend's default fast paths on the shipped trained tiny models, against the numpy backend.

Both defaults trade exact float32 arithmetic for speed, as llama.cpp's CUDA build does: one-token decode steps
multiply with int8 activations (about 0.4% of each 32-block's largest value), and prefill matmuls run on 16-bit
tensor cores (fp16/bf16 operands, fp32 sums; the attention products in TF32). The bounds are on what users see, the
next-token loss on held-out text and the logits, each next to the float32 paths (``DS4_CUDA_INT8=0``,
``DS4_CUDA_PREFILL=32``), which stay within float32 summation order of numpy.

Decode: each model reads the first tokens of a held-out file, then decodes the rest one token at a time (teacher
forcing: the file's own next token is fed, so both backends see the same inputs at every step). Prefill: one
window of held-out text in one feed.
"""

from __future__ import annotations

from collections.abc import Callable
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
IDS = [m[1] for m in MODELS]
PROMPT, STEPS = 48, 64  # decode: steps after a prompt
WINDOW = 256  # prefill: tokens in one feed (past the 32 up to which the GEMV kernels take a feed)
#: Drift (per step: largest |logit difference| / largest |logit|; bounded at the 90th percentile of the steps) and
#: |mean loss difference| in nats. A near-tie in a router's or indexer's top-k can fall the other way under the
#: fast arithmetic at a few steps, as in any int8 engine (the tiny DeepSeek V4 model: 2 of 64 decode steps near 0.2,
#: the others under 0.02); such steps count in the loss. Measured on the H200: int8 decode drift 2.1e-2 (GLM 5.3)
#: to 4.0e-2 (Qwen3.8), loss -0.004 to +0.0001 nats; 16-bit prefill drift up to 8e-2, loss within 0.0003 (float32
#: paths: drift under 1e-6, loss 0).
DECODE_BOUNDS = (6e-2, 1e-2)
PREFILL_BOUNDS = (0.15, 1e-2)


def _decode(engine: Engine, ids: list[int]) -> np.ndarray:
    """Logits after each of ids[PROMPT - 1:], fed one token at a time after a prompt of PROMPT - 1 tokens."""
    session = engine.new_session()
    session.feed(ids[:PROMPT - 1])
    return np.stack([np.asarray(session.feed([t])[-1], dtype=np.float64) for t in ids[PROMPT - 1:-1]])


def _prefill(engine: Engine, ids: list[int]) -> np.ndarray:
    """Logits at every position of ids[:-1], fed at once."""
    return np.asarray(engine.new_session().feed(ids[:-1]), dtype=np.float64)


def _compare(monkeypatch, package: str, name: str, bos: bool, tokens: int, run: Callable, env: str,
             bounds: tuple[float, float]) -> None:
    """numpy, CUDA on the float32 paths, then CUDA with ``env`` at its default: that one within ``bounds``."""
    texts = held_out_sources()
    if texts is None:
        pytest.skip("this interpreter ships no standard-library sources")
    path = Path(str(resources.files(package).joinpath("data", name)))
    logits = {}
    for label, backend, default in (("numpy", "numpy", False), ("float32", "cuda", False), ("fast", "cuda", True)):
        monkeypatch.setenv("DS4_CUDA_INT8", "0")
        monkeypatch.setenv("DS4_CUDA_PREFILL", "32")
        if default:
            monkeypatch.delenv(env)
        engine = Engine.load(path, backend=backend)
        try:
            tok = engine.tokenizer
            ids = (([tok.bos_id] if bos else []) + tok.encode(next(iter(texts.values()))[:3000]))[:tokens]
            logits[label] = run(engine, ids)
        finally:
            engine.close()
    want, targets = logits["numpy"], np.asarray(ids[1:])[-len(logits["numpy"]):]
    per_step = {k: np.abs(logits[k] - want).max(axis=-1) / np.abs(want).max() for k in ("float32", "fast")}
    drift = {"float32": per_step["float32"].max(), "fast": np.quantile(per_step["fast"], 0.9)}
    dloss = cross_entropy(logits["fast"], targets).mean() - cross_entropy(want, targets).mean()
    assert drift["float32"] < 1e-4
    assert 10 * drift["float32"] < drift["fast"] < bounds[0], drift  # the fast path was taken, and stays close
    assert abs(dloss) < bounds[1], dloss


@pytest.mark.parametrize("package, name, bos", MODELS, ids=IDS)
def test_int8_decode_keeps_loss_and_logits(cuda_backend, monkeypatch, package, name, bos):
    _compare(monkeypatch, package, name, bos, PROMPT + STEPS, _decode, "DS4_CUDA_INT8", DECODE_BOUNDS)


@pytest.mark.parametrize("package, name, bos", MODELS, ids=IDS)
def test_tensor_core_prefill_keeps_loss_and_logits(cuda_backend, monkeypatch, package, name, bos):
    _compare(monkeypatch, package, name, bos, WINDOW + 1, _prefill, "DS4_CUDA_PREFILL", PREFILL_BOUNDS)
