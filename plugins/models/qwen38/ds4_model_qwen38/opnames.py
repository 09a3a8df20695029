"""Op names of the Qwen3.8 graph (data only, so ``plugin.py`` can import it without numpy)."""

#: Ops this plugin declares; their numpy references live in :mod:`ds4_model_qwen38.ops`.
MODEL_OPS: tuple[str, ...] = ("rope_half", "hc_mix", "gqa_attention", "moe_route_softmax")

#: Ops the graph calls, checked against the backend before any weight loads.
GRAPH_OPS: tuple[str, ...] = (
    "embed", "linear", "rms_norm", "swiglu", "topk", "indexer_scores", "moe_experts", "short_conv",
    "gated_delta_rule", "gated_delta_rule_chunked", *MODEL_OPS,
)
