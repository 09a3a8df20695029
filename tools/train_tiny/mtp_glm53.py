"""The GLM 5.3 Flash MTP (next-n) block for joint training (spec §8), which transformers 5.23 does not build.

DeepSeek-V3 recipe: ``h' = Block(eh_proj([enorm(embed(t[p+1])) ; hnorm(h[p])]))``, draft logits
``lm_head(shared_head.norm(h'))``, with the trunk's own embedding and LM head. ``Block`` is a plain pre-norm
DSA + MoE layer without hyper-connections (transformers' decoder layer always has them, so it is composed from
its ``Glm5NextTextAttention`` — with its own pooled indexer — and ``Glm5NextTextMoE``), running causally over the
rows p = 0..T-2 at positions p.

Trunk state ``h[p]`` (the spec's open question): the output of the trunk's final norm, i.e. ``norm(mean over the
hyper-connection streams)`` — transformers' ``last_hidden_state``, the vector the LM head reads. This is what
vLLM hands its MTP drafters (the target model's post-norm hidden state), it needs no extra tensor, and the numpy
drafter (``ds4_model_glm5.next_mtp``) reads the same vector from ``Glm5NextModel.hidden``.

Checkpoint names (``checkpoint_tensors``) are the ``model.language_model.layers.L.*`` names ``save_pretrained``
uses for trunk layers, with per-expert weights, plus ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm``;
``ds4 convert`` writes them as ``blk.L.*`` and ``blk.L.nextn.*`` (L = ``num_hidden_layers``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.models.glm5_next.modeling_glm5_next import (
    Glm5NextTextAttention,
    Glm5NextTextMoE,
    Glm5NextTextRMSNorm,
)

CHECKPOINT_PREFIX = "model.language_model.layers"


class MtpHead(nn.Module):
    """The MTP block of ``model`` (a ``Glm5NextForConditionalGeneration``), fed by a hook on its trunk's final norm.

    Call it right after the trunk's forward on ``input_ids [B, T]``: it returns logits ``[B, T-1, V]`` whose row p
    predicts token p+2 from the trunk state at p and the embedding of token p+1.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        trunk = model.model.language_model
        config = copy.deepcopy(model.config.text_config)
        self.layer = config.num_hidden_layers
        config.indexer_types = [*config.indexer_types, "full"]  # the block runs its own indexer
        D, eps = config.hidden_size, config.rms_norm_eps
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.enorm = Glm5NextTextRMSNorm(D, eps)
        self.hnorm = Glm5NextTextRMSNorm(D, eps)
        self.input_layernorm = Glm5NextTextRMSNorm(D, eps)
        self.self_attn = Glm5NextTextAttention(config, self.layer)
        self.post_attention_layernorm = Glm5NextTextRMSNorm(D, eps)
        self.mlp = Glm5NextTextMoE(config)
        self.shared_head_norm = Glm5NextTextRMSNorm(D, eps)
        for module in self.modules():  # the trunk's own initialisation, before the shared modules join
            trunk._init_weights(module)
        self.to(next(model.parameters()).dtype)
        self.embed_tokens = trunk.embed_tokens  # shared with the trunk
        self.lm_head = model.lm_head  # shared with the trunk
        self._trunk_state: torch.Tensor | None = None
        trunk.norm.register_forward_hook(self._capture)

    def _capture(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._trunk_state = output

    def block(self, x: torch.Tensor) -> torch.Tensor:
        """The DSA + MoE layer on ``x [B, S, D]`` (causal, positions 0..S-1) -> ``[B, S, D]``."""
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        x = x + self.self_attn(hidden_states=self.input_layernorm(x), attention_mask=mask)[0]
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, T]`` (those the trunk just ran on) -> draft logits ``[B, T-1, V]``."""
        h = self._trunk_state
        if h is None or h.shape[:2] != input_ids.shape:
            raise RuntimeError("MtpHead must be called right after the trunk's forward on the same input_ids")
        e = self.enorm(self.embed_tokens(input_ids[:, 1:]))
        x = self.eh_proj(torch.cat([e, self.hnorm(h[:, :-1])], dim=-1))
        return self.lm_head(self.shared_head_norm(self.block(x)))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The block's weights under their checkpoint names (``model.language_model.layers.L.*``), per expert."""
        prefix = f"{CHECKPOINT_PREFIX}.{self.layer}."
        out = {prefix + "eh_proj.weight": self.eh_proj.weight, prefix + "enorm.weight": self.enorm.weight,
               prefix + "hnorm.weight": self.hnorm.weight,
               prefix + "shared_head.norm.weight": self.shared_head_norm.weight,
               prefix + "input_layernorm.weight": self.input_layernorm.weight,
               prefix + "post_attention_layernorm.weight": self.post_attention_layernorm.weight}
        out |= {f"{prefix}self_attn.{name}": t for name, t in self.self_attn.state_dict().items()}
        experts = self.mlp.experts
        out |= {f"{prefix}mlp.{name}": t for name, t in self.mlp.state_dict().items()
                if not name.startswith("experts.")}
        F = experts.intermediate_dim
        for e in range(experts.num_experts):
            out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = experts.gate_up_proj[e, :F]
            out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = experts.gate_up_proj[e, F:]
            out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = experts.down_proj[e]
        return {name: t.detach() for name, t in out.items()}
