"""GLM 5.3 Flash decoding state: the KDA prefill form == the recurrence, chunked prefill == token by token,
snapshots (KDA state included), the pooled indexer's selection invariants, context limits and the metadata config."""

from __future__ import annotations

import numpy as np
import pytest
from ds4_model_glm5.next_config import ARCH, Glm5NextConfig
from ds4_model_glm5.next_model import Attention
from ds4_model_glm5.next_state import KdaState

from ds4_core.engine import Engine
from ds4_core.errors import ContextError, ModelConfigError
from ds4_core.ops_recurrent import DELTA_CHUNK, gated_delta_rule, gated_delta_rule_chunked


def _kda_inputs(rng: np.random.Generator, T: int, h: int = 3, dk: int = 8, dv: int = 6):
    """KDA-like inputs: unit-norm keys, scaled unit-norm queries, per-channel log-decays bounded in (-5, 0)."""
    q, k = rng.standard_normal((2, T, h, dk)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5).astype(np.float32)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, h, dv)).astype(np.float32)
    g = (-5 / (1 + np.exp(-2 * rng.standard_normal((T, h, dk))))).astype(np.float32)  # some near -5, some near 0
    beta = rng.uniform(0, 1, (T, h)).astype(np.float32)
    state = rng.standard_normal((h, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 5, DELTA_CHUNK + 7])
def test_core_chunked_delta_rule_equals_recurrence_with_kda_decays(T):
    """The prefill form the graph uses for T > 1 equals the decode form on KDA's per-channel decays."""
    args = _kda_inputs(np.random.default_rng(T), T)
    o_ref, s_ref = gated_delta_rule(*args)
    o, s = gated_delta_rule_chunked(*args)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def mixed_engine(next_converted):
    return Engine.load(next_converted("mixed", "f32"), backend="numpy", ctx=64)


def test_chunked_prefill_equals_token_by_token(mixed_engine):
    ids = np.random.default_rng(7).integers(0, mixed_engine.model.vocab_size, 45)
    whole = mixed_engine.new_session().feed(ids)
    session = mixed_engine.new_session()
    single = np.concatenate([session.feed(ids[i:i + 1]) for i in range(len(ids))])
    error = np.abs(whole - single).max() / np.abs(single).max()
    print(f"chunked vs token by token: max relative difference {error:.1e}")
    assert error <= 1e-4


def test_snapshot_restore_is_exact_including_kda_state(mixed_engine):
    rng = np.random.default_rng(8)
    prefix, suffix = rng.integers(0, mixed_engine.model.vocab_size, (2, 21))
    session = mixed_engine.new_session()
    session.feed(prefix)
    snap = session.snapshot()
    first = session.feed(suffix)
    kda_after = [ls.recurrent.copy() for ls in session.state.layers if isinstance(ls, KdaState)]
    session.feed(suffix)  # move further away, then come back
    session.restore(snap)
    assert session.tokens == list(prefix)
    again = session.feed(suffix)
    np.testing.assert_array_equal(again, first)
    kda_again = [ls.recurrent for ls in session.state.layers if isinstance(ls, KdaState)]
    assert kda_after and all(np.abs(a).max() > 0 for a in kda_after)
    for a, b in zip(kda_after, kda_again, strict=True):
        np.testing.assert_array_equal(a, b)
    session.restore(snap)  # the snapshot stays reusable
    np.testing.assert_array_equal(session.feed(suffix), first)


def test_pooled_indexer_reads_chosen_pools_and_the_open_pool(mixed_engine):
    """Every query reads whole complete pools (as many as the budget allows) plus its own open pool, nothing later."""
    cfg = mixed_engine.model.cfg
    P, budget = cfg.index_pool, cfg.index_topk // cfg.index_pool
    seen: list[np.ndarray] = []
    ops = mixed_engine.ops
    original = ops._kernels["sparse_attention"]
    ops._kernels["sparse_attention"] = lambda q, kv, idx, *a: (seen.append(np.array(idx)), original(q, kv, idx, *a))[1]
    try:
        ids = np.random.default_rng(9).integers(0, cfg.vocab_size, 30)
        session = mixed_engine.new_session()
        session.feed(ids[:13])
        session.feed(ids[13:])
    finally:
        ops._kernels["sparse_attention"] = original
    n_dsa = sum(isinstance(b.mixer, Attention) for b in mixed_engine.model.blocks)
    assert len(seen) == 2 * n_dsa
    for call, p0 in zip(seen, [0] * n_dsa + [13] * n_dsa, strict=True):
        for t, row in enumerate(call):
            p = p0 + t
            rows = set(row[row >= 0].tolist())
            tail = set(range(p - p % P, p + 1)) if (p + 1) % P else set()
            complete = rows - tail
            pools = {r // P for r in complete}
            assert max(rows) <= p and tail <= rows  # a just-completed pool competes like the others
            assert all((j + 1) * P - 1 <= p for j in pools), "a pool not yet complete was read"
            assert complete == {j * P + m for j in pools for m in range(P)}, "pools are read whole"
            assert len(pools) == min(budget, (p + 1) // P)
            assert len(row) == cfg.index_topk + P - 1


def test_context_overflow_is_a_clear_error(next_converted):
    session = Engine.load(next_converted("mixed", "f32"), backend="numpy", ctx=8).new_session()
    session.feed([1, 2, 3])
    with pytest.raises(ContextError, match="context"):
        session.feed(list(range(6)))


def test_config_metadata_round_trip_and_validation(mixed_engine):
    cfg = mixed_engine.model.cfg
    meta = {key: value for key, (value, _, _) in cfg.to_gguf_metadata().items()}
    assert Glm5NextConfig.from_metadata(meta) == cfg
    assert cfg.layer_types == (0, 0, 0, 1, 0, 1)  # K K K D K D
    with pytest.raises(ModelConfigError, match="layer_types"):
        Glm5NextConfig.from_metadata({**meta, f"{ARCH}.layer_types": [0, 1]})
    with pytest.raises(ModelConfigError, match="pool_size"):
        Glm5NextConfig.from_metadata({**meta, f"{ARCH}.attention.indexer.pool_size": 3})
    missing = dict(meta)
    del missing[f"{ARCH}.linear_attention.head_count"]
    with pytest.raises(ModelConfigError, match="re-convert"):
        Glm5NextConfig.from_metadata(missing)
