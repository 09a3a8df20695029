"""GLM 5.3 Flash hyperparameters, read from (and written to) the ``glm5-next.*`` GGUF metadata (spec §10.3)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from gguf import GGUFValueType

from ds4_core.errors import ModelConfigError

ARCH = "glm5-next"
KDA, DSA = 0, 1  # values of the per-block ``layer_types`` array
_U32, _F32, _BOOL, _ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL, GGUFValueType.ARRAY

# attribute -> (metadata key without the "glm5-next." prefix, value type, default or None when required).
_SCALARS: dict[str, tuple[str, GGUFValueType, Any]] = {
    "vocab_size": ("vocab_size", _U32, None),
    "hidden_size": ("embedding_length", _U32, None),
    "block_count": ("block_count", _U32, None),
    "num_layers": ("trunk_block_count", _U32, None),
    "n_nextn": ("nextn_predict_layers", _U32, 0),
    "context_length": ("context_length", _U32, None),
    "ffn": ("feed_forward_length", _U32, None),
    "expert_ffn": ("expert_feed_forward_length", _U32, None),
    "n_experts": ("expert_count", _U32, None),
    "n_experts_used": ("expert_used_count", _U32, None),
    "n_shared_experts": ("expert_shared_count", _U32, None),
    "n_expert_groups": ("expert_group_count", _U32, 1),
    "n_expert_groups_used": ("expert_group_used_count", _U32, 1),
    "n_dense_layers": ("leading_dense_block_count", _U32, None),
    "routed_scaling_factor": ("expert_weights_scale", _F32, None),
    "expert_weights_norm": ("expert_weights_norm", _BOOL, None),
    "swiglu_limit": ("swiglu_limit", _F32, None),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", _F32, None),
    "num_heads": ("attention.head_count", _U32, None),
    "key_length": ("attention.key_length", _U32, None),
    "value_length": ("attention.value_length", _U32, None),
    "q_lora_rank": ("attention.q_lora_rank", _U32, None),
    "kv_lora_rank": ("attention.kv_lora_rank", _U32, None),
    "rope_dim": ("attention.rope_dimension_count", _U32, 0),
    "index_n_heads": ("attention.indexer.head_count", _U32, None),
    "index_head_dim": ("attention.indexer.key_length", _U32, None),
    "index_topk": ("attention.indexer.top_k", _U32, None),
    "index_pool": ("attention.indexer.pool_size", _U32, None),
    "kda_heads": ("linear_attention.head_count", _U32, None),
    "kda_head_dim": ("linear_attention.head_dimension", _U32, None),
    "kda_conv": ("linear_attention.conv_kernel", _U32, None),
    "kda_lower_bound": ("linear_attention.gate_lower_bound", _F32, None),
    "hc_mult": ("hyper_connection.count", _U32, None),
    "hc_sinkhorn_iters": ("hyper_connection.sinkhorn_iterations", _U32, None),
    "hc_eps": ("hyper_connection.epsilon", _F32, None),
}


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not float(value).is_integer():
        raise ModelConfigError(f"GGUF key {ARCH}.{key} must be an integer, got {value!r}; re-convert the model")
    return int(value)


@attrs.frozen
class Glm5NextConfig:
    """Hyperparameters of one GLM 5.3 Flash model (the release or a tiny test model).

    ``num_layers`` trunk blocks are followed by ``n_nextn`` MTP blocks (``block_count`` in all);
    ``layer_types[b]`` is :data:`KDA` or :data:`DSA` for every block b (MTP blocks are DSA).
    """

    vocab_size: int
    hidden_size: int
    block_count: int
    num_layers: int
    n_nextn: int
    context_length: int
    ffn: int
    expert_ffn: int
    n_experts: int
    n_experts_used: int
    n_shared_experts: int
    n_expert_groups: int
    n_expert_groups_used: int
    n_dense_layers: int
    routed_scaling_factor: float
    expert_weights_norm: bool
    swiglu_limit: float
    rms_norm_eps: float
    num_heads: int
    key_length: int
    value_length: int
    q_lora_rank: int
    kv_lora_rank: int
    rope_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_pool: int
    kda_heads: int
    kda_head_dim: int
    kda_conv: int
    kda_lower_bound: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    layer_types: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Glm5NextConfig:
        """Read ``glm5-next.*`` keys from a GGUF metadata mapping (key -> Python/numpy value)."""
        values: dict[str, Any] = {}
        for attr, (key, vtype, default) in _SCALARS.items():
            full = f"{ARCH}.{key}"
            if full not in meta and default is None:
                raise ModelConfigError(f"GGUF metadata key {full!r} is missing; this file is not a complete GLM 5.3 "
                                       "Flash (glm5-next) model — re-convert it with `ds4 convert`")
            raw = meta.get(full, default)
            values[attr] = _to_int(key, raw) if vtype is _U32 else bool(raw) if vtype is _BOOL else float(raw)
        if f"{ARCH}.layer_types" not in meta:
            raise ModelConfigError(f"GGUF metadata key '{ARCH}.layer_types' is missing; this file is not a complete "
                                   "glm5-next model — re-convert it with `ds4 convert`")
        types = [_to_int("layer_types", t) for t in np.asarray(meta[f"{ARCH}.layer_types"]).reshape(-1)]
        return cls(**values, layer_types=types)

    def to_gguf_metadata(self) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
        """The inverse of :meth:`from_metadata`: full key -> (value, GGUF type, array element type or None)."""
        out: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}
        for attr, (key, vtype, _) in _SCALARS.items():
            out[f"{ARCH}.{key}"] = (getattr(self, attr), vtype, None)
        out[f"{ARCH}.layer_types"] = (list(self.layer_types), _ARR, _U32)
        return out

    def is_dsa(self, block: int) -> bool:
        return self.layer_types[block] == DSA

    def is_dense(self, block: int) -> bool:
        """Dense SwiGLU MLP (the leading blocks) rather than MoE."""
        return block < self.n_dense_layers

    def _validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ModelConfigError(f"GLM 5.3 Flash config: {message}; the GGUF metadata is inconsistent — "
                                       "re-convert the model")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "key_length", "value_length",
                     "q_lora_rank", "kv_lora_rank", "n_experts", "n_experts_used", "expert_ffn", "kda_heads",
                     "kda_head_dim", "kda_conv", "hc_mult", "hc_sinkhorn_iters", "index_pool"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.block_count == self.num_layers + self.n_nextn,
             f"block_count {self.block_count} must be trunk_block_count {self.num_layers} + nextn_predict_layers "
             f"{self.n_nextn}")
        need(len(self.layer_types) == self.block_count,
             f"layer_types has {len(self.layer_types)} entries for {self.block_count} blocks")
        need(set(self.layer_types) <= {KDA, DSA}, f"layer_types holds values other than 0 (KDA) and 1 (DSA): "
             f"{sorted(set(self.layer_types))}")
        need(all(self.is_dsa(b) for b in range(self.num_layers, self.block_count)), "MTP blocks must be DSA blocks")
        need(self.rope_dim == 0, f"rope_dimension_count must be 0 (GLM 5.3 Flash has no RoPE), got {self.rope_dim}")
        need(self.n_experts_used <= self.n_experts,
             f"expert_used_count {self.n_experts_used} exceeds expert_count {self.n_experts}")
        need(self.n_expert_groups >= 1 and self.n_experts % self.n_expert_groups == 0
             and 1 <= self.n_expert_groups_used <= self.n_expert_groups,
             f"expert groups {self.n_expert_groups_used} of {self.n_expert_groups} do not fit {self.n_experts} experts")
        need(self.n_shared_experts >= 1, "expert_shared_count must be at least 1")
        need(0 <= self.n_dense_layers <= self.num_layers, f"leading_dense_block_count {self.n_dense_layers} is out "
             "of range")
        need(self.index_topk % self.index_pool == 0,
             f"indexer top_k {self.index_topk} must be a multiple of pool_size {self.index_pool}")
        need(self.kda_lower_bound < 0, f"gate_lower_bound must be negative, got {self.kda_lower_bound}")
        if DSA in self.layer_types:
            need(self.index_n_heads > 0 and self.index_head_dim > 0 and self.index_topk > 0,
                 "DSA blocks need indexer heads, a key length and a top-k")
