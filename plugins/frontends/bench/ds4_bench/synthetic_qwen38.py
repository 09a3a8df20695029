"""Qwen3.8 Flash Next (``qwen4exp``) for ``ds4 bench --synthetic qwen38-flash``: the weight plan and state reads of
one decode token.

Shapes follow the released checkpoint (spec qwen38.md §2.1, §2.4), tensor names the ``qwen4exp`` GGUF (§9.2).
Formats follow ds4's Qwen packs: Q2 = IQ2_XXS gate/up experts + Q2_K down padded from 640 to 768 columns, Q4 =
Q4_K gate/up + MXFP4 down; dense projections (attention, delta-net, PLE, shared expert, head) Q8_0, the QSA
indexer BF16, the routers F32, the hyper-connection mixers F16. The n-gram table stays on disk (a few KB per token)
and is not part of the step.
"""

from __future__ import annotations

from .synthetic_plan import Matrix, Plan, RoutedExperts, SyntheticModel, selected_tokens, state_rows

#: Qwen3.8 Flash Next text dimensions (spec qwen38.md §2.1). ``ple_layer`` is 0-based (``ple_layer_ids = [2]``);
#: ``index_ratio`` tokens per QSA block, ``index_budget`` tokens kept from complete blocks.
QWEN38_FLASH: dict[str, int] = {"hidden": 2560, "layers": 48, "vocab": 248320, "heads": 24, "kv_heads": 2,
                                "head_dim": 256, "key_heads": 16, "value_heads": 48, "key_dim": 128, "value_dim": 128,
                                "experts": 512, "k": 10, "inter": 640, "shared_inter": 640, "hc": 4, "hc_rank": 320,
                                "index_heads": 4, "index_dim": 128, "index_ratio": 4, "index_budget": 2048,
                                "ple_layer": 1, "ple_dim": 2560}
#: Per recipe: routed gate/up format, routed down format.
RECIPES: dict[str, tuple[str, str]] = {"q2": ("IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "MXFP4")}


def is_attention_layer(layer: int) -> bool:
    """Layer ``i`` is gated attention with the QSA indexer when ``(i + 1) % 4 == 0``, else gated delta-net (§2.2)."""
    return (layer + 1) % 4 == 0


def _hc_site(prefix: str, s: dict[str, int], inject: bool = True) -> Plan:
    """The hyper-connection mixer's matrices: down ``[R, hc·D]``, up ``[hc·D, R]``, inject ``[hc, hc·D]``."""
    width = s["hc"] * s["hidden"]
    site = [Matrix(prefix + "down", "F16", s["hc_rank"], width), Matrix(prefix + "up", "F16", width, s["hc_rank"])]
    return [*site, Matrix(prefix + "inject", "F16", s["hc"], width)] if inject else site


def decode_plan(recipe: str, layers: int, shapes: dict[str, int] = QWEN38_FLASH) -> Plan:
    """The matrices one batch-1 token reads in decoder layers ``0 .. layers-1`` of a ``qwen4exp`` model, then the
    final mixer and the output head.

    Per layer: the PLE key/value projections (PLE layer only); the attention HC site; gated delta-net (qkv, z,
    beta, alpha, out) or gated attention (q+gate, k, v, the BF16 indexer q/k, output); the FFN HC site; the F32
    router, ``k`` routed experts, the F32 shared-expert gate and the Q8_0 shared expert.
    """
    s = shapes
    D = s["hidden"]
    gate_up, down = RECIPES[recipe]
    value_width = s["value_heads"] * s["value_dim"]
    plan: Plan = []
    for i in range(layers):
        p = f"blk.{i}."
        if i == s["ple_layer"]:
            plan += [Matrix(p + "ple_key", "Q8_0", s["hc"] * D, s["ple_dim"]),
                     Matrix(p + "ple_value", "Q8_0", D, s["ple_dim"])]
        plan += _hc_site(p + "hc_attn_", s)
        if is_attention_layer(i):
            width = s["heads"] * s["head_dim"]
            plan += [Matrix(p + "attn_q", "Q8_0", 2 * width, D),
                     Matrix(p + "attn_k", "Q8_0", s["kv_heads"] * s["head_dim"], D),
                     Matrix(p + "attn_v", "Q8_0", s["kv_heads"] * s["head_dim"], D),
                     Matrix(p + "indexer.q_proj", "BF16", s["index_heads"] * s["index_dim"], D),
                     Matrix(p + "indexer.k_proj", "BF16", s["index_dim"], D),
                     Matrix(p + "attn_output", "Q8_0", D, width)]
        else:
            plan += [Matrix(p + "attn_qkv", "Q8_0", 2 * s["key_heads"] * s["key_dim"] + value_width, D),
                     Matrix(p + "attn_gate", "Q8_0", value_width, D),
                     Matrix(p + "ssm_beta", "Q8_0", s["value_heads"], D),
                     Matrix(p + "ssm_alpha", "Q8_0", s["value_heads"], D),
                     Matrix(p + "ssm_out", "Q8_0", D, value_width)]
        plan += _hc_site(p + "hc_ffn_", s)
        plan += [Matrix(p + "ffn_gate_inp", "F32", s["experts"], D),
                 RoutedExperts(p + "ffn_exps", gate_up, down, s["experts"], s["k"], D, s["inter"]),
                 Matrix(p + "ffn_gate_inp_shexp", "F32", 1, D),
                 Matrix(p + "ffn_gate_shexp", "Q8_0", s["shared_inter"], D),
                 Matrix(p + "ffn_up_shexp", "Q8_0", s["shared_inter"], D),
                 Matrix(p + "ffn_down_shexp", "Q8_0", D, s["shared_inter"])]
    plan += _hc_site("output_hc_", s, inject=False)
    plan.append(Matrix("output", "Q8_0", s["vocab"], D))
    return plan


def state_plan(layers: int, context: int, shapes: dict[str, int] = QWEN38_FLASH) -> Plan:
    """The state one token reads with ``context`` cached tokens (spec §4.5, §4.8, §5): gated delta-net layers their
    recurrent state (``value_heads`` × ``key_dim`` × ``value_dim``, whatever the context); attention layers the K
    and V rows of the selected tokens (the best ``index_budget`` block tokens plus the tail, all tokens while
    fewer) and one cached key per complete index block (``context // index_ratio`` × ``index_dim``, all scored)."""
    s = shapes
    plan: Plan = []
    for i in range(layers):
        p = f"blk.{i}."
        if is_attention_layer(i):
            plan += state_rows(p + "kv_selected", selected_tokens(context, s["index_ratio"], s["index_budget"]),
                               2 * s["kv_heads"] * s["head_dim"])
            plan += state_rows(p + "indexer_block_keys", context // s["index_ratio"], s["index_dim"])
        else:
            plan += state_rows(p + "delta_net_state", s["value_heads"] * s["key_dim"], s["value_dim"])
    return plan


MODEL = SyntheticModel(
    "Qwen3.8 Flash Next", QWEN38_FLASH["layers"],
    {"q2": "IQ2_XXS gate/up + Q2_K down (padded to 768) experts", "q4": "Q4_K gate/up + MXFP4 down experts"},
    decode_plan, state_plan,
    "gated delta-net state (48 x 128 x 128 per delta-net layer), K and V rows of the selected tokens (<=2051 x "
    "2 x 2 x 256) and one pooled key per index block (ctx/4 x 128), float32; conv histories, PLE and n-gram reads "
    "not included")
