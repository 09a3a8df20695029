"""The numpy engine on converted tiny GLM 5.2 models reproduces transformers' cached, token-by-token logits.

Oracle: ``GlmMoeDsaForCausalLM`` (transformers, eager, float32) fed one token per call with its
``past_key_values``. Our side: the converted f32 GGUF on the numpy backend, fed in uneven chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# Tokens per config: several times index_topk, so most queries attend to a sparse selection.
SEQUENCE_LENGTHS = {"default": 40, "freq": 44, "pattern": 36}
CHUNKS = (1, 7, 3, 16, 2, 13, 5, 1, 11, 9, 4, 17)
RELATIVE_TOLERANCE = 1e-3


def transformers_cached_logits(model, ids: np.ndarray) -> np.ndarray:
    """[T, vocab] logits of ``model`` decoding ``ids`` one token per forward call with its cache."""
    rows, past = [], None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # these matrices are tiny: thread start-up costs several times the work
    try:
        with torch.no_grad():
            for token in ids:
                out = model(input_ids=torch.tensor([[int(token)]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                rows.append(out.logits[0, -1].float().numpy())
    finally:
        torch.set_num_threads(threads)
    return np.stack(rows)


def engine_chunked_logits(path, ids: np.ndarray) -> np.ndarray:
    """[T, vocab] logits of the numpy engine fed ``ids`` in the uneven :data:`CHUNKS`."""
    from ds4_core.engine import Engine

    session = Engine.load(path, backend="numpy").new_session()
    parts, start, i = [], 0, 0
    while start < len(ids):
        stop = min(start + CHUNKS[i % len(CHUNKS)], len(ids))
        parts.append(np.asarray(session.feed(ids[start:stop]), dtype=np.float32))
        start, i = stop, i + 1
    return np.concatenate(parts)


@pytest.mark.parametrize("name", sorted(SEQUENCE_LENGTHS))
def test_engine_matches_transformers_cached_decode(name, tiny_hf, converted):
    _, model = tiny_hf(name)
    length = SEQUENCE_LENGTHS[name]
    assert length > 4 * model.config.index_topk
    ids = np.random.default_rng(200 + length).integers(0, model.config.vocab_size, length)

    expected = transformers_cached_logits(model, ids)
    got = engine_chunked_logits(converted(name, "f32"), ids)

    assert got.shape == expected.shape
    scale = np.abs(expected).max()
    error = np.abs(got - expected).max() / scale
    print(f"{name}: max |logit| {scale:.3f}, max relative error {error:.2e}")
    assert error <= RELATIVE_TOLERANCE, f"worst position {int(np.abs(got - expected).max(axis=1).argmax())}"
