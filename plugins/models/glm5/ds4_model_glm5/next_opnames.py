"""Op names of the GLM 5.3 Flash (``glm5-next``) graph (data only, so ``plugin.py`` can import it without numpy)."""

#: Ops the GLM 5.3 Flash graph calls, checked against the backend before any weight loads
#: (``layer_norm`` and ``moe_route_sigmoid`` are declared by the GLM 5.2 module of this package).
NEXT_GRAPH_OPS: tuple[str, ...] = (
    "embed", "linear", "grouped_linear", "rms_norm", "swiglu", "topk", "sparse_attention", "indexer_scores",
    "moe_experts", "short_conv", "gated_delta_rule", "gated_delta_rule_chunked", "layer_norm", "moe_route_sigmoid",
    "hc_pre", "hc_post", "softmax_pool",
)
