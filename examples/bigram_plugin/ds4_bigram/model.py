"""A bigram model: the next token's logits are ``output @ token_embd[current]``."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ds4_core.backend import Ops, Weight, WeightLoader
from ds4_core.errors import ModelConfigError


@attrs.define
class BigramState:
    """A bigram needs no history; the position is kept only to enforce the context length."""

    position: int = 0


@attrs.define
class BigramModel:
    """``forward(ids) -> logits [T, vocab]`` from two matrices, through the op vocabulary."""

    ops: Ops
    embedding: Weight
    output: Weight
    family: str = "bigram"
    max_context: int = 1 << 20

    @property
    def vocab_size(self) -> int:
        return self.output.shape[0]

    def new_state(self, ctx: int) -> BigramState:
        return BigramState()

    def forward(self, ids: np.ndarray, state: BigramState) -> Any:
        state.position += len(ids)
        return self.ops.linear(self.ops.embed(self.embedding, ids), self.output)

    def state_nbytes(self, ctx: int) -> int:
        return 0


def load(gguf: Any, weights: WeightLoader, ops: Ops, options: dict[str, Any]) -> BigramModel:
    """Read ``bigram.embedding_length`` and the two tensors; refuse inconsistent files."""
    width = gguf.metadata.int("bigram.embedding_length")
    vocab = len(gguf.metadata.array("tokenizer.ggml.tokens"))
    if width < 1:
        raise ModelConfigError("bigram.embedding_length must be positive")
    embedding = weights.get("token_embd.weight", shape=(vocab, width), types=("F32", "F16", "Q8_0"))
    output = weights.get("output.weight", shape=(vocab, width), types=("F32", "F16", "Q8_0"))
    return BigramModel(ops, embedding, output)
