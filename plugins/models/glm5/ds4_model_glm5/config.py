"""GLM 5.2 hyperparameters, read from (and written to) the ``glm-dsa.*`` GGUF metadata (spec §10.2).

The IndexShare schedule is not metadata: a layer runs its own indexer exactly when the file holds its
``indexer.*`` tensors (shared layers have none), which also reads ds4's GLM-5.2 files correctly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from gguf import GGUFValueType

from ds4_core.errors import ModelConfigError

ARCH = "glm-dsa"
#: ``expert_gating_func`` value of sigmoid scoring (llama.cpp's enum), the only one GLM 5 uses.
GATING_SIGMOID = 2
#: Epsilon of ``q_a_layernorm`` / ``kv_a_layernorm`` (a constructor default in transformers, not the config's).
LATENT_NORM_EPS = 1e-6
#: Epsilon of the indexer key LayerNorm.
INDEXER_NORM_EPS = 1e-6
_U32, _F32, _BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL

# attribute -> (metadata key without the "glm-dsa." prefix, value type)
_SCALARS: dict[str, tuple[str, GGUFValueType]] = {
    "vocab_size": ("vocab_size", _U32),
    "hidden_size": ("embedding_length", _U32),
    "block_count": ("block_count", _U32),
    "nextn_layers": ("nextn_predict_layers", _U32),
    "context_length": ("context_length", _U32),
    "ffn": ("feed_forward_length", _U32),
    "num_heads": ("attention.head_count", _U32),
    "num_kv_heads": ("attention.head_count_kv", _U32),
    "key_length": ("attention.key_length", _U32),
    "value_length": ("attention.value_length", _U32),
    "qk_head_dim": ("attention.key_length_mla", _U32),
    "v_head_dim": ("attention.value_length_mla", _U32),
    "rope_dim": ("rope.dimension_count", _U32),
    "rope_theta": ("rope.freq_base", _F32),
    "q_lora_rank": ("attention.q_lora_rank", _U32),
    "kv_lora_rank": ("attention.kv_lora_rank", _U32),
    "n_experts": ("expert_count", _U32),
    "n_experts_used": ("expert_used_count", _U32),
    "expert_ffn": ("expert_feed_forward_length", _U32),
    "n_shared_experts": ("expert_shared_count", _U32),
    "n_group": ("expert_group_count", _U32),
    "topk_group": ("expert_group_used_count", _U32),
    "gating_func": ("expert_gating_func", _U32),
    "leading_dense": ("leading_dense_block_count", _U32),
    "index_n_heads": ("attention.indexer.head_count", _U32),
    "index_head_dim": ("attention.indexer.key_length", _U32),
    "index_topk": ("attention.indexer.top_k", _U32),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", _F32),
    "routed_scaling_factor": ("expert_weights_scale", _F32),
    "expert_weights_norm": ("expert_weights_norm", _BOOL),
}


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not float(value).is_integer():
        raise ModelConfigError(f"GGUF key {ARCH}.{key} must be an integer, got {value!r}; re-convert the model")
    return int(value)


@attrs.frozen
class GlmDsaConfig:
    """Hyperparameters of one GLM 5.2-style model (GLM-5, 5.1, 5.2, full 5.3, or a tiny test model).

    ``block_count`` includes the ``nextn_layers`` MTP blocks stored after the trunk; the MLA sizes follow
    llama.cpp: ``key_length = kv_lora_rank + rope_dim`` (the cached row), ``value_length = kv_lora_rank``,
    ``qk_head_dim = nope + rope`` and ``v_head_dim`` per head after decompression.
    """

    vocab_size: int
    hidden_size: int
    block_count: int
    nextn_layers: int
    context_length: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    key_length: int
    value_length: int
    qk_head_dim: int
    v_head_dim: int
    rope_dim: int
    rope_theta: float
    q_lora_rank: int
    kv_lora_rank: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    gating_func: int
    leading_dense: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    routed_scaling_factor: float
    expert_weights_norm: bool

    def __attrs_post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> GlmDsaConfig:
        """Read ``glm-dsa.*`` keys from a GGUF metadata mapping (key -> Python/numpy value)."""
        values: dict[str, Any] = {}
        for attr, (key, vtype) in _SCALARS.items():
            full = f"{ARCH}.{key}"
            if full not in meta:
                raise ModelConfigError(f"GGUF metadata key {full!r} is missing; this file is not a complete GLM 5.2 "
                                       "(glm-dsa) model — re-convert it with `ds4 convert`")
            raw = meta[full]
            values[attr] = _to_int(key, raw) if vtype is _U32 else bool(raw) if vtype is _BOOL else float(raw)
        return cls(**values)

    def to_gguf_metadata(self) -> list[tuple[str, Any, GGUFValueType, None]]:
        """The inverse of :meth:`from_metadata`: rows ``(full key, value, GGUF type, None)`` for ``add_key_value``."""
        return [(f"{ARCH}.{key}", getattr(self, attr), vtype, None) for attr, (key, vtype) in _SCALARS.items()]

    # ---- derived values ------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Trunk layers (the MTP blocks excluded)."""
        return self.block_count - self.nextn_layers

    @property
    def nope_dim(self) -> int:
        """Per-head query/key channels without RoPE."""
        return self.qk_head_dim - self.rope_dim

    def is_dense(self, layer: int) -> bool:
        return layer < self.leading_dense

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies ``theta^(-2i/rope_dim)``, ``[rope_dim / 2]`` float32."""
        i = np.arange(0, self.rope_dim, 2, dtype=np.float64)
        return (self.rope_theta ** (-i / self.rope_dim)).astype(np.float32)

    def _validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ModelConfigError(f"GLM 5.2 config: {message}; the GGUF metadata is inconsistent — "
                                       "re-convert the model")

        for name in ("vocab_size", "hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                     "v_head_dim", "n_experts", "n_experts_used", "expert_ffn", "n_group", "topk_group",
                     "index_n_heads", "index_head_dim", "index_topk", "context_length"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(0 <= self.nextn_layers < self.block_count, f"nextn_predict_layers {self.nextn_layers} leaves no trunk "
             f"in block_count {self.block_count}")
        need(self.num_kv_heads == 1, f"head_count_kv must be 1 (MLA caches one latent row), got {self.num_kv_heads}")
        need(self.key_length == self.kv_lora_rank + self.rope_dim,
             f"key_length {self.key_length} must be kv_lora_rank + rope dimension "
             f"({self.kv_lora_rank} + {self.rope_dim})")
        need(self.value_length == self.kv_lora_rank,
             f"value_length {self.value_length} must equal kv_lora_rank {self.kv_lora_rank}")
        need(self.rope_dim % 2 == 0 and 0 < self.rope_dim < self.qk_head_dim,
             f"rope.dimension_count {self.rope_dim} must be even and below key_length_mla {self.qk_head_dim}")
        need(self.rope_dim <= self.index_head_dim,
             f"rope.dimension_count {self.rope_dim} exceeds the indexer key_length {self.index_head_dim}")
        need(self.gating_func == GATING_SIGMOID, f"expert_gating_func must be {GATING_SIGMOID} (sigmoid), "
             f"got {self.gating_func}")
        need(self.n_experts % self.n_group == 0 and self.n_experts // self.n_group >= 2,
             f"expert_group_count {self.n_group} must split expert_count {self.n_experts} into groups of ≥ 2")
        need(self.topk_group <= self.n_group, f"expert_group_used_count {self.topk_group} exceeds "
             f"expert_group_count {self.n_group}")
        need(self.n_experts_used <= self.n_experts // self.n_group * self.topk_group,
             f"expert_used_count {self.n_experts_used} exceeds the experts of the kept groups")
        need(self.n_shared_experts >= 1, f"expert_shared_count must be ≥ 1, got {self.n_shared_experts}")
        need(0 <= self.leading_dense <= self.num_layers, f"leading_dense_block_count {self.leading_dense} is out "
             "of range")
