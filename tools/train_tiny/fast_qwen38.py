"""Vectorised QSA block selection for training the tiny Qwen3.8 model (``Qwen4ExpForCausalLM``).

transformers' ``Qwen4ExpTextQSAIndexer`` picks each query's key blocks in a Python loop over (batch, query) with a
``nonzero`` host sync per query: ~40 small kernels per query and layer, which is what makes a GPU step take seconds.
Under the plain causal mask of a cache-free forward (how ``train.py`` calls the model) every query ``i`` sees the
tokens ``0..i``, so its complete blocks are the same 4-token groups ``[4b, 4b+4)`` for all queries, and the selection
becomes a handful of batched tensor ops: pool and rotate every block key once, score all (query, block) pairs with
one matmul, take top-k with not-yet-complete blocks at -inf. Same ops, same dtypes, same result; no host syncs and
no shape that depends on data.

The patch changes computation only (no parameter is added, renamed or reinitialised), so ``save_pretrained`` still
writes a plain transformers checkpoint. Forwards with an attention mask, position ids or a non-empty cache fall back
to transformers' own indexer.
"""

from __future__ import annotations

import math
from types import MethodType
from typing import Any

import torch
from torch import nn
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer, apply_rotary_pos_emb


def causal_block_selection(indexer: Qwen4ExpTextQSAIndexer, hidden_states: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor],
                           past_key_values: Any = None) -> torch.Tensor:
    """Bool mask ``[B, 1, T, T]`` of the tokens each query attends to: its top-k complete 4-token blocks by indexer
    score plus its incomplete tail block, for ``hidden_states [B, T, D]`` under the plain causal mask (query ``i``
    sees ``0..i``). ``position_embeddings`` are ``(cos, sin)`` ``[B, T, rotary_dim]`` indexed by key position; an
    (empty) ``past_key_values`` cache records the indexer keys as transformers does."""
    seq_len = hidden_states.shape[1]
    ratio, head_dim = indexer.compress_ratio, indexer.index_head_dim
    cos, sin = position_embeddings
    q, keys = indexer.index_qk_proj(hidden_states).split(
        [indexer.index_n_heads * head_dim, indexer.index_kv_heads * head_dim], dim=-1)
    if past_key_values is not None:
        past_key_values.update_indexer(keys, indexer.layer_idx)
    q = indexer.q_layernorm(q.unflatten(-1, (-1, head_dim)))  # [B, T, H, d]
    q = apply_rotary_pos_emb(q, cos=cos[:, -seq_len:], sin=sin[:, -seq_len:], unsqueeze_dim=2)
    num_blocks = seq_len // ratio
    pooled = keys[:, :num_blocks * ratio].unflatten(1, (num_blocks, ratio)).float().mean(dim=2).to(keys.dtype)
    block_keys = indexer.k_layernorm(pooled)  # [B, NB, d], rotated at each block's first position
    block_keys = apply_rotary_pos_emb(block_keys.unsqueeze(2), cos=cos[:, :num_blocks * ratio:ratio],
                                      sin=sin[:, :num_blocks * ratio:ratio], unsqueeze_dim=2).squeeze(2)
    scores = torch.matmul(q.float(), block_keys.float().transpose(-1, -2).unsqueeze(1))  # [B, T, H, NB]
    scores = torch.relu(scores).sum(dim=2) / math.sqrt(head_dim)  # [B, T, NB]

    device = hidden_states.device
    positions = torch.arange(seq_len, device=device)
    complete = (positions + 1) // ratio  # complete blocks each query sees: [T]
    block_visible = torch.arange(num_blocks, device=device) < complete[:, None]  # [T, NB]
    scores = scores.masked_fill(~block_visible, float("-inf"))
    top = scores.topk(min(indexer.block_topk, num_blocks), dim=-1).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True) & block_visible  # [B, T, NB]
    chosen_tokens = chosen.repeat_interleave(ratio, dim=-1)  # [B, T, NB * ratio]
    chosen_tokens = nn.functional.pad(chosen_tokens, (0, seq_len - num_blocks * ratio))
    tail = (positions[None, :] >= ratio * complete[:, None]) & (positions[None, :] <= positions[:, None])  # [T, T]
    return (chosen_tokens | tail).unsqueeze(1)


def _fast_forward(indexer: Qwen4ExpTextQSAIndexer, reference: Any, state: dict, hidden_states: torch.Tensor,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor,
                  past_key_values: Any) -> torch.Tensor:
    """The indexer's forward: the vectorised selection when the enclosing forward is plain causal, else
    transformers' own."""
    seq_len = hidden_states.shape[1]
    if not state["plain_causal"] or attention_mask.shape[-1] != seq_len:
        return reference(hidden_states, position_embeddings, attention_mask, past_key_values)
    with torch.no_grad():  # the selection is integer-valued: no gradient reaches the indexer either way
        return causal_block_selection(indexer, hidden_states, position_embeddings, past_key_values)


def _note_mask_kind(state: dict, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of ``Qwen4ExpTextModel``: the causal mask is plain when no mask, position ids or cached
    tokens come in."""
    cache = kwargs.get("past_key_values")
    state["plain_causal"] = (not args and kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None
                             and (cache is None or cache.get_seq_length() == 0))


def _patch_indexers(module: nn.Module, state: dict) -> int:
    count = 0
    for sub in module.modules():
        if isinstance(sub, Qwen4ExpTextQSAIndexer):
            if "forward" in sub.__dict__:
                raise RuntimeError("fast_qwen38: this model is already patched; call patch() once per model")
            if sub.index_kv_heads != 1:  # transformers' indexer pools one shared key per token, as done here
                raise ValueError(f"fast_qwen38 needs indexer_kv_heads 1, got {sub.index_kv_heads}")
            reference = sub.forward
            sub.forward = MethodType(lambda self, *a, _ref=reference: _fast_forward(self, _ref, state, *a), sub)
            count += 1
    return count


def patch(model: nn.Module) -> nn.Module:
    """Make ``model`` (a ``Qwen4ExpForCausalLM``) select QSA blocks with :func:`causal_block_selection` in its
    plain causal forwards; returns ``model``. Parameters and checkpoint are untouched."""
    state = {"plain_causal": False}
    if not _patch_indexers(model, state):
        raise ValueError("fast_qwen38.patch: the model has no QSA indexer (expected a Qwen4ExpForCausalLM)")
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: _note_mask_kind(state, module, args, kwargs), with_kwargs=True)
    return model


def patch_mtp(mtp: nn.Module) -> nn.Module:
    """Same for the MTP head of ``mtp_qwen38`` (its forward always builds a plain causal mask); returns ``mtp``."""
    if not _patch_indexers(mtp, {"plain_causal": True}):
        raise ValueError("fast_qwen38.patch_mtp: the module has no QSA indexer")
    return mtp
