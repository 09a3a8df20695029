"""The GLM 5.3 Flash MTP (next-n) block as a drafter: draft logits for the token after next (spec §8).

Row p of the MTP sequence reads the trunk's final state ``h[p]`` (:meth:`Glm5NextModel.hidden`: the final norm of
the streams' mean, the vector the LM head reads) and the token ``t[p+1]``:
``x = eh_proj([enorm(embed(t[p+1])) ; hnorm(h[p])])``, then a plain pre-norm DSA + MoE block (its own latent cache
and pooled indexer, no hyper-connections) at position p, then ``output(shared_head_norm(x))`` predicts ``t[p+2]``.
This is the recipe ``tools/train_tiny/mtp_glm53.py`` trains. Rows may be fed in chunks of any length (a prefill
over a run, or one row per decoded token); the result is the same.

Held-out MTP loss of a GGUF: ``MtpDrafter(engine.model).cross_entropy(window)``.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ds4_core.errors import ContextError, ModelConfigError
from ds4_core.scoring import cross_entropy

from .next_model import Glm5NextModel, MtpBlock
from .next_state import DsaState, PoolState


@attrs.define
class MtpState:
    """``n_rows`` MTP rows fed so far (the next row's position) and the block's attention cache."""

    ctx: int
    n_rows: int
    attn: DsaState


class MtpDrafter:
    """Runs the first MTP block of a loaded GLM 5.3 Flash model (``engine.model``); ``model.forward`` is unchanged."""

    def __init__(self, model: Glm5NextModel):
        if not model.mtp:
            raise ModelConfigError("this GLM 5.3 Flash GGUF has no MTP block (glm5-next.nextn_predict_layers is 0); "
                                   "convert a checkpoint that includes it (e.g. the trained tiny model's "
                                   "mtp.safetensors next to model.safetensors)")
        self.model, self.block = model, model.mtp[0]

    def new_state(self, ctx: int) -> MtpState:
        """Empty MTP state for ``ctx`` rows."""
        cfg, xp = self.model.cfg, self.model.ops.xp
        P, dI = cfg.index_pool, cfg.index_head_dim
        pool = None
        if self.block.attn.indexer is not None:
            pool = PoolState(open_keys=xp.zeros((P, dI), dtype=xp.float32),
                             open_gates=xp.zeros((P, dI), dtype=xp.float32),
                             pooled=xp.zeros((ctx // P, dI), dtype=xp.float32))
        latent = xp.zeros((ctx, cfg.kv_lora_rank), dtype=xp.float32)
        return MtpState(ctx=ctx, n_rows=0, attn=DsaState(latent=latent, pool=pool))

    def draft(self, hidden: Any, next_ids: Any, state: MtpState) -> Any:
        """Draft logits ``[T, V]`` for rows ``state.n_rows…``: ``hidden [T, D]`` trunk states at those positions,
        ``next_ids [T]`` the tokens that follow them; row p's logits predict the token after ``next_ids[p]``."""
        model, block = self.model, self.block
        ops, xp, cfg = model.ops, model.ops.xp, model.cfg
        T, p0 = len(next_ids), state.n_rows
        if T < 1 or hidden.shape != (T, cfg.hidden_size):
            raise ContextError(f"draft needs T ≥ 1 trunk states [T, {cfg.hidden_size}] and T next tokens; got "
                               f"{tuple(hidden.shape)} and {T}")
        if p0 + T > state.ctx:
            raise ContextError(f"{p0 + T} MTP rows do not fit the context of {state.ctx}; make a larger state")
        eps = cfg.rms_norm_eps
        e = ops.rms_norm(ops.embed(model.token_embd, ops.backend.asarray(next_ids, dtype=xp.int32)),
                         block.nextn_enorm, eps)
        h = ops.rms_norm(ops.backend.asarray(hidden, dtype=xp.float32), block.nextn_hnorm, eps)
        x = ops.linear(xp.concatenate([e, h], axis=1), block.nextn_eh_proj)
        x = x + _attention(ops, block, x, xp.arange(p0, p0 + T, dtype=xp.int32), state.attn, p0, eps)
        x = x + block.ffn(ops, ops.rms_norm(x, block.ffn_norm, eps))
        state.n_rows = p0 + T
        return ops.linear(ops.rms_norm(x, block.nextn_shared_head_norm, eps), model.output)

    def logits(self, ids: Any) -> Any:
        """Draft logits ``[T-1, V]`` of a fresh prefill over ``ids [T]`` (T ≥ 2): row p predicts ``ids[p+2]``."""
        T = len(ids)
        if T < 2:
            raise ContextError("MTP logits need at least two tokens")
        hidden = self.model.hidden(ids, self.model.new_state(T))
        return self.draft(hidden[:-1], ids[1:], self.new_state(T - 1))

    def cross_entropy(self, window: Any) -> tuple[float, int]:
        """(summed cross-entropy in nats, predicted tokens) of the MTP on ``window [T+1]``: the trunk reads
        ``window[:-1]`` and row p is scored on ``window[p+2]`` (``tools/train_tiny/train.py``'s held-out MTP loss)."""
        ids = np.asarray(window)
        nats = cross_entropy(self.model.ops.backend.to_numpy(self.logits(ids[:-1])), ids[2:])
        return float(nats.sum()), nats.size


def _attention(ops: Any, block: MtpBlock, x: Any, pos: Any, ls: DsaState, p0: int, eps: float) -> Any:
    """The block's pre-normed DSA attention on ``x [T, D]`` -> ``[T, D]``; it runs its own indexer."""
    if block.attn.indexer is None:
        raise ModelConfigError("the MTP block has no indexer tensors (blk.L.indexer.*); re-convert the model")
    return block.attn(ops, ops.rms_norm(x, block.attn_norm, eps), pos, ls, p0, None)[0]
