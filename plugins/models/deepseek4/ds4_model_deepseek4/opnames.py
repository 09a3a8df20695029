"""Op names of the DeepSeek V4 graph (data only, so ``plugin.py`` can import it without numpy)."""

#: Ops a backend may add to run a decode step in fewer launches; the graph composes the same work from
#: :data:`GRAPH_OPS` where they are missing, and that composition is their reference.
FUSED_OPS: tuple[str, ...] = ("compress_step", "shared_expert", "index_select", "linears", "norm_linear",
                               "hc_pre_norm", "hc_post_pre_norm", "hc_post_head_norm", "norm_rope", "norm_rope_into",
                               "norm_rope_attention", "moe_gate_route", "norm_rope_window_attention",
                               "output_projection", "step_index")

#: Ops this plugin declares; their numpy references live in :mod:`ds4_model_deepseek4.ops`.
MODEL_OPS: tuple[str, ...] = ("fp8_kv_round", "fp4_hadamard_round", *FUSED_OPS)

#: Ops of the ``qat_rounding`` option (not needed otherwise).
QAT_OPS: tuple[str, ...] = ("fp8_kv_round", "fp4_hadamard_round")

#: Ops the graph always calls, checked against the backend before any weight loads.
GRAPH_OPS: tuple[str, ...] = (
    "embed", "linear", "grouped_linear", "rms_norm", "rope", "swiglu", "topk", "sparse_attention",
    "indexer_scores", "moe_route", "moe_experts", "hc_pre", "hc_post", "hc_head", "softmax_pool",
)
