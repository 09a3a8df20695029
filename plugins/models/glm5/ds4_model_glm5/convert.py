"""Convert a Hugging Face GLM 5.2 checkpoint (``GlmMoeDsaForCausalLM``) to a ``glm-dsa`` GGUF (spec §10.2).

Accepts what transformers' ``save_pretrained`` writes (per-expert ``mlp.experts.E.{gate,up,down}_proj.weight``) and
the stacked runtime layout (``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``), in F32, F16 or
BF16 safetensors. ``kv_b_proj`` is split per head into ``attn_k_b`` (K-NoPE rows, transposed) and ``attn_v_b``
(V rows), as ds4 and llama.cpp store MLA. MTP blocks (``model.layers.L…`` with ``eh_proj``), when the checkpoint has
them, become ``blk.L.nextn.*`` plus a full block. Tensors stream one chunk at a time from memory-mapped files and the
output is written atomically.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ds4_core.conversion import (
    Chunks,
    PlannedTensor,
    Progress,
    SafetensorsSource,
    check_outtype,
    gguf_type,
    member_chunks,
    metadata_row,
    read_hf_config,
    refuse_unknown_tensors,
    row_chunks,
    stacked_expert_chunks,
    tokenizer_metadata,
    write_gguf_atomic,
)
from ds4_core.conversion import config_field as _field
from ds4_core.errors import ConversionError, ModelConfigError

from .config import ARCH, GATING_SIGMOID, GlmDsaConfig

# ---------------------------------------------------------------- hyperparameters

def indexer_types(config: Mapping[str, Any], n_layers: int) -> list[str]:
    """``"full"``/``"shared"`` per trunk layer, as transformers derives it (spec §2.3)."""
    types = config.get("indexer_types")
    if types is None and config.get("index_topk_pattern") is not None:
        pattern = config["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq = max(int(config.get("index_topk_freq") or 1), 1)
        offset = int(config.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    types = list(types)[:n_layers]
    if len(types) != n_layers or set(types) - {"full", "shared"} or types[0] != "full":
        raise ConversionError(f"config.json indexer schedule {types} must give 'full' or 'shared' for each of the "
                              f"{n_layers} layers, starting with 'full'")
    return types


def hparams_from_config(config: Mapping[str, Any], nextn_layers: int) -> GlmDsaConfig:
    """Normalise a ``glm_moe_dsa`` config.json dict into the model config (``nextn_layers`` MTP blocks present)."""
    if config.get("model_type") not in (None, "glm_moe_dsa"):
        raise ConversionError(f"config.json declares model_type {config.get('model_type')!r}; this converter "
                              "handles glm_moe_dsa (GlmMoeDsaForCausalLM)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise ConversionError(f"rope type {rope.get('rope_type') or rope.get('type')!r} is not supported: GLM 5.x "
                              "uses plain RoPE (rope_type 'default')")
    n_layers = int(_field(config, "num_hidden_layers"))
    heads, kv_heads = int(_field(config, "num_attention_heads")), int(config.get("num_key_value_heads") or 0)
    if kv_heads not in (0, heads):
        raise ConversionError(f"num_key_value_heads {kv_heads} must equal num_attention_heads {heads} for MLA")
    first_dense = int(config.get("first_k_dense_replace", 3))
    mlp_types = list(config.get("mlp_layer_types") or
                     ["dense"] * min(first_dense, n_layers) + ["sparse"] * (n_layers - min(first_dense, n_layers)))
    leading = mlp_types.count("dense")
    if mlp_types[:n_layers] != ["dense"] * leading + ["sparse"] * (n_layers - leading):
        raise ConversionError(f"config.json mlp_layer_types must be dense layers then sparse ones, got {mlp_types}")
    kv_rank, rope_dim = int(_field(config, "kv_lora_rank")), int(_field(config, "qk_rope_head_dim"))
    try:
        return GlmDsaConfig(
            vocab_size=int(_field(config, "vocab_size")), hidden_size=int(_field(config, "hidden_size")),
            block_count=n_layers + nextn_layers, nextn_layers=nextn_layers,
            context_length=int(_field(config, "max_position_embeddings")),
            ffn=int(_field(config, "intermediate_size")), num_heads=heads, num_kv_heads=1,
            key_length=kv_rank + rope_dim, value_length=kv_rank,
            qk_head_dim=int(_field(config, "qk_nope_head_dim")) + rope_dim,
            v_head_dim=int(_field(config, "v_head_dim")), rope_dim=rope_dim,
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            q_lora_rank=int(_field(config, "q_lora_rank")), kv_lora_rank=kv_rank,
            n_experts=int(_field(config, "n_routed_experts")),
            n_experts_used=int(_field(config, "num_experts_per_tok")),
            expert_ffn=int(_field(config, "moe_intermediate_size")),
            n_shared_experts=int(config.get("n_shared_experts") or 1), n_group=int(config.get("n_group") or 1),
            topk_group=int(config.get("topk_group") or 1), gating_func=GATING_SIGMOID, leading_dense=leading,
            index_n_heads=int(_field(config, "index_n_heads")), index_head_dim=int(_field(config, "index_head_dim")),
            index_topk=int(_field(config, "index_topk")), rms_norm_eps=float(_field(config, "rms_norm_eps")),
            routed_scaling_factor=float(_field(config, "routed_scaling_factor")),
            expert_weights_norm=bool(config.get("norm_topk_prob", True)),
        )
    except ModelConfigError as exc:
        raise ConversionError(f"config.json cannot be represented in a glm-dsa GGUF: {exc}") from None


# ---------------------------------------------------------------- the plan

# (GGUF name inside blk.N., HF name inside model.layers.N., type class of ds4_core.conversion.gguf_type).
_ATTN = (
    ("attn_norm.weight", "input_layernorm.weight", "f32"),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "f32"),
    ("attn_q_a.weight", "self_attn.q_a_proj.weight", "matrix"),
    ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight", "f32"),
    ("attn_q_b.weight", "self_attn.q_b_proj.weight", "matrix"),
    ("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight", "matrix"),
    ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", "f32"),
    ("attn_output.weight", "self_attn.o_proj.weight", "matrix"),
)
_INDEXER = (
    ("indexer.attn_q_b.weight", "self_attn.indexer.wq_b.weight", "matrix"),
    ("indexer.attn_k.weight", "self_attn.indexer.wk.weight", "matrix"),
    ("indexer.k_norm.weight", "self_attn.indexer.k_norm.weight", "f32"),
    ("indexer.k_norm.bias", "self_attn.indexer.k_norm.bias", "f32"),
    ("indexer.proj.weight", "self_attn.indexer.weights_proj.weight", "f32"),
)
_DENSE = (
    ("ffn_gate.weight", "mlp.gate_proj.weight", "matrix"),
    ("ffn_up.weight", "mlp.up_proj.weight", "matrix"),
    ("ffn_down.weight", "mlp.down_proj.weight", "matrix"),
)
_MOE = (
    ("ffn_gate_inp.weight", "mlp.gate.weight", "f32"),
    ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias", "f32"),
    ("ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight", "matrix"),
    ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight", "matrix"),
    ("ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight", "matrix"),
)
_NEXTN = (
    ("nextn.eh_proj.weight", "eh_proj.weight", "matrix"),
    ("nextn.enorm.weight", "enorm.weight", "f32"),
    ("nextn.hnorm.weight", "hnorm.weight", "f32"),
    ("nextn.shared_head_norm.weight", "shared_head.norm.weight", "f32"),
)
# Copies of the trunk's embedding / LM head some checkpoints repeat inside the MTP block; the GGUF shares the trunk's.
_NEXTN_DUPLICATES = ("embed_tokens.weight", "shared_head.head.weight")


class _Planner:
    """Maps source tensors to GGUF tensors, checking shapes and that every source tensor is used exactly once."""

    def __init__(self, hp: GlmDsaConfig, source: SafetensorsSource, outtype: str):
        self.hp, self.source, self.outtype = hp, source, outtype
        self.used: set[str] = set()
        self.plan: list[PlannedTensor] = []

    def need(self, name: str, shape: tuple[int, ...] | None = None) -> str:
        found = self.source.shape(name)  # refuses a tensor the checkpoint lacks
        if shape is not None and found != shape:
            raise ConversionError(f"tensor {name!r} has shape {found}, but config.json implies {shape}")
        self.used.add(name)
        return name

    def add(self, gguf_name: str, shape: tuple[int, ...], type_class: str, chunks: Chunks) -> None:
        self.plan.append(PlannedTensor(gguf_name, shape, gguf_type(type_class, self.outtype, shape[-1]), chunks))

    def copy(self, table: tuple, layer: int) -> None:
        for gguf_name, local, type_class in table:
            name = self.need(f"model.layers.{layer}.{local}")
            self.add(f"blk.{layer}.{gguf_name}", self.source.shape(name) or (1,), type_class,
                     row_chunks(self.source, name))

    def kv_b(self, layer: int) -> None:
        """``kv_b_proj [H·(dn+dv), R]`` -> ``attn_k_b [H, R, dn]`` (transposed K rows) and ``attn_v_b [H, dv, R]``."""
        hp, src = self.hp, self.source
        H, R, dn, dv = hp.num_heads, hp.kv_lora_rank, hp.nope_dim, hp.v_head_dim
        name = self.need(f"model.layers.{layer}.self_attn.kv_b_proj.weight", (H * (dn + dv), R))

        def heads(part: str) -> Chunks:
            def chunks() -> Iterator[np.ndarray]:
                for h in range(H):
                    rows = src.rows(name, h * (dn + dv), (h + 1) * (dn + dv))
                    yield rows[:dn].T if part == "k" else rows[dn:]
            return chunks

        self.add(f"blk.{layer}.attn_k_b.weight", (H, R, dn), "matrix", heads("k"))
        self.add(f"blk.{layer}.attn_v_b.weight", (H, dv, R), "matrix", heads("v"))

    def experts(self, layer: int) -> None:
        """Routed experts as ``ffn_{gate,up}_exps [E, I, D]`` and ``ffn_down_exps [E, D, I]``."""
        hp, src = self.hp, self.source
        E, F, D = hp.n_experts, hp.expert_ffn, hp.hidden_size
        prefix = f"model.layers.{layer}.mlp.experts."
        stacked = src.has(prefix + "gate_up_proj")
        for part, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            if stacked:
                name = self.need(prefix + ("down_proj" if part == "down" else "gate_up_proj"),
                                 (E, D, F) if part == "down" else (E, 2 * F, D))
                chunks = stacked_expert_chunks(src, name, E, part, F)
            else:
                chunks = member_chunks(src, [self.need(f"{prefix}{e}.{part}_proj.weight", shape) for e in range(E)])
            self.add(f"blk.{layer}.ffn_{part}_exps.weight", (E, *shape), "matrix", chunks)

    def block(self, layer: int, full_indexer: bool) -> None:
        self.copy(_ATTN, layer)
        self.kv_b(layer)
        if full_indexer:
            self.copy(_INDEXER, layer)
        if self.hp.is_dense(layer):
            self.copy(_DENSE, layer)
        else:
            self.copy(_MOE, layer)
            self.experts(layer)


def count_nextn_layers(config: Mapping[str, Any], names: set[str]) -> int:
    """MTP blocks present in the checkpoint: ``model.layers.L.eh_proj.weight`` for L = num_hidden_layers, …"""
    n_layers, count = int(_field(config, "num_hidden_layers")), 0
    while f"model.layers.{n_layers + count}.eh_proj.weight" in names:
        count += 1
    return count


def plan_tensors(config: Mapping[str, Any], source: SafetensorsSource, outtype: str) -> tuple[GlmDsaConfig,
                                                                                             list[PlannedTensor]]:
    """The model config and every GGUF tensor (spec §10.2); refuses missing, misshapen and unknown tensors."""
    hp = hparams_from_config(config, count_nextn_layers(config, source.names()))
    types = indexer_types(config, hp.num_layers)
    p = _Planner(hp, source, outtype)
    p.add("token_embd.weight", (hp.vocab_size, hp.hidden_size), "half",
          row_chunks(source, p.need("model.embed_tokens.weight", (hp.vocab_size, hp.hidden_size))))
    for layer in range(hp.num_layers):
        p.block(layer, types[layer] == "full")
    for layer in range(hp.num_layers, hp.block_count):
        p.copy(_NEXTN, layer)
        p.block(layer, source.has(f"model.layers.{layer}.self_attn.indexer.wk.weight"))
        p.used.update(n for n in (f"model.layers.{layer}.{d}" for d in _NEXTN_DUPLICATES) if source.has(n))
    p.add("output_norm.weight", (hp.hidden_size,), "f32", row_chunks(source, p.need("model.norm.weight")))
    p.add("output.weight", (hp.vocab_size, hp.hidden_size), "matrix",
          row_chunks(source, p.need("lm_head.weight", (hp.vocab_size, hp.hidden_size))))
    refuse_unknown_tensors(source.names() - p.used, "it may be another model, or config.json (indexer_types, "
                           "first_k_dense_replace) may not match it")
    return hp, p.plan


def convert(src_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
            progress: Progress | None = None) -> None:
    """Convert the Hugging Face GLM 5.2 directory ``src_dir`` to a ``glm-dsa`` GGUF at ``out_path``.

    ``outtype``: ``f32``/``f16``/``bf16`` (that type for matrices, F32 for norms, router and indexer head weights)
    or ``q8_0`` (Q8_0 matrices, F16 embedding). ``progress(done_bytes, total_bytes)`` is called after each tensor.
    Raises :class:`ConversionError` on anything it cannot convert; ``out_path`` is then left untouched.
    """
    outtype = check_outtype(outtype)
    src = Path(src_dir)
    config = read_hf_config(src)
    hp, plan = plan_tensors(config, SafetensorsSource(src), outtype)
    metadata = [metadata_row("general.name", src.resolve().name or "GLM-5.2"), *hp.to_gguf_metadata(),
                *tokenizer_metadata(src, hp.vocab_size, "glm4")]
    write_gguf_atomic(out_path, ARCH, metadata, plan, progress)
