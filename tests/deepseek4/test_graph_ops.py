"""The numpy op references of the DeepSeek V4 graph, checked against transformers' DeepSeek V4 modules (torch, CPU)."""

from __future__ import annotations

import types
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dsv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from ds4_model_deepseek4.config import DeepSeekV4Config  # noqa: E402
from transformers import DeepseekV4Config as HFConfig  # noqa: E402

from ds4_core import ops, ops_hc  # noqa: E402
from ds4_core.backend import Weight  # noqa: E402

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test's random data from its own name, not from the tests that ran before it in the same worker."""
    global RNG
    RNG = np.random.default_rng(zlib.crc32(request.node.name.encode()))


def W(a: np.ndarray) -> Weight:
    """A weight as the numpy backend holds it."""
    a = np.asarray(a, dtype=np.float32)
    return Weight("w", "F32", a.shape, a)


def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


FLASH_YARN = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0,
              "beta_slow": 1.0}


def hf_config(**kw) -> HFConfig:
    """transformers' default (Flash) config with Flash's YaRN scaling, shrunk where ``kw`` says."""
    return HFConfig(rope_scaling=FLASH_YARN, max_position_embeddings=1048576, **kw)


def ours_from_hf(hf: HFConfig) -> DeepSeekV4Config:
    """Our config with the RoPE fields of ``hf`` (other fields are placeholders)."""
    scaling = hf.rope_parameters["compress"]
    rd = int(hf.head_dim * hf.rope_parameters["main"]["partial_rotary_factor"])
    n = 4
    return DeepSeekV4Config(
        vocab_size=8, hidden_size=8, num_layers=1, context_length=16, num_heads=1, num_kv_heads=1,
        head_dim=hf.head_dim, value_dim=hf.head_dim, rope_dim=rd, q_lora_rank=4, o_lora_rank=4, o_groups=1,
        n_experts=2, n_experts_used=1, expert_ffn=4, n_shared_experts=1, n_hash_layers=0, sliding_window=4,
        index_n_heads=1, index_head_dim=max(rd, 16), index_topk=2, hc_mult=n, hc_sinkhorn_iters=2, hc_eps=1e-6,
        rope_theta=hf.rope_parameters["main"]["rope_theta"], compress_rope_theta=scaling["rope_theta"],
        yarn_factor=scaling["factor"], yarn_original_context=scaling["original_max_position_embeddings"],
        yarn_beta_fast=scaling["beta_fast"], yarn_beta_slow=scaling["beta_slow"], routed_scaling_factor=1.0,
        expert_weights_norm=True, rms_norm_eps=1e-6, compress_ratios=(4,), swiglu_limits=(10.0,))


# ---------------------------------------------------------------- RoPE


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_inverse_frequencies_match_transformers_flash(kind):
    hf = hf_config()  # Flash defaults: rd 64, theta 10000 / 160000, YaRN factor 16 over 65536
    ours = ours_from_hf(hf)
    expected = getattr(dsv4.DeepseekV4RotaryEmbedding(hf), f"{kind}_inv_freq").numpy()
    got = ours.main_inv_freq() if kind == "main" else ours.compress_inv_freq()
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_yarn_blends_only_the_middle_pairs():
    freqs = ours_from_hf(hf_config())
    base = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    ratio = freqs.compress_inv_freq() / base
    np.testing.assert_allclose(ratio[:16], 1, rtol=1e-6)  # pairs 0..15 keep the original frequency
    np.testing.assert_allclose(ratio[25:], 1 / 16, rtol=1e-6)  # pairs >= 25 are divided by the factor


def test_rope_matches_transformers_partial_interleaved():
    hf = hf_config()
    emb = dsv4.DeepseekV4RotaryEmbedding(hf)
    x = randn(7, 3, 512)
    pos = np.array([0, 1, 5, 127, 128, 4095, 70000], dtype=np.int32)
    cos, sin = emb(t(x), position_ids=t(pos[None].astype(np.int64)), layer_type="compress")
    expected = dsv4.apply_rotary_pos_emb(t(x)[None].transpose(1, 2), cos, sin).transpose(1, 2)[0].numpy()
    got = ops.rope(x, pos, emb.compress_inv_freq.numpy())
    np.testing.assert_allclose(got, expected, atol=2e-5)
    np.testing.assert_array_equal(got[..., :448], x[..., :448])


def test_rope_inverse_undoes_rope():
    x = randn(5, 2, 32)
    pos = np.arange(100, 105, dtype=np.int32)
    inv_freq = (10000.0 ** (-np.arange(0, 8, 2) / 8)).astype(np.float32)
    y = ops.rope(x, pos, inv_freq)
    assert not np.allclose(y, x)
    np.testing.assert_allclose(ops.rope(y, pos, inv_freq, inverse=True), x, atol=1e-5)


# ---------------------------------------------------------------- norms and projections


def test_rms_norm_matches_transformers_weighted_and_unweighted():
    x, w = randn(4, 64), randn(64)
    norm = dsv4.DeepseekV4RMSNorm(64, eps=1e-6)
    norm.weight.data = t(w)
    np.testing.assert_allclose(ops.rms_norm(x, W(w), 1e-6), norm(t(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    unweighted = dsv4.DeepseekV4UnweightedRMSNorm(eps=1e-6)(t(x)).numpy()
    np.testing.assert_allclose(ops.rms_norm(x, None, 1e-6), unweighted, rtol=1e-5, atol=1e-6)


def test_linear_and_embed_follow_the_torch_convention():
    x, w = randn(3, 16), randn(8, 16)
    expected = torch.nn.functional.linear(t(x), t(w)).numpy()
    np.testing.assert_allclose(ops.linear(x, W(w)), expected, rtol=1e-5, atol=1e-5)
    table = randn(10, 4)
    np.testing.assert_array_equal(ops.embed(W(table), np.array([3, 0, 3])), table[[3, 0, 3]])


def test_grouped_linear_matches_transformers():
    G, per_group, out = 2, 12, 5
    x, w = randn(3, G, per_group), randn(G * out, per_group)
    lin = dsv4.DeepseekV4GroupedLinear(per_group, G * out, G)
    lin.weight.data = t(w)
    expected = lin(t(x)[None]).detach()[0].numpy()
    np.testing.assert_allclose(ops.grouped_linear(x, W(w)), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- hyper-connections


def _hc_module(n: int, D: int, iters: int) -> tuple:
    hf = hf_config(hidden_size=D, hc_mult=n, hc_sinkhorn_iters=iters)
    mod = dsv4.DeepseekV4HyperConnection(hf)
    fn, base, scale = randn((2 + n) * n, n * D, scale=0.3), randn((2 + n) * n), 1 + randn(3, scale=0.3)
    mod.fn.data, mod.base.data, mod.scale.data = t(fn), t(base), t(scale)
    return mod, fn, base, scale


def test_hc_pre_matches_transformers():
    n, D = 4, 16
    mod, fn, base, scale = _hc_module(n, D, 20)
    S = randn(5, n, D)
    post, comb, collapsed = (a.detach()[0].numpy() for a in mod(t(S)[None]))
    c, got_post, got_comb = ops_hc.hc_pre(S, W(fn), W(scale), W(base), 20, 1e-6, 1e-6)
    np.testing.assert_allclose(c, collapsed, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_post, post, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_comb, comb, rtol=1e-5, atol=1e-6)


def test_sinkhorn_mixing_is_nearly_doubly_stochastic():
    n = 4
    _, fn, base, scale = _hc_module(n, 8, 20)
    S = randn(6, n, 8)
    _, _, comb = ops_hc.hc_pre(S, W(fn), W(scale), W(base), 20, 1e-6, 1e-6)
    _, _, one_pass = ops_hc.hc_pre(S, W(fn), W(scale), W(base), 1, 1e-6, 1e-6)
    assert (comb > 0).all()
    np.testing.assert_allclose(comb.sum(axis=-2), 1, atol=1e-5)  # the last pass normalises columns
    np.testing.assert_allclose(comb.sum(axis=-1), 1, atol=1e-2)
    assert np.abs(one_pass.sum(axis=-1) - 1).max() > 10 * np.abs(comb.sum(axis=-1) - 1).max()


def test_hc_post_applies_the_transposed_mixing():
    n, D = 3, 5
    S, y, post, comb = randn(2, n, D), randn(2, D), randn(2, n), randn(2, n, n)
    expected = np.empty_like(S)
    for tok in range(2):
        for k in range(n):
            expected[tok, k] = post[tok, k] * y[tok] + sum(comb[tok, i, k] * S[tok, i] for i in range(n))
    np.testing.assert_allclose(ops_hc.hc_post(S, y, post, comb), expected, rtol=1e-5, atol=1e-6)


def test_hc_head_matches_transformers():
    n, D = 4, 16
    hf = hf_config(hidden_size=D, hc_mult=n)
    mod = dsv4.DeepseekV4HyperHead(hf)
    fn, base, scale = randn(n, n * D, scale=0.3), randn(n), randn(1)
    mod.hc_fn.data, mod.hc_base.data, mod.hc_scale.data = t(fn), t(base), t(scale)
    S = randn(3, n, D)
    expected = mod(t(S)[None]).detach()[0].numpy()
    np.testing.assert_allclose(ops_hc.hc_head(S, W(fn), W(scale), W(base), 1e-6, 1e-6), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- attention, compressor, indexer


@pytest.mark.parametrize("T", [4, 300])  # 300 spans several query blocks of the reference
def test_sparse_attention_matches_transformers_eager_with_sinks(T):
    H, d, N, K = 3, 16, 9, 4
    q, kv, sinks = randn(T, H, d), randn(N, d), randn(H)
    idx = np.stack([RNG.permutation(N)[:K] for _ in range(T)]).astype(np.int32)
    idx[:, 1:][RNG.random((T, K - 1)) < 0.3] = -1  # distinct rows, at least one per query
    mask = np.full((T, N), -np.inf, dtype=np.float32)
    for row, picks in enumerate(idx):
        mask[row, picks[picks >= 0]] = 0
    module = types.SimpleNamespace(num_key_value_groups=H, sinks=t(sinks), training=False)
    key = t(kv)[None, None]
    expected, _ = dsv4.eager_attention_forward(module, t(q).transpose(0, 1)[None], key, key, t(mask)[None, None],
                                               scaling=d ** -0.5)
    got = ops.sparse_attention(q, kv, idx, W(sinks), d ** -0.5)
    np.testing.assert_allclose(got, expected[0].numpy(), rtol=1e-5, atol=1e-6)


def test_sparse_attention_of_a_query_that_sees_nothing_is_zero_with_sinks_and_nan_without(recwarn):
    q, kv = randn(2, 3, 8), randn(5, 8)
    idx = np.array([[-1, -1], [0, 3]], dtype=np.int32)
    with_sinks = ops.sparse_attention(q, kv, idx, W(randn(3)), 8 ** -0.5)
    without = ops.sparse_attention(q, kv, idx, None, 8 ** -0.5)
    np.testing.assert_array_equal(with_sinks[0], 0)
    assert np.isnan(without[0]).all() and np.isfinite(without[1]).all()
    assert not recwarn.list  # the empty softmax is the documented result, not a numpy warning


def test_softmax_pool_is_a_per_channel_softmax_and_ignores_minus_inf_slots():
    kv, gate = randn(3, 8, 6), randn(3, 8, 6)
    gate[0, :4] = -np.inf
    expected = (torch.softmax(t(gate), dim=1) * t(kv)).sum(dim=1).numpy()
    got = ops_hc.softmax_pool(kv, gate)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[0], ops_hc.softmax_pool(kv[:1, 4:], gate[:1, 4:])[0], rtol=1e-6)


def test_indexer_scores_match_transformers_scorer():
    T, nih, ih, R, D = 3, 8, 16, 7, 12
    hf = hf_config(hidden_size=D, index_n_heads=nih, index_head_dim=ih)
    scorer = dsv4.DeepseekV4IndexerScorer(hf)
    proj, x, q, keys = randn(nih, D), randn(T, D), randn(T, nih, ih), randn(R, ih)
    scorer.weights_proj.weight.data = t(proj)
    expected = scorer(t(q)[None], t(keys)[None], t(x)[None]).detach()[0].numpy()
    got = ops.indexer_scores(q, keys, ops.linear(x, W(proj)) * np.float32(nih ** -0.5), ih ** -0.5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_topk_orders_by_value_and_breaks_ties_toward_the_lowest_index():
    scores = np.array([[0.0, 2.0, 0.0, 2.0, 0.0, -np.inf], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=np.float32)
    np.testing.assert_array_equal(ops.topk(scores, 4), [[1, 3, 0, 2], [0, 1, 2, 3]])
    assert ops.topk(scores, 4).dtype == np.int32


# ---------------------------------------------------------------- MoE


def _moe_config(E: int, k: int, D: int, F: int, limit: float) -> HFConfig:
    return hf_config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=k, moe_intermediate_size=F,
                     swiglu_limit=limit, routed_scaling_factor=1.5, vocab_size=16)


def test_moe_route_matches_transformers_topk_router():
    E, k, D = 8, 3, 12
    router = dsv4.DeepseekV4TopKRouter(_moe_config(E, k, D, 4, 10.0))
    gate, bias, x = randn(E, D), randn(E), randn(6, D, scale=3)
    router.weight.data, router.e_score_correction_bias.data = t(gate), t(bias)
    _, weights, indices = router(t(x))
    idx, w = ops.moe_route(ops.linear(x, W(gate)), W(bias), k, 1.5)
    order = np.argsort(indices.numpy(), axis=1)
    np.testing.assert_array_equal(np.sort(idx, axis=1), np.take_along_axis(indices.numpy(), order, 1))
    np.testing.assert_allclose(np.take_along_axis(w, np.argsort(idx, axis=1), 1),
                               np.take_along_axis(weights.detach().numpy(), order, 1), rtol=1e-5)


def test_moe_route_hash_layer_uses_the_fixed_experts_with_learned_weights():
    E, k, D = 8, 2, 12
    router = dsv4.DeepseekV4HashRouter(_moe_config(E, k, D, 4, 10.0))
    gate, x = randn(E, D), randn(5, D, scale=3)
    table = np.stack([RNG.permutation(E)[:k] for _ in range(16)]).astype(np.int64)
    ids = np.array([3, 3, 0, 15, 7])
    router.weight.data, router.tid2eid.data = t(gate), t(table)
    _, weights, indices = router(t(x), t(ids))
    idx, w = ops.moe_route(ops.linear(x, W(gate)), None, k, 1.5, fixed_idx=table[ids])
    np.testing.assert_array_equal(idx, indices.numpy())
    np.testing.assert_allclose(w, weights.detach().numpy(), rtol=1e-5)


def test_moe_experts_match_transformers_with_the_clamp_active():
    E, k, D, F, limit = 6, 2, 12, 8, 0.5
    experts = dsv4.DeepseekV4Experts(_moe_config(E, k, D, F, limit))
    gate_up, down = randn(E, 2 * F, D), randn(E, D, F)
    experts.gate_up_proj.data, experts.down_proj.data = t(gate_up), t(down)
    x = randn(7, D)
    idx = np.stack([RNG.permutation(E)[:k] for _ in range(7)]).astype(np.int32)
    w = RNG.random((7, k)).astype(np.float32)
    expected = experts(t(x), t(idx.astype(np.int64)), t(w)).detach().numpy()
    got = ops.moe_experts(x, W(gate_up[:, :F]), W(gate_up[:, F:]), W(down), idx, w, limit)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    h = x @ gate_up[:, :F].transpose(0, 2, 1)
    assert (h > limit).any() and (np.abs(x @ gate_up[:, F:].transpose(0, 2, 1)) > limit).any()


def test_swiglu_clamps_gate_above_and_up_on_both_sides():
    gate = np.array([-3.0, 0.2, 5.0], dtype=np.float32)
    up = np.array([-5.0, 0.3, 5.0], dtype=np.float32)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    expected = [silu(-3.0) * -1.0, silu(0.2) * 0.3, silu(1.0) * 1.0]
    np.testing.assert_allclose(ops.swiglu(gate, up, 1.0), expected, rtol=1e-6)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_sigmoid_and_swiglu_of_very_negative_inputs_are_zero_without_warnings():
    x = np.array([-1000.0, -100.0, 0.0, 100.0], dtype=np.float32)
    np.testing.assert_array_equal(ops_hc.sigmoid(x), torch.sigmoid(t(x)).numpy())
    expected = torch.nn.functional.silu(t(x)).numpy() * 2
    np.testing.assert_allclose(ops.swiglu(x, np.full_like(x, 2.0), 0.0), expected, rtol=1e-6, atol=0)
    assert ops.swiglu(x, np.ones_like(x), 0.0)[0] == 0.0
