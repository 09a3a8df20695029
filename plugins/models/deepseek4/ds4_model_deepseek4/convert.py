"""Convert a Hugging Face DeepSeek V4 checkpoint to a ds4-schema GGUF (spec §11, §12).

Two source layouts are accepted:

* what transformers' ``save_pretrained`` writes for ``DeepseekV4ForCausalLM``: ``model.``-prefixed names,
  stacked routed experts ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``;
* the official DeepSeek layout: names of spec §11, per-expert ``ffn.experts.E.w{1,2,3}``, FP8 E4M3 weights with
  128x128 E8M0 block scales and packed FP4 experts with 1x32 E8M0 scales (both dequantized here).

An MTP (next-n) block in the checkpoint (``mtp.0.*``, e.g. ``mtp.safetensors`` beside the trunk's shards) is written
into the same GGUF under the ``mtp.0.*`` names of spec §12.3; a checkpoint without one converts to the trunk alone.

Tensors are streamed one chunk of rows at a time from memory-mapped safetensors, so memory stays bounded by the
largest chunk, and the output is written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGUFValueType

from ds4_core.conversion import (
    SAFETENSORS_DTYPES,
    MetadataRow,
    PlannedTensor,
    Progress,
    SafetensorsSource,
    StoredTensor,
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

from .config import CSA_RATIO, DeepSeekV4Config

ARCHITECTURE = "deepseek4"


# ---------------------------------------------------------------- hyperparameters (config.json -> §12.2 keys)

_LAYER_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                "heavily_compressed_attention": "hca"}
_LEGACY_RATIO_KINDS = {0: "sliding", 4: "csa", 128: "hca"}


def _layer_schedule(config: Mapping[str, Any], n_layers: int) -> tuple[list[str], list[int]]:
    """(kind per layer in sliding/csa/hca, compression ratio per layer) from either config flavour."""
    if config.get("layer_types") is not None:
        rates = {"csa": 4, "hca": 128, "sliding": 0}
        for name, rate in (config.get("compress_rates") or {}).items():
            rates[_LAYER_KINDS.get(name, name)] = int(rate)
        kinds = []
        for name in config["layer_types"][:n_layers]:
            if name not in _LAYER_KINDS:
                raise ConversionError(f"config.json layer_types holds {name!r}; DeepSeek V4 layers are one of "
                                      f"{', '.join(_LAYER_KINDS)}")
            kinds.append(_LAYER_KINDS[name])
    elif config.get("compress_ratios") is not None:
        ratios = [int(r) for r in config["compress_ratios"][:n_layers]]
        bad = sorted({r for r in ratios if r not in _LEGACY_RATIO_KINDS})
        if bad:
            raise ConversionError(f"config.json compress_ratios holds {bad}; only 0, 4 and 128 are defined")
        kinds = [_LEGACY_RATIO_KINDS[r] for r in ratios]
        rates = {"sliding": 0, "csa": int(config.get("compress_rate_csa") or 4),
                 "hca": int(config.get("compress_rate_hca") or 128)}
    else:
        raise ConversionError("config.json has neither layer_types nor compress_ratios; one of them is required "
                              "to know which layers compress their KV cache")
    if len(kinds) != n_layers:
        raise ConversionError(f"config.json describes {len(kinds)} layer types for {n_layers} layers")
    return kinds, [rates[kind] for kind in kinds]


def _hash_layer_count(config: Mapping[str, Any], n_layers: int) -> int:
    if config.get("mlp_layer_types") is not None:
        types = list(config["mlp_layer_types"][:n_layers])
        count = types.count("hash_moe")
        if types != ["hash_moe"] * count + ["moe"] * (n_layers - count):
            raise ConversionError(f"config.json mlp_layer_types must be hash_moe layers followed by moe layers; "
                                  f"got {types}")
        return count
    return min(int(_field(config, "num_hash_layers")), n_layers)


def _rope_dimension(config: Mapping[str, Any], head_dim: int) -> int:
    if config.get("qk_rope_head_dim") is not None:
        return int(config["qk_rope_head_dim"])
    factor = config.get("partial_rotary_factor")
    if factor is None:
        factor = ((config.get("rope_parameters") or {}).get("main") or {}).get("partial_rotary_factor")
    if factor is None:
        raise ConversionError("config.json has neither qk_rope_head_dim nor partial_rotary_factor; one is required")
    return int(head_dim * float(factor))


def _yarn(config: Mapping[str, Any]) -> dict[str, float]:
    """YaRN parameters of the compressed layers; factor 1 (a no-op) when the checkpoint uses plain RoPE there."""
    scaling = config.get("rope_scaling") or ((config.get("rope_parameters") or {}).get("compress")) or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        return {"factor": 1.0, "original": int(_field(config, "max_position_embeddings")),
                "beta_fast": 32.0, "beta_slow": 1.0}
    return {"factor": float(_field(scaling, "factor")),
            "original": int(_field(scaling, "original_max_position_embeddings")),
            "beta_fast": float(scaling.get("beta_fast", 32.0)), "beta_slow": float(scaling.get("beta_slow", 1.0))}


def hparams_from_config(config: Mapping[str, Any]) -> DeepSeekV4Config:
    """Normalise a DeepSeek V4 ``config.json`` dict (transformers or official flavour) into the model's config."""
    model_type = config.get("model_type")
    if model_type not in (None, "deepseek_v4"):
        raise ConversionError(f"config.json declares model_type {model_type!r}; this converter handles deepseek_v4")
    n_layers = int(_field(config, "num_hidden_layers"))
    head_dim = int(_field(config, "head_dim"))
    kinds, ratios = _layer_schedule(config, n_layers)
    yarn = _yarn(config)
    try:
        hp = DeepSeekV4Config(
            vocab_size=int(_field(config, "vocab_size")), hidden_size=int(_field(config, "hidden_size")),
            num_layers=n_layers, context_length=int(_field(config, "max_position_embeddings")),
            num_heads=int(_field(config, "num_attention_heads")),
            num_kv_heads=int(config.get("num_key_value_heads") or 1), head_dim=head_dim, value_dim=head_dim,
            rope_dim=_rope_dimension(config, head_dim), q_lora_rank=int(_field(config, "q_lora_rank")),
            o_lora_rank=int(_field(config, "o_lora_rank")), o_groups=int(_field(config, "o_groups")),
            n_experts=int(_field(config, "n_routed_experts")),
            n_experts_used=int(_field(config, "num_experts_per_tok")),
            expert_ffn=int(_field(config, "moe_intermediate_size")),
            n_shared_experts=int(config.get("n_shared_experts") or 1),
            n_hash_layers=_hash_layer_count(config, n_layers), sliding_window=int(_field(config, "sliding_window")),
            index_n_heads=int(_field(config, "index_n_heads")), index_head_dim=int(_field(config, "index_head_dim")),
            index_topk=int(_field(config, "index_topk")), hc_mult=int(_field(config, "hc_mult")),
            hc_sinkhorn_iters=int(_field(config, "hc_sinkhorn_iters")), hc_eps=float(_field(config, "hc_eps")),
            rope_theta=float(_field(config, "rope_theta")),
            compress_rope_theta=float(_field(config, "compress_rope_theta")), yarn_factor=yarn["factor"],
            yarn_original_context=yarn["original"], yarn_beta_fast=yarn["beta_fast"],
            yarn_beta_slow=yarn["beta_slow"], routed_scaling_factor=float(_field(config, "routed_scaling_factor")),
            expert_weights_norm=bool(config.get("norm_topk_prob", True)),
            rms_norm_eps=float(_field(config, "rms_norm_eps")), compress_ratios=ratios,
            swiglu_limits=[float(_field(config, "swiglu_limit"))] * n_layers,
        )
    except ModelConfigError as exc:
        raise ConversionError(f"config.json cannot be represented in a deepseek4 GGUF: {exc}") from None
    recorded = [hp.layer_kind(layer) for layer in range(n_layers)]
    if recorded != kinds:
        raise ConversionError(f"config.json layer kinds {kinds} with compression rates {ratios} would read back as "
                              f"{recorded}: the GGUF tells CSA layers by the ratio {CSA_RATIO}, so CSA layers need "
                              f"rate {CSA_RATIO} and HCA layers another rate")
    return hp


def gguf_metadata(hp: DeepSeekV4Config) -> list[MetadataRow]:
    """The ``deepseek4.*`` metadata of spec §12.2 as (key, value, value type, array element type) rows, plus the
    two keys llama.cpp's ``deepseek4`` loader also reads (sqrt-softplus gating = 4, YaRN scaling), which ds4
    ignores; with them the same file loads in both engines (docs/conformance.md)."""
    rows = [(key, value, vtype, sub_type) for key, (value, vtype, sub_type) in hp.to_gguf_metadata().items()]
    return [*rows, ("deepseek4.expert_gating_func", 4, GGUFValueType.UINT32, None),
            ("deepseek4.rope.scaling.type", "yarn", GGUFValueType.STRING, None)]


# ---------------------------------------------------------------- tensor names and types (§11, §12.3)

# (GGUF name, canonical name = the transformers module name without "model.", type class); layer tables hold
# the names inside "blk.N." / "layers.N.". Type classes as in ds4_core.conversion.gguf_type.
_GLOBAL_TENSORS = (
    ("token_embd.weight", "embed_tokens.weight", "half"),
    ("output.weight", "lm_head.weight", "matrix"),
    ("output_norm.weight", "norm.weight", "f32"),
    ("output_hc_fn.weight", "hc_head.hc_fn", "half"),
    ("output_hc_base.weight", "hc_head.hc_base", "f32"),
    ("output_hc_scale.weight", "hc_head.hc_scale", "f32"),
)
_LAYER_TENSORS = (
    ("hc_attn_fn.weight", "attn_hc.fn", "half"),
    ("hc_attn_scale.weight", "attn_hc.scale", "f32"),
    ("hc_attn_base.weight", "attn_hc.base", "f32"),
    ("hc_ffn_fn.weight", "ffn_hc.fn", "half"),
    ("hc_ffn_scale.weight", "ffn_hc.scale", "f32"),
    ("hc_ffn_base.weight", "ffn_hc.base", "f32"),
    ("attn_norm.weight", "input_layernorm.weight", "f32"),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "f32"),
    ("attn_q_a.weight", "self_attn.q_a_proj.weight", "matrix"),
    ("attn_q_a_norm.weight", "self_attn.q_a_norm.weight", "f32"),
    ("attn_q_b.weight", "self_attn.q_b_proj.weight", "matrix"),
    ("attn_kv.weight", "self_attn.kv_proj.weight", "matrix"),
    ("attn_kv_a_norm.weight", "self_attn.kv_norm.weight", "f32"),
    ("attn_sinks.weight", "self_attn.sinks", "f32"),
    ("attn_output_a.weight", "self_attn.o_a_proj.weight", "matrix"),
    ("attn_output_b.weight", "self_attn.o_b_proj.weight", "matrix"),
    ("ffn_gate_inp.weight", "mlp.gate.weight", "half"),
    ("ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight", "matrix"),
    ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight", "matrix"),
    ("ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight", "matrix"),
)
_COMPRESSOR_TENSORS = (
    ("attn_compressor_ape.weight", "self_attn.compressor.position_bias", "half"),
    ("attn_compressor_kv.weight", "self_attn.compressor.kv_proj.weight", "half"),
    ("attn_compressor_gate.weight", "self_attn.compressor.gate_proj.weight", "half"),
    ("attn_compressor_norm.weight", "self_attn.compressor.kv_norm.weight", "f32"),
)
_INDEXER_TENSORS = (
    ("indexer.attn_q_b.weight", "self_attn.compressor.indexer.q_b_proj.weight", "half"),
    ("indexer.proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight", "half"),
    ("indexer_compressor_ape.weight", "self_attn.compressor.indexer.position_bias", "half"),
    ("indexer_compressor_kv.weight", "self_attn.compressor.indexer.kv_proj.weight", "half"),
    ("indexer_compressor_gate.weight", "self_attn.compressor.indexer.gate_proj.weight", "half"),
    ("indexer_compressor_norm.weight", "self_attn.compressor.indexer.kv_norm.weight", "f32"),
)
_HASH_TENSORS = (("ffn_gate_tid2eid.weight", "mlp.gate.tid2eid", "i32"),)
_BIAS_TENSORS = (("exp_probs_b.bias", "mlp.gate.e_score_correction_bias", "f32"),)
# The MTP block's own tensors (spec §8, §12.3), inside "mtp.0." in both the GGUF and the canonical naming; its
# decoder block uses _LAYER_TENSORS, _BIAS_TENSORS (required) and the routed experts, like a sliding layer.
_MTP_TENSORS = (
    ("e_proj.weight", "e_proj.weight", "matrix"),
    ("h_proj.weight", "h_proj.weight", "matrix"),
    ("enorm.weight", "enorm.weight", "f32"),
    ("hnorm.weight", "hnorm.weight", "f32"),
    ("norm.weight", "norm.weight", "f32"),
    ("hc_head_fn.weight", "hc_head.hc_fn", "half"),
    ("hc_head_base.weight", "hc_head.hc_base", "f32"),
    ("hc_head_scale.weight", "hc_head.hc_scale", "f32"),
)
MTP_PREFIX = "mtp.0."
# Routed experts: (GGUF name, official per-expert weight, part of the transformers stacked tensor).
_EXPERT_TENSORS = (("ffn_gate_exps.weight", "w1", "gate"), ("ffn_up_exps.weight", "w3", "up"),
                   ("ffn_down_exps.weight", "w2", "down"))

# Official DeepSeek names -> transformers module names (spec §11), applied in order after dropping "model.".
# transformers' save_pretrained writes these official names back (keeping "model."), so both layouts meet here.
_RENAMES = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"), (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
))


def canonical_name(name: str) -> str:
    """The transformers module name (without ``model.``) of a tensor in either checkpoint layout; an MTP tensor
    keeps its ``mtp.N.`` prefix, followed by the module name its block part would have inside a layer."""
    name = name.removeprefix("model.")
    mtp = re.match(r"mtp\.\d+\.", name)
    if mtp:
        own = canonical_name(name[mtp.end():])  # e_proj, enorm, norm, hc_head_* are named like the trunk's globals
        if own in {local for _, local, _ in _MTP_TENSORS}:
            return mtp.group() + own
        return mtp.group() + canonical_name("layers.0." + name[mtp.end():]).removeprefix("layers.0.")
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


# ---------------------------------------------------------------- sources


@attrs.frozen
class ArraySource:
    """A :class:`TensorSource` over in-memory arrays (used to build random-weight models without torch)."""

    arrays: Mapping[str, np.ndarray]

    def names(self) -> set[str]:
        return set(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.arrays[name].shape)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.arrays[name][start:stop])


def _e4m3_table() -> np.ndarray:
    """float32 value of every FP8 E4M3 (fn) byte: bias 7, subnormals at exponent 0, 0x7F/0xFF NaN."""
    code = np.arange(256)
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    magnitude = np.where((code & 0x7F) == 0x7F, np.nan, magnitude)
    return np.where(code & 0x80, -magnitude, magnitude).astype(np.float32)


_E4M3 = _e4m3_table()
# E8M0 byte e -> 2**(e - 127); 255 is NaN.
_E8M0 = np.append(np.exp2(np.arange(255) - 127.0), np.nan).astype(np.float32)
_FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
_FP8_BLOCK = 128
_FP4_BLOCK = 32


class BlockScaledSafetensorsSource(SafetensorsSource):
    """A :class:`SafetensorsSource` that also reads the official layout's FP8 and packed FP4 weights, dequantized.

    A weight ``X.weight`` with a companion ``X.scale`` is block-quantized: FP8 E4M3 with 128x128 scale blocks, or
    (dtype I8/U8) two FP4 E2M1 codes per byte, element 2j in the low nibble, with 1x32 scale blocks.
    """

    def __init__(self, directory: Path):
        super().__init__(directory, dtypes=tuple(SAFETENSORS_DTYPES))

    def names(self) -> set[str]:
        """Every tensor name, the ``.scale`` companions excluded."""
        stored = super().names()
        return {n for n in stored if not (n.endswith(".scale") and n[:-6] + ".weight" in stored)}

    def _scale_of(self, name: str) -> StoredTensor | None:
        scale = name[: -len(".weight")] + ".scale"
        return self.entry(scale) if name.endswith(".weight") and self.has(scale) else None

    def _is_fp4(self, name: str) -> bool:
        return self.entry(name).dtype in ("I8", "U8") and self._scale_of(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical (dequantized) shape of ``name``: packed FP4 rows hold two elements per byte."""
        shape = self.entry(name).shape
        return (*shape[:-1], shape[-1] * 2) if self._is_fp4(name) else shape

    def decode(self, raw: np.ndarray, dtype: str) -> np.ndarray:
        if dtype == "F8_E4M3":
            return _E4M3[raw]
        if dtype == "F8_E8M0":
            return _E8M0[raw]
        return super().decode(raw, dtype)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """``name[start:stop]`` dequantized; FP8 weights are read in whole 128-row blocks."""
        entry = self.entry(name)
        values = self.decode(self.raw(entry, start, stop), entry.dtype)
        scale = self._scale_of(name)
        if scale is None:
            return values
        if self._is_fp4(name):
            return self._dequantize_fp4(name, entry, scale, start, stop)
        if entry.dtype != "F8_E4M3" or len(entry.shape) != 2:
            raise ConversionError(f"tensor {name!r} has a .scale companion but dtype {entry.dtype} and shape "
                                  f"{entry.shape}; only 2-D FP8 E4M3 and packed FP4 weights are block-scaled")
        rows_, cols = entry.shape
        expected = (-(-rows_ // _FP8_BLOCK), -(-cols // _FP8_BLOCK))
        if scale.shape != expected:
            raise ConversionError(f"scale of {name!r} has shape {scale.shape}; 128x128 blocks of {entry.shape} "
                                  f"need {expected}")
        if start % _FP8_BLOCK:
            raise ValueError("FP8 weights are read in whole 128-row blocks")
        blocks = self.decode(self.raw(scale, start // _FP8_BLOCK, -(-stop // _FP8_BLOCK)), scale.dtype)
        expanded = np.repeat(np.repeat(blocks, _FP8_BLOCK, axis=0), _FP8_BLOCK, axis=1)
        return values * expanded[: values.shape[0], :cols]

    def _dequantize_fp4(self, name: str, entry: StoredTensor, scale: StoredTensor, start: int,
                        stop: int) -> np.ndarray:
        packed = self.raw(entry, start, stop).view(np.uint8)
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
        expected = (*entry.shape[:-1], entry.shape[-1] * 2 // _FP4_BLOCK)
        if scale.shape != expected:
            raise ConversionError(f"scale of packed FP4 {name!r} has shape {scale.shape}; 32-element blocks of "
                                  f"{self.shape(name)} need {expected}")
        scales = self.decode(self.raw(scale, start, stop), scale.dtype)
        return _FP4[codes] * np.repeat(scales, _FP4_BLOCK, axis=-1)


# ---------------------------------------------------------------- the plan: one entry per GGUF tensor


def _expected_shape(hp: DeepSeekV4Config, canonical: str, kind: str) -> tuple[int, ...] | None:
    """Numpy-order shape a tensor must have, for the tensors whose shape the config fixes (None: not checked)."""
    d, h, hd, v, q, g = hp.hidden_size, hp.num_heads, hp.head_dim, hp.vocab_size, hp.q_lora_rank, hp.o_groups
    coff = 2 if kind == "csa" else 1
    shapes = {
        "embed_tokens.weight": (v, d), "lm_head.weight": (v, d),
        "self_attn.q_a_proj.weight": (q, d), "self_attn.q_b_proj.weight": (h * hd, q),
        "self_attn.kv_proj.weight": (hd, d), "self_attn.o_a_proj.weight": (g * hp.o_lora_rank, h * hd // g),
        "self_attn.o_b_proj.weight": (d, g * hp.o_lora_rank), "mlp.gate.weight": (hp.n_experts, d),
        "self_attn.compressor.kv_proj.weight": (coff * hd, d), "mlp.gate.tid2eid": (v, hp.n_experts_used),
        "self_attn.compressor.indexer.q_b_proj.weight": (hp.index_n_heads * hp.index_head_dim, q),
        "e_proj.weight": (d, d), "h_proj.weight": (d, d),
    }
    return shapes.get(re.sub(r"^(layers\.\d+|mtp\.0)\.", "", canonical))


def plan_tensors(hp: DeepSeekV4Config, source: TensorSource, outtype: str) -> list[PlannedTensor]:
    """Map every source tensor to its GGUF tensor (spec §12.3); refuse missing, duplicate and unknown tensors."""
    by_canonical: dict[str, str] = {}
    for name in sorted(source.names()):
        canonical = canonical_name(name)
        if canonical in by_canonical:
            raise ConversionError(f"tensors {by_canonical[canonical]!r} and {name!r} are the same weight under two "
                                  "names; remove the stray shard")
        by_canonical[canonical] = name
    used: set[str] = set()
    plan: list[PlannedTensor] = []

    def add(table: tuple, layer: int | str | None = None, kind: str = "", optional: bool = False) -> None:
        """``layer``: a trunk layer index, ``MTP_PREFIX`` for the MTP block, or None for global tensors."""
        scope, gguf_scope = _scopes(layer)
        for gguf_name, local, type_class in table:
            canonical = scope + local
            if canonical not in by_canonical:
                if optional:
                    continue
                where = "the MTP block" if layer == MTP_PREFIX else \
                    f"layer {layer} ({kind})" if layer is not None else "every model"
                raise ConversionError(f"the checkpoint has no tensor {canonical!r} (transformers naming), which "
                                      f"{where} needs; the download is incomplete or config.json does not match "
                                      "the weights")
            name = by_canonical[canonical]
            shape = source.shape(name)
            expected = _expected_shape(hp, canonical, kind)
            if expected is not None and shape != expected:
                raise ConversionError(f"tensor {name!r} has shape {shape}, but config.json implies {expected}")
            used.add(canonical)
            full_name = gguf_scope + gguf_name
            qtype = gguf_type(type_class, outtype, shape[-1] if shape else 1)
            plan.append(PlannedTensor(full_name, shape or (1,), qtype, row_chunks(source, name, _FP8_BLOCK)))

    add(_GLOBAL_TENSORS[:1])
    for layer in range(hp.num_layers):
        kind = hp.layer_kind(layer)
        add(_LAYER_TENSORS, layer, kind)
        if kind != "sliding":
            add(_COMPRESSOR_TENSORS, layer, kind)
        if kind == "csa":
            add(_INDEXER_TENSORS, layer, kind)
        if hp.is_hash_layer(layer):
            add(_HASH_TENSORS, layer, "hash-routed")
        else:
            add(_BIAS_TENSORS, layer, kind, optional=True)
        plan.extend(_plan_experts(hp, source, by_canonical, layer, used, outtype))
    add(_GLOBAL_TENSORS[1:])
    if any(c.startswith(MTP_PREFIX) for c in by_canonical):  # spec §8: one sliding, non-hash block
        add(_MTP_TENSORS, MTP_PREFIX)
        add(_LAYER_TENSORS, MTP_PREFIX, "sliding")
        add(_BIAS_TENSORS, MTP_PREFIX, "sliding")
        plan.extend(_plan_experts(hp, source, by_canonical, MTP_PREFIX, used, outtype))

    refuse_unknown_tensors([by_canonical[c] for c in set(by_canonical) - used], "it may be a different model, a "
                           "newer DeepSeek V4 variant, or config.json may not match it")
    return plan


def _scopes(layer: int | str | None) -> tuple[str, str]:
    """(canonical prefix, GGUF prefix) of a trunk layer index, ``MTP_PREFIX`` or None (global tensors)."""
    if layer is None:
        return "", ""
    if isinstance(layer, str):
        return layer, layer
    return f"layers.{layer}.", f"blk.{layer}."


def _plan_experts(hp: DeepSeekV4Config, source: TensorSource, by_canonical: dict[str, str], layer: int | str,
                  used: set[str], outtype: str) -> list[PlannedTensor]:
    """Routed experts of one layer (or of the MTP block, ``layer`` = ``MTP_PREFIX``) as three [E, rows, cols]
    tensors (gate, up, down), from per-expert ``experts.E.w{1,2,3}`` (official layout) or stacked
    ``gate_up_proj``/``down_proj`` (transformers modules)."""
    i, d, e = hp.expert_ffn, hp.hidden_size, hp.n_experts
    shapes = {"gate": (i, d), "up": (i, d), "down": (d, i)}
    scope, gguf_scope = _scopes(layer)
    prefix = f"{scope}mlp.experts."
    stacked = {"gate_up_proj": (e, 2 * i, d), "down_proj": (e, d, i)}
    planned = []
    for gguf_name, w, part in _EXPERT_TENSORS:
        stacked_name = prefix + ("down_proj" if part == "down" else "gate_up_proj")
        if stacked_name in by_canonical:
            name = by_canonical[stacked_name]
            if source.shape(name) != stacked[stacked_name.rsplit(".", 1)[1]]:
                raise ConversionError(f"tensor {name!r} has shape {source.shape(name)}, expected "
                                      f"{stacked[stacked_name.rsplit('.', 1)[1]]}")
            used.add(stacked_name)
            chunks = stacked_expert_chunks(source, name, e, part, i)
        else:
            members = [f"{prefix}{x}.{w}.weight" for x in range(e)]
            missing = [m for m in members if m not in by_canonical]
            if missing:
                raise ConversionError(f"the checkpoint lacks routed expert tensor {missing[0]!r} (and has no stacked "
                                      f"{stacked_name!r}); the download is incomplete or n_routed_experts is wrong")
            for member in members:
                if source.shape(by_canonical[member]) != shapes[part]:
                    raise ConversionError(f"tensor {by_canonical[member]!r} has shape "
                                          f"{source.shape(by_canonical[member])}, expected {shapes[part]}")
            used.update(members)
            chunks = member_chunks(source, [by_canonical[m] for m in members])
        shape = (e, *shapes[part])
        planned.append(PlannedTensor(f"{gguf_scope}{gguf_name}", shape, gguf_type("matrix", outtype, shape[-1]),
                                     chunks))
    return planned


def build_gguf(source: TensorSource, config: Mapping[str, Any], tokenizer_dir: Path, out_path: str | os.PathLike[str],
               outtype: str, name: str, progress: Progress | None = None) -> None:
    """Write the ds4 GGUF of ``source`` (transformers or official names) under ``config`` (a config.json dict)."""
    outtype = check_outtype(outtype)
    hp = hparams_from_config(config)
    plan = plan_tensors(hp, source, outtype)
    metadata = [metadata_row("general.name", name), *gguf_metadata(hp),
                *tokenizer_metadata(tokenizer_dir, hp.vocab_size, "joyai-llm")]
    write_gguf_atomic(out_path, ARCHITECTURE, metadata, plan, progress)


def convert(src_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
            progress: Progress | None = None) -> None:
    """Convert the Hugging Face DeepSeek V4 directory ``src_dir`` to a ds4 GGUF at ``out_path``.

    ``outtype``: ``f32``/``f16``/``bf16`` (that type for the large matrices, F32 for norms and other small
    tensors) or ``q8_0`` (the published recipe: Q8_0 projections and experts, F16 router/HC/compressor/indexer/
    embedding, F32 norms/biases/sinks). ``progress(done_bytes, total_bytes)`` is called after each tensor.
    Raises :class:`ConversionError` on anything it cannot convert; ``out_path`` is then left untouched.
    """
    outtype = check_outtype(outtype)
    src = Path(src_dir)
    config = read_hf_config(src)
    name = src.resolve().name or "DeepSeek-V4"
    build_gguf(BlockScaledSafetensorsSource(src), config, src, out_path, outtype, name, progress)
