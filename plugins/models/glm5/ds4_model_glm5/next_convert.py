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

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType

from ds4_core.errors import ConversionError, ModelConfigError, TokenizerError
from ds4_core.quants import quantize, tensor_nbytes
from ds4_core.tokenizer import TOKEN_UNUSED, tokenizer_metadata_from_hf

from .next_config import ARCH, DSA, KDA, Glm5NextConfig

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
Progress = Callable[[int, int], None]
T = GGMLQuantizationType
_CHUNK_ELEMENTS = 1 << 22
_LAYER_KINDS = {"linear_attention": KDA, "indexed_attention": DSA, "full_attention": DSA,
                "deepseek_sparse_attention": DSA}

# ---------------------------------------------------------------- hyperparameters


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    model_type = config.get("model_type")
    if model_type not in (None, "glm5_next", "glm5_next_text"):
        raise ConversionError(f"config.json declares model_type {model_type!r}; this converter handles glm5_next")
    return config.get("text_config") or config


def _field(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConversionError(f"config.json has no {key!r}; it is required to convert a GLM 5.3 Flash checkpoint")
    return config[key]


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


# ---------------------------------------------------------------- safetensors source

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class SafetensorsSource:
    """Float tensors of a directory's ``*.safetensors`` files, memory-mapped, read as leading-axis slices."""

    def __init__(self, directory: Path):
        self._entries: dict[str, tuple[np.memmap, str, tuple[int, ...]]] = {}
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{directory} has no .safetensors files; point the converter at a Hugging Face "
                                  "model directory")
        for path in files:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise ConversionError(f"tensor {name!r} in {path.name} is {info['dtype']}; only F32/F16/BF16 "
                                          "checkpoints are supported (dequantize FP8 weights first)")
                start, stop = info["data_offsets"]
                self._entries[name] = (data[start:stop], info["dtype"], tuple(info["shape"]))

    def names(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of the leading axis as float32."""
        raw, dtype, shape = self._entries[name]
        a = raw.view(_DTYPES[dtype]).reshape(shape or (1,))[start:stop]
        if dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


# ---------------------------------------------------------------- names

# Runtime (module) names -> checkpoint names inside "layers.N.", applied after the prefix is dropped.
_RENAMES = tuple((re.compile(p), r) for p, r in (
    (r"\.self_attn\.forget_gate\.", ".self_attn."), (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
))
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_VISION = ("model.visual.", "visual.", "model.vision_tower.")

# (GGUF name inside blk.N, checkpoint name inside layers.N, type class). Type classes: "matrix" -> Q8_0 under q8_0
# (F16 when rows are not a multiple of 32), "half" -> F16 under q8_0, both -> the outtype otherwise; "f32" always F32.
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


def _tensor_type(type_class: str, outtype: str, row_length: int) -> GGMLQuantizationType:
    if type_class == "f32":
        return T.F32
    if outtype != "q8_0":
        return T[outtype.upper()]
    return T.Q8_0 if type_class == "matrix" and row_length % 32 == 0 else T.F16


# ---------------------------------------------------------------- the plan


@attrs.frozen
class PlannedTensor:
    """One GGUF tensor: name, numpy-order shape, type, and its row chunks in order."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def _rows(source: Any, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None
          ) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        shape = source.shape(name) or (1,)
        step = max(1, _CHUNK_ELEMENTS // max(1, int(np.prod(shape[1:]))))
        for start in range(0, shape[0], step):
            part = source.rows(name, start, min(start + step, shape[0]))
            yield part if transform is None else transform(part)
    return chunks


class _Planner:
    def __init__(self, hp: Glm5NextConfig, source: Any, outtype: str):
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

    def add(self, gguf_name: str, shape: tuple[int, ...], type_class: str,
            chunks: Callable[[], Iterator[np.ndarray]]) -> None:
        self.plan.append(PlannedTensor(gguf_name, shape, _tensor_type(type_class, self.outtype, shape[-1]), chunks))

    def table(self, table: tuple, layer: int | None, what: str) -> None:
        for gguf_name, local, type_class in table:
            name = self.take(f"layers.{layer}.{local}" if layer is not None else local, what)
            full = f"blk.{layer}.{gguf_name}" if layer is not None else gguf_name
            self.add(full, self.source.shape(name) or (1,), type_class, _rows(self.source, name))

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

                def chunks(name: str = name, part: str = part) -> Iterator[np.ndarray]:
                    for e in range(E):
                        block = self.source.rows(name, e, e + 1)
                        yield block if part == "down" else block[:, :F] if part == "gate" else block[:, F:]
            else:
                names = [self.take(f"{prefix}{e}.{part}_proj.weight", f"MoE layer {layer}") for e in range(E)]

                def chunks(names: list[str] = names) -> Iterator[np.ndarray]:
                    for member in names:
                        yield self.source.rows(member, 0, self.source.shape(member)[0])[None]
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
        unknown = sorted(self.by_name[c] for c in set(self.by_name) - self.used)
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise ConversionError(f"the checkpoint holds tensors this converter does not know: {shown}; it may be a "
                                  "different model or config.json may not match it")
        return self.plan


def plan_tensors(hp: Glm5NextConfig, source: Any, outtype: str) -> list[PlannedTensor]:
    """Map every source tensor to its ``glm5-next`` GGUF tensor; refuse missing, duplicate and unknown tensors."""
    return _Planner(hp, source, outtype).build()


def count_mtp_blocks(config: Mapping[str, Any], source: Any) -> int:
    """MTP blocks present in ``source`` (transformers' ``save_pretrained`` drops them, so often 0)."""
    n = int(_field(_text_config(config), "num_hidden_layers"))
    names = {canonical_name(name) for name in source.names()}
    count = 0
    while f"layers.{n + count}.eh_proj.weight" in names:
        count += 1
    return count


# ---------------------------------------------------------------- writing

Row = tuple[str, Any, GGUFValueType, GGUFValueType | None]


def write_gguf(out_path: str | os.PathLike[str], metadata: list[Row], plan: list[PlannedTensor],
               progress: Progress | None = None) -> None:
    """Write a GGUF atomically: a temporary file beside ``out_path``, fsync, then rename over it."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    writer = GGUFWriter(None, ARCH)
    try:
        for key, value, vtype, sub_type in metadata:
            writer.add_key_value(key, value, vtype, sub_type)
        for tensor in plan:
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes,
                                   raw_dtype=tensor.qtype)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout, total, done = writer.fout[0], sum(t.nbytes for t in plan), 0
        for tensor in plan:
            fout.write(b"\0" * (-fout.tell() % writer.data_alignment))
            written = 0
            for chunk in tensor.chunks():
                data = quantize(np.ascontiguousarray(chunk, dtype=np.float32), tensor.qtype).tobytes()
                fout.write(data)
                written += len(data)
            if written != tensor.nbytes:
                raise ConversionError(f"tensor {tensor.name} produced {written} bytes instead of {tensor.nbytes}; "
                                      "the source tensor does not match its declared shape")
            done += written
            if progress is not None:
                progress(done, total)
        fout.write(b"\0" * (-fout.tell() % writer.data_alignment))
        writer.flush()
        os.fsync(fout.fileno())
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _metadata_row(key: str, value: Any) -> Row:
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        return (key, items, GGUFValueType.ARRAY, GGUFValueType.get_type(items[0]) if items else GGUFValueType.INT32)
    return (key, value, GGUFValueType.get_type(value), None)


def tokenizer_metadata(src_dir: Path, vocab: int) -> list[Row]:
    """``tokenizer.*`` metadata (GLM pre-tokenizer ``glm4``), the token list padded with unused entries to ``vocab``."""
    if not (src_dir / "tokenizer.json").is_file():
        raise ConversionError(f"{src_dir} has no tokenizer.json; copy it from the model's Hugging Face repository")
    try:
        metadata = tokenizer_metadata_from_hf(src_dir, pre="glm4")
    except TokenizerError as exc:
        raise ConversionError(f"cannot convert the tokenizer of {src_dir}: {exc}") from None
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    if len(tokens) > vocab:
        raise ConversionError(f"tokenizer.json has {len(tokens)} tokens but the model only {vocab} embedding rows")
    metadata["tokenizer.ggml.tokens"] = [*tokens, *(f"[PAD{i}]" for i in range(len(tokens), vocab))]
    metadata["tokenizer.ggml.token_type"] = [*types, *[TOKEN_UNUSED] * (vocab - len(types))]
    return [_metadata_row(key, value) for key, value in metadata.items()]


def build_gguf(source: Any, config: Mapping[str, Any], tokenizer_dir: Path, out_path: str | os.PathLike[str],
               outtype: str, name: str, progress: Progress | None = None) -> None:
    """Write the ``glm5-next`` GGUF of ``source`` (``names/shape/rows``) under ``config`` (a config.json dict)."""
    outtype = _check_outtype(outtype)
    hp = hparams_from_config(config, count_mtp_blocks(config, source))
    plan = plan_tensors(hp, source, outtype)
    metadata = [("general.name", name, GGUFValueType.STRING, None),
                *((k, v, t, s) for k, (v, t, s) in hp.to_gguf_metadata().items()),
                *tokenizer_metadata(tokenizer_dir, hp.vocab_size)]
    write_gguf(out_path, metadata, plan, progress)


def _check_outtype(outtype: str) -> str:
    if not isinstance(outtype, str) or outtype.lower() not in OUTTYPES:
        raise ConversionError(f"unsupported output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    return outtype.lower()


def convert(src_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
            progress: Progress | None = None) -> None:
    """Convert the Hugging Face GLM 5.3 Flash directory ``src_dir`` to a ``glm5-next`` GGUF at ``out_path``.

    ``outtype``: ``f32``/``f16``/``bf16`` (that type for the matrices, F32 for norms, biases, convs, router and
    HC base/scale) or ``q8_0`` (Q8_0 matrices, F16 embedding/HC/indexer head weights and pool tensors).
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
    build_gguf(SafetensorsSource(src), config, src, out_path, outtype, src.resolve().name or "GLM-5.3-Flash", progress)
