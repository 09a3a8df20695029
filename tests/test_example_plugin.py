"""The example third-party plugin loads through the real hooks and runs on the numpy backend."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ds4_core.engine import Engine
from ds4_core.errors import GGUFTensorError
from ds4_core.sampling import SamplingParams
from ds4_core.testing.gguf_files import write_gguf
from ds4_core.tokenizer import BYTE_TO_CHAR

sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "bigram_plugin"))
from ds4_bigram import plugin as bigram_plugin

V, D = 257, 32  # the byte alphabet plus one merged token


def bigram_file(tmp_path: Path, *, output_shape=(V, D)) -> Path:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((V, D)).astype(np.float32)
    out = rng.standard_normal(output_shape).astype(np.float32)
    metadata = {"bigram.embedding_length": D, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
                "tokenizer.ggml.tokens": [*BYTE_TO_CHAR, "he"], "tokenizer.ggml.merges": ["h e"]}
    return write_gguf(tmp_path / "bigram.gguf", "bigram", metadata, {"token_embd.weight": emb, "output.weight": out})


def test_example_plugin_runs_and_matches_its_definition(tmp_path):
    engine = Engine.load(bigram_file(tmp_path), plugins=[bigram_plugin], load_entrypoints=False)
    ids = engine.tokenizer.encode("hello, world")
    logits = engine.new_session().feed(ids)
    emb = engine.model.embedding.data
    np.testing.assert_allclose(logits, emb[ids] @ engine.model.output.data.T, rtol=1e-5, atol=1e-5)
    text = "".join(p.text for p in engine.new_session().generate(ids, max_tokens=8,
                                                                 sampling=SamplingParams(temperature=0)))
    assert isinstance(text, str)


def test_example_plugin_rejects_a_wrong_shape(tmp_path):
    with pytest.raises(GGUFTensorError, match=r"output\.weight"):
        Engine.load(bigram_file(tmp_path, output_shape=(V, D + 1)), plugins=[bigram_plugin], load_entrypoints=False)


def test_unknown_architecture_names_the_missing_plugin(tmp_path):
    from ds4_core.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match=r"bigram.*install"):
        Engine.load(bigram_file(tmp_path), load_entrypoints=False)
