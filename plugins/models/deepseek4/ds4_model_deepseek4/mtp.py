"""The DeepSeek V4 MTP (next-n) block on the numpy graph: draft logits for the token after next (spec §8).

Row p of the MTP sequence reads the trunk's final stream state ``S[p] [n, D]`` (before its HyperHead; the model
keeps it as ``last_stream``) and the token ``t[p+1]``: ``e_proj · enorm(embed(t[p+1]))`` is added to every stream
of ``h_proj · hnorm(S[p])``, one decoder block runs at position p (sliding window only, learned top-k MoE with its
selection bias, its own raw KV ring), and ``output(norm(HyperHead_mtp(S)))`` predicts ``t[p+2]``. This is the
pairing ``tools/train_tiny/mtp_deepseek4.py`` trains (ds4's C drafter pairs ``S[p]`` with ``t[p]``, spec §18).
Rows may be fed in chunks of any length (a prefill over a run, or one row per decoded token): same result.

The block is the trunk's own :class:`~.model.Block`, built from the ``mtp.0.*`` tensors of the same GGUF through
a renaming view of the weight loader. Held-out MTP loss of a GGUF: ``MtpDrafter(engine.model).cross_entropy(w)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from ds4_core.backend import Ops, WeightLoader
from ds4_core.errors import ContextError, GGUFTensorError, ModelConfigError
from ds4_core.scoring import cross_entropy

from .config import DeepSeekV4Config
from .model import FLOAT, MATMUL, NORM, Block, DeepSeekV4Model
from .state import DeepSeekV4State, new_state

#: GGUF prefix of the MTP tensors (one next-n block, spec §12.3).
MTP_PREFIX = "mtp.0."


class _MtpTensors:
    """The weight loader seen through the names of layer 0: ``blk.0.X`` reads ``mtp.0.X``. Every tensor is
    required, the selection bias ``exp_probs_b`` included (optional in trunk layers, required here by §12.3)."""

    def __init__(self, w: WeightLoader):
        self.w = w

    @staticmethod
    def _name(name: str) -> str:
        return MTP_PREFIX + name.removeprefix("blk.0.")

    def get(self, name: str, shape: tuple[int, ...] | None = None, types: Iterable[str] | None = None) -> Any:
        return self.w.get(self._name(name), shape, types)

    optional = get

    def array(self, name: str, dtype: Any = np.float32, shape: tuple[int, ...] | None = None) -> np.ndarray:
        return self.w.array(self._name(name), dtype, shape)


class MtpBlock:
    """The loaded ``mtp.0.*`` weights: the input projections and norms, one decoder block, the MTP HyperHead."""

    def __init__(self, w: WeightLoader, ops: Ops, cfg: DeepSeekV4Config, qat: bool):
        n, D = cfg.hc_mult, cfg.hidden_size
        # The block is a sliding, non-hash layer; its SwiGLU clamp is the MTP entry of swiglu_clamp_exp when the
        # file lists one past the trunk layers (the official per-layer + MTP layout), else the last layer's.
        limits = np.asarray(w.gguf.metadata.get("deepseek4.swiglu_clamp_exp", cfg.swiglu_limits), dtype=np.float64)
        limit = float(limits[cfg.num_layers] if len(limits) > cfg.num_layers else cfg.swiglu_limits[-1])
        self.cfg = attrs.evolve(cfg, num_layers=1, n_hash_layers=0, compress_ratios=(0,), swiglu_limits=(limit,))
        p = MTP_PREFIX
        self.e_proj = w.get(f"{p}e_proj.weight", (D, D), MATMUL)
        self.h_proj = w.get(f"{p}h_proj.weight", (D, D), MATMUL)
        self.enorm = w.get(f"{p}enorm.weight", (D,), NORM)
        self.hnorm = w.get(f"{p}hnorm.weight", (D,), NORM)
        self.norm = w.get(f"{p}norm.weight", (D,), NORM)
        self.hc_head_fn = w.get(f"{p}hc_head_fn.weight", (n, n * D), FLOAT)
        self.hc_head_scale = w.get(f"{p}hc_head_scale.weight", (1,), NORM)
        self.hc_head_base = w.get(f"{p}hc_head_base.weight", (n,), NORM)
        self.block = Block(_MtpTensors(w), ops, 0, self.cfg, qat)


def load_mtp(w: WeightLoader, ops: Ops, cfg: DeepSeekV4Config, qat: bool) -> MtpBlock | None:
    """The MTP block when the file holds ``mtp.0.*`` tensors, else None; an incomplete block is an error."""
    if not any(name.startswith(MTP_PREFIX) for name in w.names()):
        return None
    try:
        return MtpBlock(w, ops, cfg, qat)
    except GGUFTensorError as exc:
        raise GGUFTensorError(f"the MTP block (mtp.0.* tensors) is incomplete: {exc}. Re-convert the checkpoint "
                              "with its complete mtp.safetensors, or without it") from None


@attrs.define
class MtpState:
    """The MTP block's own decoding state: one sliding layer (raw KV ring); ``n_tokens`` = next row's position."""

    state: DeepSeekV4State


class MtpDrafter:
    """Runs the MTP block of a loaded DeepSeek V4 model (``engine.model``); ``model.forward`` is unchanged."""

    def __init__(self, model: DeepSeekV4Model):
        if model.mtp is None:
            raise ModelConfigError("this DeepSeek V4 GGUF has no MTP block (no mtp.0.* tensors); convert a "
                                   "checkpoint that includes it (e.g. the trained tiny model's mtp.safetensors "
                                   "next to model.safetensors)")
        self.model, self.mtp = model, model.mtp

    def new_state(self, ctx: int) -> MtpState:
        """Empty MTP state for ``ctx`` rows."""
        return MtpState(new_state(self.mtp.cfg, ctx, self.model.ops.xp))

    def draft(self, streams: Any, next_ids: Any, state: MtpState) -> tuple[Any, Any]:
        """Rows ``state.n_tokens…``: ``streams [T, n, D]`` trunk final states at those positions, ``next_ids [T]``
        the tokens that follow them -> (logits ``[T, V]``, row p predicting the token after ``next_ids[p]``;
        the block's output streams ``[T, n, D]``, the state a recursive draft would read)."""
        model, mtp = self.model, self.mtp
        ops, xp, cfg = model.ops, model.ops.xp, mtp.cfg
        T, p0, st = len(next_ids), state.state.n_tokens, state.state
        if T < 1 or tuple(streams.shape) != (T, cfg.hc_mult, cfg.hidden_size):
            raise ContextError(f"draft needs T ≥ 1 trunk states [T, {cfg.hc_mult}, {cfg.hidden_size}] and T next "
                               f"tokens; got {tuple(streams.shape)} and {T}")
        if p0 + T > st.ctx:
            raise ContextError(f"{p0 + T} MTP rows do not fit the context of {st.ctx}; make a larger state")
        eps = cfg.rms_norm_eps
        ids = ops.backend.asarray(next_ids, dtype=xp.int32)
        pos = xp.arange(p0, p0 + T, dtype=xp.int32)
        e = ops.linear(ops.rms_norm(ops.embed(model.token_embd, ids), mtp.enorm, eps), mtp.e_proj)
        hs = ops.linear(ops.rms_norm(ops.backend.asarray(streams, dtype=xp.float32), mtp.hnorm, eps), mtp.h_proj)
        S = mtp.block(ops, hs + e[:, None, :], ids, pos, st.layers[0], p0)
        h = ops.hc_head(S, mtp.hc_head_fn, mtp.hc_head_scale, mtp.hc_head_base, cfg.hc_eps, eps)
        st.n_tokens = p0 + T
        return ops.linear(ops.rms_norm(h, mtp.norm, eps), model.output), S

    def logits(self, ids: Any) -> Any:
        """Draft logits ``[T-1, V]`` of a fresh prefill over ``ids [T]`` (T ≥ 2): row p predicts ``ids[p+2]``."""
        T = len(ids)
        if T < 2:
            raise ContextError("MTP logits need at least two tokens")
        self.model.forward(ids, self.model.new_state(T))
        return self.draft(self.model.last_stream[:-1], ids[1:], self.new_state(T - 1))[0]

    def cross_entropy(self, window: Any) -> tuple[float, int]:
        """(summed cross-entropy in nats, predicted tokens) of the MTP on ``window [T+1]``: the trunk reads
        ``window[:-1]`` and row p is scored on ``window[p+2]`` (``tools/train_tiny/train.py``'s held-out MTP loss)."""
        ids = np.asarray(window)
        nats = cross_entropy(self.model.ops.backend.to_numpy(self.logits(ids[:-1])), ids[2:])
        return float(nats.sum()), nats.size
