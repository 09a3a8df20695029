"""The numpy engine on converted tiny GLM 5.2 models reproduces transformers' cached, token-by-token logits.

Oracle: ``GlmMoeDsaForCausalLM`` (transformers, eager, float32) fed one token per call with its
``past_key_values``. Our side: the converted f32 GGUF on the numpy backend, fed in uneven chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4_core.testing.conformance import assert_logits_match, engine_chunked_logits, transformers_cached_logits  # noqa: E402

# Tokens per config: several times index_topk, so most queries attend to a sparse selection.
SEQUENCE_LENGTHS = {"default": 40, "freq": 44, "pattern": 36}
CHUNKS = (1, 7, 3, 16, 2, 13, 5, 1, 11, 9, 4, 17)
RELATIVE_TOLERANCE = 1e-3


@pytest.mark.parametrize("name", sorted(SEQUENCE_LENGTHS))
def test_engine_matches_transformers_cached_decode(name, tiny_hf, converted):
    _, model = tiny_hf(name)
    length = SEQUENCE_LENGTHS[name]
    assert length > 4 * model.config.index_topk
    ids = np.random.default_rng(200 + length).integers(0, model.config.vocab_size, length)

    expected = transformers_cached_logits(model, ids)
    got = engine_chunked_logits(converted(name, "f32"), ids, CHUNKS)

    assert_logits_match(got, expected, RELATIVE_TOLERANCE, name)
