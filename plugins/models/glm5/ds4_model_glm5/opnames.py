"""Op names of the GLM 5.2 (``glm-dsa``) graph (data only, so ``plugin.py`` can import it without numpy)."""

#: Ops this module declares; their numpy references live in :mod:`ds4_model_glm5.ops`.
MODEL_OPS: tuple[str, ...] = ("layer_norm", "moe_route_sigmoid")

#: Ops the GLM 5.2 graph calls, checked against the backend before any weight loads.
GRAPH_OPS: tuple[str, ...] = (
    "embed", "linear", "grouped_linear", "rms_norm", "rope", "swiglu", "topk", "sparse_attention",
    "indexer_scores", "moe_experts", "layer_norm", "moe_route_sigmoid",
)
