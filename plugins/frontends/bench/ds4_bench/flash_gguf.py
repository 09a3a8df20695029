"""A synthetic DeepSeek V4 Flash GGUF in the ds4 schema: the published shapes and tensor types, fewer layers, random
valid weights. ``ds4 bench -m FILE`` then times the real engine on it end to end, and llama.cpp's ``deepseek4``
loader can read the same file.

Layers keep the Flash schedule (spec §1.1): 0 and 1 sliding window, then CSA (ratio 4, even layers) and HCA
(ratio 128, odd layers); the first three layers route by hash. So 4 layers hold one CSA and one HCA layer, and a
CSA layer routed by scores first appears at 5 layers.
"""

from __future__ import annotations

import functools
import os
import re
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from ds4_model_deepseek4.config import CSA_RATIO, DeepSeekV4Config
from ds4_model_deepseek4.tiny import SPECIAL_TOKENS
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType

from ds4_core.errors import ModelConfigError
from ds4_core.quants import QUANT_NAMES, block_geometry, random_blocks, tensor_nbytes
from ds4_core.tokenizer import BYTE_TO_CHAR, TOKEN_CONTROL, TOKEN_NORMAL

from .synthetic_deepseek4 import RECIPES

_T = GGMLQuantizationType

#: DeepSeek V4 Flash hyperparameters (spec §1.1, §12.2) as :class:`DeepSeekV4Config` fields, for 43 layers.
FLASH: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, num_layers=43, context_length=1048576, num_heads=64, num_kv_heads=1,
    head_dim=512, value_dim=512, rope_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, n_experts=256,
    n_experts_used=6, expert_ffn=2048, n_shared_experts=1, n_hash_layers=3, sliding_window=128, index_n_heads=64,
    index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rope_theta=10000.0,
    compress_rope_theta=160000.0, yarn_factor=16.0, yarn_original_context=65536, yarn_beta_fast=32.0,
    yarn_beta_slow=1.0, routed_scaling_factor=1.5, expert_weights_norm=True, rms_norm_eps=1e-6,
    compress_ratios=[0, 0] + [CSA_RATIO if i % 2 == 0 else 128 for i in range(2, 43)], swiglu_limits=[10.0] * 43)

#: llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS``; its deepseek4 loader refuses any other value.
SQRT_SOFTPLUS_GATING = 4

# Random bytes generated per tensor and then repeated to fill it: large enough to defeat caches, small to be fast.
_PATTERN_BYTES = 8 << 20
_HASH_PATTERN_ROWS = 4096
_LAYER = re.compile(r"^blk\.\d+\.")


class PlannedTensor(NamedTuple):
    """One tensor of the file: GGUF name, numpy-order shape, GGML type."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def flash_config(layers: int, shapes: Mapping[str, Any] | None = None) -> DeepSeekV4Config:
    """The Flash config cut to ``layers`` decoder layers (``shapes`` overrides :data:`FLASH` fields first).

    The layer schedule and SwiGLU limits are the first ``layers`` entries of the (overridden) lists; the hash
    layer count is capped at ``layers``.
    """
    values = {**FLASH, **(shapes or {})}
    if layers < 1 or layers > len(values["compress_ratios"]):
        raise ModelConfigError(f"a synthetic Flash file has 1..{len(values['compress_ratios'])} layers, not {layers}")
    values |= dict(num_layers=layers, n_hash_layers=min(values["n_hash_layers"], layers),
                   compress_ratios=values["compress_ratios"][:layers],
                   swiglu_limits=(list(values["swiglu_limits"]) * layers)[:layers])
    return DeepSeekV4Config(**values)


def tensor_plan(cfg: DeepSeekV4Config, recipe: str = "q2") -> list[PlannedTensor]:
    """Every tensor of the ds4 schema (spec §12.3) for ``cfg``, in file order, typed as the published Flash recipe:
    routed experts per ``recipe``, attention projections, shared expert and output head Q8_0, token embedding,
    router, hyper-connection mixes, compressors and indexer F16, vectors F32, hash tables I32."""
    if recipe not in RECIPES:
        raise ModelConfigError(f"unknown recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    gate_up, down = (QUANT_NAMES[t] for t in RECIPES[recipe])
    D, V, E, F, n = cfg.hidden_size, cfg.vocab_size, cfg.n_experts, cfg.expert_ffn, cfg.hc_mult
    H, hd, G = cfg.num_heads, cfg.head_dim, cfg.o_groups
    mix = (2 + n) * n
    t = [PlannedTensor("token_embd.weight", (V, D), _T.F16), PlannedTensor("output.weight", (V, D), _T.Q8_0),
         PlannedTensor("output_norm.weight", (D,), _T.F32), PlannedTensor("output_hc_fn.weight", (n, n * D), _T.F16),
         PlannedTensor("output_hc_base.weight", (n,), _T.F32), PlannedTensor("output_hc_scale.weight", (1,), _T.F32)]
    for layer in range(cfg.num_layers):
        b = f"blk.{layer}."
        for sub in ("attn", "ffn"):
            t += [PlannedTensor(f"{b}hc_{sub}_fn.weight", (mix, n * D), _T.F16),
                  PlannedTensor(f"{b}hc_{sub}_scale.weight", (3,), _T.F32),
                  PlannedTensor(f"{b}hc_{sub}_base.weight", (mix,), _T.F32)]
        t += [PlannedTensor(f"{b}attn_norm.weight", (D,), _T.F32), PlannedTensor(f"{b}ffn_norm.weight", (D,), _T.F32),
              PlannedTensor(f"{b}attn_q_a.weight", (cfg.q_lora_rank, D), _T.Q8_0),
              PlannedTensor(f"{b}attn_q_a_norm.weight", (cfg.q_lora_rank,), _T.F32),
              PlannedTensor(f"{b}attn_q_b.weight", (H * hd, cfg.q_lora_rank), _T.Q8_0),
              PlannedTensor(f"{b}attn_kv.weight", (hd, D), _T.Q8_0),
              PlannedTensor(f"{b}attn_kv_a_norm.weight", (hd,), _T.F32),
              PlannedTensor(f"{b}attn_sinks.weight", (H,), _T.F32),
              PlannedTensor(f"{b}attn_output_a.weight", (G * cfg.o_lora_rank, H * hd // G), _T.Q8_0),
              PlannedTensor(f"{b}attn_output_b.weight", (D, G * cfg.o_lora_rank), _T.Q8_0),
              PlannedTensor(f"{b}ffn_gate_inp.weight", (E, D), _T.F16),
              PlannedTensor(f"{b}ffn_gate_exps.weight", (E, F, D), gate_up),
              PlannedTensor(f"{b}ffn_up_exps.weight", (E, F, D), gate_up),
              PlannedTensor(f"{b}ffn_down_exps.weight", (E, D, F), down),
              PlannedTensor(f"{b}ffn_gate_shexp.weight", (F, D), _T.Q8_0),
              PlannedTensor(f"{b}ffn_up_shexp.weight", (F, D), _T.Q8_0),
              PlannedTensor(f"{b}ffn_down_shexp.weight", (D, F), _T.Q8_0)]
        # llama.cpp requires the score bias on every routed-by-score layer (ds4 treats it as optional).
        t += [PlannedTensor(f"{b}ffn_gate_tid2eid.weight", (V, cfg.n_experts_used), _T.I32)
              if cfg.is_hash_layer(layer) else PlannedTensor(f"{b}exp_probs_b.bias", (E,), _T.F32)]
        m = cfg.compress_ratios[layer]
        if m:
            width = (2 if m == CSA_RATIO else 1) * hd
            t += [PlannedTensor(f"{b}attn_compressor_ape.weight", (m, width), _T.F16),
                  PlannedTensor(f"{b}attn_compressor_kv.weight", (width, D), _T.F16),
                  PlannedTensor(f"{b}attn_compressor_gate.weight", (width, D), _T.F16),
                  PlannedTensor(f"{b}attn_compressor_norm.weight", (hd,), _T.F32)]
        if m == CSA_RATIO:
            ih, nih = cfg.index_head_dim, cfg.index_n_heads
            t += [PlannedTensor(f"{b}indexer.attn_q_b.weight", (nih * ih, cfg.q_lora_rank), _T.F16),
                  PlannedTensor(f"{b}indexer.proj.weight", (nih, D), _T.F16),
                  PlannedTensor(f"{b}indexer_compressor_ape.weight", (m, 2 * ih), _T.F16),
                  PlannedTensor(f"{b}indexer_compressor_kv.weight", (2 * ih, D), _T.F16),
                  PlannedTensor(f"{b}indexer_compressor_gate.weight", (2 * ih, D), _T.F16),
                  PlannedTensor(f"{b}indexer_compressor_norm.weight", (ih,), _T.F32)]
    return t


def planned_nbytes(layers: int, recipe: str = "q2", shapes: Mapping[str, Any] | None = None) -> int:
    """Tensor bytes of the file :func:`write_flash_gguf` would write (the header adds ~3 MB of vocabulary)."""
    return sum(t.nbytes for t in tensor_plan(flash_config(layers, shapes), recipe))


def synthetic_vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary of exactly ``vocab_size`` tokens.

    Ids 0..8 are DeepSeek's special tokens (BOS 0, EOS 1, pad 2, chat markers), then the 256 byte-level
    characters; the rest are merged tokens: every pair of byte characters, then byte triples, each with its merge.
    """
    specials, alphabet = list(SPECIAL_TOKENS), list(BYTE_TO_CHAR)
    n_merged = vocab_size - len(specials) - len(alphabet)
    if n_merged < 0:
        raise ModelConfigError(f"a vocabulary needs at least {len(specials) + len(alphabet)} tokens, not {vocab_size}")
    pairs = [(a, b) for a in alphabet for b in alphabet]
    prefixes_needed = -(-max(0, n_merged - len(pairs)) // len(alphabet))  # pairs that start the triples
    pairs = (pairs + [(a + b, c) for a, b in pairs[:prefixes_needed] for c in alphabet])[:n_merged]
    tokens = specials + alphabet + [a + b for a, b in pairs]
    types = [TOKEN_CONTROL] * len(specials) + [TOKEN_NORMAL] * (len(tokens) - len(specials))
    return tokens, types, [f"{a} {b}" for a, b in pairs]


def _float_values(name: str, count: int, rng: np.random.Generator, fan_in: int) -> np.ndarray:
    """``count`` float32 values for a float tensor, drawn so activations stay of order one (as the tiny models do)."""
    if name.endswith("norm.weight"):
        return (1 + 0.1 * rng.standard_normal(count)).astype(np.float32)
    if name.endswith("_scale.weight"):
        return rng.uniform(0.5, 1.5, count).astype(np.float32)
    if name.endswith(("sinks.weight", "_base.weight", "_ape.weight", ".bias", "token_embd.weight")):
        return rng.standard_normal(count, dtype=np.float32)
    return rng.standard_normal(count, dtype=np.float32) / np.float32(np.sqrt(fan_in))


def tensor_pattern(t: PlannedTensor, cfg: DeepSeekV4Config, seed: int = 0) -> bytes:
    """Random valid bytes, a whole number of blocks (rows for the hash table), that :func:`tensor_bytes` repeats to
    the tensor's size. Made once per seed and role (the name without its layer, shape and type), so every layer's
    tensor of one role has the same bytes: a few dozen patterns make a 43-layer model."""
    return _role_pattern(_LAYER.sub("", t.name), t.shape, t.qtype, cfg.n_experts, seed)


@functools.lru_cache(maxsize=64)
def _role_pattern(role: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, n_experts: int,
                  seed: int) -> bytes:
    rng = np.random.default_rng([seed, zlib.crc32(role.encode())])
    t = PlannedTensor(role, shape, qtype)
    if qtype == _T.I32:  # hash routing: each token row names ``k`` distinct experts
        rows = min(shape[0], _HASH_PATTERN_ROWS)
        ids = rng.random((rows, n_experts)).argsort(axis=1)[:, : shape[1]]
        return ids.astype("<i4").tobytes()
    block_bytes = block_geometry(qtype)[1]
    blocks = min(t.nbytes, _PATTERN_BYTES) // block_bytes
    if qtype in (_T.F16, _T.F32):
        values = _float_values(role, blocks, rng, shape[-1])
        return values.astype("<f2" if qtype == _T.F16 else "<f4").tobytes()
    return random_blocks(qtype, blocks, rng).tobytes()


def _tensor_chunks(t: PlannedTensor, cfg: DeepSeekV4Config, seed: int) -> Iterator[memoryview]:
    """The bytes of ``t``: its pattern repeated, the last copy cut short (at a block/row boundary)."""
    pattern = memoryview(tensor_pattern(t, cfg, seed))
    left = t.nbytes
    while left:
        chunk = pattern[: min(left, len(pattern))]
        left -= len(chunk)
        yield chunk


def tensor_bytes(t: PlannedTensor, cfg: DeepSeekV4Config, seed: int = 0) -> np.ndarray:
    """All of ``t``'s bytes (uint8 ``[nbytes]``), as :func:`write_flash_gguf` writes them."""
    pattern = np.frombuffer(tensor_pattern(t, cfg, seed), dtype=np.uint8)
    return np.resize(pattern, t.nbytes)


def _header_writer(path: Path, cfg: DeepSeekV4Config, plan: list[PlannedTensor]) -> GGUFWriter:
    """A writer holding the metadata (ds4's, plus the keys llama.cpp's deepseek4 loader requires) and the
    tensor table of ``plan``; the caller writes the header and appends the data."""
    writer = GGUFWriter(path, "deepseek4")
    writer.add_name(f"DeepSeek-V4-Flash synthetic {cfg.num_layers}-layer")
    for key, (value, vtype, sub) in cfg.to_gguf_metadata().items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_uint32("deepseek4.expert_gating_func", SQRT_SOFTPLUS_GATING)
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    tokens, types, merges = synthetic_vocabulary(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("joyai-llm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(2)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    return writer


def _pad(f: Any, alignment: int) -> None:
    f.write(b"\0" * (-f.tell() % alignment))


def write_flash_gguf(path: str | Path, layers: int, recipe: str = "q2", seed: int = 0, progress: bool = True,
                     shapes: Mapping[str, Any] | None = None) -> Path:
    """Write a ``layers``-layer synthetic DeepSeek V4 Flash GGUF (ds4 schema, recipe ``recipe``) to ``path``.

    Tensors are streamed one after another, a few MB in memory at a time (a 4-layer Q2 file is ~9.5 GB): each
    tensor is a random pattern of at most 8 MiB — valid quant blocks from :func:`ds4_core.quants.random_blocks`,
    float weights scaled by 1/sqrt(fan-in), hash tables of distinct expert ids — repeated to its full size
    (:func:`tensor_pattern`: one per role, which every layer shares). So experts repeat their bytes every few MB and
    layers repeat each other; bandwidth timing does not care (each tensor has its own addresses), but the model
    computes nothing meaningful. ``shapes`` overrides :data:`FLASH` fields (tests write toy-size files). The file
    appears at ``path`` only when complete. Returns ``path``.
    """
    path = Path(path)
    cfg = flash_config(layers, shapes)
    plan = tensor_plan(cfg, recipe)
    partial = path.with_name(path.name + ".partial")
    try:
        writer = _header_writer(partial, cfg, plan)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        alignment = writer.data_alignment
        writer.close()
        with open(partial, "ab") as f, ProgressBar(progress, sum(t.nbytes for t in plan), path.name) as bar:
            _pad(f, alignment)
            for t in plan:
                for chunk in _tensor_chunks(t, cfg, seed):
                    f.write(chunk)
                    bar.advance(len(chunk))
                _pad(f, alignment)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


class ProgressBar:
    """A transient rich bar of bytes written (or another ``verb``) on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int, label: str, verb: str = "writing"):
        self.enabled, self.total, self.label, self.verb = enabled, total, label, verb
        self.bar: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            from ds4_core.console import stderr_console

            self.bar = Progress(TextColumn(f"{self.verb} {{task.description}}"), BarColumn(), DownloadColumn(),
                                TimeRemainingColumn(), console=stderr_console(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total)
        return self

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, nbytes)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
