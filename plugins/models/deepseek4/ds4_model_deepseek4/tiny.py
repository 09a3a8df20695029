"""Tiny random-weight DeepSeek V4 models: a transformers oracle for tests, and the built-in default GGUF.

``build_tiny_hf`` (needs torch, transformers and tokenizers) saves a tiny ``DeepseekV4ForCausalLM`` with a small
byte-level BPE tokenizer. ``ensure_default_model`` needs none of them: it writes the same kind of model from numpy
random weights and the tokenizer shipped in ``data/tiny_tokenizer.json`` through the converter's GGUF writer.

The initialisation fixes transformers' test-hostile defaults (spec §1.4): sinks, position biases, correction
biases and HC base/scale are random, every hash-routing row names distinct experts, the SwiGLU limit is small
enough for the clamp to trigger, and weights are scaled by 1/sqrt(fan-in) so activations stay of order one.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .convert import ArraySource, build_gguf

# §13 special tokens, in id order (BOS 0, EOS 1, pad 2, then the chat markers).
SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<think>", "</think>", "｜DSML｜", "<｜latest_reminder｜>")

TINY_VOCAB = 512

# The tokenizer's training text: prose, code, digits, whitespace runs and some CJK, so common merges exist.
TRAINING_TEXT = """\
You are a helpful assistant. The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun.
Hello world! How are you today? I am fine, thank you. What is the weather like in the mountains this week?
DeepSeek V4 uses compressed sparse attention, heavily compressed attention and a sliding window of recent tokens.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 2 * i))

int main(void) { int x = 42; printf("%d\\n", x); return 0; }
The numbers 1, 22, 333, 4444 and 2026 appear here; so do 3.14159 and 1e-6.
<｜User｜>What is the capital of France?<｜Assistant｜></think>The capital of France is Paris.
<｜User｜>Think about it.<｜Assistant｜><think>Let me think step by step.</think>The answer is 7.
你好，世界。今日は良い天気です。カタカナ。
    indented line with    several   spaces	and a tab.
"""

# The default (spec §1.4) oracle configuration, in transformers' config.json flavour.
TINY_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 16,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 3,
    "sliding_window": 8,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "swiglu_limit": 0.5,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# The built-in default model: a little wider and longer-context than the oracle config (about 1.5 MB as Q8_0).
DEFAULT_MODEL_OVERRIDES: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    "n_routed_experts": 16,
    "moe_intermediate_size": 32,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 32,
    "index_topk": 16,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 4096,
}
DEFAULT_MODEL_FILE = "deepseek4-tiny-random-v1.gguf"
DEFAULT_MODEL_SEED = 0


def tiny_config(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tiny config.json dict with ``overrides`` applied (``layer_types``/``mlp_layer_types`` follow
    ``num_hidden_layers`` only if given explicitly)."""
    config = copy.deepcopy(TINY_CONFIG)
    config.update(copy.deepcopy(dict(overrides or {})))
    return config


def _layer_shapes(config: Mapping[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    """transformers parameter names (inside ``model.layers.N.``) -> shapes of one decoder layer."""
    d, n, hd = config["hidden_size"], config["hc_mult"], config["head_dim"]
    h, g, q = config["num_attention_heads"], config["o_groups"], config["q_lora_rank"]
    e, i = config["n_routed_experts"], config["moe_intermediate_size"]
    kind = config["layer_types"][layer]
    shapes: dict[str, tuple[int, ...]] = {}
    for hc in ("attn_hc", "ffn_hc"):
        shapes |= {f"{hc}.fn": ((2 + n) * n, n * d), f"{hc}.base": ((2 + n) * n,), f"{hc}.scale": (3,)}
    shapes |= {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_a_proj.weight": (q, d), "self_attn.q_a_norm.weight": (q,),
        "self_attn.q_b_proj.weight": (h * hd, q), "self_attn.kv_proj.weight": (hd, d),
        "self_attn.kv_norm.weight": (hd,), "self_attn.sinks": (h,),
        "self_attn.o_a_proj.weight": (g * config["o_lora_rank"], h * hd // g),
        "self_attn.o_b_proj.weight": (d, g * config["o_lora_rank"]),
        "mlp.gate.weight": (e, d), "mlp.experts.gate_up_proj": (e, 2 * i, d), "mlp.experts.down_proj": (e, d, i),
        "mlp.shared_experts.gate_proj.weight": (i, d), "mlp.shared_experts.up_proj.weight": (i, d),
        "mlp.shared_experts.down_proj.weight": (d, i),
    }
    if kind != "sliding_attention":
        m = config["compress_rates"][kind]
        coff = 2 if kind == "compressed_sparse_attention" else 1
        c = "self_attn.compressor."
        shapes |= {c + "position_bias": (m, coff * hd), c + "kv_proj.weight": (coff * hd, d),
                   c + "gate_proj.weight": (coff * hd, d), c + "kv_norm.weight": (hd,)}
        if coff == 2:
            ih, nih = config["index_head_dim"], config["index_n_heads"]
            x = c + "indexer."
            shapes |= {x + "position_bias": (m, 2 * ih), x + "kv_proj.weight": (2 * ih, d),
                       x + "gate_proj.weight": (2 * ih, d), x + "kv_norm.weight": (ih,),
                       x + "q_b_proj.weight": (nih * ih, q), x + "scorer.weights_proj.weight": (nih, d)}
    if config["mlp_layer_types"][layer] == "hash_moe":
        shapes["mlp.gate.tid2eid"] = (config["vocab_size"], config["num_experts_per_tok"])
    else:
        shapes["mlp.gate.e_score_correction_bias"] = (e,)
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], config: Mapping[str, Any],
                   rng: np.random.Generator) -> np.ndarray:
    """One parameter drawn so that every term of the forward pass matters (see the module docstring)."""
    if name.endswith("tid2eid"):
        experts = config["n_routed_experts"]
        return np.stack([rng.permutation(experts)[: shape[1]] for _ in range(shape[0])]).astype(np.int64)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(("scale", "hc_scale")):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith(("sinks", "position_bias", "base", "hc_base", "e_score_correction_bias")):
        return rng.standard_normal(shape).astype(np.float32)
    fan_in = 1 if name.endswith("embed_tokens.weight") else shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def random_weights(config: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random parameters of ``config`` under their transformers names (float32; tid2eid int64)."""
    d, n, v = config["hidden_size"], config["hc_mult"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "model.hc_head.hc_fn": (n, n * d),
              "model.hc_head.hc_base": (n,), "model.hc_head.hc_scale": (1,), "lm_head.weight": (v, d)}
    for layer in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{layer}.{k}": s for k, s in _layer_shapes(config, layer).items()}
    rng = np.random.default_rng(seed)
    return {name: _random_tensor(name, shape, config, rng) for name, shape in shapes.items()}


def train_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` tokens with DeepSeek V4's
    pre-tokenizer (``joyai-llm``) and the §13 special tokens at ids 0..8, trained on :data:`TRAINING_TEXT`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from ds4_core.pretokenizers import pre_tokenizer

    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre_tokenizer("joyai-llm").hf_split_patterns]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TRAINING_TEXT] * 4, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the training text yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}; "
                         "pick a smaller vocab_size")
    return tokenizer


def write_tokenizer_files(directory: Path, tokenizer_json: str) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` naming BOS/EOS/pad into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
              "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2], "model_max_length": 4096}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1),
                                                     encoding="utf-8")


def build_tiny_hf(directory: str | Path, config_overrides: Mapping[str, Any] | None = None, seed: int = 0) -> Any:
    """Save a tiny random ``DeepseekV4ForCausalLM`` (CPU, float32, eager) and its tokenizer into ``directory``.

    Returns the model in eval mode. Its vocabulary is the trained tokenizer's, so ``vocab_size`` in the overrides
    also sets the tokenizer size (at least 265: 9 special tokens + 256 bytes).
    """
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    directory = Path(directory)
    config = tiny_config(config_overrides)
    hf_config = DeepseekV4Config(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config).to(torch.float32).eval()
    state = {name: torch.from_numpy(value) for name, value in random_weights(config, seed).items()}
    model.load_state_dict(state, strict=True)
    model.save_pretrained(directory)
    write_tokenizer_files(directory, train_tiny_tokenizer(config["vocab_size"]).to_str())
    return model


def shipped_tokenizer_json() -> str:
    """The tokenizer.json shipped with the plugin (:func:`train_tiny_tokenizer` output, vocab :data:`TINY_VOCAB`)."""
    return resources.files(__package__).joinpath("data/tiny_tokenizer.json").read_text(encoding="utf-8")


def trained_model(cache_dir: str | Path | None = None) -> Path:
    """The shipped tiny DeepSeek V4 trained on Python's standard library (``ds4 run``'s default; see its card
    ``data/tiny-deepseek4.md``). ``cache_dir`` is unused: the file ships with the package."""
    return Path(__file__).parent / "data" / "tiny-deepseek4.gguf"


def ensure_default_model(cache_dir: str | Path) -> Path:
    """Path of a 2 MB random-weight DeepSeek V4 GGUF in ``cache_dir`` (a fast test fixture), built first if absent.

    Needs neither torch nor tokenizers; deterministic (seed :data:`DEFAULT_MODEL_SEED`); written atomically,
    so concurrent callers at worst build it twice.
    """
    cache_dir = Path(cache_dir)
    path = cache_dir / DEFAULT_MODEL_FILE
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(DEFAULT_MODEL_OVERRIDES)
    scratch = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=cache_dir))
    try:
        write_tokenizer_files(scratch, shipped_tokenizer_json())
        build_gguf(ArraySource(random_weights(config, DEFAULT_MODEL_SEED)), config, scratch, path, "q8_0",
                   "DeepSeek-V4-tiny-random")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def main() -> None:
    """Regenerate ``data/tiny_tokenizer.json`` (run ``python -m ds4_model_deepseek4.tiny``)."""
    target = Path(__file__).parent / "data" / "tiny_tokenizer.json"
    target.parent.mkdir(exist_ok=True)
    target.write_text(train_tiny_tokenizer().to_str(pretty=True), encoding="utf-8")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
