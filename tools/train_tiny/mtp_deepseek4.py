"""DeepSeek V4's MTP (next-n) block for joint training with a transformers ``DeepseekV4ForCausalLM`` (spec §8).

transformers does not instantiate the block (it drops ``mtp.*`` keys on load), so :class:`MtpHead` builds it from
transformers' own V4 modules: one ``DeepseekV4DecoderLayer`` configured as a sliding-attention layer with a
top-k (non-hash) MoE and its selection bias, a ``DeepseekV4HyperHead`` and ``DeepseekV4RMSNorm`` norms. The token
embedding, the LM head and the rotary tables are the trunk's own modules (shared, not copied).

Pairing, the usual DeepSeek training convention: row p combines the trunk's final stream state at position p with
the embedding of token p+1, runs the block at position p, and predicts token p+2. (ds4's experimental C drafter
pairs the state at p with the embedding of token p itself, spec §8 and §18 item 3.)

Contract: ``tools/train_tiny/train.py`` (``MtpHead(model)``, called right after the trunk's forward);
``tools/train_tiny/train_mtp_frozen.py`` passes a frozen trunk's cached states instead.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.core_model_loading import revert_weight_conversion
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)

#: Prefix of the block's tensors in the official checkpoint (``num_nextn_predict_layers`` = 1).
CHECKPOINT_PREFIX = "mtp.0."


class MtpHead(nn.Module):
    """The MTP block attached to ``model`` (a ``DeepseekV4ForCausalLM``); see the module docstring."""

    def __init__(self, model: nn.Module):
        super().__init__()
        config = copy.deepcopy(model.config)
        config.num_hidden_layers = 1
        config.layer_types = ["sliding_attention"]  # the MTP entry of compress_ratios is 0: raw window only
        config.mlp_layer_types = ["moe"]  # learned top-k routing with a selection bias (gate.bias)
        self.config = config
        d = config.hidden_size
        self.embed_tokens = model.model.embed_tokens  # shared with the trunk
        self.lm_head = model.lm_head  # shared with the trunk
        self.rotary_emb = model.model.rotary_emb  # parameter-free tables ("main" theta for sliding layers)
        self.enorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = DeepseekV4DecoderLayer(config, layer_idx=0)
        self.hc_head = DeepseekV4HyperHead(config)
        self.norm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        own = (self.enorm, self.hnorm, self.e_proj, self.h_proj, self.block, self.hc_head, self.norm)
        for module in own:  # the trunk's initialisation rules (post_init never sees these modules)
            for sub in module.modules():
                model._init_weights(sub)
        self._trunk = [model]  # a list, so the trunk is not registered as a submodule of the head
        self._stream: torch.Tensor | None = None
        model.model.hc_head.register_forward_pre_hook(self._capture)

    def _capture(self, module: nn.Module, args: tuple) -> None:
        self._stream = args[0]  # [B, T, n, D]: the trunk's final streams before its HyperHead

    def forward(self, input_ids: torch.Tensor, stream: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T-1, V]`` for ``input_ids [B, T]``: row p predicts token p+2 from the trunk state at p and
        the embedding of token p+1. The trunk states are ``stream [B, T-1, n, D]`` (positions 0..T-2, e.g. cached
        from a frozen trunk) when given, else those captured from the trunk forward on ``input_ids`` that just ran."""
        if stream is None:
            stream = self._stream
            if stream is None or stream.shape[:2] != input_ids.shape:
                raise RuntimeError("MtpHead must be called right after the trunk's forward on the same input_ids")
            self._stream = None
            stream = stream[:, :-1]
        elif stream.shape[:2] != (input_ids.shape[0], input_ids.shape[1] - 1):
            raise ValueError(f"trunk states {tuple(stream.shape)} do not match input_ids {tuple(input_ids.shape)}: "
                             "expected one state per position but the last")
        next_ids = input_ids[:, 1:]
        e = self.e_proj(self.enorm(self.embed_tokens(next_ids)))  # [B, T-1, D]
        hs = self.h_proj(self.hnorm(stream))  # [B, T-1, n, D], per stream
        hidden = hs + e.unsqueeze(2)
        positions = torch.arange(next_ids.shape[1], device=input_ids.device).unsqueeze(0)
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=e, attention_mask=None,
                                                 past_key_values=None, position_ids=positions)
        rope = {kind: self.rotary_emb(e, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
        hidden = self.block(hidden, position_embeddings=rope, position_ids=positions, attention_mask=mask)
        return self.lm_head(self.norm(self.hc_head(hidden)))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The block's weights under the official checkpoint names (``mtp.0.e_proj.weight``,
        ``mtp.0.attn.wq_a.weight``, ``mtp.0.ffn.experts.E.w1.weight``, ``mtp.0.hc_head_fn``, ...).

        The decoder block's names come from transformers' own save-time renaming of a trunk layer, so they match
        what ``save_pretrained`` writes for ``model.layers.N.*``; the shared embedding and head are left out.
        """
        layer = "model.layers.0."
        block = {layer + name: value for name, value in self.block.state_dict().items()}
        renamed = revert_weight_conversion(self._trunk[0], block)
        tensors = {CHECKPOINT_PREFIX + name.removeprefix(layer): value for name, value in renamed.items()}
        for name, module in (("enorm", self.enorm), ("hnorm", self.hnorm), ("e_proj", self.e_proj),
                             ("h_proj", self.h_proj), ("norm", self.norm)):
            tensors[f"{CHECKPOINT_PREFIX}{name}.weight"] = module.weight
        for part in ("fn", "base", "scale"):
            tensors[f"{CHECKPOINT_PREFIX}hc_head_{part}"] = getattr(self.hc_head, f"hc_{part}")
        return tensors
