"""Convert a Hugging Face Qwen3.8 Flash Next checkpoint to a ``qwen4exp`` GGUF (spec §3, §9.2).

Accepted layouts: what transformers' ``save_pretrained`` writes for ``Qwen4ExpForCausalLM`` (``model.*``) and
the released VLM checkpoint's text tower (``model.language_model.*``; vision and ``mtp.*`` tensors are
skipped, n-gram shards ``ngram_embedding.shard_k`` are concatenated in shard order).

Value changes made on the way, each at the function that makes it:

* zero-centred norm weights are stored as ``1 + w`` (:func:`_shift_norm`), so the graph uses plain RMS norms;
  the delta-net's gated ``norm`` is a plain weight and is not shifted;
* ``A_log`` becomes ``ssm_a = −exp(A_log)`` (:func:`_ssm_a`);
* depthwise conv weights ``[C, 1, K]`` are squeezed to ``[C, K]``;
* delta-net value heads move from transformers' grouped order to the tiled order (:func:`_tile_value_heads`);
* ``index_qk_proj`` is split into ``indexer.q_proj`` / ``indexer.k_proj`` and ``gate_up_proj`` into gate and up;
* every PLE layer's n-gram table is stacked into ``per_layer_token_embd`` (written last) with global head offsets.
"""

from __future__ import annotations

import json
import math
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

from .config import ARCH, Qwen38Config
from .hashing import layer_multipliers, table_sizes
from .model import NGRAM_TABLE

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
Progress = Callable[[int, int], None]
T = GGMLQuantizationType
Chunks = Callable[[], Iterator[np.ndarray]]

_TABLE_CHUNK_ROWS = 1 << 16
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4"}


# ---------------------------------------------------------------- hyperparameters


def _field(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConversionError(f"config.json has no {key!r}; it is required to convert a Qwen3.8 checkpoint")
    return config[key]


def _layer_types(config: Mapping[str, Any], n_layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval") or 4)
        types = ["indexed_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    types = ["indexed_attention" if t == "full_attention" else t for t in types]
    bad = sorted(set(types) - {"linear_attention", "indexed_attention"})
    if bad or len(types) != n_layers:
        raise ConversionError(f"config.json layer_types must list {n_layers} of linear_attention / indexed_attention, "
                              f"got {len(types)} entries{' with ' + ', '.join(bad) if bad else ''}")
    return list(types)


def hparams_from_config(config: Mapping[str, Any]) -> Qwen38Config:
    """Normalise a Qwen3.8 ``config.json`` dict (text config, or the composite one with ``text_config``)."""
    config = config.get("text_config") or config
    n_layers = int(_field(config, "num_hidden_layers"))
    D, head_dim = int(_field(config, "hidden_size")), int(_field(config, "head_dim"))
    types = _layer_types(config, n_layers)
    rope = config.get("rope_parameters") or {}
    ratio = int(config.get("indexer_compress_ratio") or 0)
    ple_ids = sorted({int(i) - 1 for i in config.get("ple_layer_ids") or []})
    ngram, per, vocab = int(config.get("ngram_size") or 3), int(config.get("heads_per_ngram") or 8), \
        int(_field(config, "vocab_size"))
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos  # transformers hashes with the first of a list
    if ple_ids and eos is None:
        raise ConversionError("config.json enables PLE (ple_layer_ids) but has no eos_token_id, the n-gram separator")
    heads = (ngram - 1) * per
    E = int(config.get("ple_embed_dim") or D)
    multipliers, sizes, offsets, base = [], [], [], 0
    for index in range(len(ple_ids)):
        multipliers += layer_multipliers(vocab, ngram, index, int(config.get("seed") or 1234))
        layer_sizes = table_sizes(int(config.get("ngram_vocab_size_base") or 20000000), heads, index)
        offsets += [base + sum(layer_sizes[:h]) for h in range(heads)]
        sizes += layer_sizes
        base += _padded_rows(layer_sizes, int(config.get("make_ngram_vocab_size_divisible_by") or 128))
    gate = config.get("output_gate_type") or config.get("hidden_act") or "silu"
    try:
        return Qwen38Config(
            vocab_size=vocab, hidden_size=D, num_layers=n_layers,
            context_length=int(_field(config, "max_position_embeddings")),
            num_heads=int(_field(config, "num_attention_heads")),
            num_kv_heads=int(_field(config, "num_key_value_heads")), head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6), rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_dim=int(head_dim * float(rope.get("partial_rotary_factor", 1.0))),
            n_experts=int(_field(config, "num_experts")), n_experts_used=int(_field(config, "num_experts_per_tok")),
            expert_ffn=int(_field(config, "moe_intermediate_size")),
            shared_ffn=int(_field(config, "shared_expert_intermediate_size")),
            expert_weights_norm=bool(config.get("norm_topk_prob", True)),
            conv_kernel=int(_field(config, "linear_conv_kernel_dim")),
            ssm_key_dim=int(_field(config, "linear_key_head_dim")),
            ssm_key_heads=int(_field(config, "linear_num_key_heads")),
            ssm_value_heads=int(_field(config, "linear_num_value_heads")),
            ssm_inner=int(_field(config, "linear_num_value_heads")) * int(_field(config, "linear_value_head_dim")),
            output_gate=gate, hc_count=int(_field(config, "hc_count")), hc_rank=int(_field(config, "hc_lowrank")),
            index_heads=int(config.get("indexer_n_heads") or 0), index_dim=int(config.get("indexer_head_dim") or 0),
            index_budget=int(config.get("indexer_budget") or 0), ngram_size=ngram if ple_ids else 0,
            heads_per_ngram=per if ple_ids else 0,
            ple_conv_kernel=int(config.get("ple_conv_kernel_size") or 4) if ple_ids else 0,
            ple_eos=int(eos or 0), ple_row_dim=E // heads if ple_ids else 0,
            compress_ratios=[ratio if t == "indexed_attention" else 0 for t in types],
            rope_sections=[*(rope.get("mrope_section") or []), 0], ple_layers=ple_ids,
            ple_multipliers=multipliers, ple_head_offsets=offsets, ple_head_sizes=sizes)
    except ModelConfigError as exc:
        raise ConversionError(f"config.json describes an inconsistent model: {exc}") from None


def _padded_rows(sizes: list[int], divisor: int) -> int:
    return math.ceil(sum(sizes) / divisor) * divisor


# ---------------------------------------------------------------- safetensors source


@attrs.frozen
class _Stored:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsSource:
    """Every ``*.safetensors`` file of a directory, memory-mapped, names normalised to ``model.*``."""

    def __init__(self, directory: Path):
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{directory} holds no *.safetensors files; point the converter at the model "
                                  "directory downloaded from Hugging Face")
        self.stored: dict[str, _Stored] = {}
        for path in files:
            try:
                with path.open("rb") as f:
                    length = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(length))
            except (OSError, ValueError) as exc:
                raise ConversionError(f"{path} is not a readable safetensors file ({exc}); re-download it") from None
            for name, entry in header.items():
                if name == "__metadata__" or name.startswith(("mtp.", "model.visual.")):
                    continue
                if entry["dtype"] not in _DTYPES:
                    raise ConversionError(f"{path}: tensor {name!r} has dtype {entry['dtype']}; supported: "
                                          f"{', '.join(_DTYPES)}")
                begin, end = entry["data_offsets"]
                self.stored[name.replace("model.language_model.", "model.")] = _Stored(
                    path, entry["dtype"], tuple(entry["shape"]), 8 + length + begin, 8 + length + end)
        self._maps: dict[Path, np.memmap] = {}

    def has(self, name: str) -> bool:
        return name in self.stored

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def _entry(self, name: str) -> _Stored:
        if name not in self.stored:
            raise ConversionError(f"the checkpoint has no tensor {name!r}; the download is incomplete or config.json "
                                  "does not match the weights")
        return self.stored[name]

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """``name[start:stop]`` as float32 (int64 for integer tensors)."""
        entry = self._entry(name)
        if entry.path not in self._maps:
            self._maps[entry.path] = np.memmap(entry.path, dtype=np.uint8, mode="r")
        raw = self._maps[entry.path][entry.begin:entry.end].view(_DTYPES[entry.dtype]).reshape(entry.shape or (1,))
        raw = raw[start:stop]
        if entry.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.int64 if entry.dtype.startswith("I") else np.float32)


# ---------------------------------------------------------------- value transforms


def _shift_norm(w: np.ndarray) -> np.ndarray:
    """Zero-centred RMSNorm weight ``w`` (output ``rms(x)·(1 + w)``) -> the plain weight ``1 + w``."""
    return 1.0 + w


def _ssm_a(a_log: np.ndarray) -> np.ndarray:
    """``A_log`` -> the per-head log-decay rate ``−exp(A_log)`` (the decay is ``ssm_a · softplus(α + dt)``)."""
    return -np.exp(a_log.astype(np.float64)).astype(np.float32)


def _tile_value_heads(x: np.ndarray, nk: int, nv: int, axis: int = 0) -> np.ndarray:
    """Reorder value heads along ``axis`` from grouped to tiled order.

    transformers lets value head ``kh·(nv/nk) + r`` read key head ``kh``; the tiled order puts it at
    ``r·nk + kh`` so value head ``j`` reads key head ``j mod nk`` (the layout ggml-style kernels broadcast).
    """
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    tiled = x.reshape(nk, nv // nk, -1, *rest).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(tiled, 0, axis)


# ---------------------------------------------------------------- the plan


@attrs.frozen
class Planned:
    """One GGUF tensor: name, numpy-order shape, type, its row chunks in order."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    chunks: Chunks

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def _qtype(kind: str, outtype: str, row: int) -> GGMLQuantizationType:
    """``kind``: ``"f32"`` (norms, small vectors, conv taps) or ``"matrix"``."""
    if kind == "f32" or outtype == "f32":
        return T.F32
    if outtype == "q8_0":
        return T.Q8_0 if row % 32 == 0 else T.F16
    return T[outtype.upper()]


class _Planner:
    def __init__(self, hp: Qwen38Config, source: SafetensorsSource, outtype: str):
        self.hp, self.source, self.outtype = hp, source, outtype
        self.plan: list[Planned] = []
        self.names: set[str] = set()  # checkpoint tensors the plan reads

    def add(self, name: str, value: Callable[[], np.ndarray], shape: tuple[int, ...], kind: str = "matrix") -> None:
        self.plan.append(Planned(name, shape, _qtype(kind, self.outtype, shape[-1]), lambda: iter([value()])))

    def copy(self, name: str, hf: str, kind: str = "matrix",
             transform: Callable[[np.ndarray], np.ndarray] | None = None, shape: tuple[int, ...] | None = None) -> None:
        src = self.source
        self.names.add(hf)

        def value() -> np.ndarray:
            x = src.read(hf)
            return transform(x) if transform else x

        self.add(name, value, shape or src.shape(hf), kind)

    def norm(self, name: str, hf: str) -> None:
        self.copy(name, hf, "f32", _shift_norm)

    def hyper_connection(self, prefix: str, hf: str, inject: bool) -> None:
        self.norm(f"{prefix}_norm.weight", f"{hf}.hc_norm.weight")
        self.copy(f"{prefix}_down.weight", f"{hf}.input_mix_weight_down.weight")
        self.copy(f"{prefix}_up.weight", f"{hf}.input_mix_weight_up.weight")
        if inject:
            self.copy(f"{prefix}_inject.weight", f"{hf}.block_inject_weight.weight")

    def delta_net(self, blk: str, hf: str) -> None:
        hp = self.hp
        nk, nv, keys = hp.ssm_key_heads, hp.ssm_value_heads, 2 * hp.ssm_key_heads * hp.ssm_key_dim

        def heads(x: np.ndarray, axis: int = 0) -> np.ndarray:
            return _tile_value_heads(x, nk, nv, axis)

        def qkv(x: np.ndarray) -> np.ndarray:  # only the value rows/channels are per value head
            return np.concatenate([x[:keys], heads(x[keys:])])

        self.copy(f"{blk}.attn_qkv.weight", f"{hf}.in_proj_qkv.weight", transform=qkv)
        self.copy(f"{blk}.attn_gate.weight", f"{hf}.in_proj_z.weight", transform=heads)
        self.copy(f"{blk}.ssm_beta.weight", f"{hf}.in_proj_b.weight", transform=heads)
        self.copy(f"{blk}.ssm_alpha.weight", f"{hf}.in_proj_a.weight", transform=heads)
        self.copy(f"{blk}.ssm_a", f"{hf}.A_log", "f32", lambda x: heads(_ssm_a(x)))
        self.copy(f"{blk}.ssm_dt.bias", f"{hf}.dt_bias", "f32", heads)
        self.copy(f"{blk}.ssm_conv1d.weight", f"{hf}.conv1d.weight", "f32", lambda x: qkv(x[:, 0, :]),
                  (hp.conv_dim, hp.conv_kernel))
        self.copy(f"{blk}.ssm_norm.weight", f"{hf}.norm.weight", "f32")  # plain weight: no shift
        self.copy(f"{blk}.ssm_out.weight", f"{hf}.out_proj.weight", transform=lambda x: heads(x, axis=1))

    def attention(self, blk: str, hf: str) -> None:
        hp = self.hp
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            self.copy(f"{blk}.{ours}.weight", f"{hf}.{theirs}.weight")  # attn_q keeps [query | gate] per head
        self.norm(f"{blk}.attn_q_norm.weight", f"{hf}.q_norm.weight")
        self.norm(f"{blk}.attn_k_norm.weight", f"{hf}.k_norm.weight")
        split, D = hp.index_heads * hp.index_dim, hp.hidden_size
        qk = f"{hf}.indexer.index_qk_proj.weight"
        self.copy(f"{blk}.indexer.q_proj.weight", qk, transform=lambda x: x[:split], shape=(split, D))
        self.copy(f"{blk}.indexer.k_proj.weight", qk, transform=lambda x: x[split:], shape=(hp.index_dim, D))
        self.norm(f"{blk}.indexer.q_norm.weight", f"{hf}.indexer.q_layernorm.weight")
        self.norm(f"{blk}.indexer.k_norm.weight", f"{hf}.indexer.k_layernorm.weight")

    def moe(self, blk: str, hf: str) -> None:
        hp, src = self.hp, self.source
        E, F, D = hp.n_experts, hp.expert_ffn, hp.hidden_size
        self.copy(f"{blk}.ffn_gate_inp.weight", f"{hf}.gate.weight")
        self.copy(f"{blk}.ffn_gate_inp_shexp.weight", f"{hf}.shared_expert_gate.weight")
        for part in ("gate", "up", "down"):
            self.copy(f"{blk}.ffn_{part}_shexp.weight", f"{hf}.shared_expert.{part}_proj.weight")
        fused, down = f"{hf}.experts.gate_up_proj", f"{hf}.experts.down_proj"
        if src.has(fused):  # stacked experts, gate rows then up rows
            self.names |= {fused, down}
            if src.shape(fused) != (E, 2 * F, D) or src.shape(down) != (E, D, F):
                raise ConversionError(f"{fused} / {down} have shapes {src.shape(fused)} / {src.shape(down)}; "
                                      f"config.json implies {(E, 2 * F, D)} / {(E, D, F)}")
            parts = {"gate": (fused, slice(0, F)), "up": (fused, slice(F, 2 * F)), "down": (down, slice(None))}

            def experts(part: str) -> Chunks:  # one expert at a time keeps memory bounded
                name, rows = parts[part]
                return lambda: (src.read(name, e, e + 1)[0, rows] for e in range(E))
        else:  # one tensor per expert (what save_pretrained writes)
            def experts(part: str) -> Chunks:
                names = [f"{hf}.experts.{e}.{part}_proj.weight" for e in range(E)]
                self.names.update(names)
                for name in names:
                    if src.shape(name) != ((D, F) if part == "down" else (F, D)):
                        raise ConversionError(f"{name} has shape {src.shape(name)}; config.json implies "
                                              f"{(D, F) if part == 'down' else (F, D)}")
                return lambda: (src.read(name) for name in names)

        for part in ("gate", "up", "down"):
            shape = (E, D, F) if part == "down" else (E, F, D)
            self.plan.append(Planned(f"{blk}.ffn_{part}_exps.weight", shape,
                                     _qtype("matrix", self.outtype, shape[-1]), experts(part)))

    def ple(self, blk: str, hf: str) -> None:
        for ours, theirs in (("ple_key", "key_proj"), ("ple_value", "value_proj")):
            self.copy(f"{blk}.{ours}.weight", f"{hf}.{theirs}.weight")
        for norm in ("key", "query", "conv"):
            self.norm(f"{blk}.ple_norm_{norm}.weight", f"{hf}.norm_{norm}.weight")
        self.copy(f"{blk}.ple_conv1d.weight", f"{hf}.conv1d.weight", "f32", lambda x: x[:, 0, :],
                  (self.hp.hc_count * self.hp.hidden_size, self.hp.ple_conv_kernel))
        self._check_hash_buffers(hf)

    def _check_hash_buffers(self, hf: str) -> None:
        """The checkpoint's hash buffers (if saved) must equal the constants computed from config.json."""
        hp, index = self.hp, int(re.search(r"layers\.(\d+)\.", hf).group(1))
        i, n, heads = hp.ple_layers.index(index), hp.ngram_size, hp.ple_heads
        base = hp.ple_head_offsets[i * heads]
        expected = {"layer_multipliers": hp.ple_multipliers[i * n:(i + 1) * n],
                    "ngram_heads_vocab_sizes": hp.ple_head_sizes[i * heads:(i + 1) * heads],
                    "ngram_heads_offsets": [o - base for o in hp.ple_head_offsets[i * heads:(i + 1) * heads]]}
        for buffer, values in expected.items():
            name = f"{hf}.ple_embedding.{buffer}"
            self.names.add(name)
            if self.source.has(name) and self.source.read(name).tolist() != list(values):
                raise ConversionError(f"{name} does not match the n-gram hash that config.json implies; the config "
                                      "(seed, ngram_vocab_size_base, vocab_size, ple_layer_ids) does not fit the "
                                      "weights")

    def ngram_table(self) -> None:
        """Stack every PLE layer's table (single tensor or ``shard_k`` pieces) into :data:`NGRAM_TABLE`."""
        hp, src = self.hp, self.source
        pieces: list[str] = []
        for layer in hp.ple_layers:
            prefix = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding."
            if src.has(prefix + "weight"):
                pieces.append(prefix + "weight")
                continue
            shards = sorted((n for n in src.stored if n.startswith(prefix + "shard_")),
                            key=lambda n: int(n[len(prefix) + 6:].split(".")[0]))
            if not shards:
                raise ConversionError(f"the checkpoint has no n-gram table {prefix}weight (nor shard_k pieces)")
            pieces += shards
        self.names.update(pieces)
        rows = sum(src.shape(p)[0] for p in pieces)

        def chunks() -> Iterator[np.ndarray]:
            for piece in pieces:
                for start in range(0, src.shape(piece)[0], _TABLE_CHUNK_ROWS):
                    yield src.read(piece, start, start + _TABLE_CHUNK_ROWS)

        shape = (rows, hp.ple_row_dim)
        self.plan.append(Planned(NGRAM_TABLE, shape, _qtype("matrix", self.outtype, shape[1]), chunks))


def plan_tensors(hp: Qwen38Config, source: SafetensorsSource, outtype: str) -> list[Planned]:
    """Every GGUF tensor in file order (the n-gram table last, so a file cut short loses only table rows)."""
    p = _Planner(hp, source, outtype)
    p.copy("token_embd.weight", "model.embed_tokens.weight")
    for layer in range(hp.num_layers):
        blk, hf = f"blk.{layer}", f"model.layers.{layer}"
        if layer in hp.ple_layers:
            p.ple(blk, f"{hf}.ple")
        p.hyper_connection(f"{blk}.hc_attn", f"{hf}.attn_hyper_connection", inject=True)
        if hp.is_attention(layer):
            p.attention(blk, f"{hf}.self_attn")
        else:
            p.delta_net(blk, f"{hf}.linear_attn")
        p.hyper_connection(f"{blk}.hc_ffn", f"{hf}.mlp_hyper_connection", inject=True)
        p.moe(blk, f"{hf}.mlp")
    p.hyper_connection("output_hc", "model.hyper_connection_mixer", inject=False)
    p.copy("output.weight", "lm_head.weight")
    if hp.ple_layers:
        p.ngram_table()
    unknown = sorted(set(source.stored) - p.names)
    if unknown:
        raise ConversionError(f"the checkpoint holds tensors this converter does not know: {', '.join(unknown[:5])}"
                              f"{' …' if len(unknown) > 5 else ''}; it may be another model or config.json may not "
                              "match it")
    return p.plan


# ---------------------------------------------------------------- writing


def write_gguf(out_path: str | os.PathLike[str], metadata: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]],
               plan: list[Planned], progress: Progress | None = None) -> None:
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
                                      "the source tensor does not match config.json")
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


def _metadata_row(key: str, value: Any) -> tuple[str, Any, GGUFValueType, GGUFValueType | None]:
    if isinstance(value, (list, tuple)):
        items = list(value)
        return (key, items, GGUFValueType.ARRAY, GGUFValueType.get_type(items[0]) if items else GGUFValueType.INT32)
    return (key, value, GGUFValueType.get_type(value), None)


def tokenizer_metadata(src_dir: Path, vocab: int) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """``tokenizer.*`` rows from ``src_dir`` (pre-tokenizer ``qwen35``), padded with unused ids to ``vocab`` rows."""
    if not (src_dir / "tokenizer.json").is_file():
        raise ConversionError(f"{src_dir} has no tokenizer.json; copy it from the model's Hugging Face repository")
    try:
        metadata = tokenizer_metadata_from_hf(src_dir, pre="qwen35")
    except TokenizerError as exc:
        raise ConversionError(f"cannot convert the tokenizer of {src_dir}: {exc}") from None
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    if len(tokens) > vocab:
        raise ConversionError(f"tokenizer.json has {len(tokens)} tokens but the model only {vocab} embedding rows")
    metadata["tokenizer.ggml.tokens"] = [*tokens, *(f"[PAD{i}]" for i in range(len(tokens), vocab))]
    metadata["tokenizer.ggml.token_type"] = [*types, *[TOKEN_UNUSED] * (vocab - len(types))]
    return [_metadata_row(key, value) for key, value in metadata.items()]


def convert(src_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
            progress: Progress | None = None) -> None:
    """Convert the Hugging Face Qwen3.8 directory ``src_dir`` to a ``qwen4exp`` GGUF at ``out_path``.

    ``outtype``: ``f32``/``f16``/``bf16`` for the matrices and the n-gram table (F32 norms, conv taps and
    delta-net vectors), or ``q8_0`` (Q8_0 where rows are multiples of 32, else F16). Raises
    :class:`ConversionError` on anything it cannot convert; ``out_path`` is then left untouched.
    """
    if not isinstance(outtype, str) or outtype.lower() not in OUTTYPES:
        raise ConversionError(f"unsupported output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    src = Path(src_dir)
    try:
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{src}/config.json is missing or not valid JSON ({exc})") from None
    hp = hparams_from_config(config)
    source = SafetensorsSource(src)
    plan = plan_tensors(hp, source, outtype.lower())
    metadata = [("general.name", src.resolve().name or "Qwen3.8", GGUFValueType.STRING, None),
                *hp.to_gguf_metadata(), *tokenizer_metadata(src, hp.vocab_size)]
    write_gguf(out_path, metadata, plan, progress)

