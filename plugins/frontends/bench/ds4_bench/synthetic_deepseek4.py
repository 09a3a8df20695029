"""DeepSeek V4 Flash (``deepseek4``) for ``ds4 bench --synthetic deepseek4-flash``: the weight plan and state reads
of one decode token.

Shapes follow spec deepseek_v4.md §1.1, tensor names the ds4 GGUF. Formats: the routed experts per recipe, the
attention projections, shared expert and output head Q8_0, the hyper-connection mixes, compressors, indexer and
router F16.
"""

from __future__ import annotations

from .synthetic_plan import Matrix, Plan, RoutedExperts, SyntheticModel, state_rows

#: DeepSeek V4 Flash dimensions (spec §1.1, §9.1): ``window`` raw KV rows, CSA / HCA compression ratios.
FLASH: dict[str, int] = {"hidden": 4096, "layers": 43, "vocab": 129280, "q_lora": 1024, "heads": 64,
                         "head_dim": 512, "o_groups": 8, "o_lora": 1024, "experts": 256, "k": 6, "inter": 2048,
                         "hc": 4, "index_heads": 64, "index_dim": 128, "index_topk": 512, "window": 128,
                         "csa_ratio": 4, "hca_ratio": 128}
#: Routed-expert formats (gate and up, down) of each recipe.
RECIPES: dict[str, tuple[str, str]] = {"q2": ("IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K"), "mxfp4": ("MXFP4", "MXFP4")}


def compress_ratio(layer: int, shapes: dict[str, int] = FLASH) -> int:
    """0 (raw window only) for layers 0 and 1, then CSA (even layers) and HCA (odd layers), as ds4 lays them out."""
    if layer < 2:
        return 0
    return shapes["csa_ratio"] if layer % 2 == 0 else shapes["hca_ratio"]


def all_visible(context: int, shapes: dict[str, int] = FLASH) -> bool:
    """Whether the step at position ``context`` (after ``context`` tokens) sees every complete CSA row, at most
    ``index_topk``, so that it leaves the indexer's queries and scores out (the model's ``all_visible``)."""
    return (context + 1) // shapes["csa_ratio"] <= shapes["index_topk"]


def decode_plan(recipe: str, layers: int, shapes: dict[str, int] = FLASH, context: int | None = None) -> Plan:
    """The matrices one batch-1 token reads in decoder layers ``0 .. layers-1``, then the HC head and output head.

    Per layer: the attention HC mix; q_a, q_b, kv; the compressor kv/gate of CSA (``2·head_dim`` wide) and HCA
    (``head_dim``) layers and, in CSA layers, the indexer's q_b, head weights and compressor kv/gate; the grouped
    o_a (one launch) and o_b; the FFN HC mix; the router, ``k`` routed experts and the shared expert. With a
    ``context`` where every complete CSA row is visible, the indexer's q_b and head weights are not read.
    """
    s = shapes
    choosing = context is None or not all_visible(context, s)
    D, n, hd = s["hidden"], s["hc"], s["head_dim"]
    gate_up, down = RECIPES[recipe]
    plan: Plan = []
    for i in range(layers):
        p = f"blk.{i}."
        plan += [Matrix(p + "hc_attn_fn", "F16", (2 + n) * n, n * D),
                 Matrix(p + "attn_q_a", "Q8_0", s["q_lora"], D),
                 Matrix(p + "attn_q_b", "Q8_0", s["heads"] * hd, s["q_lora"]),
                 Matrix(p + "attn_kv", "Q8_0", hd, D)]
        ratio = compress_ratio(i, s)
        if ratio:
            coff = 2 if ratio == s["csa_ratio"] else 1
            plan += [Matrix(p + "attn_compressor_kv", "F16", coff * hd, D),
                     Matrix(p + "attn_compressor_gate", "F16", coff * hd, D)]
        if ratio == s["csa_ratio"]:
            if choosing:
                plan += [Matrix(p + "indexer.attn_q_b", "F16", s["index_heads"] * s["index_dim"], s["q_lora"]),
                         Matrix(p + "indexer.proj", "F16", s["index_heads"], D)]
            plan += [Matrix(p + "indexer_compressor_kv", "F16", 2 * s["index_dim"], D),
                     Matrix(p + "indexer_compressor_gate", "F16", 2 * s["index_dim"], D)]
        plan += [Matrix(p + "attn_output_a", "Q8_0", s["o_lora"], s["heads"] * hd // s["o_groups"], s["o_groups"]),
                 Matrix(p + "attn_output_b", "Q8_0", D, s["o_groups"] * s["o_lora"]),
                 Matrix(p + "hc_ffn_fn", "F16", (2 + n) * n, n * D),
                 Matrix(p + "ffn_gate_inp", "F16", s["experts"], D),
                 RoutedExperts(p + "ffn_exps", gate_up, down, s["experts"], s["k"], D, s["inter"]),
                 Matrix(p + "ffn_gate_shexp", "Q8_0", s["inter"], D),
                 Matrix(p + "ffn_up_shexp", "Q8_0", s["inter"], D),
                 Matrix(p + "ffn_down_shexp", "Q8_0", D, s["inter"])]
    plan += [Matrix("output_hc_fn", "F16", n, n * D), Matrix("output", "Q8_0", s["vocab"], D)]
    return plan


def state_plan(layers: int, context: int, shapes: dict[str, int] = FLASH) -> Plan:
    """The state one token reads with ``context`` cached tokens (spec §5.2, §9.1): per layer the raw window
    (≤ ``window`` rows × ``head_dim``); HCA layers every complete compressed row; CSA layers every indexer key
    (``context // 4`` × ``index_dim``, all scored) and the ``index_topk`` selected compressed rows, or, while those
    are all the complete rows (:func:`all_visible`), those rows alone."""
    s = shapes
    hd = s["head_dim"]
    plan: Plan = []
    for i in range(layers):
        p = f"blk.{i}."
        plan += state_rows(p + "kv_window", min(context, s["window"]), hd)
        ratio = compress_ratio(i, s)
        if ratio == s["csa_ratio"]:
            rows = context // ratio
            if not all_visible(context, s):
                plan += state_rows(p + "indexer_keys", rows, s["index_dim"])
            plan += state_rows(p + "compressed_rows_selected", min(rows, s["index_topk"]), hd)
        elif ratio:
            plan += state_rows(p + "compressed_rows", context // ratio, hd)
    return plan


MODEL = SyntheticModel(
    "DeepSeek V4 Flash", FLASH["layers"],
    {"q2": "IQ2_XXS gate/up + Q2_K down experts", "q4": "Q4_K experts", "mxfp4": "MXFP4 experts"},
    decode_plan, state_plan,
    "raw window (<=128 rows x 512), HCA compressed rows (ctx/128 x 512), CSA indexer keys (ctx/4 x 128, scored "
    "once more than 512 rows are complete) and the top-512 compressed rows (x 512), float32; compressor buffers not "
    "included")
