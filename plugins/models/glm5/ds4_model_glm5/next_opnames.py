"""Op names of the GLM 5.3 Flash (``glm5-next``) graph (data only, so ``plugin.py`` can import it without numpy)."""

#: Ops this module declares; each numpy reference is ``ds4_model_glm5.next_ops:<op name>``.
NEXT_MODEL_OPS: tuple[str, ...] = ("glm5_hc_pre", "glm5_hc_post", "glm5_pool_softmax")

#: Ops the GLM 5.3 Flash graph calls, checked against the backend before any weight loads
#: (``layer_norm`` and ``moe_route_sigmoid`` are declared by the GLM 5.2 module of this package).
NEXT_GRAPH_OPS: tuple[str, ...] = (
    "embed", "linear", "grouped_linear", "rms_norm", "swiglu", "topk", "sparse_attention", "indexer_scores",
    "moe_experts", "short_conv", "gated_delta_rule", "gated_delta_rule_chunked", "layer_norm", "moe_route_sigmoid",
    *NEXT_MODEL_OPS,
)
