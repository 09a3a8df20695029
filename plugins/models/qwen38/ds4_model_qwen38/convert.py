"""Convert a Hugging Face Qwen3.8 Flash Next checkpoint to a ``qwen4exp`` GGUF (spec §3, §9.2).

Accepted layouts: what transformers' ``save_pretrained`` writes for ``Qwen4ExpForCausalLM`` (``model.*``) and
the released VLM checkpoint's text tower (``model.language_model.*``; vision tensors are skipped, n-gram shards
``ngram_embedding.shard_k`` are concatenated in shard order). An MTP head (``mtp.*``, spec §6: the checkpoint's own,
or ``mtp.safetensors`` written by ``tools/train_tiny/train.py --mtp``) becomes block ``blk.{n_layer}`` as llama.cpp
stores it (spec §9.2): ``block_count`` = trunk layers + 1, ``nextn_predict_layers`` = 1, an ordinary gated-attention
block plus ``blk.{n_layer}.nextn.{eh_proj, enorm, hnorm, hc_head_norm, hc_head_down, hc_head_up}``.

Value changes made on the way, each at the function that makes it:

* zero-centred norm weights are stored as ``1 + w`` (:func:`_shift_norm`), so the graph uses plain RMS norms;
  the delta-net's gated ``norm`` is a plain weight and is not shifted;
* ``A_log`` becomes ``ssm_a = −exp(A_log)`` (:func:`_ssm_a`);
* depthwise conv weights ``[C, 1, K]`` are squeezed to ``[C, K]``;
* delta-net value heads move from transformers' grouped order to the tiled order (:func:`_tile_value_heads`);
* ``index_qk_proj`` is split into ``indexer.q_proj`` / ``indexer.k_proj`` and ``gate_up_proj`` into gate and up;
* every PLE layer's n-gram table is stacked into ``per_layer_token_embd`` (written last) with global head offsets;
* the MTP's norms get the same ``1 + w`` shift (``enorm``, ``hnorm``, ``hc_head_norm`` and its block's norms), and
  ``fc_embedding`` / ``fc_hidden`` are joined into ``eh_proj = [fc_embedding | fc_hidden]`` (:meth:`_Planner.mtp`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
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
    stacked_expert_chunks,
    tokenizer_metadata,
    write_gguf_atomic,
)
from ds4_core.conversion import config_field as _field
from ds4_core.errors import ConversionError, ModelConfigError

from .config import ARCH, Qwen38Config
from .hashing import layer_multipliers, table_sizes
from .model import NGRAM_TABLE

_TABLE_CHUNK_ROWS = 1 << 16
_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32")


# ---------------------------------------------------------------- hyperparameters


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


def hparams_from_config(config: Mapping[str, Any], nextn_layers: int = 0) -> Qwen38Config:
    """Normalise a Qwen3.8 ``config.json`` dict (text config, or the composite one with ``text_config``);
    ``nextn_layers`` MTP blocks (0 or 1) follow the trunk."""
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
            ple_multipliers=multipliers, ple_head_offsets=offsets, ple_head_sizes=sizes, nextn_layers=nextn_layers)
    except ModelConfigError as exc:
        raise ConversionError(f"config.json describes an inconsistent model: {exc}") from None


def _padded_rows(sizes: list[int], divisor: int) -> int:
    return math.ceil(sum(sizes) / divisor) * divisor


# ---------------------------------------------------------------- safetensors source


MTP = "mtp."
_MTP_MARKER = "mtp.fc_embedding.weight"


def _text_tower_name(name: str) -> str | None:
    """The name the planner uses: the VLM's text tower as ``model.*``, MTP as ``mtp.*``; ``None`` (skipped) for
    vision."""
    if name.startswith("model.visual."):
        return None
    return name.replace("model.language_model.", "model.")


def text_tower_source(directory: Path) -> SafetensorsSource:
    """The checkpoint's text-model (and MTP) tensors, names normalised to ``model.*`` / ``mtp.*``."""
    return SafetensorsSource(directory, dtypes=_DTYPES, rename=_text_tower_name)


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


class _Planner:
    def __init__(self, hp: Qwen38Config, source: SafetensorsSource, outtype: str):
        self.hp, self.source, self.outtype = hp, source, outtype
        self.plan: list[PlannedTensor] = []
        self.names: set[str] = set()  # checkpoint tensors the plan reads

    def add(self, name: str, value: Callable[[], np.ndarray], shape: tuple[int, ...], kind: str = "matrix") -> None:
        self.plan.append(PlannedTensor(name, shape, gguf_type(kind, self.outtype, shape[-1]), lambda: iter([value()])))

    def copy(self, name: str, hf: str, kind: str = "matrix",
             transform: Callable[[np.ndarray], np.ndarray] | None = None, shape: tuple[int, ...] | None = None) -> None:
        src = self.source
        self.names.add(hf)

        def value() -> np.ndarray:
            x = src.rows(hf)
            return transform(x) if transform else x

        self.add(name, value, shape or src.shape(hf), kind)

    def norm(self, name: str, hf: str) -> None:
        self.copy(name, hf, "f32", _shift_norm)

    def hyper_connection(self, prefix: str, hf: str, inject: bool) -> None:
        self.norm(f"{prefix}_norm.weight", f"{hf}.hc_norm.weight")
        # the mixers stay float at every outtype: the loader (like ds4) accepts only F32/F16/BF16 there
        self.copy(f"{prefix}_down.weight", f"{hf}.input_mix_weight_down.weight", kind="half")
        self.copy(f"{prefix}_up.weight", f"{hf}.input_mix_weight_up.weight", kind="half")
        if inject:
            self.copy(f"{prefix}_inject.weight", f"{hf}.block_inject_weight.weight", kind="half")

    def delta_net(self, blk: str, hf: str) -> None:
        hp = self.hp
        nk, nv, keys = hp.ssm_key_heads, hp.ssm_value_heads, 2 * hp.ssm_key_heads * hp.ssm_key_dim

        def heads(x: np.ndarray, axis: int = 0) -> np.ndarray:
            return _tile_value_heads(x, nk, nv, axis)

        def qkv(x: np.ndarray) -> np.ndarray:  # only the value rows/channels are per value head
            return np.concatenate([x[:keys], heads(x[keys:])])

        self.copy(f"{blk}.attn_qkv.weight", f"{hf}.in_proj_qkv.weight", transform=qkv)
        self.copy(f"{blk}.attn_gate.weight", f"{hf}.in_proj_z.weight", transform=heads)
        # beta/alpha, the indexer projections and the routers stay float at every outtype, as the loader expects
        self.copy(f"{blk}.ssm_beta.weight", f"{hf}.in_proj_b.weight", "half", heads)
        self.copy(f"{blk}.ssm_alpha.weight", f"{hf}.in_proj_a.weight", "half", heads)
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
        self.copy(f"{blk}.indexer.q_proj.weight", qk, "half", lambda x: x[:split], (split, D))
        self.copy(f"{blk}.indexer.k_proj.weight", qk, "half", lambda x: x[split:], (hp.index_dim, D))
        self.norm(f"{blk}.indexer.q_norm.weight", f"{hf}.indexer.q_layernorm.weight")
        self.norm(f"{blk}.indexer.k_norm.weight", f"{hf}.indexer.k_layernorm.weight")

    def moe(self, blk: str, hf: str) -> None:
        hp, src = self.hp, self.source
        E, F, D = hp.n_experts, hp.expert_ffn, hp.hidden_size
        self.copy(f"{blk}.ffn_gate_inp.weight", f"{hf}.gate.weight", kind="half")
        self.copy(f"{blk}.ffn_gate_inp_shexp.weight", f"{hf}.shared_expert_gate.weight", kind="half")
        for part in ("gate", "up", "down"):
            self.copy(f"{blk}.ffn_{part}_shexp.weight", f"{hf}.shared_expert.{part}_proj.weight")
        fused, down = f"{hf}.experts.gate_up_proj", f"{hf}.experts.down_proj"
        if src.has(fused):  # stacked experts, gate rows then up rows
            self.names |= {fused, down}
            if src.shape(fused) != (E, 2 * F, D) or src.shape(down) != (E, D, F):
                raise ConversionError(f"{fused} / {down} have shapes {src.shape(fused)} / {src.shape(down)}; "
                                      f"config.json implies {(E, 2 * F, D)} / {(E, D, F)}")

            def experts(part: str) -> Chunks:  # one expert at a time keeps memory bounded
                return stacked_expert_chunks(src, down if part == "down" else fused, E, part, F)
        else:  # one tensor per expert (what save_pretrained writes)
            def experts(part: str) -> Chunks:
                names = [f"{hf}.experts.{e}.{part}_proj.weight" for e in range(E)]
                self.names.update(names)
                for name in names:
                    if src.shape(name) != ((D, F) if part == "down" else (F, D)):
                        raise ConversionError(f"{name} has shape {src.shape(name)}; config.json implies "
                                              f"{(D, F) if part == 'down' else (F, D)}")
                return member_chunks(src, names)

        for part in ("gate", "up", "down"):
            shape = (E, D, F) if part == "down" else (E, F, D)
            self.plan.append(PlannedTensor(f"{blk}.ffn_{part}_exps.weight", shape,
                                           gguf_type("matrix", self.outtype, shape[-1]), experts(part)))

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
            if self.source.has(name) and self.source.rows(name).tolist() != list(values):
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
            shards = sorted((n for n in src.names() if n.startswith(prefix + "shard_")),
                            key=lambda n: int(n[len(prefix) + 6:].split(".")[0]))
            if not shards:
                raise ConversionError(f"the checkpoint has no n-gram table {prefix}weight (nor shard_k pieces)")
            pieces += shards
        self.names.update(pieces)
        rows = sum(src.shape(p)[0] for p in pieces)

        def chunks() -> Iterator[np.ndarray]:
            for piece in pieces:
                for start in range(0, src.shape(piece)[0], _TABLE_CHUNK_ROWS):
                    yield src.rows(piece, start, start + _TABLE_CHUNK_ROWS)

        shape = (rows, hp.ple_row_dim)
        self.plan.append(PlannedTensor(NGRAM_TABLE, shape, gguf_type("matrix", self.outtype, shape[1]), chunks))


    def mtp(self) -> None:
        """The MTP head as block ``blk.{num_layers}``: a gated-attention block plus its ``nextn.*`` tensors."""
        hp, src = self.hp, self.source
        blk, D = f"blk.{hp.num_layers}", hp.hidden_size
        self.norm(f"{blk}.nextn.enorm.weight", f"{MTP}pre_fc_norm_embedding.weight")
        self.norm(f"{blk}.nextn.hnorm.weight", f"{MTP}pre_fc_norm_hidden.weight")
        fc = (f"{MTP}fc_embedding.weight", f"{MTP}fc_hidden.weight")
        for name in fc:
            if src.shape(name) != (D, D):
                raise ConversionError(f"{name} has shape {src.shape(name)}; config.json implies {(D, D)}")
        self.names.update(fc)
        self.add(f"{blk}.nextn.eh_proj.weight", lambda: np.concatenate([src.rows(fc[0]), src.rows(fc[1])], axis=1),
                 (D, 2 * D))  # applied to [embedding | hidden stream]
        self.hyper_connection(f"{blk}.nextn.hc_head", f"{MTP}hyper_connection_mixer", inject=False)
        self.names.add(f"{MTP}hyper_connection_mixer.block_inject_weight.weight")  # unused by a mixer: skipped
        layer = f"{MTP}layers.0"
        self.hyper_connection(f"{blk}.hc_attn", f"{layer}.attn_hyper_connection", inject=True)
        self.attention(blk, f"{layer}.self_attn")
        self.hyper_connection(f"{blk}.hc_ffn", f"{layer}.mlp_hyper_connection", inject=True)
        self.moe(blk, f"{layer}.mlp")


def mtp_layers(source: SafetensorsSource) -> int:
    """1 if the checkpoint has an MTP head (``mtp.*`` tensors), else 0."""
    if not any(name.startswith(MTP) for name in source.names()):
        return 0
    if not source.has(_MTP_MARKER):
        raise ConversionError(f"the checkpoint has mtp.* tensors but no {_MTP_MARKER}; the MTP head is incomplete — "
                              "re-save it or remove the mtp.* tensors to convert the trunk alone")
    return 1


def plan_tensors(hp: Qwen38Config, source: SafetensorsSource, outtype: str) -> list[PlannedTensor]:
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
    if hp.nextn_layers:
        p.mtp()
    if hp.ple_layers:
        p.ngram_table()
    refuse_unknown_tensors(source.names() - p.names, "it may be another model or config.json may not match it")
    return p.plan


def convert(src_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
            progress: Progress | None = None) -> None:
    """Convert the Hugging Face Qwen3.8 directory ``src_dir`` to a ``qwen4exp`` GGUF at ``out_path``.

    ``outtype``: ``f32``/``f16``/``bf16`` for the matrices and the n-gram table (F32 norms, conv taps and
    delta-net vectors), or ``q8_0`` (Q8_0 where rows are multiples of 32, else F16). Raises
    :class:`ConversionError` on anything it cannot convert; ``out_path`` is then left untouched.
    """
    outtype = check_outtype(outtype)
    src = Path(src_dir)
    config = read_hf_config(src)
    source = text_tower_source(src)
    hp = hparams_from_config(config, mtp_layers(source))
    plan = plan_tensors(hp, source, outtype)
    metadata = [metadata_row("general.name", src.resolve().name or "Qwen3.8"), *hp.to_gguf_metadata(),
                *tokenizer_metadata(src, hp.vocab_size, "qwen35")]
    write_gguf_atomic(out_path, ARCH, metadata, plan, progress)

