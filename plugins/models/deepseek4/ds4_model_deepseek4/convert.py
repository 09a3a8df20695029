"""Convert a Hugging Face DeepSeek V4 checkpoint to a ds4-schema GGUF (spec §11, §12).

Two source layouts are accepted:

* what transformers' ``save_pretrained`` writes for ``DeepseekV4ForCausalLM``: ``model.``-prefixed names,
  stacked routed experts ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``;
* the official DeepSeek layout: names of spec §11, per-expert ``ffn.experts.E.w{1,2,3}``, FP8 E4M3 weights with
  128x128 E8M0 block scales and packed FP4 experts with 1x32 E8M0 scales (both dequantized here).

Tensors are streamed one chunk of rows at a time from memory-mapped safetensors, so memory stays bounded by the
largest chunk, and the output is written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType

from ds4_core.errors import ConversionError, ModelConfigError, TokenizerError
from ds4_core.quants import quantize, tensor_nbytes
from ds4_core.tokenizer import TOKEN_UNUSED, tokenizer_metadata_from_hf

from .config import CSA_RATIO, DeepSeekV4Config

ARCHITECTURE = "deepseek4"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

Progress = Callable[[int, int], None]
T = GGMLQuantizationType

# Elements per streamed chunk of a 2-D tensor (rows are kept in multiples of the 128-row FP8 scale block).
_CHUNK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------- hyperparameters (config.json -> §12.2 keys)

_LAYER_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                "heavily_compressed_attention": "hca"}
_LEGACY_RATIO_KINDS = {0: "sliding", 4: "csa", 128: "hca"}


def _field(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConversionError(f"config.json has no {key!r}; it is required to convert a DeepSeek V4 checkpoint "
                              "(add it from the model card or the original config.json)")
    return config[key]


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


def gguf_metadata(hp: DeepSeekV4Config) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """The ``deepseek4.*`` metadata of spec §12.2 as (key, value, value type, array element type) rows."""
    return [(key, value, vtype, sub_type) for key, (value, vtype, sub_type) in hp.to_gguf_metadata().items()]


# ---------------------------------------------------------------- tensor names and types (§11, §12.3)

# Type classes: "matrix" -> Q8_0 under q8_0 (F16 when the row length is not a multiple of 32), "half" -> F16 under
# q8_0, both -> the outtype otherwise; "f32" always F32; "i32" always I32.
# (GGUF name, canonical name = the transformers module name without "model.", type class); layer tables hold
# the names inside "blk.N." / "layers.N.".
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
    """The transformers module name (without ``model.``) of a tensor in either checkpoint layout."""
    name = name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


def _tensor_type(type_class: str, outtype: str, row_length: int) -> GGMLQuantizationType:
    if type_class == "i32":
        return T.I32
    if type_class == "f32":
        return T.F32
    if outtype != "q8_0":
        return T[outtype.upper()]
    if type_class == "matrix" and row_length % 32 == 0:
        return T.Q8_0
    return T.F16


# ---------------------------------------------------------------- sources


class TensorSource(Protocol):
    """Named float tensors in transformers or official naming, read as leading-axis slices."""

    def names(self) -> set[str]:
        """Every tensor name the source holds (quantization companions such as ``.scale`` excluded)."""

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical (dequantized) shape of ``name``."""

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """``name[start:stop]`` dequantized: float32, or int64 for integer tensors."""


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
_PLAIN_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
                 "I8": "i1", "U8": "u1", "BOOL": "u1", "BF16": "<u2", "F8_E4M3": "u1", "F8_E8M0": "u1"}
_FP8_BLOCK = 128
_FP4_BLOCK = 32


@attrs.frozen
class _Stored:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_safetensors_header(path: Path) -> dict[str, _Stored]:
    """Tensor directory of one safetensors file (parsed here: safetensors' numpy API cannot decode BF16/FP8)."""
    try:
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= 100 << 20:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{path} is not a readable safetensors file ({exc}); re-download it") from None
    base = 8 + length
    stored = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _PLAIN_DTYPES:
            raise ConversionError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which this converter cannot "
                                  f"read; supported: {', '.join(_PLAIN_DTYPES)}")
        begin, end = entry["data_offsets"]
        stored[name] = _Stored(path, entry["dtype"], tuple(entry["shape"]), base + begin, base + end)
    return stored


def _decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E4M3":
        return _E4M3[raw]
    if dtype == "F8_E8M0":
        return _E8M0[raw]
    if dtype.startswith("I"):
        return raw.astype(np.int64)
    return raw.astype(np.float32)


class SafetensorsSource:
    """Every ``*.safetensors`` file of a directory, memory-mapped; FP8 and packed FP4 weights are dequantized.

    A weight ``X.weight`` with a companion ``X.scale`` is block-quantized: FP8 E4M3 with 128x128 scale blocks, or
    (dtype I8/U8) two FP4 E2M1 codes per byte, element 2j in the low nibble, with 1x32 scale blocks.
    """

    def __init__(self, directory: Path):
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{directory} holds no *.safetensors files; point the converter at the model "
                                  "directory downloaded from Hugging Face")
        self._stored: dict[str, _Stored] = {}
        for path in files:
            for name, entry in _read_safetensors_header(path).items():
                if name in self._stored:
                    raise ConversionError(f"tensor {name!r} appears in both {self._stored[name].path.name} and "
                                          f"{path.name}; remove the stray shard")
                self._stored[name] = entry
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> set[str]:
        return {n for n in self._stored if not (n.endswith(".scale") and n[:-6] + ".weight" in self._stored)}

    def _scale_of(self, name: str) -> _Stored | None:
        return self._stored.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None

    def _is_fp4(self, name: str) -> bool:
        return self._stored[name].dtype in ("I8", "U8") and self._scale_of(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._stored[name].shape
        return (*shape[:-1], shape[-1] * 2) if self._is_fp4(name) else shape

    def _raw(self, entry: _Stored, start: int, stop: int) -> np.ndarray:
        if entry.path not in self._maps:
            self._maps[entry.path] = np.memmap(entry.path, dtype=np.uint8, mode="r")
        data = self._maps[entry.path][entry.begin:entry.end].view(_PLAIN_DTYPES[entry.dtype])
        return data.reshape(entry.shape or (1,))[start:stop]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        entry = self._stored[name]
        values = _decode(self._raw(entry, start, stop), entry.dtype)
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
        blocks = _decode(self._raw(scale, start // _FP8_BLOCK, -(-stop // _FP8_BLOCK)), scale.dtype)
        expanded = np.repeat(np.repeat(blocks, _FP8_BLOCK, axis=0), _FP8_BLOCK, axis=1)
        return values * expanded[: values.shape[0], :cols]

    def _dequantize_fp4(self, name: str, entry: _Stored, scale: _Stored, start: int, stop: int) -> np.ndarray:
        packed = self._raw(entry, start, stop).view(np.uint8)
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
        expected = (*entry.shape[:-1], entry.shape[-1] * 2 // _FP4_BLOCK)
        if scale.shape != expected:
            raise ConversionError(f"scale of packed FP4 {name!r} has shape {scale.shape}; 32-element blocks of "
                                  f"{self.shape(name)} need {expected}")
        scales = _decode(self._raw(scale, start, stop), scale.dtype)
        return _FP4[codes] * np.repeat(scales, _FP4_BLOCK, axis=-1)


# ---------------------------------------------------------------- the plan: one entry per GGUF tensor


@attrs.frozen
class PlannedTensor:
    """One GGUF tensor: name, numpy-order shape (GGUF dims reversed), type, and its row chunks in order."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def _row_chunks(source: TensorSource, name: str) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        shape = source.shape(name)
        if len(shape) < 2:
            yield source.rows(name, 0, shape[0] if shape else 1).reshape(shape or (1,))
            return
        step = max(_FP8_BLOCK, _CHUNK_ELEMENTS // max(1, int(np.prod(shape[1:]))) // _FP8_BLOCK * _FP8_BLOCK)
        for start in range(0, shape[0], step):
            yield source.rows(name, start, min(start + step, shape[0]))
    return chunks


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
    }
    return shapes.get(re.sub(r"^layers\.\d+\.", "", canonical))


def plan_tensors(hp: DeepSeekV4Config, source: TensorSource, outtype: str) -> list[PlannedTensor]:
    """Map every source tensor to its GGUF tensor (spec §12.3); refuse missing, duplicate and unknown tensors."""
    by_canonical: dict[str, str] = {}
    for name in sorted(source.names()):
        if name.startswith("mtp."):  # the MTP block goes into a separate GGUF
            continue
        canonical = canonical_name(name)
        if canonical in by_canonical:
            raise ConversionError(f"tensors {by_canonical[canonical]!r} and {name!r} are the same weight under two "
                                  "names; remove the stray shard")
        by_canonical[canonical] = name
    used: set[str] = set()
    plan: list[PlannedTensor] = []

    def add(table: tuple, layer: int | None = None, kind: str = "", optional: bool = False) -> None:
        for gguf_name, local, type_class in table:
            canonical = f"layers.{layer}.{local}" if layer is not None else local
            if canonical not in by_canonical:
                if optional:
                    continue
                where = f"layer {layer} ({kind})" if layer is not None else "every model"
                raise ConversionError(f"the checkpoint has no tensor {canonical!r} (transformers naming), which "
                                      f"{where} needs; the download is incomplete or config.json does not match "
                                      "the weights")
            name = by_canonical[canonical]
            shape = source.shape(name)
            expected = _expected_shape(hp, canonical, kind)
            if expected is not None and shape != expected:
                raise ConversionError(f"tensor {name!r} has shape {shape}, but config.json implies {expected}")
            used.add(canonical)
            full_name = f"blk.{layer}.{gguf_name}" if layer is not None else gguf_name
            qtype = _tensor_type(type_class, outtype, shape[-1] if shape else 1)
            plan.append(PlannedTensor(full_name, shape or (1,), qtype, _row_chunks(source, name)))

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

    unknown = sorted(by_canonical[c] for c in set(by_canonical) - used)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ConversionError(f"the checkpoint holds tensors this converter does not know: {shown}; it may be a "
                              "different model, a newer DeepSeek V4 variant, or config.json may not match it")
    return plan


def _plan_experts(hp: DeepSeekV4Config, source: TensorSource, by_canonical: dict[str, str], layer: int, used: set[str],
                  outtype: str) -> list[PlannedTensor]:
    """Routed experts of one layer as three [E, rows, cols] tensors (gate, up, down), from per-expert
    ``experts.E.w{1,2,3}`` (official layout) or stacked ``gate_up_proj``/``down_proj`` (transformers modules)."""
    i, d, e = hp.expert_ffn, hp.hidden_size, hp.n_experts
    shapes = {"gate": (i, d), "up": (i, d), "down": (d, i)}
    prefix = f"layers.{layer}.mlp.experts."
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
            chunks = _stacked_expert_chunks(source, name, e, part, i)
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
            chunks = _expert_chunks(source, [by_canonical[m] for m in members])
        shape = (e, *shapes[part])
        planned.append(PlannedTensor(f"blk.{layer}.{gguf_name}", shape, _tensor_type("matrix", outtype, shape[-1]),
                                     chunks))
    return planned


def _expert_chunks(source: TensorSource, members: list[str]) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        for member in members:
            yield source.rows(member, 0, source.shape(member)[0])
    return chunks


def _stacked_expert_chunks(source: TensorSource, name: str, experts: int, part: str,
                           i: int) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        for x in range(experts):
            block = source.rows(name, x, x + 1)[0]
            yield block if part == "down" else block[:i] if part == "gate" else block[i:]
    return chunks


# ---------------------------------------------------------------- writing


def _encode(chunk: np.ndarray, qtype: GGMLQuantizationType) -> bytes:
    if qtype == T.I32:
        return np.ascontiguousarray(chunk, dtype="<i4").tobytes()
    return quantize(chunk.astype(np.float32, copy=False), qtype).tobytes()


def write_gguf(out_path: str | os.PathLike[str], metadata: list[tuple[str, Any, GGUFValueType,
               GGUFValueType | None]], plan: list[PlannedTensor], progress: Progress | None = None) -> None:
    """Write a GGUF atomically: a temporary file beside ``out_path``, fsync, then rename over it."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    writer = GGUFWriter(None, ARCHITECTURE)
    try:
        for key, value, vtype, sub_type in metadata:
            writer.add_key_value(key, value, vtype, sub_type)
        for tensor in plan:
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes,
                                   raw_dtype=tensor.qtype)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        _write_tensor_data(writer, plan, progress)
        writer.flush()
        os.fsync(writer.fout[0].fileno())
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _write_tensor_data(writer: GGUFWriter, plan: list[PlannedTensor], progress: Progress | None) -> None:
    fout = writer.fout[0]
    alignment = writer.data_alignment
    total = sum(t.nbytes for t in plan)
    done = 0
    for tensor in plan:
        fout.write(b"\0" * (-fout.tell() % alignment))
        written = 0
        for chunk in tensor.chunks():
            data = _encode(chunk, tensor.qtype)
            fout.write(data)
            written += len(data)
        if written != tensor.nbytes:
            raise ConversionError(f"tensor {tensor.name} produced {written} bytes instead of {tensor.nbytes}; the "
                                  "source tensor does not match its declared shape")
        done += written
        if progress is not None:
            progress(done, total)
    fout.write(b"\0" * (-fout.tell() % alignment))


def tokenizer_metadata(src_dir: Path, vocab: int) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """``tokenizer.*`` metadata from ``src_dir``'s tokenizer.json (special ids and chat template from
    tokenizer_config.json when present), with the DeepSeek V4 pre-tokenizer ``joyai-llm``; the token list is
    padded with unused ``[PAD<id>]`` entries up to the model's ``vocab`` rows."""

    if not (src_dir / "tokenizer.json").is_file():
        raise ConversionError(f"{src_dir} has no tokenizer.json; copy it from the model's Hugging Face repository")
    try:
        metadata = tokenizer_metadata_from_hf(src_dir, pre="joyai-llm")
    except TokenizerError as exc:
        raise ConversionError(f"cannot convert the tokenizer of {src_dir}: {exc}") from None
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    if len(tokens) > vocab:
        raise ConversionError(f"tokenizer.json has {len(tokens)} tokens but the model only {vocab} embedding rows; "
                              "the tokenizer belongs to another model")
    metadata["tokenizer.ggml.tokens"] = [*tokens, *(f"[PAD{i}]" for i in range(len(tokens), vocab))]
    metadata["tokenizer.ggml.token_type"] = [*types, *[TOKEN_UNUSED] * (vocab - len(types))]
    return [_metadata_row(key, value) for key, value in metadata.items()]


def _metadata_row(key: str, value: Any) -> tuple[str, Any, GGUFValueType, GGUFValueType | None]:
    """A metadata row for a plain Python value (lists become arrays typed by their first element)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        return (key, items, GGUFValueType.ARRAY, GGUFValueType.get_type(items[0]) if items else GGUFValueType.INT32)
    return (key, value, GGUFValueType.get_type(value), None)


def build_gguf(source: TensorSource, config: Mapping[str, Any], tokenizer_dir: Path, out_path: str | os.PathLike[str],
               outtype: str, name: str, progress: Progress | None = None) -> None:
    """Write the ds4 GGUF of ``source`` (transformers or official names) under ``config`` (a config.json dict)."""
    outtype = _check_outtype(outtype)
    hp = hparams_from_config(config)
    plan = plan_tensors(hp, source, outtype)
    metadata = [("general.name", name, GGUFValueType.STRING, None), *gguf_metadata(hp),
                *tokenizer_metadata(tokenizer_dir, hp.vocab_size)]
    write_gguf(out_path, metadata, plan, progress)


def _check_outtype(outtype: str) -> str:
    if not isinstance(outtype, str) or outtype.lower() not in OUTTYPES:
        raise ConversionError(f"unsupported output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    return outtype.lower()


def convert(src_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
            progress: Progress | None = None) -> None:
    """Convert the Hugging Face DeepSeek V4 directory ``src_dir`` to a ds4 GGUF at ``out_path``.

    ``outtype``: ``f32``/``f16``/``bf16`` (that type for the large matrices, F32 for norms and other small
    tensors) or ``q8_0`` (the published recipe: Q8_0 projections and experts, F16 router/HC/compressor/indexer/
    embedding, F32 norms/biases/sinks). ``progress(done_bytes, total_bytes)`` is called after each tensor.
    Raises :class:`ConversionError` on anything it cannot convert; ``out_path`` is then left untouched.
    """
    outtype = _check_outtype(outtype)
    src = Path(src_dir)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{src} has no config.json; point the converter at a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{config_path} is not valid JSON ({exc}); re-download it") from None
    name = src.resolve().name or "DeepSeek-V4"
    build_gguf(SafetensorsSource(src), config, src, out_path, outtype, name, progress)
