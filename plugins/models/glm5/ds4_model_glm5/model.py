"""The GLM 5.2 (``glm-dsa``) graph on the op vocabulary: MLA over a latent cache, the DSA indexer with IndexShare,
dense-then-MoE feed-forward with sigmoid group-limited routing (spec §4–5).

Ordered weights → indexer → attention → feed-forward → block → model. Attribute names follow the GGUF tensor names
(spec §10.2); shapes are numpy order (GGUF dims reversed). ``T`` is the chunk length, ``p0`` the position of its
first token. Attention is computed *absorbed*: queries are mapped into the latent space with ``attn_k_b``, attend
over the cached ``[c_kv | k_rope]`` rows (one K=V table shared by all heads), and the latent output is expanded
with ``attn_v_b`` — exactly the decompressed MLA of transformers. A chunk of any length gives the same result as
feeding its tokens one by one: each query only ever sees rows of positions up to its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4_core.backend import Ops, WeightLoader
from ds4_core.errors import ContextError, GGUFTensorError

from .config import INDEXER_NORM_EPS, LATENT_NORM_EPS, GlmDsaConfig
from .state import GlmDsaState, LayerState, new_state, state_nbytes

# GGML types each kind of tensor may have.
NORM = ("F32",)
FLOAT = ("F32", "F16", "BF16")
MATMUL = (*FLOAT, "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K")
EXPERT = (*MATMUL, "IQ2_XXS")


def has_indexer(w: WeightLoader, layer: int) -> bool:
    """Whether block ``layer`` runs its own indexer ("full") rather than reusing the previous selection ("shared")."""
    return w.has(f"blk.{layer}.indexer.attn_k.weight")


class Indexer:
    """DSA lightning indexer of a "full" layer: ReLU-scored keys, top-k rows per query (spec §5.3)."""

    def __init__(self, w: WeightLoader, blk: str, cfg: GlmDsaConfig):
        self.nih, self.ih, self.topk, self.rd = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.rope_dim
        self.attn_q_b = w.get(f"{blk}.indexer.attn_q_b.weight", (self.nih * self.ih, cfg.q_lora_rank), MATMUL)
        self.attn_k = w.get(f"{blk}.indexer.attn_k.weight", (self.ih, cfg.hidden_size), MATMUL)
        self.k_norm = w.get(f"{blk}.indexer.k_norm.weight", (self.ih,), NORM)
        self.k_norm_bias = w.get(f"{blk}.indexer.k_norm.bias", (self.ih,), NORM)
        self.proj = w.get(f"{blk}.indexer.proj.weight", (self.nih, cfg.hidden_size), FLOAT)

    def _rope_head(self, ops: Ops, x: Any, pos: Any, inv_freq: Any) -> Any:
        """RoPE on the *first* ``rope_dim`` channels of ``x [T, ..., ih]`` (the main attention ropes the last)."""
        return ops.xp.concatenate([ops.rope(x[..., :self.rd], pos, inv_freq), x[..., self.rd:]], axis=-1)

    def keys(self, ops: Ops, x: Any, pos: Any, inv_freq: Any) -> Any:
        """Indexer keys ``[T, ih]`` of the attention input ``x [T, D]``."""
        k = ops.layer_norm(ops.linear(x, self.attn_k), self.k_norm, self.k_norm_bias, INDEXER_NORM_EPS)
        return self._rope_head(ops, k, pos, inv_freq)

    def select(self, ops: Ops, x: Any, q_lat: Any, pos: Any, keys: Any, inv_freq: Any) -> Any:
        """Top-``min(index_topk, R)`` causal rows per query among ``keys [R, ih]``, ``[T, K]`` int (``-1`` = none)."""
        xp, T = ops.xp, x.shape[0]
        q = self._rope_head(ops, ops.linear(q_lat, self.attn_q_b).reshape(T, self.nih, self.ih), pos, inv_freq)
        head_w = ops.linear(x, self.proj) * np.float32(self.nih ** -0.5)
        scores = ops.indexer_scores(q, keys, head_w, self.ih ** -0.5)
        causal = xp.arange(keys.shape[0])[None, :] <= pos[:, None]
        sel = ops.topk(xp.where(causal, scores, -xp.inf), min(self.topk, keys.shape[0]))
        return xp.where(xp.take_along_axis(causal, sel, axis=1), sel, -1)


class Attention:
    """MLA with q/kv low-rank projections and DSA row selection (spec §4.3, §5.3)."""

    def __init__(self, w: WeightLoader, ops: Ops, layer: int, cfg: GlmDsaConfig):
        blk, D, H, R = f"blk.{layer}", cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        self.cfg = cfg
        self.attn_q_a = w.get(f"{blk}.attn_q_a.weight", (cfg.q_lora_rank, D), MATMUL)
        self.attn_q_a_norm = w.get(f"{blk}.attn_q_a_norm.weight", (cfg.q_lora_rank,), NORM)
        self.attn_q_b = w.get(f"{blk}.attn_q_b.weight", (H * cfg.qk_head_dim, cfg.q_lora_rank), MATMUL)
        self.attn_kv_a_mqa = w.get(f"{blk}.attn_kv_a_mqa.weight", (cfg.key_length, D), MATMUL)
        self.attn_kv_a_norm = w.get(f"{blk}.attn_kv_a_norm.weight", (R,), NORM)
        self.attn_k_b = w.get(f"{blk}.attn_k_b.weight", (H, R, cfg.nope_dim), MATMUL)
        self.attn_v_b = w.get(f"{blk}.attn_v_b.weight", (H, cfg.v_head_dim, R), MATMUL)
        self.attn_output = w.get(f"{blk}.attn_output.weight", (D, H * cfg.v_head_dim), MATMUL)
        self.indexer = Indexer(w, blk, cfg) if has_indexer(w, layer) else None
        self.inv_freq = ops.backend.asarray(cfg.inv_freq())

    def __call__(self, ops: Ops, x: Any, pos: Any, ls: LayerState, p0: int, shared_sel: Any) -> tuple[Any, Any]:
        """``x [T, D]`` (normalised) at positions ``pos [T]`` -> (output ``[T, D]``, the row selection ``[T, K]``).

        ``shared_sel`` is the previous full layer's selection, used when this layer has no indexer.
        """
        cfg, xp, T = self.cfg, ops.xp, x.shape[0]
        H, R, dn, n = cfg.num_heads, cfg.kv_lora_rank, cfg.nope_dim, p0 + T
        q_lat = ops.rms_norm(ops.linear(x, self.attn_q_a), self.attn_q_a_norm, LATENT_NORM_EPS)
        q = ops.linear(q_lat, self.attn_q_b).reshape(T, H, cfg.qk_head_dim)
        q = xp.concatenate([ops.grouped_linear(q[..., :dn], self.attn_k_b), ops.rope(q[..., dn:], pos, self.inv_freq)],
                           axis=-1)
        kv = ops.linear(x, self.attn_kv_a_mqa)
        ls.latent[p0:n, :R] = ops.rms_norm(kv[:, :R], self.attn_kv_a_norm, LATENT_NORM_EPS)
        ls.latent[p0:n, R:] = ops.rope(kv[:, R:], pos, self.inv_freq)

        if self.indexer is not None:
            ls.index_keys[p0:n] = self.indexer.keys(ops, x, pos, self.inv_freq)
            if n > self.indexer.topk:
                sel = self.indexer.select(ops, x, q_lat, pos, ls.index_keys[:n], self.inv_freq)
            else:  # every causal row fits in the top-k: dense attention
                rows = xp.arange(n)[None, :]
                sel = xp.where(rows <= pos[:, None], rows, -1)
        elif shared_sel is None:
            raise GGUFTensorError("the first GLM attention layer has no indexer tensors, so there is no selection to "
                                  "share; the file is incomplete — re-convert it")
        else:
            sel = shared_sel

        o = ops.sparse_attention(q, ls.latent[:n], sel, None, cfg.qk_head_dim ** -0.5)
        v = ops.grouped_linear(o[..., :R], self.attn_v_b)
        return ops.linear(v.reshape(T, H * cfg.v_head_dim), self.attn_output), sel


class DenseFFN:
    """The SwiGLU MLP of the leading dense layers."""

    def __init__(self, w: WeightLoader, blk: str, cfg: GlmDsaConfig):
        D, F = cfg.hidden_size, cfg.ffn
        self.ffn_gate = w.get(f"{blk}.ffn_gate.weight", (F, D), MATMUL)
        self.ffn_up = w.get(f"{blk}.ffn_up.weight", (F, D), MATMUL)
        self.ffn_down = w.get(f"{blk}.ffn_down.weight", (D, F), MATMUL)

    def __call__(self, ops: Ops, x: Any) -> Any:
        return ops.linear(ops.swiglu(ops.linear(x, self.ffn_gate), ops.linear(x, self.ffn_up), 0.0), self.ffn_down)


class MoE:
    """Sigmoid-routed experts (correction bias, groups, renormalisation, routed scale) plus the shared expert."""

    def __init__(self, w: WeightLoader, blk: str, cfg: GlmDsaConfig):
        D, E, F, Fs = cfg.hidden_size, cfg.n_experts, cfg.expert_ffn, cfg.expert_ffn * cfg.n_shared_experts
        self.cfg = cfg
        self.ffn_gate_inp = w.get(f"{blk}.ffn_gate_inp.weight", (E, D), FLOAT)
        self.exp_probs_b = w.optional(f"{blk}.exp_probs_b.bias", (E,), NORM)
        self.ffn_gate_exps = w.get(f"{blk}.ffn_gate_exps.weight", (E, F, D), EXPERT)
        self.ffn_up_exps = w.get(f"{blk}.ffn_up_exps.weight", (E, F, D), EXPERT)
        self.ffn_down_exps = w.get(f"{blk}.ffn_down_exps.weight", (E, D, F), EXPERT)
        self.ffn_gate_shexp = w.get(f"{blk}.ffn_gate_shexp.weight", (Fs, D), MATMUL)
        self.ffn_up_shexp = w.get(f"{blk}.ffn_up_shexp.weight", (Fs, D), MATMUL)
        self.ffn_down_shexp = w.get(f"{blk}.ffn_down_shexp.weight", (D, Fs), MATMUL)

    def __call__(self, ops: Ops, x: Any) -> Any:
        routed, shared = ops.concurrently(lambda: self._routed(ops, x), lambda: self._shared(ops, x))
        return routed + shared

    def _routed(self, ops: Ops, x: Any) -> Any:
        cfg = self.cfg
        idx, weights = ops.moe_route_sigmoid(ops.linear(x, self.ffn_gate_inp), self.exp_probs_b, cfg.n_experts_used,
                                             cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group,
                                             cfg.expert_weights_norm)
        return ops.moe_experts(x, self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps, idx, weights, 0.0)

    def _shared(self, ops: Ops, x: Any) -> Any:
        h = ops.swiglu(ops.linear(x, self.ffn_gate_shexp), ops.linear(x, self.ffn_up_shexp), 0.0)
        return ops.linear(h, self.ffn_down_shexp)


class Block:
    """One decoder layer: pre-norm attention and feed-forward, each added to the residual."""

    def __init__(self, w: WeightLoader, ops: Ops, layer: int, cfg: GlmDsaConfig):
        blk = f"blk.{layer}"
        self.eps = cfg.rms_norm_eps
        self.attn_norm = w.get(f"{blk}.attn_norm.weight", (cfg.hidden_size,), NORM)
        self.ffn_norm = w.get(f"{blk}.ffn_norm.weight", (cfg.hidden_size,), NORM)
        self.attn = Attention(w, ops, layer, cfg)
        self.ffn = DenseFFN(w, blk, cfg) if cfg.is_dense(layer) else MoE(w, blk, cfg)

    def __call__(self, ops: Ops, h: Any, pos: Any, ls: LayerState, p0: int, sel: Any) -> tuple[Any, Any]:
        """Residual ``h [T, D]`` -> (``[T, D]``, this layer's row selection for the next shared layer)."""
        a, sel = self.attn(ops, ops.rms_norm(h, self.attn_norm, self.eps), pos, ls, p0, sel)
        h = h + a
        return h + self.ffn(ops, ops.rms_norm(h, self.ffn_norm, self.eps)), sel


class MtpBlock:
    """The next-token-prediction (MTP/nextn) block stored after the trunk (spec §8): loaded for a drafter, not run
    by :meth:`GlmDsaModel.forward`. Recipe: ``Block(eh_proj([enorm(embed(t+1)); hnorm(h_t)]))``, then
    ``output(shared_head_norm(·))``."""

    def __init__(self, w: WeightLoader, ops: Ops, layer: int, cfg: GlmDsaConfig):
        blk, D = f"blk.{layer}.nextn", cfg.hidden_size
        self.layer = layer
        self.eh_proj = w.get(f"{blk}.eh_proj.weight", (D, 2 * D), MATMUL)
        self.enorm = w.get(f"{blk}.enorm.weight", (D,), NORM)
        self.hnorm = w.get(f"{blk}.hnorm.weight", (D,), NORM)
        self.shared_head_norm = w.get(f"{blk}.shared_head_norm.weight", (D,), NORM)
        self.block = Block(w, ops, layer, cfg)


class GlmDsaModel:
    """A loaded GLM 5.2 model (satisfies :class:`ds4_core.model.Model`)."""

    family = "glm52"

    def __init__(self, w: WeightLoader, ops: Ops, cfg: GlmDsaConfig):
        D, V = cfg.hidden_size, cfg.vocab_size
        self.cfg, self.ops = cfg, ops
        self.vocab_size, self.max_context = V, cfg.context_length
        self.token_embd = w.get("token_embd.weight", (V, D), MATMUL)
        self.full_indexer = tuple(has_indexer(w, layer) for layer in range(cfg.num_layers))
        if not self.full_indexer[0]:
            raise GGUFTensorError("blk.0 has no indexer tensors (blk.0.indexer.*), but the first layer must run its "
                                  "own indexer; the file is incomplete — re-convert it")
        self.blocks = [Block(w, ops, layer, cfg) for layer in range(cfg.num_layers)]
        self.output_norm = w.get("output_norm.weight", (D,), NORM)
        self.output = w.get("output.weight", (V, D), MATMUL)
        #: MTP blocks (weights only; their use by a drafter is later work).
        self.mtp = [MtpBlock(w, ops, layer, cfg) for layer in range(cfg.num_layers, cfg.block_count)]

    def new_state(self, ctx: int) -> GlmDsaState:
        """Empty state for a context of ``ctx`` tokens."""
        return new_state(self.cfg, self.full_indexer, ctx, self.ops.xp)

    def state_nbytes(self, ctx: int) -> int:
        return state_nbytes(self.cfg, self.full_indexer, ctx)

    def forward(self, ids: Any, state: GlmDsaState, *, last_row: bool = False) -> Any:
        """Feed ids ``[T]`` (T ≥ 1) after the ``state.n_tokens`` tokens fed so far; return logits ``[T, V]`` (with
        ``last_row``, only the last position's ``[1, V]``: the head runs on that row alone)."""
        ops, xp = self.ops, self.ops.xp
        T, p0 = len(ids), state.n_tokens
        if T < 1:
            raise ContextError("forward needs at least one token")
        if p0 + T > state.ctx:
            raise ContextError(f"{p0 + T} tokens do not fit the context of {state.ctx}; start a new session "
                               "or load the model with a larger --ctx")
        pos = xp.arange(p0, p0 + T, dtype=xp.int32)
        h = ops.embed(self.token_embd, ops.backend.asarray(ids, dtype=xp.int32))
        sel = None
        for block, ls in zip(self.blocks, state.layers, strict=True):
            h, sel = block(ops, h, pos, ls, p0, sel)
        state.n_tokens = p0 + T
        h = h[-1:] if last_row else h
        return ops.linear(ops.rms_norm(h, self.output_norm, self.cfg.rms_norm_eps), self.output)
