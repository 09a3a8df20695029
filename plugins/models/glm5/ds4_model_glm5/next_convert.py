"""Convert a Hugging Face GLM 5.3 Flash checkpoint (``Glm5NextForConditionalGeneration``) to a ``glm5-next`` GGUF.

Accepts what transformers' ``save_pretrained`` writes (checkpoint names: ``model.language_model.``-prefixed,
separate ``{q,k,v}_conv1d``, ``hc_attn_*``, per-expert weights) and the runtime module names (merged
``conv1d``, ``forget_gate.*``, ``attn_hc.*``, stacked ``gate_up_proj``/``down_proj``); F32/F16/BF16 payloads.
Output follows spec §10.3: ``kv_b_proj`` split per head into ``attn_k_b``/``attn_v_b``, an MTP block
(``layers.<L>``: DSA + MoE + ``eh_proj``/``enorm``/``hnorm``/``shared_head.norm``) when the checkpoint has one.

Not converted: the vision tower (``model.visual.*``; ds4 ships it as a separate encoder GGUF, not yet supported
here — its tensors are skipped), the MTP block's duplicates of the trunk embedding/head. Tensors are streamed one
row chunk at a time from memory-mapped safetensors; the output is written atomically.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ds4_core.conversion import (
    Chunks,
    PlannedTensor,
    Progress,
    SafetensorsSource,
    TensorSource,
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

from .next_config import ARCH, DSA, KDA, Glm5NextConfig

_LAYER_KINDS = {"linear_attention": KDA, "indexed_attention": DSA, "full_attention": DSA,
                "deepseek_sparse_attention": DSA}

# ---------------------------------------------------------------- hyperparameters


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    model_type = config.get("model_type")
    if model_type not in (None, "glm5_next", "glm5_next_text"):
        raise ConversionError(f"config.json declares model_type {model_type!r}; this converter handles glm5_next")
    return config.get("text_config") or config


def hparams_from_config(config: Mapping[str, Any], n_nextn: int) -> Glm5NextConfig:
    """The model config of a ``Glm5Next`` config.json dict (composite or text-only) with ``n_nextn`` MTP blocks."""
    tc = _text_config(config)
    n = int(_field(tc, "num_hidden_layers"))
    names = tc.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if any(name not in _LAYER_KINDS for name in names) or len(names) != n:
        raise ConversionError(f"config.json layer_types {names} must name linear_attention or indexed_attention "
                              f"for each of the {n} layers")
    mlp = tc.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
    dense = mlp.count("dense")
    if mlp != ["dense"] * dense + ["sparse"] * (n - dense):
        raise ConversionError(f"config.json mlp_layer_types must be dense layers followed by sparse ones; got {mlp}")
    if tc.get("linear_lower_bound", -5.0) is None:
        raise ConversionError("linear_lower_bound is null (softplus decay); only the bounded KDA gate of GLM 5.3 "
                              "Flash is supported")
    try:
        return Glm5NextConfig(
            vocab_size=int(_field(tc, "vocab_size")), hidden_size=int(_field(tc, "hidden_size")),
            block_count=n + n_nextn, num_layers=n, n_nextn=n_nextn,
            context_length=int(tc.get("max_position_embeddings") or 1048576),
            ffn=int(_field(tc, "intermediate_size")), expert_ffn=int(_field(tc, "moe_intermediate_size")),
            n_experts=int(_field(tc, "n_routed_experts")), n_experts_used=int(_field(tc, "num_experts_per_tok")),
            n_shared_experts=int(tc.get("n_shared_experts") or 1), n_expert_groups=int(tc.get("n_group") or 1),
            n_expert_groups_used=int(tc.get("topk_group") or 1), n_dense_layers=dense,
            routed_scaling_factor=float(tc.get("routed_scaling_factor", 2.5)),
            expert_weights_norm=bool(tc.get("norm_topk_prob", True)), swiglu_limit=float(_field(tc, "swiglu_limit")),
            rms_norm_eps=float(_field(tc, "rms_norm_eps")), num_heads=int(_field(tc, "num_attention_heads")),
            key_length=int(_field(tc, "qk_nope_head_dim")), value_length=int(_field(tc, "v_head_dim")),
            q_lora_rank=int(_field(tc, "q_lora_rank")), kv_lora_rank=int(_field(tc, "kv_lora_rank")),
            rope_dim=int(tc.get("qk_rope_head_dim") or 0), index_n_heads=int(_field(tc, "index_n_heads")),
            index_head_dim=int(_field(tc, "index_head_dim")), index_topk=int(_field(tc, "index_topk")),
            index_pool=int(_field(tc, "index_kpool")), kda_heads=int(_field(tc, "linear_num_heads")),
            kda_head_dim=int(_field(tc, "linear_head_dim")), kda_conv=int(_field(tc, "linear_conv_kernel_dim")),
            kda_lower_bound=float(tc.get("linear_lower_bound", -5.0)), hc_mult=int(_field(tc, "hc_mult")),
            hc_sinkhorn_iters=int(_field(tc, "hc_sinkhorn_iters")), hc_eps=float(tc.get("hc_eps", 1e-6)),
            layer_types=[_LAYER_KINDS[name] for name in names] + [DSA] * n_nextn,
        )
    except ModelConfigError as exc:
        raise ConversionError(f"config.json cannot be represented in a glm5-next GGUF: {exc}") from None


# ---------------------------------------------------------------- names

# Runtime (module) names -> checkpoint names inside "layers.N.", applied after the prefix is dropped.
_RENAMES = tuple((re.compile(p), r) for p, r in (
    (r"\.self_attn\.forget_gate\.", ".self_attn."), (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
))
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_VISION = ("model.visual.", "visual.", "model.vision_tower.")

# (GGUF name inside blk.N, checkpoint name inside layers.N, type class of ds4_core.conversion.gguf_type).
_BLOCK = (("attn_norm.weight", "input_layernorm.weight", "f32"),
          ("ffn_norm.weight", "post_attention_layernorm.weight", "f32"))
_HC = tuple((f"hc_{s}_{p}.weight", f"hc_{s}_{p}", "half" if p == "fn" else "f32")
            for s in ("attn", "ffn") for p in ("fn", "base", "scale"))
_KDA = (*((f"kda_{x}.weight", f"self_attn.{x}_proj.weight", "matrix") for x in "qkv"),
        *((f"kda_{x}_conv.weight", f"self_attn.{x}_conv1d.weight", "f32") for x in "qkv"),
        ("kda_f_a.weight", "self_attn.f_a_proj.weight", "matrix"), ("kda_f_b.weight", "self_attn.f_b_proj.weight",
                                                                     "matrix"),
        ("kda_g_a.weight", "self_attn.g_a_proj.weight", "matrix"), ("kda_g_b.weight", "self_attn.g_b_proj.weight",
                                                                     "matrix"),
        ("kda_dt_bias.weight", "self_attn.dt_bias", "f32"), ("kda_a_log.weight", "self_attn.A_log", "f32"),
        ("kda_beta.weight", "self_attn.b_proj.weight", "matrix"), ("kda_o_norm.weight", "self_attn.o_norm.weight",
                                                                   "f32"),
        ("kda_output.weight", "self_attn.o_proj.weight", "matrix"))
_DSA = (("attn_q_a.weight", "self_attn.q_a_proj.weight", "matrix"),
        ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight", "f32"),
        ("attn_q_b.weight", "self_attn.q_b_proj.weight", "matrix"),
        ("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight", "matrix"),
        ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", "f32"),
        ("attn_output.weight", "self_attn.o_proj.weight", "matrix"))
_INDEXER = (("indexer.attn_q_b.weight", "self_attn.indexer.wq_b.weight", "matrix"),
            ("indexer.attn_k.weight", "self_attn.indexer.wk.weight", "matrix"),
            ("indexer.k_norm.weight", "self_attn.indexer.k_norm.weight", "f32"),
            ("indexer.k_norm.bias", "self_attn.indexer.k_norm.bias", "f32"),
            ("indexer.proj.weight", "self_attn.indexer.weights_proj.weight", "half"),
            ("indexer.pool_ape.weight", "self_attn.indexer.index_kpool_compress_ape", "half"),
            ("indexer.pool_gate.weight", "self_attn.indexer.index_kpool_compress_gate", "half"))
_DENSE = tuple((f"ffn_{x}.weight", f"mlp.{x}_proj.weight", "matrix") for x in ("gate", "up", "down"))
_MOE = (("ffn_gate_inp.weight", "mlp.gate.weight", "f32"),
        ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias", "f32"),
        *((f"ffn_{x}_shexp.weight", f"mlp.shared_experts.{x}_proj.weight", "matrix") for x in ("gate", "up", "down")))
_NEXTN = (("nextn.eh_proj.weight", "eh_proj.weight", "matrix"), ("nextn.enorm.weight", "enorm.weight", "f32"),
          ("nextn.hnorm.weight", "hnorm.weight", "f32"),
          ("nextn.shared_head_norm.weight", "shared_head.norm.weight", "f32"))
_MTP_DUPLICATES = ("embed_tokens.weight", "shared_head.head.weight")  # the trunk's embedding and head serve MTP


def canonical_name(name: str) -> str | None:
    """The checkpoint name without prefix (``layers.N.…``, ``embed_tokens.weight``…), or ``None`` for vision."""
    if name.startswith(_VISION):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


# ---------------------------------------------------------------- the plan


class _Planner:
    def __init__(self, hp: Glm5NextConfig, source: TensorSource, outtype: str):
        self.hp, self.source, self.outtype = hp, source, outtype
        self.by_name: dict[str, str] = {}
        for name in sorted(source.names()):
            canonical = canonical_name(name)
            if canonical is None:
                continue
            if canonical in self.by_name:
                raise ConversionError(f"tensors {self.by_name[canonical]!r} and {name!r} are the same weight; remove "
                                      "the stray shard")
            self.by_name[canonical] = name
        self.used: set[str] = set()
        self.plan: list[PlannedTensor] = []

    def has(self, canonical: str) -> bool:
        return canonical in self.by_name

    def take(self, canonical: str, what: str) -> str:
        if canonical not in self.by_name:
            raise ConversionError(f"the checkpoint has no tensor {canonical!r}, which {what} needs; the download is "
                                  "incomplete or config.json does not match the weights")
        self.used.add(canonical)
        return self.by_name[canonical]

    def add(self, gguf_name: str, shape: tuple[int, ...], type_class: str, chunks: Chunks) -> None:
        self.plan.append(PlannedTensor(gguf_name, shape, gguf_type(type_class, self.outtype, shape[-1]), chunks))

    def table(self, table: tuple, layer: int | None, what: str) -> None:
        for gguf_name, local, type_class in table:
            name = self.take(f"layers.{layer}.{local}" if layer is not None else local, what)
            full = f"blk.{layer}.{gguf_name}" if layer is not None else gguf_name
            self.add(full, self.source.shape(name) or (1,), type_class, row_chunks(self.source, name))

    def kda(self, layer: int) -> None:
        merged = f"layers.{layer}.self_attn.conv1d.weight"
        if self.has(merged):  # runtime layout: q|k|v channels in one depthwise conv
            name = self.take(merged, f"KDA layer {layer}")
            hd = self.source.shape(name)[0] // 3
            for i, x in enumerate("qkv"):
                self.add(f"blk.{layer}.kda_{x}_conv.weight", (hd, *self.source.shape(name)[1:]), "f32",
                         lambda name=name, i=i, hd=hd: iter([self.source.rows(name, i * hd, (i + 1) * hd)]))
            table = tuple(row for row in _KDA if "_conv" not in row[0])
        else:
            table = _KDA
        self.table(table, layer, f"KDA layer {layer}")

    def dsa(self, layer: int) -> None:
        hp = self.hp
        self.table(_DSA, layer, f"DSA layer {layer}")
        name = self.take(f"layers.{layer}.self_attn.kv_b_proj.weight", f"DSA layer {layer}")
        H, dk, dv, R = hp.num_heads, hp.key_length, hp.value_length, hp.kv_lora_rank
        if self.source.shape(name) != (H * (dk + dv), R):
            raise ConversionError(f"tensor {name!r} has shape {self.source.shape(name)}, but config.json implies "
                                  f"{(H * (dk + dv), R)}")

        def head_rows(h: int) -> np.ndarray:
            return self.source.rows(name, h * (dk + dv), (h + 1) * (dk + dv))

        self.add(f"blk.{layer}.attn_k_b.weight", (H, R, dk), "matrix",
                 lambda: (head_rows(h)[:dk].T[None] for h in range(H)))
        self.add(f"blk.{layer}.attn_v_b.weight", (H, dv, R), "matrix",
                 lambda: (head_rows(h)[dk:][None] for h in range(H)))
        if self.has(f"layers.{layer}.self_attn.indexer.wk.weight"):
            self.table(_INDEXER, layer, f"the indexer of DSA layer {layer}")

    def moe(self, layer: int) -> None:
        hp = self.hp
        E, F, D = hp.n_experts, hp.expert_ffn, hp.hidden_size
        self.table(_MOE, layer, f"MoE layer {layer}")
        prefix = f"layers.{layer}.mlp.experts."
        stacked = self.has(prefix + "gate_up_proj")
        for part in ("gate", "up", "down"):
            shape = (E, D, F) if part == "down" else (E, F, D)
            if stacked:
                name = self.take(prefix + ("down_proj" if part == "down" else "gate_up_proj"), f"MoE layer {layer}")
                chunks = stacked_expert_chunks(self.source, name, E, part, F)
            else:
                names = [self.take(f"{prefix}{e}.{part}_proj.weight", f"MoE layer {layer}") for e in range(E)]
                chunks = member_chunks(self.source, names)
            self.add(f"blk.{layer}.ffn_{part}_exps.weight", shape, "matrix", chunks)

    def build(self) -> list[PlannedTensor]:
        hp = self.hp
        self.table((("token_embd.weight", "embed_tokens.weight", "half"),), None, "every model")
        for layer in range(hp.block_count):
            mtp = layer >= hp.num_layers
            self.table(_BLOCK, layer, f"layer {layer}")
            if mtp:
                self.table(_NEXTN, layer, f"MTP block {layer}")
                self.used.update(f"layers.{layer}.{d}" for d in _MTP_DUPLICATES)
            else:
                self.table(_HC, layer, f"layer {layer}")
            self.dsa(layer) if hp.is_dsa(layer) else self.kda(layer)
            self.moe(layer) if mtp or not hp.is_dense(layer) else self.table(_DENSE, layer, f"dense layer {layer}")
        self.table((("output_norm.weight", "norm.weight", "f32"), ("output.weight", "lm_head.weight", "matrix")),
                   None, "every model")
        refuse_unknown_tensors([self.by_name[c] for c in set(self.by_name) - self.used],
                               "it may be a different model or config.json may not match it")
        return self.plan


def plan_tensors(hp: Glm5NextConfig, source: TensorSource, outtype: str) -> list[PlannedTensor]:
    """Map every source tensor to its ``glm5-next`` GGUF tensor; refuse missing, duplicate and unknown tensors."""
    return _Planner(hp, source, outtype).build()


def count_mtp_blocks(config: Mapping[str, Any], source: TensorSource) -> int:
    """MTP blocks present in ``source`` (transformers' ``save_pretrained`` drops them, so often 0)."""
    n = int(_field(_text_config(config), "num_hidden_layers"))
    names = {canonical_name(name) for name in source.names()}
    count = 0
    while f"layers.{n + count}.eh_proj.weight" in names:
        count += 1
    return count


# ---------------------------------------------------------------- writing


def build_gguf(source: TensorSource, config: Mapping[str, Any], tokenizer_dir: Path, out_path: str | os.PathLike[str],
               outtype: str, name: str, progress: Progress | None = None) -> None:
    """Write the ``glm5-next`` GGUF of ``source`` (``names/shape/rows``) under ``config`` (a config.json dict)."""
    outtype = check_outtype(outtype)
    hp = hparams_from_config(config, count_mtp_blocks(config, source))
    plan = plan_tensors(hp, source, outtype)
    metadata = [metadata_row("general.name", name), *((k, v, t, s) for k, (v, t, s) in hp.to_gguf_metadata().items()),
                *tokenizer_metadata(tokenizer_dir, hp.vocab_size, "glm4")]
    write_gguf_atomic(out_path, ARCH, metadata, plan, progress)


def convert(src_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
            progress: Progress | None = None) -> None:
    """Convert the Hugging Face GLM 5.3 Flash directory ``src_dir`` to a ``glm5-next`` GGUF at ``out_path``.

    ``outtype``: ``f32``/``f16``/``bf16`` (that type for the matrices, F32 for norms, biases, convs, router and
    HC base/scale) or ``q8_0`` (Q8_0 matrices, F16 embedding/HC/indexer head weights and pool tensors).
    Raises :class:`ConversionError` on anything it cannot convert; ``out_path`` is then left untouched.
    """
    outtype = check_outtype(outtype)
    src = Path(src_dir)
    config = read_hf_config(src)
    build_gguf(SafetensorsSource(src), config, src, out_path, outtype, src.resolve().name or "GLM-5.3-Flash", progress)
