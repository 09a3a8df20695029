"""The GLM 5.3 Flash graph on the op vocabulary: mHC streams around KDA or NoPE sparse-MLA mixers and clamped MoE.

Ordered weights → KDA → pooled indexer → MLA attention → MLP/MoE → block → model. Attribute names follow
the GGUF tensor names (spec §10.3); shapes are numpy order (GGUF dims reversed). ``T`` is the chunk length,
``p0`` the position of its first token. A chunk of any length gives the same logits as its tokens fed one by
one: KDA carries its recurrence, and the indexer's pools are anchored at absolute positions.

:meth:`Glm5NextModel.decode_step` is the one-token form whose position lives only in a device array: every shape
is fixed by the context (attention reads the whole latent cache, the indexer scores every pool slot, both masked
by position), so the backend can record it once as a graph and replay it per token (``ds4_core.decode_graph``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4_core.backend import Ops, WeightLoader
from ds4_core.decode_graph import DecodeGraphs
from ds4_core.errors import ContextError, ModelConfigError

from .next_config import Glm5NextConfig
from .next_state import DsaState, Glm5NextState, KdaState, PoolState, new_state, state_nbytes

# GGML types each kind of tensor may have.
NORM = ("F32",)
FLOAT = ("F32", "F16", "BF16")
MATMUL = (*FLOAT, "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K")
EXPERT = (*MATMUL, "IQ2_XXS")
INDEXER_KEY_NORM_EPS = 1e-6


def _small(w: WeightLoader, ops: Ops, name: str, shape: tuple[int, ...]) -> Any:
    """A small float tensor used in glue arithmetic, as a backend array."""
    return ops.backend.asarray(w.array(name, shape=shape), dtype=ops.xp.float32)


def _sigmoid(xp: Any, x: Any) -> Any:
    return 1 / (1 + xp.exp(-x))


def _l2norm(xp: Any, x: Any) -> Any:
    """``x / sqrt(Σx² + 1e-6)`` over the last axis (the epsilon sits inside the root, as in KDA's reference)."""
    return (x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))).astype(xp.float32)


class Kda:
    """Kimi delta attention (spec §6.3): short convs, per-channel bounded decay, delta rule, gated RMS norm."""

    def __init__(self, w: WeightLoader, ops: Ops, blk: str, cfg: Glm5NextConfig):
        D, h, d, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv
        self.cfg = cfg
        for part in ("q", "k", "v"):
            setattr(self, f"kda_{part}", w.get(f"{blk}.kda_{part}.weight", (h * d, D), MATMUL))
        # The three depthwise convs as one [3·h·d, K] F32 tensor over the q|k|v channels (core short_conv layout).
        taps = np.concatenate([w.array(f"{blk}.kda_{part}_conv.weight", shape=(h * d, 1, K)).reshape(h * d, K)
                               for part in "qkv"])
        self.conv = ops.backend.upload(f"{blk}.kda_qkv_conv", "F32", taps.shape,
                                       np.ascontiguousarray(taps, dtype=np.float32).view(np.uint8).reshape(-1))
        self.kda_f_a = w.get(f"{blk}.kda_f_a.weight", (d, D), MATMUL)
        self.kda_f_b = w.get(f"{blk}.kda_f_b.weight", (h * d, d), MATMUL)
        self.kda_dt_bias = _small(w, ops, f"{blk}.kda_dt_bias.weight", (h * d,))
        self.decay_rate = ops.xp.exp(_small(w, ops, f"{blk}.kda_a_log.weight", (h,)))[:, None]
        self.kda_beta = w.get(f"{blk}.kda_beta.weight", (h, D), MATMUL)
        self.kda_g_a = w.get(f"{blk}.kda_g_a.weight", (d, D), MATMUL)
        self.kda_g_b = w.get(f"{blk}.kda_g_b.weight", (h * d, d), MATMUL)
        self.kda_o_norm = w.get(f"{blk}.kda_o_norm.weight", (d,), NORM)
        self.kda_output = w.get(f"{blk}.kda_output.weight", (D, h * d), MATMUL)

    def __call__(self, ops: Ops, x: Any, ls: KdaState) -> Any:
        """``x [T, D]`` (normalised collapsed stream) -> ``[T, D]``; advances ``ls`` in place (a recorded decode
        step keeps the addresses of its arrays)."""
        cfg, xp, T = self.cfg, ops.xp, x.shape[0]
        h, d = cfg.kda_heads, cfg.kda_head_dim
        u = xp.concatenate([ops.linear(x, self.kda_q), ops.linear(x, self.kda_k), ops.linear(x, self.kda_v)], axis=1)
        u, conv = ops.short_conv(u, ls.conv, self.conv)
        ls.conv[...] = conv
        q, k, v = (u * _sigmoid(xp, u)).reshape(T, 3, h, d).transpose(1, 0, 2, 3)  # SiLU after the conv
        q = _l2norm(xp, q) * np.float32(d ** -0.5)
        k = _l2norm(xp, k)
        raw = (ops.linear(ops.linear(x, self.kda_f_a), self.kda_f_b) + self.kda_dt_bias).reshape(T, h, d)
        g = (cfg.kda_lower_bound * _sigmoid(xp, self.decay_rate * raw)).astype(xp.float32)  # per key channel
        beta = _sigmoid(xp, ops.linear(x, self.kda_beta)).astype(xp.float32)
        recurrence = ops.gated_delta_rule if T == 1 else ops.gated_delta_rule_chunked
        o, recurrent = recurrence(q, k, v, g, beta, ls.recurrent)
        ls.recurrent[...] = recurrent
        gate = ops.linear(ops.linear(x, self.kda_g_a), self.kda_g_b).reshape(T, h, d)
        o = ops.rms_norm(o, self.kda_o_norm, cfg.rms_norm_eps) * _sigmoid(xp, gate)
        return ops.linear(o.reshape(T, h * d).astype(xp.float32), self.kda_output)


class PooledIndexer:
    """DSA indexer over pools of P tokens (spec §6.4): pooled keys compete, the query's open pool is always read."""

    def __init__(self, w: WeightLoader, ops: Ops, blk: str, cfg: Glm5NextConfig):
        D, nI, dI, P = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim, cfg.index_pool
        self.nI, self.dI, self.P, self.n_pools = nI, dI, P, cfg.index_topk // P
        self.attn_q_b = w.get(f"{blk}.indexer.attn_q_b.weight", (nI * dI, cfg.q_lora_rank), MATMUL)
        self.attn_k = w.get(f"{blk}.indexer.attn_k.weight", (dI, D), MATMUL)
        self.k_norm = w.get(f"{blk}.indexer.k_norm.weight", (dI,), NORM)
        self.k_norm_bias = w.get(f"{blk}.indexer.k_norm.bias", (dI,), NORM)
        self.proj = w.get(f"{blk}.indexer.proj.weight", (nI, D), FLOAT + MATMUL)
        self.pool_ape = _small(w, ops, f"{blk}.indexer.pool_ape.weight", (P, dI))
        self.pool_gate = w.get(f"{blk}.indexer.pool_gate.weight", (dI, D), MATMUL)

    def select(self, ops: Ops, x: Any, q_lat: Any, pos: Any, ps: PoolState, p0: int) -> Any:
        """Token rows each query reads, ``[T, index_topk + P − 1]`` int (``-1`` = none); pools what ``x`` completes.

        ``x [T, D]`` attention input, ``q_lat [T, q_lora]`` its normalised query latent, ``pos [T]`` positions.
        """
        xp, P, T = ops.xp, self.P, x.shape[0]
        keys, gates = self._keys(ops, x, pos)
        b = p0 % P  # tokens of the open pool already buffered
        keys = xp.concatenate([ps.open_keys[:b], keys])
        gates = xp.concatenate([ps.open_gates[:b], gates])
        first, n_new = p0 // P, (b + T) // P
        done = n_new * P
        if n_new:
            pooled = ops.softmax_pool(keys[:done].reshape(n_new, P, -1), gates[:done].reshape(n_new, P, -1))
            ps.pooled[first:first + n_new] = pooled
        rest = b + T - done
        ps.open_keys[:rest] = keys[done:]
        ps.open_gates[:rest] = gates[done:]
        return self._rows(ops, x, q_lat, pos, ps.pooled[:first + n_new])

    def step(self, ops: Ops, x: Any, q_lat: Any, pos: Any, ps: PoolState) -> Any:
        """:meth:`select` for one token at the device position ``pos [1]``: buffer it in open slot ``pos mod P``,
        store the pool when it completes one, and score every pool slot (slots not yet complete are masked)."""
        xp, P, slots = ops.xp, self.P, ps.pooled.shape[0]
        slot = pos % P
        ps.open_keys[slot], ps.open_gates[slot] = self._keys(ops, x, pos)
        if slots:  # pooled every step (no host branch); stored only when this token completes the pool
            pooled = ops.softmax_pool(ps.open_keys[None], ps.open_gates[None])
            j = xp.minimum(pos // P, slots - 1)  # a completed pool always lies inside the context
            ps.pooled[j] = xp.where((slot == P - 1)[:, None], pooled, ps.pooled[j])
        return self._rows(ops, x, q_lat, pos, ps.pooled)

    def _keys(self, ops: Ops, x: Any, pos: Any) -> tuple[Any, Any]:
        """(LayerNorm'd keys, gate logits with the pool APE) of ``x [T, D]`` at ``pos [T]``, each ``[T, dI]``."""
        keys = ops.layer_norm(ops.linear(x, self.attn_k), self.k_norm, self.k_norm_bias, INDEXER_KEY_NORM_EPS)
        return keys, ops.linear(x, self.pool_gate) + self.pool_ape[pos % self.P]

    def _rows(self, ops: Ops, x: Any, q_lat: Any, pos: Any, pooled: Any) -> Any:
        """The rows of :meth:`select` given the pool keys ``pooled [N, dI]``; pool j is complete for query t when
        ``j < (pos[t] + 1) // P`` (later slots may be stale or empty)."""
        xp, P, T = ops.xp, self.P, x.shape[0]
        visible = (pos + 1) // P  # complete pools query t may read: j < visible[t]
        total = pooled.shape[0]
        j = xp.arange(total, dtype=xp.int32)[None, :]
        if total > self.n_pools:
            q = ops.linear(q_lat, self.attn_q_b).reshape(T, self.nI, self.dI)
            head_w = ops.linear(x, self.proj) * np.float32(self.nI ** -0.5)
            scores = ops.indexer_scores(q, pooled, head_w, self.dI ** -0.5)
            scores = xp.where(j < visible[:, None], scores, -xp.inf)
            chosen = ops.topk(scores, self.n_pools)
        else:  # every complete pool fits the budget
            chosen = xp.broadcast_to(j, (T, total))
        chosen = xp.where(chosen < visible[:, None], chosen, -1)
        width = self.n_pools * P
        rows = (chosen[:, :, None] * P + xp.arange(P, dtype=xp.int32)).reshape(T, -1)
        rows = xp.where(xp.repeat(chosen >= 0, P, axis=1), rows, -1)
        rows = xp.concatenate([rows, xp.full((T, width - rows.shape[1]), -1, dtype=rows.dtype)], axis=1)
        tail = visible[:, None] * P + xp.arange(P - 1, dtype=xp.int32)[None, :]  # the open pool, up to the query
        tail = xp.where(tail <= pos[:, None], tail, -1)
        return xp.concatenate([rows, tail], axis=1).astype(xp.int32)


class Attention:
    """NoPE MLA over the latent cache (absorbed form), restricted to the indexer's rows (spec §6.4)."""

    def __init__(self, w: WeightLoader, ops: Ops, blk: str, cfg: Glm5NextConfig):
        D, H, dk, dv, R = cfg.hidden_size, cfg.num_heads, cfg.key_length, cfg.value_length, cfg.kv_lora_rank
        self.cfg = cfg
        self.attn_q_a = w.get(f"{blk}.attn_q_a.weight", (cfg.q_lora_rank, D), MATMUL)
        self.attn_q_a_norm = w.get(f"{blk}.attn_q_a_norm.weight", (cfg.q_lora_rank,), NORM)
        self.attn_q_b = w.get(f"{blk}.attn_q_b.weight", (H * dk, cfg.q_lora_rank), MATMUL)
        self.attn_kv_a_mqa = w.get(f"{blk}.attn_kv_a_mqa.weight", (R, D), MATMUL)
        self.attn_kv_a_norm = w.get(f"{blk}.attn_kv_a_norm.weight", (R,), NORM)
        self.attn_k_b = w.get(f"{blk}.attn_k_b.weight", (H, R, dk), MATMUL)
        self.attn_v_b = w.get(f"{blk}.attn_v_b.weight", (H, dv, R), MATMUL)
        self.attn_output = w.get(f"{blk}.attn_output.weight", (D, H * dv), MATMUL)
        self.indexer = PooledIndexer(w, ops, blk, cfg) if w.has(f"{blk}.indexer.attn_k.weight") else None

    def __call__(self, ops: Ops, x: Any, pos: Any, ls: DsaState, p0: int | None, shared_rows: Any) -> tuple[Any, Any]:
        """``x [T, D]`` at positions ``pos`` -> (``[T, D]``, the rows read); ``shared_rows`` is the selection of
        the latest block with an indexer, used when this block has none. Advances ``ls``.

        ``p0 = None``: one token whose position is only on the device (``pos [1]``), written at row ``pos``."""
        cfg, T = self.cfg, x.shape[0]
        eps = cfg.rms_norm_eps
        q_lat = ops.rms_norm(ops.linear(x, self.attn_q_a), self.attn_q_a_norm, eps)
        q = ops.linear(q_lat, self.attn_q_b).reshape(T, cfg.num_heads, cfg.key_length)
        latent = ops.rms_norm(ops.linear(x, self.attn_kv_a_mqa), self.attn_kv_a_norm, eps)
        if p0 is None:
            ls.latent[pos] = latent
        else:
            ls.latent[p0:p0 + T] = latent
        if self.indexer is not None:
            if p0 is None:
                rows = self.indexer.step(ops, x, q_lat, pos, ls.pool)
            else:
                rows = self.indexer.select(ops, x, q_lat, pos, ls.pool, p0)
        elif shared_rows is None:
            raise ModelConfigError("a DSA block without indexer tensors must follow a block with an indexer; the "
                                   "GGUF is inconsistent — re-convert the model")
        else:
            rows = shared_rows
        q_abs = ops.grouped_linear(q, self.attn_k_b)  # [T, H, R]: queries against the latent
        # the whole cache: rows list only positions already written, and a fixed shape keeps a step recordable
        o = ops.sparse_attention(q_abs, ls.latent, rows, None, cfg.key_length ** -0.5)
        o = ops.grouped_linear(o, self.attn_v_b)  # [T, H, dv]
        return ops.linear(o.reshape(T, -1), self.attn_output), rows


class FeedForward:
    """Clamped SwiGLU: a dense MLP (leading blocks) or sigmoid-routed experts plus a shared expert (spec §4.2)."""

    def __init__(self, w: WeightLoader, ops: Ops, blk: str, cfg: Glm5NextConfig, dense: bool):
        D, E, F = cfg.hidden_size, cfg.n_experts, cfg.expert_ffn
        self.cfg, self.dense = cfg, dense
        if dense:
            self.ffn_gate = w.get(f"{blk}.ffn_gate.weight", (cfg.ffn, D), MATMUL)
            self.ffn_up = w.get(f"{blk}.ffn_up.weight", (cfg.ffn, D), MATMUL)
            self.ffn_down = w.get(f"{blk}.ffn_down.weight", (D, cfg.ffn), MATMUL)
            return
        Fs = F * cfg.n_shared_experts
        self.ffn_gate_inp = w.get(f"{blk}.ffn_gate_inp.weight", (E, D), FLOAT)
        self.exp_probs_b = w.optional(f"{blk}.exp_probs_b.bias", (E,), NORM)
        self.ffn_gate_exps = w.get(f"{blk}.ffn_gate_exps.weight", (E, F, D), EXPERT)
        self.ffn_up_exps = w.get(f"{blk}.ffn_up_exps.weight", (E, F, D), EXPERT)
        self.ffn_down_exps = w.get(f"{blk}.ffn_down_exps.weight", (E, D, F), EXPERT)
        self.ffn_gate_shexp = w.get(f"{blk}.ffn_gate_shexp.weight", (Fs, D), MATMUL)
        self.ffn_up_shexp = w.get(f"{blk}.ffn_up_shexp.weight", (Fs, D), MATMUL)
        self.ffn_down_shexp = w.get(f"{blk}.ffn_down_shexp.weight", (D, Fs), MATMUL)

    def __call__(self, ops: Ops, x: Any) -> Any:
        """``x [T, D]`` -> ``[T, D]``."""
        cfg, L = self.cfg, self.cfg.swiglu_limit
        if self.dense:
            return ops.linear(ops.swiglu(ops.linear(x, self.ffn_gate), ops.linear(x, self.ffn_up), L), self.ffn_down)
        idx, weights = ops.moe_route_sigmoid(ops.linear(x, self.ffn_gate_inp), self.exp_probs_b, cfg.n_experts_used,
                                             cfg.routed_scaling_factor, cfg.n_expert_groups,
                                             cfg.n_expert_groups_used, cfg.expert_weights_norm)
        routed = ops.moe_experts(x, self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps, idx, weights, L)
        h = ops.swiglu(ops.linear(x, self.ffn_gate_shexp), ops.linear(x, self.ffn_up_shexp), L)
        return routed + ops.linear(h, self.ffn_down_shexp)


class Block:
    """One trunk block: a hyper-connection site around the mixer (KDA or DSA), then one around the MLP."""

    def __init__(self, w: WeightLoader, ops: Ops, block: int, cfg: Glm5NextConfig):
        blk, n, D = f"blk.{block}", cfg.hc_mult, cfg.hidden_size
        self.cfg = cfg
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", w.get(f"{blk}.hc_{sub}_fn.weight", ((2 + n) * n, n * D), FLOAT))
            setattr(self, f"hc_{sub}_scale", w.get(f"{blk}.hc_{sub}_scale.weight", (3,), NORM))
            setattr(self, f"hc_{sub}_base", w.get(f"{blk}.hc_{sub}_base.weight", ((2 + n) * n,), NORM))
        self.attn_norm = w.get(f"{blk}.attn_norm.weight", (D,), NORM)
        self.ffn_norm = w.get(f"{blk}.ffn_norm.weight", (D,), NORM)
        self.mixer = Attention(w, ops, blk, cfg) if cfg.is_dsa(block) else Kda(w, ops, blk, cfg)
        self.ffn = FeedForward(w, ops, blk, cfg, cfg.is_dense(block))

    def __call__(self, ops: Ops, S: Any, pos: Any, ls: Any, p0: int | None, rows: Any) -> tuple[Any, Any]:
        """Streams ``S [T, n, D]`` -> (``[T, n, D]``, the latest indexer selection); ``p0 = None``: one token at
        the device position ``pos``."""
        cfg = self.cfg
        hc = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        x, post, comb = ops.hc_pre(S, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, *hc)
        x = ops.rms_norm(x, self.attn_norm, cfg.rms_norm_eps)
        if isinstance(self.mixer, Attention):
            y, rows = self.mixer(ops, x, pos, ls, p0, rows)
        else:
            y = self.mixer(ops, x, ls)
        S = ops.hc_post(S, y, post, comb)
        x, post, comb = ops.hc_pre(S, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, *hc)
        return ops.hc_post(S, self.ffn(ops, ops.rms_norm(x, self.ffn_norm, cfg.rms_norm_eps)), post, comb), rows


class MtpBlock:
    """The multi-token-prediction block (spec §8): ``nextn.*`` projections and a plain DSA + MoE block without
    hyper-connections. Loaded so a drafter can reach it; the trunk never runs it."""

    def __init__(self, w: WeightLoader, ops: Ops, block: int, cfg: Glm5NextConfig):
        blk, D = f"blk.{block}", cfg.hidden_size
        self.nextn_eh_proj = w.get(f"{blk}.nextn.eh_proj.weight", (D, 2 * D), MATMUL)
        self.nextn_enorm = w.get(f"{blk}.nextn.enorm.weight", (D,), NORM)
        self.nextn_hnorm = w.get(f"{blk}.nextn.hnorm.weight", (D,), NORM)
        self.nextn_shared_head_norm = w.get(f"{blk}.nextn.shared_head_norm.weight", (D,), NORM)
        self.attn_norm = w.get(f"{blk}.attn_norm.weight", (D,), NORM)
        self.ffn_norm = w.get(f"{blk}.ffn_norm.weight", (D,), NORM)
        self.attn = Attention(w, ops, blk, cfg)
        self.ffn = FeedForward(w, ops, blk, cfg, dense=False)


class Glm5NextModel:
    """A loaded GLM 5.3 Flash model (satisfies :class:`ds4_core.model.Model`); ``mtp`` holds its MTP blocks."""

    family = "glm53"

    def __init__(self, w: WeightLoader, ops: Ops, cfg: Glm5NextConfig):
        D, V = cfg.hidden_size, cfg.vocab_size
        self.cfg, self.ops = cfg, ops
        self.vocab_size, self.max_context = V, cfg.context_length
        self.token_embd = w.get("token_embd.weight", (V, D), MATMUL)
        self.blocks = [Block(w, ops, b, cfg) for b in range(cfg.num_layers)]
        self.mtp = [MtpBlock(w, ops, b, cfg) for b in range(cfg.num_layers, cfg.block_count)]
        self.output_norm = w.get("output_norm.weight", (D,), NORM)
        self.output = w.get("output.weight", (V, D), MATMUL)
        self.indexed = tuple(isinstance(b.mixer, Attention) and b.mixer.indexer is not None for b in self.blocks)
        first_dsa = next((b for b in range(cfg.num_layers) if cfg.is_dsa(b)), None)
        if first_dsa is not None and not self.indexed[first_dsa]:
            raise ModelConfigError(f"the first DSA block ({first_dsa}) has no indexer tensors, so it has no selection "
                                   "to share; the GGUF is incomplete — re-convert the model")
        #: One-token forwards as recorded graphs, on backends that record them (else None: plain forwards).
        self.decode_graphs = DecodeGraphs(ops.backend, self.decode_step) if ops.backend.graphs else None

    def new_state(self, ctx: int) -> Glm5NextState:
        """Empty state for a context of ``ctx`` tokens."""
        return new_state(self.cfg, ctx, self.ops.xp, self.indexed)

    def state_nbytes(self, ctx: int) -> int:
        return state_nbytes(self.cfg, ctx, self.indexed)

    def forward(self, ids: Any, state: Glm5NextState, *, last_row: bool = False) -> Any:
        """Feed ids ``[T]`` (T ≥ 1) after the ``state.n_tokens`` tokens fed so far; return logits ``[T, V]`` (with
        ``last_row``, only the last position's ``[1, V]``: the head runs on that row alone)."""
        return self._feed(ids, state, logits=True, last_row=last_row)

    def hidden(self, ids: Any, state: Glm5NextState) -> Any:
        """Like :meth:`forward`, but return the trunk's final state ``[T, D]`` (the final norm of the streams' mean,
        which the LM head and the MTP block read)."""
        return self._feed(ids, state, logits=False)

    def decode_step(self, ids: Any, pos: Any, state: Glm5NextState) -> tuple[Any, Any]:
        """One token ``ids [1]`` at the position in the device array ``pos [1]`` -> (logits ``[1, V]``, trunk final
        state ``[1, D]``). Writes ``state``'s arrays in place but not ``state.n_tokens`` (the caller's job); takes
        no host decision on the position, so it can be recorded once and replayed."""
        h = self._run(ids, pos, state, None)
        return self.ops.linear(h, self.output), h

    def _feed(self, ids: Any, state: Glm5NextState, logits: bool, last_row: bool = False) -> Any:
        ops, xp = self.ops, self.ops.xp
        T, p0 = len(ids), state.n_tokens
        if T < 1:
            raise ContextError("forward needs at least one token")
        if p0 + T > state.ctx:
            raise ContextError(f"{p0 + T} tokens do not fit the context of {state.ctx}; start a new session "
                               "or load the model with a larger --ctx")
        if T == 1 and self.decode_graphs is not None:
            out = self.decode_graphs(int(ids[0]), p0, state)[0 if logits else 1]
            out = out.copy()  # the recorded buffer is overwritten by the next step
        else:
            out = self._run(ops.backend.asarray(ids, dtype=xp.int32), xp.arange(p0, p0 + T, dtype=xp.int32), state,
                            p0)
            if logits:
                out = ops.linear(out[-1:] if last_row else out, self.output)
        state.n_tokens = p0 + T
        return out

    def _run(self, ids: Any, pos: Any, state: Glm5NextState, p0: int | None) -> Any:
        """The trunk's final state ``[T, D]`` of ``ids [T]`` at ``pos [T]`` (``p0 = None``: one token whose position
        is only on the device); advances ``state``'s arrays."""
        ops, xp, cfg = self.ops, self.ops.xp, self.cfg
        S = xp.repeat(ops.embed(self.token_embd, ids)[:, None, :], cfg.hc_mult, axis=1)
        rows = None
        for block, ls in zip(self.blocks, state.layers, strict=True):
            S, rows = block(ops, S, pos, ls, p0, rows)
        return ops.rms_norm(S.mean(axis=1), self.output_norm, cfg.rms_norm_eps)  # S is float32 already
