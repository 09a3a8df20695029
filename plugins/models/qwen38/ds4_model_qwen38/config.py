"""Qwen3.8 Flash Next hyperparameters, read from (and written to) the ``qwen4exp.*`` GGUF metadata (spec §9.2).

Key names follow llama.cpp's ``qwen4exp`` where it has one. Two extensions:

* ``ssm.output_gate`` (``"sigmoid"``/``"silu"``): the delta-net output gate's activation (absent = sigmoid,
  the released model's);
* several PLE layers: their n-gram tables are stacked, in ``ple.layers`` order, into the one
  ``per_layer_token_embd`` table, and ``ple.layer_multipliers`` / ``ple.head_offsets`` /
  ``ple.head_vocab_sizes`` hold every layer's values one layer after the other, with head offsets counted
  from the start of the stacked table. With the released model's single PLE layer this is llama.cpp's layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from gguf import GGUFValueType

from ds4_core.errors import ModelConfigError

ARCH = "qwen4exp"
#: ``general.architecture`` values this plugin reads (some converters write the transformers spelling).
ARCHITECTURES = ("qwen4exp", "qwen4_exp")
GATE_TYPES = ("sigmoid", "silu")

_U32, _U64, _F32, _BOOL, _STR = (GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.FLOAT32,
                                 GGUFValueType.BOOL, GGUFValueType.STRING)

# attribute -> (key without the architecture prefix, type, default or None = required)
_SCALARS: dict[str, tuple[str, GGUFValueType, Any]] = {
    "vocab_size": ("vocab_size", _U32, None),
    "hidden_size": ("embedding_length", _U32, None),
    "num_layers": ("block_count", _U32, None),
    "context_length": ("context_length", _U32, None),
    "num_heads": ("attention.head_count", _U32, None),
    "num_kv_heads": ("attention.head_count_kv", _U32, None),
    "head_dim": ("attention.key_length", _U32, None),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", _F32, None),
    "rope_theta": ("rope.freq_base", _F32, None),
    "rope_dim": ("rope.dimension_count", _U32, None),
    "n_experts": ("expert_count", _U32, None),
    "n_experts_used": ("expert_used_count", _U32, None),
    "expert_ffn": ("expert_feed_forward_length", _U32, None),
    "shared_ffn": ("expert_shared_feed_forward_length", _U32, None),
    "expert_weights_norm": ("expert_weights_norm", _BOOL, True),
    "conv_kernel": ("ssm.conv_kernel", _U32, None),
    "ssm_key_dim": ("ssm.state_size", _U32, None),
    "ssm_key_heads": ("ssm.group_count", _U32, None),
    "ssm_value_heads": ("ssm.time_step_rank", _U32, None),
    "ssm_inner": ("ssm.inner_size", _U32, None),
    "output_gate": ("ssm.output_gate", _STR, "sigmoid"),
    "hc_count": ("hyper_connection.count", _U32, None),
    "hc_rank": ("hyper_connection.low_rank", _U32, None),
    "index_heads": ("attention.indexer.head_count", _U32, 0),
    "index_dim": ("attention.indexer.key_length", _U32, 0),
    "index_budget": ("attention.indexer.top_k", _U32, 0),
    "ngram_size": ("ple.ngram_size", _U32, 0),
    "heads_per_ngram": ("ple.heads_per_ngram", _U32, 0),
    "ple_conv_kernel": ("ple.conv_kernel", _U32, 0),
    "ple_eos": ("ple.eos_token_id", _U32, 0),
    "ple_row_dim": ("embedding_length_per_layer_input", _U32, 0),
    "nextn_layers": ("nextn_predict_layers", _U32, 0),
}
# attribute -> (key, element type, required)
_ARRAYS: dict[str, tuple[str, GGUFValueType, bool]] = {
    "compress_ratios": ("attention.compress_ratios", _U32, True),
    "rope_sections": ("rope.dimension_sections", _U32, False),
    "ple_layers": ("ple.layers", _U32, False),
    "ple_multipliers": ("ple.layer_multipliers", _U64, False),
    "ple_head_offsets": ("ple.head_offsets", _U64, False),
    "ple_head_sizes": ("ple.head_vocab_sizes", _U64, False),
}


def _integer(key: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not float(value).is_integer():
        raise ModelConfigError(f"GGUF key {key!r} must be an integer, got {value!r}; re-convert the model")
    return int(value)


@attrs.frozen
class Qwen38Config:
    """Hyperparameters of one ``qwen4exp`` model (the release or a tiny test model).

    ``compress_ratios[l]`` is the QSA block length on gated-attention layers and 0 on delta-net layers;
    ``ple_layers`` are 0-based layer indices with an n-gram (PLE) block. ``num_layers`` counts the trunk only: the
    ``nextn_layers`` MTP blocks (gated attention) follow it as ``blk.{num_layers}…``, and the file's
    ``block_count`` and ``attention.compress_ratios`` include them (llama.cpp's layout).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    context_length: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_dim: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    shared_ffn: int
    expert_weights_norm: bool
    conv_kernel: int
    ssm_key_dim: int
    ssm_key_heads: int
    ssm_value_heads: int
    ssm_inner: int
    output_gate: str
    hc_count: int
    hc_rank: int
    index_heads: int
    index_dim: int
    index_budget: int
    ngram_size: int
    heads_per_ngram: int
    ple_conv_kernel: int
    ple_eos: int
    ple_row_dim: int
    compress_ratios: tuple[int, ...] = attrs.field(converter=tuple)
    nextn_layers: int = 0
    rope_sections: tuple[int, ...] = attrs.field(converter=tuple, default=())
    ple_layers: tuple[int, ...] = attrs.field(converter=tuple, default=())
    ple_multipliers: tuple[int, ...] = attrs.field(converter=tuple, default=())
    ple_head_offsets: tuple[int, ...] = attrs.field(converter=tuple, default=())
    ple_head_sizes: tuple[int, ...] = attrs.field(converter=tuple, default=())

    def __attrs_post_init__(self) -> None:
        self._validate()

    # ---- reading / writing GGUF metadata -------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Qwen38Config:
        """Read the architecture's keys (``qwen4exp.*``, or ``qwen4_exp.*`` if that is the file's spelling)."""
        arch = str(meta.get("general.architecture", ARCH))
        prefix = arch if arch in ARCHITECTURES else ARCH

        def get(key: str, default: Any) -> Any:
            full = f"{prefix}.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise ModelConfigError(f"GGUF metadata key {full!r} is missing; this file is not a complete "
                                       "Qwen3.8 (qwen4exp) model — re-convert it with `ds4 convert`")
            return default

        values: dict[str, Any] = {}
        for attr, (key, vtype, default) in _SCALARS.items():
            raw = get(key, default)
            values[attr] = (_integer(key, raw) if vtype is _U32 else bool(raw) if vtype is _BOOL
                            else str(raw) if vtype is _STR else float(raw))
        for attr, (key, _, required) in _ARRAYS.items():
            values[attr] = [_integer(key, v) for v in get(key, None if required else [])]
        values["num_layers"] -= values["nextn_layers"]
        values["compress_ratios"] = values["compress_ratios"][:values["num_layers"]]
        return cls(**values)

    def to_gguf_metadata(self) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
        """The inverse of :meth:`from_metadata`: rows ``(full key, value, type, array element type or None)``."""
        rows: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]] = []
        written = {"num_layers": self.block_count,
                   "compress_ratios": [*self.compress_ratios, *[self.index_ratio] * self.nextn_layers]}
        for attr, (key, vtype, _) in _SCALARS.items():
            rows.append((f"{ARCH}.{key}", written.get(attr, getattr(self, attr)), vtype, None))
        for attr, (key, element, _) in _ARRAYS.items():
            if getattr(self, attr):
                rows.append((f"{ARCH}.{key}", list(written.get(attr, getattr(self, attr))), GGUFValueType.ARRAY,
                             element))
        return rows

    # ---- derived values ------------------------------------------------------------------------

    @property
    def block_count(self) -> int:
        """Trunk layers plus MTP blocks."""
        return self.num_layers + self.nextn_layers

    def is_attention(self, layer: int) -> bool:
        """Gated attention with QSA selection (else a gated delta-net layer); MTP blocks are gated attention."""
        return layer >= self.num_layers or self.compress_ratios[layer] > 0

    @property
    def index_ratio(self) -> int:
        """Tokens per QSA index block (the ratio of the attention layers)."""
        return max(self.compress_ratios)

    @property
    def ple_heads(self) -> int:
        """Hash heads of one PLE layer, ``(n − 1) · heads_per_ngram``."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def conv_dim(self) -> int:
        """Channels of the delta-net short convolution: queries, keys, values."""
        return 2 * self.ssm_key_heads * self.ssm_key_dim + self.ssm_inner

    @property
    def ssm_value_dim(self) -> int:
        return self.ssm_inner // self.ssm_value_heads

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies ``[rope_dim / 2]`` float32 (text positions: every mRoPE axis is equal)."""
        i = np.arange(0, self.rope_dim, 2, dtype=np.float64)
        return (1.0 / self.rope_theta ** (i / self.rope_dim)).astype(np.float32)

    # ---- validation ----------------------------------------------------------------------------

    def _validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ModelConfigError(f"Qwen3.8 config: {message}; the GGUF metadata is inconsistent — "
                                       "re-convert the model")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "n_experts",
                     "n_experts_used", "expert_ffn", "conv_kernel", "ssm_key_dim", "ssm_key_heads",
                     "ssm_value_heads", "ssm_inner", "hc_rank"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.nextn_layers in (0, 1), f"nextn_predict_layers must be 0 or 1, got {self.nextn_layers}")
        need(not self.nextn_layers or self.index_ratio > 0, "an MTP block needs the attention layers' QSA indexer")
        need(self.hc_count > 1, f"hyper_connection.count must be > 1, got {self.hc_count}")
        need(len(self.compress_ratios) == self.num_layers,
             f"attention.compress_ratios has {len(self.compress_ratios)} entries for {self.num_layers} layers")
        need(self.num_heads % self.num_kv_heads == 0, "head_count must be a multiple of head_count_kv")
        need(self.ssm_value_heads % self.ssm_key_heads == 0, "ssm.time_step_rank must be a multiple of group_count")
        need(self.ssm_inner % self.ssm_value_heads == 0, "ssm.inner_size must be a multiple of time_step_rank")
        need(self.output_gate in GATE_TYPES, f"ssm.output_gate {self.output_gate!r} is not one of {GATE_TYPES}")
        need(self.n_experts_used <= self.n_experts, "expert_used_count exceeds expert_count")
        need(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim,
             f"rope.dimension_count {self.rope_dim} must be even and in (0, {self.head_dim}]")
        ratios = {r for r in self.compress_ratios if r}
        if ratios:
            need(len(ratios) == 1, f"every attention layer needs the same QSA block length, got {sorted(ratios)}")
            need(self.index_heads > 0 and self.rope_dim <= self.index_dim,
                 "the QSA indexer needs heads and a key_length of at least rope.dimension_count")
            need(self.index_budget > 0 and self.index_budget % self.index_ratio == 0,
                 f"attention.indexer.top_k {self.index_budget} must be a positive multiple of {self.index_ratio}")
        if self.ple_layers:
            n, heads = len(self.ple_layers), self.ple_heads
            need(self.ngram_size >= 2 and self.heads_per_ngram > 0 and self.ple_conv_kernel > 0,
                 "PLE needs ngram_size ≥ 2, heads_per_ngram and conv_kernel")
            need(all(0 <= layer < self.num_layers and not self.is_attention(layer) for layer in self.ple_layers),
                 f"ple.layers {list(self.ple_layers)} must name delta-net layers")
            need(len(self.ple_multipliers) == n * self.ngram_size,
                 f"ple.layer_multipliers needs {n * self.ngram_size} values, has {len(self.ple_multipliers)}")
            need(len(self.ple_head_offsets) == n * heads and len(self.ple_head_sizes) == n * heads,
                 f"ple.head_offsets and ple.head_vocab_sizes need {n * heads} values each")
            need(self.ple_row_dim > 0, "embedding_length_per_layer_input must be positive")
            need(max(self.ple_multipliers) * self.vocab_size < 2**63,
                 "a PLE multiplier times the vocabulary size overflows int64")
