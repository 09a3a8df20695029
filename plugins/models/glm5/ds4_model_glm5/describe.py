"""The GLM 5.x summaries ``ds4 info`` prints: layer schedule, context and decoding-state sizes."""

from __future__ import annotations

from typing import Any

from ds4_core.inspect import state_summary

from .config import GlmDsaConfig
from .next_config import Glm5NextConfig
from .next_state import state_breakdown as next_state_breakdown
from .state import state_breakdown


def _has_indexer(gguf: Any, block: int) -> bool:
    """Whether block ``block`` runs its own indexer (the loaders decide the same way, from the tensors)."""
    return f"blk.{block}.indexer.attn_k.weight" in gguf.tensors


def describe(gguf: Any) -> dict[str, str]:
    """Layers, attention, context and decoding-state sizes of a ``glm-dsa`` (GLM 5.2) GGUF."""
    cfg = GlmDsaConfig.from_metadata(gguf.metadata)
    full = tuple(_has_indexer(gguf, layer) for layer in range(cfg.num_layers))
    return {
        "layers": f"{cfg.num_layers}: MLA + DSA, {sum(full)} with their own indexer, {cfg.leading_dense} dense",
        "attention": f"{cfg.num_heads} heads, MLA latent {cfg.kv_lora_rank} + rope {cfg.rope_dim}, "
                     f"indexer {cfg.index_n_heads}×{cfg.index_head_dim} top-{cfg.index_topk}",
        "context": f"{cfg.context_length} tokens",
        **state_summary(lambda ctx: state_breakdown(cfg, full, ctx), cfg.context_length),
    }


def describe_next(gguf: Any) -> dict[str, str]:
    """Layers, attention, context and decoding-state sizes of a ``glm5-next`` (GLM 5.3 Flash) GGUF."""
    cfg = Glm5NextConfig.from_metadata(gguf.metadata)
    indexed = tuple(cfg.is_dsa(b) and _has_indexer(gguf, b) for b in range(cfg.num_layers))
    dsa = sum(cfg.is_dsa(b) for b in range(cfg.num_layers))
    return {
        "layers": f"{cfg.num_layers}: {cfg.num_layers - dsa} KDA, {dsa} MLA + pooled indexer "
                  f"({sum(indexed)} with their own)",
        "attention": f"{cfg.num_heads} heads, MLA latent {cfg.kv_lora_rank}, indexer {cfg.index_n_heads}×"
                     f"{cfg.index_head_dim} top-{cfg.index_topk} in pools of {cfg.index_pool}; "
                     f"KDA {cfg.kda_heads}×{cfg.kda_head_dim}, conv {cfg.kda_conv}",
        "context": f"{cfg.context_length} tokens",
        **state_summary(lambda ctx: next_state_breakdown(cfg, ctx, indexed), cfg.context_length),
    }
