"""Convert a Hugging Face GLM 5.2 checkpoint (``GlmMoeDsaForCausalLM``) to a ``glm-dsa`` GGUF (spec §10.2).

Accepts what transformers' ``save_pretrained`` writes (per-expert ``mlp.experts.E.{gate,up,down}_proj.weight``) and
the stacked runtime layout (``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``), in F32, F16 or
BF16 safetensors. ``kv_b_proj`` is split per head into ``attn_k_b`` (K-NoPE rows, transposed) and ``attn_v_b``
(V rows), as ds4 and llama.cpp store MLA. MTP blocks (``model.layers.L…`` with ``eh_proj``), when the checkpoint has
them, become ``blk.L.nextn.*`` plus a full block. Tensors stream one chunk at a time from memory-mapped files and the
output is written atomically.
"""

from __future__ import annotations

import json
import os
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

from .config import ARCH, GATING_SIGMOID, GlmDsaConfig

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
Progress = Callable[[int, int], None]
MetadataRow = tuple[str, Any, GGUFValueType, GGUFValueType | None]
T = GGMLQuantizationType
_CHUNK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------- hyperparameters

def _field(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConversionError(f"config.json has no {key!r}; it is required to convert a GLM 5.2 checkpoint "
                              "(copy it from the model's original config.json)")
    return config[key]


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


# ---------------------------------------------------------------- safetensors

_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}


@attrs.frozen
class _Stored:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsSource:
    """Every ``*.safetensors`` file of a directory, memory-mapped; F32, F16 and BF16 tensors read as float32."""

    def __init__(self, directory: Path):
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{directory} holds no *.safetensors files; point the converter at the model "
                                  "directory downloaded from Hugging Face or written by save_pretrained")
        self._stored: dict[str, _Stored] = {}
        self._maps: dict[Path, np.memmap] = {}
        for path in files:
            try:
                with path.open("rb") as f:
                    length = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(length))
            except (OSError, ValueError) as exc:
                raise ConversionError(f"{path} is not a readable safetensors file ({exc}); re-download it") from None
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in _DTYPES:
                    raise ConversionError(f"{path.name}: tensor {name!r} has dtype {entry['dtype']}; this converter "
                                          f"reads {', '.join(_DTYPES)} (dequantize FP8 checkpoints first)")
                if name in self._stored:
                    raise ConversionError(f"tensor {name!r} appears in two shards; remove the stray shard")
                begin, end = entry["data_offsets"]
                self._stored[name] = _Stored(path, entry["dtype"], tuple(entry["shape"]), 8 + length + begin,
                                             8 + length + end)

    def names(self) -> set[str]:
        return set(self._stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored[name].shape

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """``name[start:stop]`` as float32."""
        entry = self._stored[name]
        if entry.path not in self._maps:
            self._maps[entry.path] = np.memmap(entry.path, dtype=np.uint8, mode="r")
        raw = self._maps[entry.path][entry.begin:entry.end].view(_DTYPES[entry.dtype]).reshape(entry.shape or (1,))
        raw = raw[start:stop]
        return (raw.astype(np.uint32) << 16).view(np.float32) if entry.dtype == "BF16" else raw.astype(np.float32)


# ---------------------------------------------------------------- the plan

@attrs.frozen
class PlannedTensor:
    """One GGUF tensor: name, numpy-order shape (GGUF dims reversed), type, and its chunks in row order."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


# GGUF name inside blk.N. -> (HF name inside model.layers.N., type class). "matrix": Q8_0 under q8_0 (F16 when rows
# do not fill Q8_0 blocks), "half": F16 under q8_0, "f32": always F32; otherwise the outtype.
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


def _qtype(type_class: str, outtype: str, row_length: int) -> GGMLQuantizationType:
    if type_class == "f32":
        return T.F32
    if outtype != "q8_0":
        return T[outtype.upper()]
    return T.Q8_0 if type_class == "matrix" and row_length % 32 == 0 else T.F16


def _row_chunks(source: SafetensorsSource, name: str) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        shape = source.shape(name)
        if len(shape) < 2:
            yield source.rows(name, 0, shape[0] if shape else 1).reshape(shape or (1,))
            return
        step = max(1, _CHUNK_ELEMENTS // max(1, int(np.prod(shape[1:]))))
        for start in range(0, shape[0], step):
            yield source.rows(name, start, min(start + step, shape[0]))
    return chunks


class _Planner:
    """Maps source tensors to GGUF tensors, checking shapes and that every source tensor is used exactly once."""

    def __init__(self, hp: GlmDsaConfig, source: SafetensorsSource, outtype: str):
        self.hp, self.source, self.outtype = hp, source, outtype
        self.used: set[str] = set()
        self.plan: list[PlannedTensor] = []

    def need(self, name: str, shape: tuple[int, ...] | None = None) -> str:
        if name not in self.source.names():
            raise ConversionError(f"the checkpoint has no tensor {name!r}; the download is incomplete or config.json "
                                  "does not match the weights")
        if shape is not None and self.source.shape(name) != shape:
            raise ConversionError(f"tensor {name!r} has shape {self.source.shape(name)}, but config.json implies "
                                  f"{shape}")
        self.used.add(name)
        return name

    def add(self, gguf_name: str, shape: tuple[int, ...], type_class: str,
            chunks: Callable[[], Iterator[np.ndarray]]) -> None:
        self.plan.append(PlannedTensor(gguf_name, shape, _qtype(type_class, self.outtype, shape[-1]), chunks))

    def copy(self, table: tuple, layer: int) -> None:
        for gguf_name, local, type_class in table:
            name = self.need(f"model.layers.{layer}.{local}")
            self.add(f"blk.{layer}.{gguf_name}", self.source.shape(name) or (1,), type_class,
                     _row_chunks(self.source, name))

    def kv_b(self, layer: int) -> None:
        """``kv_b_proj [H·(dn+dv), R]`` -> ``attn_k_b [H, R, dn]`` (transposed K rows) and ``attn_v_b [H, dv, R]``."""
        hp, src = self.hp, self.source
        H, R, dn, dv = hp.num_heads, hp.kv_lora_rank, hp.nope_dim, hp.v_head_dim
        name = self.need(f"model.layers.{layer}.self_attn.kv_b_proj.weight", (H * (dn + dv), R))

        def heads(part: str) -> Callable[[], Iterator[np.ndarray]]:
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
        stacked = prefix + "gate_up_proj" in src.names()
        for part, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            if stacked:
                name = self.need(prefix + ("down_proj" if part == "down" else "gate_up_proj"),
                                 (E, D, F) if part == "down" else (E, 2 * F, D))
                members = [name] * E
            else:
                members = [self.need(f"{prefix}{e}.{part}_proj.weight", shape) for e in range(E)]

            def chunks(members: list[str] = members, part: str = part, rows: int = shape[0]) -> Iterator[np.ndarray]:
                for e, member in enumerate(members):
                    if not stacked:
                        yield src.rows(member, 0, rows)
                        continue
                    block = src.rows(member, e, e + 1)[0]
                    yield block if part == "down" else block[:F] if part == "gate" else block[F:]

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
          _row_chunks(source, p.need("model.embed_tokens.weight", (hp.vocab_size, hp.hidden_size))))
    for layer in range(hp.num_layers):
        p.block(layer, types[layer] == "full")
    for layer in range(hp.num_layers, hp.block_count):
        p.copy(_NEXTN, layer)
        p.block(layer, f"model.layers.{layer}.self_attn.indexer.wk.weight" in source.names())
        p.used.update(n for n in (f"model.layers.{layer}.{d}" for d in _NEXTN_DUPLICATES) if n in source.names())
    p.add("output_norm.weight", (hp.hidden_size,), "f32", _row_chunks(source, p.need("model.norm.weight")))
    p.add("output.weight", (hp.vocab_size, hp.hidden_size), "matrix",
          _row_chunks(source, p.need("lm_head.weight", (hp.vocab_size, hp.hidden_size))))
    unknown = sorted(source.names() - p.used)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ConversionError(f"the checkpoint holds tensors this converter does not know: {shown}; it may be another "
                              "model, or config.json (indexer_types, first_k_dense_replace) may not match it")
    return hp, p.plan


# ---------------------------------------------------------------- writing

def _encode(chunk: np.ndarray, qtype: GGMLQuantizationType) -> bytes:
    return quantize(np.ascontiguousarray(chunk, dtype=np.float32), qtype).tobytes()


def write_gguf(out_path: str | os.PathLike[str], metadata: list[MetadataRow], plan: list[PlannedTensor],
               progress: Progress | None = None) -> None:
    """Write a ``glm-dsa`` GGUF atomically: a temporary file beside ``out_path``, fsync, then rename over it."""
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
                data = _encode(chunk, tensor.qtype)
                fout.write(data)
                written += len(data)
            if written != tensor.nbytes:
                raise ConversionError(f"tensor {tensor.name} produced {written} bytes instead of {tensor.nbytes}; the "
                                      "source tensor does not match its declared shape")
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


def _metadata_row(key: str, value: Any) -> MetadataRow:
    if isinstance(value, (list, tuple)):
        items = list(value)
        return (key, items, GGUFValueType.ARRAY, GGUFValueType.get_type(items[0]) if items else GGUFValueType.INT32)
    return (key, value, GGUFValueType.get_type(value), None)


def tokenizer_metadata(src_dir: Path, vocab: int) -> list[MetadataRow]:
    """``tokenizer.*`` rows from ``src_dir``'s tokenizer.json (pre-tokenizer ``glm4``), padded to ``vocab`` tokens."""
    if not (src_dir / "tokenizer.json").is_file():
        raise ConversionError(f"{src_dir} has no tokenizer.json; copy it from the model's Hugging Face repository")
    try:
        metadata = tokenizer_metadata_from_hf(src_dir, pre="glm4")
    except TokenizerError as exc:
        raise ConversionError(f"cannot convert the tokenizer of {src_dir}: {exc}") from None
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    if len(tokens) > vocab:
        raise ConversionError(f"tokenizer.json has {len(tokens)} tokens but the model only {vocab} embedding rows; "
                              "the tokenizer belongs to another model")
    metadata["tokenizer.ggml.tokens"] = [*tokens, *(f"[PAD{i}]" for i in range(len(tokens), vocab))]
    metadata["tokenizer.ggml.token_type"] = [*types, *[TOKEN_UNUSED] * (vocab - len(types))]
    return [_metadata_row(key, value) for key, value in metadata.items()]


def convert(src_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
            progress: Progress | None = None) -> None:
    """Convert the Hugging Face GLM 5.2 directory ``src_dir`` to a ``glm-dsa`` GGUF at ``out_path``.

    ``outtype``: ``f32``/``f16``/``bf16`` (that type for matrices, F32 for norms, router and indexer head weights)
    or ``q8_0`` (Q8_0 matrices, F16 embedding). ``progress(done_bytes, total_bytes)`` is called after each tensor.
    Raises :class:`ConversionError` on anything it cannot convert; ``out_path`` is then left untouched.
    """
    if not isinstance(outtype, str) or outtype.lower() not in OUTTYPES:
        raise ConversionError(f"unsupported output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    src = Path(src_dir)
    try:
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"cannot read {src / 'config.json'} ({exc}); point the converter at a Hugging Face "
                              "model directory") from None
    hp, plan = plan_tensors(config, SafetensorsSource(src), outtype.lower())
    metadata = [("general.name", src.resolve().name or "GLM-5.2", GGUFValueType.STRING, None),
                *hp.to_gguf_metadata(), *tokenizer_metadata(src, hp.vocab_size)]
    write_gguf(out_path, metadata, plan, progress)
