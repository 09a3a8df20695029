"""The DeepSeek V4 summary ``ds4 info`` prints."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ds4_core.inspect import state_summary

from .config import DeepSeekV4Config
from .state import state_breakdown


def describe(gguf: Any) -> dict[str, str]:
    """Variant, layer schedule, attention, MoE, context and decoding-state figures of a ``deepseek4`` GGUF."""
    cfg = DeepSeekV4Config.from_metadata(gguf.metadata)
    kinds = Counter(cfg.layer_kind(i) for i in range(cfg.num_layers))
    experts = gguf.tensors.get("blk.0.ffn_gate_exps.weight") or gguf.tensors.get(
        f"blk.{cfg.num_layers - 1}.ffn_gate_exps.weight")
    return {
        "model": {"flash": "DeepSeek V4 Flash", "pro": "DeepSeek V4 PRO"}.get(cfg.variant, "DeepSeek V4 (custom size)"),
        "layers": f"{cfg.num_layers}: {kinds['sliding']} sliding, {kinds['csa']} CSA (m=4), {kinds['hca']} HCA "
                  f"(m={max(cfg.compress_ratios)}); {cfg.n_hash_layers} hash-routed",
        "attention": f"{cfg.num_heads} heads × {cfg.head_dim}, 1 shared KV head, rope {cfg.rope_dim}, "
                     f"window {cfg.sliding_window}, "
                     f"indexer {cfg.index_n_heads}×{cfg.index_head_dim} top-{cfg.index_topk}",
        "experts": f"{cfg.n_experts} routed ({cfg.n_experts_used} active, width {cfg.expert_ffn}) + "
                   f"{cfg.n_shared_experts} shared" + (f", {experts.type_name}" if experts else ""),
        "hyper-connections": f"{cfg.hc_mult} streams, {cfg.hc_sinkhorn_iters} Sinkhorn iterations",
        "context": f"{cfg.context_length} tokens (YaRN ×{cfg.yarn_factor:g} on compressed layers)",
        "MTP block": (f"present ({sum(n.startswith('mtp.0.') for n in gguf.tensors)} mtp.0.* tensors; a drafter "
                      "of the token after next)" if "mtp.0.e_proj.weight" in gguf.tensors else "none in this file"),
        **state_summary(lambda ctx: state_breakdown(cfg, ctx), cfg.context_length),
    }
