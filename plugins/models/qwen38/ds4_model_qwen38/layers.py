"""The Qwen3.8 sub-blocks on the op vocabulary: gated delta-net, gated attention with QSA, MoE, PLE.

Attribute names follow the GGUF tensor names (spec §9.2); shapes are numpy order. ``T`` is the chunk
length and ``p0`` the position of its first token, or ``None`` for one token whose position is only in the device
array ``pos`` (a decode step recorded once as a graph and replayed: no shape or host decision depends on it). A
chunk of any length gives the same result as feeding its tokens one by one: every quantity depends only on absolute
positions and the state of spec §5, which every sub-block writes in place.
Zero-centred norm weights are stored as ``1 + w`` by the converter, so every norm here is a plain RMS norm.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4_core.backend import Ops, WeightLoader

from .config import Qwen38Config
from .state import AttentionState, DeltaNetState

NORM = ("F32",)
FLOAT = ("F32", "F16", "BF16")
MATMUL = (*FLOAT, "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K")
EXPERT = (*MATMUL, "IQ2_XXS", "MXFP4")


def small(w: WeightLoader, ops: Ops, name: str, shape: tuple[int, ...]) -> Any:
    """A small float tensor used in glue arithmetic, as a backend array."""
    return ops.backend.asarray(w.array(name, shape=shape), dtype=ops.xp.float32)


def sigmoid(xp: Any, x: Any) -> Any:
    return 1 / (1 + xp.exp(-x))


def silu(xp: Any, x: Any) -> Any:
    return x * sigmoid(xp, x)


def grouped_rms_norm(ops: Ops, x: Any, weight: Any, eps: float) -> Any:
    """RMS norm of each stream of ``x [T, n, D]`` times ``weight [n, D]``."""
    return ops.rms_norm(x, None, eps) * weight


class GatedDeltaNet:
    """Gated delta-net (spec §4.5): projections, short conv + SiLU, L2-normed q/k, delta rule, gated norm.

    Value heads are in the converter's tiled order, so value head ``j`` reads key head ``j mod nk``.
    """

    def __init__(self, w: WeightLoader, blk: str, cfg: Qwen38Config, ops: Ops):
        D, nv, dv = cfg.hidden_size, cfg.ssm_value_heads, cfg.ssm_value_dim
        self.cfg = cfg
        self.attn_qkv = w.get(f"{blk}.attn_qkv.weight", (cfg.conv_dim, D), MATMUL)
        self.attn_gate = w.get(f"{blk}.attn_gate.weight", (nv * dv, D), MATMUL)
        self.ssm_beta = w.get(f"{blk}.ssm_beta.weight", (nv, D), FLOAT)
        self.ssm_alpha = w.get(f"{blk}.ssm_alpha.weight", (nv, D), FLOAT)
        self.ssm_a = small(w, ops, f"{blk}.ssm_a", (nv,))
        self.ssm_dt = small(w, ops, f"{blk}.ssm_dt.bias", (nv,))
        self.ssm_conv1d = w.get(f"{blk}.ssm_conv1d.weight", (cfg.conv_dim, cfg.conv_kernel), NORM)
        self.ssm_norm = w.get(f"{blk}.ssm_norm.weight", (dv,), NORM)
        self.ssm_out = w.get(f"{blk}.ssm_out.weight", (D, nv * dv), MATMUL)

    def __call__(self, ops: Ops, x: Any, ls: DeltaNetState) -> Any:
        """``x [T, D]`` -> ``[T, D]``; advances ``ls.conv`` and ``ls.memory`` in place."""
        cfg, xp, T = self.cfg, ops.xp, x.shape[0]
        nk, dk, nv, dv = cfg.ssm_key_heads, cfg.ssm_key_dim, cfg.ssm_value_heads, cfg.ssm_value_dim
        mixed, conv = ops.short_conv(ops.linear(x, self.attn_qkv), ls.conv, self.ssm_conv1d)
        mixed = silu(xp, mixed)
        q = mixed[:, :nk * dk].reshape(T, nk, dk)
        k = mixed[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
        v = mixed[:, 2 * nk * dk:].reshape(T, nv, dv)
        q = q / xp.sqrt(xp.sum(q * q, axis=-1, keepdims=True) + np.float32(1e-6)) * np.float32(dk ** -0.5)
        k = k / xp.sqrt(xp.sum(k * k, axis=-1, keepdims=True) + np.float32(1e-6))
        q, k = xp.tile(q, (1, nv // nk, 1)), xp.tile(k, (1, nv // nk, 1))
        beta = sigmoid(xp, ops.linear(x, self.ssm_beta))
        log_decay = self.ssm_a * xp.logaddexp(0, ops.linear(x, self.ssm_alpha) + self.ssm_dt)  # ssm_a = −exp(A_log)
        rule = ops.gated_delta_rule_chunked if T > 1 else ops.gated_delta_rule
        o, memory = rule(q, k, v, log_decay.astype(xp.float32), beta, ls.memory)
        ls.conv[...], ls.memory[...] = conv, memory
        z = ops.linear(x, self.attn_gate).reshape(T, nv, dv)
        gate = sigmoid(xp, z) if cfg.output_gate == "sigmoid" else silu(xp, z)
        o = ops.rms_norm(o, self.ssm_norm, cfg.rms_norm_eps) * gate
        return ops.linear(o.reshape(T, nv * dv), self.ssm_out)


class GatedAttention:
    """Gated GQA attention with q/k norms, partial RoPE, a sigmoid output gate and QSA block selection (§4.6–4.8)."""

    def __init__(self, w: WeightLoader, blk: str, cfg: Qwen38Config, ops: Ops):
        D, H, G, hd, ni, di = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_heads,
                               cfg.index_dim)
        self.cfg = cfg
        self.attn_q = w.get(f"{blk}.attn_q.weight", (H * 2 * hd, D), MATMUL)  # per head: [query | gate]
        self.attn_k = w.get(f"{blk}.attn_k.weight", (G * hd, D), MATMUL)
        self.attn_v = w.get(f"{blk}.attn_v.weight", (G * hd, D), MATMUL)
        self.attn_output = w.get(f"{blk}.attn_output.weight", (D, H * hd), MATMUL)
        self.attn_q_norm = w.get(f"{blk}.attn_q_norm.weight", (hd,), NORM)
        self.attn_k_norm = w.get(f"{blk}.attn_k_norm.weight", (hd,), NORM)
        self.index_q = w.get(f"{blk}.indexer.q_proj.weight", (ni * di, D), FLOAT)
        self.index_k = w.get(f"{blk}.indexer.k_proj.weight", (di, D), FLOAT)
        self.index_q_norm = w.get(f"{blk}.indexer.q_norm.weight", (di,), NORM)
        self.index_k_norm = w.get(f"{blk}.indexer.k_norm.weight", (di,), NORM)
        self.inv_freq = ops.backend.asarray(cfg.inv_freq())
        self.ratio = cfg.index_ratio
        self.block_topk = cfg.index_budget // self.ratio

    def select(self, ops: Ops, x: Any, pos: Any, ls: AttentionState, n: int) -> Any:
        """Visibility mask ``[T, n]`` (bool) of the chunk's queries over the first ``n`` positions.

        Causal; and once a query sees more complete blocks of ``ratio`` tokens than ``budget / ratio``, only
        its top-scoring blocks plus the open tail (the tokens after its last complete block) stay visible. Blocks
        a query has not completed never compete (their pooled keys may mix in rows past it), so ``n`` may reach
        past the chunk, up to the whole cache.
        """
        cfg, xp, T, r = self.cfg, ops.xp, x.shape[0], self.ratio
        keys = xp.arange(n)
        visible = keys[None, :] <= pos[:, None]
        n_blocks = n // r
        if n_blocks <= self.block_topk:  # no query has more complete blocks than the budget: dense
            return visible
        iq = ops.linear(x, self.index_q).reshape(T, cfg.index_heads, cfg.index_dim)
        iq = ops.rope_half(ops.rms_norm(iq, self.index_q_norm, cfg.rms_norm_eps), pos, self.inv_freq)
        pooled = ls.index_keys[:n_blocks * r].reshape(n_blocks, r, -1).mean(axis=1)
        starts = xp.arange(n_blocks, dtype=xp.int32) * r
        block_keys = ops.rope_half(ops.rms_norm(pooled, self.index_k_norm, cfg.rms_norm_eps), starts, self.inv_freq)
        heads = xp.ones((T, cfg.index_heads), dtype=xp.float32)
        scores = ops.indexer_scores(iq, block_keys, heads, cfg.index_dim ** -0.5)
        complete = (pos + 1) // r  # complete blocks each query sees
        blocks = xp.arange(n_blocks)
        scores = xp.where(blocks[None, :] < complete[:, None], scores, -xp.inf)
        chosen = ops.topk(scores, self.block_topk)
        chosen_ok = xp.take_along_axis(blocks[None, :] < complete[:, None], chosen, axis=1)
        kept = xp.zeros((T, n_blocks + 1), dtype=xp.bool_)  # the extra column absorbs unusable picks
        kept[xp.arange(T)[:, None], xp.where(chosen_ok, chosen, n_blocks)] = True
        block_of_key = xp.minimum(keys // r, n_blocks)
        in_tail = keys[None, :] >= (complete * r)[:, None]
        return visible & (in_tail | xp.take_along_axis(kept, xp.broadcast_to(block_of_key, (T, n)), axis=1))

    def __call__(self, ops: Ops, x: Any, pos: Any, ls: AttentionState, p0: int | None) -> Any:
        """``x [T, D]`` at positions ``pos [T]`` -> ``[T, D]``; writes ``ls`` at those positions.

        ``p0 = None`` (one token at a device position): the query reads the whole cache under a mask built from
        ``pos``, so every shape is fixed by the context; rows past ``pos`` are never visible."""
        cfg, xp, T = self.cfg, ops.xp, x.shape[0]
        H, G, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        qg = ops.linear(x, self.attn_q).reshape(T, H, 2 * hd)
        q = ops.rope_half(ops.rms_norm(qg[:, :, :hd], self.attn_q_norm, eps), pos, self.inv_freq)
        k = ops.rope_half(ops.rms_norm(ops.linear(x, self.attn_k).reshape(T, G, hd), self.attn_k_norm, eps), pos,
                          self.inv_freq)
        rows, n = (pos, ls.keys.shape[0]) if p0 is None else (slice(p0, p0 + T), p0 + T)
        ls.keys[rows] = k
        ls.values[rows] = ops.linear(x, self.attn_v).reshape(T, G, hd)
        ls.index_keys[rows] = ops.linear(x, self.index_k)
        mask = self.select(ops, x, pos, ls, n)
        o = ops.gqa_attention(q, ls.keys[:n], ls.values[:n], mask, hd ** -0.5).reshape(T, H * hd)
        return ops.linear(o * sigmoid(xp, qg[:, :, hd:].reshape(T, H * hd)), self.attn_output)


class MoE:
    """Softmax-routed SwiGLU experts plus a shared expert behind a scalar sigmoid gate (§4.9)."""

    def __init__(self, w: WeightLoader, blk: str, cfg: Qwen38Config):
        D, E, F, S = cfg.hidden_size, cfg.n_experts, cfg.expert_ffn, cfg.shared_ffn
        self.k, self.normalize = cfg.n_experts_used, cfg.expert_weights_norm
        self.ffn_gate_inp = w.get(f"{blk}.ffn_gate_inp.weight", (E, D), FLOAT)
        self.ffn_gate_exps = w.get(f"{blk}.ffn_gate_exps.weight", (E, F, D), EXPERT)
        self.ffn_up_exps = w.get(f"{blk}.ffn_up_exps.weight", (E, F, D), EXPERT)
        self.ffn_down_exps = w.get(f"{blk}.ffn_down_exps.weight", (E, D, F), EXPERT)
        self.ffn_gate_inp_shexp = w.get(f"{blk}.ffn_gate_inp_shexp.weight", (1, D), FLOAT)
        self.ffn_gate_shexp = w.get(f"{blk}.ffn_gate_shexp.weight", (S, D), MATMUL)
        self.ffn_up_shexp = w.get(f"{blk}.ffn_up_shexp.weight", (S, D), MATMUL)
        self.ffn_down_shexp = w.get(f"{blk}.ffn_down_shexp.weight", (D, S), MATMUL)

    def __call__(self, ops: Ops, x: Any) -> Any:
        """``x [T, D]`` -> ``[T, D]``."""
        routed, shared = ops.concurrently(lambda: self._routed(ops, x), lambda: self._shared(ops, x))
        return routed + shared

    def _routed(self, ops: Ops, x: Any) -> Any:
        idx, weights = ops.moe_route_softmax(ops.linear(x, self.ffn_gate_inp), self.k, self.normalize)
        return ops.moe_experts(x, self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps, idx, weights, 0.0)

    def _shared(self, ops: Ops, x: Any) -> Any:
        h = ops.swiglu(ops.linear(x, self.ffn_gate_shexp), ops.linear(x, self.ffn_up_shexp), 0.0)
        return sigmoid(ops.xp, ops.linear(x, self.ffn_gate_inp_shexp)) * ops.linear(h, self.ffn_down_shexp)


class PerLayerEmbedding:
    """PLE block (§4.4): n-gram embedding rows gate a value into every stream, plus a dilated causal conv."""

    def __init__(self, w: WeightLoader, blk: str, cfg: Qwen38Config, ops: Ops):
        n, D = cfg.hc_count, cfg.hidden_size
        E = cfg.ple_heads * cfg.ple_row_dim
        self.cfg = cfg
        self.ple_key = w.get(f"{blk}.ple_key.weight", (n * D, E), MATMUL)
        self.ple_value = w.get(f"{blk}.ple_value.weight", (D, E), MATMUL)
        for norm in ("ple_norm_key", "ple_norm_query", "ple_norm_conv"):
            setattr(self, norm, small(w, ops, f"{blk}.{norm}.weight", (n * D,)).reshape(n, D))
        self.ple_conv1d = w.get(f"{blk}.ple_conv1d.weight", (n * D, cfg.ple_conv_kernel), NORM)

    def __call__(self, ops: Ops, H: Any, emb: Any, ls: DeltaNetState) -> Any:
        """Streams ``H [T, n, D]`` and n-gram embeddings ``emb [T, E]`` -> the update to add to ``H``."""
        cfg, xp = self.cfg, ops.xp
        T, n, D = H.shape
        eps = cfg.rms_norm_eps
        key = grouped_rms_norm(ops, ops.linear(emb, self.ple_key).reshape(T, n, D), self.ple_norm_key, eps)
        query = grouped_rms_norm(ops, H, self.ple_norm_query, eps)
        g = xp.sum(key * query, axis=-1) / np.float32(np.sqrt(D))
        g = xp.sign(g) * xp.sqrt(xp.maximum(xp.abs(g), np.float32(1e-6)))  # signed square root
        gated = sigmoid(xp, g)[:, :, None] * ops.linear(emb, self.ple_value)[:, None, :]
        normed = grouped_rms_norm(ops, gated, self.ple_norm_conv, eps)
        conv, ls.ple_conv[...] = ops.short_conv(normed.reshape(T, n * D), ls.ple_conv, self.ple_conv1d,
                                                cfg.ngram_size)
        return gated + silu(xp, conv).reshape(T, n, D)
