"""The numpy engine on converted tiny GLM 5.3 Flash models reproduces transformers' cached, token-by-token logits.

Oracle: ``Glm5NextForConditionalGeneration`` (transformers, eager, float32) fed one token per call with its
cache. Our side: the converted f32 GGUF loaded by ``Engine.load(backend="numpy")``, fed in uneven chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4_core.testing.conformance import assert_logits_match, engine_chunked_logits, transformers_cached_logits  # noqa: E402

# Tokens per config: several times index_topk, so the pooled indexer really selects (and the open pool varies).
SEQUENCE_LENGTHS = {"mixed": 44, "shared": 40, "kda_heavy": 56}
CHUNKS = (1, 7, 3, 17, 2, 5, 1, 11, 4)  # 17 > the KDA prefill block of 16
RELATIVE_TOLERANCE = 1e-3


@pytest.mark.parametrize("name", sorted(SEQUENCE_LENGTHS))
def test_engine_matches_transformers_cached_decode(name, tiny_next_hf, next_converted):
    _, model = tiny_next_hf(name)
    length = SEQUENCE_LENGTHS[name]
    ids = np.random.default_rng(300 + length).integers(0, model.config.text_config.vocab_size, length)

    expected = transformers_cached_logits(model, ids)
    got = engine_chunked_logits(next_converted(name, "f32"), ids, CHUNKS)

    assert_logits_match(got, expected, RELATIVE_TOLERANCE, name)
