"""What differs between the tiny models of the three families: tokenizer, document framing and model.

Each :class:`Family` names its pre-tokenizer (``ds4_core.pretokenizers``), its special tokens (ids 0.. of the BPE,
taken from the family plugin's ``tiny`` module), how a source file is framed in the token stream (the prefix is
what ``ds4 run --raw`` puts before a prompt: the GGUF's BOS, or nothing), and the transformers model. Every matrix
row length is a multiple of 32 so that all of them quantize to Q8_0.

Only :func:`Family.build` and :func:`Family.forward` need torch; only the tokenizer helpers need the plugins.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEEPSEEK4_CONFIG: dict[str, Any] = {
    "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
    "partial_rotary_factor": 0.25, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 128, "index_n_heads": 8,
    "index_head_dim": 32, "index_topk": 32, "sliding_window": 64,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "swiglu_limit": 10.0,
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}

_KDA, _MLA = "linear_attention", "indexed_attention"
#: GLM 5.3 Flash (~9M parameters): KDA + NoPE MLA with the pooled indexer (8 heads, 4-token pools, top-64 = 16
#: pools), one dense FFN layer then group-limited sigmoid MoE, 4 hyper-connection streams.
GLM53_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 6,
    "layer_types": [_KDA, _MLA] * 3, "mlp_layer_types": ["dense"] + ["sparse"] * 5,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128,
    "qk_rope_head_dim": 0, "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
    "index_topk": 64, "index_head_dim": 32, "index_n_heads": 8, "index_kpool": 4, "linear_num_heads": 4,
    "linear_head_dim": 64, "linear_conv_kernel_dim": 4, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "swiglu_limit": 10.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "bos_token_id": 2, "eos_token_id": 0, "pad_token_id": 0,
}
#: The composite model needs a vision tower; the converter skips it (and it is never run).
GLM53_VISION_CONFIG: dict[str, Any] = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
                                       "out_hidden_size": 128, "projection_intermediate_size": 32}

_GDN, _QSA = "linear_attention", "indexed_attention"
#: Qwen3.8 Flash Next (~11M parameters): gated delta-net + gated QSA attention (8 index heads, blocks of 4,
#: budget 64), softmax MoE with a shared expert, 4 hyper-connection streams, hashed 2/3-gram PLE on layers 1, 3
#: and 5 (one-indexed).
QWEN38_CONFIG: dict[str, Any] = {
    "hidden_size": 256, "num_hidden_layers": 6, "layer_types": [_GDN, _QSA] * 3,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
    "hc_count": 4, "hc_lowrank": 32, "ple_layer_ids": [1, 3, 5], "ple_embed_dim": 64, "heads_per_ngram": 2,
    "ngram_size": 3, "ngram_vocab_size_base": 4096, "make_ngram_vocab_size_divisible_by": 32,
    "ple_conv_kernel_size": 4, "split_ngram_parts": 4, "indexer_n_heads": 8, "indexer_kv_heads": 1,
    "indexer_head_dim": 32, "indexer_budget": 64, "indexer_compress_ratio": 4, "output_gate_type": "sigmoid",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [8, 4, 4]},
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 0,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class Family:
    """One architecture's tiny-model recipe (see the module docstring)."""

    name: str
    title: str
    pre: str  # ds4_core.pretokenizers name
    nfc: bool  # the family's tokenizer normalises to NFC first
    tiny_module: str  # plugin module holding SPECIAL_TOKENS
    tokenizer_config: dict[str, Any]
    doc_prefix: tuple[str, ...]  # special tokens before each file (the GGUF's BOS, if it has one)
    doc_suffix: tuple[str, ...]  # special tokens after each file
    build: Callable[[int, int, dict], Any] = field(repr=False)  # (vocab_size, seed, config overrides) -> model
    aux_loss_coef: float = 0.0  # weight of transformers' router load-balancing loss (softmax routers)
    mtp_module: str = ""  # tools/train_tiny module whose ``MtpHead(model)`` trains the family's MTP block
    fast_module: str = ""  # tools/train_tiny module with exact, faster training forwards (``patch``, ``patch_mtp``)

    def build_mtp(self, model: Any) -> Any:
        """The family's MTP head attached to ``model`` (see ``train.py``: ``MtpHead`` contract)."""
        head = importlib.import_module(self.mtp_module).MtpHead(model)
        return importlib.import_module(self.fast_module).patch_mtp(head) if self.fast_module else head

    def special_tokens(self) -> tuple[str, ...]:
        """The family's special tokens in id order (ids 0..)."""
        return tuple(importlib.import_module(self.tiny_module).SPECIAL_TOKENS)

    def write_tokenizer_files(self, directory: Path, tokenizer_json: str) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` as the family's converter reads them."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.tokenizer_config, "model_max_length": 4096}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1),
                                                         encoding="utf-8")

    def forward(self, model: Any, input_ids: Any) -> tuple[Any, Any]:
        """``(logits [B, T, V], weighted auxiliary loss or None)`` of ``input_ids [B, T]``."""
        if self.aux_loss_coef:
            out = model(input_ids=input_ids, output_router_logits=True)
            return out.logits, self.aux_loss_coef * out.aux_loss
        return model(input_ids=input_ids).logits, None


def _build_deepseek4(vocab_size: int, seed: int, overrides: dict) -> Any:
    """``DeepseekV4ForCausalLM``; hash tables hold ``num_experts_per_tok`` distinct experts per token (frozen)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(vocab_size=vocab_size, **{**DEEPSEEK4_CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            rows = [torch.randperm(config.n_routed_experts, generator=gen)[: config.num_experts_per_tok]
                    for _ in range(vocab_size)]
            gate.tid2eid.copy_(torch.stack(rows))
    return model


def _build_glm53(vocab_size: int, seed: int, overrides: dict) -> Any:
    """``Glm5NextForConditionalGeneration`` (the text part is what trains; the vision tower is a stub)."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = {"vocab_size": vocab_size, **GLM53_TEXT_CONFIG, **overrides}
    config = Glm5NextConfig(text_config=text,
                            vision_config={**GLM53_VISION_CONFIG, "out_hidden_size": text["hidden_size"]})
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Glm5NextForConditionalGeneration(config)


def _build_qwen38(vocab_size: int, seed: int, overrides: dict) -> Any:
    """``Qwen4ExpForCausalLM`` (text only), its QSA block selection vectorized (``fast_qwen38``: same numbers, no
    per-query loop)."""
    import fast_qwen38
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(vocab_size=vocab_size, **{**QWEN38_CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return fast_qwen38.patch(Qwen4ExpForCausalLM(config))


FAMILIES: dict[str, Family] = {
    "deepseek4": Family(
        name="deepseek4", title="DeepSeek V4", pre="joyai-llm", nfc=False, tiny_module="ds4_model_deepseek4.tiny",
        tokenizer_config={"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                          "pad_token": "<｜▁pad▁｜>"},
        doc_prefix=("<｜begin▁of▁sentence｜>",), doc_suffix=("<｜end▁of▁sentence｜>",), build=_build_deepseek4,
        mtp_module="mtp_deepseek4"),
    "glm53": Family(
        name="glm53", title="GLM 5.3 Flash", pre="glm4", nfc=False, tiny_module="ds4_model_glm5.tiny",
        tokenizer_config={"bos_token": "[gMASK]", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                          "add_bos_token": False},
        doc_prefix=("[gMASK]",), doc_suffix=("<|endoftext|>",), build=_build_glm53, mtp_module="mtp_glm53"),
    "qwen38": Family(
        name="qwen38", title="Qwen3.8 Flash Next", pre="qwen35", nfc=True, tiny_module="ds4_model_qwen38.tiny",
        tokenizer_config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        doc_prefix=(), doc_suffix=("<|endoftext|>",), build=_build_qwen38, aux_loss_coef=1e-2,
        mtp_module="mtp_qwen38", fast_module="fast_qwen38"),
}
