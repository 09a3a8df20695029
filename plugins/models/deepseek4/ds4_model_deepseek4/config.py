"""DeepSeek V4 hyperparameters, read from (and written to) the ``deepseek4.*`` GGUF metadata (spec §12.2)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from gguf import GGUFValueType

from ds4_core.errors import ModelConfigError

ARCH = "deepseek4"
CSA_RATIO = 4
_U32, _F32, _BOOL, _ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL, GGUFValueType.ARRAY

# attribute -> (metadata key without the "deepseek4." prefix, value type); the per-layer lists are separate.
_SCALARS: dict[str, tuple[str, GGUFValueType]] = {
    "vocab_size": ("vocab_size", _U32),
    "hidden_size": ("embedding_length", _U32),
    "num_layers": ("block_count", _U32),
    "context_length": ("context_length", _U32),
    "num_heads": ("attention.head_count", _U32),
    "num_kv_heads": ("attention.head_count_kv", _U32),
    "head_dim": ("attention.key_length", _U32),
    "value_dim": ("attention.value_length", _U32),
    "rope_dim": ("rope.dimension_count", _U32),
    "q_lora_rank": ("attention.q_lora_rank", _U32),
    "o_lora_rank": ("attention.output_lora_rank", _U32),
    "o_groups": ("attention.output_group_count", _U32),
    "n_experts": ("expert_count", _U32),
    "n_experts_used": ("expert_used_count", _U32),
    "expert_ffn": ("expert_feed_forward_length", _U32),
    "n_shared_experts": ("expert_shared_count", _U32),
    "n_hash_layers": ("hash_layer_count", _U32),
    "sliding_window": ("attention.sliding_window", _U32),
    "index_n_heads": ("attention.indexer.head_count", _U32),
    "index_head_dim": ("attention.indexer.key_length", _U32),
    "index_topk": ("attention.indexer.top_k", _U32),
    "hc_mult": ("hyper_connection.count", _U32),
    "hc_sinkhorn_iters": ("hyper_connection.sinkhorn_iterations", _U32),
    "hc_eps": ("hyper_connection.epsilon", _F32),
    "rope_theta": ("rope.freq_base", _F32),
    "compress_rope_theta": ("attention.compress_rope_freq_base", _F32),
    "yarn_factor": ("rope.scaling.factor", _F32),
    "yarn_original_context": ("rope.scaling.original_context_length", _U32),
    "yarn_beta_fast": ("rope.scaling.yarn_beta_fast", _F32),
    "yarn_beta_slow": ("rope.scaling.yarn_beta_slow", _F32),
    "routed_scaling_factor": ("expert_weights_scale", _F32),
    "expert_weights_norm": ("expert_weights_norm", _BOOL),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", _F32),
}


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not float(value).is_integer():
        raise ModelConfigError(f"GGUF key {key!r} must be an integer, got {value!r}; re-convert the model")
    return int(value)


@attrs.frozen
class DeepSeekV4Config:
    """Hyperparameters of one DeepSeek V4 model (Flash, Pro or a tiny test model).

    ``compress_ratios[l]`` is 0 (sliding window only), 4 (CSA: overlapping windows + indexer)
    or a larger HCA ratio (128 in the released models); ``swiglu_limits[l]`` is the layer's clamp.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    context_length: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    n_shared_experts: int
    n_hash_layers: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn_factor: float
    yarn_original_context: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    routed_scaling_factor: float
    expert_weights_norm: bool
    rms_norm_eps: float
    compress_ratios: tuple[int, ...] = attrs.field(converter=tuple)
    swiglu_limits: tuple[float, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        self._validate()

    # ---- reading / writing GGUF metadata -------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> DeepSeekV4Config:
        """Read ``deepseek4.*`` keys from a GGUF metadata mapping (key -> Python/numpy value)."""

        def get(key: str) -> Any:
            full = f"{ARCH}.{key}"
            if full not in meta:
                raise ModelConfigError(f"GGUF metadata key {full!r} is missing; this file is not a complete "
                                       "DeepSeek V4 (deepseek4) model — re-convert it with `ds4 convert`")
            return meta[full]

        values: dict[str, Any] = {}
        for attr, (key, vtype) in _SCALARS.items():
            raw = get(key)
            if vtype is _U32:
                values[attr] = _to_int(key, raw)
            elif vtype is _BOOL:
                values[attr] = bool(raw)
            else:
                values[attr] = float(raw)
        n = values["num_layers"]
        ratios = [_to_int("attention.compress_ratios", r) for r in np.asarray(get("attention.compress_ratios"))]
        limits = [float(v) for v in np.asarray(get("swiglu_clamp_exp"))]
        if len(ratios) < n or len(limits) < n:
            raise ModelConfigError(f"deepseek4.attention.compress_ratios ({len(ratios)}) and "
                                   f"deepseek4.swiglu_clamp_exp ({len(limits)}) need one entry per layer ({n})")
        for key in ("expert_group_count", "expert_group_used_count"):
            if meta.get(f"{ARCH}.{key}", 0):
                raise ModelConfigError(f"deepseek4.{key} must be 0: DeepSeek V4 has no grouped expert routing")
        return cls(**values, compress_ratios=ratios[:n], swiglu_limits=limits[:n])

    def to_gguf_metadata(self) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
        """The inverse of :meth:`from_metadata`: full key -> (value, GGUF type, array element type or None),
        ready for ``GGUFWriter.add_key_value(key, value, vtype, sub_type=...)``."""
        out: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}
        for attr, (key, vtype) in _SCALARS.items():
            out[f"{ARCH}.{key}"] = (getattr(self, attr), vtype, None)
        out[f"{ARCH}.attention.compress_ratios"] = (list(self.compress_ratios), _ARR, _U32)
        out[f"{ARCH}.swiglu_clamp_exp"] = (list(self.swiglu_limits), _ARR, _F32)
        return out

    # ---- derived values ------------------------------------------------------------------------

    @property
    def variant(self) -> str:
        """``"flash"``, ``"pro"`` or ``"custom"``, told apart by the published dimensions."""
        dims = (self.hidden_size, self.num_layers, self.n_experts)
        return {(4096, 43, 256): "flash", (7168, 61, 384): "pro"}.get(dims, "custom")

    def layer_kind(self, layer: int) -> str:
        """``"sliding"``, ``"csa"`` or ``"hca"``."""
        m = self.compress_ratios[layer]
        return "sliding" if m == 0 else "csa" if m == CSA_RATIO else "hca"

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def main_inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies of sliding-only layers, ``[rope_dim / 2]`` float32."""
        i = np.arange(0, self.rope_dim, 2, dtype=np.float64)
        return (self.rope_theta ** (-i / self.rope_dim)).astype(np.float32)

    def compress_inv_freq(self) -> np.ndarray:
        """YaRN inverse frequencies (no magnitude scale) of CSA/HCA layers, ``[rope_dim / 2]`` float32 (spec §2)."""
        rd, base = self.rope_dim, self.compress_rope_theta
        i = np.arange(0, rd, 2, dtype=np.float64)
        f = base ** (-i / rd)

        def corr(rot: float) -> float:
            return rd * math.log(self.yarn_original_context / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(corr(self.yarn_beta_fast)), 0)
        hi = min(math.ceil(corr(self.yarn_beta_slow)), rd - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(rd // 2) - lo) / (hi - lo), 0, 1)
        return (f / self.yarn_factor * ramp + f * (1 - ramp)).astype(np.float32)

    # ---- validation ----------------------------------------------------------------------------

    def _validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ModelConfigError(f"DeepSeek V4 config: {message}; the GGUF metadata is inconsistent — "
                                       "re-convert the model")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
                     "o_lora_rank", "o_groups", "n_experts", "n_experts_used", "expert_ffn", "sliding_window",
                     "hc_mult", "hc_sinkhorn_iters"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.num_kv_heads == 1, f"head_count_kv must be 1 (one shared K=V head), got {self.num_kv_heads}")
        need(self.value_dim == self.head_dim, f"value_length {self.value_dim} must equal key_length {self.head_dim}")
        need(self.num_heads % self.o_groups == 0,
             f"output_group_count {self.o_groups} must divide head_count {self.num_heads}")
        need(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim,
             f"rope.dimension_count {self.rope_dim} must be even and in (0, {self.head_dim}]")
        need(self.n_experts_used <= self.n_experts,
             f"expert_used_count {self.n_experts_used} exceeds expert_count {self.n_experts}")
        need(self.n_shared_experts == 1, f"expert_shared_count must be 1, got {self.n_shared_experts}")
        need(0 <= self.n_hash_layers <= self.num_layers, f"hash_layer_count {self.n_hash_layers} is out of range")
        need(self.expert_weights_norm, "expert_weights_norm must be true (routed weights are always renormalised)")
        need(self.yarn_factor > 0 and self.yarn_original_context > 0, "rope.scaling factor/context must be positive")
        need(len(self.compress_ratios) == self.num_layers and len(self.swiglu_limits) == self.num_layers,
             "compress_ratios and swiglu_clamp_exp need one entry per layer")
        for layer, m in enumerate(self.compress_ratios):
            need(m == 0 or m >= CSA_RATIO,
                 f"compress ratio {m} of layer {layer} is not 0 (sliding), 4 (CSA) or a larger HCA ratio (128)")
        if CSA_RATIO in self.compress_ratios:
            need(self.index_n_heads > 0 and self.index_topk > 0, "CSA layers need indexer heads and a top-k")
            need(self.rope_dim <= self.index_head_dim,
                 f"rope.dimension_count {self.rope_dim} exceeds indexer key_length {self.index_head_dim}")
