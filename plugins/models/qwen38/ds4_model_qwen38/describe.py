"""The Qwen3.8 summary ``ds4 info`` prints."""

from __future__ import annotations

from typing import Any

from ds4_core.inspect import state_summary

from .config import Qwen38Config
from .state import state_breakdown


def describe(gguf: Any) -> dict[str, str]:
    """Layer schedule, attention, delta-net, MoE, n-gram and decoding-state figures of a ``qwen4exp`` GGUF."""
    cfg = Qwen38Config.from_metadata(gguf.metadata)
    attention = sum(cfg.is_attention(i) for i in range(cfg.num_layers))
    table = gguf.tensors.get("per_layer_token_embd.weight")
    return {
        "model": "Qwen3.8 Flash Next" if cfg.hidden_size == 2560 and cfg.num_layers == 48 else "Qwen3.8 (custom size)",
        "layers": f"{cfg.num_layers}: {cfg.num_layers - attention} gated delta-net, {attention} gated attention",
        "attention": f"{cfg.num_heads} heads × {cfg.head_dim}, {cfg.num_kv_heads} KV heads, rope {cfg.rope_dim}, "
                     f"QSA blocks of {cfg.index_ratio if attention else 0}, budget {cfg.index_budget}",
        "delta-net": f"{cfg.ssm_key_heads} key / {cfg.ssm_value_heads} value heads, "
                     f"dk {cfg.ssm_key_dim}, dv {cfg.ssm_value_dim}, {cfg.output_gate} gate",
        "experts": f"{cfg.n_experts} routed ({cfg.n_experts_used} active, width {cfg.expert_ffn}) + 1 shared",
        "hyper-connections": f"{cfg.hc_count} streams, rank {cfg.hc_rank}",
        "n-gram embeddings": (f"layers {list(cfg.ple_layers)}, {table.shape[0]} rows on disk ({table.type_name})"
                              if cfg.ple_layers and table else "none"),
        "context": f"{cfg.context_length} tokens",
        **state_summary(lambda ctx: state_breakdown(cfg, ctx), cfg.context_length),
    }
