"""GLM 5.3 Flash (``glm5-next``) for ``ds4 bench --synthetic glm53-flash``: the weight plan and state reads of one
decode token.

Shapes and formats follow the published ds4 GGUFs (spec glm5.md §2.2, §10.3). Where the spec names no format
(KDA gates/beta/output, MLA projections, dense FFN) the plan uses Q8_0, ds4's format for attention and shared
matrices; in Q2 files the KDA q/k projections are Q4_K.
"""

from __future__ import annotations

from .synthetic_plan import Matrix, Plan, RoutedExperts, SyntheticModel, selected_tokens, state_rows

#: GLM 5.3 Flash text dimensions (spec glm5.md §2.2); ``index_pool`` tokens per pooled indexer key.
GLM53_FLASH: dict[str, int] = {"hidden": 4096, "layers": 45, "vocab": 154880, "dense_layers": 3, "dense_inter": 12288,
                               "q_lora": 1536, "kv_lora": 512, "heads": 64, "head_dim": 256, "index_heads": 32,
                               "index_dim": 128, "index_topk": 2048, "index_pool": 4, "linear_heads": 64,
                               "linear_dim": 128, "experts": 288, "k": 8, "inter": 2048, "hc": 4}
#: Per recipe: routed gate/up format, routed down format, KDA q/k format.
RECIPES: dict[str, tuple[str, str, str]] = {"q2": ("IQ2_XXS", "Q2_K", "Q4_K"), "q4": ("Q4_K", "Q4_K", "Q8_0")}


def is_dsa_layer(layer: int) -> bool:
    """Layer ``i`` is MLA + pooled DSA indexer when ``i % 4 == 3``, else Kimi delta attention (spec §2.3)."""
    return layer % 4 == 3


def decode_plan(recipe: str, layers: int, shapes: dict[str, int] = GLM53_FLASH) -> Plan:
    """The matrices one batch-1 token reads in decoder layers ``0 .. layers-1`` of a ``glm5-next`` model, then the
    output head (the final hyper-connection collapse is a plain mean: no matrix).

    Per layer: the attention HC mix (BF16 ``[(2+N)·N, N·H]``); KDA (q, k, v, the low-rank forget and output gates,
    beta, output) or DSA (q_a, q_b, kv_a, per-head ``attn_k_b``/``attn_v_b`` as one grouped launch each, output,
    and the BF16 indexer q_b, k, head weights and pool gate); the FFN HC mix; then a dense SwiGLU (first
    ``dense_layers``) or the F32 router, ``k`` routed experts and the Q8_0 shared expert.
    """
    s = shapes
    D, n, hd = s["hidden"], s["hc"], s["head_dim"]
    lh, ld = s["linear_heads"], s["linear_dim"]
    gate_up, down, kda_qk = RECIPES[recipe]
    plan: Plan = []
    for i in range(layers):
        p = f"blk.{i}."
        plan.append(Matrix(p + "hc_attn_fn", "BF16", (2 + n) * n, n * D))
        if is_dsa_layer(i):
            plan += [Matrix(p + "attn_q_a", "Q8_0", s["q_lora"], D),
                     Matrix(p + "attn_q_b", "Q8_0", s["heads"] * hd, s["q_lora"]),
                     Matrix(p + "attn_kv_a_mqa", "Q8_0", s["kv_lora"], D),
                     Matrix(p + "indexer.attn_q_b", "BF16", s["index_heads"] * s["index_dim"], s["q_lora"]),
                     Matrix(p + "indexer.attn_k", "BF16", s["index_dim"], D),
                     Matrix(p + "indexer.pool_gate", "BF16", s["index_dim"], D),
                     Matrix(p + "indexer.proj", "BF16", s["index_heads"], D),
                     Matrix(p + "attn_k_b", "Q8_0", s["kv_lora"], hd, s["heads"]),
                     Matrix(p + "attn_v_b", "Q8_0", hd, s["kv_lora"], s["heads"]),
                     Matrix(p + "attn_output", "Q8_0", D, s["heads"] * hd)]
        else:
            plan += [Matrix(p + "kda_q", kda_qk, lh * ld, D),
                     Matrix(p + "kda_k", kda_qk, lh * ld, D),
                     Matrix(p + "kda_v", "Q8_0", lh * ld, D),
                     Matrix(p + "kda_f_a", "Q8_0", ld, D),
                     Matrix(p + "kda_f_b", "Q8_0", lh * ld, ld),
                     Matrix(p + "kda_beta", "Q8_0", lh, D),
                     Matrix(p + "kda_g_a", "Q8_0", ld, D),
                     Matrix(p + "kda_g_b", "Q8_0", lh * ld, ld),
                     Matrix(p + "kda_output", "Q8_0", D, lh * ld)]
        plan.append(Matrix(p + "hc_ffn_fn", "BF16", (2 + n) * n, n * D))
        if i < s["dense_layers"]:
            plan += [Matrix(p + "ffn_gate", "Q8_0", s["dense_inter"], D),
                     Matrix(p + "ffn_up", "Q8_0", s["dense_inter"], D),
                     Matrix(p + "ffn_down", "Q8_0", D, s["dense_inter"])]
        else:
            plan += [Matrix(p + "ffn_gate_inp", "F32", s["experts"], D),
                     RoutedExperts(p + "ffn_exps", gate_up, down, s["experts"], s["k"], D, s["inter"]),
                     Matrix(p + "ffn_gate_shexp", "Q8_0", s["inter"], D),
                     Matrix(p + "ffn_up_shexp", "Q8_0", s["inter"], D),
                     Matrix(p + "ffn_down_shexp", "Q8_0", D, s["inter"])]
    plan.append(Matrix("output", "Q8_0", s["vocab"], D))
    return plan


def state_plan(layers: int, context: int, shapes: dict[str, int] = GLM53_FLASH) -> Plan:
    """The state one token reads with ``context`` cached tokens (spec §6.3, §6.4, §7): KDA layers their recurrent
    state (``linear_heads`` × ``linear_dim``², whatever the context); DSA layers the latent rows of the selected
    tokens (the best ``index_topk`` pooled tokens plus the open pool, all tokens while fewer) and every complete
    pooled indexer key (``context // index_pool`` × ``index_dim``, all scored)."""
    s = shapes
    ld = s["linear_dim"]
    plan: Plan = []
    for i in range(layers):
        p = f"blk.{i}."
        if is_dsa_layer(i):
            plan += state_rows(p + "latent_kv_selected", selected_tokens(context, s["index_pool"], s["index_topk"]),
                               s["kv_lora"])
            plan += state_rows(p + "indexer_pooled_keys", context // s["index_pool"], s["index_dim"])
        else:
            plan += state_rows(p + "kda_state", s["linear_heads"] * ld, ld)
    return plan


MODEL = SyntheticModel(
    "GLM 5.3 Flash", GLM53_FLASH["layers"],
    {"q2": "IQ2_XXS gate/up + Q2_K down experts, Q4_K KDA q/k", "q4": "Q4_K experts, Q8_0 KDA q/k"},
    decode_plan, state_plan,
    "KDA recurrent state (64 x 128 x 128 per KDA layer), DSA latent rows of the selected tokens (<=2051 x 512) and "
    "the pooled indexer keys (ctx/4 x 128), float32; KDA conv history and the open pool's raw keys not included")
