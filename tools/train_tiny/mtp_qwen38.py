"""Qwen3.8 Flash Next MTP head for joint training (spec §6), attached to a transformers ``Qwen4ExpForCausalLM``.

transformers has no MTP module for this family, so the head is assembled here from transformers' own pieces: its
zero-centred RMS norm, one ``Qwen4ExpTextDecoderLayer`` of attention type (gated attention with its QSA indexer,
MoE, both hyper-connection sites, no PLE) and a final ``Qwen4ExpTextGatedResidual`` mixer without combine.

Choices where the public ports disagree (spec §13, open questions 1 and 2), shared with the numpy drafter
(``ds4_model_qwen38.mtp``):

* ``pre_fc_norm_hidden`` normalises the whole ``hc·D`` stream tensor at once (flat, as vLLM and llama.cpp do);
* the MTP layer keeps QSA block selection, over the MTP's own keys (vLLM), not dense attention;
* the MTP has its own mixer ``mtp.hyper_connection_mixer`` (vLLM, ds4 fork), not the trunk's.

Rotary positions: the entry for trunk position t sits at the position of x_{t+1} (t + 1). Every MTP key and
query is shifted alike, so attention scores and the indexer's block scores equal those at position t.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    Qwen4ExpTextDecoderLayer,
    Qwen4ExpTextGatedResidual,
    Qwen4ExpTextRMSNorm,
)


def mtp_layer_config(config: Qwen4ExpTextConfig) -> Qwen4ExpTextConfig:
    """The trunk config reduced to the MTP's single decoder layer: gated attention, no PLE."""
    values = config.to_dict()
    values.update(num_hidden_layers=1, layer_types=["indexed_attention"], ple_layer_ids=[])
    layer_config = Qwen4ExpTextConfig.from_dict(values)
    layer_config._attn_implementation = config._attn_implementation or "eager"
    layer_config._experts_implementation = config._experts_implementation  # from_dict leaves these unset
    return layer_config


class MtpHead(nn.Module):
    """Draft logits for the token after next (``tools/train_tiny/train.py`` contract).

    Submodule names are the checkpoint's ``mtp.*`` names without the prefix; the token embedding and the output head
    are the trunk's (shared, not saved).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config
        D, hc = config.hidden_size, config.hc_count
        eps = config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(D, eps=eps)
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(hc * D, eps=eps)  # flat over hc·D (see the module docstring)
        self.fc_embedding = nn.Linear(D, D, bias=False)
        self.fc_hidden = nn.Linear(D, D, bias=False)
        layer_config = mtp_layer_config(config)
        self.layers = nn.ModuleList([Qwen4ExpTextDecoderLayer(layer_config, 0)])
        self.hyper_connection_mixer = Qwen4ExpTextGatedResidual(config, use_combine=False)
        for module in self.modules():  # transformers' initialisation (zero-centred norms start at 0)
            model._init_weights(module)
        self.embed_tokens = model.model.embed_tokens
        self.lm_head = model.lm_head
        self.rotary_emb = model.model.rotary_emb
        self.hc, self.hidden_size = hc, D
        self._streams: torch.Tensor | None = None
        model.model.hyper_connection_mixer.register_forward_pre_hook(self._capture)

    def _capture(self, module: nn.Module, args: tuple) -> None:
        self._streams = args[0]  # [B, T, hc·D]: the trunk after its last layer, before the final mixer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, T]`` (just fed to the trunk) -> logits ``[B, T-1, V]``; row p predicts token p+2."""
        streams = self._streams
        if streams is None or tuple(streams.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError("MtpHead reads the trunk's last stream tensor: run the trunk's forward on the same "
                               "input_ids right before calling it")
        B, T = input_ids.shape
        D, hc = self.hidden_size, self.hc
        e = self.pre_fc_norm_embedding(self.embed_tokens(input_ids[:, 1:]))  # [B, T-1, D]
        hn = self.pre_fc_norm_hidden(streams[:, :-1]).unflatten(-1, (hc, D))  # [B, T-1, hc, D]
        H = (self.fc_embedding(e).unsqueeze(-2) + self.fc_hidden(hn)).flatten(-2)  # [B, T-1, hc·D]
        positions = torch.arange(1, T, device=input_ids.device).expand(B, -1)
        position_embeddings = self.rotary_emb(H, positions)
        n = T - 1
        causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
        mask = torch.zeros(n, n, dtype=H.dtype, device=H.device).masked_fill(~causal, torch.finfo(H.dtype).min)
        for layer in self.layers:
            H = layer(H, position_embeddings=position_embeddings, attention_mask=mask.expand(B, 1, n, n))
        return self.lm_head(self.hyper_connection_mixer(H))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The MTP's own weights under the checkpoint names ``mtp.*`` (spec §6); shared ones are left out."""
        shared = {"embed_tokens.", "lm_head.", "rotary_emb."}
        return {f"mtp.{name}": value for name, value in self.state_dict().items()
                if not name.startswith(tuple(shared))}
