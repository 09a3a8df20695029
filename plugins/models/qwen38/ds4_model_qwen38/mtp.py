"""The Qwen3.8 MTP head (spec §6): draft logits for the token after next from the trunk's last streams.

Stored as block ``blk.{n_layer}`` (``nextn_predict_layers`` = 1, see ``convert.py``). For trunk position t, with
``Hs`` the trunk streams after the last layer (before the final mixer) and ``x`` the token at t + 1:

    e  = rms(embed(x)) · enorm;   hn = rms(Hs over all hc·D) · hnorm, viewed (hc, D)
    H0 = eh_proj · [e | hn_k] for each stream k;   H1 = block(H0);   logits = output · hc_head_mix(H1)

Choices shared with the training head (``tools/train_tiny/mtp_qwen38.py``; spec §13 questions 1–2): the hidden
norm is flat over hc·D, the block keeps QSA selection over the MTP's own keys, the mixer is the MTP's own
(``nextn.hc_head_*``). The MTP's attention state has one slot per trunk position and rotates at that position t;
the spec's position t + 1 shifts every key and query alike, which rotary attention and the indexer's block scores
cannot see.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4_core.backend import Ops, WeightLoader
from ds4_core.errors import ContextError, GGUFTensorError, ModelConfigError
from ds4_core.scoring import cross_entropy

from .config import Qwen38Config
from .layers import MATMUL, NORM
from .model import Block, HyperConnection
from .state import AttentionState


class Qwen38Mtp:
    """The loaded MTP head; ``trunk`` is the :class:`ds4_model_qwen38.model.Qwen38Model` whose embedding and output
    head it shares."""

    def __init__(self, w: WeightLoader, ops: Ops, cfg: Qwen38Config, trunk: Any):
        D, layer = cfg.hidden_size, cfg.num_layers
        blk = f"blk.{layer}"
        self.cfg, self.ops = cfg, ops
        self.token_embd, self.output = trunk.token_embd, trunk.output
        try:
            self.enorm = w.get(f"{blk}.nextn.enorm.weight", (D,), NORM)
            self.hnorm = w.get(f"{blk}.nextn.hnorm.weight", (cfg.hc_count * D,), NORM)
            self.eh_proj = w.get(f"{blk}.nextn.eh_proj.weight", (D, 2 * D), MATMUL)
            self.hc_head = HyperConnection(w, f"{blk}.nextn.hc_head", cfg, inject=False)
            self.block = Block(w, ops, layer, cfg)
        except GGUFTensorError as exc:
            raise GGUFTensorError(f"the MTP head (nextn_predict_layers = 1, block {layer}) is incomplete: {exc}") \
                from None

    def new_state(self, ctx: int) -> AttentionState:
        """Empty MTP attention state for ``ctx`` trunk positions."""
        cfg, xp = self.cfg, self.ops.xp
        kv = (ctx, cfg.num_kv_heads, cfg.head_dim)
        return AttentionState(xp.zeros(kv, dtype=xp.float32), xp.zeros(kv, dtype=xp.float32),
                              xp.zeros((ctx, cfg.index_dim), dtype=xp.float32))

    def draft(self, streams: Any, next_ids: Any, state: AttentionState, p0: int) -> tuple[Any, Any]:
        """Draft a run of trunk positions ``p0 .. p0+T-1``.

        ``streams [T, n, D]``: trunk streams there (:meth:`Qwen38Model.forward_streams`); ``next_ids [T]``: the token
        after each position. Returns (logits ``[T, V]``, row i predicting the token at p0 + i + 2; the MTP streams
        ``[T, n, D]``, which chained drafting feeds back as ``streams``). Appends to ``state``; runs must come in
        position order (a run of any length gives the same logits as its positions one by one).
        """
        ops, xp, cfg = self.ops, self.ops.xp, self.cfg
        n, D = cfg.hc_count, cfg.hidden_size
        T = len(next_ids)
        if tuple(streams.shape) != (T, n, D):
            raise ModelConfigError(f"MTP draft: streams have shape {tuple(streams.shape)}, expected {(T, n, D)} "
                                   "(one trunk stream tensor per next token)")
        if p0 + T > state.keys.shape[0]:
            raise ContextError(f"{p0 + T} MTP positions do not fit its state of {state.keys.shape[0]}; "
                               "make a larger one with new_state")
        ids = ops.backend.asarray(np.asarray(next_ids, dtype=np.int64), dtype=xp.int32)
        e = ops.rms_norm(ops.embed(self.token_embd, ids), self.enorm, cfg.rms_norm_eps)  # [T, D]
        hn = ops.rms_norm(streams.reshape(T, n * D), self.hnorm, cfg.rms_norm_eps).reshape(T, n, D)
        pairs = xp.concatenate([xp.broadcast_to(e[:, None, :], (T, n, D)), hn], axis=-1)  # [T, n, 2D]
        H = ops.linear(pairs, self.eh_proj)
        pos = xp.arange(p0, p0 + T, dtype=xp.int32)
        H = self.block(ops, H, pos, state, p0, None)
        h, _ = self.hc_head(ops, H)
        return ops.linear(h, self.output), H


def _model_with_mtp(model: Any) -> Qwen38Mtp:
    if getattr(model, "mtp", None) is None:
        raise ModelConfigError("this Qwen3.8 file has no MTP head (nextn_predict_layers = 0); convert a checkpoint "
                               "that has mtp.* tensors (train.py --mtp writes model/mtp.safetensors)")
    return model.mtp


def mtp_logits(model: Any, ids: Any) -> np.ndarray:
    """Teacher-forced MTP logits of a whole sequence: ``ids [T]`` (T ≥ 2) -> ``[T-1, V]`` float32, row p predicting
    ``ids[p+2]`` from the trunk at p and ``ids[p+1]`` (the training head's contract). Uses fresh states."""
    mtp = _model_with_mtp(model)
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) < 2:
        raise ContextError("MTP logits need a 1-D sequence of at least two tokens")
    streams = model.forward_streams(ids[:-1], model.new_state(len(ids) - 1))
    logits, _ = mtp.draft(streams, ids[1:], mtp.new_state(len(ids) - 1), 0)
    return np.asarray(model.ops.backend.to_numpy(logits), dtype=np.float32)


def mtp_cross_entropy(model: Any, ids: Any) -> tuple[float, int]:
    """(summed cross-entropy in nats, count) of the MTP's predictions of ``ids[2:]`` (rows of :func:`mtp_logits`
    that have a target), for a held-out MTP loss over several windows."""
    ids = np.asarray(ids, dtype=np.int64)
    nats = cross_entropy(mtp_logits(model, ids)[:-1], ids[2:])
    return float(nats.sum()), nats.size
